//! The trust rule: code chosen by one role (a handler's owner, a registration's role) runs as a
//! job's enqueuer only when that role already holds the enqueuer's rights (`runs_code_of`).
//! The claim's SQL asks it through `registration_serves!`; a batch's load and each handler's
//! call ask it again (`runnable_handler`, `registrant_serves`, `may_run_routine`).

use pgrx::pg_sys;
use pgrx::prelude::*;

/// SQL: whether the registration made by the role named `$registered_by` serves the jobs of the
/// role named `$enqueued_by` (both name expressions), as `durable_job_handler_serves` says, with
/// no function call for a role's own jobs. The worker's claim, the enqueue's direct lease and a
/// batch's load all ask it.
#[macro_export]
macro_rules! registration_serves {
    ($registered_by:literal, $enqueued_by:literal) => {
        concat!(
            "(",
            $registered_by,
            " = ",
            $enqueued_by,
            " OR durable_jobs.durable_job_handler_serves(",
            $registered_by,
            "::pg_catalog.text, ",
            $enqueued_by,
            "::pg_catalog.text))"
        )
    };
}

/// Whether a registration made by `registered_by` serves the jobs that `enqueued_by` enqueues
/// (`runs_code_of`): its own role's, those of the roles whose privileges it has that are not
/// superusers, and every role's when the registrant is a superuser. Asked by the background
/// worker's claim for each candidate, from the role caches, so that the claim's plan stays as
/// simple as a lookup of the kind.
#[pg_extern(stable, parallel_safe, strict)]
#[search_path(pg_catalog, pg_temp)]
fn durable_job_handler_serves(registered_by: &str, enqueued_by: &str) -> bool {
    registration_serves(registered_by, enqueued_by)
}

/// `durable_job_handler_serves`, for the worker's own checks.
pub(crate) fn registration_serves(registered_by: &str, enqueued_by: &str) -> bool {
    if registered_by == enqueued_by {
        return true;
    }
    let registrant = role_oid(registered_by);
    registrant != pg_sys::Oid::INVALID && runs_code_of(role_oid(enqueued_by), registrant)
}

/// Whether code that `author` chose (a handler's owner, a registration's role) may run as
/// `enqueuer`: only when the author already holds the enqueuer's rights. A superuser's code runs
/// as any role; an ordinary role's as itself and as the roles whose privileges it has (roles it
/// is a member of, with inheritance), never as a superuser. Never the other way round: a member
/// has its group's rights, not the group its member's, so a group's code running as a member (or
/// one member's code reaching another through their group) would act with rights its author
/// never had. has_privs_of_role is true for every superuser `author`, hence the explicit check
/// that the enqueuer is not one.
fn runs_code_of(enqueuer: pg_sys::Oid, author: pg_sys::Oid) -> bool {
    unsafe {
        pg_sys::superuser_arg(author)
            || (enqueuer != pg_sys::Oid::INVALID
                && !pg_sys::superuser_arg(enqueuer)
                && pg_sys::has_privs_of_role(author, enqueuer)
                && may_become(author, enqueuer))
    }
}

/// From PostgreSQL 16 a membership can give a role's privileges without the right to become it
/// (`GRANT e TO a WITH SET FALSE`); what comes only with becoming it (its attributes, such as
/// BYPASSRLS or CREATEROLE, and its identity) is then not the author's, so the author must be
/// able to `SET ROLE` to the enqueuer too, as PostgreSQL 16 asks of a subscription's owner for
/// each table's. On 15, a membership that inherits privileges can always be used to become the
/// role.
#[cfg(feature = "pg15")]
unsafe fn may_become(_author: pg_sys::Oid, _enqueuer: pg_sys::Oid) -> bool {
    true
}

#[cfg(not(feature = "pg15"))]
unsafe fn may_become(author: pg_sys::Oid, enqueuer: pg_sys::Oid) -> bool {
    unsafe { pg_sys::member_can_set_role(author, enqueuer) }
}

/// The oid of the role named `name`; invalid when there is none.
fn role_oid(name: &str) -> pg_sys::Oid {
    std::ffi::CString::new(name)
        .map(|name| unsafe { pg_sys::get_role_oid(name.as_ptr(), true) })
        .unwrap_or(pg_sys::Oid::INVALID)
}

