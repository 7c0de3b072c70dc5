//! Running a claim: its jobs grouped per enqueuing role, each group a batch in a transaction of
//! its own, in the worker's session for the role it is bound to or handed to that role's runner;
//! a batch that fails as a whole runs again job by job.

use super::claim::{claim_ahead, give_back, Claimed, CLAIMED_AHEAD};
use super::execution::{self, Completion, Failure};
use super::load::ClaimedRows;
use super::runner::{self};
use super::sandbox::CaughtFailure;
use super::session::WORKER_TYPE;
use super::session::{
    in_transaction, in_transaction_or_logged, in_worker_transaction, session_serves_bound_role,
    BOUND_ROLE_MOVED,
};
use crate::jobs::counters::{Counter, Tally};
use crate::jobs::failure::FailureCode;
use crate::jobs::lease;
use crate::pg::privilege::with_worker_settings;
use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;
use pgrx::Uuid;

/// The claimed jobs grouped by the role that enqueued them, in claim order. Each group runs in a
/// transaction of its own, so that roles never share one: no transaction-level lock, statistic
/// or rerun of one role's job touches another role's.
pub(super) fn batches_per_enqueuer(jobs: Vec<(String, (i64, Uuid))>) -> Vec<(String, Vec<(i64, Uuid)>)> {
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
pub(super) fn run_batch_in_runner(
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
pub(super) fn renew_after_rollback(waiting: &[(i64, Uuid)], worker_id: &str, lease_seconds: i32) {
    if !waiting.is_empty() {
        in_worker_transaction("renewing leases", || {
            lease::renew_leases_after_rollback(waiting, worker_id, lease_seconds)
        });
    }
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
pub(super) fn run_batch(
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
    let error = match outcome {
        Ok(tally) => {
            tally.publish();
            return;
        }
        Err(error) => error,
    };
    renew_from(0);
    if let [job] = jobs {
        fail_in_own_transaction(*job, &error, worker_id);
        return;
    }
    log!(
        "{WORKER_TYPE}: a batch of {} jobs failed as a whole with SQLSTATE {}; running its jobs one by one",
        jobs.len(),
        error.sqlstate()
    );
    for (position, job) in jobs.iter().enumerate() {
        // Renewed with `later` when due, so that the jobs after this one keep their leases.
        let waiting: Vec<(i64, Uuid)> = jobs[position + 1..].iter().chain(later).copied().collect();
        match run(std::slice::from_ref(job), &waiting, Completion::PerJob, false, None, false) {
            Ok(ran) => ran.expect("ran").publish(),
            Err(error) => {
                renew_from(position);
                fail_in_own_transaction(*job, &error, worker_id);
            }
        }
    }
}

/// Fails a job, fenced, with the code and text of the error its own transaction raised, in a
/// new one.
pub(super) fn fail_in_own_transaction(job: (i64, Uuid), error: &CaughtFailure, worker_id: &str) {
    let recorded = in_transaction_or_logged("recording a failure", || {
        BackgroundWorker::transaction(|| {
            let mut tally = Tally::default();
            // Its run's count went with its transaction: counted here, as claimed once.
            tally.count(Counter::Claimed);
            let sqlstate = error.sqlstate();
            let code = FailureCode::from_sqlstate(&sqlstate);
            let failure = Failure { code, sqlstate: Some(sqlstate), message: Some(error.message.clone()) };
            with_worker_settings(|| execution::record_failure(job, worker_id, failure, &mut tally));
            tally
        })
    });
    if let Some(tally) = recorded {
        tally.publish();
    }
}
