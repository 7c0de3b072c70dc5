//! Queue controls: a paused queue is claimed from by no one (the background worker and external
//! workers alike), and enqueue into it goes on; a queue's concurrency limit caps how many of its
//! jobs run at once.

use crate::jobs::arguments;
use crate::jobs::lease::first_value_of;
use crate::pg::privilege::{as_extension_owner, caller};
use pgrx::pg_sys;
use pgrx::prelude::*;

const CHANGE_PAUSED: &str = "
    UPDATE durable_jobs.durable_job_queue
    SET paused = $2, changed_by = $3::pg_catalog.name, changed_at = pg_catalog.now()
    WHERE queue_name = $1 AND paused <> $2
    RETURNING 1";

// Pauses a queue that has no row yet, or whose row another session inserts meanwhile (a first
// concurrency limit): DO NOTHING would report that queue as paused already.
const INSERT_PAUSED: &str = "
    INSERT INTO durable_jobs.durable_job_queue (queue_name, paused, changed_by)
    VALUES ($1, true, $2::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET paused = true, changed_by = excluded.changed_by, changed_at = pg_catalog.now()
    WHERE NOT durable_job_queue.paused
    RETURNING 1";

/// Sets a queue's paused state; true when that changed it. A queue without a row is open.
fn set_paused(queue_name: Option<String>, paused: bool) -> bool {
    let queue_name = arguments::name(queue_name, "queue_name");
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        let args = [queue_name.as_str().into(), paused.into(), changed_by.as_str().into()];
        if first_value_of::<i32>(CHANGE_PAUSED, &args).is_some() {
            return true;
        }
        paused
            && first_value_of::<i32>(INSERT_PAUSED, &[queue_name.as_str().into(), changed_by.as_str().into()])
                .is_some()
    })
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn pause_durable_job_queue(queue_name: Option<String>) -> bool {
    crate::jobs::direct_lease::withdraw();
    set_paused(queue_name, true)
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn resume_durable_job_queue(queue_name: Option<String>) -> bool {
    set_paused(queue_name, false)
}

const SET_CONCURRENCY: &str = "
    INSERT INTO durable_jobs.durable_job_queue (queue_name, concurrency_limit, changed_by)
    VALUES ($1, $2, $3::pg_catalog.name)
    ON CONFLICT (queue_name) DO UPDATE
    SET concurrency_limit = excluded.concurrency_limit, changed_by = excluded.changed_by,
        changed_at = pg_catalog.now()
    RETURNING 1";

/// Upper bound of a queue's concurrency limit.
const CONCURRENCY_LIMIT_MAX: i32 = 100_000;

/// Limits how many jobs of a queue may run (hold a live lease) at once; NULL removes the limit.
/// Claims by the background workers and by external workers both honour it.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn set_durable_job_queue_concurrency(queue_name: Option<String>, concurrency_limit: Option<i32>) {
    crate::jobs::direct_lease::withdraw();
    let queue_name = arguments::name(queue_name, "queue_name");
    if let Some(limit) = concurrency_limit {
        if !(1..=CONCURRENCY_LIMIT_MAX).contains(&limit) {
            arguments::invalid(&format!(
                "concurrency_limit must be NULL (no limit) or between 1 and {CONCURRENCY_LIMIT_MAX}"
            ));
        }
    }
    let changed_by = caller().role_name;
    as_extension_owner(|| {
        first_value_of::<i32>(
            SET_CONCURRENCY,
            &[queue_name.as_str().into(), concurrency_limit.into(), changed_by.as_str().into()],
        )
    });
}

/// The C functions defined here, by SQL name: they look no name up through search_path, and pin
/// none (a `SET` clause would cost a GUC save and restore per call).
#[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
pub const C_FUNCTIONS: [&str; 1] = ["durable_job_row_held"];

/// `durable_jobs.durable_job_row_held(tid)`, a V1 function: whether the job table's row version
/// at `tid` is held by another transaction still in progress (an update or a row lock neither
/// committed nor rolled back), as PostgreSQL decides before it waits for a row. A queue's
/// concurrency limit counts such a running job whose committed lease lapsed
/// (`durable_job_queue_running`): a worker's batch runs its later jobs on leases renewed in the
/// batch's own transaction.
#[unsafe(no_mangle)]
#[doc(hidden)]
pub extern "C" fn pg_finfo_durable_job_row_held() -> &'static pg_sys::Pg_finfo_record {
    const V1_API: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1_API
}

#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_row_held(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        // STRICT: never NULL. A tid is passed by reference.
        let tid = (*fcinfo).args.as_slice(1)[0].value.cast_mut_ptr::<pg_sys::ItemPointerData>();
        // ReadBuffer would take InvalidBlockNumber for a new page.
        let block = (u32::from((*tid).ip_blkid.bi_hi) << 16) | u32::from((*tid).ip_blkid.bi_lo);
        if block == pg_sys::InvalidBlockNumber {
            return pg_sys::Datum::from(false);
        }
        let schema = pg_sys::get_namespace_oid(c"durable_jobs".as_ptr(), false);
        let table = pg_sys::get_relname_relid(c"durable_job".as_ptr(), schema);
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
        pg_sys::Datum::from(held)
    }
}
