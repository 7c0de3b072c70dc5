//! The counters in shared memory (idle polls, claimed, succeeded, ...), which the background
//! workers and their runners add to after their transactions commit, and the SQL API's claims,
//! completions and failures when their caller's transaction commits; with the attempts' wait and
//! run times (`histograms`). `api::metrics` reports them.

use crate::jobs::histograms::{self, Observation};
use crate::pg::latch::at_commit_or_forget;
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Clone, Copy)]
pub enum Counter {
    IdlePolls,
    Claimed,
    Succeeded,
    Retried,
    Failed,
    Stale,
    SqlApiClaimed,
    SqlApiSucceeded,
    SqlApiRetried,
    SqlApiFailed,
    SqlApiStale,
}

/// How many counters there are.
const COUNTER_KINDS: usize = 11;

impl Counter {
    pub const ALL: [Counter; COUNTER_KINDS] = [
        Counter::IdlePolls,
        Counter::Claimed,
        Counter::Succeeded,
        Counter::Retried,
        Counter::Failed,
        Counter::Stale,
        Counter::SqlApiClaimed,
        Counter::SqlApiSucceeded,
        Counter::SqlApiRetried,
        Counter::SqlApiFailed,
        Counter::SqlApiStale,
    ];

    pub fn help(self) -> &'static str {
        match self {
            Counter::IdlePolls => "Background worker polls that found no job.",
            Counter::Claimed => {
                "Jobs claimed, by the background workers (counted when a batch runs them) and through \
                 claim_next_durable_job."
            }
            Counter::Succeeded => {
                "Attempts that completed their job, in the background workers (with their handler's \
                 writes) and through complete_durable_job."
            }
            Counter::Retried => "Attempts that failed and sent their job back for another attempt.",
            Counter::Failed => "Attempts that failed and ended their job.",
            Counter::Stale => "Completions and failures refused because the lease was lost before them.",
            Counter::SqlApiClaimed => "Of claimed: the claims of claim_next_durable_job.",
            Counter::SqlApiSucceeded => "Of succeeded: the completions of complete_durable_job.",
            Counter::SqlApiRetried => "Of retried: the failures of fail_durable_job that retried their job.",
            Counter::SqlApiFailed => "Of failed: the failures of fail_durable_job that ended their job.",
            Counter::SqlApiStale => {
                "Of stale: the calls of complete_durable_job and fail_durable_job told stale."
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Counter::IdlePolls => "idle_polls",
            Counter::Claimed => "claimed",
            Counter::Succeeded => "succeeded",
            Counter::Retried => "retried",
            Counter::Failed => "failed",
            Counter::Stale => "stale",
            Counter::SqlApiClaimed => "sql_api_claimed",
            Counter::SqlApiSucceeded => "sql_api_succeeded",
            Counter::SqlApiRetried => "sql_api_retried",
            Counter::SqlApiFailed => "sql_api_failed",
            Counter::SqlApiStale => "sql_api_stale",
        }
    }

    /// The SQL API's share of this counter, if it has one.
    fn sql_api_share(self) -> Option<Counter> {
        match self {
            Counter::Claimed => Some(Counter::SqlApiClaimed),
            Counter::Succeeded => Some(Counter::SqlApiSucceeded),
            Counter::Retried => Some(Counter::SqlApiRetried),
            Counter::Failed => Some(Counter::SqlApiFailed),
            Counter::Stale => Some(Counter::SqlApiStale),
            _ => None,
        }
    }

    /// The counter for what a fenced complete or fail answered.
    pub fn for_outcome(outcome: &str) -> Counter {
        match outcome {
            "succeeded" => Counter::Succeeded,
            "retried" => Counter::Retried,
            "failed" => Counter::Failed,
            _ => Counter::Stale,
        }
    }
}

#[derive(Default)]
pub struct WorkerCounters([AtomicU64; COUNTER_KINDS]);

unsafe impl PGRXSharedMemory for WorkerCounters {}

static COUNTERS: PgAtomic<WorkerCounters> = unsafe { PgAtomic::new(c"durable_jobs_worker_counters") };

