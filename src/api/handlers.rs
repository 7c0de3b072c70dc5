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
