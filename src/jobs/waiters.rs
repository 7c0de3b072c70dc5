//! Waking the sessions that wait for a job to change, when the transaction that changed it
//! commits. A waiter publishes (its process, the job) in a shared slot and sleeps on its latch;
//! every transition our statements make notes the job, and at commit, once the change is
//! visible, the latches of the jobs' waiters are set. Nothing is sent when nobody waits, and no
//! NOTIFY (which takes a cluster-wide lock at commit) is involved.

use crate::pg::latch::{at_commit_or_forget, my_procno_plus_one, set_latch_of};
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, Ordering};

/// Sessions that can wait at once through a slot; more wait by re-reading once a second.
pub const WAITER_SLOTS: usize = 1024;

pub struct WaiterSlots {
    /// Slots in use, so that a commit with no waiter scans nothing.
    in_use: AtomicU32,
    /// The waiter's `pgprocno + 1`; 0 when the slot is free.
    owner: [AtomicI32; WAITER_SLOTS],
    /// The job it waits for, and the database of that job (each numbers its own jobs).
    job_id: [AtomicI64; WAITER_SLOTS],
    database: [AtomicU32; WAITER_SLOTS],
    /// It waits for the job to end, so only a change to a terminal state wakes it.
    until_terminal: [AtomicBool; WAITER_SLOTS],
}

impl Default for WaiterSlots {
    fn default() -> Self {
        WaiterSlots {
            in_use: AtomicU32::new(0),
            owner: std::array::from_fn(|_| AtomicI32::new(0)),
            job_id: std::array::from_fn(|_| AtomicI64::new(0)),
            database: std::array::from_fn(|_| AtomicU32::new(0)),
            until_terminal: std::array::from_fn(|_| AtomicBool::new(false)),
        }
    }
}

unsafe impl PGRXSharedMemory for WaiterSlots {}

static SLOTS: PgAtomic<WaiterSlots> = unsafe { PgAtomic::new(c"durable_jobs_waiter_slots") };

/// Set while preloading (inherited by forked backends); without it, waiters re-read once a second.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

/// Whether this backend registered the exit hook that frees its slots.
static EXIT_HOOK: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The jobs this backend's current transaction changed; their waiters wake at its commit.
    static CHANGED: RefCell<Vec<(i64, Change)>> = const { RefCell::new(Vec::new()) };
}

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(SLOTS);
    SHARED_MEMORY.store(true, Ordering::Relaxed);
}

/// A slot held while its session waits; freed when dropped (also when an error unwinds).
pub struct WaiterSlot(Option<usize>);

impl WaiterSlot {
    /// Takes a free slot for `job_id` (woken only when it ends, with `until_terminal`); without
    /// one (none free, or no shared memory) the waiter falls back to re-reading.
    pub fn take(job_id: i64, until_terminal: bool) -> WaiterSlot {
        if !SHARED_MEMORY.load(Ordering::Relaxed) {
            return WaiterSlot(None);
        }
        if !EXIT_HOOK.swap(true, Ordering::Relaxed) {
            // A session ended by FATAL (terminate, postmaster death) does not unwind.
            unsafe extern "C-unwind" fn free_my_slots(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
                let slots = SLOTS.get();
                let me = my_procno_plus_one();
                for index in 0..WAITER_SLOTS {
                    if slots.owner[index].load(Ordering::Relaxed) == me {
                        release(index);
                    }
                }
            }
            unsafe { pg_sys::before_shmem_exit(Some(free_my_slots), pg_sys::Datum::from(0)) };
        }
        let slots = SLOTS.get();
        let me = my_procno_plus_one();
        for index in 0..WAITER_SLOTS {
            if slots.owner[index].compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                slots.until_terminal[index].store(until_terminal, Ordering::SeqCst);
                slots.database[index].store(my_database(), Ordering::SeqCst);
                slots.job_id[index].store(job_id, Ordering::SeqCst);
                slots.in_use.fetch_add(1, Ordering::SeqCst);
                return WaiterSlot(Some(index));
            }
        }
        WaiterSlot(None)
    }

    /// Whether a commit will wake this waiter (else it must re-read on its own).
    pub fn is_woken_at_commit(&self) -> bool {
        self.0.is_some()
    }
}

