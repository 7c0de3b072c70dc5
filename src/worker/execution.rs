//! Running a claimed batch's handlers inside the background worker.
//!
//! Each job runs in its own subtransaction, as the role that enqueued it, under a
//! security-restricted operation and a statement timeout that ends before its lease does. Its
//! fenced completion commits in the same transaction as the handler's writes, so they commit
//! exactly when the job is marked succeeded and are rolled back when the lease was lost: right
//! after the handler in its subtransaction, or, early in a batch, together with the other jobs
//! that succeeded (see `Completion`). On error the subtransaction is rolled back and the job is
//! failed, fenced, with the stable code of the error's SQLSTATE. Whatever a handler could leave
//! in the session is cleared before the next job runs.

use crate::jobs::failure::FailureCode;
use crate::api::handlers::{
    may_run_routine, registrant_serves, registration_serves, routine_still_exists, runnable_handler,
    RunnableHandler,
};
use crate::jobs::lease;
use crate::jobs::metrics::{Counter, Tally};
use crate::pg::plans;
use crate::pg::privilege::{
    as_extension_owner, as_owner, installed_at_library_version, set_at_this_level, with_worker_settings,
};
use crate::pg::randomness;
use crate::pg::sql_types::JsonbDatum;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;
use pgrx::Uuid;
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// For each claimed job whose lease is still exactly ours: its payload, its kind's registered
/// handler (text, NULL when there is none), the enqueuing role, its lease expiry (Unix
/// microseconds), kind and attempt, the role that registered the handler and whether that
/// registration serves the enqueuer now (it may not: unregistered and registered again by another
/// role since the claim, or the registering role no longer holds the enqueuer's rights). Whether
/// the enqueuer may run the handler is decided in the library (`handlers::runnable_handler`),
/// once per handler, enqueuer and registering role of the batch.
pub(crate) const LOAD_JOBS: &str = concat!(
    "
    SELECT j.job_id,
           j.payload,
           h.handler,
           j.enqueued_by::pg_catalog.text,
           (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8,
           j.job_kind,
           j.attempt_count,
           h.registered_by::pg_catalog.text,
           ",
    crate::registration_serves!("h.registered_by", "j.enqueued_by"),
    "
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
         AS c(job_id, lease_token)
    JOIN durable_jobs.durable_job j ON j.job_id = c.job_id AND j.lease_token = c.lease_token
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    -- The token is the state check (see lease_fence in lease.rs).
    WHERE j.job_id = ANY ($1) AND j.lease_owner = $3"
);

/// The search_path handlers run with, whatever the session's: `pg_temp` last, so that no
/// temporary object can capture a handler's unqualified names.
const HANDLER_SEARCH_PATH: &std::ffi::CStr = c"\"$user\", public, pg_temp";

pub(crate) struct LoadedJob {
    payload: JsonbDatum,
    /// None when the job may not run.
    pub(crate) handler: Option<RunnableHandler>,
    lease_expires_unix_us: i64,
    job_kind: String,
    attempt_count: i32,
    /// Given back to the queue at the load, with its attempt: its kind is no longer registered,
    /// or its registration no longer serves its enqueuer (the job waits for an external worker,
    /// as it would had that been so at the claim). Not run, and counted as nothing.
    pub(crate) given_back: bool,
}

/// Loads a batch of claimed jobs with one query; a job missing from the result lost its lease.
/// A job whose kind is no longer registered, or whose registration no longer serves its
/// enqueuer, is given back here.
pub(crate) fn load_jobs(jobs: &[(i64, Uuid)], worker_id: &str) -> HashMap<i64, LoadedJob> {
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = jobs.iter().copied().unzip();
    as_extension_owner(|| {
        let loaded: HashMap<i64, LoadedJob> = Spi::connect_mut(|client| {
            let mut runnable = RunnableHandlers::default();
            plans::execute_generic(client, LOAD_JOBS, &[ids.into(), tokens.into(), worker_id.into()])
                .map(|row| {
                    let handler: Option<String> = row.get(3).unwrap();
                    // Unregistered since the claim (which takes only registered kinds), or no
                    // longer a registration that serves the enqueuer.
                    let given_back = handler.is_none() || row.get::<bool>(9).unwrap() == Some(false);
                    let enqueuer: String = row.get(4).unwrap().unwrap();
                    let registrant: Option<String> = row.get(8).unwrap();
                    let job = LoadedJob {
                        payload: row.get(2).unwrap().unwrap(),
                        handler: if given_back { None } else { runnable.of(handler, enqueuer, registrant) },
                        lease_expires_unix_us: row.get(5).unwrap().unwrap(),
                        job_kind: row.get(6).unwrap().unwrap(),
                        attempt_count: row.get(7).unwrap().unwrap(),
                        given_back,
                    };
                    (row.get::<i64>(1).unwrap().unwrap(), job)
                })
                .collect()
        });
        give_back_marked(jobs, &loaded, worker_id);
        loaded
    })
}

/// Gives the jobs of `jobs` that the load marked `given_back` back to the queue (`release_in_batch`).
fn give_back_marked(jobs: &[(i64, Uuid)], loaded: &HashMap<i64, LoadedJob>, worker_id: &str) {
    let marked: Vec<(i64, Uuid)> =
        jobs.iter().filter(|(id, _)| loaded.get(id).is_some_and(|job| job.given_back)).copied().collect();
    release_in_batch(&marked, worker_id);
}

/// Gives `jobs`, claimed but not started, back to the queue with their attempts, in the batch's
/// transaction (they stay running, their rows locked, until it commits). A job whose row another
/// session holds, or a wait for the table given up, leaves that job to its lease, as any job the
/// batch does not run; nothing else of the batch is lost with it.
fn release_in_batch(jobs: &[(i64, Uuid)], worker_id: &str) {
    if jobs.is_empty() {
        return;
    }
    match in_subtransaction(|| {
        lease::release_unstarted(jobs, worker_id);
        true
    }) {
        Ok(_) => {}
        Err(error) if gave_up_waiting(&error) => {}
        Err(error) => raise_again(error),
    }
}

/// A batch's jobs share a few handlers, enqueuers and registering roles: each is checked once.
#[derive(Default)]
struct RunnableHandlers(HashMap<(String, String, String), Option<RunnableHandler>>);

impl RunnableHandlers {
    fn of(
        &mut self,
        registered: Option<String>,
        enqueuer: String,
        registrant: Option<String>,
    ) -> Option<RunnableHandler> {
        let (registered, registrant) = (registered?, registrant?);
        *self.0.entry((registered, enqueuer, registrant)).or_insert_with_key(
            |(registered, enqueuer, registrant)| runnable_handler(registered, enqueuer, registrant),
        )
    }
}

/// A job as a claim of the worker (a poll's, or one ahead) returned it, kept past that claim's
/// commit, so that the transaction that runs it right after does not read it again: its lease
/// was exactly ours when the claim committed, a moment before, and a lease lost since (a cancel,
/// say) is found by the fenced completion, which then rolls the handler's writes back, as for a
/// lease lost while the handler runs.
pub(crate) struct ClaimedRow {
    lease_token: Uuid,
    payload: Vec<u8>,
    handler: Option<String>,
    registered_by: Option<String>,
    enqueued_by: String,
    lease_expires_unix_us: i64,
    job_kind: String,
    attempt_count: i32,
}

impl ClaimedRow {
    pub(crate) fn of(job: lease::ClaimedJob) -> (i64, ClaimedRow) {
        let row = ClaimedRow {
            lease_token: job.lease_token,
            payload: job.payload.to_bytes(),
            handler: job.handler,
            registered_by: job.registered_by,
            enqueued_by: job.enqueued_by,
            lease_expires_unix_us: unix_us(job.lease_expires_at),
            job_kind: job.job_kind,
            attempt_count: job.attempt_count,
        };
        (job.job_id, row)
    }
}

/// A claim's rows by job id, and the extension they were claimed from (its pg_extension oid).
#[derive(Default)]
pub(crate) struct ClaimedRows {
    pub(crate) extension: pg_sys::Oid,
    pub(crate) rows: HashMap<i64, ClaimedRow>,
}

/// `load_jobs`, from the claim's rows instead of the table, as the extension owner (resolving a
/// handler needs USAGE on its schema): None unless the extension is the one the rows were
/// claimed from, at this library's version (the job table locked, as the load's statement
/// locks it, so that DDL waits for the batch), and the rows hold every job of the batch under
/// its lease.
fn loaded_from_claim(
    jobs: &[(i64, Uuid)],
    claimed: &ClaimedRows,
    worker_id: &str,
) -> Option<HashMap<i64, LoadedJob>> {
    let installed = installed_at_library_version().filter(|row| row.extension == claimed.extension)?;
    let rows: Vec<(i64, &ClaimedRow)> = jobs
        .iter()
        .map(|(job_id, lease_token)| {
            claimed.rows.get(job_id).filter(|row| row.lease_token == *lease_token).map(|row| (*job_id, row))
        })
        .collect::<Option<_>>()?;
    as_owner(installed.owner, || {
        let mut runnable = RunnableHandlers::default();
        let loaded: HashMap<i64, LoadedJob> = rows
            .into_iter()
            .map(|(job_id, row)| {
                // The claim judged the registration a moment ago; the registering role's
                // memberships may have changed since, as at a load.
                let given_back = !row
                    .registered_by
                    .as_deref()
                    .is_some_and(|registrant| registration_serves(registrant, &row.enqueued_by));
                let job = LoadedJob {
                    payload: JsonbDatum::from_bytes(&row.payload),
                    handler: if given_back {
                        None
                    } else {
                        runnable.of(row.handler.clone(), row.enqueued_by.clone(), row.registered_by.clone())
                    },
                    lease_expires_unix_us: row.lease_expires_unix_us,
                    job_kind: row.job_kind.clone(),
                    attempt_count: row.attempt_count,
                    given_back,
                };
                (job_id, job)
            })
            .collect();
        give_back_marked(jobs, &loaded, worker_id);
        Some(loaded)
    })
}

/// A timestamp as Unix microseconds (PostgreSQL counts from 2000-01-01).
fn unix_us(at: TimestampWithTimeZone) -> i64 {
    const POSTGRES_EPOCH_UNIX_US: i64 = 946_684_800_000_000;
    pg_sys::TimestampTz::from(at) + POSTGRES_EPOCH_UNIX_US
}

fn now_unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

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

/// Whether a caught error is a wait for a lock given up: a lock timeout, or a deadlock with the
/// session holding the row.
fn gave_up_waiting(error: &CaughtFailure) -> bool {
    matches!(error.sqlstate().as_str(), "55P03" | "40P01")
}

/// Raises a caught error again, with its SQLSTATE and message.
fn raise_again(error: CaughtFailure) -> ! {
    ereport!(ERROR, PgSqlErrorCode::from(error.packed_sqlstate), error.message);
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
                            if let Outcome::Failed(code, sqlstate) = outcome {
                                let _ = RowWaits::new(expiry, margin_ms).arm();
                                record_failure(lease, worker_id, code, sqlstate.as_deref(), &mut tally);
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
    for job in not_among(&leases, &completed) {
        if !waits.arm() {
            fail_batch_for_a_lost_lease();
        }
        if !matches!(
            in_subtransaction(|| lease::complete_jobs(&[job], worker_id, false).len() == 1),
            Ok(true)
        ) {
            fail_batch_for_a_lost_lease();
        }
    }
    leases.iter().for_each(|_| tally.count(Counter::Succeeded));
}

/// What became of a job once its handler returned.
enum Outcome {
    /// Completed (`PerJob`) or found stale, and counted.
    Counted,
    /// Succeeded, with its completion left to the batch (`Batched`).
    Pending,
    /// To be failed with this code and the SQLSTATE of the handler's error, if it ran.
    Failed(FailureCode, Option<String>),
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
        return Outcome::Failed(FailureCode::TargetRejected, None);
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
        return Outcome::Failed(FailureCode::TargetUnavailable, None);
    }
    let outcome = in_subtransaction(|| {
        fire_constraints_immediately();
        as_enqueuer(handler.role, timeout_ms, || call_handler(handler, job.payload));
        match completion {
            Completion::Batched => job.lease_expires_unix_us > now_unix_us(),
            Completion::PerJob => {
                let _ = RowWaits::new(job.lease_expires_unix_us, margin_ms).arm();
                lease::complete_job(job_id, worker_id, lease_token) == "succeeded"
            }
        }
    });
    match outcome {
        Ok(true) if completion == Completion::Batched => return Outcome::Pending,
        Ok(true) => tally.count(Counter::Succeeded),
        Ok(false) => tally.count(Counter::Stale),
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
            return Outcome::Failed(code, Some(sqlstate));
        }
    }
    Outcome::Counted
}

