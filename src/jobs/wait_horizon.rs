//! Whether a sleeping wait_for_durable_job may stop holding back vacuum's horizon.
//!
//! An open statement advertises the xmin of its snapshot, and no vacuum or page pruning anywhere
//! in the cluster removes a row version that snapshot could still see: 200 sleeping waiters
//! kept every job the worker finished as dead entries that each claim then visited. A wait may
//! stop advertising it while it sleeps only when no snapshot taken before the sleep will ever be
//! read again; the wait's own reads take a fresh snapshot each time (plans::with_fresh_snapshot),
//! which advertises a new xmin. That holds when all of these do:
//! - this call is the whole statement: the client's own statement (not a cursor's, a
//!   function's, a trigger's or a utility command's query: `jobs::hooks`, and its rows go to the
//!   client), whose plan is only a scan of this one call, projecting its columns, with no
//!   filter and no subquery. Its arguments were evaluated before the call, and once it returns
//!   nothing reads with the statement's snapshot: the rows it returns were formed whole
//!   (composite values carry no pointers to TOAST).
//! - the statement alone holds its snapshot, which is the transaction's only one, registered or
//!   active (no open cursor, no other portal of a pipeline, no exported snapshot, nothing an
//!   argument opened), and the transaction is not a block.
//! Anything else keeps the horizon while it sleeps, as any open statement does. Each form that
//! broke an earlier version has its test in tests/status.rs. One cursor does release:
//! a `DECLARE ... WITH HOLD` (no block needed) run by the protocol's Execute message rather than
//! FETCH passes every check as the client's own statement. It is harmless: its function scan is
//! the only reader of its snapshot, and persisting it at commit re-reads only the rows it stored.

use crate::jobs::hooks;
use pgrx::pg_sys;

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

/// The statement's snapshot, if the call behind `fcinfo` is its statement's only work (the
/// first condition above).
pub fn call_is_whole_statement(fcinfo: pg_sys::FunctionCallInfo) -> Option<pg_sys::Snapshot> {
    match unsafe { whole_statement(fcinfo) } {
        Ok(snapshot) => Some(snapshot),
        Err(reason) => {
            pgrx::debug1!("wait_for_durable_job keeps its statement's xmin while it sleeps: {reason}");
            None
        }
    }
}

unsafe fn whole_statement(fcinfo: pg_sys::FunctionCallInfo) -> Result<pg_sys::Snapshot, &'static str> {
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
        if !hooks::is_client_statement((*portal).queryDesc) {
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
        // Its rows go to the client: a cursor's go to SPI or a tuplestore (a plain SELECT run by
        // a deferred trigger at commit, or by the planner folding a function, is also the only
        // executor recorded, but runs under a snapshot pushed outside any of them).
        let destination = (*(*portal).queryDesc).dest;
        if destination.is_null()
            || !matches!(
                (*destination).mydest,
                pg_sys::CommandDest::DestRemote
                    | pg_sys::CommandDest::DestRemoteExecute
                    | pg_sys::CommandDest::DestRemoteSimple
            )
        {
            return Err("its rows do not go to the client");
        }
        // Its columns and nothing more: an expression could call a function that reads.
        let only_columns = list_pointers((*plan).targetlist).into_iter().all(|entry| {
            let expression = (*(entry as *mut pg_sys::TargetEntry)).expr as *mut std::ffi::c_void;
            node_tag(expression) == Some(pg_sys::NodeTag::T_Var)
        });
        if !only_columns {
            return Err("not only its columns");
        }
        Ok((*(*portal).queryDesc).snapshot)
    }
}

/// Before a sleep of a call that is its whole statement (`statement_snapshot`): stops
/// advertising the backend's xmin if that snapshot is the transaction's only one and only the
/// statement itself holds it (the second condition above). Checked before every sleep: the
/// wait's own reads come and go in between.
pub fn release_for_sleep(statement_snapshot: Option<pg_sys::Snapshot>) -> bool {
    let Some(snapshot) = statement_snapshot else { return false };
    unsafe {
        // The catalog snapshot counts as registered; the next catalog read takes a new one.
        pg_sys::InvalidateCatalogSnapshot();
        if pg_sys::IsTransactionBlock()
            || pg_sys::XactHasExportedSnapshots()
            || !pg_sys::ThereAreNoPriorRegisteredSnapshots()
            // The heap counts snapshots, not their holders: something that registered or pushed
            // the statement's own snapshot again (a read-only cursor opened in an argument,
            // lo_open) would read with it later. The statement holds it twice (its query and its
            // executor) and has it active once. (ThereAreNoReadyPortals would also see such a
            // cursor, but leaks its hash scan when it finds one.)
            || (*snapshot).regd_count != STATEMENT_REGISTRATIONS
            || (*snapshot).active_count != 1
        {
            return false;
        }
        // Nothing below the statement's snapshot on the active stack (a snapshot pushed by
        // whatever runs the statement would be read again after it): the stack is private, so
        // look by taking the statement's off and putting it back (the same copy, registered).
        if pg_sys::GetActiveSnapshot() != snapshot {
            return false;
        }
        pg_sys::PopActiveSnapshot();
        let alone = !pg_sys::ActiveSnapshotSet();
        pg_sys::PushActiveSnapshot(snapshot);
        if !alone {
            return false;
        }
        // What SnapshotResetXmin does once a backend holds no snapshot.
        (*pg_sys::MyProc).xmin = pg_sys::InvalidTransactionId;
    }
    true
}

/// How often a client's plain SELECT registers its snapshot: CreateQueryDesc and ExecutorStart.
const STATEMENT_REGISTRATIONS: u32 = 2;
