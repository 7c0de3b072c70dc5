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
//! every other role in its role runner: a dynamic background worker bound, for its whole life,
//! to the role of the first batch it takes. The worker hands each batch's leases (job ids and
//! tokens) over in shared memory, wakes the runner and waits until it is done; the runner takes
//! over exactly those leases, so every fence holds as before. A batch of another role retires
//! the runner (it ends) and starts a new one; an idle runner ends after a while. A runner takes a
//! hand-over only if it is for its own role and from the worker process that started it: a
//! runner left over from a worker that restarted, or bound to another role, ends instead.

use crate::settings::WORKER_COUNT_LIMIT;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, Uuid};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The most leases one hand-over carries (the area is built on the postmaster's stack at start,
/// so it stays small): a larger batch is handed over in parts, and leases of later batches
/// beyond it are left to the worker's next renewal.
pub const HANDOFF_JOBS: usize = 256;

/// A role's name as the hand-over carries it (NAMEDATALEN bytes).
const ROLE_WORDS: usize = 8;

pub const RUNNER_TYPE: &str = "durable_jobs role runner";

/// How long a runner waits for its next batch before it ends and frees its slot.
const RUNNER_IDLE_LIMIT: Duration = Duration::from_secs(10);

/// Worker N's hand-overs to its runner. The worker writes a hand-over only while no runner works
/// on one (it waits for `done`), then publishes it by raising `generation`.
pub struct Handoff {
    generation: AtomicU64,
    /// The latest generation a runner took (only one runner can take each), and finished.
    taken: AtomicU64,
    done: AtomicU64,
    /// Set by the worker to retire its runner.
    quit: AtomicBool,
    worker_pid: AtomicI32,
    worker_procno: AtomicI32,
    /// `pgprocno + 1` of the running runner; 0 when none.
    runner_procno: AtomicI32,
    role: [AtomicU64; ROLE_WORDS],
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
            taken: AtomicU64::new(0),
            done: AtomicU64::new(0),
            quit: AtomicBool::new(false),
            worker_pid: AtomicI32::new(0),
            worker_procno: AtomicI32::new(0),
            runner_procno: AtomicI32::new(0),
            role: std::array::from_fn(|_| AtomicU64::new(0)),
            lease_seconds: AtomicI32::new(0),
            batch_len: AtomicUsize::new(0),
            total_len: AtomicUsize::new(0),
            job_ids: std::array::from_fn(|_| AtomicI64::new(0)),
            tokens: std::array::from_fn(|_| [AtomicU64::new(0), AtomicU64::new(0)]),
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

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(HANDOFFS);
}

fn handoff_of(number: i32) -> &'static Handoff {
    &HANDOFFS.get().0[(number - 1) as usize]
}

fn role_words(role: &str) -> [u64; ROLE_WORDS] {
    let mut bytes = [0u8; ROLE_WORDS * 8];
    let name = role.as_bytes();
    let length = name.len().min(ROLE_WORDS * 8);
    bytes[..length].copy_from_slice(&name[..length]);
    std::array::from_fn(|word| u64::from_le_bytes(bytes[word * 8..word * 8 + 8].try_into().expect("8 bytes")))
}

fn set_latch_of(procno_plus_one: i32) {
    if procno_plus_one > 0 {
        unsafe {
            let process = (*pg_sys::ProcGlobal).allProcs.add((procno_plus_one - 1) as usize);
            pg_sys::SetLatch(&raw mut (*process).procLatch);
        }
    }
}

fn my_procno_plus_one() -> i32 {
    unsafe { (*pg_sys::MyProc).pgprocno + 1 }
}

/// Sleeps on this process's latch for at most `timeout`, then checks for interrupts.
fn sleep_on_latch(timeout: Duration) {
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout.as_millis().max(1) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    pg_sys::check_for_interrupts!();
}

/// Why a batch could not be handed to a runner.
pub enum NotRun {
    /// No background worker slot was free (`max_worker_processes`).
    NoSlot,
    /// The runner ended while it worked on the batch; its leases expire.
    Lost,
}

thread_local! {
    /// This worker's runner, and the role it is bound to.
    static RUNNER: RefCell<Option<(DynamicBackgroundWorker, String)>> = const { RefCell::new(None) };
}

fn is_running(runner: &DynamicBackgroundWorker) -> bool {
    !matches!(runner.pid(), Err(BackgroundWorkerStatus::Stopped | BackgroundWorkerStatus::PostmasterDied))
}

fn start_runner(number: i32) -> Result<DynamicBackgroundWorker, NotRun> {
    BackgroundWorkerBuilder::new(&format!("{RUNNER_TYPE} {number}"))
        .set_type(RUNNER_TYPE)
        .set_library("durable_jobs")
        .set_function("durable_jobs_role_runner_main")
        .set_argument(Some(pg_sys::Datum::from(number)))
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
        .map_err(|_| NotRun::NoSlot)
}

/// Ends this worker's runner, if any, and waits until it has.
pub fn retire_runner(number: i32) {
    if let Some((runner, _)) = RUNNER.with(|slot| slot.borrow_mut().take()) {
        let handoff = handoff_of(number);
        handoff.quit.store(true, Ordering::SeqCst);
        set_latch_of(handoff.runner_procno.load(Ordering::Acquire));
        let _ = runner.wait_for_shutdown();
        handoff.quit.store(false, Ordering::SeqCst);
    }
}

