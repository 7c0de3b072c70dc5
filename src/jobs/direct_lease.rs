//! Direct leases: an enqueue that finds a worker asleep leases its job to that worker in its own
//! INSERT and hands the job over when it commits; the worker wakes and runs it without a claim
//! of its own. This is the enqueuing backend's side; the workers' words are in `sleepers`. (A
//! little over 400 lines: the reservation, its withdrawals and the hand-over at commit are one
//! protocol.)
//!
//! Waking with a reservation that is not committing yet cancels it: the enqueuer then makes its
//! job available again before it commits, as it does when its transaction ran on more than
//! 100 ms after the INSERT or did something the claim would have to judge. So a job is committed
//! leased to a worker only while that worker waits for it, and the worker runs it right after
//! the commit: what a claim guarantees (attempt counted before the handler starts, lease fenced,
//! running job visible) holds as for a claimed job. A commit that outlasts the worker's wait (a
//! second) gets its job given back once it is done. The enqueue leases only what the worker's
//! claim would take at once: a job of a kind with a handler serving its enqueuer, due, in a
//! queue neither paused nor limited, in the worker's database, from a READ COMMITTED transaction
//! of a session that is no background worker, with no synchronous standby to wait for; the
//! transaction's first job.

use crate::jobs::sleepers::{sleeper, word, ASLEEP, AWAKE, COMMITTING, HANDED, PUBLISHING, RESERVED};
use crate::pg::latch::{my_procno_plus_one, set_latch_of};
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_found, set_at_this_level};
use crate::pg::settings::{self, WORKER_COUNT_LIMIT};
use crate::pg::shared_words::{store_name, store_token};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

/// What this backend's transaction reserved: the worker, and the job it leased to it once the
/// INSERT made one.
struct Reservation {
    number: i32,
    /// The innermost subtransaction the INSERT's effects belong to.
    subtransaction: pg_sys::SubTransactionId,
    lease_seconds: i32,
    leased: Option<LeasedJob>,
    /// The transaction did something after the INSERT that the worker's claim would have to
    /// see (another enqueue, a queue's controls, a handler's registration, a cancel, DDL): the
    /// job is made available at pre-commit.
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
    /// Set from the transaction's pre-commit on: an enqueue after it (another extension's
    /// pre-commit work) leases nothing.
    static PAST_PRE_COMMIT: Cell<bool> = const { Cell::new(false) };
    /// The pre-commit made a leased job available: the workers are woken at commit, as for any
    /// enqueue (a leased job's enqueue wakes only its worker, by the hand-over).
    static WAKE_WORKERS_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
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
        || PAST_PRE_COMMIT.get()
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
            lease_token: crate::pg::randomness::new_uuid(),
            lease_seconds,
        });
    }
    None
}

/// The transaction inserts jobs other than through `lease_for_next_insert` (several at once, a
/// replay): a job leased before is withdrawn, and none after is leased.
pub fn jobs_inserted() {
    first_enqueue_of_transaction();
}

