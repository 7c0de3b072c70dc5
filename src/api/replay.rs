//! replay_durable_job: a failed or cancelled job runs again under the same job_id, with the
//! payload its producer supplies again (it was cleared when the job ended), checked against the
//! fingerprint kept at enqueue. Every replay and cancellation is written to the audit table.

use crate::api::enqueue::{check_payload_size, require_intake_enabled};
use crate::api::status::sees_all_jobs;
use crate::jobs::arguments;
use crate::jobs::lease;
use crate::jobs::{waiters, wakeup};
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_of, caller};
use crate::pg::sql_types::{JobStatusRow, JsonbDatum};
use pgrx::prelude::*;

/// Most attempts a job may have, as enqueue allows.
const EXTRA_ATTEMPTS_LIMIT: i32 = 1000;

// $2: the payload; $3: the caller sees every job; $4: the caller. Locks a job that can be
// replayed, if the caller may (as cancel does, never another role's row), so that of two
// concurrent replays the second sees the first one's result.
const LOCK_FOR_REPLAY: &str = concat!(
    "
    SELECT j.job_state, j.last_failure_code, j.attempt_count,
           j.payload_sha256 IS NOT NULL,
           j.payload_sha256 = pg_catalog.sha256(pg_catalog.convert_to($2::pg_catalog.text, 'UTF8'))
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1 AND j.job_state IN ('failed', 'cancelled') AND ",
    crate::has_privileges_of_role!("$3", "$4", "j.enqueued_by"),
    "
    FOR UPDATE OF j"
);

// $2: the payload; $3: extra attempts; $4: the caller; $5, $6: state and failure code before.
const REPLAY: &str = concat!(
    "
    WITH replayed AS (
        UPDATE durable_jobs.durable_job j
        SET job_state = 'available', payload = $2, run_after = pg_catalog.now(), finished_at = NULL,
            max_attempts = j.attempt_count + $3, replay_count = j.replay_count + 1,
            state_version = j.state_version + 1, updated_at = pg_catalog.clock_timestamp()
        WHERE j.job_id = $1 AND j.job_state IN ('failed', 'cancelled')
        RETURNING ROW(",
    crate::status_columns!(),
    ")::durable_jobs.durable_job_status AS status, j.job_id),
    audited AS (
        INSERT INTO durable_jobs.durable_job_audit
            (job_id, action, acted_by, previous_state, previous_failure_code)
        SELECT job_id, 'replay', $4::pg_catalog.name, $5, $6 FROM replayed)
    SELECT status FROM replayed"
);

fn refuse(code: PgSqlErrorCode, message: &str) -> ! {
    ereport!(ERROR, code, message);
}

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn replay_durable_job(
    job_id: Option<i64>,
    payload: Option<JsonbDatum>,
    extra_attempts: default!(Option<i32>, "1"),
) -> SetOfIterator<'static, JobStatusRow> {
    let job_id = arguments::required(job_id, "job_id");
    let payload = arguments::required(payload, "payload");
    let extra_attempts = arguments::required(extra_attempts, "extra_attempts");
    if !(1..=EXTRA_ATTEMPTS_LIMIT).contains(&extra_attempts) {
        arguments::invalid(&format!("extra_attempts must be between 1 and {EXTRA_ATTEMPTS_LIMIT}"));
    }
    check_payload_size(payload.raw_size());
    require_intake_enabled();
    let caller = caller();
    let row = as_extension_owner_of(|installed| {
        let sees_all = sees_all_jobs(&caller, installed.owner);
        Spi::connect_mut(|client| {
            let args = [job_id.into(), payload.into(), sees_all.into(), caller.role_oid.into()];
            let found = loop {
                let found = plans::execute(client, LOCK_FOR_REPLAY, &args);
                if !found.is_empty() {
                    break found;
                }
                let why = [job_id.into(), caller.role_oid.into(), sees_all.into()];
                // A job the caller may not see is, to it, no job: no row, as for a missing one.
                let (state, true) = lease::state_and_permission(client, &why)? else {
                    return None;
                };
                if !matches!(state.as_str(), "failed" | "cancelled") {
                    refuse(
                        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                        &format!("only a failed or cancelled job can be replayed; this one is {state}"),
                    );
                }
                // It failed between the two reads: lock it now.
            };
            let job = found.first();
            let state: String = job.get(1).unwrap().expect("job_state");
            let failure_code: Option<String> = job.get(2).unwrap();
            let attempt_count: i32 = job.get(3).unwrap().expect("attempt_count");
            let has_fingerprint: bool = job.get(4).unwrap().expect("fingerprint known");
            let same_payload: Option<bool> = job.get(5).unwrap();
            if !has_fingerprint {
                refuse(
                    PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                    "this job kept no payload fingerprint (enqueued before 0.4.0 without an idempotency key); \
                     enqueue it again instead",
                );
            }
            if same_payload != Some(true) {
                // 23514, not 22023: a well-formed argument that does not match the job's (422).
                refuse(
                    PgSqlErrorCode::ERRCODE_CHECK_VIOLATION,
                    "payload differs from the payload the job was enqueued with",
                );
            }
            if attempt_count + extra_attempts > EXTRA_ATTEMPTS_LIMIT {
                arguments::invalid(&format!(
                    "the job has made {attempt_count} attempts; extra_attempts may take it to {EXTRA_ATTEMPTS_LIMIT} at most"
                ));
            }
            let args = [
                job_id.into(),
                payload.into(),
                extra_attempts.into(),
                caller.role_name.as_str().into(),
                state.as_str().into(),
                failure_code.as_deref().into(),
            ];
            let replayed = plans::execute(client, REPLAY, &args);
            Some(replayed.first().get_one::<JobStatusRow>().unwrap().expect("the replayed job"))
        })
    });
    if row.is_some() {
        waiters::wake_waiters_at_commit([job_id], crate::jobs::waiters::Change::Other);
        crate::jobs::direct_lease::jobs_inserted();
        wakeup::wake_workers_at_commit();
    }
    SetOfIterator::new(row)
}
