//! The worker counters in shared memory (idle polls, claimed, succeeded, ...), which the worker
//! and its runners add to after their transactions commit; `api::metrics` reports them.

use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Clone, Copy)]
pub enum Counter {
    IdlePolls,
    Claimed,
    Succeeded,
    Retried,
    Failed,
    Stale,
}

impl Counter {
    pub const ALL: [Counter; 6] = [
        Counter::IdlePolls,
        Counter::Claimed,
        Counter::Succeeded,
        Counter::Retried,
        Counter::Failed,
        Counter::Stale,
    ];

    pub fn help(self) -> &'static str {
        match self {
            Counter::IdlePolls => "Background worker polls that found no job.",
            Counter::Claimed => "Jobs the background workers claimed and ran or found lost (external workers' claims excluded; a job given back unrun counts when it runs).",
            Counter::Succeeded => {
                "Handler runs of the background workers that committed with their job's success \
                                   (external workers excluded)."
            }
            Counter::Retried => {
                "Handler failures in the background workers that sent the job back for another \
                                 attempt (external workers excluded)."
            }
            Counter::Failed => {
                "Handler failures in the background workers that ended the job (external workers \
                                excluded)."
            }
            Counter::Stale => {
                "Jobs the background workers claimed whose lease was lost before they finished them \
                               (external workers excluded)."
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
pub struct WorkerCounters([AtomicU64; 6]);

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
pub struct Tally([u64; 6]);

impl Tally {
    pub fn count(&mut self, counter: Counter) {
        self.0[counter as usize] += 1;
    }

    pub fn publish(&self) {
        for counter in Counter::ALL {
            add(counter, self.0[counter as usize]);
        }
    }
}

pub fn counter_value(counter: Counter) -> i64 {
    if SHARED_MEMORY.load(Ordering::Relaxed) {
        COUNTERS.get().0[counter as usize].load(Ordering::Relaxed) as i64
    } else {
        0
    }
}
