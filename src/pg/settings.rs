//! Server settings (GUCs). Every bound used by the SQL API lives here, with its default and range.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;
use std::ffi::CString;

/// Lease length in seconds when a claim or extension names none.
pub static LEASE_DURATION: GucSetting<i32> = GucSetting::<i32>::new(60);
/// The longest lease anyone may ask for, in seconds.
pub static MAX_LEASE_DURATION: GucSetting<i32> = GucSetting::<i32>::new(3600);
/// Attempts a job gets when its enqueue names none.
pub static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(5);
/// Delay before the first retry, in milliseconds; doubles with each attempt.
pub static RETRY_BASE_DELAY: GucSetting<i32> = GucSetting::<i32>::new(1000);
/// The longest delay between retries, in seconds.
pub static RETRY_MAX_DELAY: GucSetting<i32> = GucSetting::<i32>::new(3600);
/// The largest payload enqueue accepts, in kilobytes.
pub static MAX_PAYLOAD_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1024);

/// Whether the background workers claim jobs.
pub static WORKER_ENABLED: GucSetting<bool> = GucSetting::<bool>::new(false);
/// How long an idle worker sleeps before polling again, in milliseconds.
pub static POLL_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(1000);
/// Whether enqueue accepts new jobs.
pub static INTAKE_ENABLED: GucSetting<bool> = GucSetting::<bool>::new(true);
/// Whether the workers log each handler error's text (never the payload).
pub static LOG_HANDLER_ERRORS: GucSetting<bool> = GucSetting::<bool>::new(false);
/// Whether a failed attempt keeps its error message (`jobs::attempts`), not only its codes.
pub static KEEP_ERROR_MESSAGES: GucSetting<bool> = GucSetting::<bool>::new(true);
/// Whether an enqueue that finds a background worker asleep leases its job to it (`direct_lease`).
pub static DIRECT_LEASES: GucSetting<bool> = GucSetting::<bool>::new(true);
/// How many background workers the postmaster starts (restart to change).
pub static WORKER_COUNT: GucSetting<i32> = GucSetting::<i32>::new(1);
/// The database the background workers connect to (restart to change).
pub static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"postgres"));

/// The role the background workers connect as (restart to change); empty: the bootstrap
/// superuser.
pub static WORKER_ROLE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// How many jobs a background worker claims per transaction.
pub static CLAIM_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1);
/// How long finished jobs are kept before the workers delete them, in seconds; 0 keeps them.
pub static RETENTION_PERIOD: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);

/// Upper bound of `durable_jobs.worker_count`.
pub const WORKER_COUNT_LIMIT: i32 = 64;

/// Upper bound of `max_attempts`, for the GUC and for each job.
pub const MAX_ATTEMPTS_LIMIT: i32 = 1000;
/// Upper bound of any lease, one week.
pub const LEASE_SECONDS_LIMIT: i32 = 7 * 24 * 3600;

