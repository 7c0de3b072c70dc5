//! enqueue_durable_job, enqueue_or_get_durable_job and enqueue_durable_jobs: validated inserts,
//! with idempotency keys that outlive the payload. (Some 500 lines: the three share the job
//! template and its one idempotent insert, and each is kept for schemas before 0.6.0 too.)

use crate::jobs::arguments;
use crate::jobs::direct_lease;
use crate::jobs::slots;
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_of, caller, Installed};
use crate::pg::sql_types::{JsonbArray, JsonbDatum};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::time::Instant;

// The fingerprint is kept after the payload is cleared, so a finished job still recognises a
// repeated enqueue, and a replay its payload. jsonb's text form is canonical (key order,
// whitespace), so equal values match. $9: fingerprint every payload (schemas from 0.4.0 on);
// before, only keyed ones had one.
// Keys are unique per queue and enqueuing role, so one role learns nothing of another's jobs.
// No conflict target: the same statement works against the 0.2.0 index (per queue), which a
// database keeps until ALTER EXTENSION durable_jobs UPDATE.
// A job with a concurrency key adds its column; its value is the statement's last parameter.
macro_rules! job_columns {
    ($key_column:literal) => {
        concat!(
            "queue_name, job_kind, payload, idempotency_key, payload_sha256,
                 priority, run_after, max_attempts, enqueued_by",
            $key_column
        )
    };
}
macro_rules! job_values {
    ($key_value:literal) => {
        concat!(
            "$1, $2, $3, $4,
                   CASE WHEN $4 IS NULL AND NOT $9 THEN NULL
                        ELSE pg_catalog.sha256(pg_catalog.convert_to($3::pg_catalog.text, 'UTF8')) END,
                   $5, $6, $7, $8::pg_catalog.name",
            $key_value
        )
    };
}
macro_rules! insert_job {
    ($on_conflict:literal, $key_column:literal, $key_value:literal) => {
        concat!(
            "
            INSERT INTO durable_jobs.durable_job (",
            job_columns!($key_column),
            ")
            VALUES (",
            job_values!($key_value),
            ")",
            $on_conflict,
            "
            RETURNING job_id"
        )
    };
}
const INSERT_JOB: &str = insert_job!(" ON CONFLICT DO NOTHING", "", "");
// Without a key a job conflicts with none (its id is drawn from the identity): a plain insert,
// without ON CONFLICT's speculative insertion and the WAL record that confirms it.
const INSERT_JOB_WITHOUT_KEY: &str = insert_job!("", "", "");
// With a concurrency key, $10 (schemas from 0.6.0 on).
const INSERT_CONCURRENCY_KEYED_JOB: &str =
    insert_job!(" ON CONFLICT DO NOTHING", ", concurrency_key", ", $10");
const INSERT_CONCURRENCY_KEYED_JOB_WITHOUT_KEY: &str = insert_job!("", ", concurrency_key", ", $10");

// The same job leased to a sleeping worker ($10 its id, $11 the lease token, $12 the lease in
// seconds) when the worker's claim would take it now: due, in a queue neither paused nor
// limited nor rate-limited (nor, for a job with a concurrency key, $13, limited per key), of a kind whose handler
// serves its enqueuer (as CLAIM_FOR_WORKER asks); otherwise available, as INSERT_JOB makes it.
// Written as a claim writes it (see `direct_lease`).
macro_rules! insert_leased_job {
    ($on_conflict:literal, $key_column:literal, $key_value:literal, $key_limit:literal) => {
        concat!(
            "
            INSERT INTO durable_jobs.durable_job (",
            job_columns!($key_column),
            ",
                 job_state, lease_owner, lease_token, lease_expires_at, attempt_count, state_version,
                 attempt_started_at, attempt_worker_id)
            SELECT ",
            job_values!($key_value),
            ",
                   CASE WHEN claimable THEN 'running' ELSE 'available' END,
                   CASE WHEN claimable THEN $10 END,
                   CASE WHEN claimable THEN $11::pg_catalog.uuid END,
                   CASE WHEN claimable
                        THEN pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $12) END,
                   CASE WHEN claimable THEN 1 ELSE 0 END,
                   CASE WHEN claimable THEN 2 ELSE 1 END,
                   CASE WHEN claimable THEN pg_catalog.clock_timestamp() END,
                   CASE WHEN claimable THEN $10 END
            FROM (SELECT $6 <= pg_catalog.clock_timestamp()
                         AND NOT EXISTS (SELECT 1 FROM durable_jobs.durable_job_queue q
                                         WHERE q.queue_name = $1
                                           AND (q.paused OR q.concurrency_limit IS NOT NULL
                                                OR q.rate_per_second IS NOT NULL",
            $key_limit,
            "))
                         AND EXISTS (SELECT 1 FROM durable_jobs.durable_job_handler h
                                     WHERE h.job_kind = $2 AND ",
            crate::registration_serves!("h.registered_by", "$8::pg_catalog.name"),
            ")
                  AS claimable) AS lease",
            $on_conflict,
            "
            RETURNING job_id, job_state = 'running'"
        )
    };
}
const INSERT_LEASED_JOB: &str = insert_leased_job!(" ON CONFLICT DO NOTHING", "", "", "");
const INSERT_LEASED_JOB_WITHOUT_KEY: &str = insert_leased_job!("", "", "", "");
const INSERT_LEASED_CONCURRENCY_KEYED_JOB: &str = insert_leased_job!(
    " ON CONFLICT DO NOTHING",
    ", concurrency_key",
    ", $13",
    " OR q.key_concurrency_limit IS NOT NULL"
);
const INSERT_LEASED_CONCURRENCY_KEYED_JOB_WITHOUT_KEY: &str =
    insert_leased_job!("", ", concurrency_key", ", $13", " OR q.key_concurrency_limit IS NOT NULL");

// The caller's own job first; another role's only under the 0.2.0 index.
const FIND_BY_KEY: &str = "
    SELECT job_id,
           enqueued_by = $5::pg_catalog.name AND job_kind = $3
           AND payload_sha256 = pg_catalog.sha256(pg_catalog.convert_to($4::pg_catalog.text, 'UTF8'))
    FROM durable_jobs.durable_job
    WHERE queue_name = $1 AND idempotency_key = $2
    ORDER BY enqueued_by = $5::pg_catalog.name DESC
    LIMIT 1";

// The caller's own job holding the key: looked up before the insert. Another role's job with
// the same key is no conflict (keys are per role), and must not be reported as one.
const FIND_OWN_BY_KEY: &str = "
    SELECT job_id,
           job_kind = $3
           AND payload_sha256 = pg_catalog.sha256(pg_catalog.convert_to($4::pg_catalog.text, 'UTF8'))
    FROM durable_jobs.durable_job
    WHERE queue_name = $1 AND idempotency_key = $2 AND enqueued_by = $5::pg_catalog.name";

// Identity values follow insertion order, and rows are inserted in array order, so sorting by
// job_id returns the ids in the order of the payloads. $8 as $9 of INSERT_JOB; with a
// concurrency key, $9.
macro_rules! insert_jobs {
    ($key_column:literal, $key_value:literal) => {
        concat!(
            "
    WITH inserted AS (
        INSERT INTO durable_jobs.durable_job
            (queue_name, job_kind, payload, payload_sha256, priority, run_after, max_attempts, enqueued_by",
            $key_column,
            ")
        SELECT $1, $2, p.payload,
               CASE WHEN $8 THEN pg_catalog.sha256(pg_catalog.convert_to(p.payload::pg_catalog.text, 'UTF8')) END,
               $4, $5, $6, $7::pg_catalog.name",
            $key_value,
            "
        FROM pg_catalog.unnest($3::pg_catalog.jsonb[]) WITH ORDINALITY AS p(payload, position)
        ORDER BY p.position
        RETURNING job_id)
    SELECT job_id FROM inserted ORDER BY job_id"
        )
    };
}
const INSERT_JOBS: &str = insert_jobs!("", "");
const INSERT_CONCURRENCY_KEYED_JOBS: &str = insert_jobs!(", concurrency_key", ", $9");

// (elements, NULL elements, largest element in bytes)
const DESCRIBE_PAYLOADS: &str = "
    SELECT pg_catalog.count(*), pg_catalog.count(*) FILTER (WHERE p IS NULL),
           COALESCE(pg_catalog.max(pg_catalog.pg_column_size(p)), 0)::pg_catalog.int8
    FROM pg_catalog.unnest($1::pg_catalog.jsonb[]) AS p";

/// What every job of one enqueue call shares, validated.
struct JobTemplate {
    job_kind: String,
    queue_name: String,
    run_after: TimestampWithTimeZone,
    max_attempts: i32,
    priority: i32,
    enqueued_by: String,
    concurrency_key: Option<String>,
}

impl JobTemplate {
    fn new(
        job_kind: Option<String>,
        queue_name: Option<String>,
        run_after: Option<TimestampWithTimeZone>,
        max_attempts: Option<i32>,
        priority: Option<i32>,
        concurrency_key: Option<String>,
    ) -> JobTemplate {
        JobTemplate {
            concurrency_key: concurrency_key.map(|key| arguments::name(Some(key), "concurrency_key")),
            job_kind: arguments::name(job_kind, "job_kind"),
            queue_name: arguments::name(queue_name, "queue_name"),
            run_after: arguments::run_after(run_after),
            max_attempts: arguments::max_attempts(max_attempts),
            priority: arguments::priority(priority),
            enqueued_by: caller().role_name,
        }
    }

    /// Inserts one job, or returns the job already holding `idempotency_key`; with whether it
    /// inserted it.
    fn insert_one(
        &self,
        client: &mut SpiClient,
        installed: Installed,
        payload: JsonbDatum,
        idempotency_key: Option<&str>,
    ) -> (i64, bool) {
        let args = [
            self.queue_name.as_str().into(),
            self.job_kind.as_str().into(),
            payload.into(),
            idempotency_key.into(),
            self.priority.into(),
            self.run_after.into(),
            self.max_attempts.into(),
            self.enqueued_by.as_str().into(),
            installed.has_status_api.into(),
        ];
        // A key already bound is checked before anything is written (no job_id is drawn): its own
        // job comes back, even with intake off (producers retry enqueues after timeouts), and
        // another job's key is refused. Anything that would take a new job in needs intake on.
        let existing = idempotency_key.map(|key| self.find_by_key(client, FIND_OWN_BY_KEY, key, payload));
        if let Some((Some(job_id), Some(true))) = existing {
            return (job_id, false);
        }
        require_intake_enabled();
        if let Some((Some(_), _)) = existing {
            key_used_by_another_job();
        }
        let lease = direct_lease::lease_for_next_insert(installed.at_library_version);
        if let Some(lease) = lease {
            let (leased_at, inserted) = (unsafe { pgrx::pg_sys::GetCurrentTimestamp() }, Instant::now());
            let statement = match (idempotency_key.is_some(), self.concurrency_key.is_some()) {
                (true, false) => INSERT_LEASED_JOB,
                (false, false) => INSERT_LEASED_JOB_WITHOUT_KEY,
                (true, true) => INSERT_LEASED_CONCURRENCY_KEYED_JOB,
                (false, true) => INSERT_LEASED_CONCURRENCY_KEYED_JOB_WITHOUT_KEY,
            };
            let lease_args = [
                lease.worker_id.as_str().into(),
                lease.lease_token.into(),
                f64::from(lease.lease_seconds).into(),
            ];
            let args: Vec<DatumWithOid> = args.into_iter().chain(lease_args).chain(self.key_arg()).collect();
            let rows = plans::execute(client, statement, &args);
            let row = (!rows.is_empty()).then(|| rows.first().get_two::<i64, bool>().expect("job_id"));
            match row {
                Some((Some(job_id), Some(true))) => {
                    direct_lease::leased(job_id, &lease, &self.enqueued_by, leased_at, inserted);
                    return (job_id, true);
                }
                Some((Some(job_id), _)) => {
                    direct_lease::not_leased();
                    self.make_key_places(client);
                    return (job_id, true);
                }
                _ => direct_lease::not_leased(),
            }
        } else {
            let statement = match (idempotency_key.is_some(), self.concurrency_key.is_some()) {
                (true, false) => INSERT_JOB,
                (false, false) => INSERT_JOB_WITHOUT_KEY,
                (true, true) => INSERT_CONCURRENCY_KEYED_JOB,
                (false, true) => INSERT_CONCURRENCY_KEYED_JOB_WITHOUT_KEY,
            };
            let args: Vec<DatumWithOid> = args.into_iter().chain(self.key_arg()).collect();
            let inserted = plans::execute(client, statement, &args);
            if !inserted.is_empty() {
                self.make_key_places(client);
                return (inserted.first().get_one::<i64>().expect("job_id").expect("job_id"), true);
            }
        }
        // A concurrent enqueue took the key meanwhile; ON CONFLICT waited for it, so its row is
        // visible now.
        let key = idempotency_key.expect("a conflict implies a key");
        match self.find_by_key(client, FIND_BY_KEY, key, payload) {
            (Some(job_id), Some(true)) => (job_id, false),
            (Some(_), _) => key_used_by_another_job(),
            (None, _) => {
                ereport!(
                    ERROR,
                    PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
                    "the job holding this idempotency_key was removed concurrently; retry the enqueue"
                );
            }
        }
    }

    /// The concurrency key as the last parameter of a statement, if the jobs have one.
    fn key_arg(&self) -> Option<DatumWithOid<'_>> {
        self.concurrency_key.as_deref().map(DatumWithOid::from)
    }

    /// The places of the jobs' concurrency key, when their queue limits each key and they are
    /// missing (`jobs::slots`), so that the key's claims find them.
    fn make_key_places(&self, client: &mut SpiClient) {
        if let Some(key) = &self.concurrency_key {
            plans::execute(
                client,
                slots::MAKE_KEY_PLACES,
                &[self.queue_name.as_str().into(), key.as_str().into()],
            );
        }
    }

    /// The job `statement` (FIND_BY_KEY or FIND_OWN_BY_KEY) finds holding `key` in this queue,
    /// and whether it is this caller's job of this kind and payload.
    fn find_by_key(
        &self,
        client: &mut SpiClient,
        statement: &str,
        key: &str,
        payload: JsonbDatum,
    ) -> (Option<i64>, Option<bool>) {
        let args = [
            self.queue_name.as_str().into(),
            key.into(),
            self.job_kind.as_str().into(),
            payload.into(),
            self.enqueued_by.as_str().into(),
        ];
        let existing = plans::execute(client, statement, &args);
        match existing.is_empty() {
            true => (None, None),
            false => existing.first().get_two::<i64, bool>().expect("existing job"),
        }
    }
}

/// 23505 for an idempotency key another job (other kind or payload) holds in the queue.
fn key_used_by_another_job() -> ! {
    ereport!(
        ERROR,
        PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION,
        "idempotency_key is already used in this queue by a job with a different job_kind or payload"
    );
}

/// While `durable_jobs.intake_enabled` is off, nothing new is taken in (enqueue, replay): 25006,
/// read_only_sql_transaction, as a read-only server refuses writes (not 57P03, on which
/// connection pools drop the connection).
pub fn require_intake_enabled() {
    if !crate::pg::settings::INTAKE_ENABLED.get() {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            "job intake is disabled (durable_jobs.intake_enabled = off)"
        );
    }
}

/// 54000 for a payload (of `size` bytes, decompressed) over `durable_jobs.max_payload_size`.
pub fn check_payload_size(size: usize) {
    if size > crate::pg::settings::MAX_PAYLOAD_SIZE.get() as usize * 1024 {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!(
                "payload is larger than durable_jobs.max_payload_size ({} kB)",
                crate::pg::settings::MAX_PAYLOAD_SIZE.get()
            )
        );
    }
}

/// enqueue_durable_job with a concurrency key (from 0.6.0 on). A new C symbol, since a schema
/// from before keeps calling the seven-argument one.
#[pg_extern(volatile, parallel_unsafe, name = "enqueue_durable_job")]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::too_many_arguments)]
fn enqueue_durable_job_with_concurrency_key(
    job_kind: Option<String>,
    payload: Option<JsonbDatum>,
    idempotency_key: default!(Option<String>, "NULL"),
    queue_name: default!(Option<String>, "'default'"),
    run_after: default!(Option<TimestampWithTimeZone>, "now()"),
    max_attempts: default!(Option<i32>, "NULL"),
    priority: default!(Option<i32>, "0"),
    concurrency_key: default!(Option<String>, "NULL"),
) -> i64 {
    let template = JobTemplate::new(job_kind, queue_name, run_after, max_attempts, priority, concurrency_key);
    enqueue_one(template, payload, idempotency_key).0
}

/// The enqueue of schemas before 0.6.0, which this library serves until ALTER EXTENSION
/// durable_jobs UPDATE; not part of the 0.6.0 schema.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn enqueue_durable_job(
    job_kind: Option<String>,
    payload: Option<JsonbDatum>,
    idempotency_key: Option<String>,
    queue_name: Option<String>,
    run_after: Option<TimestampWithTimeZone>,
    max_attempts: Option<i32>,
    priority: Option<i32>,
) -> i64 {
    let template = JobTemplate::new(job_kind, queue_name, run_after, max_attempts, priority, None);
    enqueue_one(template, payload, idempotency_key).0
}

/// enqueue_durable_job, telling whether the job was created or an idempotency key named one that
/// already existed (what an HTTP gateway answers with 201 or 200).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::too_many_arguments)]
fn enqueue_or_get_durable_job(
    job_kind: Option<String>,
    payload: Option<JsonbDatum>,
    idempotency_key: default!(Option<String>, "NULL"),
    queue_name: default!(Option<String>, "'default'"),
    run_after: default!(Option<TimestampWithTimeZone>, "now()"),
    max_attempts: default!(Option<i32>, "NULL"),
    priority: default!(Option<i32>, "0"),
    concurrency_key: default!(Option<String>, "NULL"),
) -> TableIterator<'static, (name!(job_id, i64), name!(created, bool))> {
    let template = JobTemplate::new(job_kind, queue_name, run_after, max_attempts, priority, concurrency_key);
    TableIterator::once(enqueue_one(template, payload, idempotency_key))
}

