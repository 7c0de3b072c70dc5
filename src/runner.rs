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
//! session runs that role's handlers only and then ends. The worker hands the batch's leases
//! (job ids and tokens) over in shared memory and waits for the runner to finish; the runner
//! takes over exactly those leases, so every fence holds as before. Each hand-over has a
//! generation, which the runner is started with: a runner that starts too late to find its
//! own hand-over does nothing.

use crate::settings::WORKER_COUNT_LIMIT;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, Uuid};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, AtomicUsize, Ordering};

/// The most leases one hand-over carries (the area is built on the postmaster's stack at start,
/// so it stays small): a larger batch is handed over in parts, and leases of later batches
/// beyond it are left to the worker's next renewal.
pub const HANDOFF_JOBS: usize = 256;

pub const RUNNER_TYPE: &str = "durable_jobs role runner";

/// What worker N hands its runner: a batch's leases, then those of the claim's later batches
/// (which the runner renews with its own), and the lease length, under a generation number.
pub struct Handoff {
    generation: AtomicU64,
    lease_seconds: AtomicI32,
    batch_len: AtomicUsize,
    total_len: AtomicUsize,
    job_ids: [AtomicI64; HANDOFF_JOBS],
    /// Each lease token as two halves.
    tokens: [[AtomicU64; 2]; HANDOFF_JOBS],
}

impl Default for Handoff {
    fn default() -> Self {
        Handoff {
            generation: AtomicU64::new(0),
            lease_seconds: AtomicI32::new(0),
            batch_len: AtomicUsize::new(0),
            total_len: AtomicUsize::new(0),
            job_ids: std::array::from_fn(|_| AtomicI64::new(0)),
            tokens: std::array::from_fn(|_| [AtomicU64::new(0), AtomicU64::new(0)]),
        }
    }
}

/// A runner's argument: its worker's number (low 16 bits) and the generation of its hand-over.
fn runner_argument(number: i32, generation: u64) -> pg_sys::Datum {
    pg_sys::Datum::from(((generation << 16) | (number as u64 & 0xffff)) as usize)
}

fn split_runner_argument(argument: pg_sys::Datum) -> (i32, u64) {
    let value = argument.value() as u64;
    ((value & 0xffff) as i32, value >> 16)
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

/// Runs `batch` (leases of one role's jobs, in claim order) in a role runner for worker
/// `number`, with `later` (the claim's leases still to run after it), and waits until the
/// runner ends.
pub fn run_in_runner(
    number: i32,
    batch: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    lease_seconds: i32,
) -> Result<(), NotRun> {
    let handoff = &HANDOFFS.get().0[(number - 1) as usize];
    let leases: Vec<(i64, Uuid)> = batch.iter().chain(later).copied().take(HANDOFF_JOBS).collect();
    // The previous runner of this worker has ended (it was waited for), or started too late to
    // matter: the generation tells it this hand-over is not its own.
    let generation = handoff.generation.fetch_add(1, Ordering::AcqRel) + 1;
    for (index, (job_id, token)) in leases.iter().enumerate() {
        handoff.job_ids[index].store(*job_id, Ordering::Relaxed);
        let bytes = token.as_bytes();
        let halves = [&bytes[..8], &bytes[8..]].map(|half| u64::from_le_bytes(half.try_into().expect("8 bytes")));
        handoff.tokens[index][0].store(halves[0], Ordering::Relaxed);
        handoff.tokens[index][1].store(halves[1], Ordering::Relaxed);
    }
    handoff.lease_seconds.store(lease_seconds, Ordering::Relaxed);
    handoff.batch_len.store(batch.len().min(HANDOFF_JOBS), Ordering::Relaxed);
    handoff.total_len.store(leases.len(), Ordering::Release);
    let runner = BackgroundWorkerBuilder::new(&format!("{RUNNER_TYPE} {number}"))
        .set_type(RUNNER_TYPE)
        .set_library("durable_jobs")
        .set_function("durable_jobs_role_runner_main")
        .set_argument(Some(runner_argument(number, generation)))
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

/// What a runner was started for.
pub struct Handover {
    pub worker_number: i32,
    pub batch: Vec<(i64, Uuid)>,
    pub later: Vec<(i64, Uuid)>,
    pub lease_seconds: i32,
}

/// The hand-over of the runner started with `argument`; None when a newer hand-over replaced it
/// (its worker restarted and handed over again before this runner started).
pub fn take_handoff(argument: pg_sys::Datum) -> (i32, Option<Handover>) {
    let (number, generation) = split_runner_argument(argument);
    let handoff = &HANDOFFS.get().0[(number - 1) as usize];
    let total = handoff.total_len.load(Ordering::Acquire);
    let batch_len = handoff.batch_len.load(Ordering::Relaxed);
    let leases: Vec<(i64, Uuid)> = (0..total)
        .map(|index| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&handoff.tokens[index][0].load(Ordering::Relaxed).to_le_bytes());
            bytes[8..].copy_from_slice(&handoff.tokens[index][1].load(Ordering::Relaxed).to_le_bytes());
            (handoff.job_ids[index].load(Ordering::Relaxed), Uuid::from_bytes(bytes))
        })
        .collect();
    if handoff.generation.load(Ordering::Acquire) != generation {
        return (number, None);
    }
    let (batch, later) = leases.split_at(batch_len.min(total));
    let handover = Handover {
        worker_number: number,
        batch: batch.to_vec(),
        later: later.to_vec(),
        lease_seconds: handoff.lease_seconds.load(Ordering::Relaxed),
    };
    (number, Some(handover))
}
