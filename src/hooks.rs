//! The executor and utility hooks of a preloaded library: they count how deep executors and
//! utility commands nest, which tells a client's own statement from the queries of cursors,
//! functions and utility commands (wait_horizon.rs), and wake the waiters after COMMIT PREPARED.

use crate::waiters;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;

thread_local! {
    /// How many executor runs and utility commands are in progress in this backend.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The statement whose executor runs at depth one, while it is the only thing running.
    static TOP_LEVEL: Cell<Option<*mut pg_sys::QueryDesc>> = const { Cell::new(None) };
}

static mut PREVIOUS_EXECUTOR_RUN: pg_sys::ExecutorRun_hook_type = None;
static mut PREVIOUS_PROCESS_UTILITY: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hooks (preloaded libraries only: loaded later, the statements already running
/// would go uncounted).
pub fn install() {
    unsafe {
        PREVIOUS_EXECUTOR_RUN = pg_sys::ExecutorRun_hook;
        pg_sys::ExecutorRun_hook = Some(executor_run);
        PREVIOUS_PROCESS_UTILITY = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
    }
}

/// Whether `query_desc` is the client's own statement: its executor runs at depth one, under no
/// utility command (a cursor's query runs inside the FETCH, function or DO block that reads it).
pub fn is_client_statement(query_desc: *mut pg_sys::QueryDesc) -> bool {
    TOP_LEVEL.with(|top| top.get() == Some(query_desc))
}

/// Runs `run` one level deeper; `query_desc` is the top-level statement when it is the first.
fn nested<R>(query_desc: Option<*mut pg_sys::QueryDesc>, run: impl FnOnce() -> R) -> R {
    let depth = DEPTH.with(|depth| {
        depth.set(depth.get() + 1);
        depth.get()
    });
    let outer_top = TOP_LEVEL.with(|top| top.replace(if depth == 1 { query_desc } else { None }));
    PgTryBuilder::new(std::panic::AssertUnwindSafe(run))
        .finally(|| {
            DEPTH.with(|depth| depth.set(depth.get() - 1));
            TOP_LEVEL.with(|top| top.set(outer_top));
        })
        .execute()
}

#[pg_guard]
unsafe extern "C-unwind" fn executor_run(
    query_desc: *mut pg_sys::QueryDesc,
    direction: pg_sys::ScanDirection::Type,
    count: u64,
    execute_once: bool,
) {
    nested(Some(query_desc), || unsafe {
        match PREVIOUS_EXECUTOR_RUN {
            Some(previous) => pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
                previous(query_desc, direction, count, execute_once)
            }),
            None => pg_sys::standard_ExecutorRun(query_desc, direction, count, execute_once),
        }
    })
}

#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    statement: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_environment: *mut pg_sys::QueryEnvironment,
    destination: *mut pg_sys::DestReceiver,
    completion: *mut pg_sys::QueryCompletion,
) {
    let commits_prepared = unsafe {
        let node = (*statement).utilityStmt;
        !node.is_null()
            && (*node).type_ == pg_sys::NodeTag::T_TransactionStmt
            && (*(node as *mut pg_sys::TransactionStmt)).kind
                == pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED
    };
    nested(None, || unsafe {
        match PREVIOUS_PROCESS_UTILITY {
            Some(previous) => pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
                previous(
                    statement,
                    query_string,
                    read_only_tree,
                    context,
                    params,
                    query_environment,
                    destination,
                    completion,
                )
            }),
            None => pg_sys::standard_ProcessUtility(
                statement,
                query_string,
                read_only_tree,
                context,
                params,
                query_environment,
                destination,
                completion,
            ),
        }
    });
    // The prepared transaction's changes are visible now; which jobs it changed was forgotten at
    // PREPARE, so every waiter reads again (a spurious wake-up costs one read).
    if commits_prepared {
        waiters::wake_every_waiter();
    }
}
