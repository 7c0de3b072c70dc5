//! Direct leases: an enqueue that finds a worker asleep leases its job to that worker in its own
//! INSERT and hands the job over when it commits; the worker wakes and runs it without a claim
//! of its own (a claim's statement and commit were the largest step of ours between an enqueue
//! and its handler: docs/benchmarks.md, fifteenth round).
//!
//! Each worker has a word in shared memory: awake; asleep; reserved by an enqueuing backend
//! (whose transaction inserts, or inserted, a job leased to that worker); committing (that
//! backend's transaction passed its pre-commit and will hand the job over or abort); handed (the
//! job is there to take). A worker marks itself asleep right before it sleeps and awake when it
//! wakes. Waking with a reservation that is not committing yet cancels it: the enqueuer then
//! makes its job available again before it commits, as it does when its transaction ran longer
//! than a fraction of the lease. So a job is committed leased to a worker only while that
//! worker waits for it, and the worker runs it right after the commit: what a claim guarantees
//! (attempt counted before the handler starts, lease fenced, running job visible) holds as for
//! a claimed job. The enqueue leases only what the worker's claim would take at once: a job of
//! a kind with a handler serving its enqueuer, due, in a queue neither paused nor limited, in
//! the worker's database, from a session that is no background worker, with no synchronous
//! standby to wait for; one job per transaction.

use crate::plans;
use crate::privilege::{as_extension_owner, set_at_this_level};
use crate::runner::{load_role, load_token, store_role, store_token, ROLE_WORDS};
use crate::settings::{self, WORKER_COUNT_LIMIT};
use crate::wakeup::{my_procno_plus_one, set_latch_of, sleep_on_latch};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, Uuid};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

// A worker's word: the state in the low three bits, the reserving backend (`pgprocno + 1`)
// above them. Only the reserving backend moves the word out of committing and publishing.
const AWAKE: u64 = 0;
const ASLEEP: u64 = 1;
const RESERVED: u64 = 2;
const COMMITTING: u64 = 3;
/// The committed enqueuer writes the job's fields.
const PUBLISHING: u64 = 4;
const HANDED: u64 = 5;
const STATE_BITS: u64 = 3;

fn word(state: u64, procno_plus_one: i32) -> u64 {
    state | (procno_plus_one as u64) << STATE_BITS
}

fn state_of(word: u64) -> u64 {
    word & ((1 << STATE_BITS) - 1)
}

pub struct Sleeper {
    state: AtomicU64,
    // Written by the worker while awake, read by the enqueuer that reserved it.
    worker_procno: AtomicI32,
    database: AtomicU32,
    lease_seconds: AtomicI32,
    // Written by the enqueuer while publishing, read by the worker once handed.
    job_id: AtomicI64,
    lease_token: [AtomicU64; 2],
    enqueued_by: [AtomicU64; ROLE_WORDS],
    leased_at: AtomicI64,
    commit_end: AtomicU64,
}

impl Default for Sleeper {
    fn default() -> Self {
        Sleeper {
            state: AtomicU64::new(AWAKE),
            worker_procno: AtomicI32::new(0),
            database: AtomicU32::new(0),
            lease_seconds: AtomicI32::new(0),
            job_id: AtomicI64::new(0),
            lease_token: [AtomicU64::new(0), AtomicU64::new(0)],
            enqueued_by: std::array::from_fn(|_| AtomicU64::new(0)),
            leased_at: AtomicI64::new(0),
            commit_end: AtomicU64::new(0),
        }
    }
}

pub struct Sleepers([Sleeper; WORKER_COUNT_LIMIT as usize]);

impl Default for Sleepers {
    fn default() -> Self {
        Sleepers(std::array::from_fn(|_| Sleeper::default()))
    }
}

unsafe impl PGRXSharedMemory for Sleepers {}

static SLEEPERS: PgAtomic<Sleepers> = unsafe { PgAtomic::new(c"durable_jobs_sleepers") };

