//! Whether a row version of the job table is held by another transaction in progress (an
//! update or a row lock neither committed nor rolled back), as PostgreSQL decides before it waits
//! for a row: what concurrency limits count as running beside live leases (a worker's batch runs
//! its later jobs on leases renewed in its own transaction), and what a claim asks before it
//! takes a place or a token for a job it may then have to skip.

use pgrx::pg_sys;
use pgrx::prelude::*;

/// The C function defined here, by SQL name (see `slots::C_FUNCTIONS`).
#[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
pub const C_FUNCTIONS: [&str; 1] = ["durable_job_row_held"];

crate::v1_function_info!(pg_finfo_durable_job_row_held);

/// `durable_jobs.durable_job_row_held(tid)`, a V1 function: whether the job table's row version
/// at `tid` is held by another transaction still in progress (an update or a row lock neither
/// committed nor rolled back), as PostgreSQL decides before it waits for a row. A queue's
/// concurrency limit counts such a running job whose committed lease lapsed
/// (`durable_job_queue_running`): a worker's batch runs its later jobs on leases renewed in the
/// batch's own transaction.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_row_held(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // STRICT: never NULL. A tid is passed by reference.
    unsafe { pg_sys::Datum::from(row_held(fcinfo, (*fcinfo).args.as_slice(1)[0].value.cast_mut_ptr())) }
}

/// Whether the job table's row version at `tid` is held by another transaction in progress
/// (`durable_job_row_held`). `fcinfo`: the calling C function's, whose `fn_extra` keeps the job
/// table's oid for the rest of the statement (looking it up by name was most of a call's cost).
pub(crate) unsafe fn row_held(fcinfo: pg_sys::FunctionCallInfo, tid: *const pg_sys::ItemPointerData) -> bool {
    unsafe {
        // ReadBuffer would take InvalidBlockNumber for a new page.
        let block = (u32::from((*tid).ip_blkid.bi_hi) << 16) | u32::from((*tid).ip_blkid.bi_lo);
        if block == pg_sys::InvalidBlockNumber {
            return false;
        }
        let flinfo = (*fcinfo).flinfo;
        if (*flinfo).fn_extra.is_null() {
            let schema = pg_sys::get_namespace_oid(c"durable_jobs".as_ptr(), false);
            let oid = pg_sys::get_relname_relid(c"durable_job".as_ptr(), schema);
            let kept = pg_sys::MemoryContextAlloc((*flinfo).fn_mcxt, std::mem::size_of::<pg_sys::Oid>())
                .cast::<pg_sys::Oid>();
            *kept = oid;
            (*flinfo).fn_extra = kept.cast();
        }
        let table = *(*flinfo).fn_extra.cast::<pg_sys::Oid>();
        // The caller's scan of the table holds this lock already, and the row version's page
        // pinned, so it cannot be pruned away meanwhile.
        let relation = pg_sys::table_open(table, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
        tuple.t_self = *tid;
        let mut buffer: pg_sys::Buffer = 0;
        let found =
            pg_sys::heap_fetch(relation, &raw mut pg_sys::SnapshotAnyData, &mut tuple, &mut buffer, false);
        let held = found && {
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            let state =
                pg_sys::HeapTupleSatisfiesUpdate(&mut tuple, pg_sys::GetCurrentCommandId(false), buffer);
            // Not a lock of the caller's own transaction (an update of its own is the row
            // version it sees): a claimer counts what others hold. Updated or deleted by a
            // transaction that committed after the caller's snapshot (a batch's commit): held
            // as far as the caller can see, counted once more rather than once less.
            let header = tuple.t_data;
            let own = (*header).t_infomask & pg_sys::HEAP_XMAX_IS_MULTI as u16 == 0
                && pg_sys::TransactionIdIsCurrentTransactionId((*header).t_choice.t_heap.t_xmax);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_UNLOCK as i32);
            pg_sys::ReleaseBuffer(buffer);
            let changing = matches!(
                state,
                pg_sys::TM_Result::TM_BeingModified
                    | pg_sys::TM_Result::TM_Updated
                    | pg_sys::TM_Result::TM_Deleted
            );
            changing && !own
        };
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        held
    }
}