/// Runs `batch` (leases of `role`'s jobs, in claim order) in this worker's runner for `role`,
/// with `later` (the claim's leases still to run after it), and waits until it is done.
pub fn run_in_runner(
    number: i32,
    role: &str,
    batch: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    lease_seconds: i32,
) -> Result<(), NotRun> {
    let handoff = handoff_of(number);
    let leases: Vec<(i64, Uuid)> = batch.iter().chain(later).copied().take(HANDOFF_JOBS).collect();
    for (index, (job_id, token)) in leases.iter().enumerate() {
        handoff.job_ids[index].store(*job_id, Ordering::Relaxed);
        let bytes = token.as_bytes();
        let halves = [&bytes[..8], &bytes[8..]].map(|half| u64::from_le_bytes(half.try_into().expect("8 bytes")));
        handoff.tokens[index][0].store(halves[0], Ordering::Relaxed);
        handoff.tokens[index][1].store(halves[1], Ordering::Relaxed);
    }
    for (word, value) in handoff.role.iter().zip(role_words(role)) {
        word.store(value, Ordering::Relaxed);
    }
    handoff.lease_seconds.store(lease_seconds, Ordering::Relaxed);
    handoff.batch_len.store(batch.len().min(HANDOFF_JOBS), Ordering::Relaxed);
    handoff.total_len.store(leases.len(), Ordering::Relaxed);
    handoff.worker_pid.store(unsafe { pg_sys::MyProcPid }, Ordering::Relaxed);
    handoff.worker_procno.store(my_procno_plus_one(), Ordering::Relaxed);
    let generation = handoff.generation.load(Ordering::Relaxed) + 1;
    handoff.generation.store(generation, Ordering::Release);

    // The runner bound to this role, if it is still there; else a new one.
    let current = RUNNER.with(|slot| slot.borrow_mut().take());
    let kept = match current {
        Some((runner, bound)) if bound == role && is_running(&runner) => Some(runner),
        other => {
            RUNNER.with(|slot| *slot.borrow_mut() = other);
            None
        }
    };
    let mut runner = match kept {
        Some(runner) => {
            set_latch_of(handoff.runner_procno.load(Ordering::Acquire));
            runner
        }
        None => {
            retire_runner(number);
            start_runner(number)?
        }
    };
    loop {
        if handoff.done.load(Ordering::Acquire) >= generation {
            RUNNER.with(|slot| *slot.borrow_mut() = Some((runner, role.to_owned())));
            return Ok(());
        }
        if !is_running(&runner) {
            if handoff.taken.load(Ordering::Acquire) >= generation {
                return Err(NotRun::Lost);
            }
            // It ended (idle) before it took this batch: a new runner takes it.
            runner = start_runner(number)?;
        }
        sleep_on_latch(Duration::from_millis(100));
    }
}

/// A batch a runner took.
pub struct Handover {
    pub worker_number: i32,
    pub batch: Vec<(i64, Uuid)>,
    pub later: Vec<(i64, Uuid)>,
    pub lease_seconds: i32,
}

/// A runner's side: waits for hand-overs of worker `number` and gives each to `run`, as long as
/// they come from the worker process and for the role of its first one; ends when retired, when
/// idle for a while, or at the first hand-over not its own.
pub fn serve_handovers(number: i32, mut run: impl FnMut(Handover)) {
    let handoff = handoff_of(number);
    handoff.runner_procno.store(my_procno_plus_one(), Ordering::Release);
    let mut bound: Option<(i32, [u64; ROLE_WORDS])> = None;
    let mut idle_since = Instant::now();
    loop {
        if handoff.quit.load(Ordering::SeqCst) {
            break;
        }
        let generation = handoff.generation.load(Ordering::Acquire);
        if generation > handoff.done.load(Ordering::Acquire) && generation > handoff.taken.load(Ordering::Acquire) {
            let owner = (
                handoff.worker_pid.load(Ordering::Relaxed),
                std::array::from_fn(|word| handoff.role[word].load(Ordering::Relaxed)),
            );
            if bound.is_some_and(|bound| bound != owner) {
                // Another role's batch, or another worker process's: not for this session.
                break;
            }
            if handoff.taken.fetch_max(generation, Ordering::AcqRel) >= generation {
                continue;
            }
            bound = Some(owner);
            run(read_handover(number, handoff));
            handoff.done.store(generation, Ordering::Release);
            set_latch_of(handoff.worker_procno.load(Ordering::Relaxed));
            idle_since = Instant::now();
            continue;
        }
        if idle_since.elapsed() >= RUNNER_IDLE_LIMIT {
            break;
        }
        sleep_on_latch(Duration::from_secs(1));
    }
    handoff.runner_procno.store(0, Ordering::Release);
    // The worker may be waiting on a hand-over this runner did not take: it looks again.
    set_latch_of(handoff.worker_procno.load(Ordering::Relaxed));
}

fn read_handover(number: i32, handoff: &Handoff) -> Handover {
    let total = handoff.total_len.load(Ordering::Relaxed);
    let batch_len = handoff.batch_len.load(Ordering::Relaxed).min(total);
    let leases: Vec<(i64, Uuid)> = (0..total)
        .map(|index| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&handoff.tokens[index][0].load(Ordering::Relaxed).to_le_bytes());
            bytes[8..].copy_from_slice(&handoff.tokens[index][1].load(Ordering::Relaxed).to_le_bytes());
            (handoff.job_ids[index].load(Ordering::Relaxed), Uuid::from_bytes(bytes))
        })
        .collect();
    let (batch, later) = leases.split_at(batch_len);
    Handover {
        worker_number: number,
        batch: batch.to_vec(),
        later: later.to_vec(),
        lease_seconds: handoff.lease_seconds.load(Ordering::Relaxed),
    }
}
