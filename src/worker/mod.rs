//! The background worker: poll, claim jobs whose kind has a handler, run them, repeat.
//!
//! Transaction 1 claims and commits the leases, so a crash after it loses nothing: a job is
//! claimed again once its lease expires (that commit waits for no flush, see
//! `claim_in_own_transaction`). (A busy worker claims its next batch at the end of
//! the transaction that runs the last batch, and commits it there: `claim_ahead`.) Then one
//! transaction per enqueuing role runs that role's handlers (see `execution`): in the worker's
//! own session for the role it is bound to, in a role runner's session of its own for any other
//! role (see `runner`).
//! No error stops the worker: a failed transaction is rolled back, logged and, for a batch,
//! run again job by job.

pub mod execution;
pub mod load;
pub mod runner;
pub mod sandbox;

use crate::jobs::direct_lease;
use crate::jobs::failure::FailureCode;
use crate::jobs::lease;
use crate::jobs::metrics::{self, Counter, Tally};
use crate::jobs::retention;
use crate::jobs::wakeup;
use crate::pg::privilege::{
    as_extension_owner_found, as_extension_owner_of, set_for_this_transaction, with_worker_settings, Binding,
};
use crate::pg::settings;
use execution::Completion;
use load::{ClaimedRow, ClaimedRows};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use runner::{TakenOver, RUNNER_TYPE};
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

pub const WORKER_TYPE: &str = "durable_jobs worker";

