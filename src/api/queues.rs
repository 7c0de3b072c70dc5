//! Queue controls: a paused queue is claimed from by no one (the background worker and external
//! workers alike), and enqueue into it goes on; a queue's concurrency limit caps how many of its
//! jobs run at once.

use crate::jobs::arguments;
use crate::jobs::lease::first_value_of;
use crate::pg::privilege::{as_extension_owner, as_extension_owner_of, caller};
use pgrx::prelude::*;

const CHANGE_PAUSED: &str = "
    UPDATE durable_jobs.durable_job_queue
    SET paused = $2, changed_by = $3::pg_catalog.name, changed_at = pg_catalog.now()
    WHERE queue_name = $1 AND paused <> $2
    RETURNING 1";

// Pauses a queue that has no row yet, or whose row another session inserts meanwhile (a first
// concurrency limit): DO NOTHING would report that queue as paused already.
const INSERT_PAUSED: &str = "
    INSERT INTO durable_jobs.durable_job_queue (queue_name, paused, changed_by)
    VALUES ($1, true, $2::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET paused = true, changed_by = excluded.changed_by, changed_at = pg_catalog.now()
    WHERE NOT durable_job_queue.paused
    RETURNING 1";

/// Sets a queue's paused state; true when that changed it. A queue without a row is open.
fn set_paused(queue_name: Option<String>, paused: bool) -> bool {
    let queue_name = arguments::name(queue_name, "queue_name");
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        let args = [queue_name.as_str().into(), paused.into(), changed_by.as_str().into()];
        if first_value_of::<i32>(CHANGE_PAUSED, &args).is_some() {
            return true;
        }
        paused
            && first_value_of::<i32>(INSERT_PAUSED, &[queue_name.as_str().into(), changed_by.as_str().into()])
                .is_some()
    })
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn pause_durable_job_queue(queue_name: Option<String>) -> bool {
    crate::jobs::direct_lease::withdraw();
    set_paused(queue_name, true)
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn resume_durable_job_queue(queue_name: Option<String>) -> bool {
    set_paused(queue_name, false)
}

macro_rules! set_concurrency {
    ($places:literal) => {
        concat!(
            $places,
            "
    INSERT INTO durable_jobs.durable_job_queue (queue_name, concurrency_limit, changed_by)
    VALUES ($1, $2, $3::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET concurrency_limit = excluded.concurrency_limit, changed_by = excluded.changed_by,
        changed_at = pg_catalog.now()
    RETURNING 1"
        )
    };
}
// With the queue's places up to the limit (`jobs::slots`); a lowered limit leaves the places
// above it, which claims do not take.
const SET_CONCURRENCY: &str = set_concurrency!(
    "
    WITH places AS (
        INSERT INTO durable_jobs.durable_job_queue_slot (queue_name, slot)
        SELECT $1, place FROM pg_catalog.generate_series(1, $2) AS place
        ON CONFLICT DO NOTHING)"
);
// On a schema from before 0.6.0, whose claims count a limited queue's running jobs.
const SET_CONCURRENCY_ON_OLD_SCHEMA: &str = set_concurrency!("");

/// A limit argument: NULL (no limit) or 1 to `max`; anything else is refused (22023).
fn optional_limit(limit: Option<i32>, argument: &str, max: i32) -> Option<i32> {
    if limit.is_some_and(|limit| !(1..=max).contains(&limit)) {
        arguments::invalid(&format!("{argument} must be NULL (no limit) or between 1 and {max}"));
    }
    limit
}

/// Upper bound of a queue's concurrency limit.
const CONCURRENCY_LIMIT_MAX: i32 = 100_000;

/// Limits how many jobs of a queue may run (hold a live lease) at once; NULL removes the limit.
/// Claims by the background workers and by external workers both honour it, each taking a place
/// of the queue for the job it starts (`jobs::slots`).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn set_durable_job_queue_concurrency(queue_name: Option<String>, concurrency_limit: Option<i32>) {
    crate::jobs::direct_lease::withdraw();
    let queue_name = arguments::name(queue_name, "queue_name");
    let concurrency_limit = optional_limit(concurrency_limit, "concurrency_limit", CONCURRENCY_LIMIT_MAX);
    let changed_by = caller().role_name;
    as_extension_owner_of(|installed| {
        let statement =
            if installed.has_attempt_history { SET_CONCURRENCY } else { SET_CONCURRENCY_ON_OLD_SCHEMA };
        first_value_of::<i32>(
            statement,
            &[queue_name.as_str().into(), concurrency_limit.into(), changed_by.as_str().into()],
        )
    });
}

// With the places of the keys of the queue's pending jobs (`jobs::slots`), each made under its
// key's lock as `MAKE_KEY_PLACES` makes them (a key whose lock another transaction holds is
// left to it, or to the claim that finds its places missing); keys enqueued later get theirs
// at their enqueue. NULL: the queue's key places go.
const SET_KEY_CONCURRENCY: &str = "
    WITH places AS (
        INSERT INTO durable_jobs.durable_job_key_slot (queue_name, concurrency_key, slot)
        SELECT $1, k.concurrency_key, place
        FROM (SELECT DISTINCT j.concurrency_key FROM durable_jobs.durable_job j
              WHERE j.queue_name = $1 AND j.job_state IN ('available', 'running')
                AND j.concurrency_key IS NOT NULL) k,
             pg_catalog.generate_series(1, $2) AS place
        WHERE pg_catalog.pg_try_advisory_xact_lock(
                  pg_catalog.hashtext('durable_jobs key places'), pg_catalog.hashtext($1 || ' ' || k.concurrency_key))
        ON CONFLICT DO NOTHING),
    gone AS (
        DELETE FROM durable_jobs.durable_job_key_slot s WHERE s.queue_name = $1 AND $2 IS NULL)
    INSERT INTO durable_jobs.durable_job_queue (queue_name, key_concurrency_limit, changed_by)
    VALUES ($1, $2, $3::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET key_concurrency_limit = excluded.key_concurrency_limit, changed_by = excluded.changed_by,
        changed_at = pg_catalog.now()
    RETURNING 1";

/// Upper bound of a queue's per-key limit.
const KEY_CONCURRENCY_LIMIT_MAX: i32 = 1_000;

/// Limits how many jobs of one concurrency key may run at once in a queue; NULL removes the
/// limit. Jobs without a key are not limited by it.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn set_durable_job_queue_key_concurrency(queue_name: Option<String>, max_running_per_key: Option<i32>) {
    crate::jobs::direct_lease::withdraw();
    let queue_name = arguments::name(queue_name, "queue_name");
    let max_running_per_key =
        optional_limit(max_running_per_key, "max_running_per_key", KEY_CONCURRENCY_LIMIT_MAX);
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        first_value_of::<i32>(
            SET_KEY_CONCURRENCY,
            &[queue_name.as_str().into(), max_running_per_key.into(), changed_by.as_str().into()],
        )
    });
}

