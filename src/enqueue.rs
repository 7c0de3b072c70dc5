//! enqueue_durable_job: validated insert with an idempotency key that outlives the payload.

use crate::arguments;
use crate::sql_types::JsonbDatum;
use crate::privilege::{as_extension_owner, caller};
use pgrx::prelude::*;

// The fingerprint is kept after the payload is cleared, so a finished job still recognises a
// repeated enqueue. jsonb's text form is canonical (key order, whitespace), so equal values match.
const INSERT_JOB: &str = "
    INSERT INTO durable_jobs.durable_job
        (queue_name, job_kind, payload, idempotency_key, payload_sha256,
         priority, run_after, max_attempts, enqueued_by)
    VALUES ($1, $2, $3, $4,
            CASE WHEN $4 IS NULL THEN NULL
                 ELSE pg_catalog.sha256(pg_catalog.convert_to($3::pg_catalog.text, 'UTF8')) END,
            $5, $6, $7, $8::pg_catalog.name)
    ON CONFLICT (queue_name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING job_id";

const FIND_BY_KEY: &str = "
    SELECT job_id,
           job_kind = $3
           AND payload_sha256 = pg_catalog.sha256(pg_catalog.convert_to($4::pg_catalog.text, 'UTF8'))
    FROM durable_jobs.durable_job
    WHERE queue_name = $1 AND idempotency_key = $2";

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn enqueue_durable_job(
    job_kind: Option<String>,
    payload: Option<JsonbDatum>,
    idempotency_key: default!(Option<String>, "NULL"),
    queue_name: default!(Option<String>, "'default'"),
    run_after: default!(Option<TimestampWithTimeZone>, "now()"),
    max_attempts: default!(Option<i32>, "NULL"),
    priority: default!(Option<i32>, "0"),
) -> i64 {
    if !crate::settings::INTAKE_ENABLED.get() {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "job intake is disabled (durable_jobs.intake_enabled = off)"
        );
    }
    let job_kind = arguments::name(job_kind, "job_kind");
    let payload = arguments::required(payload, "payload");
    let idempotency_key = arguments::idempotency_key(idempotency_key);
    let queue_name = arguments::name(queue_name, "queue_name");
    let run_after = arguments::run_after(run_after);
    let max_attempts = arguments::max_attempts(max_attempts);
    let priority = arguments::priority(priority);
    check_payload_size(&payload);
    let enqueued_by = caller().role_name;

    as_extension_owner(|| {
        Spi::connect_mut(|client| {
            let inserted = client
                .update(
                    INSERT_JOB,
                    None,
                    &[
                        queue_name.as_str().into(),
                        job_kind.as_str().into(),
                        payload.into(),
                        idempotency_key.as_deref().into(),
                        priority.into(),
                        run_after.into(),
                        max_attempts.into(),
                        enqueued_by.as_str().into(),
                    ],
                )
                .expect("insert job");
            if !inserted.is_empty() {
                return inserted.first().get_one::<i64>().expect("job_id").expect("job_id");
            }
            // ON CONFLICT waited for any concurrent insert of the key, so the row is visible now.
            let key = idempotency_key.as_deref().expect("a conflict implies a key");
            let existing = client
                .select(
                    FIND_BY_KEY,
                    None,
                    &[
                        queue_name.as_str().into(),
                        key.into(),
                        job_kind.as_str().into(),
                        payload.into(),
                    ],
                )
                .expect("look up idempotency key");
            let existing = match existing.is_empty() {
                true => (None, None),
                false => existing.first().get_two::<i64, bool>().expect("existing job"),
            };
            match existing {
                (Some(job_id), Some(true)) => job_id,
                (Some(_), _) => {
                    ereport!(
                        ERROR,
                        PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION,
                        "idempotency_key is already used in this queue by a job with a different job_kind or payload"
                    );
                }
                (None, _) => {
                    ereport!(
                        ERROR,
                        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
                        "the job holding this idempotency_key was removed concurrently; retry the enqueue"
                    );
                }
            }
        })
    })
}

fn check_payload_size(payload: &JsonbDatum) {
    let limit_kb = crate::settings::MAX_PAYLOAD_SIZE.get();
    if payload.raw_size() > limit_kb as usize * 1024 {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("payload is larger than durable_jobs.max_payload_size ({limit_kb} kB)")
        );
    }
}