/// Set in the postmaster while preloading and inherited by every backend it forks; without
/// preloading there is no shared memory and no worker, so the counters read zero.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(COUNTERS);
    SHARED_MEMORY.store(true, Ordering::Relaxed);
}

pub fn count(counter: Counter) {
    add(counter, 1);
}

fn add(counter: Counter, amount: u64) {
    if SHARED_MEMORY.load(Ordering::Relaxed) && amount > 0 {
        COUNTERS.get().0[counter as usize].fetch_add(amount, Ordering::Relaxed);
    }
}

/// Outcomes of a transaction's jobs, published only once it has committed, so that the
/// counters never count work that a failed commit rolled back.
#[derive(Default)]
pub struct Tally {
    counts: [u64; COUNTER_KINDS],
    observations: Vec<Observation>,
}

impl Tally {
    pub fn count(&mut self, counter: Counter) {
        self.counts[counter as usize] += 1;
    }

    /// An attempt that completed or failed, for the histograms.
    pub fn observe(&mut self, observation: Option<Observation>) {
        self.observations.extend(observation);
    }

    pub fn publish(&self) {
        for counter in Counter::ALL {
            add(counter, self.counts[counter as usize]);
        }
        self.observations.iter().for_each(histograms::observe);
    }
}

/// One SQL API call's count, with the subtransaction it was made in.
struct PendingCall {
    subtransaction: pg_sys::SubTransactionId,
    counter: Counter,
    observation: Option<Observation>,
}

thread_local! {
    /// What the SQL API's calls of the current transaction count once it commits.
    static AT_COMMIT: RefCell<Option<Vec<PendingCall>>> = const { RefCell::new(None) };
    static SUBTRANSACTION_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts `counter` and its SQL API share, and observes the attempt, when the current
/// transaction commits (never, if it rolls back or is prepared, or if the subtransaction the
/// call was made in rolls back: ROLLBACK TO SAVEPOINT, an exception block).
pub fn count_sql_api_call_at_commit(counter: Counter, observation: Option<Observation>) {
    if !SHARED_MEMORY.load(Ordering::Relaxed) {
        return;
    }
    if !SUBTRANSACTION_CALLBACK.replace(true) {
        unsafe { pg_sys::RegisterSubXactCallback(Some(subtransaction_event), std::ptr::null_mut()) };
    }
    let subtransaction = unsafe { pg_sys::GetCurrentSubTransactionId() };
    AT_COMMIT.with(|pending| {
        pending
            .borrow_mut()
            .get_or_insert_with(|| {
                at_commit_or_forget(publish_at_commit, forget_at_end);
                Vec::new()
            })
            .push(PendingCall { subtransaction, counter, observation });
    });
}

/// A subtransaction that rolls back takes the calls counted in it, and in the subtransactions
/// inside it, along: those have ids from its own on (ids only grow within a transaction, and no
/// later sibling has begun while it is open).
#[pg_guard]
unsafe extern "C-unwind" fn subtransaction_event(
    event: pg_sys::SubXactEvent::Type,
    subtransaction: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _argument: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        AT_COMMIT.with(|pending| {
            if let Some(calls) = pending.borrow_mut().as_mut() {
                calls.retain(|call| call.subtransaction < subtransaction);
            }
        });
    }
}

fn forget_at_end() {
    AT_COMMIT.with(|pending| pending.borrow_mut().take());
}

fn publish_at_commit() {
    let Some(calls) = AT_COMMIT.with(|pending| pending.borrow_mut().take()) else {
        return;
    };
    let mut tally = Tally::default();
    for call in calls {
        tally.count(call.counter);
        if let Some(share) = call.counter.sql_api_share() {
            tally.count(share);
        }
        tally.observe(call.observation);
    }
    tally.publish();
}

pub fn counter_value(counter: Counter) -> i64 {
    if SHARED_MEMORY.load(Ordering::Relaxed) {
        COUNTERS.get().0[counter as usize].load(Ordering::Relaxed) as i64
    } else {
        0
    }
}
