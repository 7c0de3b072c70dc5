//! The SQL API of leases: claim_next_durable_job, complete_durable_job, fail_durable_job,
//! extend_durable_job_lease and cancel_durable_job.

use crate::api::status::sees_all_jobs;
use crate::jobs::arguments;
use crate::jobs::counters::{self, Counter};
use crate::jobs::failure::FailureCode;
use crate::jobs::lease::{claim_jobs, complete_job, fail_job, first_value_of, state_and_permission};
use crate::jobs::statements::{
    CANCEL, CANCEL_ON_OLD_SCHEMA, CANCEL_WITHOUT_HISTORY, EXTEND, LOCK_FOR_CANCEL,
};
use crate::jobs::waiters::{self, Change};
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner, as_extension_owner_of, caller};
use crate::pg::sql_types::JsonbDatum;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::Uuid;

/// Runs a statement as the extension owner and returns its first row's first column, if any.
fn first_value<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    as_extension_owner(|| first_value_of(query, args))
}

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
    for _ in &claimed {
        counters::count_sql_api_call_at_commit(Counter::Claimed, None);
    }
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
    let (outcome, observed) = complete_job(holder.job_id, &holder.worker_id, holder.lease_token);
    counters::count_sql_api_call_at_commit(Counter::for_outcome(outcome), observed);
    outcome
}

/// fail_durable_job(job_id, worker_id, lease_token, failure_code, error_message): the SQL API's
/// failure from 0.6.0 on, whose attempt keeps the worker's error text. A new C symbol, since a
/// schema from before keeps calling the four-argument one.
#[pg_extern(volatile, parallel_unsafe, name = "fail_durable_job")]
#[search_path(pg_catalog, pg_temp)]
fn fail_durable_job_with_message(
    job_id: Option<i64>,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
    failure_code: Option<String>,
    error_message: default!(Option<String>, "NULL"),
) -> &'static str {
    let holder = LeaseHolder::new(job_id, worker_id, lease_token);
    let code = FailureCode::from_caller(&arguments::required(failure_code, "failure_code"));
    let (outcome, observed) =
        fail_job(holder.job_id, &holder.worker_id, holder.lease_token, code, None, error_message.as_deref());
    counters::count_sql_api_call_at_commit(Counter::for_outcome(outcome), observed);
    outcome
}

/// The four-argument failure of schemas before 0.6.0, which this library serves until ALTER
/// EXTENSION durable_jobs UPDATE; not part of the 0.6.0 schema.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn fail_durable_job(
    job_id: Option<i64>,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
    failure_code: Option<String>,
) -> &'static str {
    fail_durable_job_with_message(job_id, worker_id, lease_token, failure_code, None)
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
    as_extension_owner_of(|installed| {
        let args = [job_id.into(), caller.role_oid.into(), sees_all_jobs(&caller, installed.owner).into()];
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
                // A job the caller may not see is, to it, no job: false, as for a missing one.
                let Some((state, true)) = state_and_permission(client, &args) else {
                    return false;
                };
                if !matches!(state.as_str(), "available" | "running") {
                    return false;
                }
                // Replayed between the two reads: lock it now.
            };
            // A job this transaction leased at its enqueue was never running to anyone else, and
            // no worker started it: cancelled as the available job it is, with no attempt.
            let never_started = state.as_deref() == Some("running")
                && crate::jobs::direct_lease::leased_job() == Some(job_id);
            let state = if never_started { Some("available".to_string()) } else { state };
            let cancelled = if installed.has_status_api {
                let mut args: Vec<DatumWithOid> = vec![
                    job_id.into(),
                    caller.role_name.as_str().into(),
                    state.as_deref().into(),
                    failure_code.as_deref().into(),
                ];
                let statement = if installed.has_attempt_history {
                    args.push(never_started.into());
                    CANCEL
                } else {
                    CANCEL_WITHOUT_HISTORY
                };
                plans::execute(client, statement, &args)
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