// With the queue's tokens up to the burst (`jobs::rates`), new ones usable at once; a smaller
// burst leaves the tokens above it, which claims do not take. NULL: the tokens go.
const SET_RATE: &str = "
    WITH tokens AS (
        INSERT INTO durable_jobs.durable_job_rate_token (queue_name, token)
        SELECT $1, token FROM pg_catalog.generate_series(1, $3) AS token
        ON CONFLICT DO NOTHING),
    gone AS (
        DELETE FROM durable_jobs.durable_job_rate_token t WHERE t.queue_name = $1 AND $2 IS NULL)
    INSERT INTO durable_jobs.durable_job_queue (queue_name, rate_per_second, rate_burst, changed_by)
    VALUES ($1, $2, $3, $4::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET rate_per_second = excluded.rate_per_second, rate_burst = excluded.rate_burst,
        changed_by = excluded.changed_by, changed_at = pg_catalog.now()
    RETURNING 1";

// A token spent under the old rate comes back no later than one period of the new rate.
const RESET_TOKENS: &str = "
    UPDATE durable_jobs.durable_job_rate_token
    SET next_at = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $3::pg_catalog.float8 / $2)
    WHERE queue_name = $1
      AND next_at > pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $3::pg_catalog.float8 / $2)";

/// Upper bounds of a queue's rate limit, and of its period (burst / rate): a token a year.
const RATE_MAX: f64 = 1_000_000.0;
const BURST_MAX: i32 = 10_000;
const PERIOD_MAX_SECONDS: f64 = 366.0 * 86_400.0;

/// Limits how many claims start the queue's jobs: at most `burst + starts_per_second * T` in any
/// window of T seconds, for the background workers and every SQL-API claim; NULL removes it.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn set_durable_job_queue_rate(
    queue_name: Option<String>,
    starts_per_second: Option<f64>,
    burst: default!(Option<i32>, "1"),
) {
    crate::jobs::direct_lease::withdraw();
    let queue_name = arguments::name(queue_name, "queue_name");
    let burst = match starts_per_second {
        None => None,
        Some(rate) => {
            if !(rate > 0.0 && rate <= RATE_MAX) {
                arguments::invalid(&format!(
                    "starts_per_second must be NULL (no limit) or above 0 and at most {RATE_MAX}"
                ));
            }
            let burst = arguments::required(burst, "burst");
            if !(1..=BURST_MAX).contains(&burst) {
                arguments::invalid(&format!("burst must be between 1 and {BURST_MAX}"));
            }
            if f64::from(burst) / rate > PERIOD_MAX_SECONDS {
                arguments::invalid("burst / starts_per_second must be at most 366 days");
            }
            Some(burst)
        }
    };
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        let args =
            [queue_name.as_str().into(), starts_per_second.into(), burst.into(), changed_by.as_str().into()];
        first_value_of::<i32>(SET_RATE, &args);
        if starts_per_second.is_some() {
            Spi::connect_mut(|client| {
                crate::pg::plans::execute(client, RESET_TOKENS, &args[..3]);
            });
        }
    });
}

const NEXT_START: &str = "
    SELECT CASE WHEN pg_catalog.min(t.next_at) IS NOT NULL
                THEN GREATEST(pg_catalog.min(t.next_at), pg_catalog.clock_timestamp()) END
    FROM durable_jobs.durable_job_queue q
    JOIN durable_jobs.durable_job_rate_token t ON t.queue_name = q.queue_name AND t.token <= q.rate_burst
    WHERE q.queue_name = $1";

/// When the queue's rate limit lets the next claim start one of its jobs: now when a token is
/// usable, NULL when the queue has no rate limit. What an external worker whose claim took
/// nothing sleeps until (a token a claim in progress holds counts as usable).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn get_durable_job_queue_next_start(queue_name: Option<String>) -> Option<TimestampWithTimeZone> {
    let queue_name = arguments::name(queue_name, "queue_name");
    as_extension_owner(|| first_value_of::<TimestampWithTimeZone>(NEXT_START, &[queue_name.as_str().into()]))
}
