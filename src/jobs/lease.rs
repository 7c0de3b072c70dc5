//! The lease state machine's transitions, which the SQL API and the background worker share:
//! claim, fenced completion and failure, renewal, batch completion and release.
//!
//! A lease is the triple (lease_owner, lease_token, lease_expires_at) on a running job. Every
//! transition out of `running` is fenced on all three, with expiry checked against
//! clock_timestamp() at that moment, so a worker whose lease lapsed or was taken over changes
//! nothing and is told `stale`. The statements are in `jobs::statements`.

use crate::jobs::attempts::{self, LapsedLease};
use crate::jobs::failure::FailureCode;
use crate::jobs::histograms::Observation;
use crate::jobs::rates;
use crate::jobs::slots;
use crate::jobs::statements::{
    one_kind, ALL_KINDS, CLAIM, CLAIM_FOR_WORKER, CLAIM_ON_OLD_SCHEMA, CLAIM_WITHOUT_HISTORY, COMPLETE,
    COMPLETE_BATCH, COMPLETE_BATCH_SKIPPING_HELD, COMPLETE_ON_OLD_SCHEMA, COMPLETE_WITHOUT_HISTORY,
    EXPIRE_EXHAUSTED, FAIL, FAIL_ON_OLD_SCHEMA, FAIL_WITHOUT_HISTORY, HELD_LEASES, RELEASE_UNSTARTED,
    RENEW_AFTER_ROLLBACK, RENEW_AFTER_ROLLBACK_WITHIN_LIMIT, RENEW_BATCH, RENEW_BATCH_SKIPPING_HELD,
    STATE_AND_PERMISSION,
};
use crate::jobs::waiters::{self, Change};
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner, as_extension_owner_of, Installed};
use crate::pg::randomness;
use crate::pg::settings;
use crate::pg::sql_types::JsonbDatum;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Runs a statement and returns its first row's first column; None when there is no row.
pub fn first_value_of<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    Spi::connect_mut(|client| first_value_in(client, query, args))
}

fn first_value_in<T: FromDatum + IntoDatum>(
    client: &mut pgrx::spi::SpiClient,
    query: &str,
    args: &[DatumWithOid],
) -> Option<T> {
    let rows = plans::execute(client, query, args);
    if rows.is_empty() {
        None
    } else {
        rows.first().get_one::<T>().expect(query)
    }
}

const ANY_CONCURRENCY_LIMIT: &str =
    "SELECT EXISTS (SELECT 1 FROM durable_jobs.durable_job_queue WHERE concurrency_limit IS NOT NULL)";

/// A claim statement taking up to `limit` jobs, of the one kind in parameter `kinds` when given
/// (`statements::one_kind`), otherwise of every kind in claim order. The limit is written into
/// the text: with a parameter there, the kept plan's generic form assumes a tenth of the queue
/// and hash-joins the whole job table, so PostgreSQL planned every call anew (a third of an API
/// call's time); with a number it keeps the generic plan after five calls. Written once per
/// statement, limit and source: a claim does not copy 4 KB.
pub(crate) fn claim_text(statement: &'static str, limit: i32, kinds: Option<&'static str>) -> Rc<str> {
    thread_local! {
        static WRITTEN: RefCell<HashMap<(usize, usize, i32, bool), Rc<str>>> = RefCell::new(HashMap::new());
    }
    WRITTEN.with(|written| {
        let key = (statement.as_ptr() as usize, statement.len(), limit, kinds.is_some());
        Rc::clone(written.borrow_mut().entry(key).or_insert_with(|| {
            let (kind, order) = match kinds {
                None => (ALL_KINDS.0.to_string(), ALL_KINDS.1),
                Some(kinds) => one_kind(kinds),
            };
            statement
                .replace("{limit}", &limit.to_string())
                .replace("{kind}", &kind)
                .replace("{order}", order)
                .into()
        }))
    })
}

// The kinds a background worker's claim may take: those with a registration.
const REGISTERED_KINDS: &str = "
    SELECT COALESCE(pg_catalog.array_agg(h.job_kind ORDER BY h.job_kind), '{}')
    FROM durable_jobs.durable_job_handler h";

