//! Running one claimed job's handler inside the background worker.
//!
//! The handler runs in a subtransaction, as the role that enqueued the job, under a statement
//! timeout that ends before the lease does. On success the fenced completion runs in the same
//! subtransaction, so the handler's writes commit exactly when the job is marked succeeded and
//! are rolled back when the lease was lost. On error the subtransaction is rolled back and the
//! job is failed, fenced, with the stable code of the error's SQLSTATE.

use crate::failure::FailureCode;
use crate::lease;
use crate::metrics::{self, Counter};
use crate::plans;
use crate::privilege::with_pinned_search_path;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;

/// The job's payload, its handler call, the enqueuing role and the lease time left, for a job
/// whose lease is still exactly ours. Handler or role may be gone (NULL).
const LOAD_JOB: &str = "
    SELECT j.payload::pg_catalog.text,
           CASE p.prokind WHEN 'p' THEN 'CALL ' ELSE 'SELECT ' END
               || pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname)
               || '($1::pg_catalog.jsonb)',
           r.oid,
           (pg_catalog.date_part('epoch', j.lease_expires_at - pg_catalog.clock_timestamp())
               * 1000)::pg_catalog.int8
    FROM durable_jobs.durable_job j
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    LEFT JOIN pg_catalog.pg_proc p ON p.oid = h.handler
    LEFT JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    LEFT JOIN pg_catalog.pg_roles r ON r.rolname = j.enqueued_by
    WHERE j.job_id = $1 AND j.job_state = 'running' AND j.lease_owner = $2 AND j.lease_token = $3";

struct LoadedJob {
    payload: String,
    handler_call: Option<String>,
    role: Option<pg_sys::Oid>,
    lease_left_ms: i64,
}

fn load_job(job_id: i64, worker_id: &str, lease_token: Uuid) -> Option<LoadedJob> {
    Spi::connect_mut(|client| {
        let rows = plans::execute(client, LOAD_JOB, &[job_id.into(), worker_id.into(), lease_token.into()]);
        if rows.is_empty() {
            return None;
        }
        let row = rows.first();
        Some(LoadedJob {
            payload: row.get(1).unwrap().unwrap(),
            handler_call: row.get(2).unwrap(),
            role: row.get(3).unwrap(),
            lease_left_ms: row.get(4).unwrap().unwrap(),
        })
    })
}

/// The statement timeout for a handler: the lease left, less a margin so that the fenced
/// failure still lands inside the lease.
fn handler_timeout_ms(lease_left_ms: i64) -> Option<i32> {
    let margin = (lease_left_ms / 10).clamp(100, 2000);
    let timeout = lease_left_ms - margin;
    (timeout >= 10).then(|| timeout.min(i32::MAX as i64) as i32)
}

/// Runs the claimed job; the caller's transaction commits whatever this leaves in place.
pub fn run_job(job_id: i64, worker_id: &str, lease_token: Uuid) {
    let Some(job) = with_pinned_search_path(|| load_job(job_id, worker_id, lease_token)) else {
        metrics::count(Counter::Stale);
        return;
    };
    let fail = |code: FailureCode| {
        let outcome = with_pinned_search_path(|| lease::fail_job(job_id, worker_id, lease_token, code));
        metrics::count(Counter::for_outcome(outcome));
    };
    let (Some(handler_call), Some(role)) = (job.handler_call, job.role) else {
        // The handler was unregistered or dropped, or the enqueuing role no longer exists.
        fail(FailureCode::TargetRejected);
        return;
    };
    let Some(timeout_ms) = handler_timeout_ms(job.lease_left_ms) else {
        metrics::count(Counter::Stale);
        return;
    };

    let outcome = in_subtransaction(|| {
        as_role_with_timeout(role, timeout_ms, || {
            Spi::connect_mut(|client| {
                plans::execute(client, &handler_call, &[job.payload.as_str().into()]);
            });
        });
        with_pinned_search_path(|| lease::complete_job(job_id, worker_id, lease_token)) == "succeeded"
    });
    match outcome {
        Ok(true) => metrics::count(Counter::Succeeded),
        Ok(false) => metrics::count(Counter::Stale),
        Err(sqlstate) => fail(FailureCode::from_sqlstate(&sqlstate)),
    }
}

// utils/timeout.h; not in pgrx's bindings. STATEMENT_TIMEOUT is the fourth TimeoutId on
// PostgreSQL 15 through 18.
const STATEMENT_TIMEOUT: std::ffi::c_int = 3;
unsafe extern "C-unwind" {
    fn enable_timeout_after(id: std::ffi::c_int, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: std::ffi::c_int, keep_indicator: bool);
}

fn disarm_statement_timeout() {
    unsafe { pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| disable_timeout(STATEMENT_TIMEOUT, false)) };
}

/// Runs `f` as `role` under a statement timeout. Changing the user with
/// SECURITY_LOCAL_USERID_CHANGE keeps the handler from `SET ROLE`/`RESET ROLE` back to the
/// worker's superuser; the GUC nest level undoes any `SET` the handler made.
fn as_role_with_timeout(role: pg_sys::Oid, timeout_ms: i32, f: impl FnOnce()) {
    let mut saved_user = pg_sys::Oid::INVALID;
    let mut saved_context = 0;
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::SetUserIdAndSecContext(role, saved_context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32);
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            enable_timeout_after(STATEMENT_TIMEOUT, timeout_ms)
        });
        f();
        disarm_statement_timeout();
        pg_sys::AtEOXact_GUC(false, level);
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
    }
}

/// Runs `f` in a subtransaction that is released when `f` returns true and rolled back when it
/// returns false or raises an error, whose SQLSTATE is returned. User, memory context and
/// resource owner are restored on every path, and the statement timeout disarmed.
fn in_subtransaction(f: impl FnOnce() -> bool) -> Result<bool, String> {
    unsafe {
        let memory_context = pg_sys::CurrentMemoryContext;
        let resource_owner = pg_sys::CurrentResourceOwner;
        let mut saved_user = pg_sys::Oid::INVALID;
        let mut saved_context = 0;
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);

        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(memory_context);
        let result = PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(f())))
            .catch_others(|error| Err(sqlstate_of(&error)))
            .execute();
        disarm_statement_timeout();
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        if result == Ok(true) {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        pg_sys::MemoryContextSwitchTo(memory_context);
        pg_sys::CurrentResourceOwner = resource_owner;
        result
    }
}

fn sqlstate_of(error: &pg_sys::panic::CaughtError) -> String {
    use pg_sys::panic::CaughtError;
    let report = match error {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => report,
        CaughtError::RustPanic { ereport, .. } => ereport,
    };
    sqlstate_text(report.sql_error_code() as i32)
}

/// Decodes a packed SQLSTATE (MAKE_SQLSTATE: five 6-bit characters, first in the low bits).
pub(crate) fn sqlstate_text(packed: i32) -> String {
    (0..5).map(|i| (((packed >> (6 * i)) & 0x3F) as u8 + b'0') as char).collect()
}
