//! The SQL texts of the lease state machine: the claim, the fence every transition out of
//! `running` passes, renewals, batch completion, release and cancel. One file, about 650
//! lines, so that the fence and the lease columns are written once, as macros the statements are
//! assembled from at compile time (`concat!`); `jobs::lease` and `api::lease` run them.

use crate::{attempt_history, no_attempt_history};

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
// columns' changes where the schema has them, `$history` the recording of the attempts
// (`jobs::attempts`).
macro_rules! expire_exhausted_ctes {
    ($expired:expr, $history:ident) => {
        concat!(
            "
                exhausted AS (
                    SELECT job_id, lease_expires_at AS was_expiry FROM durable_jobs.durable_job
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
                    RETURNING x.job_id, exhausted.was_expiry",
            $history!(expired_returning),
            ")"
        )
    };
}

// How a claim keeps to concurrency limits. By place (schemas from 0.6.0 on, `jobs::slots`): a
// job of a limited queue is taken only with a free place of its queue, and a job with a
// concurrency key in a queue with a per-key limit only with a free place of its key (asked for
// first: a key is more often full), which it records; and a job of a queue with a rate limit
// only with a token of the queue, asked for last, once the job has its places (a token taken is
// spent: `jobs::rates`). By lock (older schemas): queues at their limit are left out, and a limited queue with
// room left is checked under its advisory lock, one job per statement.
macro_rules! limits_by_place {
    (closed) => {
        ""
    };
    // A place is asked for last, for a job that passes every other condition (a CASE fixes the
    // order; the planner orders plain conditions by their cost, and may join the kind's
    // handler after them), so that no place goes to a job the claim cannot take; and the claim
    // order index hands the candidates over in claim order (`plans::execute_in_claim_order`).
    (filter, $kind_filter:expr) => {
        concat!(
            "AND CASE WHEN true ",
            $kind_filter,
            "
                          THEN NOT EXISTS (SELECT FROM durable_jobs.durable_job_queue q
                                      WHERE q.queue_name = durable_job.queue_name
                                        AND (q.paused
                                             OR (durable_job.concurrency_key IS NOT NULL
                                                 AND q.key_concurrency_limit IS NOT NULL
                                                 AND durable_jobs.durable_job_take_key_slot(
                                                         durable_job.queue_name, durable_job.concurrency_key,
                                                         durable_job.job_id, durable_job.ctid) IS NULL)
                                             OR (q.concurrency_limit IS NOT NULL
                                                 AND durable_jobs.durable_job_take_queue_slot(
                                                         durable_job.queue_name, durable_job.job_id,
                                                         durable_job.ctid) IS NULL)
                                             OR (q.rate_per_second IS NOT NULL
                                                 AND NOT durable_jobs.durable_job_take_rate_token(
                                                         durable_job.queue_name, durable_job.job_id,
                                                         durable_job.ctid))))
                          ELSE false END"
        )
    };
    (place) => {
        ", durable_jobs.durable_job_taken_queue_slot(job_id) AS place,
           durable_jobs.durable_job_taken_key_slot(job_id) AS key_place,
           durable_jobs.durable_job_rate_token_taken_at(job_id) AS token_at"
    };
    (set) => {
        "queue_slot = numbered.place, key_slot = numbered.key_place, "
    };
}
macro_rules! limits_by_lock {
    (closed) => {
        "
                -- Queues no one may claim from now: paused, or at their concurrency limit. Anti-joins keep
                -- the claim an index scan; a limited queue with room left is checked under its lock.
                closed AS MATERIALIZED (
                    SELECT q.queue_name FROM durable_jobs.durable_job_queue q
                    WHERE q.paused
                       OR (q.concurrency_limit IS NOT NULL
                           AND durable_jobs.durable_job_queue_running(q.queue_name) >= q.concurrency_limit)),"
    };
    (filter, $kind_filter:expr) => {
        concat!(
            "AND NOT EXISTS (SELECT 1 FROM closed WHERE closed.queue_name = durable_job.queue_name)
                      AND NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job_queue q
                                      WHERE q.queue_name = durable_job.queue_name AND q.concurrency_limit IS NOT NULL
                                        AND NOT durable_jobs.durable_job_queue_has_capacity(q.queue_name))
                      ",
            $kind_filter
        )
    };
    (place) => {
        ""
    };
    (set) => {
        ""
    };
}

