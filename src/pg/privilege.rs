//! Who is calling, and running our own statements with the extension owner's rights.
//!
//! No role but the owner has any privilege on the job table. The SQL functions are SECURITY
//! INVOKER, so EXECUTE on each is what a role is granted; inside, they note the calling role and
//! switch to the extension owner, as pg_cron does, rather than SECURITY DEFINER, which would
//! hide the caller.

use pgrx::pg_sys;
use pgrx::prelude::*;

/// SQL: `$bypass`, or the role `$caller` (an oid) has the privileges of the role named by the
/// column `$role_name`, as `pg_has_role(..., 'USAGE')` says; false for a role that no longer
/// exists (pg_has_role by name would raise).
#[macro_export]
macro_rules! has_privileges_of_role {
    ($bypass:literal, $caller:literal, $role_name:literal) => {
        concat!(
            "(",
            $bypass,
            " OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = ",
            $role_name,
            " AND pg_catalog.pg_has_role(",
            $caller,
            ", r.oid, 'USAGE')))"
        )
    };
}

pub struct Caller {
    pub role_oid: pg_sys::Oid,
    pub role_name: String,
    pub is_superuser: bool,
}

pub fn caller() -> Caller {
    unsafe {
        let role_oid = pg_sys::GetUserId();
        let name = pg_sys::GetUserNameFromId(role_oid, false);
        Caller {
            role_oid,
            role_name: std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned(),
            is_superuser: pg_sys::superuser_arg(role_oid),
        }
    }
}

/// Versions whose schema predates the status API (state_version, the fingerprint of every
/// payload, the audit table). This library serves them until ALTER EXTENSION durable_jobs UPDATE.
const VERSIONS_BEFORE_STATUS_API: [&str; 3] = ["0.1.0", "0.2.0", "0.3.0"];
/// Versions whose schema predates the attempt history (`jobs::attempts`).
const VERSIONS_BEFORE_ATTEMPT_HISTORY: [&str; 5] = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"];

/// What our statements need to know of the installed extension.
#[derive(Clone, Copy)]
pub struct Installed {
    pub owner: pg_sys::Oid,
    /// The schema has the status API's columns and tables (0.4.0 on).
    pub has_status_api: bool,
    /// The schema has the attempt history's columns and table (0.6.0 on).
    pub has_attempt_history: bool,
    /// The schema is this library's version (what the background workers wait for).
    pub at_library_version: bool,
}

/// The extension's pg_extension row, as `installed_row` reads it.
pub struct InstalledRow {
    /// The row's oid: another after DROP and CREATE EXTENSION.
    pub extension: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    pub version: String,
}

/// The extension's row, read from pg_extension on every call, as `get_extension_oid` reads that
/// row anyway: no cache to go stale after `REASSIGN OWNED` or `ALTER EXTENSION UPDATE`. None
/// when the extension is not installed in this database.
pub fn installed_row() -> Option<InstalledRow> {
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        // The job table first: an ALTER EXTENSION durable_jobs UPDATE in progress that alters the
        // table holds it, so a call that crosses one reads the version it left (the lock
        // processes its invalidations), not the one before, and runs the statements of the
        // schema it will meet.
        let schema = pg_sys::get_namespace_oid(c"durable_jobs".as_ptr(), true);
        if schema != pg_sys::Oid::INVALID {
            let table = pg_sys::get_relname_relid(c"durable_job".as_ptr(), schema);
            if table != pg_sys::Oid::INVALID {
                pg_sys::LockRelationOid(table, lock);
            }
        }
        let catalog = pg_sys::table_open(pg_sys::ExtensionRelationId, lock);
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut key,
            pg_sys::Anum_pg_extension_extname as pg_sys::AttrNumber,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_NAMEEQ),
            pg_sys::Datum::from(c"durable_jobs".as_ptr()),
        );
        let index = pg_sys::Oid::from(pg_sys::ExtensionNameIndexId);
        let scan = pg_sys::systable_beginscan(catalog, index, true, std::ptr::null_mut(), 1, &mut key);
        let row = pg_sys::systable_getnext(scan);
        let found = (!row.is_null()).then(|| {
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_extension>(row);
            let mut is_null = false;
            let version = pg_sys::heap_getattr(
                row,
                pg_sys::Anum_pg_extension_extversion as i32,
                (*catalog).rd_att,
                &mut is_null,
            );
            InstalledRow {
                extension: (*form).oid,
                owner: (*form).extowner,
                version: String::from_datum(version, is_null).unwrap_or_default(),
            }
        });
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(catalog, lock);
        found
    }
}