/// One claimed job, as the claim returns it.
pub struct ClaimedJob {
    pub job_id: i64,
    pub lease_token: Uuid,
    pub lease_expires_at: TimestampWithTimeZone,
    pub job_kind: String,
    pub payload: JsonbDatum,
    pub attempt_count: i32,
    pub max_attempts: i32,
    pub enqueued_by: String,
    /// The kind's registered handler, and the role that registered it: claims of the background
    /// worker only.
    pub handler: Option<String>,
    pub registered_by: Option<String>,
}

/// How many exhausted leases one expiry ends at most (the `LIMIT` of `expire_exhausted_ctes`).
pub const EXPIRE_BATCH: usize = 100;

/// The background worker's expiry of exhausted leases (`EXPIRE_EXHAUSTED`), in the current
/// transaction; their waiters wake at its commit. Returns how many it ended.
pub fn expire_exhausted_leases() -> usize {
    as_extension_owner(|| Spi::connect_mut(|client| expire_in(client, DatumWithOid::null::<Vec<String>>())))
}

/// `EXPIRE_EXHAUSTED` in the queues `queues` (NULL: every queue), with the attempts it ended
/// recorded; returns how many it ended.
fn expire_in(client: &mut pgrx::spi::SpiClient, queues: DatumWithOid) -> usize {
    let mut lapsed = Vec::new();
    let expired: Vec<i64> = plans::execute(client, EXPIRE_EXHAUSTED, &[queues])
        .map(|row| {
            let job_id = row.get(1).unwrap().unwrap();
            lapsed.extend(LapsedLease::from_row(&row, job_id, 2));
            job_id
        })
        .collect();
    attempts::record_lapsed_leases(client, lapsed);
    let count = expired.len();
    waiters::wake_waiters_at_commit(expired, Change::Terminal);
    count
}