/// Registers `durable_jobs.worker_count` workers; called from _PG_init while preloading.
pub fn register_workers() {
    for number in 1..=settings::WORKER_COUNT.get() {
        BackgroundWorkerBuilder::new(&format!("{WORKER_TYPE} {number}"))
            .set_type(WORKER_TYPE)
            .set_library("durable_jobs")
            .set_function("durable_jobs_worker_main")
            .set_argument(Some(pg_sys::Datum::from(number)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(Some(Duration::from_secs(5)))
            .load();
    }
}

unsafe extern "C-unwind" {
    // PostgreSQL's own SIGTERM handler: it makes the next CHECK_FOR_INTERRUPTS exit, also in
    // the middle of a handler's statement, where pgrx's flag-only handler would wait for it.
    fn die(signal: std::ffi::c_int);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn durable_jobs_worker_main(argument: pg_sys::Datum) {
    let number = argument.value() as i32;
    start_session(&format!("{WORKER_TYPE} {number}"));
    wakeup::publish_worker(number);
    warn_if_runners_may_find_no_slot();
    log!("{WORKER_TYPE} {number} started");

    let worker_id = format!("durable_jobs-worker-{number}");
    let mut last_prune = Instant::now();
    let mut reported_enabled = None;
    let mut last_poll_found_job = false;
    loop {
        // Pruning waits for a poll that claims nothing ahead, so that it never delays jobs
        // whose leases already run.
        let prune_due = settings::RETENTION_PERIOD.get() > 0 && last_prune.elapsed() >= PRUNE_EVERY;
        // Nothing but a shutdown stops the worker: an error here (a cancel while idle, a claim
        // that hit lock_timeout) is logged, its transaction rolled back, and the loop goes on.
        let found_job = in_transaction_or_logged("poll", || {
            take_handed_job(number, &worker_id);
            pg_sys::check_for_interrupts!();
            // Cleared before the check: a SIGHUP from here on sets it again (see sleep_until_poll).
            unsafe { (&raw mut pg_sys::ConfigReloadPending).write_volatile(0) };
            if BackgroundWorker::sighup_received() {
                unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            }
            let enabled = settings::WORKER_ENABLED.get();
            // Before the report: a worker shown switched off holds no job it claimed ahead.
            if !enabled {
                give_back_claimed_ahead(&worker_id);
            }
            if reported_enabled != Some(enabled) {
                wakeup::set_worker_wakeable(number, enabled);
            }
            report_whether_enabled(enabled, &mut reported_enabled);
            // At claim_batch_size 1 any job fills a claim: after a poll that found nothing, one
            // job most likely came alone, and a claim ahead would only find nothing, once more
            // before the poll after it, and delay the job's commit.
            let may_claim_ahead = !prune_due && (last_poll_found_job || settings::CLAIM_BATCH_SIZE.get() > 1);
            enabled && poll_once(number, &worker_id, may_claim_ahead)
        })
        .unwrap_or(false);
        last_poll_found_job = found_job;
        if BOUND_ROLE_MOVED.get() {
            // Its handlers must not run in this session, and no other role's may (see `runner`).
            log!(
                "{WORKER_TYPE} {number}: the role its session is bound to was renamed, or dropped and \
                 created again; it restarts"
            );
            give_back_claimed_ahead(&worker_id);
            // Its runner would hold a slot until idle: the new worker may need one at once.
            runner::retire_runner(number);
            unsafe { pg_sys::proc_exit(1) };
        }
        let claimed_ahead = CLAIMED_AHEAD.with(|ahead| !ahead.borrow().jobs.is_empty());
        // Retention does not depend on whether jobs run: pruning goes on with the worker off.
        if prune_due && !claimed_ahead {
            in_transaction_or_logged("pruning", prune_finished_jobs);
            last_prune = Instant::now();
        }
        let statistics_due = report_statistics();
        // Jobs claimed ahead run next, whatever else this poll met.
        if found_job || claimed_ahead {
            continue;
        }
        if !in_transaction_or_logged("wait", || sleep_until_poll(number, statistics_due)).unwrap_or(true) {
            break;
        }
    }
    log!("{WORKER_TYPE} {number} stopped");
}

/// Sleeps until the latch is set (an enqueue's commit, a reload, a shutdown) or the poll interval
/// has passed, flushing on the way the statistics left pending when they fall due (a flush is
/// not a poll: it claims nothing and counts no idle poll). Asleep, worker `number` may be handed
/// a job by an enqueue (`direct_lease`), which it then runs as one claimed ahead. False when the
/// worker is to stop.
fn sleep_until_poll(number: i32, mut statistics_due: Option<Instant>) -> bool {
    let deadline = Instant::now() + settings::poll_interval();
    loop {
        // A reload whose latch a lock wait used up (lock waits reset the latch) is still due: a
        // worker switched off, which no enqueue wakes, would otherwise miss being switched on
        // until its poll interval ends.
        if unsafe { (&raw const pg_sys::ConfigReloadPending).read_volatile() } != 0 {
            return true;
        }
        let wake_at = statistics_due.map_or(deadline, |due| due.min(deadline));
        if settings::WORKER_ENABLED.get()
            && !direct_lease::fall_asleep(number, settings::default_lease_seconds())
        {
            return true;
        }
        let latch_set = wakeup::sleep_on_latch(wake_at.saturating_duration_since(Instant::now()));
        if BackgroundWorker::sigterm_received() {
            return false;
        }
        // The poll wakes it for enqueues (`take_handed_job`); a flush of statistics leaves it
        // asleep to them.
        if latch_set || Instant::now() >= deadline {
            return true;
        }
        statistics_due = report_statistics();
    }
}

/// Wakes worker `number` to enqueues (`direct_lease::wake_up`) and keeps the job one handed it,
/// if any, with the jobs claimed ahead, which this poll runs (its lease renewed first if a
/// quarter of it is gone: a worker restarted meanwhile). A job whose enqueue's commit outlasted
/// the worker's wait goes back to the queue, with its attempt, at the first poll after that
/// commit.
fn take_handed_job(number: i32, worker_id: &str) {
    LATE_HANDOVERS.with(|late| {
        late.borrow_mut().retain(|(job, transaction)| match direct_lease::transaction_ended(*transaction) {
            None => true,
            Some(committed) => {
                if committed {
                    give_back(std::slice::from_ref(job), worker_id);
                }
                false
            }
        })
    });
    let handed = match direct_lease::wake_up(number) {
        direct_lease::Handed::Nothing => return,
        direct_lease::Handed::Late(job, transaction) => {
            log!("{WORKER_TYPE} {number}: an enqueue's commit outlasted the wait for its job's hand-over; the job goes back to the queue once it commits");
            LATE_HANDOVERS.with(|late| late.borrow_mut().push((job, transaction)));
            return;
        }
        direct_lease::Handed::Job(handed) => handed,
    };
    // An enqueue that committed without waiting for its flush: its WAL reaches the operating
    // system before the handler starts, as a claim's does, so that a crash of PostgreSQL in the
    // handler cannot undo the job and its attempt.
    write_wal_up_to(handed.commit_end);
    if handed.leased_at.elapsed() > Duration::from_secs(handed.lease_seconds.max(1) as u64) / 4 {
        renew_after_rollback(&[handed.job], worker_id, handed.lease_seconds);
    }
    CLAIMED_AHEAD.with(|ahead| {
        let mut ahead = ahead.borrow_mut();
        ahead.jobs.push((handed.enqueued_by, handed.job));
        ahead.claimed_at = Some(ahead.claimed_at.map_or(handed.leased_at, |at| at.min(handed.leased_at)));
    });
}

/// Shows in pg_stat_activity whether this worker claims jobs, when that changes: how an operator
/// sees that a reload switching the worker off (or on) has reached it.
fn report_whether_enabled(enabled: bool, reported: &mut Option<bool>) {
    if *reported != Some(enabled) {
        let (state, activity) = if enabled {
            (pg_sys::BackendState::STATE_RUNNING, c"claiming jobs")
        } else {
            (pg_sys::BackendState::STATE_IDLE, c"switched off (durable_jobs.worker_enabled = off)")
        };
        unsafe { pg_sys::pgstat_report_activity(state, activity.as_ptr()) };
        *reported = Some(enabled);
    }
}

/// Logs a warning when `max_worker_processes` leaves no sure room for each worker's role runner
/// beside the workers, parallel query and logical replication, which any role can fill (a
/// parallel query is enough): a batch of a role other than a worker's own then waits for a slot.
fn warn_if_runners_may_find_no_slot() {
    let (processes, parallel) = unsafe { (pg_sys::max_worker_processes, pg_sys::max_parallel_workers) };
    let replication: i32 = unsafe {
        let value = pg_sys::GetConfigOption(c"max_logical_replication_workers".as_ptr(), true, false);
        if value.is_null() {
            0
        } else {
            std::ffi::CStr::from_ptr(value).to_str().unwrap_or("0").parse().unwrap_or(0)
        }
    };
    let needed = 2 * settings::WORKER_COUNT.get() + parallel + replication + 1;
    if processes < needed {
        warning!(
            "{WORKER_TYPE}: max_worker_processes = {processes} leaves no sure room for role runners; set it to at \
             least {needed} (2 x durable_jobs.worker_count + max_parallel_workers + max_logical_replication_workers + 1)"
        );
    }
}

/// Signal handlers, the connection, and the session settings of a worker or a role runner.
fn start_session(application_name: &str) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    unsafe { pg_sys::pqsignal(pg_sys::SIGTERM as i32, Some(die)) };
    BackgroundWorker::connect_worker_to_spi(Some(&settings::database()), settings::worker_role().as_deref());
    set_session_option(c"application_name", application_name);
    // The fences rely on READ COMMITTED's re-check of a row updated concurrently; under a
    // configured REPEATABLE READ default they would raise serialization failures instead.
    set_session_option(c"default_transaction_isolation", "read committed");
}

/// A role runner of worker `number`: runs the batches of one role the worker hands over, in this
/// session of its own, until it is retired or idle (see `runner`).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn durable_jobs_role_runner_main(argument: pg_sys::Datum) {
    let number = argument.value() as i32;
    start_session(&format!("{RUNNER_TYPE} {number}"));
    // Between batches (the runner sleeps a second at most): statistics are reported at the
    // top of its loop, after the worker was told the last batch is done.
    let between_batches = || {
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        report_statistics();
    };
    runner::serve_handovers(number, between_batches, |handover| {
        bind_session_to(&bound_role(&handover.role), None);
        let worker_id = format!("durable_jobs-worker-{}", handover.worker_number);
        let leases = in_transaction_or_logged("taking over a batch", || {
            BackgroundWorker::transaction(|| {
                if !extension_ready() {
                    return Err(TakenOver::Refused);
                }
                if !session_serves_bound_role() {
                    return Err(TakenOver::RefusedAndEnds);
                }
                let held =
                    |leases: &[(i64, Uuid)]| with_worker_settings(|| lease::held_leases(leases, &worker_id));
                Ok((held(&handover.batch), held(&handover.later)))
            })
        });
        let (batch, later) = match leases {
            Some(Ok(leases)) => leases,
            Some(Err(TakenOver::RefusedAndEnds)) => {
                log!("{RUNNER_TYPE}: its role was renamed, or dropped and created again; it ends");
                return TakenOver::RefusedAndEnds;
            }
            _ => return TakenOver::Refused,
        };
        // Leases lost before the runner took them count as the worker's would.
        let mut lost = Tally::default();
        for _ in batch.len()..handover.batch.len() {
            lost.count(Counter::Claimed);
            lost.count(Counter::Stale);
        }
        lost.publish();
        if !batch.is_empty() {
            run_batch(&batch, &later, &worker_id, handover.lease_seconds, false, None, false);
        }
        TakenOver::Ran
    });
}

thread_local! {
    /// When the statistics left pending by the last report are to be flushed, waiting for the
    /// shared entries' locks if need be.
    static STATISTICS_DUE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// How long counts may stay pending: a backend's idle loop leaves them up to ten seconds
/// (PGSTAT_IDLE_INTERVAL), as long as a role runner waits for work before it ends.
const STATISTICS_PENDING_AT_MOST: Duration = Duration::from_secs(1);

/// Hands this session's table and WAL counts to the cumulative statistics, which autovacuum
/// decides from: PostgreSQL reports a background worker's only when it exits. As a backend's
/// idle loop does (postgres.c): at most once a second and without waiting for a lock; what that
/// leaves pending is flushed, waiting, once due. Returns when that is, for the wait.
/// Between transactions only; an error is logged, not fatal to the worker. (PostgreSQL's
/// unforced report times itself by the last transaction's end, which stands still between
/// transactions: without the forced one, a runner waiting for work would never flush.)
fn report_statistics() -> Option<Instant> {
    if unsafe { pg_sys::IsTransactionOrTransactionBlock() } {
        return None;
    }
    let now = Instant::now();
    let force = STATISTICS_DUE.get().is_some_and(|due| now >= due);
    let pending =
        in_transaction_or_logged("reporting statistics", || unsafe { pg_sys::pgstat_report_stat(force) })
            .is_some_and(|pending_ms| pending_ms > 0);
    let due = match pending {
        false => None,
        true if force => Some(now + STATISTICS_PENDING_AT_MOST),
        true => STATISTICS_DUE.get().or(Some(now + STATISTICS_PENDING_AT_MOST)),
    };
    STATISTICS_DUE.set(due);
    due
}

/// Sets a setting for the worker's whole session, above what postgresql.conf, the database or
/// the role set.
fn set_session_option(name: &std::ffi::CStr, value: &str) {
    let value = std::ffi::CString::new(value).expect("no NUL");
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
}

/// Runs `f` and returns its result; when `f` raises an error (which aborts the transaction it
/// ran in, the commit included), rolls back, and returns the error's SQLSTATE. Called between
/// transactions only: it rolls back every level, also subtransactions an error left open (one
/// raised while a job's subtransaction was released), which AbortCurrentTransaction would
/// leave aborted with the transaction around them, failing every later poll.
fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(f())))
        .catch_others(|error| {
            sandbox::disarm_statement_timeout();
            unsafe {
                pg_sys::AbortOutOfAnyTransaction();
                // What the abort does not when the error came between transactions (postgres.c's
                // recovery does the same); a cancel that came during it would cancel the next
                // statement, not what it was meant for.
                pg_sys::LWLockReleaseAll();
                pg_sys::ConditionVariableCancelSleep();
                pg_sys::QueryCancelPending = 0;
            }
            Err(sandbox::sqlstate_of(&error))
        })
        .execute()
}