// The best ready jobs in the queues $1 names are claimed. A job is ready by the clock, not by
// the transaction's start: the worker claims ahead at the end of a transaction that ran a
// batch. `{kind}` and `{order}` are written in at run time (`jobs::lease::claim_text`): nothing
// and the claim order, or one kind's range of its index, in the same order (`one_kind`).
// `$claimed` adds the status columns' changes where the schema has them, `$returning` columns
// after the eight every claim returns, `$history` the recording of attempts (`jobs::attempts`),
// `$limits` the keeping to concurrency limits. The lease tokens come in $6, one per job the
// claim may take (`randomness`), handed out in claim order.
macro_rules! claim_ctes {
    ($kind_filter:expr, $claimed:expr, $returning:expr, $history:ident, $limits:ident) => {
        concat!(
            $limits!(closed),
            "
                candidate AS (
                    SELECT job_id, job_state AS was_state",
            $history!(was),
            $limits!(place),
            " FROM durable_jobs.durable_job
                    WHERE ((job_state = 'available' AND run_after <= pg_catalog.clock_timestamp())
                           OR (job_state = 'running'
                               AND lease_expires_at <= pg_catalog.clock_timestamp()
                               AND attempt_count < max_attempts))
                      AND ($1::pg_catalog.text[] IS NULL OR queue_name = ANY ($1)) {kind}
                      ",
            $limits!(filter, $kind_filter),
            "
                    ORDER BY {order}
                    LIMIT {limit}
                    FOR UPDATE OF durable_job SKIP LOCKED),
                numbered AS (SELECT c.*, pg_catalog.row_number() OVER () AS n FROM candidate c),
                claimed AS (
                UPDATE durable_jobs.durable_job j
                SET job_state = 'running', ",
            $claimed,
            $history!(started),
            $limits!(set),
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
            $history!(reclaimed_returning),
            ")"
        )
    };
}

/// A claim of every kind reads the claim order.
pub(crate) const ALL_KINDS: (&str, &str) = ("", "priority DESC, run_after, job_id");

/// A claim of one kind (the kind in element 1 of the array parameter `kinds`) reads that kind's
/// range of `durable_job_kind_claim_order_idx`, in claim order, as far as it needs: no job of
/// another kind, and exactly the jobs, in the same order, that the claim order would give it.
/// The kind as a range of one value, and the order led by the kind, which only the kind's
/// index gives: with an equality the planner takes the kind for a constant, and the kept
/// generic plan, which knows no kind, read the claim order past other kinds' jobs once
/// statistics made one kind look common. (A claim of several kinds reads the claim order: a
/// merge of their ranges that reads each only as far as it needs is not built yet.)
pub(crate) fn one_kind(kinds: &str) -> (String, &'static str) {
    (
        format!("AND job_kind >= {kinds}[1] AND job_kind <= {kinds}[1]"),
        "job_kind, priority DESC, run_after, job_id",
    )
}

// The SQL API's claim, one statement: first exhausted leases expire, then jobs are claimed. The
// two parts touch disjoint rows (attempts used up or not).
macro_rules! claim_statement {
    ($kind_filter:expr, $claimed:expr, $expired:expr, $history:ident, $limits:ident) => {
        concat!(
            "WITH",
            expire_exhausted_ctes!($expired, $history),
            ",",
            claim_ctes!($kind_filter, $claimed, "", $history, $limits),
            "
                -- The claimed jobs, then the expired ones (no lease token), whose waiters wake too.
                SELECT * FROM claimed
                UNION ALL
                SELECT job_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL",
            $history!(expired_selected),
            " FROM expired"
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

pub(crate) const CLAIM: &str =
    claim_statement!(any_kind!(), new_state_version!(), expiry_columns!(), attempt_history, limits_by_place);

// The same on a schema from before 0.6.0 and before 0.4.0, which this library serves until
// ALTER EXTENSION durable_jobs UPDATE.
pub(crate) const CLAIM_WITHOUT_HISTORY: &str = claim_statement!(
    any_kind!(),
    new_state_version!(),
    expiry_columns!(),
    no_attempt_history,
    limits_by_lock
);
pub(crate) const CLAIM_ON_OLD_SCHEMA: &str =
    claim_statement!(any_kind!(), "", "", no_attempt_history, limits_by_lock);

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
                           WHERE h.job_kind = j.job_kind)",
        attempt_history,
        limits_by_place
    ),
    "
    SELECT * FROM claimed"
);

/// The worker's expiry of exhausted leases in every queue ($1 NULL); returns the expired jobs.
pub(crate) const EXPIRE_EXHAUSTED: &str = concat!(
    "WITH",
    expire_exhausted_ctes!(expiry_columns!(), attempt_history),
    " SELECT job_id",
    attempt_history!(expired_selected),
    " FROM expired"
);

macro_rules! complete_statement {
    ($status_columns:expr, $history:ident) => {
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
            RETURNING job_id",
            $history!(observed)
        )
    };
}

