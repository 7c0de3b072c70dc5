//! The handler's sandbox: the call as the enqueuing role, inside a security-restricted operation,
//! under a statement timeout and a lease watchdog, in a subtransaction of its own; and the
//! clearing of whatever a handler could leave in the session for the next job.

use crate::jobs::trust::{may_run_routine, registrant_serves, RunnableHandler};
use crate::pg::privilege::set_at_this_level;
use crate::pg::randomness;
use crate::pg::sql_types::JsonbDatum;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// The search_path handlers run with, whatever the session's: `pg_temp` last, so that no
/// temporary object can capture a handler's unqualified names.
const HANDLER_SEARCH_PATH: &std::ffi::CStr = c"\"$user\", public, pg_temp";

/// Calls the handler routine by its oid with the payload, as SPI would run `SELECT f($1)` or
/// `CALL p($1)`: after a command counter increment, with a fresh snapshot. The enqueuer must
/// still be allowed to run it (`may_run_routine`; fmgr itself checks nothing).
pub(crate) fn call_handler(handler: RunnableHandler, payload: JsonbDatum) {
    unsafe {
        // Checked again at the call, not only when the batch resolved it: a grant, the owner,
        // the registering role's memberships, the role or the routine itself may have changed since. The caller's `routine_still_exists`
        // has just taken in other sessions' changes to the catalog caches.
        if pg_sys::pg_proc_aclcheck(handler.routine, handler.role, pg_sys::ACL_EXECUTE as pg_sys::AclMode)
            != pg_sys::AclResult::ACLCHECK_OK
            || may_run_routine(handler.routine, handler.role).is_none()
            || !registrant_serves(&handler)
        {
            ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                "permission denied to run the handler of this job"
            );
        }
        // Only as the session's bound role: one renamed, or dropped and created again, after the
        // claim (the worker restarts at its next claim) fails this attempt, retried.
        if !crate::pg::privilege::session_may_run_as(handler.role) {
            ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                "this job's role is not the role this worker session is bound to"
            );
        }
        let flinfo = pg_sys::palloc0(std::mem::size_of::<pg_sys::FmgrInfo>()) as *mut pg_sys::FmgrInfo;
        pg_sys::fmgr_info(handler.routine, flinfo);
        let size = std::mem::size_of::<pg_sys::FunctionCallInfoBaseData>()
            + std::mem::size_of::<pg_sys::NullableDatum>();
        let fcinfo = pg_sys::palloc0(size) as *mut pg_sys::FunctionCallInfoBaseData;
        (*fcinfo).flinfo = flinfo;
        (*fcinfo).nargs = 1;
        (*fcinfo).fncollation = pg_sys::Oid::INVALID;
        if handler.is_procedure {
            let context = PgBox::<pg_sys::CallContext>::alloc_node(pg_sys::NodeTag::T_CallContext);
            (*context.as_ptr()).atomic = true;
            (*fcinfo).context = context.into_pg() as *mut pg_sys::Node;
        }
        let args = (*fcinfo).args.as_mut_slice(1);
        args[0] = pg_sys::NullableDatum { value: payload.into_datum().expect("a payload"), isnull: false };
        pg_sys::CommandCounterIncrement();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        let function = (*flinfo).fn_addr.expect("a function address");
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| function(fcinfo));
        pg_sys::PopActiveSnapshot();
    }
}

/// `SET CONSTRAINTS ALL IMMEDIATE` for the job's subtransaction. Deferred constraints and
/// constraint triggers then fire at the end of each of the handler's statements, inside its
/// subtransaction and as its role, instead of at the batch's commit as the worker's role; and
/// under the security-restricted operation PostgreSQL refuses to defer one to commit at all.
pub(crate) fn fire_constraints_immediately() {
    unsafe {
        let statement =
            PgBox::<pg_sys::ConstraintsSetStmt>::alloc_node(pg_sys::NodeTag::T_ConstraintsSetStmt);
        pg_sys::AfterTriggerSetState(statement.as_ptr());
    }
}

/// Clears what a handler can leave in the session beyond its subtransaction, before another job,
/// maybe another role's, runs: open cursors (portals), session advisory locks, temporary objects
/// (functions, domains and enum types can be made in pg_temp under the restriction), open large
/// objects, the seed of `random()` and a replication origin. PostgreSQL itself refuses PREPARE,
/// LISTEN and WITH HOLD cursors to the handler. The sequence caches go too: `lastval()` would name
/// the last job's sequence. Under the worker's lock timeout: dropping a temporary object can wait.
pub(crate) fn clear_session_state() {
    const USER_LOCKMETHOD: pg_sys::LOCKMETHODID = 2;
    unsafe {
        pg_sys::PortalHashTableDeleteAll();
        pg_sys::LockReleaseSession(USER_LOCKMETHOD);
        pg_sys::ResetTempTableNamespace();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| ResetSequenceCaches());
        let seed = randomness::new_seed();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            AtEOXact_LargeObject(true);
            pg_sys::DirectFunctionCall1Coll(Some(setseed), pg_sys::Oid::INVALID, seed.into_datum().unwrap());
        });
        // A replication origin set up for the session (where pg_replication_origin_session_setup
        // is granted) would tag every later commit of this session, the worker's own included,
        // so that subscribers filtering by origin skip them. As pg_replication_origin_session_reset.
        if pg_sys::replorigin_session_origin != pg_sys::InvalidRepOriginId as pg_sys::RepOriginId {
            pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| pg_sys::replorigin_session_reset());
            pg_sys::replorigin_session_origin = pg_sys::InvalidRepOriginId as pg_sys::RepOriginId;
            pg_sys::replorigin_session_origin_lsn = 0;
            pg_sys::replorigin_session_origin_timestamp = 0;
        }
    }
}