/// Calls the handler routine by its oid with the payload, as SPI would run `SELECT f($1)` or
/// `CALL p($1)`: after a command counter increment, with a fresh snapshot. The enqueuer must
/// still be allowed to run it (`may_run_routine`; fmgr itself checks nothing).
pub(crate) fn call_handler(handler: RunnableHandler, payload: JsonbDatum) {
    unsafe {
        // Checked again at the call, not only when the batch resolved it: a grant, the owner,
        // the registering role's memberships, the role or the routine itself may have changed since. The caller's `routine_still_exists`
        // has just taken in other sessions' changes to the catalog caches.
        if pg_sys::pg_proc_aclcheck(handler.routine, handler.role, pg_sys::ACL_EXECUTE as pg_sys::AclMode)
            != pg_sys::AclResult::ACLCHECK_OK
            || may_run_routine(handler.routine, handler.role).is_none()
            || !registrant_serves(&handler)
        {
            ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                "permission denied to run the handler of this job"
            );
        }
        // Only as the session's bound role: one renamed, or dropped and created again, after the
        // claim (the worker restarts at its next claim) fails this attempt, retried.
        if !crate::pg::privilege::session_may_run_as(handler.role) {
            ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                "this job's role is not the role this worker session is bound to"
            );
        }
        let flinfo = pg_sys::palloc0(std::mem::size_of::<pg_sys::FmgrInfo>()) as *mut pg_sys::FmgrInfo;
        pg_sys::fmgr_info(handler.routine, flinfo);
        let size = std::mem::size_of::<pg_sys::FunctionCallInfoBaseData>()
            + std::mem::size_of::<pg_sys::NullableDatum>();
        let fcinfo = pg_sys::palloc0(size) as *mut pg_sys::FunctionCallInfoBaseData;
        (*fcinfo).flinfo = flinfo;
        (*fcinfo).nargs = 1;
        (*fcinfo).fncollation = pg_sys::Oid::INVALID;
        if handler.is_procedure {
            let context = PgBox::<pg_sys::CallContext>::alloc_node(pg_sys::NodeTag::T_CallContext);
            (*context.as_ptr()).atomic = true;
            (*fcinfo).context = context.into_pg() as *mut pg_sys::Node;
        }
        let args = (*fcinfo).args.as_mut_slice(1);
        args[0] = pg_sys::NullableDatum { value: payload.into_datum().expect("a payload"), isnull: false };
        pg_sys::CommandCounterIncrement();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        let function = (*flinfo).fn_addr.expect("a function address");
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| function(fcinfo));
        pg_sys::PopActiveSnapshot();
    }
}

