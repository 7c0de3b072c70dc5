//! Handler registration: which SQL function or procedure the background worker runs for a kind.
//!
//! A handler takes exactly one jsonb argument, the job's payload. It runs as the role that
//! enqueued the job, and only for enqueuers whose rights the registering role and the handler's
//! owner already hold (`runs_code_of`), so registering grants nobody new rights. The registering
//! role must itself be allowed to execute the handler, and only the role that registered a kind
//! (or roles with its privileges) may replace or remove that registration.

use crate::jobs::arguments;
use crate::jobs::lease::first_value_of;
use crate::pg::privilege::{as_extension_owner, caller, Caller};
use crate::pg::sql_types::Regprocedure;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// (prokind, pronargs, first argument is jsonb, caller may execute) of a routine. Executing
/// takes USAGE on the routine's schema too: the worker calls it by oid, which PostgreSQL checks
/// for EXECUTE only (a call by name looks the schema up, and checks it).
const DESCRIBE_ROUTINE: &str = "
    SELECT p.prokind::pg_catalog.text, p.pronargs::pg_catalog.int4,
           p.pronargs >= 1 AND p.proargtypes[0] = 'pg_catalog.jsonb'::pg_catalog.regtype,
           pg_catalog.has_function_privilege($2, p.oid, 'EXECUTE')
           AND pg_catalog.has_schema_privilege($2, p.pronamespace, 'USAGE')
    FROM pg_catalog.pg_proc p WHERE p.oid = $1";

/// Whether the caller may replace or remove the registration of a kind; NULL when there is none.
const MAY_CHANGE_REGISTRATION: &str = concat!(
    "SELECT ",
    crate::has_privileges_of_role!("$3", "$2", "h.registered_by"),
    " FROM durable_jobs.durable_job_handler h WHERE h.job_kind = $1 FOR UPDATE"
);

/// The registration upsert, storing the handler as `$handler`, an expression over the oid $2.
/// An existing registration is replaced only when the caller ($4, superuser $5) has the
/// privileges of the role that made it; the check runs on the row as locked by the upsert, so
/// that of two roles registering a new kind at once, the later one is refused, not obeyed.
macro_rules! upsert_handler {
    ($handler:literal) => {
        concat!(
            "INSERT INTO durable_jobs.durable_job_handler AS h (job_kind, handler, registered_by)
             VALUES ($1, ",
            $handler,
            ", $3::pg_catalog.name)
             ON CONFLICT (job_kind) DO UPDATE
             SET handler = excluded.handler, registered_by = excluded.registered_by,
                 registered_at = pg_catalog.now()
             WHERE ",
            crate::has_privileges_of_role!("$5", "$4", "h.registered_by"),
            "
             RETURNING 1"
        )
    };
}

// The schema of 0.1.0 stored the handler as regprocedure, later ones as its schema-qualified
// text; the library serves both until ALTER EXTENSION durable_jobs UPDATE.
const UPSERT_HANDLER: &str = upsert_handler!("$2::pg_catalog.oid::pg_catalog.regprocedure::pg_catalog.text");
const UPSERT_HANDLER_AS_REGPROCEDURE: &str = upsert_handler!("$2::pg_catalog.oid::pg_catalog.regprocedure");
const HANDLER_IS_TEXT: &str = "
    SELECT a.atttypid = 'pg_catalog.text'::pg_catalog.regtype FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = 'durable_jobs.durable_job_handler'::pg_catalog.regclass AND a.attname = 'handler'";

fn refuse_foreign_registration() -> ! {
    ereport!(
        ERROR,
        PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
        "permission denied to change the handler another role registered for this job_kind"
    );
}

/// Whether the caller may remove the registration of a kind, locking it; None when there is none.
fn may_change_registration(job_kind: &str, caller: &Caller) -> Option<bool> {
    first_value_of::<bool>(
        MAY_CHANGE_REGISTRATION,
        &[job_kind.into(), caller.role_oid.into(), caller.is_superuser.into()],
    )
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn register_durable_job_handler(job_kind: Option<String>, handler: Option<Regprocedure>) {
    crate::jobs::direct_lease::withdraw();
    let job_kind = arguments::name(job_kind, "job_kind");
    let handler = arguments::required(handler, "handler").0;
    let caller = caller();
    let described = Spi::connect(|client| {
        let rows = client
            .select(DESCRIBE_ROUTINE, Some(1), &[handler.into(), caller.role_oid.into()])
            .expect("describe handler");
        if rows.is_empty() {
            return None;
        }
        let row = rows.first();
        Some((
            row.get::<String>(1).unwrap().unwrap(),
            row.get::<i32>(2).unwrap().unwrap(),
            row.get::<bool>(3).unwrap().unwrap(),
            row.get::<bool>(4).unwrap().unwrap(),
        ))
    });
    let Some((kind, arg_count, takes_jsonb, may_execute)) = described else {
        arguments::invalid("handler does not exist");
    };
    if !matches!(kind.as_str(), "f" | "p") || arg_count != 1 || !takes_jsonb {
        arguments::invalid("handler must be a function or procedure taking exactly one jsonb argument");
    }
    if !may_execute {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "permission denied: the registering role must be allowed to execute the handler",
            "It needs EXECUTE on the handler and USAGE on its schema."
        );
    }
    as_extension_owner(|| {
        let upsert = match first_value_of::<bool>(HANDLER_IS_TEXT, &[]) {
            Some(false) => UPSERT_HANDLER_AS_REGPROCEDURE,
            _ => UPSERT_HANDLER,
        };
        let args = [
            job_kind.as_str().into(),
            handler.into(),
            caller.role_name.as_str().into(),
            caller.role_oid.into(),
            caller.is_superuser.into(),
        ];
        if first_value_of::<i32>(upsert, &args).is_none() {
            refuse_foreign_registration();
        }
    });
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn unregister_durable_job_handler(job_kind: Option<String>) -> bool {
    crate::jobs::direct_lease::withdraw();
    let job_kind = arguments::name(job_kind, "job_kind");
    let caller = caller();
    as_extension_owner(|| {
        match may_change_registration(&job_kind, &caller) {
            None => return false,
            Some(false) => refuse_foreign_registration(),
            Some(true) => {}
        }
        Spi::run_with_args(
            "DELETE FROM durable_jobs.durable_job_handler WHERE job_kind = $1",
            &[job_kind.as_str().into()],
        )
        .expect("unregister handler");
        true
    })
}

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