/// Whether this is the transaction's first enqueue; a job leased before is withdrawn. False
/// without workers (no shared memory).
fn first_enqueue_of_transaction() -> bool {
    withdraw();
    if !crate::jobs::wakeup::preloaded() {
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

/// The job this transaction leased to a sleeping worker at its enqueue, withdrawn or not: until
/// the commit, no one but this transaction sees it running, and no worker has started it.
pub fn leased_job() -> Option<i64> {
    RESERVATION.with(|reservation| {
        reservation.borrow().as_ref().and_then(|held| held.leased.as_ref().map(|leased| leased.job.0))
    })
}

/// Whether this transaction holds a job leased to a sleeping worker, to hand over at commit.
pub fn lease_pending() -> bool {
    RESERVATION.with(|reservation| {
        reservation.borrow().as_ref().is_some_and(|held| held.leased.is_some() && !held.withdrawn)
    })
}

/// The INSERT made an available job (not leased: see the module's comment) or none (an
/// idempotency key's conflict): the worker sleeps on, free for another enqueue.
pub fn not_leased() {
    if let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) {
        release(&reservation);
    }
}

/// The current transaction changed what the worker's claim checks (a queue's controls, a
/// handler's registration, a job cancelled, DDL), or enqueues another job: a job it leased is
/// made available at pre-commit, to be claimed, or not, as the claim then decides.
pub fn withdraw() {
    RESERVATION.with(|reservation| {
        if let Some(reservation) = reservation.borrow_mut().as_mut() {
            reservation.withdrawn |= reservation.leased.is_some();
        }
    });
}

/// A statement is about to run (the executor hook): one that writes the job, queue or handler
/// table itself (their owner's UPDATE of a queue's row, say, rather than a call of our
/// functions, which withdraw by themselves) after this transaction leased a job withdraws it, as
/// any change of what the claim judges does. Nothing to do, and nothing looked up, otherwise.
pub fn statement_starts(query_desc: *mut pg_sys::QueryDesc) {
    if !lease_pending() {
        return;
    }
    unsafe {
        let statement = (*query_desc).plannedstmt;
        let schema = pg_sys::get_namespace_oid(c"durable_jobs".as_ptr(), true);
        if statement.is_null() || schema == pg_sys::Oid::INVALID {
            return;
        }
        let tables = [c"durable_job", c"durable_job_queue", c"durable_job_handler"]
            .map(|name| pg_sys::get_relname_relid(name.as_ptr(), schema));
        let writes = (pg_sys::ACL_INSERT | pg_sys::ACL_UPDATE | pg_sys::ACL_DELETE) as pg_sys::AclMode;
        let rtable = pgrx::PgList::<pg_sys::RangeTblEntry>::from_pg((*statement).rtable);
        if rtable.iter_ptr().any(|entry| {
            (*entry).rtekind == pg_sys::RTEKind::RTE_RELATION
                && (*entry).requiredPerms & writes != 0
                && tables.contains(&(*entry).relid)
        }) {
            withdraw();
        }
    }
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
            if WAKE_WORKERS_AT_COMMIT.get() {
                crate::jobs::wakeup::wake_workers();
            }
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
/// it available instead. The INSERT judged the queue's controls and the kind's handler, which
/// other sessions may change before the commit (as they may between a claim and its handler):
/// this keeps that moment short, and every lease committed with nearly all of it left.
const HANDOVER_DEADLINE: Duration = Duration::from_millis(100);

/// Pre-commit: the job is handed over when the worker still waits for it, the transaction was
/// quick and withdrew nothing; otherwise it is made available again here, before anyone can see
/// it.
fn before_commit() {
    PAST_PRE_COMMIT.set(true);
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let Some(leased) = reservation.leased.as_ref() else {
        return release(&reservation);
    };
    let me = my_procno_plus_one();
    let sleeper = sleeper(reservation.number);
    if !reservation.withdrawn
        && !settings::synchronous_standbys_configured()
        && leased.inserted.elapsed() < HANDOVER_DEADLINE
        && sleeper.state.compare_exchange(word(RESERVED, me), word(PUBLISHING, me), SeqCst, SeqCst).is_ok()
    {
        // What a worker that stops waiting for this commit needs to give the job back.
        sleeper.job_id.store(leased.job.0, SeqCst);
        store_token(&sleeper.lease_token, leased.job.1);
        store_name(&sleeper.enqueued_by, &leased.enqueued_by);
        sleeper.leased_at.store(leased.leased_at, SeqCst);
        sleeper.lease_seconds_leased.store(reservation.lease_seconds, SeqCst);
        sleeper.transaction.store(unsafe { pg_sys::GetTopTransactionIdIfAny() }.into(), SeqCst);
        sleeper.state.store(word(COMMITTING, me), SeqCst);
        RESERVATION.with(|kept| *kept.borrow_mut() = Some(reservation));
        return;
    }
    release(&reservation);
    WAKE_WORKERS_AT_COMMIT.set(true);
    make_available(leased.job);
}

/// A prepared transaction commits later, maybe from another session: its job is made available.
fn before_prepare() {
    PAST_PRE_COMMIT.set(true);
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
    let me = my_procno_plus_one();
    let sleeper = sleeper(reservation.number);
    if reservation.leased.is_none() {
        return release(&reservation);
    }
    if sleeper.state.compare_exchange(word(COMMITTING, me), word(PUBLISHING, me), SeqCst, SeqCst).is_err() {
        // The worker stopped waiting for this commit (`Handed::Late`): woken, it gives the job
        // back to the queue now that the commit is done.
        return crate::jobs::wakeup::wake_workers();
    }
    sleeper.commit_end.store(unsafe { pg_sys::XactLastCommitEnd }, SeqCst);
    if sleeper.state.compare_exchange(word(PUBLISHING, me), HANDED, SeqCst, SeqCst).is_ok() {
        set_latch_of(sleeper.worker_procno.load(SeqCst));
    }
}

/// At the end of every transaction: a reservation still held (an abort, also one after the
/// pre-commit) ends, and a worker waiting for the commit is told.
fn forget() {
    ENQUEUED_IN_TRANSACTION.set(false);
    PAST_PRE_COMMIT.set(false);
    WAKE_WORKERS_AT_COMMIT.set(false);
    let Some(reservation) = RESERVATION.with(|reservation| reservation.borrow_mut().take()) else {
        return;
    };
    let me = my_procno_plus_one();
    let sleeper = sleeper(reservation.number);
    release(&reservation);
    // Awake, not asleep: the worker may be waiting for this commit, or asleep; woken, it polls
    // and sleeps again.
    if sleeper.state.compare_exchange(word(COMMITTING, me), AWAKE, SeqCst, SeqCst).is_ok() {
        set_latch_of(sleeper.worker_procno.load(SeqCst));
    }
}

// The job as an enqueue without a sleeping worker would have inserted it, its state_version
// moved on (`$state_version`: none on a schema from before the status API, which an ALTER
// EXTENSION UPDATE TO later in the same transaction can leave). Fenced on its token: the same
// transaction may have cancelled it meanwhile. Operators qualified: the caller's search_path is
// back in force at commit.
macro_rules! make_available {
    ($state_version:literal, $attempt:literal) => {
        concat!(
            "
    UPDATE durable_jobs.durable_job
    SET job_state = 'available', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        attempt_count = 0, ",
            $state_version,
            $attempt,
            "updated_at = pg_catalog.clock_timestamp()
    WHERE job_id OPERATOR(pg_catalog.=) $1 AND lease_token OPERATOR(pg_catalog.=) $2
    RETURNING job_id"
        )
    };
}
const MAKE_AVAILABLE: &str = make_available!(
    "state_version = state_version OPERATOR(pg_catalog.+) 1, ",
    "attempt_started_at = NULL, attempt_worker_id = NULL, "
);
const MAKE_AVAILABLE_WITHOUT_HISTORY: &str =
    make_available!("state_version = state_version OPERATOR(pg_catalog.+) 1, ", "");
const MAKE_AVAILABLE_ON_OLD_SCHEMA: &str = make_available!("", "");

/// In a pre-commit callback: as the extension owner, under our search_path, with a snapshot of
/// its own (no statement's is active), and past a `SET TRANSACTION READ ONLY` that came after
/// the INSERT (this undoes the transaction's own write). An error unwinds all of it (the cancel
/// hold-off too: an abort resets it) and aborts the transaction.
fn make_available((job_id, lease_token): (i64, Uuid)) {
    // A cancel (or statement_timeout) arriving now would fail the COMMIT for our sake.
    unsafe { pg_sys::QueryCancelHoldoffCount += 1 };
    // Dropped in this transaction, with its jobs.
    let Some(installed) = crate::pg::privilege::installed_row() else {
        unsafe { pg_sys::QueryCancelHoldoffCount -= 1 };
        return;
    };
    unsafe {
        let read_only = pg_sys::XactReadOnly;
        pg_sys::XactReadOnly = false;
        let level = pg_sys::NewGUCNestLevel();
        set_at_this_level(c"search_path", c"pg_catalog, pg_temp");
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        as_extension_owner_found(&installed, |installed| {
            let statement = match (installed.has_attempt_history, installed.has_status_api) {
                (true, _) => MAKE_AVAILABLE,
                (false, true) => MAKE_AVAILABLE_WITHOUT_HISTORY,
                (false, false) => MAKE_AVAILABLE_ON_OLD_SCHEMA,
            };
            Spi::connect_mut(|client| {
                plans::execute(client, statement, &[job_id.into(), lease_token.into()]);
            })
        });
        pg_sys::PopActiveSnapshot();
        pg_sys::AtEOXact_GUC(true, level);
        pg_sys::XactReadOnly = read_only;
        pg_sys::QueryCancelHoldoffCount -= 1;
    }
}
