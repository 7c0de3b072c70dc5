//! Latches: waking idle workers when work arrives, so enqueue-to-start latency does not wait for
//! `durable_jobs.poll_interval`. Each worker publishes its pid in a shared slot (empty while it is
//! switched off); a transaction that enqueued sets their latches once, when it commits (a
//! rolled-back enqueue wakes no one).
//! Also the latch helpers the waiters and the role runners share.

use crate::pg::settings::WORKER_COUNT_LIMIT;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, PgXactCallbackEvent};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

pub struct WorkerSlots([AtomicI32; WORKER_COUNT_LIMIT as usize]);

impl Default for WorkerSlots {
    fn default() -> Self {
        WorkerSlots(std::array::from_fn(|_| AtomicI32::new(0)))
    }
}

unsafe impl PGRXSharedMemory for WorkerSlots {}

static SLOTS: PgAtomic<WorkerSlots> = unsafe { PgAtomic::new(c"durable_jobs_worker_slots") };

/// Set while preloading (inherited by forked backends); without it there are no workers.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

/// Whether this backend's current transaction already asked for a wake-up at commit.
static WAKE_AT_COMMIT: AtomicBool = AtomicBool::new(false);

/// Whether the library was preloaded: without it there are no workers to wake or lease to.
pub fn preloaded() -> bool {
    SHARED_MEMORY.load(Ordering::Relaxed)
}

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(SLOTS);
    SHARED_MEMORY.store(true, Ordering::Relaxed);
}

/// Called by worker `number` (1-based) once it runs; the slot is cleared when it exits.
pub fn publish_worker(number: i32) {
    set_worker_wakeable(number, true);
    crate::jobs::direct_lease::reset(number, true);
    unsafe extern "C-unwind" fn clear_slot(_code: std::ffi::c_int, number: pg_sys::Datum) {
        set_worker_wakeable(number.value() as i32, false);
        crate::jobs::direct_lease::reset(number.value() as i32, false);
    }
    unsafe { pg_sys::on_shmem_exit(Some(clear_slot), pg_sys::Datum::from(number)) };
}

/// Whether enqueues wake worker `number` (1-based): not while it is switched off, when a wake-up
/// would only cost the enqueuer a signal (a reload that switches it on sets its latch anyway).
/// Set before the worker's next claim: a job committed before the slot is filled is seen by
/// that claim, one committed after wakes the worker.
pub fn set_worker_wakeable(number: i32, wakeable: bool) {
    let pid = if wakeable { unsafe { pg_sys::MyProcPid } } else { 0 };
    SLOTS.get().0[(number - 1) as usize].store(pid, Ordering::Relaxed);
}

/// Asks for the workers to be woken when the current transaction commits.
pub fn wake_workers_at_commit() {
    if !SHARED_MEMORY.load(Ordering::Relaxed) || WAKE_AT_COMMIT.swap(true, Ordering::Relaxed) {
        return;
    }
    // A prepared transaction commits later, maybe elsewhere: the poll interval picks it up.
    at_commit_or_forget(wake_workers, || WAKE_AT_COMMIT.store(false, Ordering::Relaxed));
}

/// At the end of the current transaction: `on_commit` if it committed (once the change is
/// visible), then `forget` in any case. A prepared transaction only forgets: it commits later,
/// maybe from another session.
pub fn at_commit_or_forget(on_commit: fn(), forget: fn()) {
    pgrx::register_xact_callback(PgXactCallbackEvent::Commit, move || {
        on_commit();
        forget();
    });
    for event in [PgXactCallbackEvent::Abort, PgXactCallbackEvent::Prepare] {
        pgrx::register_xact_callback(event, forget);
    }
}

/// This process, named as shared slots keep it: `pgprocno + 1`, so that 0 can mean none.
pub fn my_procno_plus_one() -> i32 {
    unsafe { (*pg_sys::MyProc).pgprocno + 1 }
}

/// Sets the latch of the process `procno_plus_one` names (as `my_procno_plus_one`); 0 is none.
pub fn set_latch_of(procno_plus_one: i32) {
    if procno_plus_one > 0 {
        unsafe {
            let process = (*pg_sys::ProcGlobal).allProcs.add((procno_plus_one - 1) as usize);
            pg_sys::SetLatch(&raw mut (*process).procLatch);
        }
    }
}

/// Sleeps on this process's latch for at most `timeout` (wait event `Extension`), resets it,
/// then checks for interrupts (a query cancel or a terminate ends the sleep with its error).
/// A latch set before the sleep ends it at once, so a caller that reads shared state, then
/// sleeps, misses no change whose setter set the latch after making it visible. Returns
/// whether the latch was set (false: the time ran out).
pub fn sleep_on_latch(timeout: std::time::Duration) -> bool {
    // Interrupts first, as PostgreSQL's own wait loops do: a cancel that came while interrupts
    // were held, and whose latch a lock wait since reset, would otherwise wait out the timeout.
    pg_sys::check_for_interrupts!();
    let events = unsafe {
        let events = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout.as_millis().max(1) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        events
    };
    pg_sys::check_for_interrupts!();
    events & pg_sys::WL_LATCH_SET as i32 != 0
}

/// Runs `wait` with query cancels held off (a terminate still ends it), then drops any cancel
/// that came meanwhile: for a worker waiting on its role runner, to which a cancel means nothing
/// (it would abort the poll and strand the claim's later batches until their leases lapse).
/// Only around waits that arm no timeout: `lock_timeout` and `statement_timeout` raise through
/// the same flag, and a held one would never fire.
pub fn past_cancels<R>(wait: impl FnOnce() -> R) -> R {
    unsafe {
        let held = pg_sys::QueryCancelHoldoffCount;
        pg_sys::QueryCancelHoldoffCount = held + 1;
        let result = wait();
        (&raw mut pg_sys::QueryCancelPending).write_volatile(0);
        pg_sys::QueryCancelHoldoffCount = held;
        result
    }
}

pub(crate) fn wake_workers() {
    for slot in &SLOTS.get().0 {
        let pid = slot.load(Ordering::Relaxed);
        if pid != 0 {
            unsafe {
                let process = pg_sys::BackendPidGetProc(pid);
                if !process.is_null() {
                    pg_sys::SetLatch(&raw mut (*process).procLatch);
                }
            }
        }
    }
}