/// Set while preloading (inherited by forked backends); without it there are no workers.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(SLEEPERS);
    SHARED_MEMORY.store(true, SeqCst);
}

fn sleeper(number: i32) -> &'static Sleeper {
    &SLEEPERS.get().0[(number - 1) as usize]
}

/// Worker `number` starts, or exits: it is awake to enqueues. A reservation of it ends (its
/// enqueuer makes the job available again); a job committed leased to it and not taken is
/// claimed again once its lease lapses, as a claimed job whose worker stopped.
pub fn reset(number: i32) {
    sleeper(number).state.store(AWAKE, SeqCst);
}

/// A job an enqueue handed to this worker: (enqueuer, (job, lease token)), and when its lease
/// started.
pub struct HandedJob {
    pub enqueued_by: String,
    pub job: (i64, Uuid),
    pub leased_at: Instant,
}

/// Worker `number`, whose claim found nothing, is about to sleep: enqueues may lease it a job
/// until it wakes (`wake_up`). Its lease length is the one the worker's claims use. False when
/// a job was handed to it meanwhile (the poll that takes it is due; committing, its enqueuer
/// sets the worker's latch once it is handed).
pub fn fall_asleep(number: i32, lease_seconds: i32) -> bool {
    let sleeper = sleeper(number);
    match state_of(sleeper.state.load(SeqCst)) {
        AWAKE => {
            sleeper.worker_procno.store(my_procno_plus_one(), SeqCst);
            sleeper.database.store(unsafe { pg_sys::MyDatabaseId }.into(), SeqCst);
            sleeper.lease_seconds.store(lease_seconds, SeqCst);
            let _ = sleeper.state.compare_exchange(AWAKE, ASLEEP, SeqCst, SeqCst);
            true
        }
        HANDED => false,
        // Left from a wait an error ended: the next `wake_up` settles it.
        _ => true,
    }
}

/// How long a waking worker waits for an enqueue that is committing to hand its job over (its
/// commit is under way: its WAL flush). Past it, the worker goes on, and takes the job at a
/// later poll (its enqueuer sets the worker's latch once it is handed).
const COMMIT_WAIT: Duration = Duration::from_millis(50);

/// Worker `number` is awake (woken, or about to poll): no enqueue may lease it a job from here
/// on. Returns the job one handed it, if any. A reservation not yet committing is cancelled
/// (its enqueuer makes the job available again before it commits); one committing is waited
/// for a moment (`COMMIT_WAIT`). Called at the top of each poll, so that a wait an error ended
/// leaves nothing behind.
pub fn wake_up(number: i32) -> Option<HandedJob> {
    let sleeper = sleeper(number);
    let waiting_since = Instant::now();
    loop {
        let current = sleeper.state.load(SeqCst);
        match state_of(current) {
            AWAKE => return None,
            COMMITTING | PUBLISHING if waiting_since.elapsed() < COMMIT_WAIT => {
                sleep_on_latch(Duration::from_millis(1));
            }
            COMMITTING | PUBLISHING => return None,
            HANDED => {
                let handed = HandedJob {
                    enqueued_by: load_role(&sleeper.enqueued_by),
                    job: (sleeper.job_id.load(SeqCst), load_token(&sleeper.lease_token)),
                    leased_at: instant_of(sleeper.leased_at.load(SeqCst)),
                };
                let commit_end = sleeper.commit_end.load(SeqCst);
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    // An enqueue that committed without waiting for its flush: its WAL reaches
                    // the disk before the handler starts, as a claim's reaches the operating
                    // system, so that a crash in the handler cannot undo the job and its attempt.
                    unsafe { pg_sys::XLogFlush(commit_end) };
                    return Some(handed);
                }
            }
            // Asleep, or reserved: the enqueuer finds the reservation gone at its pre-commit.
            _ => {
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    return None;
                }
            }
        }
    }
}

