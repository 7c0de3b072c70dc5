//! Role runners: one session never runs the handlers of two roles.
//!
//! A session keeps caches that PostgreSQL does not key by role: PL/pgSQL compiles a function
//! once per session, resolving the type names in its declarations with the search_path of its
//! first caller, and every later caller uses that compiled copy. If one worker session ran the
//! handlers of several roles, one role could decide what a shared function means when another
//! role's job runs it (a domain of its own, with a CHECK calling its code, in place of the type
//! the author meant), and so act with that role's rights.
//!
//! So a background worker binds to the role of the first batch it runs, and runs the batches of
//! every other role in a role runner: a dynamic background worker started for that batch, whose
//! session runs that role's handlers only and then ends. The worker hands the batch's job ids
//! over in shared memory and waits for the runner to finish; the runner takes the leases over
//! (they are the worker's: same `lease_owner`), so every fence holds as before.

use crate::settings::WORKER_COUNT_LIMIT;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicUsize, Ordering};

/// The most job ids one hand-over carries: a claim's jobs (`claim_batch_size` is at most 1000).
const HANDOFF_JOBS: usize = 1000;

pub const RUNNER_TYPE: &str = "durable_jobs role runner";

/// What worker N hands its runner: a batch's job ids, then those of the claim's later batches
/// (whose leases the runner renews with its own), and the lease length.
pub struct Handoff {
    lease_seconds: AtomicI32,
    batch_len: AtomicUsize,
    total_len: AtomicUsize,
    job_ids: [AtomicI64; HANDOFF_JOBS],
}

impl Default for Handoff {
    fn default() -> Self {
        Handoff {
            lease_seconds: AtomicI32::new(0),
            batch_len: AtomicUsize::new(0),
            total_len: AtomicUsize::new(0),
            job_ids: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

pub struct Handoffs([Handoff; WORKER_COUNT_LIMIT as usize]);

impl Default for Handoffs {
    fn default() -> Self {
        Handoffs(std::array::from_fn(|_| Handoff::default()))
    }
}

unsafe impl PGRXSharedMemory for Handoffs {}

static HANDOFFS: PgAtomic<Handoffs> = unsafe { PgAtomic::new(c"durable_jobs_runner_handoffs") };

/// Set while preloading (inherited by forked processes).
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(HANDOFFS);
    SHARED_MEMORY.store(true, Ordering::Relaxed);
}

/// Why a batch could not be handed to a runner.
pub enum NotRun {
    /// No background worker slot was free (`max_worker_processes`).
    NoSlot,
    /// The runner could not be waited for (the postmaster died).
    Lost,
}

/// Runs `batch` (job ids of one role, in claim order) in a role runner for worker `number`,
/// with `later` (the claim's jobs still to run after it), and waits until the runner ends.
pub fn run_in_runner(number: i32, batch: &[i64], later: &[i64], lease_seconds: i32) -> Result<(), NotRun> {
    let handoff = &HANDOFFS.get().0[(number - 1) as usize];
    let ids: Vec<i64> = batch.iter().chain(later).copied().take(HANDOFF_JOBS).collect();
    for (slot, id) in handoff.job_ids.iter().zip(&ids) {
        slot.store(*id, Ordering::Relaxed);
    }
    handoff.lease_seconds.store(lease_seconds, Ordering::Relaxed);
    handoff.batch_len.store(batch.len().min(HANDOFF_JOBS), Ordering::Relaxed);
    // Published by the postmaster's start of the runner, which happens after this store.
    handoff.total_len.store(ids.len(), Ordering::Release);
    let runner = BackgroundWorkerBuilder::new(&format!("{RUNNER_TYPE} {number}"))
        .set_type(RUNNER_TYPE)
        .set_library("durable_jobs")
        .set_function("durable_jobs_role_runner_main")
        .set_argument(Some(pg_sys::Datum::from(number)))
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
        .map_err(|_| NotRun::NoSlot)?;
    match runner.wait_for_startup() {
        Ok(_) => runner.wait_for_shutdown().map_err(|_| NotRun::Lost),
        // Stopped already: it ran and ended before we looked.
        Err(pgrx::bgworkers::BackgroundWorkerStatus::Stopped) => Ok(()),
        Err(_) => Err(NotRun::Lost),
    }
}

/// The hand-over a runner for worker `number` reads: (batch, later, lease seconds).
pub fn take_handoff(number: i32) -> (Vec<i64>, Vec<i64>, i32) {
    let handoff = &HANDOFFS.get().0[(number - 1) as usize];
    let total = handoff.total_len.load(Ordering::Acquire);
    let batch_len = handoff.batch_len.load(Ordering::Relaxed);
    let ids: Vec<i64> = handoff.job_ids[..total].iter().map(|id| id.load(Ordering::Relaxed)).collect();
    let (batch, later) = ids.split_at(batch_len.min(total));
    (batch.to_vec(), later.to_vec(), handoff.lease_seconds.load(Ordering::Relaxed))
}
