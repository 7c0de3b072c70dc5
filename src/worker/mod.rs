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

pub mod batch;
pub mod claim;
pub mod execution;
pub mod load;
pub mod runner;
pub mod sandbox;
pub mod session;

use crate::jobs::counters::{self, Counter, Tally};
use crate::jobs::lease;
use crate::jobs::rates;
use crate::jobs::retention;
use crate::jobs::sleepers;
use crate::jobs::wakeup;
use crate::pg::privilege::{as_extension_owner_of, with_worker_settings};
use crate::pg::settings;
use batch::{batches_per_enqueuer, renew_after_rollback, run_batch, run_batch_in_runner};
use claim::{
    claim_in_own_transaction, give_back, give_back_claimed_ahead, write_wal_up_to, Claimed, CLAIMED_AHEAD,
    LATE_HANDOVERS,
};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use runner::{TakenOver, RUNNER_TYPE};
use session::{
    bind_session_to, bound_role, extension_ready, in_transaction_or_logged, report_statistics,
    session_serves_bound_role, start_session, BOUND_ROLE_MOVED, WORKER_TYPE,
};
use std::time::{Duration, Instant};

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

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn durable_jobs_worker_main(argument: pg_sys::Datum) {
    let number = argument.value() as i32;
    start_session(&format!("{WORKER_TYPE} {number}"));
    // In this order: at exit (callbacks run in reverse) the wake-up slot is cleared before the
    // direct-lease word is reset.
    sleepers::publish_worker(number);
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
        // A rate-limited queue whose claim found no token: its next token comes then.
        let token_due = rates::next_token_at().map(|at| {
            let now = unsafe { pg_sys::GetCurrentTimestamp() };
            Instant::now() + Duration::from_micros(u64::try_from(at - now).unwrap_or(0))
        });
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
        if !in_transaction_or_logged("wait", || sleep_until_poll(number, statistics_due, token_due))
            .unwrap_or(true)
        {
            break;
        }
    }
    log!("{WORKER_TYPE} {number} stopped");
}

/// Sleeps until the latch is set (an enqueue's commit, a reload, a shutdown), the poll interval
/// has passed or a rate-limited queue's next token comes (`token_due`), flushing on the way the statistics left pending when they fall due (a flush is
/// not a poll: it claims nothing and counts no idle poll). Asleep, worker `number` may be handed
/// a job by an enqueue (`direct_lease`), which it then runs as one claimed ahead. False when the
/// worker is to stop.
fn sleep_until_poll(number: i32, mut statistics_due: Option<Instant>, token_due: Option<Instant>) -> bool {
    let poll_due = Instant::now() + settings::poll_interval();
    let deadline = token_due.map_or(poll_due, |due| due.min(poll_due));
    loop {
        // A reload whose latch a lock wait used up (lock waits reset the latch) is still due: a
        // worker switched off, which no enqueue wakes, would otherwise miss being switched on
        // until its poll interval ends.
        if unsafe { (&raw const pg_sys::ConfigReloadPending).read_volatile() } != 0 {
            return true;
        }
        let wake_at = statistics_due.map_or(deadline, |due| due.min(deadline));
        if settings::WORKER_ENABLED.get() && !sleepers::fall_asleep(number, settings::default_lease_seconds())
        {
            return true;
        }
        let latch_set = crate::pg::latch::sleep_on_latch(wake_at.saturating_duration_since(Instant::now()));
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

/// Wakes worker `number` to enqueues (`sleepers::wake_up`) and keeps the job one handed it,
/// if any, with the jobs claimed ahead, which this poll runs (its lease renewed first if a
/// quarter of it is gone: a worker restarted meanwhile). A job whose enqueue's commit outlasted
/// the worker's wait goes back to the queue, with its attempt, at the first poll after that
/// commit.
fn take_handed_job(number: i32, worker_id: &str) {
    LATE_HANDOVERS.with(|late| {
        late.borrow_mut().retain(|(job, transaction)| match sleepers::transaction_ended(*transaction) {
            None => true,
            Some(committed) => {
                if committed {
                    give_back(std::slice::from_ref(job), worker_id);
                }
                false
            }
        })
    });
    let handed = match sleepers::wake_up(number) {
        sleepers::Handed::Nothing => return,
        sleepers::Handed::Late(job, transaction) => {
            log!("{WORKER_TYPE} {number}: an enqueue's commit outlasted the wait for its job's hand-over; the job goes back to the queue once it commits");
            LATE_HANDOVERS.with(|late| late.borrow_mut().push((job, transaction)));
            return;
        }
        sleepers::Handed::Job(handed) => handed,
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
            counters::count(Counter::IdlePolls);
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
