//! The workers' side of direct leases (see `direct_lease`): each worker's word in shared memory,
//! which it marks asleep right before it sleeps and awake when it wakes, and from which it takes
//! a job an enqueue handed over. The word's states: awake; asleep; reserved by an enqueuing
//! backend (whose transaction inserts, or inserted, a job leased to that worker); committing
//! (that backend's transaction passed its pre-commit, published the job there, and will hand it
//! over or abort); publishing (a few stores under way); handed (the job is there to take).

use crate::pg::latch::{my_procno_plus_one, sleep_on_latch};
use crate::pg::settings::WORKER_COUNT_LIMIT;
use crate::pg::shared_words::{load_name, load_token, ROLE_WORDS};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic, Uuid};
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

// A worker's word: the state in the low three bits, the reserving backend (`pgprocno + 1`)
// above them. Only the reserving backend moves the word out of committing and publishing.
pub(super) const AWAKE: u64 = 0;
pub(super) const ASLEEP: u64 = 1;
pub(super) const RESERVED: u64 = 2;
pub(super) const COMMITTING: u64 = 3;
/// The enqueuer writes the job's fields (at its pre-commit, then its commit's end at commit).
pub(super) const PUBLISHING: u64 = 4;
pub(super) const HANDED: u64 = 5;
pub(super) const STATE_BITS: u64 = 3;

pub(super) fn word(state: u64, procno_plus_one: i32) -> u64 {
    state | (procno_plus_one as u64) << STATE_BITS
}

pub(super) fn state_of(word: u64) -> u64 {
    word & ((1 << STATE_BITS) - 1)
}

pub struct Sleeper {
    pub(super) state: AtomicU64,
    /// The worker's latch, set at its start (`reset`).
    pub(super) worker_procno: AtomicI32,
    // Written by the worker while awake, read by the enqueuer that reserved it.
    pub(super) database: AtomicU32,
    pub(super) lease_seconds: AtomicI32,
    // Written by the enqueuer while publishing, read by the worker once committing or handed.
    pub(super) job_id: AtomicI64,
    pub(super) lease_token: [AtomicU64; 2],
    pub(super) enqueued_by: [AtomicU64; ROLE_WORDS],
    pub(super) leased_at: AtomicI64,
    pub(super) lease_seconds_leased: AtomicI32,
    /// The enqueuing transaction.
    pub(super) transaction: AtomicU32,
    pub(super) commit_end: AtomicU64,
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
            lease_seconds_leased: AtomicI32::new(0),
            transaction: AtomicU32::new(0),
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

pub(super) static SLEEPERS: PgAtomic<Sleepers> = unsafe { PgAtomic::new(c"durable_jobs_sleepers") };

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(SLEEPERS);
}

pub(super) fn sleeper(number: i32) -> &'static Sleeper {
    &SLEEPERS.get().0[(number - 1) as usize]
}

/// Called by worker `number` (1-based) once it runs, before `wakeup::publish_worker`: `reset`
/// now and when it exits (after its wake-up slot is cleared).
pub fn publish_worker(number: i32) {
    reset(number, true);
    unsafe extern "C-unwind" fn reset_at_exit(_code: std::ffi::c_int, number: pg_sys::Datum) {
        reset(number.value() as i32, false);
    }
    unsafe { pg_sys::on_shmem_exit(Some(reset_at_exit), pg_sys::Datum::from(number)) };
}

/// Worker `number` starts, or exits: it is awake to enqueues, and a reservation of it ends (its
/// enqueuer makes the job available again). A hand-over under way or done is left for the
/// worker's next start (the same worker id holds the lease), whose first poll takes it; at
/// start, enqueues set the latch of this process from here on.
pub(super) fn reset(number: i32, starting: bool) {
    let sleeper = sleeper(number);
    if starting {
        sleeper.worker_procno.store(my_procno_plus_one(), SeqCst);
    }
    for reserved_or_asleep in [ASLEEP, RESERVED] {
        let current = sleeper.state.load(SeqCst);
        if state_of(current) == reserved_or_asleep {
            let _ = sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst);
        }
    }
}

/// A job an enqueue handed to this worker: (enqueuer, (job, lease token)), when its lease
/// started, and for how long.
pub struct HandedJob {
    pub enqueued_by: String,
    pub job: (i64, Uuid),
    pub leased_at: Instant,
    pub lease_seconds: i32,
    /// The end of the enqueue's commit record in the WAL.
    pub commit_end: pg_sys::XLogRecPtr,
}