fn release(index: usize) {
    let slots = SLOTS.get();
    slots.job_id[index].store(0, Ordering::SeqCst);
    slots.in_use.fetch_sub(1, Ordering::SeqCst);
    slots.owner[index].store(0, Ordering::Release);
}

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        if let Some(index) = self.0.take() {
            release(index);
        }
    }
}

/// What a transition made of a job, for the waiters that wait only for its end.
#[derive(Clone, Copy, PartialEq)]
pub enum Change {
    /// The job ended (succeeded, failed, cancelled).
    Terminal,
    /// Anything else (claimed, retried, replayed, given back).
    Other,
}

/// Notes that the current transaction changed `job_ids`, so that their waiters wake when it
/// commits (a rollback wakes no one; a spurious wake-up only makes a waiter read again). A
/// change marked `Other` that was terminal after all would only leave a waiter to its
/// ten-second re-read.
pub fn wake_waiters_at_commit(job_ids: impl IntoIterator<Item = i64>, change: Change) {
    if !SHARED_MEMORY.load(Ordering::Relaxed) {
        return;
    }
    let first = CHANGED.with(|changed| {
        let mut changed = changed.borrow_mut();
        let was_empty = changed.is_empty();
        changed.extend(job_ids.into_iter().map(|job_id| (job_id, change)));
        was_empty && !changed.is_empty()
    });
    if !first {
        return;
    }
    // A prepared transaction's waiters wake at its COMMIT PREPARED (`jobs::hooks`), every one of them.
    at_commit_or_forget(
        || {
            let changed = CHANGED.with(|changed| std::mem::take(&mut *changed.borrow_mut()));
            wake_waiters(&changed);
        },
        || CHANGED.with(|changed| changed.borrow_mut().clear()),
    );
}

fn my_database() -> u32 {
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// Sets the latch of every waiter on a job of this database.
pub fn wake_every_waiter() {
    if !SHARED_MEMORY.load(Ordering::Relaxed) {
        return;
    }
    let (slots, database) = (SLOTS.get(), my_database());
    for index in 0..WAITER_SLOTS {
        let owner = slots.owner[index].load(Ordering::Acquire);
        if owner != 0 && slots.database[index].load(Ordering::SeqCst) == database {
            set_latch_of(owner);
        }
    }
}

/// Sets the latch of every waiter on one of `changed`'s jobs, in this database (of those waiting
/// for the end, only on a terminal change). Runs after the commit is visible.
fn wake_waiters(changed: &[(i64, Change)]) {
    let slots = SLOTS.get();
    if slots.in_use.load(Ordering::SeqCst) == 0 {
        return;
    }
    // Per job, whether any of its changes in the transaction was terminal.
    let mut changed = changed.to_vec();
    changed.sort_unstable_by_key(|(job_id, change)| (*job_id, *change == Change::Other));
    changed.dedup_by_key(|(job_id, _)| *job_id);
    let database = my_database();
    for index in 0..WAITER_SLOTS {
        let owner = slots.owner[index].load(Ordering::Acquire);
        if owner == 0 {
            continue;
        }
        let job_id = slots.job_id[index].load(Ordering::SeqCst);
        if slots.database[index].load(Ordering::SeqCst) != database {
            continue;
        }
        let Ok(found) = changed.binary_search_by_key(&job_id, |(job_id, _)| *job_id) else { continue };
        if changed[found].1 == Change::Other && slots.until_terminal[index].load(Ordering::SeqCst) {
            continue;
        }
        set_latch_of(owner);
    }
}
