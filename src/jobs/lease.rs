//! The lease state machine: claim, complete, fail, extend, cancel.
//!
//! A lease is the triple (lease_owner, lease_token, lease_expires_at) on a running job. Every
//! transition out of `running` is fenced on all three, with expiry checked against
//! clock_timestamp() at that moment, so a worker whose lease lapsed or was taken over changes
//! nothing and is told `stale`.

use crate::jobs::arguments;
use crate::jobs::failure::FailureCode;
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner, as_extension_owner_of, caller, Installed};
use crate::pg::randomness;
use crate::pg::settings;
use crate::pg::sql_types::JsonbDatum;
use crate::jobs::waiters::{self, Change};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// The lease columns as they are after leaving `running`; shared by every transition. A macro,
/// so that the statements are assembled at compile time with `concat!`.
macro_rules! release_lease {
    () => {
        "lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, \
         updated_at = pg_catalog.clock_timestamp()"
    };
}

/// A change of state or lease: the job's state_version moves up (schemas from 0.4.0 on).
macro_rules! new_state_version {
    () => {
        "state_version = state_version + 1, "
    };
}

/// Matches only the running job whose live lease is exactly ($2, $3). Only a running job holds
/// a lease token (durable_job_lease_only_while_running), so the token is the state check. Naming
/// job_state would let the planner take the partial index of running jobs, which it does when
/// its statistics say no job runs, and read every running job's entries to find this one.
macro_rules! lease_fence {
    () => {
        "job_id = $1 AND lease_token = $3 AND lease_owner = $2 \
         AND lease_expires_at > pg_catalog.clock_timestamp()"
    };
}

// Expired leases with no attempts left end as `lease_expired` instead of being claimed again
// (up to 100 per call), in the queues $1 names (NULL: every queue). `$expired` adds the status
// columns' changes where the schema has them.
macro_rules! expire_exhausted_ctes {
    ($expired:expr) => {
        concat!(
            "
                exhausted AS (
                    SELECT job_id FROM durable_jobs.durable_job
                    WHERE job_state = 'running'
                      AND lease_expires_at <= pg_catalog.clock_timestamp()
                      AND attempt_count >= max_attempts
                      AND ($1::pg_catalog.text[] IS NULL OR queue_name = ANY ($1))
                    ORDER BY lease_expires_at
                    LIMIT 100
                    FOR UPDATE SKIP LOCKED),
                expired AS (
                    UPDATE durable_jobs.durable_job x
                    SET job_state = 'failed', last_failure_code = 'lease_expired',
                        finished_at = pg_catalog.clock_timestamp(), ",
            $expired,
            release_lease!(),
            "
                    FROM exhausted WHERE x.job_id = exhausted.job_id
                    RETURNING x.job_id)"
        )
    };
}