/// What this backend's transaction reserved: the worker, and the job it leased to it once the
/// INSERT made one.
struct Reservation {
    number: i32,
    /// The innermost subtransaction the INSERT's effects belong to.
    subtransaction: pg_sys::SubTransactionId,
    lease_seconds: i32,
    leased: Option<LeasedJob>,
    /// The transaction did something after the INSERT that the worker's claim would have to
    /// see (another enqueue, a queue paused or limited, a handler unregistered, the job
    /// cancelled): the job is made available at pre-commit.
    withdrawn: bool,
}

struct LeasedJob {
    job: (i64, Uuid),
    enqueued_by: String,
    leased_at: pg_sys::TimestampTz,
    inserted: Instant,
}

thread_local! {
    static RESERVATION: RefCell<Option<Reservation>> = const { RefCell::new(None) };
    /// Whether this transaction enqueued a job already: only its first enqueue may lease.
    static ENQUEUED_IN_TRANSACTION: Cell<bool> = const { Cell::new(false) };
    static CALLBACKS_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// What an enqueue needs to lease its job to the worker it reserved.
pub struct Lease {
    pub worker_id: String,
    pub lease_token: Uuid,
    pub lease_seconds: i32,
}

/// Called right before each enqueue's INSERT of one job: reserves a sleeping worker of this
/// database for it when the job is the transaction's first, the schema is this library's
/// version (`at_library_version`: what the workers run) and this session may hand jobs over
/// (see the module's comment). The caller inserts the job leased as the result says, then tells
/// `leased` or `not_leased`; the reservation ends with the (sub)transaction in any case. A job
/// leased before in this transaction is withdrawn: the worker is to claim the transaction's
/// jobs together, in claim order, as it would have without the lease.
pub fn lease_for_next_insert(at_library_version: bool) -> Option<Lease> {
    if !first_enqueue_of_transaction()
        || !at_library_version
        || !settings::DIRECT_LEASES.get()
        || unsafe { pg_sys::IsBackgroundWorker }
        // A transaction snapshot would judge the job by queue controls and handlers as they were
        // when it started.
        || unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32
        || settings::synchronous_standbys_configured()
    {
        return None;
    }
    let me = my_procno_plus_one();
    for number in 1..=settings::WORKER_COUNT.get().min(WORKER_COUNT_LIMIT) {
        let sleeper = sleeper(number);
        if sleeper.state.compare_exchange(ASLEEP, word(RESERVED, me), SeqCst, SeqCst).is_err() {
            continue;
        }
        // Stable while reserved: the worker writes them only while awake.
        if sleeper.database.load(SeqCst) != u32::from(unsafe { pg_sys::MyDatabaseId }) {
            let _ = sleeper.state.compare_exchange(word(RESERVED, me), ASLEEP, SeqCst, SeqCst);
            continue;
        }
        let lease_seconds = sleeper.lease_seconds.load(SeqCst);
        RESERVATION.with(|reservation| {
            *reservation.borrow_mut() = Some(Reservation {
                number,
                subtransaction: unsafe { pg_sys::GetCurrentSubTransactionId() },
                lease_seconds,
                leased: None,
                withdrawn: false,
            })
        });
        return Some(Lease {
            worker_id: format!("durable_jobs-worker-{number}"),
            lease_token: crate::randomness::new_uuid(),
            lease_seconds,
        });
    }
    None
}

/// The transaction inserts jobs other than through `lease_for_next_insert` (several at once):
/// a job leased before is withdrawn, and none after is leased.
pub fn jobs_inserted() {
    first_enqueue_of_transaction();
}

/// Whether this is the transaction's first enqueue; a job leased before is withdrawn. False
/// without workers (no shared memory).
fn first_enqueue_of_transaction() -> bool {
    withdraw();
    if !SHARED_MEMORY.load(SeqCst) {
        return false;
    }
    // The flag is cleared at the end of the transaction.
    register_callbacks();
    !ENQUEUED_IN_TRANSACTION.replace(true)
}

/// The reserved worker's job: inserted leased to it with `lease`, by `enqueued_by`;
/// `leased_at` and `inserted` taken before the INSERT (no later than its lease's start).
pub fn leased(
    job_id: i64,
    lease: &Lease,
    enqueued_by: &str,
    leased_at: pg_sys::TimestampTz,
    inserted: Instant,
) {
    RESERVATION.with(|reservation| {
        if let Some(reservation) = reservation.borrow_mut().as_mut() {
            reservation.leased = Some(LeasedJob {
                job: (job_id, lease.lease_token),
                enqueued_by: enqueued_by.to_owned(),
                leased_at,
                inserted,
            });
        }
    });
}

/// The INSERT made an available job (not leased: see the module's comment) or none (an
/// idempotency key's conflict): the worker sleeps on, free for another enqueue.
pub fn not_leased() {
    if let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) {
        release(&reservation);
    }
}