/// What a worker that waits for an enqueue's commit can find.
pub enum Handed {
    Nothing,
    Job(HandedJob),
    /// The enqueue's commit outlasted `COMMIT_WAIT`: its job, leased to this worker, and its
    /// transaction; the worker gives the job back once that transaction committed
    /// (`transaction_ended`).
    Late((i64, Uuid), pg_sys::TransactionId),
}

/// Worker `number`, whose claim found nothing, is about to sleep: enqueues may lease it a job
/// until it wakes (`wake_up`). Its lease length is the one the worker's claims use. False when
/// a job was handed to it meanwhile: the poll that takes it is due.
pub fn fall_asleep(number: i32, lease_seconds: i32) -> bool {
    let sleeper = sleeper(number);
    match state_of(sleeper.state.load(SeqCst)) {
        AWAKE => {
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

/// How long a waking worker waits for an enqueue that is committing (its WAL flush, normally)
/// to hand its job over. Past it, the worker goes on with other work, and gives that job back
/// to the queue once the enqueue committed (a remote commit of postgres_fdw held up, say: the
/// worker is not held with it).
pub(super) const COMMIT_WAIT: Duration = Duration::from_secs(1);

/// Worker `number` is awake (woken, or about to poll): no enqueue may lease it a job from here
/// on. Returns the job one handed it, if any. A reservation not yet committing is cancelled
/// (its enqueuer makes the job available again before it commits); one committing is waited for
/// up to `COMMIT_WAIT`. Called at the top of each poll, so that a wait an error (a cancel) ended
/// leaves nothing behind.
pub fn wake_up(number: i32) -> Handed {
    let sleeper = sleeper(number);
    let waiting_since = Instant::now();
    loop {
        let current = sleeper.state.load(SeqCst);
        match state_of(current) {
            AWAKE => return Handed::Nothing,
            COMMITTING if waiting_since.elapsed() >= COMMIT_WAIT => {
                let late = (sleeper.job_id.load(SeqCst), load_token(&sleeper.lease_token));
                let transaction = sleeper.transaction.load(SeqCst);
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    return Handed::Late(late, transaction.into());
                }
            }
            // The enqueuer sets the latch when it hands the job over or aborts; publishing
            // takes a few stores.
            COMMITTING | PUBLISHING => {
                sleep_on_latch(Duration::from_millis(10));
            }
            HANDED => {
                let handed = HandedJob {
                    enqueued_by: load_name(&sleeper.enqueued_by),
                    job: (sleeper.job_id.load(SeqCst), load_token(&sleeper.lease_token)),
                    leased_at: instant_of(sleeper.leased_at.load(SeqCst)),
                    lease_seconds: sleeper.lease_seconds_leased.load(SeqCst),
                    commit_end: sleeper.commit_end.load(SeqCst),
                };
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    return Handed::Job(handed);
                }
            }
            // Asleep, or reserved: the enqueuer finds the reservation gone at its pre-commit.
            _ => {
                if sleeper.state.compare_exchange(current, AWAKE, SeqCst, SeqCst).is_ok() {
                    return Handed::Nothing;
                }
            }
        }
    }
}

/// Worker `number`'s word as an enqueue leaves it at its pre-commit (another backend's, as far
/// as the word tells), for pg_tests of `wake_up`.
#[cfg(any(test, feature = "pg_test"))]
pub fn committing_for_test(number: i32, job: (i64, Uuid), transaction: pg_sys::TransactionId) {
    let sleeper = sleeper(number);
    sleeper.job_id.store(job.0, SeqCst);
    crate::pg::shared_words::store_token(&sleeper.lease_token, job.1);
    sleeper.transaction.store(transaction.into(), SeqCst);
    sleeper.state.store(word(COMMITTING, my_procno_plus_one() + 1), SeqCst);
}

/// None while `transaction` runs; once it ended, whether it committed.
pub fn transaction_ended(transaction: pg_sys::TransactionId) -> Option<bool> {
    unsafe {
        if pg_sys::TransactionIdIsInProgress(transaction) {
            None
        } else {
            Some(pg_sys::TransactionIdDidCommit(transaction))
        }
    }
}

/// A TimestampTz of this machine's clock as an `Instant`.
pub(super) fn instant_of(at: pg_sys::TimestampTz) -> Instant {
    let age_us = unsafe { pg_sys::GetCurrentTimestamp() }.saturating_sub(at).max(0);
    Instant::now().checked_sub(Duration::from_micros(age_us as u64)).unwrap_or_else(Instant::now)
}
