//! Running a claimed batch's handlers inside the background worker.
//!
//! Each job runs in its own subtransaction, as the role that enqueued it, under a
//! security-restricted operation and a statement timeout that ends before its lease does. Its
//! fenced completion commits in the same transaction as the handler's writes, so they commit
//! exactly when the job is marked succeeded and are rolled back when the lease was lost: right
//! after the handler in its subtransaction, or, early in a batch, together with the other jobs
//! that succeeded (see `Completion`). On error the subtransaction is rolled back and the job is
//! failed, fenced, with the stable code of the error's SQLSTATE; a completion that gives up
//! waiting for the job's row is the worker's failure, not the handler's. Whatever a handler could
//! leave in the session is cleared before the next job runs. (A little over 400 lines: a batch's
//! runs, renewals and completions share the timing of its leases.)

use super::load::{load_jobs, loaded_from_claim, now_unix_us, release_in_batch, ClaimedRows, LoadedJob};
use super::sandbox::{
    as_enqueuer, call_handler, clear_session_state, fire_constraints_immediately, gave_up_waiting,
    in_subtransaction, raise_again,
};
use crate::jobs::counters::{Counter, Tally};
use crate::jobs::failure::FailureCode;
use crate::jobs::lease;
use crate::jobs::trust::{registrant_serves, routine_still_exists};
use crate::pg::privilege::{set_at_this_level, with_worker_settings};
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;
use pgrx::Uuid;
use std::collections::HashMap;

/// How long before its lease ends a handler is stopped, so that the fenced failure still lands
/// inside the lease.
fn lease_margin_ms(lease_seconds: i32) -> i64 {
    (i64::from(lease_seconds) * 100).clamp(100, 2000)
}

/// The worker's waits for job rows that other sessions hold (a concurrent claim for a moment, a
/// cancel left open for longer) in one step of a batch: a renewal, a completion, a failure.
/// Each statement waits at most a quarter of what the leases at stake have left beyond a
/// reserve of a quarter of the margin, and half of what is left of the step's half margin (one
/// row can take two waits: its tuple lock, then its holder's transaction). After a handler that
/// used its whole timeout only half the margin is left; the waits that follow one another (a
/// completion, a failure, one per held row in the renewals) then still leave those leases live
/// when they are renewed, and a renewal's waits leave the next handler more than its timeout.
pub(crate) struct RowWaits {
    soonest_expiry_unix_us: i64,
    margin_ms: i64,
    step_ends_unix_us: i64,
}

impl RowWaits {
    fn new(soonest_expiry_unix_us: i64, margin_ms: i64) -> RowWaits {
        RowWaits::starting_at(now_unix_us(), soonest_expiry_unix_us, margin_ms)
    }

    /// The waits of a step that starts at `now_unix_us`.
    pub(crate) fn starting_at(now_unix_us: i64, soonest_expiry_unix_us: i64, margin_ms: i64) -> RowWaits {
        let step_ends_unix_us = now_unix_us + margin_ms * 1000 / 2;
        RowWaits { soonest_expiry_unix_us, margin_ms, step_ends_unix_us }
    }

    /// How long a statement of the step that starts at `now_unix_us` may wait for a row, in ms
    /// (0 or less: no time is left).
    pub(crate) fn wait_ms_at(&self, now_unix_us: i64) -> i64 {
        let slack_ms = self.soonest_expiry_unix_us.saturating_sub(now_unix_us) / 1000 - self.margin_ms / 4;
        let step_left_ms = (self.step_ends_unix_us - now_unix_us) / 1000;
        (slack_ms / 4).min(step_left_ms / 2)
    }

    /// Sets lock_timeout for the next statement; false when no time is left to wait (the
    /// statement then waits 1 ms at most: 0 would wait for ever).
    fn arm(&self) -> bool {
        let wait_ms = self.wait_ms_at(now_unix_us());
        let timeout = std::ffi::CString::new(format!("{}ms", wait_ms.max(1))).expect("no NUL");
        unsafe { set_at_this_level(c"lock_timeout", &timeout) };
        wait_ms >= 1
    }
}

