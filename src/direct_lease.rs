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
use crate::privilege::as_extension_owner;
use crate::runner::{load_role, load_token, store_role, store_token, ROLE_WORDS};
use crate::settings::{self, WORKER_COUNT_LIMIT};
use crate::wakeup::{at_commit_or_forget, my_procno_plus_one, set_latch_of, sleep_on_latch};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, PgSubXactCallbackEvent, PgXactCallbackEvent, Uuid};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

// A worker's word: the state in the low three bits, the reserving backend (`pgprocno + 1`)
// above them.
const AWAKE: u64 = 0;
const ASLEEP: u64 = 1;
const RESERVED: u64 = 2;
const COMMITTING: u64 = 3;
const HANDED: u64 = 4;
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
    // Written by the enqueuer while committing, read by the worker once handed.
    job_id: AtomicI64,
    lease_token: [AtomicU64; 2],
    enqueued_by: [AtomicU64; ROLE_WORDS],
    leased_at: AtomicI64,
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
/// until it wakes (`wake_up`). Its lease length is the one the worker's claims use.
pub fn fall_asleep(number: i32, lease_seconds: i32) {
    let sleeper = sleeper(number);
    // Anything else is left from a wait an error ended; the next `wake_up` settles it.
    if sleeper.state.load(SeqCst) != AWAKE {
        return;
    }
    sleeper.worker_procno.store(my_procno_plus_one(), SeqCst);
    sleeper.database.store(unsafe { pg_sys::MyDatabaseId }.into(), SeqCst);
    sleeper.lease_seconds.store(lease_seconds, SeqCst);
    let _ = sleeper.state.compare_exchange(AWAKE, ASLEEP, SeqCst, SeqCst);
}

