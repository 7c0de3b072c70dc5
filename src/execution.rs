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
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// For each claimed job whose lease is still exactly ours: its payload, its handler call, the
/// enqueuing role and its lease expiry (Unix microseconds). Handler or role may be gone (NULL).
const LOAD_JOBS: &str = "
    SELECT j.job_id,
           j.payload::pg_catalog.text,
           CASE p.prokind WHEN 'p' THEN 'CALL ' ELSE 'SELECT ' END
               || pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname)
               || '($1::pg_catalog.jsonb)',
           r.oid,
           (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
         AS c(job_id, lease_token)
    JOIN durable_jobs.durable_job j ON j.job_id = c.job_id AND j.lease_token = c.lease_token
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    LEFT JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(h.handler)
    LEFT JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    LEFT JOIN pg_catalog.pg_roles r ON r.rolname = j.enqueued_by
    WHERE j.job_state = 'running' AND j.lease_owner = $3";

struct LoadedJob {
    payload: String,
    handler_call: Option<String>,
    role: Option<pg_sys::Oid>,
    lease_expires_unix_us: i64,
}

/// Loads a batch of claimed jobs with one query; a job missing from the result lost its lease.
fn load_jobs(jobs: &[(i64, Uuid)], worker_id: &str) -> HashMap<i64, LoadedJob> {
    let ids: Vec<i64> = jobs.iter().map(|(id, _)| *id).collect();
    let tokens: Vec<Uuid> = jobs.iter().map(|(_, token)| *token).collect();
    Spi::connect_mut(|client| {
        plans::execute(client, LOAD_JOBS, &[ids.into(), tokens.into(), worker_id.into()])
            .map(|row| {
                let job = LoadedJob {
                    payload: row.get(2).unwrap().unwrap(),
                    handler_call: row.get(3).unwrap(),
                    role: row.get(4).unwrap(),
                    lease_expires_unix_us: row.get(5).unwrap().unwrap(),
                };
                (row.get::<i64>(1).unwrap().unwrap(), job)
            })
            .collect()
    })
}

/// The statement timeout for a handler: the lease left now, less a margin so that the fenced
/// failure still lands inside the lease. None when too little is left to start.
fn handler_timeout_ms(lease_expires_unix_us: i64) -> Option<i32> {
    let now_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
    let lease_left_ms = (lease_expires_unix_us - now_us) / 1000;
    let margin = (lease_left_ms / 10).clamp(100, 2000);
    let timeout = lease_left_ms - margin;
    (timeout >= 10).then(|| timeout.min(i32::MAX as i64) as i32)
}

/// Runs a batch of claimed jobs, each in its own subtransaction; the caller's transaction
/// commits whatever this leaves in place.
pub fn run_jobs(jobs: &[(i64, Uuid)], worker_id: &str) {
    let mut loaded = with_pinned_search_path(|| load_jobs(jobs, worker_id));
    for (job_id, lease_token) in jobs {
        match loaded.remove(job_id) {
            Some(job) => run_job(*job_id, *lease_token, worker_id, job),
            None => metrics::count(Counter::Stale),
        }
    }
}

fn run_job(job_id: i64, lease_token: Uuid, worker_id: &str, job: LoadedJob) {
    let fail = |code: FailureCode| {
        let outcome = with_pinned_search_path(|| lease::fail_job(job_id, worker_id, lease_token, code));
        metrics::count(Counter::for_outcome(outcome));
    };
    let (Some(handler_call), Some(role)) = (job.handler_call, job.role) else {
        // The handler was unregistered or dropped, or the enqueuing role no longer exists.
        fail(FailureCode::TargetRejected);
        return;
    };
    let Some(timeout_ms) = handler_timeout_ms(job.lease_expires_unix_us) else {
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