/// How a batch marks its jobs succeeded.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The successes in one fenced statement, as long as the claim's leases need no renewal:
    /// each handler's subtransaction is kept if its lease is live by the clock when it returns,
    /// and the jobs are completed together at the end, or when the first renewal is due, after
    /// which the batch goes on `PerJob`. Should that statement find a lease lost (or its row
    /// held by another session), the whole transaction fails (see `take_lease_lost_in_batch`)
    /// and the caller runs the batch again `PerJob`; nothing renewed is lost with it, and the
    /// claim's leases are then still live.
    Batched,
    /// Each job's success fenced in its own subtransaction, right after its handler.
    PerJob,
}

thread_local! {
    /// Set when a `Batched` run failed because a lease of its successes was lost.
    static LEASE_LOST_IN_BATCH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the transaction that just failed was a `Batched` run that found a lease lost; clears
/// the mark.
pub fn take_lease_lost_in_batch() -> bool {
    LEASE_LOST_IN_BATCH.with(|lost| lost.replace(false))
}

fn fail_batch_for_a_lost_lease() -> ! {
    LEASE_LOST_IN_BATCH.with(|lost| lost.set(true));
    ereport!(
        ERROR,
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        "a lease of the batch was lost before its completion"
    );
}

/// Runs a batch of claimed jobs (all of one enqueuer), each in its own subtransaction and
/// memory context; the caller's transaction commits whatever this leaves in place. Every
/// handler gets the whole handler timeout (the lease less its margin): before a handler starts
/// with less lease than that left, the leases of the batch's remaining jobs are renewed in one
/// statement (`Batched`, after completing the successes so far), and those of `later`, the
/// claim's jobs of other enqueuers still to run in transactions of their own, in a
/// subtransaction whose failure costs this batch nothing. The jobs are read from `claimed_rows`
/// when given (the claim that just committed), otherwise loaded (`load_jobs`).
pub fn run_jobs(
    jobs: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
    mut completion: Completion,
    claimed_rows: Option<&ClaimedRows>,
) -> Tally {
    with_worker_settings(|| {
        let mut tally = Tally::default();
        let margin_ms = lease_margin_ms(lease_seconds);
        let timeout_ms = i64::from(lease_seconds) * 1000 - margin_ms;
        let mut loaded = claimed_rows
            .and_then(|rows| loaded_from_claim(jobs, rows, worker_id))
            .unwrap_or_else(|| load_jobs(jobs, worker_id));
        // Batched: the jobs whose handlers succeeded, not completed yet, with their lease expiry.
        let mut succeeded: Vec<((i64, Uuid), i64)> = Vec::new();
        for (position, (job_id, lease_token)) in jobs.iter().enumerate() {
            // Given back at the load: not run, not counted, and its lease (ours no more) no part
            // of the batch's renewals.
            if loaded.get(job_id).is_some_and(|job| job.given_back) {
                loaded.remove(job_id);
                continue;
            }
            let Some(expiry) = loaded.get(job_id).map(|job| job.lease_expires_unix_us) else {
                tally.count(Counter::Claimed);
                tally.count(Counter::Stale);
                continue;
            };
            let renewal_due = |soonest: i64| soonest - now_unix_us() < (timeout_ms + margin_ms / 2) * 1000;
            if renewal_due(succeeded.iter().map(|(_, expiry)| *expiry).fold(expiry, i64::min)) {
                // Renewed leases are never lost to a rerun: complete first, then go on PerJob.
                if completion == Completion::Batched {
                    complete_succeeded(&mut succeeded, worker_id, margin_ms, &mut tally);
                    completion = Completion::PerJob;
                }
                let remaining: Vec<(i64, Uuid)> =
                    jobs[position..].iter().filter(|(id, _)| loaded.contains_key(id)).copied().collect();
                // The claim's leases were taken, and are renewed, together: `expiry` is the
                // soonest of them, `later`'s included.
                let waits = RowWaits::new(expiry, margin_ms);
                let renewed: HashMap<i64, i64> =
                    renew_leases(&remaining, worker_id, lease_seconds, &waits).into_iter().collect();
                if !later.is_empty() {
                    // Committed with this batch; a job whose row someone holds is renewed, or
                    // found lost, when its own batch runs.
                    let _ = in_subtransaction(|| {
                        renew_leases(later, worker_id, lease_seconds, &waits);
                        true
                    });
                }
                // A lease that could not be renewed was lost, or its row is held by another
                // session: that job is not ours to run now; it is claimed again after its lease.
                loaded.retain(|id, job| match renewed.get(id) {
                    Some(expiry) => {
                        job.lease_expires_unix_us = *expiry;
                        true
                    }
                    None => !remaining.iter().any(|(r, _)| r == id),
                });
            }
            // Whatever the handler allocates (its result, the call's caches) goes with its job.
            let mut job_memory = PgMemoryContexts::new("durable_jobs job");
            // SAFETY: nothing allocated in the job's context is used after it.
            unsafe {
                job_memory.switch_to(|_| {
                    let lease = (*job_id, *lease_token);
                    // Counted as claimed once it runs (or is found lost): a job given back is
                    // counted when it is claimed again.
                    match loaded.remove(job_id) {
                        None => {
                            tally.count(Counter::Claimed);
                            tally.count(Counter::Stale);
                        }
                        Some(job) => {
                            let expiry = job.lease_expires_unix_us;
                            let timing = (timeout_ms, margin_ms);
                            let outcome = run_job(lease, worker_id, job, timing, completion, &mut tally);
                            if !matches!(outcome, Outcome::GivenBack) {
                                tally.count(Counter::Claimed);
                            }
                            if let Outcome::Pending = outcome {
                                succeeded.push((lease, expiry));
                            }
                            // A handler that took long: its predecessors' leases have half the
                            // margin left at least (if it kept to its timeout); complete them at
                            // once, before this job's failure or cleanup, which can take time.
                            if completion == Completion::Batched
                                && succeeded.iter().map(|(_, expiry)| *expiry).min().is_some_and(renewal_due)
                            {
                                complete_succeeded(&mut succeeded, worker_id, margin_ms, &mut tally);
                                completion = Completion::PerJob;
                            }
                            if let Outcome::Failed(failure) = outcome {
                                let _ = RowWaits::new(expiry, margin_ms).arm();
                                record_failure(lease, worker_id, failure, &mut tally);
                            }
                        }
                    }
                    clear_session_state();
                })
            };
        }
        complete_succeeded(&mut succeeded, worker_id, margin_ms, &mut tally);
        tally
    })
}

/// Renews the leases of `jobs`: those whose rows no one else holds at once, then each held row
/// alone, waited for as `waits` allows and otherwise left to its lease. Returns the renewed
/// leases with their new expiry. Any error but giving up a wait is raised again.
fn renew_leases(
    jobs: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
    waits: &RowWaits,
) -> Vec<(i64, i64)> {
    let mut renewed = Vec::new();
    let _ = waits.arm();
    match in_subtransaction(|| {
        renewed = lease::renew_leases(jobs, worker_id, lease_seconds, true);
        true
    }) {
        Ok(_) => {}
        // A wait for the table itself given up: no row is tried alone against it.
        Err(error) if gave_up_waiting(&error) => return Vec::new(),
        Err(error) => raise_again(error),
    }
    for job in not_among(jobs, &renewed.iter().map(|(id, _)| *id).collect::<Vec<_>>()) {
        if !waits.arm() {
            break;
        }
        let mut renewed_now = Vec::new();
        match in_subtransaction(|| {
            renewed_now = lease::renew_leases(&[job], worker_id, lease_seconds, false);
            true
        }) {
            Ok(_) => renewed.extend(renewed_now),
            Err(error) if gave_up_waiting(&error) => {}
            Err(error) => raise_again(error),
        }
    }
    renewed
}

/// The leases of `jobs` whose ids are not in `ids`.
fn not_among(jobs: &[(i64, Uuid)], ids: &[i64]) -> Vec<(i64, Uuid)> {
    jobs.iter().filter(|(id, _)| !ids.contains(id)).copied().collect()
}

/// Completes the jobs whose handlers succeeded, in one fenced statement; a lease lost, or a row
/// another session holds longer than the worker waits, fails the transaction for a rerun
/// `PerJob`.
fn complete_succeeded(
    succeeded: &mut Vec<((i64, Uuid), i64)>,
    worker_id: &str,
    margin_ms: i64,
    tally: &mut Tally,
) {
    let Some(soonest_expiry) = succeeded.iter().map(|(_, expiry)| *expiry).min() else {
        return;
    };
    let leases: Vec<(i64, Uuid)> = succeeded.drain(..).map(|(lease, _)| lease).collect();
    // Those whose rows no one else holds at once, then each held row alone; any error, or a row
    // held past the worker's wait for it, counts as a lease lost.
    let waits = RowWaits::new(soonest_expiry, margin_ms);
    let _ = waits.arm();
    let mut completed = Vec::new();
    if in_subtransaction(|| {
        completed = lease::complete_jobs(&leases, worker_id, true);
        true
    })
    .is_err()
    {
        fail_batch_for_a_lost_lease();
    }
    let ids: Vec<i64> = completed.iter().map(|(id, _)| *id).collect();
    for job in not_among(&leases, &ids) {
        if !waits.arm() {
            fail_batch_for_a_lost_lease();
        }
        let mut alone = Vec::new();
        if !matches!(
            in_subtransaction(|| {
                alone = lease::complete_jobs(&[job], worker_id, false);
                alone.len() == 1
            }),
            Ok(true)
        ) {
            fail_batch_for_a_lost_lease();
        }
        completed.extend(alone);
    }
    for (_, observed) in completed {
        tally.count(Counter::Succeeded);
        tally.observe(observed);
    }
}

/// Why a job fails: its code, and the SQLSTATE and message of the handler's error, if it ran
/// (or of the worker's reason it did not run).
pub struct Failure {
    pub code: FailureCode,
    pub sqlstate: Option<String>,
    pub message: Option<String>,
}

impl Failure {
    /// A failure the worker decided without running the handler, for the reason `message` says.
    fn unrun(code: FailureCode, message: &str) -> Outcome {
        Outcome::Failed(Failure { code, sqlstate: None, message: Some(message.to_string()) })
    }
}

/// What became of a job once its handler returned.
enum Outcome {
    /// Completed (`PerJob`) or found stale, and counted.
    Counted,
    /// Succeeded, with its completion left to the batch (`Batched`).
    Pending,
    /// To be failed so.
    Failed(Failure),
    /// Given back to the queue with its attempt, unrun: its registration no longer serves it.
    GivenBack,
}

/// Runs one job's handler in its subtransaction. `PerJob`, completes it there; `Batched`,
/// keeps the subtransaction if its lease is live by the clock, for the caller to complete.
fn run_job(
    (job_id, lease_token): (i64, Uuid),
    worker_id: &str,
    job: LoadedJob,
    (timeout_ms, margin_ms): (i64, i64),
    completion: Completion,
    tally: &mut Tally,
) -> Outcome {
    let Some(handler) = job.handler else {
        // An enqueuer that no longer exists, or a handler it may not run (no EXECUTE, or an
        // owner that holds none of its rights).
        return Failure::unrun(
            FailureCode::TargetRejected,
            "the handler may not run as the job's enqueuer: the role no longer exists, may not execute it, \
             or the handler's owner holds none of its rights",
        );
    };
    // First, as it takes in other sessions' changes to the catalog caches (memberships too).
    let routine_exists = routine_still_exists(handler.routine);
    // Its registering role no longer holds the enqueuer's rights (a membership revoked since the
    // claim or the load): back to the queue, to wait for an external worker, as a job enqueued
    // now would. (`call_handler` checks it again, at the call.)
    if !registrant_serves(&handler) {
        release_in_batch(&[(job_id, lease_token)], worker_id);
        return Outcome::GivenBack;
    }
    if !routine_exists {
        // Dropped since the batch resolved it (from its claim or its load), perhaps to be
        // created again (a registration keeps the signature): a retry resolves it anew.
        return Failure::unrun(FailureCode::TargetUnavailable, "the handler no longer exists");
    }
    // Set while the worker completes the job after its handler returned: a wait of the
    // completion's given up there is the worker's, never the handler's.
    let completing = std::cell::Cell::new(false);
    // The attempt a `PerJob` completion returned, for the histograms.
    let observation = std::cell::RefCell::new(None);
    let outcome = in_subtransaction(|| {
        fire_constraints_immediately();
        as_enqueuer(handler.role, timeout_ms, || call_handler(handler, job.payload));
        match completion {
            Completion::Batched => job.lease_expires_unix_us > now_unix_us(),
            Completion::PerJob => {
                let _ = RowWaits::new(job.lease_expires_unix_us, margin_ms).arm();
                completing.set(true);
                let (outcome, observed) = lease::complete_job(job_id, worker_id, lease_token);
                completing.set(false);
                *observation.borrow_mut() = observed;
                outcome == "succeeded"
            }
        }
    });
    match outcome {
        Ok(true) if completion == Completion::Batched => return Outcome::Pending,
        Ok(true) => {
            tally.count(Counter::Succeeded);
            tally.observe(observation.take());
        }
        Ok(false) => tally.count(Counter::Stale),
        Err(error) if completing.get() => {
            // The fenced completion failed, not the handler: another session held the job's row
            // past the worker's wait (an open transaction that cancelled it, a claimer's lock), a
            // deadlock with it, or the worker's own error (a query cancel sent to the worker, no
            // memory). The handler's writes went with the subtransaction; the job is left to its
            // lease, as a lease lost, and claimed again when that expires.
            let what = if gave_up_waiting(&error) { "gave up waiting for its row" } else { "failed" };
            log!(
                "durable_jobs worker: completing job {job_id} {what} (SQLSTATE {}); its handler's writes were \
                 rolled back and it is claimed again when its lease expires",
                error.sqlstate()
            );
            tally.count(Counter::Stale);
        }
        Err(error) => {
            if crate::pg::settings::LOG_HANDLER_ERRORS.get() {
                // The handler's own message: it may quote what the handler put in it, never
                // the payload by our doing.
                log!(
                    "durable_jobs worker: job {job_id} (kind {}, attempt {}) failed with SQLSTATE {}: {}",
                    job.job_kind,
                    job.attempt_count,
                    error.sqlstate(),
                    error.message
                );
            }
            let sqlstate = error.sqlstate();
            // The routine may have been dropped after the check above, before or during the
            // call (a permission error or a failed cache lookup then): a retry resolves it anew.
            let code = match routine_still_exists(handler.routine) {
                true => FailureCode::from_sqlstate(&sqlstate),
                false => FailureCode::TargetUnavailable,
            };
            return Outcome::Failed(Failure { code, sqlstate: Some(sqlstate), message: Some(error.message) });
        }
    }
    Outcome::Counted
}

/// The fenced failure of one job, with the SQLSTATE and message of the handler's error if there
/// was one, in a subtransaction of its own: an error there (a deadlock with a concurrent cancel,
/// a lock timeout) is logged and leaves the job to its lease, which another claim takes over
/// once it expires. The caller has the worker's settings in force.
pub fn record_failure(
    (job_id, lease_token): (i64, Uuid),
    worker_id: &str,
    failure: Failure,
    tally: &mut Tally,
) {
    let outcome = in_subtransaction(|| {
        let Failure { code, sqlstate, message } = &failure;
        let (outcome, observed) =
            lease::fail_job(job_id, worker_id, lease_token, *code, sqlstate.as_deref(), message.as_deref());
        tally.count(Counter::for_outcome(outcome));
        tally.observe(observed);
        true
    });
    if let Err(error) = outcome {
        log!(
            "durable_jobs worker: could not record the failure of job {job_id} (SQLSTATE {}); \
             it is claimed again when its lease expires",
            error.sqlstate()
        );
    }
}
