//! Queue controls: a paused queue is claimed from by no one (the background worker and external
//! workers alike); enqueue into it goes on.

use crate::arguments;
use crate::lease::first_value_of;
use crate::privilege::{as_extension_owner, caller};
use pgrx::prelude::*;

const CHANGE_PAUSED: &str = "
    UPDATE durable_jobs.durable_job_queue
    SET paused = $2, changed_by = $3::pg_catalog.name, changed_at = pg_catalog.now()
    WHERE queue_name = $1 AND paused <> $2
    RETURNING 1";

const INSERT_PAUSED: &str = "
    INSERT INTO durable_jobs.durable_job_queue (queue_name, paused, changed_by)
    VALUES ($1, true, $2::pg_catalog.name)
    ON CONFLICT (queue_name) DO NOTHING
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
    set_paused(queue_name, true)
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn resume_durable_job_queue(queue_name: Option<String>) -> bool {
    set_paused(queue_name, false)
}
