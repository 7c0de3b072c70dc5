//! durable_jobs: a durable, lease-fenced job queue inside PostgreSQL.
//!
//! Four layers: `pg` (PostgreSQL plumbing), `jobs` (the job model the SQL API and the background
//! share), then `api` (the SQL functions) and `worker` (the background worker and its role
//! runners), which never import each other. A module imports from its own layer and those before
//! it, and no modules import each other in a circle (tests/docs.rs checks both). README's Layout
//! names every module; docs/architecture.md shows a job's path through them.

use pgrx::prelude::*;

mod api;
mod jobs;
mod pg;
mod worker;

::pgrx::pg_module_magic!();

// The job table, its constraints and trigger come first; privileges are locked down last, after
// pgrx has created every function (CREATE FUNCTION grants EXECUTE to PUBLIC by default).
extension_sql_file!("../sql/durable_jobs_schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/durable_jobs_handlers.sql", name = "handlers", requires = ["schema"]);
extension_sql_file!("../sql/durable_jobs_queues.sql", name = "queues", requires = ["schema", "handlers"]);
extension_sql_file!("../sql/durable_jobs_status.sql", name = "status", requires = ["schema"]);
extension_sql_file!("../sql/durable_jobs_privileges.sql", name = "privileges", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    disable_error_backtraces();
    pg::settings::register();
    // Shared memory, postmaster settings and static workers exist only when preloaded.
    if unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        pg::settings::register_postmaster_settings();
        jobs::counters::init_shared_memory();
        jobs::histograms::init_shared_memory();
        jobs::wakeup::init_shared_memory();
        jobs::sleepers::init_shared_memory();
        worker::runner::init_shared_memory();
        jobs::waiters::init_shared_memory();
        jobs::hooks::install();
        // pg_upgrade starts the servers in binary-upgrade mode and must be the only one using
        // the databases: a worker connected to one makes its restore fail.
        if !unsafe { pg_sys::IsBinaryUpgrade } {
            worker::register_workers();
        }
    }
    pg::settings::reserve_prefix();
}

/// No Rust backtrace ever reaches a client or the server log: pgrx attaches
/// `std::backtrace::Backtrace::capture()` to the DETAIL of every error it raises (ours, and
/// PostgreSQL's caught through SPI), and std captures one whenever RUST_BACKTRACE or
/// RUST_LIB_BACKTRACE is set in the environment that started the server. std decides once per
/// process, from the environment at its first capture: this makes that first capture, with
/// RUST_LIB_BACKTRACE (which takes precedence) at 0, and puts the environment back as it was.
/// In the postmaster (preloaded) the decision is inherited by every backend and worker.
fn disable_error_backtraces() {
    const VARIABLE: &str = "RUST_LIB_BACKTRACE";
    let saved = std::env::var_os(VARIABLE);
    std::env::set_var(VARIABLE, "0");
    let _ = std::backtrace::Backtrace::capture();
    match saved {
        Some(value) => std::env::set_var(VARIABLE, value),
        None => std::env::remove_var(VARIABLE),
    }
}

// pgrx runs #[pg_test] functions from schema `tests`, and only from the module that is that
// schema, so every suite file is included straight into it (they share its imports).
#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    include!("../pgrx-tests/support.rs");
    include!("../pgrx-tests/enqueue_tests.rs");
    include!("../pgrx-tests/lease_tests.rs");
    include!("../pgrx-tests/cancel_tests.rs");
    include!("../pgrx-tests/schema_tests.rs");
    include!("../pgrx-tests/handler_tests.rs");
    include!("../pgrx-tests/execution_tests.rs");
    include!("../pgrx-tests/security_tests.rs");
    include!("../pgrx-tests/queue_tests.rs");
    include!("../pgrx-tests/retention_tests.rs");
    include!("../pgrx-tests/status_tests.rs");
    include!("../pgrx-tests/docs_tests.rs");
    include!("../pgrx-tests/direct_lease_tests.rs");
}

/// Hooks `cargo pgrx test` calls while it sets up the test cluster.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        // Preloaded, as in production: shared memory and the restart-only settings exist. The
        // worker stays off (the default) and its database has no extension, so it only waits.
        vec!["shared_preload_libraries = 'durable_jobs'"]
    }
}