/// The current transaction changed what the worker's claim checks (a queue paused or limited,
/// a handler unregistered, a job cancelled), or enqueues another job: a job it leased is made
/// available at pre-commit, to be claimed, or not, as the claim then decides.
pub fn withdraw() {
    RESERVATION.with(|reservation| {
        if let Some(reservation) = reservation.borrow_mut().as_mut() {
            reservation.withdrawn |= reservation.leased.is_some();
        }
    });
}

/// Ends a reservation the worker has not cancelled: it sleeps on.
fn release(reservation: &Reservation) {
    let me = my_procno_plus_one();
    let _ = sleeper(reservation.number).state.compare_exchange(word(RESERVED, me), ASLEEP, SeqCst, SeqCst);
}

/// Once per session: the transaction callbacks below, which do nothing in a transaction that
/// leased no job. (pgrx's own keeps its hooks past a PREPARE, to run in the next transaction.)
fn register_callbacks() {
    if CALLBACKS_REGISTERED.replace(true) {
        return;
    }
    unsafe {
        pg_sys::RegisterXactCallback(Some(transaction_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(subtransaction_event), std::ptr::null_mut());
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn transaction_event(
    event: pg_sys::XactEvent::Type,
    _argument: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT => before_commit(),
        XACT_EVENT_PRE_PREPARE => before_prepare(),
        XACT_EVENT_COMMIT => {
            hand_over();
            forget();
        }
        XACT_EVENT_ABORT | XACT_EVENT_PREPARE => forget(),
        _ => {}
    }
}

/// A subtransaction committed into its parent, or rolled back: a rolled-back INSERT took its
/// job with it, and the reservation ends.
#[pg_guard]
unsafe extern "C-unwind" fn subtransaction_event(
    event: pg_sys::SubXactEvent::Type,
    subtransaction: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _argument: *mut std::ffi::c_void,
) {
    let rolled_back = match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => false,
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => true,
        _ => return,
    };
    let ended = RESERVATION.with(|reservation| {
        let mut reservation = reservation.borrow_mut();
        match reservation.as_mut() {
            Some(held) if held.subtransaction == subtransaction && !rolled_back => {
                held.subtransaction = parent;
                None
            }
            Some(held) if held.subtransaction == subtransaction => reservation.take(),
            _ => None,
        }
    });
    if let Some(reservation) = ended {
        release(&reservation);
    }
}

/// How long after its INSERT a leased job may still be handed over: a longer transaction makes
/// it available instead, so that no lease commits with less than three quarters of it left.
fn handover_deadline(lease_seconds: i32) -> Duration {
    (Duration::from_secs(u64::try_from(lease_seconds.max(1)).unwrap_or(1)) / 4).min(Duration::from_secs(1))
}

/// Pre-commit: the job is handed over when the worker still waits for it, the transaction was
/// quick and withdrew nothing; otherwise it is made available again here, before anyone can see
/// it.
fn before_commit() {
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let Some(leased) = reservation.leased.as_ref() else {
        return release(&reservation);
    };
    let me = my_procno_plus_one();
    let state = &sleeper(reservation.number).state;
    if !reservation.withdrawn
        && !settings::synchronous_standbys_configured()
        && leased.inserted.elapsed() < handover_deadline(reservation.lease_seconds)
        && state.compare_exchange(word(RESERVED, me), word(COMMITTING, me), SeqCst, SeqCst).is_ok()
    {
        RESERVATION.with(|kept| *kept.borrow_mut() = Some(reservation));
        return;
    }
    release(&reservation);
    make_available(leased.job);
}

/// A prepared transaction commits later, maybe from another session: its job is made available.
fn before_prepare() {
    if let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) {
        release(&reservation);
        if let Some(leased) = reservation.leased {
            make_available(leased.job);
        }
    }
}