fn enqueue_one(
    template: JobTemplate,
    payload: Option<JsonbDatum>,
    idempotency_key: Option<String>,
) -> (i64, bool) {
    let payload = arguments::required(payload, "payload");
    let idempotency_key = arguments::idempotency_key(idempotency_key);
    check_payload_size(payload.raw_size());
    let enqueued = as_extension_owner_of(|installed| {
        Spi::connect_mut(|client| template.insert_one(client, installed, payload, idempotency_key.as_deref()))
    });
    // A job leased to a sleeping worker wakes that worker only, by its hand-over.
    if !direct_lease::lease_pending() {
        crate::jobs::wakeup::wake_workers_at_commit();
    }
    enqueued
}

/// enqueue_durable_jobs with a concurrency key for all its jobs (from 0.6.0 on); a new C symbol,
/// as for enqueue_durable_job.
#[pg_extern(volatile, parallel_unsafe, name = "enqueue_durable_jobs")]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::too_many_arguments)]
fn enqueue_durable_jobs_with_concurrency_key(
    job_kind: Option<String>,
    payloads: Option<JsonbArray>,
    idempotency_keys: default!(Option<Vec<Option<String>>>, "NULL"),
    queue_name: default!(Option<String>, "'default'"),
    run_after: default!(Option<TimestampWithTimeZone>, "now()"),
    max_attempts: default!(Option<i32>, "NULL"),
    priority: default!(Option<i32>, "0"),
    concurrency_key: default!(Option<String>, "NULL"),
) -> SetOfIterator<'static, i64> {
    let template = JobTemplate::new(job_kind, queue_name, run_after, max_attempts, priority, concurrency_key);
    enqueue_many(template, payloads, idempotency_keys)
}