/// Worker `number` is awake (woken, or about to poll): no enqueue may lease it a job from here
/// on. Returns the job one handed it, if any; a reservation not yet committing is cancelled
/// (its enqueuer makes the job available again), and one committing is waited for: its commit
/// is under way (its WAL flush), and it hands the job over or aborts. Called at the top of each
/// poll too, so that a wait an error ended leaves nothing behind.
pub fn wake_up(number: i32) -> Option<HandedJob> {
    let sleeper = sleeper(number);
    let mut waiting_since: Option<Instant> = None;
    loop {
        let current = sleeper.state.load(SeqCst);
        match state_of(current) {
            AWAKE => return None,
            COMMITTING => {
                let since = *waiting_since.get_or_insert_with(Instant::now);
                // A commit stuck this long (a hung disk) costs the job its lease: it is claimed
                // again once the lease lapses, as a claimed job whose worker stopped.
                let patience = Duration::from_secs(sleeper.lease_seconds.load(SeqCst).max(1) as u64) / 4;
                if since.elapsed() < patience {
                    sleep_on_latch(Duration::from_millis(10));
                    continue;
                }
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    log!("durable_jobs worker {number}: an enqueue's commit took longer than a quarter of a lease to hand its job over; the job is claimed again when its lease lapses");
                    return None;
                }
            }
            HANDED => {
                let handed = HandedJob {
                    enqueued_by: load_role(&sleeper.enqueued_by),
                    job: (sleeper.job_id.load(SeqCst), load_token(&sleeper.lease_token)),
                    leased_at: instant_of(sleeper.leased_at.load(SeqCst)),
                };
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
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
    /// The transaction enqueued other jobs after it: the worker is to claim them all together.
    followed: bool,
}

struct LeasedJob {
    job: (i64, Uuid),
    enqueued_by: String,
    leased_at: pg_sys::TimestampTz,
    inserted: Instant,
}

thread_local! {
    static RESERVATION: RefCell<Option<Reservation>> = const { RefCell::new(None) };
    /// Whether this transaction reserved a worker already (one per transaction).
    static RESERVED_IN_TRANSACTION: Cell<bool> = const { Cell::new(false) };
}

/// What an enqueue needs to lease its job to the worker it reserved.
pub struct Lease {
    pub worker_id: String,
    pub lease_token: Uuid,
    pub lease_seconds: i32,
}

/// Reserves a sleeping worker of this database for the job the caller is about to insert, unless
/// this transaction did already, or this session must not hand jobs over (see the module's
/// comment). The caller inserts the job leased as the result says, then tells `leased` or
/// `not_leased`; the reservation ends with the (sub)transaction in any case.
pub fn reserve_sleeping_worker() -> Option<Lease> {
    if !SHARED_MEMORY.load(SeqCst)
        || !settings::DIRECT_LEASES.get()
        || unsafe { pg_sys::IsBackgroundWorker }
        || RESERVED_IN_TRANSACTION.get()
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
        RESERVED_IN_TRANSACTION.set(true);
        RESERVATION.with(|reservation| {
            *reservation.borrow_mut() = Some(Reservation {
                number,
                subtransaction: unsafe { pg_sys::GetCurrentSubTransactionId() },
                lease_seconds,
                leased: None,
                followed: false,
            })
        });
        register_callbacks();
        return Some(Lease {
            worker_id: format!("durable_jobs-worker-{number}"),
            lease_token: crate::randomness::new_uuid(),
            lease_seconds,
        });
    }
    None
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

/// The transaction is about to insert another job: one leased before it is made available at
/// commit, so that the worker claims them in one batch, in claim order, as it would have
/// without the lease (a batch split in two costs the worker a transaction).
pub fn another_job_follows() {
    RESERVATION.with(|reservation| {
        if let Some(reservation) = reservation.borrow_mut().as_mut() {
            reservation.followed = reservation.leased.is_some();
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

/// Ends a reservation the worker has not cancelled: it sleeps on.
fn release(reservation: &Reservation) {
    let me = my_procno_plus_one();
    let _ = sleeper(reservation.number).state.compare_exchange(word(RESERVED, me), ASLEEP, SeqCst, SeqCst);
}

fn register_callbacks() {
    pgrx::register_xact_callback(PgXactCallbackEvent::PreCommit, before_commit);
    pgrx::register_xact_callback(PgXactCallbackEvent::PrePrepare, before_prepare);
    at_commit_or_forget(hand_over, forget);
    // pgrx keeps these until the transaction commits or aborts.
    pgrx::register_subxact_callback(PgSubXactCallbackEvent::AbortSub, |subtransaction, _| {
        subtransaction_ended(subtransaction, None)
    });
    pgrx::register_subxact_callback(PgSubXactCallbackEvent::CommitSub, |subtransaction, parent| {
        subtransaction_ended(subtransaction, Some(parent))
    });
}

/// A subtransaction committed into `parent`, or rolled back (None): a rolled-back INSERT took
/// its job with it, and the reservation ends.
fn subtransaction_ended(subtransaction: pg_sys::SubTransactionId, parent: Option<pg_sys::SubTransactionId>) {
    let ended = RESERVATION.with(|reservation| {
        let mut reservation = reservation.borrow_mut();
        match (reservation.as_mut(), parent) {
            (Some(held), Some(parent)) if held.subtransaction == subtransaction => {
                held.subtransaction = parent;
                None
            }
            (Some(held), None) if held.subtransaction == subtransaction => reservation.take(),
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
    Duration::from_millis(u64::try_from(lease_seconds.max(1)).unwrap_or(1) * 1000 / 4)
        .min(Duration::from_secs(1))
}

/// Pre-commit: the job is handed over when the worker still waits for it, the transaction was
/// quick and enqueued nothing after it; otherwise it is made available again here, before
/// anyone can see it.
fn before_commit() {
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let Some(leased) = reservation.leased.as_ref() else {
        return release(&reservation);
    };
    let me = my_procno_plus_one();
    let state = &sleeper(reservation.number).state;
    if !reservation.followed
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
    let sleeper = sleeper(reservation.number);
    let committing = word(COMMITTING, my_procno_plus_one());
    if sleeper.state.load(SeqCst) != committing {
        return;
    }
    sleeper.job_id.store(leased.job.0, SeqCst);
    store_token(&sleeper.lease_token, leased.job.1);
    store_role(&sleeper.enqueued_by, &leased.enqueued_by);
    sleeper.leased_at.store(leased.leased_at, SeqCst);
    if sleeper.state.compare_exchange(committing, HANDED, SeqCst, SeqCst).is_ok() {
        set_latch_of(sleeper.worker_procno.load(SeqCst));
    }
}

/// At the end of any transaction that reserved: a reservation still held (an abort, also one
/// after the pre-commit) ends, and a worker waiting for the commit is told.
fn forget() {
    RESERVED_IN_TRANSACTION.set(false);
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

// The job as an enqueue without a sleeping worker would have inserted it. Fenced on its token:
// the same transaction may have cancelled it meanwhile.
const MAKE_AVAILABLE: &str = "
    UPDATE durable_jobs.durable_job
    SET job_state = 'available', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        attempt_count = 0, state_version = 1
    WHERE job_id = $1 AND lease_token = $2
    RETURNING job_id";

/// In a pre-commit callback, where no statement's snapshot is active (an error unwinds it).
fn make_available((job_id, lease_token): (i64, Uuid)) {
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    as_extension_owner(|| {
        Spi::connect_mut(|client| {
            plans::execute(client, MAKE_AVAILABLE, &[job_id.into(), lease_token.into()]);
        })
    });
    unsafe { pg_sys::PopActiveSnapshot() };
}

/// A TimestampTz of this machine's clock as an `Instant`.
fn instant_of(at: pg_sys::TimestampTz) -> Instant {
    let age_us = unsafe { pg_sys::GetCurrentTimestamp() }.saturating_sub(at).max(0);
    Instant::now().checked_sub(Duration::from_micros(age_us as u64)).unwrap_or_else(Instant::now)
}