/// The extension's row when it is installed at this library's version (an older schema may
/// lack what the background worker uses); locks the job table as `installed_row` does.
pub fn installed_at_library_version() -> Option<InstalledRow> {
    installed_row().filter(|row| row.version == env!("CARGO_PKG_VERSION"))
}

/// `installed_row`, as our statements need it; raises when the extension is not installed.
fn installed() -> Installed {
    let found = installed_row();
    if found.is_none() {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
            "extension durable_jobs is not installed in this database"
        );
    }
    Installed::from(&found.unwrap())
}

impl From<&InstalledRow> for Installed {
    fn from(row: &InstalledRow) -> Installed {
        Installed {
            owner: row.owner,
            has_status_api: !VERSIONS_BEFORE_STATUS_API.contains(&row.version.as_str()),
            has_attempt_history: !VERSIONS_BEFORE_ATTEMPT_HISTORY.contains(&row.version.as_str()),
            at_library_version: row.version == env!("CARGO_PKG_VERSION"),
        }
    }
}

/// Runs `f` as the extension owner. An ERROR inside aborts the (sub)transaction, which restores
/// the previous user by itself; the normal path restores it here.
pub fn as_extension_owner<R>(f: impl FnOnce() -> R) -> R {
    as_extension_owner_of(|_| f())
}

/// `as_extension_owner`, telling `f` what is installed.
pub fn as_extension_owner_of<R>(f: impl FnOnce(Installed) -> R) -> R {
    let installed = installed();
    as_owner(installed.owner, || f(installed))
}

/// `as_extension_owner_of`, with the extension's row `installed_row` read earlier in the same
/// transaction. Its lock on the job table holds off what changes the table (DROP EXTENSION, an
/// update that alters the table, REASSIGN OWNED of the table); an update that replaces only
/// functions can still commit in between, as between any two reads.
pub fn as_extension_owner_found<R>(row: &InstalledRow, f: impl FnOnce(Installed) -> R) -> R {
    let installed = Installed::from(row);
    as_owner(installed.owner, || f(installed))
}

/// Runs `f` as `owner`, the extension owner an `installed_row` read found; see
/// `as_extension_owner`.
pub fn as_owner<R>(owner: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    let mut saved_user = pg_sys::Oid::INVALID;
    let mut saved_context = 0;
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        pg_sys::SetUserIdAndSecContext(owner, saved_context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32);
    }
    let result = f();
    unsafe { pg_sys::SetUserIdAndSecContext(saved_user, saved_context) };
    result
}

/// The role (oid) whose handlers this session runs, once bound (`bind_session_to_role`); 0
/// before. A role renamed, or dropped and created again under its name, is another role.
static BOUND_ROLE_OID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// What `bind_session_to_role` did.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// The session runs that role's handlers only, and the role is its user (`session_user`).
    Bound,
    /// The same, but the session's user is still its login role, which is not a superuser (as
    /// `SET SESSION AUTHORIZATION` needs).
    BoundLoginNotSuperuser,
    /// No role has that name (now): nothing bound.
    NoSuchRole,
}