/// `in_transaction`, logging an error (its SQLSTATE, never its text, which may quote data).
fn in_transaction_or_logged<R>(what: &str, f: impl FnOnce() -> R) -> Option<R> {
    logged(what, in_transaction(f))
}

/// The result of `what`, or None once its error (the SQLSTATE, as `in_transaction` returns it)
/// is logged.
fn logged<R>(what: &str, outcome: Result<R, String>) -> Option<R> {
    match outcome {
        Ok(result) => Some(result),
        Err(sqlstate) => {
            log!("{WORKER_TYPE}: {what} failed with SQLSTATE {sqlstate}; rolled back");
            None
        }
    }
}

thread_local! {
    /// The role whose handlers this session runs: that of the first batch a worker ran, of the
    /// first hand-over a runner took.
    static BOUND_ROLE: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Whether this session was bound to `BOUND_ROLE`'s oid (`bind_session_to`): false while
    /// that role did not exist.
    static SESSION_BOUND: Cell<bool> = const { Cell::new(false) };
    /// Set by a claim that found the bound role's name naming another role now (renamed, or
    /// dropped and created again): the worker ends, to start again with a new session.
    static BOUND_ROLE_MOVED: Cell<bool> = const { Cell::new(false) };
    /// Jobs claimed at the end of the last batch's transaction and committed with it, to run at
    /// the next poll (see `claim_ahead`).
    static CLAIMED_AHEAD: RefCell<Claimed> = RefCell::new(Claimed::default());
    /// Jobs leased to this worker whose enqueues' commits outlasted its wait for the hand-over,
    /// with their transactions (see `take_handed_job`).
    static LATE_HANDOVERS: RefCell<Vec<((i64, Uuid), pg_sys::TransactionId)>> = const { RefCell::new(Vec::new()) };
    /// When this worker last ended exhausted leases (see `claim_batch`).
    static LAST_EXPIRY: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The claim of a poll: (enqueuer, (job, lease token)) in claim order, and what the claim
/// returned of the jobs of the batch that runs first, to run them without reading them again
/// (`execution::ClaimedRow`; see `claim_batch`).
#[derive(Default)]
struct Claimed {
    jobs: Vec<(String, (i64, Uuid))>,
    rows: ClaimedRows,
    /// When the claim started: its leases are no younger.
    claimed_at: Option<Instant>,
}

/// How often a worker ends exhausted leases as `lease_expired` (`lease::expire_exhausted_leases`).
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// Claims up to a batch of jobs for this worker in the current transaction, after ending
/// exhausted leases when that is due; also tells whether it ended any. None, claiming nothing,
/// unless the extension is at this library's version (`extension_ready`'s check, whose read of
/// the extension's row the claim then uses: one read, under one change of settings).
fn claim_batch(worker_id: &str, lease_seconds: i32) -> Option<(Claimed, bool)> {
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
fn claim_ahead(worker_id: &str, lease_seconds: i32) -> Claimed {
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
fn claim_in_own_transaction(worker_id: &str, lease_seconds: i32) -> Option<Claimed> {
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
fn write_wal_up_to(commit_end: pg_sys::XLogRecPtr) {
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
fn give_back_claimed_ahead(worker_id: &str) {
    let ahead = CLAIMED_AHEAD.with(|ahead| std::mem::take(&mut *ahead.borrow_mut()));
    let jobs: Vec<(i64, Uuid)> = ahead.jobs.into_iter().map(|(_, job)| job).collect();
    give_back(&jobs, worker_id);
}

/// One poll: claim up to `durable_jobs.claim_batch_size` jobs (or take those claimed ahead) and
/// run them, each in its own subtransaction, one commit per enqueuing role; `may_claim_ahead`
/// lets the last batch claim the next (`claim_ahead`). Returns whether any job was claimed.
fn poll_once(number: i32, worker_id: &str, may_claim_ahead: bool) -> bool {
    let lease_seconds = settings::default_lease_seconds();
    let ahead = CLAIMED_AHEAD.with(|ahead| std::mem::take(&mut *ahead.borrow_mut()));
    // Jobs claimed ahead or handed over by an enqueue; this poll's claim checks the bound role.
    let checked_by_claim = ahead.jobs.is_empty();
    let claimed =
        if checked_by_claim { claim_in_own_transaction(worker_id, lease_seconds) } else { Some(ahead) };
    match claimed {
        // Quietly wait for CREATE EXTENSION (or ALTER EXTENSION UPDATE).
        None => false,
        Some(claimed) if claimed.jobs.is_empty() => {
            metrics::count(Counter::IdlePolls);
            false
        }
        Some(Claimed { jobs, rows, claimed_at }) => {
            // When the leases of the claim's jobs that runners run or wait for were last renewed
            // in full (a renewal of some of them does not count).
            let mut renewal = runner::Renewal::since(claimed_at.unwrap_or_else(Instant::now), lease_seconds);
            let full = jobs.len() >= settings::CLAIM_BATCH_SIZE.get() as usize;
            let batches = batches_per_enqueuer(jobs);
            for (position, (role, batch)) in batches.iter().enumerate() {
                let later: Vec<(i64, Uuid)> =
                    batches[position + 1..].iter().flat_map(|(_, jobs)| jobs.iter().copied()).collect();
                let bound = bound_role(role);
                // Counted as claimed by the batch that runs it (`execution::run_jobs`): a job
                // given back is counted when it is claimed again.
                if *role == bound {
                    bind_session_to(role, Some(WORKER_TYPE));
                    // The last batch of a full claim claims the next one in its transaction.
                    let ahead = may_claim_ahead && full && later.is_empty();
                    let rows = (position == 0).then_some(&rows);
                    run_batch(batch, &later, worker_id, lease_seconds, ahead, rows, !checked_by_claim);
                } else {
                    run_batch_in_runner(number, role, batch, &later, worker_id, lease_seconds, &mut renewal);
                }
            }
            true
        }
    }
}

/// The role this session runs handlers for: its bound role, or `role` if it has none yet.
fn bound_role(role: &str) -> String {
    BOUND_ROLE.with(|bound| bound.borrow_mut().get_or_insert_with(|| role.to_owned()).clone())
}

/// Binds the session to its bound role's oid, and makes that role the session's user, before
/// the session runs its handlers (`privilege::bind_session_to_role`); tried again before each
/// of its batches while that role does not exist. A worker (`log_as`) whose login role is not a
/// superuser logs once that its handlers see that role as `session_user`.
fn bind_session_to(role: &str, log_as: Option<&str>) {
    if SESSION_BOUND.get() {
        return;
    }
    let binding = in_transaction_or_logged("binding the session to its role", || {
        BackgroundWorker::transaction(|| crate::pg::privilege::bind_session_to_role(role))
    });
    if let (Some(Binding::BoundLoginNotSuperuser), Some(who)) = (binding, log_as) {
        log!(
            "{who}: its login role (durable_jobs.worker_role) is not a superuser, so handlers see it as \
             session_user: give it no rights of its own"
        );
    }
    SESSION_BOUND.set(matches!(binding, Some(Binding::Bound | Binding::BoundLoginNotSuperuser)));
}

/// Whether this session still runs its bound role's handlers: while the role's name names the
/// role it was bound to (see `privilege::session_may_serve_named`); in a transaction.
fn session_serves_bound_role() -> bool {
    BOUND_ROLE
        .with(|bound| bound.borrow().as_deref().is_none_or(crate::pg::privilege::session_may_serve_named))
}

/// The claimed jobs grouped by the role that enqueued them, in claim order. Each group runs in a
/// transaction of its own, so that roles never share one: no transaction-level lock, statistic
/// or rerun of one role's job touches another role's.
fn batches_per_enqueuer(jobs: Vec<(String, (i64, Uuid))>) -> Vec<(String, Vec<(i64, Uuid)>)> {
    let mut batches: Vec<(String, Vec<(i64, Uuid)>)> = Vec::new();
    for (enqueuer, job) in jobs {
        match batches.iter_mut().find(|(role, _)| *role == enqueuer) {
            Some((_, batch)) => batch.push(job),
            None => batches.push((enqueuer, vec![job])),
        }
    }
    batches
}

/// Runs a batch of a role other than the worker's own in its role runner, in parts of what one
/// hand-over carries (the runner counts what it runs). While it waits, the worker
/// renews the leases of the claim's jobs still to run (a hand-over carries only so many). A part
/// that no runner could take goes back to the queue with its attempts, with the parts after it;
/// the log says why.
fn run_batch_in_runner(
    number: i32,
    role: &str,
    batch: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
    renewal: &mut runner::Renewal,
) {
    for (part, leases) in batch.chunks(runner::HANDOFF_JOBS).enumerate() {
        let start = part * runner::HANDOFF_JOBS;
        let following: Vec<(i64, Uuid)> =
            batch[start + leases.len()..].iter().chain(later).copied().collect();
        let renew = |leases: &[(i64, Uuid)]| {
            in_worker_transaction("renewing leases", || {
                lease::renew_leases(leases, worker_id, lease_seconds, true)
            })
            .is_some()
        };
        // A whole handler of the worker's own role may have run since the claim: the runner
        // takes over only live leases, and runs them from there.
        if renewal.is_due() && renew(&leases.iter().chain(&following).copied().collect::<Vec<_>>()) {
            renewal.done();
        }
        match runner::run_in_runner(number, role, leases, &following, lease_seconds, renew) {
            Ok(()) => {}
            Err(runner::NotRun::Lost) => {
                // What the runner committed it counted; the rest counts when it runs again.
                log!("{WORKER_TYPE}: a role runner ended while running a batch; its jobs are claimed again when their leases expire");
                // Its renewals of the jobs it carried but had not run went with its transaction.
                renew_after_rollback(&following, worker_id, lease_seconds);
                give_back(&batch[start + leases.len()..], worker_id);
                return;
            }
            Err(reason @ (runner::NotRun::NoSlot | runner::NotRun::Refused)) => {
                let why = if let runner::NotRun::Refused = reason {
                    "a role runner could not take a batch over (its transaction failed, logged; the extension \
                     is being updated; or its role was renamed)"
                } else {
                    "no role runner could start (no background worker slot free, see max_worker_processes, \
                     or it ended at start)"
                };
                log!("{WORKER_TYPE}: {why}; {} jobs go back to the queue", batch.len() - start);
                give_back(&batch[start..], worker_id);
                return;
            }
        }
    }
}

/// After a transaction that renewed leases failed (the worker's or its runner's): the jobs still
/// to run get their leases back, in a transaction of their own, before anything else runs, also
/// those that lapsed meanwhile and no one took.
fn renew_after_rollback(waiting: &[(i64, Uuid)], worker_id: &str, lease_seconds: i32) {
    if !waiting.is_empty() {
        in_worker_transaction("renewing leases", || {
            lease::renew_leases_after_rollback(waiting, worker_id, lease_seconds)
        });
    }
}

/// Gives claimed jobs that never started back to the queue, with their attempts; one whose row
/// another session holds is left to its lease. Tried again while the job table is locked (what
/// may have kept them from running, a `LOCK TABLE` say: the statement waits for no row), for up
/// to a third of a lease; after that, or another error, they are left to their leases.
fn give_back(jobs: &[(i64, Uuid)], worker_id: &str) {
    if jobs.is_empty() {
        return;
    }
    let lease_length = Duration::from_secs(settings::default_lease_seconds().max(1) as u64);
    let deadline = Instant::now() + lease_length / 3;
    loop {
        match worker_transaction(|| lease::release_unstarted(jobs, worker_id)) {
            Err(sqlstate) if sqlstate == "55P03" && Instant::now() < deadline => {
                log!("{WORKER_TYPE}: giving jobs back waited for a lock past the lock timeout; trying again");
            }
            outcome => {
                logged("giving jobs back", outcome);
                return;
            }
        }
    }
}

/// Runs `f` in a transaction of its own with the worker's settings; an error is logged and
/// rolled back (`in_transaction_or_logged`).
fn in_worker_transaction<R>(
    what: &str,
    f: impl FnOnce() -> R + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> Option<R> {
    logged(what, worker_transaction(f))
}

/// Runs `f` in a transaction of its own with the worker's settings; an error is rolled back and
/// returned (its SQLSTATE), as `in_transaction` does.
fn worker_transaction<R>(
    f: impl FnOnce() -> R + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> Result<R, String> {
    in_transaction(|| BackgroundWorker::transaction(|| with_worker_settings(f)))
}

/// Runs a claimed batch in one transaction; with `ahead`, that transaction claims the next batch
/// once this one is done (`claim_ahead`). If that transaction fails as a whole (an error
/// outside any one job's subtransaction, or at commit), nothing of it is kept and each job of a
/// larger batch is run again alone, so that the error stays with the job that caused it; a job
/// whose own transaction fails is failed with that error's code. `claimed_rows`: the jobs as the
/// claim that committed just before returned them; any run after the first reads them again.
/// With `check_bound_role` (jobs no claim of this poll took: handed over, or claimed ahead), the
/// transaction first checks, as a poll's claim does, that the session still serves its bound
/// role; if not, the jobs go back to the queue with their attempts, and the worker is to restart
/// (`BOUND_ROLE_MOVED`).
fn run_batch(
    jobs: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
    ahead: bool,
    claimed_rows: Option<&ClaimedRows>,
    check_bound_role: bool,
) {
    let run = |jobs: &[(i64, Uuid)], later: &[(i64, Uuid)], completion, ahead: bool, rows, check: bool| {
        in_transaction(|| {
            BackgroundWorker::transaction(|| {
                if check && !session_serves_bound_role() {
                    BOUND_ROLE_MOVED.set(true);
                    return None;
                }
                let tally = execution::run_jobs(jobs, later, worker_id, lease_seconds, completion, rows);
                let claimed = if ahead { claim_ahead(worker_id, lease_seconds) } else { Claimed::default() };
                Some((tally, claimed))
            })
        })
        // Kept only once committed: a claim rolled back with its transaction never happened.
        .map(|ran| {
            ran.map(|(tally, claimed)| {
                if !claimed.jobs.is_empty() {
                    CLAIMED_AHEAD.with(|ahead| *ahead.borrow_mut() = claimed);
                }
                tally
            })
        })
    };
    // The claim's leases from the job at `position` on, renewed after a transaction that failed
    // (it took its renewals with it); the job there too, whose failure is recorded fenced.
    let renew_from = |position: usize| {
        let waiting: Vec<(i64, Uuid)> = jobs[position..].iter().chain(later).copied().collect();
        renew_after_rollback(&waiting, worker_id, lease_seconds);
    };
    // A batch completes its jobs in one statement; one that finds a lease lost there runs again
    // with each job completed, fenced, right after its handler.
    let first = if jobs.len() > 1 { Completion::Batched } else { Completion::PerJob };
    let mut outcome = match run(jobs, later, first, ahead, claimed_rows, check_bound_role) {
        Ok(None) => {
            give_back(jobs, worker_id);
            return;
        }
        outcome => outcome.map(|ran| ran.expect("ran")),
    };
    if outcome.is_err() && execution::take_lease_lost_in_batch() {
        log!(
            "{WORKER_TYPE}: a batch of {} jobs found a lease lost (or a job's row held by another session) \
             when it completed its jobs; running it again with each job completed after its handler",
            jobs.len()
        );
        renew_from(0);
        outcome = run(jobs, later, Completion::PerJob, false, None, false).map(|ran| ran.expect("ran"));
    }
    let sqlstate = match outcome {
        Ok(tally) => {
            tally.publish();
            return;
        }
        Err(sqlstate) => sqlstate,
    };
    renew_from(0);
    if let [job] = jobs {
        fail_in_own_transaction(*job, &sqlstate, worker_id);
        return;
    }
    log!(
        "{WORKER_TYPE}: a batch of {} jobs failed as a whole with SQLSTATE {sqlstate}; \
         running its jobs one by one",
        jobs.len()
    );
    for (position, job) in jobs.iter().enumerate() {
        // Renewed with `later` when due, so that the jobs after this one keep their leases.
        let waiting: Vec<(i64, Uuid)> = jobs[position + 1..].iter().chain(later).copied().collect();
        match run(std::slice::from_ref(job), &waiting, Completion::PerJob, false, None, false) {
            Ok(ran) => ran.expect("ran").publish(),
            Err(sqlstate) => {
                renew_from(position);
                fail_in_own_transaction(*job, &sqlstate, worker_id);
            }
        }
    }
}

/// Fails a job, fenced, with the code of the error its own transaction raised, in a new one.
fn fail_in_own_transaction(job: (i64, Uuid), sqlstate: &str, worker_id: &str) {
    let recorded = in_transaction_or_logged("recording a failure", || {
        BackgroundWorker::transaction(|| {
            let mut tally = Tally::default();
            // Its run's count went with its transaction: counted here, as claimed once.
            tally.count(Counter::Claimed);
            let code = FailureCode::from_sqlstate(sqlstate);
            with_worker_settings(|| {
                execution::record_failure(job, worker_id, code, Some(sqlstate), &mut tally)
            });
            tally
        })
    });
    if let Some(tally) = recorded {
        tally.publish();
    }
}

const PRUNE_EVERY: Duration = Duration::from_secs(1);
const PRUNE_BATCH: i64 = 1000;
const PRUNE_BATCHES_PER_ROUND: usize = 20;

/// Deletes jobs finished longer than `durable_jobs.retention_period` ago, in small batches, one
/// transaction each, so that no long lock or transaction holds up the queue.
fn prune_finished_jobs() {
    let retention = settings::RETENTION_PERIOD.get();
    if retention == 0 {
        return;
    }
    for _ in 0..PRUNE_BATCHES_PER_ROUND {
        let deleted = BackgroundWorker::transaction(|| {
            if !extension_ready() {
                return 0;
            }
            let older_than = Interval::from_seconds(f64::from(retention));
            as_extension_owner_of(|installed| {
                with_worker_settings(|| retention::delete_finished_jobs(installed, older_than, PRUNE_BATCH))
            })
        });
        if deleted < PRUNE_BATCH {
            break;
        }
    }
}

/// Whether this database has the extension at the version of this library; an older schema
/// may lack what the worker uses, so the worker waits for `ALTER EXTENSION durable_jobs UPDATE`.
/// Read from the catalog directly, as our statements read the owner: an SPI query here, with
/// its settings and executor, was a twentieth of the path from enqueue to handler.
/// Under the worker's lock timeout: the row is read after a lock on the job table, which a long
/// `LOCK TABLE` or `VACUUM FULL` could otherwise hold the worker on, unlogged and deaf to reloads.
fn extension_ready() -> bool {
    with_worker_settings(crate::pg::privilege::installed_at_library_version).is_some()
}
