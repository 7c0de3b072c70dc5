//! Whether a sleeping wait_for_durable_job may stop holding back vacuum's horizon.
//!
//! An open statement advertises the xmin of its snapshot, and no vacuum or page pruning anywhere
//! in the cluster removes a row version that snapshot could still see: 200 sleeping waiters
//! kept every job the worker finished as dead entries that each claim then visited. A wait may
//! stop advertising it while it sleeps only when no snapshot taken before the sleep will ever be
//! read again; the wait's own reads take a fresh snapshot each time (plans::with_fresh_snapshot),
//! which advertises a new xmin. That holds when all of these do:
//! - this call is the whole statement: the client's statement (not a cursor's, a function's or a
//!   utility command's query: the executor hooks below count how deep executors and utility
//!   commands nest) whose plan is only a scan of this one call, projecting its columns, with no
//!   filter and no subquery. Its arguments were evaluated before the call, and once it
//!   returns nothing reads with the statement's snapshot: the rows it returns were formed whole
//!   (composite values carry no pointers to TOAST).
//! - the statement's snapshot is the only one registered in the transaction (no open cursor,
//!   no other portal of a pipeline, no exported snapshot) and the transaction is not a block
//!   (an earlier statement's cursor, or one declared later, could read older rows).
//! Anything else keeps the horizon while it sleeps, as any open statement does.

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

/// Installs the hooks that tell a client's statement from nested ones (preloaded libraries only:
/// loaded later, the statements already running would go uncounted).
pub fn install_hooks() {
    unsafe {
        PREVIOUS_EXECUTOR_RUN = pg_sys::ExecutorRun_hook;
        pg_sys::ExecutorRun_hook = Some(executor_run);
        PREVIOUS_PROCESS_UTILITY = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
    }
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
    })
}

/// The elements of a PostgreSQL List of pointers.
unsafe fn list_pointers(list: *mut pg_sys::List) -> Vec<*mut std::ffi::c_void> {
    if list.is_null() {
        return Vec::new();
    }
    unsafe { (0..(*list).length as usize).map(|i| (*(*list).elements.add(i)).ptr_value).collect() }
}

unsafe fn node_tag(node: *mut std::ffi::c_void) -> Option<pg_sys::NodeTag> {
    (!node.is_null()).then(|| unsafe { (*(node as *mut pg_sys::Node)).type_ })
}

/// Whether the call behind `fcinfo` is its statement's only work (the first condition above).
pub fn call_is_whole_statement(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    match unsafe { whole_statement(fcinfo) } {
        Ok(()) => true,
        Err(reason) => {
            pgrx::debug1!("wait_for_durable_job keeps its statement's xmin while it sleeps: {reason}");
            false
        }
    }
}

unsafe fn whole_statement(fcinfo: pg_sys::FunctionCallInfo) -> Result<(), &'static str> {
    unsafe {
        let portal = pg_sys::ActivePortal;
        if portal.is_null()
            || (*portal).strategy != pg_sys::PortalStrategy::PORTAL_ONE_SELECT
            || (*portal).queryDesc.is_null()
        {
            return Err("not a plain SELECT portal");
        }
        // The client's statement itself: its executor is the only one running, under no utility
        // command (a cursor's query runs inside the FETCH, the function or the DO that reads it).
        if !TOP_LEVEL.with(|top| top.get() == Some((*portal).queryDesc)) {
            return Err("not the client's own statement");
        }
        let statement = (*(*portal).queryDesc).plannedstmt;
        if statement.is_null()
            || (*statement).commandType != pg_sys::CmdType::CMD_SELECT
            || !(*statement).subplans.is_null()
        {
            return Err("not a plain SELECT plan");
        }
        let plan = (*statement).planTree;
        if node_tag(plan as *mut _) != Some(pg_sys::NodeTag::T_FunctionScan)
            || !(*plan).qual.is_null()
            || !(*plan).initPlan.is_null()
            || !(*plan).lefttree.is_null()
            || !(*plan).righttree.is_null()
        {
            return Err("more than a scan of one call");
        }
        let functions = list_pointers((*(plan as *mut pg_sys::FunctionScan)).functions);
        let [function] = functions.as_slice() else { return Err("not one call") };
        // This very call, not another wait nested in an argument (or run by a function an
        // argument calls), after which the statement would go on reading.
        let call = (*(*function as *mut pg_sys::RangeTblFunction)).funcexpr as *mut pg_sys::Node;
        if fcinfo.is_null() || (*fcinfo).flinfo.is_null() || (*(*fcinfo).flinfo).fn_expr != call {
            return Err("not the statement's own call");
        }
        // Its columns and nothing more: an expression could call a function that reads.
        let only_columns = list_pointers((*plan).targetlist).into_iter().all(|entry| {
            let expression = (*(entry as *mut pg_sys::TargetEntry)).expr as *mut std::ffi::c_void;
            node_tag(expression) == Some(pg_sys::NodeTag::T_Var)
        });
        if !only_columns {
            return Err("not only its columns");
        }
        Ok(())
    }
}

/// Before a sleep of a call that is its whole statement: stops advertising the backend's xmin
/// if the statement's snapshot is the transaction's only one (the second condition above).
/// Checked before every sleep: the wait's own reads come and go in between.
pub fn release_for_sleep(call_is_whole_statement: bool) -> bool {
    if !call_is_whole_statement {
        return false;
    }
    unsafe {
        // The catalog snapshot counts as registered; the next catalog read takes a new one.
        pg_sys::InvalidateCatalogSnapshot();
        if pg_sys::IsTransactionBlock()
            || pg_sys::XactHasExportedSnapshots()
            || !pg_sys::ThereAreNoPriorRegisteredSnapshots()
        {
            return false;
        }
        // What SnapshotResetXmin does once a backend holds no snapshot.
        (*pg_sys::MyProc).xmin = pg_sys::InvalidTransactionId;
    }
    true
}