/// The claim shared by the SQL API and the background worker, which passes `handlers_only` to
/// take only kinds with a registered handler, and may take up to `limit` jobs at once. Run as
/// the extension owner `installed` names (`as_extension_owner_of`, or the worker's
/// `as_extension_owner_found` with the row its version check read). Arguments are already
/// validated.
pub fn claim_jobs(
    installed: Installed,
    worker_id: &str,
    queue_names: Option<&[String]>,
    job_kinds: Option<&[String]>,
    lease_seconds: i32,
    handlers_only: bool,
    limit: i32,
) -> Vec<ClaimedJob> {
    Spi::connect_mut(|client| {
        let names = |names: Option<&[String]>| -> DatumWithOid {
            match names {
                Some(names) => names.to_vec().into(),
                None => DatumWithOid::null::<Vec<String>>(),
            }
        };
        // The kinds the claim reads from the kind's index: a worker's registered kinds (none: no
        // claim), the SQL API's `job_kinds`; on a schema with that index.
        let kinds: Option<Vec<String>> = match (handlers_only, installed.has_attempt_history, job_kinds) {
            (true, ..) => Some(first_value_in(client, REGISTERED_KINDS, &[]).unwrap_or_default()),
            (false, true, Some(kinds)) => Some(kinds.to_vec()),
            _ => None,
        };
        if kinds.as_ref().is_some_and(|kinds| kinds.is_empty()) {
            return Vec::new();
        }
        // A claim of queues that are all closed now (paused, full, or out of rate tokens) takes
        // nothing, and reads none of their jobs; it still ends their exhausted leases, as the
        // SQL API's claim statement does.
        if installed.has_attempt_history
            && queue_names.is_some_and(|queues| queues.iter().all(|queue| slots::queue_closed(client, queue)))
        {
            if !handlers_only {
                expire_in(client, names(queue_names));
            }
            return Vec::new();
        }
        // A claim of one kind reads that kind's range of the claim order; the SQL API's kinds
        // are $5, the worker's $7.
        let kinds_parameter =
            kinds.as_ref().filter(|kinds| kinds.len() == 1).map(|_| if handlers_only { "$7" } else { "$5" });
        let claim = |client: &mut pgrx::spi::SpiClient, count: i32| -> Vec<ClaimedJob> {
            let lease_tokens: Vec<Uuid> = (0..count).map(|_| randomness::new_uuid()).collect();
            let args = [
                names(queue_names),
                worker_id.into(),
                f64::from(lease_seconds).into(),
                handlers_only.into(),
                names(job_kinds),
                lease_tokens.into(),
                names(kinds.as_deref().filter(|_| handlers_only)),
            ];
            let statement = match (handlers_only, installed.has_attempt_history, installed.has_status_api) {
                (true, ..) => CLAIM_FOR_WORKER,
                (false, true, _) => CLAIM,
                (false, false, true) => CLAIM_WITHOUT_HISTORY,
                (false, false, false) => CLAIM_ON_OLD_SCHEMA,
            };
            let mut expired = Vec::new();
            // The attempts before: lapsed leases the claim took over or the expiry ended (their
            // columns follow the handler's, on a schema with the attempt history).
            let mut lapsed = Vec::new();
            let history_columns = if handlers_only { 11 } else { 9 };
            slots::new_claim();
            rates::new_claim();
            let claimed: Vec<ClaimedJob> =
                plans::execute_in_claim_order(client, &claim_text(statement, count, kinds_parameter), &args)
                    .filter(|row| {
                        let job_id = row.get::<i64>(1).unwrap().unwrap();
                        if installed.has_attempt_history || handlers_only {
                            lapsed.extend(LapsedLease::from_row(row, job_id, history_columns));
                        }
                        let is_claimed = row.get::<Uuid>(2).unwrap().is_some();
                        if !is_claimed {
                            expired.push(job_id);
                        }
                        is_claimed
                    })
                    .map(|row| ClaimedJob {
                        job_id: row.get(1).unwrap().unwrap(),
                        lease_token: row.get(2).unwrap().unwrap(),
                        lease_expires_at: row.get(3).unwrap().unwrap(),
                        job_kind: row.get(4).unwrap().unwrap(),
                        payload: row.get(5).unwrap().unwrap(),
                        attempt_count: row.get(6).unwrap().unwrap(),
                        max_attempts: row.get(7).unwrap().unwrap(),
                        enqueued_by: row.get(8).unwrap().unwrap(),
                        handler: if handlers_only { row.get(9).unwrap() } else { None },
                        registered_by: if handlers_only { row.get(10).unwrap() } else { None },
                    })
                    .collect();
            attempts::record_lapsed_leases(client, lapsed);
            waiters::wake_waiters_at_commit(claimed.iter().map(|job| job.job_id), Change::Other);
            waiters::wake_waiters_at_commit(expired, Change::Terminal);
            claimed
        };
        // Limits by place (`jobs::slots`) hold for a batch claimed in one statement. Limits by
        // lock, on a schema from before 0.6.0: a statement does not see its own claims when it
        // checks a queue's concurrency limit, so with limits in force a batch is claimed one job
        // per statement.
        let limits_by_place = installed.has_attempt_history || handlers_only;
        let mut claimed = Vec::new();
        if limit == 1 || limits_by_place || first_value_in(client, ANY_CONCURRENCY_LIMIT, &[]) != Some(true) {
            claimed = claim(client, limit);
            // A limit set between the check and the claim (the claim's snapshot is later):
            // all but the first job go back, and the batch is claimed one by one.
            if claimed.len() < 2
                || limits_by_place
                || first_value_in(client, ANY_CONCURRENCY_LIMIT, &[]) != Some(true)
            {
                return claimed;
            }
            let extra: Vec<(i64, Uuid)> =
                claimed.drain(1..).map(|job| (job.job_id, job.lease_token)).collect();
            release_unstarted(&extra, worker_id);
        }
        while claimed.len() < limit as usize {
            let one = claim(client, 1);
            if one.is_empty() {
                break;
            }
            claimed.extend(one);
        }
        claimed
    })
}

