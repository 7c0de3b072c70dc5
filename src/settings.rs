//! Server settings (GUCs). Every bound used by the SQL API lives here, with its default and range.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;

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
    unsafe { pg_sys::MarkGUCPrefixReserved(c"durable_jobs".as_ptr()) };
}

/// The default lease in seconds, never above the configured maximum.
pub fn default_lease_seconds() -> i32 {
    LEASE_DURATION.get().min(MAX_LEASE_DURATION.get())
}