/// The batch enqueue of schemas before 0.6.0 (see `enqueue_durable_job`).
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn enqueue_durable_jobs(
    job_kind: Option<String>,
    payloads: Option<JsonbArray>,
    idempotency_keys: Option<Vec<Option<String>>>,
    queue_name: Option<String>,
    run_after: Option<TimestampWithTimeZone>,
    max_attempts: Option<i32>,
    priority: Option<i32>,
) -> SetOfIterator<'static, i64> {
    let template = JobTemplate::new(job_kind, queue_name, run_after, max_attempts, priority, None);
    enqueue_many(template, payloads, idempotency_keys)
}

fn enqueue_many(
    template: JobTemplate,
    payloads: Option<JsonbArray>,
    idempotency_keys: Option<Vec<Option<String>>>,
) -> SetOfIterator<'static, i64> {
    let payloads = arguments::required(payloads, "payloads");
    let (elements, nulls, largest) =
        Spi::get_three_with_args::<i64, i64, i64>(DESCRIBE_PAYLOADS, &[payloads.into()])
            .expect("describe payloads");
    let (elements, nulls, largest) = (elements.unwrap_or(0), nulls.unwrap_or(0), largest.unwrap_or(0));
    if nulls > 0 {
        arguments::null_value("each element of payloads");
    }
    check_payload_size(largest as usize);
    let keys = idempotency_keys.map(|keys| {
        if keys.len() as i64 != elements {
            arguments::invalid("idempotency_keys must be NULL or have one element per payload");
        }
        keys.into_iter().map(arguments::idempotency_key).collect::<Vec<_>>()
    });
    if elements == 0 {
        return SetOfIterator::new(Vec::new());
    }
    direct_lease::jobs_inserted();

    let job_ids: Vec<i64> = as_extension_owner_of(|installed| {
        Spi::connect_mut(|client| match keys {
            // Without keys: one statement for the whole batch.
            None => {
                require_intake_enabled();
                let args = [
                    template.queue_name.as_str().into(),
                    template.job_kind.as_str().into(),
                    payloads.into(),
                    template.priority.into(),
                    template.run_after.into(),
                    template.max_attempts.into(),
                    template.enqueued_by.as_str().into(),
                    installed.has_status_api.into(),
                ];
                let args: Vec<DatumWithOid> = args.into_iter().chain(template.key_arg()).collect();
                let statement = if template.concurrency_key.is_some() {
                    INSERT_CONCURRENCY_KEYED_JOBS
                } else {
                    INSERT_JOBS
                };
                let ids = plans::execute(client, statement, &args)
                    .map(|row| row.get::<i64>(1).unwrap().unwrap())
                    .collect();
                template.make_key_places(client);
                ids
            }
            // With keys: each payload goes through the idempotent insert.
            Some(keys) => {
                let each = client
                    .select("SELECT p FROM pg_catalog.unnest($1::pg_catalog.jsonb[]) WITH ORDINALITY AS u(p, n) ORDER BY n", None, &[payloads.into()])
                    .expect("unnest payloads")
                    .map(|row| row.get::<JsonbDatum>(1).unwrap().unwrap())
                    .collect::<Vec<_>>();
                each.into_iter()
                    .zip(keys)
                    .map(|(payload, key)| template.insert_one(client, installed, payload, key.as_deref()).0)
                    .collect()
            }
        })
    });
    crate::jobs::wakeup::wake_workers_at_commit();
    SetOfIterator::new(job_ids)
}