/// The attempt a completion or failure returned (columns `first`, `first + 1`, `first + 2`:
/// queue, wait and run time), when the schema keeps its start.
fn observation(row: &pgrx::spi::SpiHeapTupleData, first: usize) -> Option<Observation> {
    Some(Observation {
        queue: row.get(first).ok()??,
        wait_microseconds: row.get(first + 1).ok()??,
        run_microseconds: row.get(first + 2).ok()??,
    })
}

/// Runs a fenced transition that returns one row, `(outcome, queue, wait, run)` where the
/// schema has the attempt history, else `(outcome)`.
fn fenced<T: FromDatum + IntoDatum>(
    statement: &str,
    args: &[DatumWithOid],
) -> Option<(T, Option<Observation>)> {
    Spi::connect_mut(|client| {
        let rows = plans::execute(client, statement, args);
        let row = rows.into_iter().next()?;
        let outcome = row.get::<T>(1).expect(statement)?;
        let observed = if row.columns() == 4 { observation(&row, 2) } else { None };
        Some((outcome, observed))
    })
}

/// Fenced completion: `succeeded` (with the attempt, for the histograms) or `stale`.
pub fn complete_job(job_id: i64, worker_id: &str, lease_token: Uuid) -> (&'static str, Option<Observation>) {
    let args = [job_id.into(), worker_id.into(), lease_token.into()];
    let completed = as_extension_owner_of(|installed| {
        let statement = match (installed.has_attempt_history, installed.has_status_api) {
            (true, _) => COMPLETE,
            (false, true) => COMPLETE_WITHOUT_HISTORY,
            (false, false) => COMPLETE_ON_OLD_SCHEMA,
        };
        fenced::<i64>(statement, &args)
    });
    match completed {
        Some((_, observed)) => {
            waiters::wake_waiters_at_commit([job_id], Change::Terminal);
            ("succeeded", observed)
        }
        None => ("stale", None),
    }
}

/// Fenced failure: `retried`, `failed` (with the attempt, for the histograms) or `stale`.
/// `sqlstate`: that of the handler error behind it, when the background worker ran the handler;
/// `message`, the error's text, which the attempt keeps (`attempts::kept_message`).
pub fn fail_job(
    job_id: i64,
    worker_id: &str,
    lease_token: Uuid,
    code: FailureCode,
    sqlstate: Option<&str>,
    message: Option<&str>,
) -> (&'static str, Option<Observation>) {
    let mut args: Vec<DatumWithOid> = vec![
        job_id.into(),
        worker_id.into(),
        lease_token.into(),
        code.is_retryable().into(),
        settings::RETRY_BASE_DELAY.get().into(),
        settings::RETRY_MAX_DELAY.get().into(),
        code.as_str().into(),
    ];
    let outcome = as_extension_owner_of(|installed| {
        if installed.has_attempt_history {
            args.push(sqlstate.into());
            args.push(attempts::kept_message(message).into());
            fenced::<String>(FAIL, &args)
        } else if installed.has_status_api {
            args.push(sqlstate.into());
            fenced::<String>(FAIL_WITHOUT_HISTORY, &args)
        } else {
            fenced::<String>(FAIL_ON_OLD_SCHEMA, &args)
        }
    });
    match outcome {
        Some((state, observed)) if state == "available" => {
            waiters::wake_waiters_at_commit([job_id], Change::Other);
            ("retried", observed)
        }
        Some((_, observed)) => {
            waiters::wake_waiters_at_commit([job_id], Change::Terminal);
            ("failed", observed)
        }
        None => ("stale", None),
    }
}

/// Runs one of the worker's statements over a set of leases, as the extension owner: $1 their
/// job ids, $2 their tokens, $3 `worker_id`, then `more`; returns each row's two columns.
fn over_leases<T: FromDatum + IntoDatum>(
    statement: &str,
    leases: &[(i64, Uuid)],
    worker_id: &str,
    more: Option<DatumWithOid>,
) -> Vec<(i64, T)> {
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let args: Vec<DatumWithOid> =
        [ids.into(), tokens.into(), worker_id.into()].into_iter().chain(more).collect();
    as_extension_owner(|| {
        Spi::connect_mut(|client| {
            plans::execute_generic(client, statement, &args)
                .map(|row| (row.get(1).unwrap().unwrap(), row.get(2).unwrap().unwrap()))
                .collect()
        })
    })
}