/// The fenced failure of one job, with the SQLSTATE of the handler's error if there was one, in
/// a subtransaction of its own: an error there (a deadlock with a concurrent cancel, a lock
/// timeout) is logged and leaves the job to its lease, which another claim takes over once it
/// expires. The caller has the worker's settings in force.
pub fn record_failure(
    (job_id, lease_token): (i64, Uuid),
    worker_id: &str,
    code: FailureCode,
    sqlstate: Option<&str>,
    tally: &mut Tally,
) {
    let outcome = in_subtransaction(|| {
        let outcome = lease::fail_job(job_id, worker_id, lease_token, code, sqlstate);
        tally.count(Counter::for_outcome(outcome));
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

/// `SET CONSTRAINTS ALL IMMEDIATE` for the job's subtransaction. Deferred constraints and
/// constraint triggers then fire at the end of each of the handler's statements, inside its
/// subtransaction and as its role, instead of at the batch's commit as the worker's role; and
/// under the security-restricted operation PostgreSQL refuses to defer one to commit at all.
fn fire_constraints_immediately() {
    unsafe {
        let statement =
            PgBox::<pg_sys::ConstraintsSetStmt>::alloc_node(pg_sys::NodeTag::T_ConstraintsSetStmt);
        pg_sys::AfterTriggerSetState(statement.as_ptr());
    }
}

/// Clears what a handler can leave in the session beyond its subtransaction, before another job,
/// maybe another role's, runs: open cursors (portals), session advisory locks, temporary objects
/// (functions, domains and enum types can be made in pg_temp under the restriction), open large
/// objects, the seed of `random()` and a replication origin. PostgreSQL itself refuses PREPARE,
/// LISTEN and WITH HOLD cursors to the handler. The sequence caches go too: `lastval()` would name
/// the last job's sequence. Under the worker's lock timeout: dropping a temporary object can wait.
fn clear_session_state() {
    const USER_LOCKMETHOD: pg_sys::LOCKMETHODID = 2;
    unsafe {
        pg_sys::PortalHashTableDeleteAll();
        pg_sys::LockReleaseSession(USER_LOCKMETHOD);
        pg_sys::ResetTempTableNamespace();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| ResetSequenceCaches());
        let seed = randomness::new_seed();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            AtEOXact_LargeObject(true);
            pg_sys::DirectFunctionCall1Coll(Some(setseed), pg_sys::Oid::INVALID, seed.into_datum().unwrap());
        });
        // A replication origin set up for the session (where pg_replication_origin_session_setup
        // is granted) would tag every later commit of this session, the worker's own included,
        // so that subscribers filtering by origin skip them. As pg_replication_origin_session_reset.
        if pg_sys::replorigin_session_origin != pg_sys::InvalidRepOriginId as pg_sys::RepOriginId {
            pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| pg_sys::replorigin_session_reset());
            pg_sys::replorigin_session_origin = pg_sys::InvalidRepOriginId as pg_sys::RepOriginId;
            pg_sys::replorigin_session_origin_lsn = 0;
            pg_sys::replorigin_session_origin_timestamp = 0;
        }
    }
}

