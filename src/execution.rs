//! Running a claimed batch's handlers inside the background worker.
//!
//! Each job runs in its own subtransaction, as the role that enqueued it, under a
//! security-restricted operation and a statement timeout that ends before its lease does. On
//! success the fenced completion runs in the same subtransaction, so the handler's writes commit
//! exactly when the job is marked succeeded and are rolled back when the lease was lost. On
//! error the subtransaction is rolled back and the job is failed, fenced, with the stable code
//! of the error's SQLSTATE. Whatever a handler could leave in the session is cleared before the
//! next job runs.

use crate::failure::FailureCode;
use crate::lease;
use crate::metrics::{Counter, Tally};
use crate::plans;
use crate::privilege::{as_extension_owner, with_pinned_search_path};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// For each claimed job whose lease is still exactly ours: its payload, its handler call, the
/// enqueuing role, its lease expiry (Unix microseconds), and whether it may run: the enqueuer
/// may execute the handler, and the handler's owner is a superuser or, for an enqueuer that is
/// not one, a role whose privileges the enqueuer has (itself or a role it is a member of).
const LOAD_JOBS: &str = "
    SELECT j.job_id,
           j.payload::pg_catalog.text,
           CASE p.prokind WHEN 'p' THEN 'CALL ' ELSE 'SELECT ' END
               || pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname)
               || '($1::pg_catalog.jsonb)',
           r.oid,
           (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8,
           COALESCE(pg_catalog.has_function_privilege(r.oid, p.oid, 'EXECUTE')
                    AND (o.rolsuper OR (NOT r.rolsuper AND pg_catalog.pg_has_role(r.oid, o.oid, 'USAGE'))),
                    false)
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
         AS c(job_id, lease_token)
    JOIN durable_jobs.durable_job j ON j.job_id = c.job_id AND j.lease_token = c.lease_token
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    LEFT JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(h.handler)
    LEFT JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    LEFT JOIN pg_catalog.pg_roles o ON o.oid = p.proowner
    LEFT JOIN pg_catalog.pg_roles r ON r.rolname = j.enqueued_by
    WHERE j.job_state = 'running' AND j.lease_owner = $3";

/// The search_path handlers run with, whatever the session's: `pg_temp` last, so that no
/// temporary object can capture a handler's unqualified names.
const HANDLER_SEARCH_PATH: &std::ffi::CStr = c"\"$user\", public, pg_temp";

struct LoadedJob {
    payload: String,
    /// The handler call and the enqueuing role, when the job may run.
    runnable: Option<(String, pg_sys::Oid)>,
    lease_expires_unix_us: i64,
}

/// Loads a batch of claimed jobs with one query; a job missing from the result lost its lease.
fn load_jobs(jobs: &[(i64, Uuid)], worker_id: &str) -> HashMap<i64, LoadedJob> {
    let ids: Vec<i64> = jobs.iter().map(|(id, _)| *id).collect();
    let tokens: Vec<Uuid> = jobs.iter().map(|(_, token)| *token).collect();
    as_extension_owner(|| {
        Spi::connect_mut(|client| {
            plans::execute(client, LOAD_JOBS, &[ids.into(), tokens.into(), worker_id.into()])
                .map(|row| {
                    let handler_call: Option<String> = row.get(3).unwrap();
                    let role: Option<pg_sys::Oid> = row.get(4).unwrap();
                    let may_run: bool = row.get(6).unwrap().unwrap();
                    let job = LoadedJob {
                        payload: row.get(2).unwrap().unwrap(),
                        runnable: handler_call.zip(role).filter(|_| may_run),
                        lease_expires_unix_us: row.get(5).unwrap().unwrap(),
                    };
                    (row.get::<i64>(1).unwrap().unwrap(), job)
                })
                .collect()
        })
    })
}

fn now_unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// How long before its lease ends a handler is stopped, so that the fenced failure still lands
/// inside the lease.
fn lease_margin_ms(lease_seconds: i32) -> i64 {
    (i64::from(lease_seconds) * 100).clamp(100, 2000)
}

/// Runs a batch of claimed jobs, each in its own subtransaction; the caller's transaction
/// commits whatever this leaves in place. Every handler gets the whole handler timeout (the
/// lease less its margin): before a handler starts with less lease than that left, the leases
/// of the batch's remaining jobs are renewed in one statement.
pub fn run_jobs(jobs: &[(i64, Uuid)], worker_id: &str, lease_seconds: i32) -> Tally {
    let mut tally = Tally::default();
    let margin_ms = lease_margin_ms(lease_seconds);
    let timeout_ms = i64::from(lease_seconds) * 1000 - margin_ms;
    let mut loaded = with_pinned_search_path(|| load_jobs(jobs, worker_id));
    for (position, (job_id, lease_token)) in jobs.iter().enumerate() {
        let Some(expiry) = loaded.get(job_id).map(|job| job.lease_expires_unix_us) else {
            tally.count(Counter::Stale);
            continue;
        };
        if expiry - now_unix_us() < (timeout_ms + margin_ms / 2) * 1000 {
            let remaining: Vec<(i64, Uuid)> =
                jobs[position..].iter().filter(|(id, _)| loaded.contains_key(id)).copied().collect();
            let renewed =
                with_pinned_search_path(|| lease::renew_leases(&remaining, worker_id, lease_seconds));
            let renewed: HashMap<i64, i64> = renewed.into_iter().collect();
            // A lease that could not be renewed was lost: that job is not ours to run.
            loaded.retain(|id, job| match renewed.get(id) {
                Some(expiry) => {
                    job.lease_expires_unix_us = *expiry;
                    true
                }
                None => !remaining.iter().any(|(r, _)| r == id),
            });
        }
        match loaded.remove(job_id) {
            Some(job) => run_job(*job_id, *lease_token, worker_id, job, timeout_ms, &mut tally),
            None => tally.count(Counter::Stale),
        }
        clear_session_state();
    }
    tally
}

fn run_job(
    job_id: i64,
    lease_token: Uuid,
    worker_id: &str,
    job: LoadedJob,
    timeout_ms: i64,
    tally: &mut Tally,
) {
    let Some((handler_call, role)) = job.runnable else {
        // No handler, an enqueuer that no longer exists, or a handler it may not run.
        record_failure(job_id, lease_token, worker_id, FailureCode::TargetRejected, tally);
        return;
    };
    let outcome = in_subtransaction(|| {
        fire_constraints_immediately();
        as_enqueuer(role, timeout_ms.min(i64::from(i32::MAX)) as i32, || {
            Spi::connect_mut(|client| {
                plans::execute(client, &handler_call, &[job.payload.as_str().into()]);
            });
        });
        with_pinned_search_path(|| lease::complete_job(job_id, worker_id, lease_token)) == "succeeded"
    });
    match outcome {
        Ok(true) => tally.count(Counter::Succeeded),
        Ok(false) => tally.count(Counter::Stale),
        Err(sqlstate) => {
            record_failure(job_id, lease_token, worker_id, FailureCode::from_sqlstate(&sqlstate), tally)
        }
    }
}

/// The fenced failure of one job, in a subtransaction of its own: an error there (a deadlock
/// with a concurrent cancel, a lock timeout) is logged and leaves the job to its lease, which
/// another claim takes over once it expires.
pub fn record_failure(job_id: i64, lease_token: Uuid, worker_id: &str, code: FailureCode, tally: &mut Tally) {
    let outcome = in_subtransaction(|| {
        let outcome = with_pinned_search_path(|| lease::fail_job(job_id, worker_id, lease_token, code));
        tally.count(Counter::for_outcome(outcome));
        true
    });
    if let Err(sqlstate) = outcome {
        log!(
            "durable_jobs worker: could not record the failure of job {job_id} (SQLSTATE {sqlstate}); \
             it is claimed again when its lease expires"
        );
    }
}

/// `SET CONSTRAINTS ALL IMMEDIATE` for the job's subtransaction. Deferred constraints and
/// constraint triggers then fire at the end of each of the handler's statements, inside its
/// subtransaction and as its role, instead of at the batch's commit as the worker's role; and
/// under the security-restricted operation PostgreSQL refuses to defer one to commit at all.
fn fire_constraints_immediately() {
    unsafe {
        let statement =
            PgBox::<pg_sys::ConstraintsSetStmt>::alloc_node(pg_sys::NodeTag::T_ConstraintsSetStmt);
        pg_sys::AfterTriggerSetState(statement.as_ptr());
    }
}

/// Clears what a handler can leave in the session beyond its subtransaction, before another
/// job, maybe another role's, runs: open cursors (portals), session advisory locks, temporary
/// objects (only a function can be made in pg_temp under the restriction) and open large
/// objects. PostgreSQL itself refuses PREPARE, LISTEN and WITH HOLD cursors to the handler.
fn clear_session_state() {
    const USER_LOCKMETHOD: pg_sys::LOCKMETHODID = 2;
    unsafe {
        pg_sys::PortalHashTableDeleteAll();
        pg_sys::LockReleaseSession(USER_LOCKMETHOD);
        pg_sys::ResetTempTableNamespace();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| AtEOXact_LargeObject(true));
    }
}