/// Binds this session, for its life, to the role named `role`: from now on it runs that role's
/// handlers only (see `runner`, and `session_may_run_as`), and makes it the session's user, as
/// `SET SESSION AUTHORIZATION` does, so that code that trusts `session_user` sees a handler's
/// enqueuer there too, never the worker's login role; that needs a login role that is a
/// superuser. In a transaction of its own (catalog lookups): a rollback would not undo it, but
/// would put back the current user its transaction started with.
pub fn bind_session_to_role(role: &str) -> Binding {
    let Ok(name) = std::ffi::CString::new(role) else { return Binding::NoSuchRole };
    let oid = unsafe { pg_sys::get_role_oid(name.as_ptr(), true) };
    if oid == pg_sys::Oid::INVALID {
        return Binding::NoSuchRole;
    }
    // PostgreSQL 17 has no GetAuthenticatedUserIsSuperuser; its own check reads it so.
    let login_is_superuser = unsafe { pg_sys::superuser_arg(pg_sys::GetAuthenticatedUserId()) };
    if login_is_superuser {
        // Raises if it cannot (before 15.9, by the superuser flag cached at login): then the
        // session stays unbound, and runs no handler (`session_may_run_as`).
        unsafe { pg_sys::SetSessionAuthorization(oid, pg_sys::superuser_arg(oid)) };
    }
    BOUND_ROLE_OID.store(oid.to_u32(), std::sync::atomic::Ordering::Relaxed);
    if login_is_superuser {
        Binding::Bound
    } else {
        Binding::BoundLoginNotSuperuser
    }
}

/// Whether this session may run a handler as `role`: a worker's or runner's session only once
/// bound, and only as its bound role (a session that runs handlers for two roles lets one
/// decide what the other's code means: see `runner`). Other backends (tests) bind none.
pub fn session_may_run_as(role: pg_sys::Oid) -> bool {
    match BOUND_ROLE_OID.load(std::sync::atomic::Ordering::Relaxed) {
        0 => !unsafe { pg_sys::IsBackgroundWorker },
        bound => role.to_u32() == bound,
    }
}

/// Whether a session bound to a role (if it is) may go on serving the role named `role`: while
/// the name names its bound role; in a transaction. Takes in other sessions' catalog changes
/// first (a transaction already holding its locks takes in none by itself).
pub fn session_may_serve_named(role: &str) -> bool {
    let bound = BOUND_ROLE_OID.load(std::sync::atomic::Ordering::Relaxed);
    if bound == 0 {
        return true;
    }
    let Ok(name) = std::ffi::CString::new(role) else { return false };
    unsafe {
        pg_sys::AcceptInvalidationMessages();
        pg_sys::get_role_oid(name.as_ptr(), true).to_u32() == bound
    }
}

/// How long the background worker's own statements wait for a lock before they give up, so that
/// no session (one that cancels a running job and keeps its transaction open, say) can stall the
/// worker; the error rolls back what the worker was doing and is handled like any other.
const WORKER_LOCK_TIMEOUT: &std::ffi::CStr = c"1s";

/// Runs `f` with `search_path = pg_catalog, pg_temp`, as a function's `SET search_path` clause
/// would, and the worker's lock timeout. The background worker calls our statements directly,
/// not through their SQL functions, and its session settings (usually `"$user", public` and no
/// lock timeout) are the handlers': `as_enqueuer` puts them back for each handler.
pub fn with_worker_settings<R>(f: impl FnOnce() -> R) -> R {
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        set_at_this_level(c"search_path", c"pg_catalog, pg_temp");
        set_at_this_level(c"lock_timeout", WORKER_LOCK_TIMEOUT);
        let result = f();
        pg_sys::AtEOXact_GUC(true, level);
        result
    }
}

/// Sets a setting as a function's `SET` clause does: saved, so that `AtEOXact_GUC` for the
/// current GUC nest level (from `NewGUCNestLevel`) puts the previous value back.
pub(crate) unsafe fn set_at_this_level(name: &std::ffi::CStr, value: &std::ffi::CStr) {
    unsafe { set_config(name, value, pg_sys::GucAction::GUC_ACTION_SAVE) }
}

/// Sets a setting as `SET LOCAL` does: until the current transaction ends, its commit included.
pub(crate) unsafe fn set_for_this_transaction(name: &std::ffi::CStr, value: &std::ffi::CStr) {
    unsafe { set_config(name, value, pg_sys::GucAction::GUC_ACTION_LOCAL) }
}

unsafe fn set_config(name: &std::ffi::CStr, value: &std::ffi::CStr, action: pg_sys::GucAction::Type) {
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            action,
            true,
            0,
            false,
        );
    }
}
