//! Validation of caller input. Every check raises a standard SQLSTATE before anything is written:
//! 22004 for a NULL where a value is required, 22023 for a value out of its documented domain,
//! 54000 for a payload over the size limit.

use pgrx::prelude::*;

/// Longest accepted job_kind, queue_name and worker_id.
pub const NAME_MAX_LEN: usize = 128;
/// Longest accepted idempotency_key.
pub const IDEMPOTENCY_KEY_MAX_LEN: usize = 255;
/// Accepted priority range; higher runs first.
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

pub fn invalid(message: &str) -> ! {
    ereport!(ERROR, PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message);
}

pub fn null_value(argument: &str) -> ! {
    ereport!(ERROR, PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED, format!("{argument} must not be NULL"));
}

pub fn required<T>(value: Option<T>, argument: &str) -> T {
    value.unwrap_or_else(|| null_value(argument))
}

/// A job_kind, queue_name or worker_id: 1 to 128 characters of letters, digits and `_ . : / -`.
/// The narrow alphabet keeps these words safe to show in logs and metrics.
pub fn name(value: Option<String>, argument: &str) -> String {
    let value = required(value, argument);
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '-');
    if value.is_empty() || value.len() > NAME_MAX_LEN || !value.chars().all(allowed) {
        invalid(&format!(
            "{argument} must be 1 to {NAME_MAX_LEN} characters of letters, digits, '_', '.', ':', '/' or '-'"
        ));
    }
    value
}

pub fn idempotency_key(value: Option<String>) -> Option<String> {
    if let Some(key) = &value {
        if key.is_empty() || key.len() > IDEMPOTENCY_KEY_MAX_LEN {
            invalid(&format!("idempotency_key must be NULL or 1 to {IDEMPOTENCY_KEY_MAX_LEN} bytes long"));
        }
    }
    value
}

pub fn priority(value: Option<i32>) -> i32 {
    let value = required(value, "priority");
    if !PRIORITY_RANGE.contains(&value) {
        invalid(&format!("priority must be between {} and {}", PRIORITY_RANGE.start(), PRIORITY_RANGE.end()));
    }
    value
}

pub fn max_attempts(value: Option<i32>) -> i32 {
    let limit = crate::pg::settings::MAX_ATTEMPTS_LIMIT;
    let value = value.unwrap_or_else(|| crate::pg::settings::MAX_ATTEMPTS.get());
    if !(1..=limit).contains(&value) {
        invalid(&format!("max_attempts must be between 1 and {limit}"));
    }
    value
}

/// A lease length: NULL means the configured default; otherwise 1 to durable_jobs.max_lease_duration.
pub fn lease_seconds(value: Option<i32>) -> i32 {
    let maximum = crate::pg::settings::MAX_LEASE_DURATION.get();
    match value {
        None => crate::pg::settings::default_lease_seconds(),
        Some(v) if (1..=maximum).contains(&v) => v,
        Some(_) => invalid(&format!(
            "lease_seconds must be between 1 and {maximum} (durable_jobs.max_lease_duration)"
        )),
    }
}

pub fn run_after(value: Option<TimestampWithTimeZone>) -> TimestampWithTimeZone {
    let value = required(value, "run_after");
    if !value.is_finite() {
        invalid("run_after must be a finite timestamp");
    }
    value
}

/// queue_names for a claim: NULL means every queue; an array must be non-empty, without NULLs.
pub fn queue_names(value: Option<Vec<Option<String>>>) -> Option<Vec<String>> {
    names(value, "queue_names", "every queue")
}

/// NULL (any kind) or a non-empty array of valid kind names.
pub fn job_kinds(value: Option<Vec<Option<String>>>) -> Option<Vec<String>> {
    names(value, "job_kinds", "any kind")
}

fn names(value: Option<Vec<Option<String>>>, argument: &str, null_means: &str) -> Option<Vec<String>> {
    let names = value?;
    if names.is_empty() {
        invalid(&format!("{argument} must be NULL ({null_means}) or a non-empty array"));
    }
    Some(names.into_iter().map(|n| name(n, &format!("{argument} element"))).collect())
}
