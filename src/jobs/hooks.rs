//! The executor and utility hooks of a preloaded library: they count how deep executors and
//! utility commands nest, which tells a client's own statement from the queries of cursors,
//! functions and utility commands (`jobs::wait_horizon`), and wake the waiters after COMMIT PREPARED.

use crate::jobs::waiters;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// The executor runs and utility commands in progress in this backend, outermost first:
    /// where each one's hook sits on the stack, and the statement it runs (None: a utility
    /// command). An error unwinds past hook frames without running their ends; frames found
    /// at or below a later point of the stack are those, and are dropped (`unwound_below`).
    static FRAMES: RefCell<Vec<(usize, Option<usize>)>> = const { RefCell::new(Vec::new()) };
}

static mut PREVIOUS_EXECUTOR_RUN: pg_sys::ExecutorRun_hook_type = None;
static mut PREVIOUS_PROCESS_UTILITY: pg_sys::ProcessUtility_hook_type = None;

// PostgreSQL's own functions, called without pgrx's guard: an error must pass through the hooks
// untouched (pgrx would catch it and raise a copy that loses its context, constraint name and
// custom SQLSTATE), so the hooks keep nothing that needs dropping while they call them.
unsafe extern "C-unwind" {
    #[link_name = "standard_ExecutorRun"]
    fn unguarded_standard_executor_run(
        query_desc: *mut pg_sys::QueryDesc,
        direction: pg_sys::ScanDirection::Type,
        count: u64,
        execute_once: bool,
    );
    #[link_name = "standard_ProcessUtility"]
    #[allow(clippy::too_many_arguments)]
    fn unguarded_standard_process_utility(
        statement: *mut pg_sys::PlannedStmt,
        query_string: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        query_environment: *mut pg_sys::QueryEnvironment,
        destination: *mut pg_sys::DestReceiver,
        completion: *mut pg_sys::QueryCompletion,
    );
}

/// Installs the hooks (preloaded libraries only: loaded later, the statements already running
/// would go uncounted).
pub fn install() {
    unsafe {
        PREVIOUS_EXECUTOR_RUN = pg_sys::ExecutorRun_hook;
        pg_sys::ExecutorRun_hook = Some(executor_run);
        PREVIOUS_PROCESS_UTILITY = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
        pg_sys::RegisterXactCallback(Some(on_abort), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subtransaction_abort), std::ptr::null_mut());
    }
}

/// An address in a frame just below the caller's: the stack grows down, so a hook frame still in
/// progress lies above (at a higher address than) anything its callees call this from.
#[inline(never)]
fn stack_address() -> usize {
    let marker = 0u8;
    std::hint::black_box(&marker) as *const u8 as usize
}

/// Drops the frames an error unwound: those not above `address`.
fn unwound_below(address: usize) {
    FRAMES.with(|frames| frames.borrow_mut().retain(|(frame, _)| *frame > address));
}

/// Whether `query_desc` is the client's own statement: its executor is the only executor run
/// or utility command in progress (a cursor's query runs inside the FETCH, function or DO block
/// that reads it). A frame an error left behind only makes this false.
pub fn is_client_statement(query_desc: *mut pg_sys::QueryDesc) -> bool {
    unwound_below(stack_address());
    FRAMES.with(|frames| {
        let frames = frames.borrow();
        frames.len() == 1 && frames[0].1 == Some(query_desc as usize)
    })
}

/// Records a frame at `address` for the call that follows; the caller removes it when the call
/// returns (an error unwinding past it leaves it to `unwound_below`).
fn enter(address: usize, query_desc: Option<usize>) {
    unwound_below(address);
    FRAMES.with(|frames| frames.borrow_mut().push((address, query_desc)));
}

fn leave(address: usize) {
    FRAMES.with(|frames| frames.borrow_mut().retain(|(frame, _)| *frame != address));
}

#[pg_guard]
unsafe extern "C-unwind" fn on_abort(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    if event == pg_sys::XactEvent::XACT_EVENT_ABORT || event == pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT {
        unwound_below(stack_address());
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subtransaction_abort(
    event: pg_sys::SubXactEvent::Type,
    _subtransaction: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        unwound_below(stack_address());
    }
}

// Not #[pg_guard]: nothing here can panic, and an error from below must reach PostgreSQL as it
// was raised.
unsafe extern "C-unwind" fn executor_run(
    query_desc: *mut pg_sys::QueryDesc,
    direction: pg_sys::ScanDirection::Type,
    count: u64,
    execute_once: bool,
) {
    crate::jobs::direct_lease::statement_starts(query_desc);
    let address = stack_address();
    enter(address, Some(query_desc as usize));
    unsafe {
        match PREVIOUS_EXECUTOR_RUN {
            Some(previous) => previous(query_desc, direction, count, execute_once),
            None => unguarded_standard_executor_run(query_desc, direction, count, execute_once),
        }
    }
    leave(address);
}

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
    let node = unsafe { (*statement).utilityStmt };
    let node_type = if node.is_null() { pg_sys::NodeTag::T_Invalid } else { unsafe { (*node).type_ } };
    let commits_prepared = node_type == pg_sys::NodeTag::T_TransactionStmt
        && unsafe { (*(node as *mut pg_sys::TransactionStmt)).kind }
            == pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED;
    // DDL after an enqueue that leased its job (DROP EXTENSION, a handler's function replaced,
    // ...): the job is made available at commit, for the worker's claim to judge.
    if !node.is_null()
        && !matches!(
            node_type,
            pg_sys::NodeTag::T_TransactionStmt
                | pg_sys::NodeTag::T_VariableSetStmt
                | pg_sys::NodeTag::T_VariableShowStmt
        )
    {
        crate::jobs::direct_lease::withdraw();
    }
    let address = stack_address();
    enter(address, None);
    unsafe {
        match PREVIOUS_PROCESS_UTILITY {
            Some(previous) => previous(
                statement,
                query_string,
                read_only_tree,
                context,
                params,
                query_environment,
                destination,
                completion,
            ),
            None => unguarded_standard_process_utility(
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
    }
    leave(address);
    // The prepared transaction's changes are visible now; which jobs it changed was forgotten at
    // PREPARE, so every waiter reads again (a spurious wake-up costs one read).
    if commits_prepared {
        waiters::wake_every_waiter();
    }
}