pub fn register() {
    // SUSET: a superuser may change these per session (tests do); postgresql.conf plus
    // pg_reload_conf() changes them for everyone without a restart.
    GucRegistry::define_int_guc(
        c"durable_jobs.lease_duration",
        c"Lease length in seconds when a claim names none.",
        c"Capped by durable_jobs.max_lease_duration.",
        &LEASE_DURATION,
        1,
        LEASE_SECONDS_LIMIT,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.max_lease_duration",
        c"The longest lease a claim or lease extension may ask for, in seconds.",
        c"",
        &MAX_LEASE_DURATION,
        1,
        LEASE_SECONDS_LIMIT,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.max_attempts",
        c"Attempts a job gets when its enqueue names none.",
        c"",
        &MAX_ATTEMPTS,
        1,
        MAX_ATTEMPTS_LIMIT,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.retry_base_delay",
        c"Delay before the first retry of a job that failed transiently.",
        c"Doubles with each further attempt, with jitter, up to durable_jobs.retry_max_delay.",
        &RETRY_BASE_DELAY,
        0,
        3_600_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.retry_max_delay",
        c"The longest delay between two attempts of a job.",
        c"",
        &RETRY_MAX_DELAY,
        0,
        LEASE_SECONDS_LIMIT,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.max_payload_size",
        c"The largest job payload enqueue accepts.",
        c"",
        &MAX_PAYLOAD_SIZE,
        1,
        1024 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_bool_guc(
        c"durable_jobs.worker_enabled",
        c"Whether the durable_jobs background workers claim and run jobs.",
        c"Off by default. Reloadable: workers notice a change at their next poll.",
        &WORKER_ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.poll_interval",
        c"How long an idle background worker sleeps before polling again.",
        c"A worker that found a job polls again at once.",
        &POLL_INTERVAL,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.claim_batch_size",
        c"How many jobs a background worker claims and finishes per transaction.",
        c"Each job still runs in its own subtransaction, fenced on its own lease.",
        &CLAIM_BATCH_SIZE,
        1,
        1000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"durable_jobs.retention_period",
        c"How long finished jobs are kept before the background workers delete them.",
        c"0 keeps finished jobs forever. An idempotency key is remembered as long as its job is kept.",
        &RETENTION_PERIOD,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_bool_guc(
        c"durable_jobs.intake_enabled",
        c"Whether enqueue accepts new jobs.",
        c"Turn off to stop intake while claims and completions go on.",
        &INTAKE_ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"durable_jobs.log_handler_errors",
        c"Whether the background workers log each handler error at LOG.",
        c"Job id, kind, attempt, SQLSTATE and the error's message. The payload itself is never \
          logged, but an error message can quote values from it (a failed cast does).",
        &LOG_HANDLER_ERRORS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"durable_jobs.keep_error_messages",
        c"Whether each failed attempt keeps its error message, not only its failure code and SQLSTATE.",
        c"Kept until the job is pruned; a message can quote values from the payload, and clearing \
          the payload when the job ends does not clear it.",
        &KEEP_ERROR_MESSAGES,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"durable_jobs.direct_leases",
        c"Whether an enqueue that finds a background worker asleep leases its job to that worker.",
        c"The worker then runs the job right after the enqueue commits, without a claim of its own.",
        &DIRECT_LEASES,
        GucContext::Suset,
        GucFlags::default(),
    );
}

/// After every setting is defined: any other `durable_jobs.*` name is then an error. Calling
/// it earlier would drop the placeholders of settings defined later, with their values.
pub fn reserve_prefix() {
    unsafe { pg_sys::MarkGUCPrefixReserved(c"durable_jobs".as_ptr()) };
}

/// Settings read only at server start; Postgres allows them only while preloading.
pub fn register_postmaster_settings() {
    GucRegistry::define_int_guc(
        c"durable_jobs.worker_count",
        c"How many durable_jobs background workers to start.",
        c"Each takes one of max_worker_processes. Needs a restart.",
        &WORKER_COUNT,
        0,
        WORKER_COUNT_LIMIT,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"durable_jobs.database",
        c"The database the durable_jobs background workers connect to.",
        c"Needs a restart.",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"durable_jobs.worker_role",
        c"The role the durable_jobs background workers connect as.",
        c"A login role that need not be a superuser; empty means the bootstrap superuser. Needs a restart.",
        &WORKER_ROLE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
}

pub fn database() -> String {
    DATABASE.get().map(|d| d.to_string_lossy().into_owned()).unwrap_or_else(|| "postgres".into())
}

/// The role named by `durable_jobs.worker_role`, or None for the bootstrap superuser.
pub fn worker_role() -> Option<String> {
    WORKER_ROLE.get().map(|r| r.to_string_lossy().into_owned()).filter(|r| !r.is_empty())
}

pub fn poll_interval() -> std::time::Duration {
    std::time::Duration::from_millis(POLL_INTERVAL.get() as u64)
}

/// The default lease in seconds, never above the configured maximum.
pub fn default_lease_seconds() -> i32 {
    LEASE_DURATION.get().min(MAX_LEASE_DURATION.get())
}

/// As PostgreSQL's `SyncStandbysDefined()`, from this session's settings: a reload that names
/// standbys reaches a worker before its next poll.
pub fn synchronous_standbys_configured() -> bool {
    let names = unsafe { pg_sys::SyncRepStandbyNames };
    !names.is_null() && unsafe { *names } != 0
}
