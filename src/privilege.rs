//! Who is calling, and running our own statements with the extension owner's rights.
//!
//! No role but the owner has any privilege on the job table. The SQL functions are SECURITY
//! INVOKER, so EXECUTE on each is what a role is granted; inside, they note the calling role and
//! switch to the extension owner, as pg_cron does, rather than SECURITY DEFINER, which would
//! hide the caller.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;

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

thread_local! {
    /// (extension oid, its owner), so the owner is looked up once per installation.
    static OWNER: Cell<Option<(pg_sys::Oid, pg_sys::Oid)>> = const { Cell::new(None) };
}

fn extension_owner() -> pg_sys::Oid {
    let extension = unsafe { pg_sys::get_extension_oid(c"durable_jobs".as_ptr(), true) };
    if extension == pg_sys::Oid::INVALID {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "extension durable_jobs is not installed in this database"
        );
    }
    if let Some((cached, owner)) = OWNER.get() {
        if cached == extension {
            return owner;
        }
    }
    let owner = Spi::get_one_with_args::<pg_sys::Oid>(
        "SELECT extowner FROM pg_catalog.pg_extension WHERE oid = $1",
        &[extension.into()],
    )
    .ok()
    .flatten()
    .expect("the extension has an owner");
    OWNER.set(Some((extension, owner)));
    owner
}

/// Runs `f` as the extension owner. An ERROR inside aborts the (sub)transaction, which restores
/// the previous user by itself; the normal path restores it here.
pub fn as_extension_owner<R>(f: impl FnOnce() -> R) -> R {
    let owner = extension_owner();
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

/// How long the background worker's own statements wait for a lock before they give up, so that
/// no session (one that cancels a running job and keeps its transaction open, say) can stall the
/// worker; the error rolls back what the worker was doing and is handled like any other.
const WORKER_LOCK_TIMEOUT: &std::ffi::CStr = c"1s";

/// Runs `f` with `search_path = pg_catalog, pg_temp`, as a function's `SET search_path` clause
/// would, and the worker's lock timeout. The background worker calls our statements directly,
/// not through their SQL functions, and its session settings are the handlers' (usually
/// `"$user", public` and no lock timeout).
pub fn with_worker_settings<R>(f: impl FnOnce() -> R) -> R {
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        for (name, value) in
            [(c"search_path", c"pg_catalog, pg_temp"), (c"lock_timeout", WORKER_LOCK_TIMEOUT)]
        {
            pg_sys::set_config_option(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        let result = f();
        pg_sys::AtEOXact_GUC(true, level);
        result
    }
}
