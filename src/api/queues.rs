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
    if let Some(limit) = concurrency_limit {
        if !(1..=CONCURRENCY_LIMIT_MAX).contains(&limit) {
            arguments::invalid(&format!(
                "concurrency_limit must be NULL (no limit) or between 1 and {CONCURRENCY_LIMIT_MAX}"
            ));
        }
    }
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

// With the places of the keys of the queue's pending jobs (`jobs::slots`); keys enqueued later
// get theirs at their enqueue.
const SET_KEY_CONCURRENCY: &str = "
    WITH places AS (
        INSERT INTO durable_jobs.durable_job_key_slot (queue_name, concurrency_key, slot)
        SELECT $1, k.concurrency_key, place
        FROM (SELECT DISTINCT j.concurrency_key FROM durable_jobs.durable_job j
              WHERE j.queue_name = $1 AND j.job_state IN ('available', 'running')
                AND j.concurrency_key IS NOT NULL) k,
             pg_catalog.generate_series(1, $2) AS place
        ON CONFLICT DO NOTHING)
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
    if let Some(limit) = max_running_per_key {
        if !(1..=KEY_CONCURRENCY_LIMIT_MAX).contains(&limit) {
            arguments::invalid(&format!(
                "max_running_per_key must be NULL (no limit) or between 1 and {KEY_CONCURRENCY_LIMIT_MAX}"
            ));
        }
    }
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        first_value_of::<i32>(
            SET_KEY_CONCURRENCY,
            &[queue_name.as_str().into(), max_running_per_key.into(), changed_by.as_str().into()],
        )
    });
}