// The best ready jobs in the queues $1 names are claimed. A job is ready by the clock, not by
// the transaction's start: the worker claims ahead at the end of a transaction that ran a
// batch. `$claimed` adds the status columns' changes where the schema has them, `$returning`
// columns after the eight every claim returns. The lease tokens come in $6, one per job the
// claim may take (`randomness`), handed out in claim order.
macro_rules! claim_ctes {
    ($kind_filter:expr, $claimed:expr, $returning:expr) => {
        concat!(
            "
                -- Queues no one may claim from now: paused, or at their concurrency limit. Anti-joins keep
                -- the claim an index scan; a limited queue with room left is checked under its lock.
                closed AS MATERIALIZED (
                    SELECT q.queue_name FROM durable_jobs.durable_job_queue q
                    WHERE q.paused
                       OR (q.concurrency_limit IS NOT NULL
                           AND durable_jobs.durable_job_queue_running(q.queue_name) >= q.concurrency_limit)),
                candidate AS (
                    SELECT job_id FROM durable_jobs.durable_job
                    WHERE ((job_state = 'available' AND run_after <= pg_catalog.clock_timestamp())
                           OR (job_state = 'running'
                               AND lease_expires_at <= pg_catalog.clock_timestamp()
                               AND attempt_count < max_attempts))
                      AND ($1::pg_catalog.text[] IS NULL OR queue_name = ANY ($1))
                      AND NOT EXISTS (SELECT 1 FROM closed WHERE closed.queue_name = durable_job.queue_name)
                      AND NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job_queue q
                                      WHERE q.queue_name = durable_job.queue_name AND q.concurrency_limit IS NOT NULL
                                        AND NOT durable_jobs.durable_job_queue_has_capacity(q.queue_name))
                      ",
            $kind_filter,
            "
                    ORDER BY priority DESC, run_after, job_id
                    LIMIT {limit}
                    FOR UPDATE OF durable_job SKIP LOCKED),
                numbered AS (SELECT job_id, pg_catalog.row_number() OVER () AS n FROM candidate),
                claimed AS (
                UPDATE durable_jobs.durable_job j
                SET job_state = 'running', ",
            $claimed,
            "
                    lease_owner = $2,
                    lease_token = ($6::pg_catalog.uuid[])[numbered.n],
                    lease_expires_at = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $3),
                    attempt_count = j.attempt_count + 1,
                    updated_at = pg_catalog.clock_timestamp()
                FROM numbered WHERE j.job_id = numbered.job_id
                RETURNING j.job_id, j.lease_token, j.lease_expires_at, j.job_kind, j.payload,
                          j.attempt_count, j.max_attempts, j.enqueued_by::pg_catalog.text",
            $returning,
            ")"
        )
    };
}

// The SQL API's claim, one statement: first exhausted leases expire, then jobs are claimed. The
// two parts touch disjoint rows (attempts used up or not).
macro_rules! claim_statement {
    ($kind_filter:expr, $claimed:expr, $expired:expr) => {
        concat!(
            "WITH",
            expire_exhausted_ctes!($expired),
            ",",
            claim_ctes!($kind_filter, $claimed, ""),
            "
                -- The claimed jobs, then the expired ones (no lease token), whose waiters wake too.
                SELECT * FROM claimed
                UNION ALL
                SELECT job_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM expired"
        )
    };
}

// A job that ends as `lease_expired` has no handler error behind it.
macro_rules! expiry_columns {
    () => {
        concat!(new_state_version!(), "last_failure_sqlstate = NULL, ")
    };
}

// The SQL API's claim ($4 false) takes the kinds in $5, NULL meaning any kind.
macro_rules! any_kind {
    () => {
        "AND NOT $4 AND ($5::pg_catalog.text[] IS NULL OR job_kind = ANY ($5))"
    };
}

pub(crate) const CLAIM: &str = claim_statement!(any_kind!(), new_state_version!(), expiry_columns!());

// The same on a schema from before 0.4.0, which this library serves until ALTER EXTENSION
// durable_jobs UPDATE.
pub(crate) const CLAIM_ON_OLD_SCHEMA: &str = claim_statement!(any_kind!(), "", "");

// The background worker's claim ($4 true) takes a kind only from the enqueuers its registration
// serves: a superuser's registration serves every role, another role's only the roles that have
// its privileges, so nobody can take over the jobs of a kind others serve. Without the expiry of
// exhausted leases, which the worker runs apart, once a second (`EXPIRE_EXHAUSTED`): starting
// that UPDATE's executor on every claim was a tenth of the path from enqueue to handler.
pub(crate) const CLAIM_FOR_WORKER: &str = concat!(
    "WITH",
    claim_ctes!(
        concat!(
            "AND $4 AND EXISTS (
         SELECT 1 FROM durable_jobs.durable_job_handler h
         WHERE h.job_kind = durable_job.job_kind AND ",
            crate::registration_serves!("h.registered_by", "durable_job.enqueued_by"),
            ")"
        ),
        new_state_version!(),
        // The kind's handler and who registered it, so that a batch run right after this claim
        // commits need not read its jobs again (`execution::ClaimedRow`).
        ",
                          (SELECT h.handler FROM durable_jobs.durable_job_handler h
                           WHERE h.job_kind = j.job_kind),
                          (SELECT h.registered_by::pg_catalog.text FROM durable_jobs.durable_job_handler h
                           WHERE h.job_kind = j.job_kind)"
    ),
    "
    SELECT * FROM claimed"
);

