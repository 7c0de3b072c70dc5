//! The session of a worker or a role runner: its start, its transactions (logged, never fatal),
//! the statistics it reports, the role it is bound to for life, and whether the extension is
//! at this library's version.

use super::sandbox::{self, CaughtFailure};
use crate::pg::privilege::{with_worker_settings, Binding};
use crate::pg::settings;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

pub const WORKER_TYPE: &str = "durable_jobs worker";

unsafe extern "C-unwind" {
    // PostgreSQL's own SIGTERM handler: it makes the next CHECK_FOR_INTERRUPTS exit, also in
    // the middle of a handler's statement, where pgrx's flag-only handler would wait for it.
    fn die(signal: std::ffi::c_int);
}

/// Signal handlers, the connection, and the session settings of a worker or a role runner.
pub(super) fn start_session(application_name: &str) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    unsafe { pg_sys::pqsignal(pg_sys::SIGTERM as i32, Some(die)) };
    BackgroundWorker::connect_worker_to_spi(Some(&settings::database()), settings::worker_role().as_deref());
    set_session_option(c"application_name", application_name);
    // The fences rely on READ COMMITTED's re-check of a row updated concurrently; under a
    // configured REPEATABLE READ default they would raise serialization failures instead.
    set_session_option(c"default_transaction_isolation", "read committed");
}

thread_local! {
    /// When the statistics left pending by the last report are to be flushed, waiting for the
    /// shared entries' locks if need be.
    pub(super) static STATISTICS_DUE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// How long counts may stay pending: a backend's idle loop leaves them up to ten seconds
/// (PGSTAT_IDLE_INTERVAL), as long as a role runner waits for work before it ends.
pub(super) const STATISTICS_PENDING_AT_MOST: Duration = Duration::from_secs(1);

/// Hands this session's table and WAL counts to the cumulative statistics, which autovacuum
/// decides from: PostgreSQL reports a background worker's only when it exits. As a backend's
/// idle loop does (postgres.c): at most once a second and without waiting for a lock; what that
/// leaves pending is flushed, waiting, once due. Returns when that is, for the wait.
/// Between transactions only; an error is logged, not fatal to the worker. (PostgreSQL's
/// unforced report times itself by the last transaction's end, which stands still between
/// transactions: without the forced one, a runner waiting for work would never flush.)
pub(super) fn report_statistics() -> Option<Instant> {
    if unsafe { pg_sys::IsTransactionOrTransactionBlock() } {
        return None;
    }
    let now = Instant::now();
    let force = STATISTICS_DUE.get().is_some_and(|due| now >= due);
    let pending =
        in_transaction_or_logged("reporting statistics", || unsafe { pg_sys::pgstat_report_stat(force) })
            .is_some_and(|pending_ms| pending_ms > 0);
    let due = match pending {
        false => None,
        true if force => Some(now + STATISTICS_PENDING_AT_MOST),
        true => STATISTICS_DUE.get().or(Some(now + STATISTICS_PENDING_AT_MOST)),
    };
    STATISTICS_DUE.set(due);
    due
}

/// Sets a setting for the worker's whole session, above what postgresql.conf, the database or
/// the role set.
pub(super) fn set_session_option(name: &std::ffi::CStr, value: &str) {
    let value = std::ffi::CString::new(value).expect("no NUL");
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
}

/// Runs `f` and returns its result; when `f` raises an error (which aborts the transaction it
/// ran in, the commit included), rolls back, and returns the error. Called between
/// transactions only: it rolls back every level, also subtransactions an error left open (one
/// raised while a job's subtransaction was released), which AbortCurrentTransaction would
/// leave aborted with the transaction around them, failing every later poll.
pub(super) fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, CaughtFailure> {
    PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(f())))
        .catch_others(|error| {
            sandbox::disarm_statement_timeout();
            unsafe {
                pg_sys::AbortOutOfAnyTransaction();
                // What the abort does not when the error came between transactions (postgres.c's
                // recovery does the same); a cancel that came during it would cancel the next
                // statement, not what it was meant for.
                pg_sys::LWLockReleaseAll();
                pg_sys::ConditionVariableCancelSleep();
                pg_sys::QueryCancelPending = 0;
            }
            Err(CaughtFailure::of(&error))
        })
        .execute()
}

