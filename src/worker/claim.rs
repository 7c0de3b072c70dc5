//! The worker's claims: a poll's claim in a transaction of its own (its WAL written, not waited
//! for), the claim ahead at the end of a batch's transaction, the expiry of exhausted leases,
//! and giving claimed jobs that never started back to the queue.

use super::load::{ClaimedRow, ClaimedRows};
use super::sandbox;
use super::session::WORKER_TYPE;
use super::session::{logged, session_serves_bound_role, worker_transaction, BOUND_ROLE, BOUND_ROLE_MOVED};
use crate::jobs::lease;
use crate::pg::privilege::{as_extension_owner_found, set_for_this_transaction, with_worker_settings};
use crate::pg::settings;
use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

thread_local! {
    /// Jobs claimed at the end of the last batch's transaction and committed with it, to run at
    /// the next poll (see `claim_ahead`).
    pub(super) static CLAIMED_AHEAD: RefCell<Claimed> = RefCell::new(Claimed::default());
    /// Jobs leased to this worker whose enqueues' commits outlasted its wait for the hand-over,
    /// with their transactions (see `take_handed_job`).
    pub(super) static LATE_HANDOVERS: RefCell<Vec<((i64, Uuid), pg_sys::TransactionId)>> = const { RefCell::new(Vec::new()) };
    /// When this worker last ended exhausted leases (see `claim_batch`).
    pub(super) static LAST_EXPIRY: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The claim of a poll: (enqueuer, (job, lease token)) in claim order, and what the claim
/// returned of the jobs of the batch that runs first, to run them without reading them again
/// (`execution::ClaimedRow`; see `claim_batch`).
#[derive(Default)]
pub(super) struct Claimed {
    pub(super) jobs: Vec<(String, (i64, Uuid))>,
    pub(super) rows: ClaimedRows,
    /// When the claim started: its leases are no younger.
    pub(super) claimed_at: Option<Instant>,
}

/// How often a worker ends exhausted leases as `lease_expired` (`lease::expire_exhausted_leases`).
pub(super) const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// Claims up to a batch of jobs for this worker in the current transaction, after ending
/// exhausted leases when that is due; also tells whether it ended any. None, claiming nothing,
/// unless the extension is at this library's version (`extension_ready`'s check, whose read of
/// the extension's row the claim then uses: one read, under one change of settings).
pub(super) fn claim_batch(worker_id: &str, lease_seconds: i32) -> Option<(Claimed, bool)> {
    let claimed_at = Some(Instant::now());
    let batch = settings::CLAIM_BATCH_SIZE.get();
    let expiry_due = LAST_EXPIRY.with(|last| last.get().is_none_or(|at| at.elapsed() >= EXPIRE_EVERY));
    let (extension, jobs, expired) = with_worker_settings(|| {
        let found = crate::pg::privilege::installed_at_library_version()?;
        if !session_serves_bound_role() {
            BOUND_ROLE_MOVED.set(true);
            return None;
        }
        let expired = if expiry_due { lease::expire_exhausted_leases() } else { 0 };
        // Due again at the next poll while a call finds a full batch of them (after a crash);
        // otherwise counted from here even if the transaction fails: retried a second later.
        if expiry_due && expired < lease::EXPIRE_BATCH {
            LAST_EXPIRY.with(|last| last.set(Some(Instant::now())));
        }
        Some((
            found.extension,
            as_extension_owner_found(&found, |installed| {
                lease::claim_jobs(installed, worker_id, None, None, lease_seconds, true, batch)
            }),
            expired,
        ))
    })?;
    let order = jobs.iter().map(|job| (job.enqueued_by.clone(), (job.job_id, job.lease_token))).collect();
    // Rows are kept for the batch that runs first only, and only when it runs in this session:
    // the first enqueuer's jobs. A batch after it starts once others ran, when the expiry the
    // claim returned may be out of date (renewals), and a runner reads its jobs itself.
    let runs_first_here = jobs
        .first()
        .map(|job| job.enqueued_by.clone())
        .filter(|role| BOUND_ROLE.with(|bound| bound.borrow().as_ref().is_none_or(|bound| bound == role)));
    let rows = jobs
        .into_iter()
        .filter(|job| runs_first_here.as_ref() == Some(&job.enqueued_by))
        .map(ClaimedRow::of)
        .collect();
    Some((Claimed { jobs: order, rows: ClaimedRows { extension, rows }, claimed_at }, expired > 0))
}

/// Claims the next batch in the transaction of the batch that ran last, when the queue had a
/// full batch for the last claim: its leases commit with that batch's outcome, so a busy worker
/// pays one durable commit per batch instead of two, and the claim still commits before any of
/// its handlers starts. In a subtransaction: a claim that fails costs the batch nothing.
pub(super) fn claim_ahead(worker_id: &str, lease_seconds: i32) -> Claimed {
    let mut claimed = Claimed::default();
    // A shutdown under way: the claim's lock waits and interrupt checks could only cost the
    // batch before it its commit.
    if !settings::WORKER_ENABLED.get() || unsafe { pg_sys::ProcDiePending } != 0 {
        return claimed;
    }
    if let Err(error) = sandbox::in_subtransaction(|| {
        // The version is asked again here: under a steady load no poll claims on its own, and a
        // schema of another version is left alone (see `extension_ready`).
        if let Some((ahead, _)) = claim_batch(worker_id, lease_seconds) {
            claimed = ahead;
        }
        true
    }) {
        log!(
            "{WORKER_TYPE}: claiming the next batch ahead failed with SQLSTATE {}; rolled back alone",
            error.sqlstate()
        );
        // Its release can fail after the claim returned (another extension's callback): the
        // jobs were never ours, and running them from the claim's rows would run others' jobs.
        return Claimed::default();
    }
    claimed
}

/// A poll's claim, in a transaction of its own that commits without waiting for its WAL to
/// reach the disk, a flush less between an enqueue and its handler while claims come less than
/// `wal_writer_delay` apart: the claim's WAL is written to the operating system before any of
/// its handlers starts (and flushed when `wal_writer_delay` has passed since this worker's last
/// flush), so a crash of PostgreSQL, a handler that takes its backend down included, keeps the
/// attempt counted. Only an operating system crash before the WAL writer flushes it (within
/// three `wal_writer_delay`s) can undo the claim: the job is then available again, the attempt
/// uncounted, and nothing of the interrupted run committed, since the run's durable commit
/// flushes the claim's WAL first. A transaction that ended exhausted leases (their waiters are
/// told at once) commits as configured, as does every claim when synchronous standbys are
/// configured (a failover must not lose it).
pub(super) fn claim_in_own_transaction(worker_id: &str, lease_seconds: i32) -> Option<Claimed> {
    let claimed = BackgroundWorker::transaction(|| {
        let (claimed, expired) = claim_batch(worker_id, lease_seconds)?;
        let without_waiting = !expired && !settings::synchronous_standbys_configured();
        if without_waiting {
            // The transaction's own commit reads it, then it is undone.
            unsafe { set_for_this_transaction(c"synchronous_commit", c"off") };
        }
        Some((claimed, without_waiting))
    });
    claimed.map(|(claimed, without_waiting)| {
        if without_waiting && !claimed.jobs.is_empty() {
            write_wal_up_to(unsafe { pg_sys::XactLastCommitEnd });
        }
        claimed
    })
}

/// Writes the WAL up to `commit_end` (the end of a commit record) to the operating system, as
/// the WAL writer does for asynchronous commits (it flushes now and then: when
/// `wal_writer_delay` has passed since its last flush in this process); when the WAL not yet
/// flushed crosses into that commit's page, it would write only the pages before, so the commit
/// is flushed at once instead, as a synchronous commit's.
pub(super) fn write_wal_up_to(commit_end: pg_sys::XLogRecPtr) {
    unsafe {
        if pg_sys::GetXLogWriteRecPtr() >= commit_end {
            return;
        }
        let page_start = commit_end - commit_end % u64::from(pg_sys::XLOG_BLCKSZ);
        if page_start > pg_sys::GetFlushRecPtr(std::ptr::null_mut()) {
            pg_sys::XLogFlush(commit_end);
            return;
        }
        pg_sys::XLogBackgroundFlush();
        // It can stop short: at the last whole page when more WAL came since, or at the end of
        // the WAL buffers.
        if pg_sys::GetXLogWriteRecPtr() < commit_end {
            pg_sys::XLogFlush(commit_end);
        }
    }
}

/// Gives back jobs claimed ahead that will not run now (the worker was switched off).
pub(super) fn give_back_claimed_ahead(worker_id: &str) {
    let ahead = CLAIMED_AHEAD.with(|ahead| std::mem::take(&mut *ahead.borrow_mut()));
    let jobs: Vec<(i64, Uuid)> = ahead.jobs.into_iter().map(|(_, job)| job).collect();
    give_back(&jobs, worker_id);
}

/// Gives claimed jobs that never started back to the queue, with their attempts; one whose row
/// another session holds is left to its lease. Tried again while the job table is locked (what
/// may have kept them from running, a `LOCK TABLE` say: the statement waits for no row), for up
/// to a third of a lease; after that, or another error, they are left to their leases.
pub(super) fn give_back(jobs: &[(i64, Uuid)], worker_id: &str) {
    if jobs.is_empty() {
        return;
    }
    let lease_length = Duration::from_secs(settings::default_lease_seconds().max(1) as u64);
    let deadline = Instant::now() + lease_length / 3;
    loop {
        match worker_transaction(|| lease::release_unstarted(jobs, worker_id)) {
            Err(error) if error.sqlstate() == "55P03" && Instant::now() < deadline => {
                log!("{WORKER_TYPE}: giving jobs back waited for a lock past the lock timeout; trying again");
            }
            outcome => {
                logged("giving jobs back", outcome);
                return;
            }
        }
    }
}