// Not in pgrx's bindings, or only as Rust wrappers: libpq/be-fsstubs.h, utils/fmgrprotos.h and
// utils/timeout.h. STATEMENT_TIMEOUT is the fourth TimeoutId on PostgreSQL 15 through 18;
// USER_TIMEOUT, which asks RegisterTimeout for a free slot, is 12 on 15 and 16, and 13 from 17
// on (TRANSACTION_TIMEOUT came before it); check timeout.h when adding a version.
const STATEMENT_TIMEOUT: std::ffi::c_int = 3;
#[cfg(any(feature = "pg15", feature = "pg16"))]
const USER_TIMEOUT: std::ffi::c_int = 12;
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
const USER_TIMEOUT: std::ffi::c_int = 13;
unsafe extern "C-unwind" {
    /// Closes every open large object descriptor, as the end of a transaction would.
    fn AtEOXact_LargeObject(is_commit: bool);
    /// commands/sequence.h: what `DISCARD SEQUENCES` does.
    fn ResetSequenceCaches();
    fn setseed(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
    fn enable_timeout_after(id: std::ffi::c_int, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: std::ffi::c_int, keep_indicator: bool);
    fn RegisterTimeout(
        id: std::ffi::c_int,
        handler: Option<unsafe extern "C-unwind" fn()>,
    ) -> std::ffi::c_int;
}

/// The timer that ends the worker when a handler outlives its lease: a handler can catch the
/// statement timeout's cancel (`EXCEPTION WHEN query_canceled`), not this. Its lease is over by
/// then, so its writes can never commit; the postmaster restarts the worker.
static LEASE_WATCHDOG: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
/// Set when the watchdog fired, so that the exit says why (PostgreSQL's own line blames an
/// administrator command).
static LEASE_OUTLIVED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

unsafe extern "C-unwind" fn handler_outlived_its_lease() {
    // What PostgreSQL's SIGTERM handler does: the next interrupt check exits the process.
    LEASE_OUTLIVED.store(true, std::sync::atomic::Ordering::Relaxed);
    unsafe {
        pg_sys::InterruptPending = 1;
        pg_sys::ProcDiePending = 1;
        pg_sys::SetLatch(pg_sys::MyLatch);
    }
}

unsafe extern "C-unwind" fn explain_exit(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
    if LEASE_OUTLIVED.load(std::sync::atomic::Ordering::Relaxed) {
        log!(
            "durable_jobs worker: a handler outlived its lease (it caught its statement timeout, or ran \
             code that does not check for interrupts); exiting"
        );
    }
}

fn lease_watchdog() -> std::ffi::c_int {
    use std::sync::atomic::Ordering;
    let mut id = LEASE_WATCHDOG.load(Ordering::Relaxed);
    if id < 0 {
        id = unsafe {
            pg_sys::before_shmem_exit(Some(explain_exit), pg_sys::Datum::from(0));
            pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
                RegisterTimeout(USER_TIMEOUT, Some(handler_outlived_its_lease))
            })
        };
        LEASE_WATCHDOG.store(id, Ordering::Relaxed);
    }
    id
}

/// Disarms the handler's statement timeout and the lease watchdog; called on every path.
pub fn disarm_statement_timeout() {
    unsafe {
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            disable_timeout(STATEMENT_TIMEOUT, false);
            let watchdog = LEASE_WATCHDOG.load(std::sync::atomic::Ordering::Relaxed);
            if watchdog >= 0 {
                disable_timeout(watchdog, false);
            }
        })
    };
}