/// `in_transaction`, logging an error (its SQLSTATE, never its text, which may quote data).
pub(super) fn in_transaction_or_logged<R>(what: &str, f: impl FnOnce() -> R) -> Option<R> {
    logged(what, in_transaction(f))
}

/// The result of `what`, or None once its error (its SQLSTATE, never its text) is logged.
pub(super) fn logged<R>(what: &str, outcome: Result<R, CaughtFailure>) -> Option<R> {
    match outcome {
        Ok(result) => Some(result),
        Err(error) => {
            log!("{WORKER_TYPE}: {what} failed with SQLSTATE {}; rolled back", error.sqlstate());
            None
        }
    }
}

thread_local! {
    /// The role whose handlers this session runs: that of the first batch a worker ran, of the
    /// first hand-over a runner took.
    pub(super) static BOUND_ROLE: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Whether this session was bound to `BOUND_ROLE`'s oid (`bind_session_to`): false while
    /// that role did not exist.
    pub(super) static SESSION_BOUND: Cell<bool> = const { Cell::new(false) };
    /// Set by a claim that found the bound role's name naming another role now (renamed, or
    /// dropped and created again): the worker ends, to start again with a new session.
    pub(super) static BOUND_ROLE_MOVED: Cell<bool> = const { Cell::new(false) };
}

/// The role this session runs handlers for: its bound role, or `role` if it has none yet.
pub(super) fn bound_role(role: &str) -> String {
    BOUND_ROLE.with(|bound| bound.borrow_mut().get_or_insert_with(|| role.to_owned()).clone())
}

/// Binds the session to its bound role's oid, and makes that role the session's user, before
/// the session runs its handlers (`privilege::bind_session_to_role`); tried again before each
/// of its batches while that role does not exist. A worker (`log_as`) whose login role is not a
/// superuser logs once that its handlers see that role as `session_user`.
pub(super) fn bind_session_to(role: &str, log_as: Option<&str>) {
    if SESSION_BOUND.get() {
        return;
    }
    let binding = in_transaction_or_logged("binding the session to its role", || {
        BackgroundWorker::transaction(|| crate::pg::privilege::bind_session_to_role(role))
    });
    if let (Some(Binding::BoundLoginNotSuperuser), Some(who)) = (binding, log_as) {
        log!(
            "{who}: its login role (durable_jobs.worker_role) is not a superuser, so handlers see it as \
             session_user: give it no rights of its own"
        );
    }
    SESSION_BOUND.set(matches!(binding, Some(Binding::Bound | Binding::BoundLoginNotSuperuser)));
}

/// Whether this session still runs its bound role's handlers: while the role's name names the
/// role it was bound to (see `privilege::session_may_serve_named`); in a transaction.
pub(super) fn session_serves_bound_role() -> bool {
    BOUND_ROLE
        .with(|bound| bound.borrow().as_deref().is_none_or(crate::pg::privilege::session_may_serve_named))
}

/// Runs `f` in a transaction of its own with the worker's settings; an error is logged and
/// rolled back (`in_transaction_or_logged`).
pub(super) fn in_worker_transaction<R>(
    what: &str,
    f: impl FnOnce() -> R + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> Option<R> {
    logged(what, worker_transaction(f))
}

/// Runs `f` in a transaction of its own with the worker's settings; an error is rolled back and
/// returned, as `in_transaction` does.
pub(super) fn worker_transaction<R>(
    f: impl FnOnce() -> R + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> Result<R, CaughtFailure> {
    in_transaction(|| BackgroundWorker::transaction(|| with_worker_settings(f)))
}

/// Whether this database has the extension at the version of this library; an older schema
/// may lack what the worker uses, so the worker waits for `ALTER EXTENSION durable_jobs UPDATE`.
/// Read from the catalog directly, as our statements read the owner: an SPI query here, with
/// its settings and executor, was a twentieth of the path from enqueue to handler.
/// Under the worker's lock timeout: the row is read after a lock on the job table, which a long
/// `LOCK TABLE` or `VACUUM FULL` could otherwise hold the worker on, unlogged and deaf to reloads.
pub(super) fn extension_ready() -> bool {
    with_worker_settings(crate::pg::privilege::installed_at_library_version).is_some()
}