/// Renews the leases of `jobs` held by `worker_id`; returns (job_id, new expiry in Unix
/// microseconds) for each lease that was still live. `skip_held`: rows another session holds
/// are left out instead of waited for.
pub fn renew_leases(
    jobs: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
    skip_held: bool,
) -> Vec<(i64, i64)> {
    let statement = if skip_held { RENEW_BATCH_SKIPPING_HELD } else { RENEW_BATCH };
    over_leases(statement, jobs, worker_id, Some(f64::from(lease_seconds).into()))
}

/// `renew_leases` (skipping held rows) after the transaction that renewed them last failed:
/// also the leases that lapsed meanwhile and no one took (RENEW_AFTER_ROLLBACK), those of a
/// queue with a concurrency limit one at a time while it has room (others may have filled it).
pub fn renew_leases_after_rollback(
    jobs: &[(i64, Uuid)],
    worker_id: &str,
    lease_seconds: i32,
) -> Vec<(i64, i64)> {
    let lease = || Some(f64::from(lease_seconds).into());
    let mut renewed = over_leases(RENEW_AFTER_ROLLBACK, jobs, worker_id, lease());
    let ids: Vec<i64> = renewed.iter().map(|(id, _)| *id).collect();
    for job in jobs.iter().filter(|(id, _)| !ids.contains(id)) {
        slots::new_claim();
        renewed.extend(over_leases::<i64>(RENEW_AFTER_ROLLBACK_WITHIN_LIMIT, &[*job], worker_id, lease()));
    }
    renewed
}

/// Marks `jobs` succeeded, fenced on each lease as `complete_job` is; returns the ids of those
/// that were, with their attempts. `skip_held`: rows another session holds are left out instead
/// of waited for. The background worker's only (a schema of its version).
pub fn complete_jobs(
    jobs: &[(i64, Uuid)],
    worker_id: &str,
    skip_held: bool,
) -> Vec<(i64, Option<Observation>)> {
    let statement = if skip_held { COMPLETE_BATCH_SKIPPING_HELD } else { COMPLETE_BATCH };
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = jobs.iter().copied().unzip();
    let args: [DatumWithOid; 3] = [ids.into(), tokens.into(), worker_id.into()];
    let completed: Vec<(i64, Option<Observation>)> = as_extension_owner(|| {
        Spi::connect_mut(|client| {
            plans::execute_generic(client, statement, &args)
                .map(|row| (row.get(1).unwrap().expect("job_id"), observation(&row, 2)))
                .collect()
        })
    });
    waiters::wake_waiters_at_commit(completed.iter().map(|(id, _)| *id), Change::Terminal);
    completed
}

/// The leases among `leases` that `worker_id` still holds, live, in their order.
pub fn held_leases(leases: &[(i64, Uuid)], worker_id: &str) -> Vec<(i64, Uuid)> {
    over_leases(HELD_LEASES, leases, worker_id, None)
}

/// Gives `jobs`, claimed by `worker_id` but never started, back to the queue with their attempt.
pub fn release_unstarted(jobs: &[(i64, Uuid)], worker_id: &str) {
    // No rows come back: the statement returns none.
    over_leases::<i64>(RELEASE_UNSTARTED, jobs, worker_id, None);
    waiters::wake_waiters_at_commit(jobs.iter().map(|(id, _)| *id), Change::Other);
}

/// A job's state and whether the caller may act on it ($1 the job, $2 the caller, $3 whether it
/// sees every job); None when there is no such job.
pub(crate) fn state_and_permission(
    client: &mut pgrx::spi::SpiClient,
    args: &[DatumWithOid],
) -> Option<(String, bool)> {
    let found = plans::execute(client, STATE_AND_PERMISSION, args);
    if found.is_empty() {
        return None;
    }
    let row = found.first();
    Some((row.get(1).unwrap().expect("job_state"), row.get(2).unwrap().expect("permission")))
}
