//! Latches: waking idle workers when work arrives, so enqueue-to-start latency does not wait for
//! `durable_jobs.poll_interval`. Each worker publishes its pid in a shared slot (empty while it is
//! switched off); a transaction that enqueued sets their latches once, when it commits (a
//! rolled-back enqueue wakes no one).

use crate::pg::latch::at_commit_or_forget;
use crate::pg::settings::WORKER_COUNT_LIMIT;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
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
    unsafe extern "C-unwind" fn clear_slot(_code: std::ffi::c_int, number: pg_sys::Datum) {
        set_worker_wakeable(number.value() as i32, false);
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

/// How many background workers are running and switched on now (their slots are filled).
pub fn awake_workers() -> usize {
    if !preloaded() {
        return 0;
    }
    SLOTS
        .get()
        .0
        .iter()
        .map(|slot| slot.load(Ordering::Relaxed))
        .filter(|&pid| pid != 0 && !unsafe { pg_sys::BackendPidGetProc(pid) }.is_null())
        .count()
}

/// Asks for the workers to be woken when the current transaction commits.
pub fn wake_workers_at_commit() {
    if !SHARED_MEMORY.load(Ordering::Relaxed) || WAKE_AT_COMMIT.swap(true, Ordering::Relaxed) {
        return;
    }
    // A prepared transaction commits later, maybe elsewhere: the poll interval picks it up.
    at_commit_or_forget(wake_workers, || WAKE_AT_COMMIT.store(false, Ordering::Relaxed));
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