#[cfg(any(test, feature = "pg_test"))]
thread_local! {
    /// How many times `runnable_handler` was asked (the tests count them).
    pub(crate) static HANDLER_CHECKS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A handler the background worker may run: the routine that was checked (called by its oid, so
/// that no name resolved later can stand in for it), whether it is a procedure, the role to run
/// it as, and the role that registered it when that is another role (whose rights over the
/// enqueuer are checked again at the call, `registrant_serves`, as the owner's are).
#[derive(Clone, Copy)]
pub(crate) struct RunnableHandler {
    pub routine: pg_sys::Oid,
    pub is_procedure: bool,
    pub role: pg_sys::Oid,
    pub registrant: Option<pg_sys::Oid>,
}

/// Whether the role that registered `handler` still holds the rights of the role it runs as: a
/// membership revoked (or the enqueuer made a superuser) while a batch runs sends its later jobs
/// back to the queue (and stops a call, should it come after all).
pub(crate) fn registrant_serves(handler: &RunnableHandler) -> bool {
    handler.registrant.is_none_or(|registrant| runs_code_of(handler.role, registrant))
}

/// The routine a registration by `registered_by` names (`handler`, its stored text, read as
/// `to_regprocedure` reads it), when the role named `enqueuer` may run it: the role exists and
/// may execute it, it returns no set, and its owner is a superuser or, for an enqueuer that is
/// not one, a role that has the enqueuer's privileges (itself or a member of it,
/// `runs_code_of`); with the registering role, whose hold on the enqueuer's rights
/// `registrant_serves` tells. From the catalog caches, not a query: as a query over
/// pg_roles this was most of the cost of loading a batch.
pub(crate) fn runnable_handler(
    handler: &str,
    enqueuer: &str,
    registered_by: &str,
) -> Option<RunnableHandler> {
    #[cfg(any(test, feature = "pg_test"))]
    HANDLER_CHECKS.with(|checks| checks.set(checks.get() + 1));
    unsafe {
        let routine =
            pgrx::direct_function_call::<pg_sys::Oid>(pg_sys::to_regprocedure, &[handler.into_datum()])?;
        // The role first: a cache miss there takes in invalidations, which could drop the
        // routine between its row being read and its privileges being checked.
        let role = role_oid(enqueuer);
        if role == pg_sys::Oid::INVALID {
            return None;
        }
        // Whether it serves the enqueuer is the caller's to ask (`registrant_serves`): a job it
        // no longer serves goes back to the queue, where one the enqueuer may not run fails. A
        // role that no longer exists (an invalid oid) has no one's rights.
        let registrant = (registered_by != enqueuer).then(|| role_oid(registered_by));
        may_run_routine(routine, role).map(|is_procedure| RunnableHandler {
            routine,
            is_procedure,
            role,
            registrant,
        })
    }
}

/// Whether `routine` exists, as other sessions' committed changes left it. The catalog caches
/// take those in only when told to (or at a lock not yet held): a batch whose handlers take none
/// would otherwise see its load's catalog, in this check and the handler check after it.
pub(crate) fn routine_still_exists(routine: pg_sys::Oid) -> bool {
    unsafe {
        pg_sys::AcceptInvalidationMessages();
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::PROCOID as i32,
            pg_sys::Datum::from(routine),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// Whether `role` may run `routine` as a handler: the role exists and may execute it (EXECUTE, and
/// USAGE on its schema, as DESCRIBE_ROUTINE), the routine takes one jsonb and returns no set (as at
/// the registration: an oid used again by another routine fails here), and its owner's code may run
/// as that role (`runs_code_of`). Some(whether it is a procedure) when it may; None when it may not
/// or the routine is gone.
pub(crate) fn may_run_routine(routine: pg_sys::Oid, role: pg_sys::Oid) -> Option<bool> {
    unsafe {
        if !pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::AUTHOID as i32,
            role.into_datum()?,
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        ) {
            return None;
        }
        let row = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::PROCOID as i32, routine.into_datum()?);
        if row.is_null() {
            return None;
        }
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_proc>(row);
        let kind = (*form).prokind as u8;
        let takes_one_jsonb =
            (*form).pronargs == 1 && (*form).proargtypes.values.as_slice(1)[0] == pg_sys::JSONBOID;
        let (returns_set, owner, schema) = ((*form).proretset, (*form).proowner, (*form).pronamespace);
        pg_sys::ReleaseSysCache(row);
        let may_run = pg_sys::pg_proc_aclcheck(routine, role, pg_sys::ACL_EXECUTE as pg_sys::AclMode)
            == pg_sys::AclResult::ACLCHECK_OK
            && pg_sys::pg_namespace_aclcheck(schema, role, pg_sys::ACL_USAGE as pg_sys::AclMode)
                == pg_sys::AclResult::ACLCHECK_OK
            && matches!(kind, b'f' | b'p')
            && takes_one_jsonb
            && !returns_set
            && runs_code_of(role, owner);
        may_run.then_some(kind == b'p')
    }
}