// libpq/be-fsstubs.h; not in pgrx's bindings. Closes every open large object descriptor, as
// the end of a transaction would.
unsafe extern "C-unwind" {
    fn AtEOXact_LargeObject(is_commit: bool);
}

// utils/timeout.h; not in pgrx's bindings. STATEMENT_TIMEOUT is the fourth TimeoutId on
// PostgreSQL 15 through 18.
const STATEMENT_TIMEOUT: std::ffi::c_int = 3;
unsafe extern "C-unwind" {
    fn enable_timeout_after(id: std::ffi::c_int, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: std::ffi::c_int, keep_indicator: bool);
}

pub fn disarm_statement_timeout() {
    unsafe { pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| disable_timeout(STATEMENT_TIMEOUT, false)) };
}

/// Runs `f` as `role` under a statement timeout, inside a security-restricted operation, as
/// PostgreSQL runs maintenance commands on another role's table: the handler cannot `SET ROLE`,
/// `SET SESSION AUTHORIZATION`, create temporary objects, declare `WITH HOLD` cursors, `LISTEN`,
/// or defer a trigger to commit, so nothing it starts runs after it as anyone else. The GUC nest
/// level undoes any setting the handler changed; search_path is pinned.
fn as_enqueuer(role: pg_sys::Oid, timeout_ms: i32, f: impl FnOnce()) {
    let mut saved_user = pg_sys::Oid::INVALID;
    let mut saved_context = 0;
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            HANDLER_SEARCH_PATH.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        let restricted = pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION;
        pg_sys::SetUserIdAndSecContext(role, saved_context | restricted as i32);
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

pub fn sqlstate_of(error: &pg_sys::panic::CaughtError) -> String {
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