/// The worker's expiry of exhausted leases in every queue ($1 NULL); returns the expired jobs.
pub(crate) const EXPIRE_EXHAUSTED: &str =
    concat!("WITH", expire_exhausted_ctes!(expiry_columns!()), " SELECT job_id FROM expired");

macro_rules! complete_statement {
    ($status_columns:expr) => {
        concat!(
            "
            UPDATE durable_jobs.durable_job
            SET job_state = 'succeeded', payload = NULL, finished_at = pg_catalog.clock_timestamp(), ",
            $status_columns,
            release_lease!(),
            "
            WHERE ",
            lease_fence!(),
            "
            RETURNING job_id"
        )
    };
}

pub(crate) const COMPLETE: &str = complete_statement!(new_state_version!());
const COMPLETE_ON_OLD_SCHEMA: &str = complete_statement!("");

// $4: the code is retryable; $5: base delay (ms); $6: maximum delay (s); $7: the code; with
// the status columns, $8: the SQLSTATE of the handler error (NULL from external workers).
// Backoff: base * 2^(attempt - 1), capped, times a jitter factor in [0.5, 1).
macro_rules! fail_statement {
    ($status_columns:expr) => {
        concat!(
            "
            UPDATE durable_jobs.durable_job
            SET job_state = CASE WHEN $4 AND attempt_count < max_attempts THEN 'available' ELSE 'failed' END,
                run_after = CASE WHEN $4 AND attempt_count < max_attempts
                    THEN pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs =>
                         LEAST($6::float8, $5::float8 / 1000 * 2.0::float8 ^ (attempt_count - 1))
                         * (0.5 + 0.5 * pg_catalog.random()))
                    ELSE run_after END,
                finished_at = CASE WHEN $4 AND attempt_count < max_attempts THEN NULL
                                   ELSE pg_catalog.clock_timestamp() END,
                last_failure_code = $7,
                ",
            $status_columns,
            release_lease!(),
            "
            WHERE ",
            lease_fence!(),
            "
            RETURNING job_state"
        )
    };
}

pub(crate) const FAIL: &str = fail_statement!(concat!(new_state_version!(), "last_failure_sqlstate = $8, "));
const FAIL_ON_OLD_SCHEMA: &str = fail_statement!("");

pub(crate) const EXTEND: &str = concat!(
    "
    UPDATE durable_jobs.durable_job
    SET lease_expires_at = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $4),
        updated_at = pg_catalog.clock_timestamp()
    WHERE ",
    lease_fence!(),
    "
    RETURNING lease_expires_at"
);