// Not in pgrx's bindings, or only as Rust wrappers: libpq/be-fsstubs.h, utils/fmgrprotos.h and
// utils/timeout.h. STATEMENT_TIMEOUT is the fourth TimeoutId on PostgreSQL 15 through 18;
// USER_TIMEOUT, which asks RegisterTimeout for a free slot, is 12 on 15 and 16, and 13 from 17
// on (TRANSACTION_TIMEOUT came before it); check timeout.h when adding a version.
const STATEMENT_TIMEOUT: std::ffi::c_int = 3;
#[cfg(any(feature = "pg15", feature = "pg16"))]
const USER_TIMEOUT: std::ffi::c_int = 12;
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
const USER_TIMEOUT: std::ffi::c_int = 13;
unsafe extern "C-unwind" {
    /// Closes every open large object descriptor, as the end of a transaction would.
    fn AtEOXact_LargeObject(is_commit: bool);
    /// commands/sequence.h: what `DISCARD SEQUENCES` does.
    fn ResetSequenceCaches();
    fn setseed(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
    fn enable_timeout_after(id: std::ffi::c_int, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: std::ffi::c_int, keep_indicator: bool);
    fn RegisterTimeout(
        id: std::ffi::c_int,
        handler: Option<unsafe extern "C-unwind" fn()>,
    ) -> std::ffi::c_int;
}

/// The timer that ends the worker when a handler outlives its lease: a handler can catch the
/// statement timeout's cancel (`EXCEPTION WHEN query_canceled`), not this. Its lease is over by
/// then, so its writes can never commit; the postmaster restarts the worker.
static LEASE_WATCHDOG: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
/// Set when the watchdog fired, so that the exit says why (PostgreSQL's own line blames an
/// administrator command).
static LEASE_OUTLIVED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

unsafe extern "C-unwind" fn handler_outlived_its_lease() {
    // What PostgreSQL's SIGTERM handler does: the next interrupt check exits the process.
    LEASE_OUTLIVED.store(true, std::sync::atomic::Ordering::Relaxed);
    unsafe {
        pg_sys::InterruptPending = 1;
        pg_sys::ProcDiePending = 1;
        pg_sys::SetLatch(pg_sys::MyLatch);
    }
}

unsafe extern "C-unwind" fn explain_exit(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
    if LEASE_OUTLIVED.load(std::sync::atomic::Ordering::Relaxed) {
        log!(
            "durable_jobs worker: a handler outlived its lease (it caught its statement timeout, or ran \
             code that does not check for interrupts); exiting"
        );
    }
}

fn lease_watchdog() -> std::ffi::c_int {
    use std::sync::atomic::Ordering;
    let mut id = LEASE_WATCHDOG.load(Ordering::Relaxed);
    if id < 0 {
        id = unsafe {
            pg_sys::before_shmem_exit(Some(explain_exit), pg_sys::Datum::from(0));
            pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
                RegisterTimeout(USER_TIMEOUT, Some(handler_outlived_its_lease))
            })
        };
        LEASE_WATCHDOG.store(id, Ordering::Relaxed);
    }
    id
}