// With the attempt's queue, wait and run time (`jobs::histograms`) where the schema has them.
pub(crate) const COMPLETE: &str = complete_statement!(new_state_version!(), attempt_history);
pub(crate) const COMPLETE_WITHOUT_HISTORY: &str =
    complete_statement!(new_state_version!(), no_attempt_history);
pub(crate) const COMPLETE_ON_OLD_SCHEMA: &str = complete_statement!("", no_attempt_history);

// $4: the code is retryable; $5: base delay (ms); $6: maximum delay (s); $7: the code; with
// the status columns, $8: the SQLSTATE of the handler error (NULL from external workers).
// Backoff: base * 2^(attempt - 1), capped, times a jitter factor in [0.5, 1).
macro_rules! fail_statement {
    ($status_columns:expr, $returning:expr) => {
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
            RETURNING job_state",
            $returning
        )
    };
}

macro_rules! fail_status_columns {
    () => {
        concat!(new_state_version!(), "last_failure_sqlstate = $8, ")
    };
}

// With the failed attempt recorded ($9 its error message), and its queue, wait and run time
// (`jobs::histograms`): the wait from the run_after it had, which a retry moves.
pub(crate) const FAIL: &str = concat!(
    "WITH previous AS (SELECT run_after FROM durable_jobs.durable_job WHERE job_id = $1),
    failed AS (",
    fail_statement!(fail_status_columns!(), attempt_history!(failed_returning)),
    ")",
    attempt_history!(failed),
    "
    SELECT f.job_state",
    attempt_history!(failed_observed),
    " FROM failed f LEFT JOIN previous ON true"
);
pub(crate) const FAIL_WITHOUT_HISTORY: &str = fail_statement!(fail_status_columns!(), "");
pub(crate) const FAIL_ON_OLD_SCHEMA: &str = fail_statement!("", "");

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
    ($live:expr, $lock:literal) => {
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

// Whether job x is under a concurrency limit: its queue's, or its key's.
macro_rules! under_a_limit {
    () => {
        "EXISTS (SELECT FROM durable_jobs.durable_job_queue q
                         WHERE q.queue_name = x.queue_name
                           AND (q.concurrency_limit IS NOT NULL
                                OR (x.concurrency_key IS NOT NULL AND q.key_concurrency_limit IS NOT NULL)))"
    };
}

// `leases_locked`: live, or lapsed and under no concurrency limit (reviving a lapsed lease
// starts a job again, which a limit must allow: `held_lease_within_limit_locked`).
macro_rules! held_leases_locked {
    ($lock:literal) => {
        leases_locked!(
            concat!(
                "
                  AND (x.lease_expires_at > pg_catalog.clock_timestamp() OR NOT ",
                under_a_limit!(),
                ")"
            ),
            $lock
        )
    };
}

// `leases_locked`, for one lapsed lease under a concurrency limit, while its key and its queue
// have a free place for it, taken as a claim takes them (`jobs::slots`).
macro_rules! held_lease_within_limit_locked {
    ($lock:literal) => {
        leases_locked!(
            concat!(
                "
                  AND x.lease_expires_at <= pg_catalog.clock_timestamp()
                  AND ",
                under_a_limit!(),
                "
                  AND NOT EXISTS (
                      SELECT FROM durable_jobs.durable_job_queue q
                      WHERE q.queue_name = x.queue_name
                        AND ((x.concurrency_key IS NOT NULL AND q.key_concurrency_limit IS NOT NULL
                              AND durable_jobs.durable_job_take_key_slot(
                                      x.queue_name, x.concurrency_key, x.job_id, x.ctid) IS NULL)
                             OR (q.concurrency_limit IS NOT NULL
                                 AND durable_jobs.durable_job_take_queue_slot(x.queue_name, x.job_id, x.ctid) IS NULL)))"
            ),
            $lock
        )
    };
}

// The background worker's renewal of the leases of a batch's jobs not yet run, so that each
// handler gets a whole lease (and the jobs stay locked by the batch's transaction). Fenced like
// EXTEND (the token is the state check); returns each renewed job with its new expiry in Unix
// microseconds. `$leases`: live_leases_locked or held_leases_locked; `$place`: the place a
// revived lease took in its queue's limit, where it took one.
macro_rules! renew_statement {
    ($leases:ident, $lock:literal, $place:literal) => {
        concat!(
            $leases!($lock),
            "
            UPDATE durable_jobs.durable_job j
            SET lease_expires_at = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $4),",
            $place,
            "
                updated_at = pg_catalog.clock_timestamp()
            FROM live WHERE j.job_id = live.job_id AND j.job_id = ANY ($1)
            RETURNING j.job_id, (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8"
        )
    };
}
pub(crate) const RENEW_BATCH: &str = renew_statement!(live_leases_locked, "", "");
pub(crate) const RENEW_BATCH_SKIPPING_HELD: &str = renew_statement!(live_leases_locked, " SKIP LOCKED", "");
// After a run transaction failed: its renewals went with it, and the leases the claim committed
// may have lapsed meanwhile (a batch runs past them on renewals of its own). A lapsed lease still
// under the worker's owner and token was taken by no one (a reclaim, a cancel, an expiry and a
// completion all change or clear the token), so it is the worker's to renew, as if in time.
pub(crate) const RENEW_AFTER_ROLLBACK: &str = renew_statement!(held_leases_locked, " SKIP LOCKED", "");
pub(crate) const RENEW_AFTER_ROLLBACK_WITHIN_LIMIT: &str = renew_statement!(
    held_lease_within_limit_locked,
    " SKIP LOCKED",
    "
                queue_slot = durable_jobs.durable_job_taken_queue_slot(j.job_id),
                key_slot = durable_jobs.durable_job_taken_key_slot(j.job_id),"
);

// The successes of a batch in one statement: what COMPLETE does, for each live lease. The worker
// runs it skipping held rows first, then for each held row alone, under its short wait for it
// (see `RowWaits` in `worker::execution`).
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
            RETURNING j.job_id",
            attempt_history!(observed)
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

// $2, $3: the caller's role and whether it sees every job (a superuser, or a role with the
// extension owner's privileges, as the status API's readers). A job belongs to the role that
// enqueued it; members of that role (with its privileges) may act on it too.
macro_rules! caller_may_act_on_job {
    () => {
        crate::has_privileges_of_role!("$3", "$2", "j.enqueued_by")
    };
}

// Locks a job that can be cancelled, if the caller may: a caller that may not act on a job never
// locks (or waits for) its row, since a row someone holds makes the worker's batch wait, then
// run again.
pub(crate) const LOCK_FOR_CANCEL: &str = concat!(
    "
    SELECT j.job_state, j.last_failure_code
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1 AND j.job_state IN ('available', 'running') AND ",
    caller_may_act_on_job!(),
    "
    FOR UPDATE OF j"
);

/// Why a job was not locked for a change: its state and whether the caller may act on it (no
/// row: there is no such job). $1 the job, $2 the caller, $3 whether it sees every job.
pub(crate) const STATE_AND_PERMISSION: &str = concat!(
    "
    SELECT j.job_state, ",
    caller_may_act_on_job!(),
    "
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1"
);

macro_rules! cancel_statement {
    ($status_columns:expr, $returning:expr) => {
        concat!(
            "
            UPDATE durable_jobs.durable_job
            SET job_state = 'cancelled', finished_at = pg_catalog.clock_timestamp(), ",
            $status_columns,
            release_lease!(),
            "
            WHERE job_id = $1 AND job_state IN ('available', 'running')
            RETURNING job_id",
            $returning
        )
    };
}

// The cancellation and its audit row in one statement (and with `$history` the attempt it
// ended); $2: the caller, $3, $4: the job's state and last failure code before; with `$history`,
// $5: the job is this transaction's direct lease, never started.
macro_rules! cancel_with_audit {
    ($history:ident) => {
        concat!(
            "WITH cancelled AS (",
            cancel_statement!(
                concat!(new_state_version!(), $history!(cancelled_set)),
                $history!(cancelled_returning)
            ),
            ")",
            $history!(cancelled),
            "
    INSERT INTO durable_jobs.durable_job_audit
        (job_id, action, acted_by, previous_state, previous_failure_code)
    SELECT job_id, 'cancel', $2::pg_catalog.name, $3, $4 FROM cancelled
    RETURNING job_id"
        )
    };
}
pub(crate) const CANCEL: &str = cancel_with_audit!(attempt_history);
pub(crate) const CANCEL_WITHOUT_HISTORY: &str = cancel_with_audit!(no_attempt_history);
pub(crate) const CANCEL_ON_OLD_SCHEMA: &str = cancel_statement!("", "");