// The leases ($1 job ids, $2 tokens) that `lease_owner` $3 still holds, locked for the
// background worker's statement that follows (`WITH live AS (...) UPDATE ... FROM live`), as
// that UPDATE would lock them (a foreign key's check of a job does not count as holding it).
// `$live`: the condition that the lease has not expired, or nothing (see RENEW_AFTER_ROLLBACK).
// `$lock`: how a row another session holds is met: waited for (a claim of another worker holds
// it for a moment), or skipped, so that only that job (its enqueuer cancelling it, say) is left
// to its lease.
macro_rules! leases_locked {
    ($live:literal, $lock:literal) => {
        concat!(
            "
            WITH live AS (
                SELECT x.job_id FROM durable_jobs.durable_job x
                JOIN ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
                     AS c(job_id, lease_token) ON x.job_id = c.job_id AND x.lease_token = c.lease_token
                WHERE x.job_id = ANY ($1) AND x.lease_owner = $3",
            $live,
            "
                FOR NO KEY UPDATE OF x",
            $lock,
            ")"
        )
    };
}

// `leases_locked`, of live leases only.
macro_rules! live_leases_locked {
    ($lock:literal) => {
        leases_locked!(
            "
                  AND x.lease_expires_at > pg_catalog.clock_timestamp()",
            $lock
        )
    };
}

// `leases_locked`: live, or lapsed in a queue without a concurrency limit (reviving a lapsed
// lease starts a job again, which a limit must allow: `held_lease_within_limit_locked`).
macro_rules! held_leases_locked {
    ($lock:literal) => {
        leases_locked!(
            "
                  AND (x.lease_expires_at > pg_catalog.clock_timestamp()
                       OR NOT EXISTS (SELECT FROM durable_jobs.durable_job_queue q
                                      WHERE q.queue_name = x.queue_name AND q.concurrency_limit IS NOT NULL))",
            $lock
        )
    };
}

// `leases_locked`, for one lapsed lease of a queue with a concurrency limit, while the queue has
// room for one more running job, under the queue's lock as a claim asks it (one job per
// statement: a statement does not see its own revivals).
macro_rules! held_lease_within_limit_locked {
    ($lock:literal) => {
        leases_locked!(
            "
                  AND x.lease_expires_at <= pg_catalog.clock_timestamp()
                  AND EXISTS (SELECT FROM durable_jobs.durable_job_queue q
                              WHERE q.queue_name = x.queue_name AND q.concurrency_limit IS NOT NULL)
                  AND durable_jobs.durable_job_queue_has_capacity(x.queue_name)",
            $lock
        )
    };
}

// The background worker's renewal of the leases of a batch's jobs not yet run, so that each
// handler gets a whole lease (and the jobs stay locked by the batch's transaction). Fenced like
// EXTEND (the token is the state check); returns each renewed job with its new expiry in Unix
// microseconds. `$leases`: live_leases_locked or held_leases_locked.
macro_rules! renew_statement {
    ($leases:ident, $lock:literal) => {
        concat!(
            $leases!($lock),
            "
            UPDATE durable_jobs.durable_job j
            SET lease_expires_at = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $4),
                updated_at = pg_catalog.clock_timestamp()
            FROM live WHERE j.job_id = live.job_id AND j.job_id = ANY ($1)
            RETURNING j.job_id, (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8"
        )
    };
}
pub(crate) const RENEW_BATCH: &str = renew_statement!(live_leases_locked, "");
pub(crate) const RENEW_BATCH_SKIPPING_HELD: &str = renew_statement!(live_leases_locked, " SKIP LOCKED");
// After a run transaction failed: its renewals went with it, and the leases the claim committed
// may have lapsed meanwhile (a batch runs past them on renewals of its own). A lapsed lease still
// under the worker's owner and token was taken by no one (a reclaim, a cancel, an expiry and a
// completion all change or clear the token), so it is the worker's to renew, as if in time.
pub(crate) const RENEW_AFTER_ROLLBACK: &str = renew_statement!(held_leases_locked, " SKIP LOCKED");
pub(crate) const RENEW_AFTER_ROLLBACK_WITHIN_LIMIT: &str =
    renew_statement!(held_lease_within_limit_locked, " SKIP LOCKED");

// The successes of a batch in one statement: what COMPLETE does, for each live lease. The worker
// runs it skipping held rows first, then for each held row alone, under its short wait for it
// (see `RowWaits` in execution.rs).
macro_rules! complete_batch_statement {
    ($lock:literal) => {
        concat!(
            live_leases_locked!($lock),
            "
            UPDATE durable_jobs.durable_job j
            SET job_state = 'succeeded', payload = NULL, finished_at = pg_catalog.clock_timestamp(), ",
            new_state_version!(),
            release_lease!(),
            "
            FROM live WHERE j.job_id = live.job_id AND j.job_id = ANY ($1)
            RETURNING j.job_id, j.state_version"
        )
    };
}
pub(crate) const COMPLETE_BATCH: &str = complete_batch_statement!("");
pub(crate) const COMPLETE_BATCH_SKIPPING_HELD: &str = complete_batch_statement!(" SKIP LOCKED");

// Which of the leases ($1 job ids, $2 tokens) `lease_owner` $3 still holds, in the order given:
// what a role runner takes over from the worker that claimed them.
pub(crate) const HELD_LEASES: &str = "
    SELECT j.job_id, j.lease_token
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
         WITH ORDINALITY AS c(job_id, lease_token, position)
    JOIN durable_jobs.durable_job j ON j.job_id = c.job_id AND j.lease_token = c.lease_token
    WHERE j.job_id = ANY ($1) AND j.lease_owner = $3 AND j.lease_expires_at > pg_catalog.clock_timestamp()
    ORDER BY c.position";

// Gives claimed jobs that never started back, with their attempt: available again in a second.
// Only the background worker runs it, which waits for a schema of its own version. A row another
// session holds (its enqueuer cancelling it, say) is skipped, left to its lease: the statement
// waits only for a lock on the whole table.
pub(crate) const RELEASE_UNSTARTED: &str = concat!(
    live_leases_locked!(" SKIP LOCKED"),
    "
    UPDATE durable_jobs.durable_job j
    SET job_state = 'available', attempt_count = j.attempt_count - 1, ",
    new_state_version!(),
    "
        run_after = pg_catalog.clock_timestamp() + interval '1 second', ",
    release_lease!(),
    "
    FROM live WHERE j.job_id = live.job_id AND j.job_id = ANY ($1)"
);

// $2, $3: the caller's role and whether it is a superuser. A job belongs to the role that
// enqueued it; members of that role (with its privileges) may act on it too.
macro_rules! caller_may_act_on_job {
    () => {
        crate::has_privileges_of_role!("$3", "$2", "j.enqueued_by")
    };
}

// Locks a job that can be cancelled, if the caller may: a caller that may not act on a job never
// locks (or waits for) its row, since a row someone holds makes the worker's batch wait, then
// run again.
const LOCK_FOR_CANCEL: &str = concat!(
    "
    SELECT j.job_state, j.last_failure_code
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1 AND j.job_state IN ('available', 'running') AND ",
    caller_may_act_on_job!(),
    "
    FOR UPDATE OF j"
);

/// Why a job was not locked for a change: its state and whether the caller may act on it (no
/// row: there is no such job). $1 the job, $2 the caller, $3 whether it is a superuser.
const STATE_AND_PERMISSION: &str = concat!(
    "
    SELECT j.job_state, ",
    caller_may_act_on_job!(),
    "
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1"
);

macro_rules! cancel_statement {
    ($status_columns:expr) => {
        concat!(
            "
            UPDATE durable_jobs.durable_job
            SET job_state = 'cancelled', finished_at = pg_catalog.clock_timestamp(), ",
            $status_columns,
            release_lease!(),
            "
            WHERE job_id = $1 AND job_state IN ('available', 'running')
            RETURNING job_id"
        )
    };
}

// The cancellation and its audit row in one statement; $2: the caller, $3, $4: the job's state
// and last failure code before.
const CANCEL: &str = concat!(
    "WITH cancelled AS (",
    cancel_statement!(new_state_version!()),
    ")
    INSERT INTO durable_jobs.durable_job_audit
        (job_id, action, acted_by, previous_state, previous_failure_code)
    SELECT job_id, 'cancel', $2::pg_catalog.name, $3, $4 FROM cancelled
    RETURNING job_id"
);
const CANCEL_ON_OLD_SCHEMA: &str = cancel_statement!("");

/// Runs a statement as the extension owner and returns its first row's first column, if any.
fn first_value<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    as_extension_owner(|| first_value_of(query, args))
}

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

