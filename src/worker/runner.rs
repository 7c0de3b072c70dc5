//! Role runners: one session never runs the handlers of two roles. (A little over 400 lines:
//! both sides of the hand-over, the worker's and the runner's, read best together.)
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
//! A session is bound to the role itself (its oid: a role renamed, or dropped and created again
//! under its name, is another role, for which the runner ends and the worker restarts), and
//! makes it the session's user (`session_user`, where the worker logs in as a superuser), so that
//! no handler sees the worker's login role there.

use crate::pg::latch::{my_procno_plus_one, past_cancels, set_latch_of, sleep_on_latch};
use crate::pg::settings::WORKER_COUNT_LIMIT;
use crate::pg::shared_words::{load_name, load_token, store_name, store_token, ROLE_WORDS};
use pgrx::bgworkers::{
    BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, Uuid};
use std::cell::RefCell;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The most leases one hand-over carries (the area is built on the postmaster's stack at start,
/// so it stays small): a larger batch is handed over in parts, and leases of later batches
/// beyond it are left to the worker's next renewal.
pub const HANDOFF_JOBS: usize = 256;

pub const RUNNER_TYPE: &str = "durable_jobs role runner";

/// How long a runner waits for its next batch before it ends and frees its slot.
const RUNNER_IDLE_LIMIT: Duration = Duration::from_secs(10);

/// Worker N's hand-overs to its runner. The worker writes a hand-over only while no runner works
/// on one (it waits for `done`), then publishes it by raising `generation`.
pub struct Handoff {
    /// A sequence lock over the fields below it: odd while the worker writes them.
    sequence: AtomicU64,
    generation: AtomicU64,
    /// The latest generation a runner took (only one runner can take each), and finished.
    taken: AtomicU64,
    done: AtomicU64,
    /// The latest generation a runner took but could not take over (see `NotRun::Refused`).
    refused: AtomicU64,
    /// The pid of the runner the worker retires (a pid, so that a value left by a worker that
    /// died while retiring cannot end a later runner).
    retire_pid: AtomicI32,
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
            sequence: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            done: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            retire_pid: AtomicI32::new(0),
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

/// Why a batch could not be handed to a runner.
pub enum NotRun {
    /// No runner could start: no background worker slot was free (`max_worker_processes`), or
    /// runners ended at start (connections refused, say) several times in a row.
    NoSlot,
    /// The runner ended while it worked on the batch; its leases expire.
    Lost,
    /// The runner took the batch but could not take its leases over (its transaction failed,
    /// logged: a cancel, a lock timeout; the extension was being updated; or its role's name
    /// names another role now): no handler of it started, and it renewed nothing.
    Refused,
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
        if let Ok(pid) = runner.pid() {
            handoff.retire_pid.store(pid, Ordering::SeqCst);
            set_latch_of(handoff.runner_procno.load(Ordering::Acquire));
        }
        // Before a hand-over: a cancel here would strand the whole claim, as in the waits below.
        let _ = past_cancels(|| runner.wait_for_shutdown());
    }
}

/// Runners that may end at start in a row before the worker gives the batch back.
const RUNNER_START_ATTEMPTS: u32 = 3;

/// Runs `batch` (leases of `role`'s jobs, in claim order) in this worker's runner for `role`,
/// with `later` (the claim's leases still to run after it), and waits until it is done. The
/// hand-over carries at most `HANDOFF_JOBS` leases; meanwhile `renew` is called for the leases
/// of `later` it could not carry every third of a lease (they were renewed, or claimed, less
/// than that before the call: see `worker::run_batch_in_runner`).
pub fn run_in_runner(
    number: i32,
    role: &str,
    batch: &[(i64, Uuid)],
    later: &[(i64, Uuid)],
    lease_seconds: i32,
    mut renew: impl FnMut(&[(i64, Uuid)]) -> bool,
) -> Result<(), NotRun> {
    let mut renewal = Renewal::since(Instant::now(), lease_seconds);
    let handoff = handoff_of(number);
    if let Some(wait) = START_BACKOFF.with(|backoff| backoff.borrow().wait()) {
        // Runners kept ending at start lately: not again before the back-off is over.
        past_cancels(|| sleep_on_latch(wait.min(Duration::from_millis(100))));
        return Err(NotRun::NoSlot);
    }
    // Decided before the hand-over is published, so that no runner of another role is still
    // there to take it.
    let current = RUNNER.with(|slot| slot.borrow_mut().take());
    let kept = match current {
        Some((runner, bound)) if bound == role && is_running(&runner) => Some(runner),
        other => {
            RUNNER.with(|slot| *slot.borrow_mut() = other);
            retire_runner(number);
            None
        }
    };
    let carried = HANDOFF_JOBS.min(batch.len() + later.len());
    let leases: Vec<(i64, Uuid)> = batch.iter().chain(later).copied().take(carried).collect();
    let uncarried = &later[(carried - batch.len().min(carried)).min(later.len())..];
    handoff.sequence.fetch_add(1, Ordering::SeqCst);
    std::sync::atomic::fence(Ordering::Release);
    for (index, (job_id, token)) in leases.iter().enumerate() {
        handoff.job_ids[index].store(*job_id, Ordering::Relaxed);
        store_token(&handoff.tokens[index], *token);
    }
    store_name(&handoff.role, role);
    handoff.lease_seconds.store(lease_seconds, Ordering::Relaxed);
    handoff.batch_len.store(batch.len().min(HANDOFF_JOBS), Ordering::Relaxed);
    handoff.total_len.store(leases.len(), Ordering::Relaxed);
    handoff.worker_pid.store(unsafe { pg_sys::MyProcPid }, Ordering::Relaxed);
    handoff.worker_procno.store(my_procno_plus_one(), Ordering::Relaxed);
    let generation = handoff.generation.load(Ordering::Relaxed) + 1;
    handoff.generation.store(generation, Ordering::Relaxed);
    handoff.sequence.fetch_add(1, Ordering::Release);

    let mut runner = match kept {
        Some(runner) => {
            set_latch_of(handoff.runner_procno.load(Ordering::Acquire));
            runner
        }
        None => start_runner(number)?,
    };
    let mut starts = 1;
    loop {
        if handoff.done.load(Ordering::Acquire) >= generation {
            START_BACKOFF.with(|backoff| backoff.borrow_mut().reset());
            RUNNER.with(|slot| *slot.borrow_mut() = Some((runner, role.to_owned())));
            if handoff.refused.load(Ordering::Acquire) >= generation {
                return Err(NotRun::Refused);
            }
            return Ok(());
        }
        if !is_running(&runner) {
            if handoff.taken.load(Ordering::Acquire) >= generation {
                return Err(NotRun::Lost);
            }
            // It ended before it took this batch (idle just then, or refused at start): a new
            // runner takes it, a few times at most, and later ones wait a growing while.
            if starts >= RUNNER_START_ATTEMPTS {
                START_BACKOFF.with(|backoff| backoff.borrow_mut().lengthen());
                return Err(NotRun::NoSlot);
            }
            starts += 1;
            runner = start_runner(number)?;
        }
        if renewal.is_due() && !uncarried.is_empty() {
            // Also after a failure, logged: retried a third of a lease later, not every 50 ms.
            renew(uncarried);
            renewal.done();
        }
        // A query cancel means nothing to the worker; a terminate still ends it here.
        past_cancels(|| sleep_on_latch(Duration::from_millis(50)));
    }
}

/// When leases were last renewed (or claimed), due again every third of a lease.
pub struct Renewal {
    every: Duration,
    last: Instant,
}

impl Renewal {
    pub fn since(last: Instant, lease_seconds: i32) -> Renewal {
        let every = Duration::from_millis((i64::from(lease_seconds) * 1000 / 3).max(100) as u64);
        Renewal { every, last }
    }

    pub fn is_due(&self) -> bool {
        self.last.elapsed() >= self.every
    }

    pub fn done(&mut self) {
        self.last = Instant::now();
    }
}

/// A growing wait before the next runner start after runners kept ending at start.
#[derive(Default)]
struct StartBackoff {
    until: Option<Instant>,
    length: Duration,
}

impl StartBackoff {
    fn wait(&self) -> Option<Duration> {
        self.until.and_then(|until| until.checked_duration_since(Instant::now()))
    }

    fn lengthen(&mut self) {
        self.length = (self.length * 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
        self.until = Some(Instant::now() + self.length);
    }

    fn reset(&mut self) {
        *self = StartBackoff::default();
    }
}

thread_local! {
    static START_BACKOFF: RefCell<StartBackoff> = RefCell::new(StartBackoff::default());
}

/// What a runner made of a hand-over it took.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TakenOver {
    /// It ran what of the batch was still leased to the worker.
    Ran,
    /// It could not take the leases over (see `NotRun::Refused`); the worker gives them back.
    Refused,
    /// The same, and its session may run the role's handlers no more (the role was renamed, or
    /// dropped and created again): it ends, and the role's next batch starts a new runner.
    RefusedAndEnds,
}

/// A batch a runner took.
pub struct Handover {
    pub worker_number: i32,
    /// The role whose jobs these are.
    pub role: String,
    pub batch: Vec<(i64, Uuid)>,
    pub later: Vec<(i64, Uuid)>,
    pub lease_seconds: i32,
}

/// A runner's side: waits for hand-overs of worker `number` and gives each to `run`, as long as
/// they come from the worker process and for the role of its first one; ends when retired, when
/// idle for a while, or at the first hand-over not its own, or when `run` says so.
pub fn serve_handovers(
    number: i32,
    mut between_batches: impl FnMut(),
    mut run: impl FnMut(Handover) -> TakenOver,
) {
    let handoff = handoff_of(number);
    let me = my_procno_plus_one();
    handoff.runner_procno.store(me, Ordering::Release);
    // Also when the runner ends by FATAL: the worker must not wake a process that is gone.
    unsafe extern "C-unwind" fn forget_me(_code: std::ffi::c_int, number: pg_sys::Datum) {
        let handoff = handoff_of(number.value() as i32);
        let _ = handoff.runner_procno.compare_exchange(
            my_procno_plus_one(),
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        // The worker may be waiting on a hand-over this runner did not take: it looks again.
        set_latch_of(handoff.worker_procno.load(Ordering::Relaxed));
    }
    unsafe { pg_sys::before_shmem_exit(Some(forget_me), pg_sys::Datum::from(number as usize)) };
    let my_pid = unsafe { pg_sys::MyProcPid };
    let mut bound: Option<(i32, [u64; ROLE_WORDS])> = None;
    let mut idle_since = Instant::now();
    loop {
        if handoff.retire_pid.load(Ordering::SeqCst) == my_pid {
            break;
        }
        between_batches();
        let Some((generation, owner, handover)) = read_consistently(number, handoff) else {
            // The worker is writing a hand-over just now.
            sleep_on_latch(Duration::from_millis(1));
            continue;
        };
        if generation > handoff.done.load(Ordering::Acquire)
            && generation > handoff.taken.load(Ordering::Acquire)
        {
            if bound.is_some_and(|bound| bound != owner) {
                // Another role's batch, or another worker process's: not for this session.
                break;
            }
            if handoff.taken.fetch_max(generation, Ordering::AcqRel) >= generation {
                continue;
            }
            bound = Some(owner);
            let taken = run(handover);
            if taken != TakenOver::Ran {
                handoff.refused.fetch_max(generation, Ordering::AcqRel);
            }
            handoff.done.fetch_max(generation, Ordering::AcqRel);
            set_latch_of(handoff.worker_procno.load(Ordering::Relaxed));
            if taken == TakenOver::RefusedAndEnds {
                break;
            }
            idle_since = Instant::now();
            continue;
        }
        if idle_since.elapsed() >= RUNNER_IDLE_LIMIT {
            break;
        }
        sleep_on_latch(Duration::from_secs(1));
    }
}

/// The current hand-over (generation, owner, contents) as one consistent snapshot; None while
/// the worker writes it.
fn read_consistently(number: i32, handoff: &Handoff) -> Option<(u64, (i32, [u64; ROLE_WORDS]), Handover)> {
    let before = handoff.sequence.load(Ordering::Acquire);
    if before % 2 == 1 {
        return None;
    }
    let generation = handoff.generation.load(Ordering::Relaxed);
    let owner = read_owner(handoff);
    let handover = read_handover(number, handoff);
    std::sync::atomic::fence(Ordering::Acquire);
    (handoff.sequence.load(Ordering::Relaxed) == before).then_some((generation, owner, handover))
}

/// Which worker process and role the current hand-over is from.
fn read_owner(handoff: &Handoff) -> (i32, [u64; ROLE_WORDS]) {
    (
        handoff.worker_pid.load(Ordering::Relaxed),
        std::array::from_fn(|word| handoff.role[word].load(Ordering::Relaxed)),
    )
}

fn read_handover(number: i32, handoff: &Handoff) -> Handover {
    let total = handoff.total_len.load(Ordering::Relaxed);
    let batch_len = handoff.batch_len.load(Ordering::Relaxed).min(total);
    let leases: Vec<(i64, Uuid)> = (0..total)
        .map(|index| (handoff.job_ids[index].load(Ordering::Relaxed), load_token(&handoff.tokens[index])))
        .collect();
    let (batch, later) = leases.split_at(batch_len);
    Handover {
        worker_number: number,
        role: load_name(&handoff.role),
        batch: batch.to_vec(),
        later: later.to_vec(),
        lease_seconds: handoff.lease_seconds.load(Ordering::Relaxed),
    }
}