/// Disarms the handler's statement timeout and the lease watchdog; called on every path.
pub fn disarm_statement_timeout() {
    unsafe {
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            disable_timeout(STATEMENT_TIMEOUT, false);
            let watchdog = LEASE_WATCHDOG.load(std::sync::atomic::Ordering::Relaxed);
            if watchdog >= 0 {
                disable_timeout(watchdog, false);
            }
        })
    };
}

/// Runs `f` as `role` under a statement timeout, inside a security-restricted operation, as
/// PostgreSQL runs maintenance commands on another role's table: the handler cannot `SET ROLE`,
/// `SET SESSION AUTHORIZATION`, create temporary objects, declare `WITH HOLD` cursors, `LISTEN`,
/// or defer a trigger to commit, so nothing it starts runs after it as anyone else. The GUC nest
/// level undoes any setting the handler changed; search_path is pinned, and lock_timeout is the
/// session's again, not the worker's own.
fn as_enqueuer(role: pg_sys::Oid, timeout_ms: i64, f: impl FnOnce()) {
    // The lease ends a margin after the statement timeout (at most 2 s); a second more, then stop.
    let watchdog_ms = (timeout_ms + 3000).min(i64::from(i32::MAX)) as i32;
    let timeout_ms = timeout_ms.min(i64::from(i32::MAX)) as i32;
    let mut saved_user = pg_sys::Oid::INVALID;
    let mut saved_context = 0;
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let level = pg_sys::NewGUCNestLevel();
        set_at_this_level(c"search_path", HANDLER_SEARCH_PATH);
        let session_lock_timeout = pg_sys::GetConfigOptionResetString(c"lock_timeout".as_ptr());
        set_at_this_level(c"lock_timeout", std::ffi::CStr::from_ptr(session_lock_timeout));
        let restricted = pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION;
        pg_sys::SetUserIdAndSecContext(role, saved_context | restricted as i32);
        let watchdog = lease_watchdog();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            enable_timeout_after(STATEMENT_TIMEOUT, timeout_ms);
            enable_timeout_after(watchdog, watchdog_ms);
        });
        f();
        disarm_statement_timeout();
        pg_sys::AtEOXact_GUC(false, level);
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
    }
}