/// The fenced arguments every lease holder passes: job, owner, token.
struct LeaseHolder {
    job_id: i64,
    worker_id: String,
    lease_token: Uuid,
}

impl LeaseHolder {
    fn new(job_id: Option<i64>, worker_id: Option<String>, lease_token: Option<Uuid>) -> Self {
        LeaseHolder {
            job_id: arguments::required(job_id, "job_id"),
            worker_id: arguments::name(worker_id, "worker_id"),
            lease_token: arguments::required(lease_token, "lease_token"),
        }
    }

    fn args(&self) -> [DatumWithOid<'_>; 3] {
        [self.job_id.into(), self.worker_id.as_str().into(), self.lease_token.into()]
    }
}

/// A claim statement taking up to `limit` jobs. The limit is written into the text: with a
/// parameter there, the kept plan's generic form assumes a tenth of the queue and hash-joins the
/// whole job table, so PostgreSQL planned every call anew (a third of an API call's time); with
/// a number it keeps the generic plan after five calls. Written once per statement and limit
/// (there are three statements, and limits up to the batch size): a claim does not copy 4 KB.
pub(crate) fn with_limit(statement: &'static str, limit: i32) -> Rc<str> {
    thread_local! {
        static WRITTEN: RefCell<HashMap<(usize, usize, i32), Rc<str>>> = RefCell::new(HashMap::new());
    }
    WRITTEN.with(|written| {
        let key = (statement.as_ptr() as usize, statement.len(), limit);
        Rc::clone(
            written
                .borrow_mut()
                .entry(key)
                .or_insert_with(|| statement.replace("{limit}", &limit.to_string()).into()),
        )
    })
}

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
    as_extension_owner(|| {
        Spi::connect_mut(|client| {
            let expired: Vec<i64> =
                plans::execute(client, EXPIRE_EXHAUSTED, &[DatumWithOid::null::<Vec<String>>()])
                    .map(|row| row.get(1).unwrap().unwrap())
                    .collect();
            let count = expired.len();
            waiters::wake_waiters_at_commit(expired, Change::Terminal);
            count
        })
    })
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
        let claim = |client: &mut pgrx::spi::SpiClient, count: i32| -> Vec<ClaimedJob> {
            let lease_tokens: Vec<Uuid> = (0..count).map(|_| randomness::new_uuid()).collect();
            let args = [
                names(queue_names),
                worker_id.into(),
                f64::from(lease_seconds).into(),
                handlers_only.into(),
                names(job_kinds),
                lease_tokens.into(),
            ];
            let statement = match (handlers_only, installed.has_status_api) {
                (true, _) => CLAIM_FOR_WORKER,
                (false, true) => CLAIM,
                (false, false) => CLAIM_ON_OLD_SCHEMA,
            };
            let mut expired = Vec::new();
            let claimed: Vec<ClaimedJob> =
                plans::execute_in_claim_order(client, &with_limit(statement, count), &args)
                    .filter(|row| {
                        let is_claimed = row.get::<Uuid>(2).unwrap().is_some();
                        if !is_claimed {
                            expired.push(row.get::<i64>(1).unwrap().unwrap());
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
            waiters::wake_waiters_at_commit(claimed.iter().map(|job| job.job_id), Change::Other);
            waiters::wake_waiters_at_commit(expired, Change::Terminal);
            claimed
        };
        // A statement does not see its own claims when it checks a queue's concurrency
        // limit, so with limits in force a batch is claimed one job per statement.
        let mut claimed = Vec::new();
        if limit == 1 || first_value_in(client, ANY_CONCURRENCY_LIMIT, &[]) != Some(true) {
            claimed = claim(client, limit);
            // A limit set between the check and the claim (the claim's snapshot is later):
            // all but the first job go back, and the batch is claimed one by one.
            if claimed.len() < 2 || first_value_in(client, ANY_CONCURRENCY_LIMIT, &[]) != Some(true) {
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

/// Fenced completion: `succeeded` or `stale`.
pub fn complete_job(job_id: i64, worker_id: &str, lease_token: Uuid) -> &'static str {
    let args = [job_id.into(), worker_id.into(), lease_token.into()];
    let completed = as_extension_owner_of(|installed| {
        let statement = if installed.has_status_api { COMPLETE } else { COMPLETE_ON_OLD_SCHEMA };
        first_value_of::<i64>(statement, &args)
    });
    match completed {
        Some(_) => {
            waiters::wake_waiters_at_commit([job_id], Change::Terminal);
            "succeeded"
        }
        None => "stale",
    }
}

/// Fenced failure: `retried`, `failed` or `stale`. `sqlstate`: that of the handler error behind
/// it, when the background worker ran the handler.
pub fn fail_job(
    job_id: i64,
    worker_id: &str,
    lease_token: Uuid,
    code: FailureCode,
    sqlstate: Option<&str>,
) -> &'static str {
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
        if installed.has_status_api {
            args.push(sqlstate.into());
            first_value_of::<String>(FAIL, &args)
        } else {
            first_value_of::<String>(FAIL_ON_OLD_SCHEMA, &args)
        }
    });
    match outcome.as_deref() {
        Some("available") => waiters::wake_waiters_at_commit([job_id], Change::Other),
        Some(_) => waiters::wake_waiters_at_commit([job_id], Change::Terminal),
        None => {}
    }
    match outcome.as_deref() {
        Some("available") => "retried",
        Some(_) => "failed",
        None => "stale",
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
        renewed.extend(over_leases::<i64>(RENEW_AFTER_ROLLBACK_WITHIN_LIMIT, &[*job], worker_id, lease()));
    }
    renewed
}

/// Marks `jobs` succeeded, fenced on each lease as `complete_job` is; returns the ids of those
/// that were. `skip_held`: rows another session holds are left out instead of waited for.
pub fn complete_jobs(jobs: &[(i64, Uuid)], worker_id: &str, skip_held: bool) -> Vec<i64> {
    let statement = if skip_held { COMPLETE_BATCH_SKIPPING_HELD } else { COMPLETE_BATCH };
    let completed: Vec<i64> =
        over_leases::<i64>(statement, jobs, worker_id, None).into_iter().map(|(id, _)| id).collect();
    waiters::wake_waiters_at_commit(completed.iter().copied(), Change::Terminal);
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

/// What the SQL API's claim returns for one job (pgrx wants the columns spelled out in each
/// signature).
type ClaimRow = (i64, Uuid, TimestampWithTimeZone, String, JsonbDatum, i32, i32);

/// claim_next_durable_job(worker_id, queue_names, lease_seconds, job_kinds): the SQL API's claim
/// from 0.4.0 on. A new C symbol, since a schema from before keeps calling the three-argument one.
#[pg_extern(volatile, parallel_unsafe, name = "claim_next_durable_job")]
#[search_path(pg_catalog, pg_temp)]
fn claim_next_durable_job_of_kinds(
    worker_id: Option<String>,
    queue_names: default!(Option<Vec<Option<String>>>, "NULL"),
    lease_seconds: default!(Option<i32>, "NULL"),
    job_kinds: default!(Option<Vec<Option<String>>>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(job_id, i64),
        name!(lease_token, Uuid),
        name!(lease_expires_at, TimestampWithTimeZone),
        name!(job_kind, String),
        name!(payload, JsonbDatum),
        name!(attempt_count, i32),
        name!(max_attempts, i32),
    ),
> {
    claim_for_caller(worker_id, queue_names, lease_seconds, arguments::job_kinds(job_kinds))
}

/// The three-argument claim of schemas before 0.4.0, which this library serves until ALTER
/// EXTENSION durable_jobs UPDATE; not part of the 0.4.0 schema.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn claim_next_durable_job(
    worker_id: Option<String>,
    queue_names: Option<Vec<Option<String>>>,
    lease_seconds: Option<i32>,
) -> TableIterator<
    'static,
    (
        name!(job_id, i64),
        name!(lease_token, Uuid),
        name!(lease_expires_at, TimestampWithTimeZone),
        name!(job_kind, String),
        name!(payload, JsonbDatum),
        name!(attempt_count, i32),
        name!(max_attempts, i32),
    ),
> {
    claim_for_caller(worker_id, queue_names, lease_seconds, None)
}

fn claim_for_caller(
    worker_id: Option<String>,
    queue_names: Option<Vec<Option<String>>>,
    lease_seconds: Option<i32>,
    job_kinds: Option<Vec<String>>,
) -> TableIterator<'static, ClaimRow> {
    let worker_id = arguments::name(worker_id, "worker_id");
    let queue_names = arguments::queue_names(queue_names);
    let lease_seconds = arguments::lease_seconds(lease_seconds);
    let claimed = as_extension_owner_of(|installed| {
        claim_jobs(
            installed,
            &worker_id,
            queue_names.as_deref(),
            job_kinds.as_deref(),
            lease_seconds,
            false,
            1,
        )
    });
    TableIterator::new(claimed.into_iter().map(|job| {
        (
            job.job_id,
            job.lease_token,
            job.lease_expires_at,
            job.job_kind,
            job.payload,
            job.attempt_count,
            job.max_attempts,
        )
    }))
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn complete_durable_job(
    job_id: Option<i64>,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
) -> &'static str {
    let holder = LeaseHolder::new(job_id, worker_id, lease_token);
    complete_job(holder.job_id, &holder.worker_id, holder.lease_token)
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn fail_durable_job(
    job_id: Option<i64>,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
    failure_code: Option<String>,
) -> &'static str {
    let holder = LeaseHolder::new(job_id, worker_id, lease_token);
    let code = FailureCode::from_caller(&arguments::required(failure_code, "failure_code"));
    fail_job(holder.job_id, &holder.worker_id, holder.lease_token, code, None)
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn extend_durable_job_lease(
    job_id: Option<i64>,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
    lease_seconds: default!(Option<i32>, "NULL"),
) -> Option<TimestampWithTimeZone> {
    let holder = LeaseHolder::new(job_id, worker_id, lease_token);
    let lease_seconds = arguments::lease_seconds(lease_seconds);
    let [job, owner, token] = holder.args();
    first_value(EXTEND, &[job, owner, token, f64::from(lease_seconds).into()])
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn cancel_durable_job(job_id: Option<i64>) -> bool {
    crate::jobs::direct_lease::withdraw();
    let job_id = arguments::required(job_id, "job_id");
    let caller = caller();
    let args = [job_id.into(), caller.role_oid.into(), caller.is_superuser.into()];
    as_extension_owner_of(|installed| {
        Spi::connect_mut(|client| {
            let (state, failure_code) = loop {
                let found = plans::execute(client, LOCK_FOR_CANCEL, &args);
                if !found.is_empty() {
                    let row = found.first();
                    break (
                        row.get::<String>(1).expect("job_state"),
                        row.get::<String>(2).expect("failure code"),
                    );
                }
                let Some((state, allowed)) = state_and_permission(client, &args) else {
                    return false;
                };
                if !allowed {
                    ereport!(
                        ERROR,
                        PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                        "permission denied to cancel a job enqueued by another role"
                    );
                }
                if !matches!(state.as_str(), "available" | "running") {
                    return false;
                }
                // Replayed between the two reads: lock it now.
            };
            let cancelled = if installed.has_status_api {
                let args = [
                    job_id.into(),
                    caller.role_name.as_str().into(),
                    state.as_deref().into(),
                    failure_code.as_deref().into(),
                ];
                plans::execute(client, CANCEL, &args)
            } else {
                plans::execute(client, CANCEL_ON_OLD_SCHEMA, &[job_id.into()])
            };
            let cancelled = cancelled.len() == 1;
            if cancelled {
                waiters::wake_waiters_at_commit([job_id], Change::Terminal);
            }
            cancelled
        })
    })
}

/// A job's state and whether the caller may act on it ($1 the job, $2 the caller, $3 whether it
/// is a superuser); None when there is no such job.
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