/// At commit, once the job is visible: it goes to the worker, whose latch is set.
fn hand_over() {
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let Some(leased) = reservation.leased else {
        return;
    };
    let me = my_procno_plus_one();
    let sleeper = sleeper(reservation.number);
    if sleeper.state.compare_exchange(word(COMMITTING, me), word(PUBLISHING, me), SeqCst, SeqCst).is_err() {
        return;
    }
    sleeper.job_id.store(leased.job.0, SeqCst);
    store_token(&sleeper.lease_token, leased.job.1);
    store_role(&sleeper.enqueued_by, &leased.enqueued_by);
    sleeper.leased_at.store(leased.leased_at, SeqCst);
    sleeper.commit_end.store(unsafe { pg_sys::XactLastCommitEnd }, SeqCst);
    if sleeper.state.compare_exchange(word(PUBLISHING, me), HANDED, SeqCst, SeqCst).is_ok() {
        set_latch_of(sleeper.worker_procno.load(SeqCst));
    }
}

/// At the end of every transaction: a reservation still held (an abort, also one after the
/// pre-commit) ends, and a worker waiting for the commit is told.
fn forget() {
    ENQUEUED_IN_TRANSACTION.set(false);
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let me = my_procno_plus_one();
    let sleeper = sleeper(reservation.number);
    release(&reservation);
    if sleeper.state.compare_exchange(word(COMMITTING, me), ASLEEP, SeqCst, SeqCst).is_ok() {
        set_latch_of(sleeper.worker_procno.load(SeqCst));
    }
}

// The job as an enqueue without a sleeping worker would have inserted it, its state_version
// moved on. Fenced on its token: the same transaction may have cancelled it meanwhile.
// Operators qualified: the caller's search_path is back in force at commit.
const MAKE_AVAILABLE: &str = "
    UPDATE durable_jobs.durable_job
    SET job_state = 'available', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        attempt_count = 0, state_version = state_version OPERATOR(pg_catalog.+) 1,
        updated_at = pg_catalog.clock_timestamp()
    WHERE job_id OPERATOR(pg_catalog.=) $1 AND lease_token OPERATOR(pg_catalog.=) $2
    RETURNING job_id";

/// In a pre-commit callback: as the extension owner, under our search_path, with a snapshot of
/// its own (no statement's is active), and past a `SET TRANSACTION READ ONLY` that came after
/// the INSERT (this undoes the transaction's own write). An error unwinds all of it and aborts
/// the transaction.
fn make_available((job_id, lease_token): (i64, Uuid)) {
    unsafe {
        let read_only = pg_sys::XactReadOnly;
        pg_sys::XactReadOnly = false;
        let level = pg_sys::NewGUCNestLevel();
        set_at_this_level(c"search_path", c"pg_catalog, pg_temp");
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        as_extension_owner(|| {
            Spi::connect_mut(|client| {
                plans::execute(client, MAKE_AVAILABLE, &[job_id.into(), lease_token.into()]);
            })
        });
        pg_sys::PopActiveSnapshot();
        pg_sys::AtEOXact_GUC(true, level);
        pg_sys::XactReadOnly = read_only;
    }
}

/// A TimestampTz of this machine's clock as an `Instant`.
fn instant_of(at: pg_sys::TimestampTz) -> Instant {
    let age_us = unsafe { pg_sys::GetCurrentTimestamp() }.saturating_sub(at).max(0);
    Instant::now().checked_sub(Duration::from_micros(age_us as u64)).unwrap_or_else(Instant::now)
}