/// An error caught in a job's subtransaction.
pub struct CaughtFailure {
    /// The SQLSTATE as PostgreSQL packs it (MAKE_SQLSTATE), so that it can be raised again.
    pub packed_sqlstate: i32,
    pub message: String,
}

impl CaughtFailure {
    pub fn sqlstate(&self) -> String {
        sqlstate_text(self.packed_sqlstate)
    }
}

/// Runs `f` in a subtransaction that is released when `f` returns true and rolled back when it
/// returns false or raises an error, whose SQLSTATE and message are returned. An error raised
/// while it is released (by another extension's subtransaction callback) rolls it back too and
/// is returned the same way, as PL/pgSQL's exception blocks do, unless the release had gone past
/// handing the subtransaction's writes to its parent: then it fails the whole transaction, whose
/// commit would otherwise keep them. User, memory context and resource owner are restored on
/// every path, and the statement timeout and lease watchdog, which also bound the release (a
/// callback may wait on another server), disarmed.
pub(crate) fn in_subtransaction(f: impl FnOnce() -> bool) -> Result<bool, CaughtFailure> {
    unsafe {
        let memory_context = pg_sys::CurrentMemoryContext;
        let resource_owner = pg_sys::CurrentResourceOwner;
        let mut saved_user = pg_sys::Oid::INVALID;
        let mut saved_context = 0;
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);

        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(memory_context);
        let caught = |error: pg_sys::panic::CaughtError| {
            let report = report_of(&error);
            Err(CaughtFailure {
                packed_sqlstate: report.sql_error_code() as i32,
                message: report.message().to_string(),
            })
        };
        let mut result =
            PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(f()))).catch_others(caught).execute();
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        if matches!(result, Ok(true)) {
            result = PgTryBuilder::new(|| {
                pg_sys::ReleaseCurrentSubTransaction();
                Ok(true)
            })
            .catch_others(|error| {
                // CommitSubTransaction moved on from "in progress" once it listed the
                // subtransaction among its parent's children (AtSubCommit_childXids).
                if !pg_sys::IsTransactionState() {
                    error.rethrow();
                }
                caught(error)
            })
            .execute();
            pg_sys::MemoryContextSwitchTo(memory_context);
        }
        if !matches!(result, Ok(true)) {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        disarm_statement_timeout();
        pg_sys::MemoryContextSwitchTo(memory_context);
        pg_sys::CurrentResourceOwner = resource_owner;
        result
    }
}

fn report_of(error: &pg_sys::panic::CaughtError) -> &pg_sys::panic::ErrorReportWithLevel {
    use pg_sys::panic::CaughtError;
    match error {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => report,
        CaughtError::RustPanic { ereport, .. } => ereport,
    }
}

pub fn sqlstate_of(error: &pg_sys::panic::CaughtError) -> String {
    sqlstate_text(report_of(error).sql_error_code() as i32)
}

/// Decodes a packed SQLSTATE (MAKE_SQLSTATE: five 6-bit characters, first in the low bits).
pub(crate) fn sqlstate_text(packed: i32) -> String {
    (0..5).map(|i| (((packed >> (6 * i)) & 0x3F) as u8 + b'0') as char).collect()
}