/// Runs `f` as `role` under a statement timeout, inside a security-restricted operation, as
/// PostgreSQL runs maintenance commands on another role's table: the handler cannot `SET ROLE`,
/// `SET SESSION AUTHORIZATION`, create temporary objects, declare `WITH HOLD` cursors, `LISTEN`,
/// or defer a trigger to commit, so nothing it starts runs after it as anyone else. The GUC nest
/// level undoes any setting the handler changed; search_path is pinned, and lock_timeout is the
/// session's again, not the worker's own.
pub(crate) fn as_enqueuer(role: pg_sys::Oid, timeout_ms: i64, f: impl FnOnce()) {
    // The lease ends a margin after the statement timeout (at most 2 s); a second more, then stop.
    let watchdog_ms = (timeout_ms + 3000).min(i64::from(i32::MAX)) as i32;
    let timeout_ms = timeout_ms.min(i64::from(i32::MAX)) as i32;
    let mut saved_user = pg_sys::Oid::INVALID;
    let mut saved_context = 0;
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let level = pg_sys::NewGUCNestLevel();
        set_at_this_level(c"search_path", HANDLER_SEARCH_PATH);
        let session_lock_timeout = pg_sys::GetConfigOptionResetString(c"lock_timeout".as_ptr());
        set_at_this_level(c"lock_timeout", std::ffi::CStr::from_ptr(session_lock_timeout));
        let restricted = pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_RESTRICTED_OPERATION;
        pg_sys::SetUserIdAndSecContext(role, saved_context | restricted as i32);
        let watchdog = lease_watchdog();
        pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
            enable_timeout_after(STATEMENT_TIMEOUT, timeout_ms);
            enable_timeout_after(watchdog, watchdog_ms);
        });
        f();
        // A statement timeout that fired as the handler ended (one that checks for interrupts
        // seldom, in C or another language) is the handler's: raised here, not in whatever
        // statement of the worker's comes next.
        pg_sys::check_for_interrupts!();
        disarm_statement_timeout();
        pg_sys::AtEOXact_GUC(false, level);
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
    }
}

/// An error caught in a job's subtransaction.
pub struct CaughtFailure {
    /// The SQLSTATE as PostgreSQL packs it (MAKE_SQLSTATE), so that it can be raised again.
    pub packed_sqlstate: i32,
    pub message: String,
}

impl CaughtFailure {
    /// What an error caught by a `PgTryBuilder` reported: its SQLSTATE and message.
    pub fn of(error: &pg_sys::panic::CaughtError) -> CaughtFailure {
        let report = report_of(error);
        CaughtFailure {
            packed_sqlstate: report.sql_error_code() as i32,
            message: report.message().to_string(),
        }
    }

    pub fn sqlstate(&self) -> String {
        sqlstate_text(self.packed_sqlstate)
    }
}

/// Runs `f` in a subtransaction that is released when `f` returns true and rolled back when it
/// returns false or raises an error, whose SQLSTATE and message are returned. An error raised
/// while it is released (by another extension's subtransaction callback) rolls it back too and
/// is returned the same way, as PL/pgSQL's exception blocks do, unless the release had gone past
/// handing the subtransaction's writes to its parent: then it fails the whole transaction, whose
/// commit would otherwise keep them. User, memory context and resource owner are restored on
/// every path, and the statement timeout and lease watchdog, which also bound the release (a
/// callback may wait on another server), disarmed.
pub(crate) fn in_subtransaction(f: impl FnOnce() -> bool) -> Result<bool, CaughtFailure> {
    unsafe {
        let memory_context = pg_sys::CurrentMemoryContext;
        let resource_owner = pg_sys::CurrentResourceOwner;
        let mut saved_user = pg_sys::Oid::INVALID;
        let mut saved_context = 0;
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);

        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(memory_context);
        let caught = |error: pg_sys::panic::CaughtError| Err(CaughtFailure::of(&error));
        let mut result =
            PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(f()))).catch_others(caught).execute();
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        if matches!(result, Ok(true)) {
            result = PgTryBuilder::new(|| {
                pg_sys::ReleaseCurrentSubTransaction();
                Ok(true)
            })
            .catch_others(|error| {
                // CommitSubTransaction moved on from "in progress" once it listed the
                // subtransaction among its parent's children (AtSubCommit_childXids).
                if !pg_sys::IsTransactionState() {
                    error.rethrow();
                }
                caught(error)
            })
            .execute();
            pg_sys::MemoryContextSwitchTo(memory_context);
        }
        if !matches!(result, Ok(true)) {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        disarm_statement_timeout();
        pg_sys::MemoryContextSwitchTo(memory_context);
        pg_sys::CurrentResourceOwner = resource_owner;
        result
    }
}

fn report_of(error: &pg_sys::panic::CaughtError) -> &pg_sys::panic::ErrorReportWithLevel {
    use pg_sys::panic::CaughtError;
    match error {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => report,
        CaughtError::RustPanic { ereport, .. } => ereport,
    }
}

/// Decodes a packed SQLSTATE (MAKE_SQLSTATE: five 6-bit characters, first in the low bits).
pub(crate) fn sqlstate_text(packed: i32) -> String {
    (0..5).map(|i| (((packed >> (6 * i)) & 0x3F) as u8 + b'0') as char).collect()
}

/// Whether a caught error is a wait for a lock given up: a lock timeout, or a deadlock with the
/// session holding the row.
pub(crate) fn gave_up_waiting(error: &CaughtFailure) -> bool {
    matches!(error.sqlstate().as_str(), "55P03" | "40P01")
}

/// Raises a caught error again, with its SQLSTATE and message.
pub(crate) fn raise_again(error: CaughtFailure) -> ! {
    ereport!(ERROR, PgSqlErrorCode::from(error.packed_sqlstate), error.message);
}
