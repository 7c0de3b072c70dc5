//! Histograms of job attempts per queue, in shared memory: how long a job waited to be claimed
//! (from its `run_after` to its attempt's claim) and how long the attempt ran (from the claim to
//! its completion or failure), observed when the attempt completes or fails, by the background
//! workers and through the SQL API alike, once the transaction that ended it has committed
//! (`counters::Tally`). `QUEUE_SLOTS` queues, of any database, get histograms of their own, the
//! first ones seen since the server started; the others share one. A queue is its database's:
//! each database reads its own.

use crate::pg::shared_words::{load_name, store_name};
use pgrx::prelude::*;
use pgrx::{PGRXSharedMemory, PgAtomic};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Queues with histograms of their own (as many as get queue gauges).
pub const QUEUE_SLOTS: usize = 100;

/// Upper bounds of the buckets, in seconds; a last bucket takes the rest (`+Inf`).
pub const BUCKET_BOUNDS: [f64; 15] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
const BUCKETS: usize = BUCKET_BOUNDS.len() + 1;

/// Words of a queue's name: the longest a queue name may be (`arguments::NAME_MAX_LEN`).
const NAME_WORDS: usize = 16;

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_microseconds: AtomicU64,
}

impl Histogram {
    fn observe(&self, microseconds: i64) {
        let microseconds = microseconds.max(0) as u64;
        let seconds = microseconds as f64 / 1e6;
        let bucket = BUCKET_BOUNDS.iter().position(|bound| seconds <= *bound).unwrap_or(BUCKETS - 1);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_microseconds.fetch_add(microseconds, Ordering::Relaxed);
    }

    fn read(&self) -> HistogramValues {
        HistogramValues {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum_microseconds: self.sum_microseconds.load(Ordering::Relaxed),
        }
    }
}

/// A histogram as read: the count of each bucket (not cumulative) and the sum.
#[derive(Clone, Copy, Default)]
pub struct HistogramValues {
    pub buckets: [u64; BUCKETS],
    pub sum_microseconds: u64,
}

impl HistogramValues {
    fn add(&mut self, other: &HistogramValues) {
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine += theirs;
        }
        self.sum_microseconds += other.sum_microseconds;
    }
}

const EMPTY: u32 = 0;
const CLAIMING: u32 = 1;
const READY: u32 = 2;

#[derive(Default)]
struct QueueSlot {
    state: AtomicU32,
    database: AtomicU32,
    name: [AtomicU64; NAME_WORDS],
    wait: Histogram,
    run: Histogram,
}

/// The queues' slots, then the one the other queues share.
pub struct QueueHistograms([QueueSlot; QUEUE_SLOTS + 1]);

impl Default for QueueHistograms {
    fn default() -> Self {
        QueueHistograms(std::array::from_fn(|_| QueueSlot::default()))
    }
}

unsafe impl PGRXSharedMemory for QueueHistograms {}

static HISTOGRAMS: PgAtomic<QueueHistograms> = unsafe { PgAtomic::new(c"durable_jobs_queue_histograms") };

/// Set while preloading (inherited by forked backends); without it nothing is kept.
static SHARED_MEMORY: AtomicBool = AtomicBool::new(false);

pub fn init_shared_memory() {
    pgrx::pg_shmem_init!(HISTOGRAMS);
    SHARED_MEMORY.store(true, Ordering::Relaxed);
}

thread_local! {
    /// The slot of each queue this process has observed (a slot keeps its queue until restart;
    /// a process works in one database), forgotten when it grows past `SLOT_CACHE_LIMIT`.
    static SLOT_OF: RefCell<HashMap<String, usize>> = RefCell::new(HashMap::new());
}

const SLOT_CACHE_LIMIT: usize = 4 * QUEUE_SLOTS;

fn this_database() -> u32 {
    u32::from(unsafe { pg_sys::MyDatabaseId })
}

/// One attempt's wait and run time, in microseconds, in its queue.
pub struct Observation {
    pub queue: String,
    pub wait_microseconds: i64,
    pub run_microseconds: i64,
}

/// Adds an attempt to its queue's histograms.
pub fn observe(observation: &Observation) {
    if !SHARED_MEMORY.load(Ordering::Relaxed) {
        return;
    }
    let slot = &HISTOGRAMS.get().0[slot_of(&observation.queue)];
    slot.wait.observe(observation.wait_microseconds);
    slot.run.observe(observation.run_microseconds);
}

/// The slot that holds `queue`: one that names it, or a free one it takes, or the shared one.
/// Two processes may take a slot each for a new queue at once; `read_all` adds them up.
fn slot_of(queue: &str) -> usize {
    if let Some(slot) = SLOT_OF.with(|slots| slots.borrow().get(queue).copied()) {
        return slot;
    }
    let slots = &HISTOGRAMS.get().0[..QUEUE_SLOTS];
    let database = this_database();
    let named = |slot: &QueueSlot| {
        slot.state.load(Ordering::Acquire) == READY
            && slot.database.load(Ordering::Relaxed) == database
            && load_name(&slot.name) == queue
    };
    let found = slots.iter().position(named).or_else(|| {
        (queue.len() <= NAME_WORDS * 8)
            .then(|| {
                slots.iter().position(|slot| {
                    slot.state.compare_exchange(EMPTY, CLAIMING, Ordering::Acquire, Ordering::Relaxed).is_ok()
                        && {
                            slot.database.store(database, Ordering::Relaxed);
                            store_name(&slot.name, queue);
                            slot.state.store(READY, Ordering::Release);
                            true
                        }
                })
            })
            .flatten()
    });
    let slot = found.unwrap_or(QUEUE_SLOTS);
    SLOT_OF.with(|slots| {
        let mut slots = slots.borrow_mut();
        if slots.len() >= SLOT_CACHE_LIMIT {
            slots.clear();
        }
        slots.insert(queue.to_string(), slot);
    });
    slot
}

/// This database's queues' histograms (wait, run), by name, then those the other queues (of any
/// database) share.
pub fn read_all() -> (Vec<(String, HistogramValues, HistogramValues)>, HistogramValues, HistogramValues) {
    let mut queues: Vec<(String, HistogramValues, HistogramValues)> = Vec::new();
    if !SHARED_MEMORY.load(Ordering::Relaxed) {
        return (queues, HistogramValues::default(), HistogramValues::default());
    }
    let all = &HISTOGRAMS.get().0;
    let database = this_database();
    let ours = |slot: &&QueueSlot| {
        slot.state.load(Ordering::Acquire) == READY && slot.database.load(Ordering::Relaxed) == database
    };
    for slot in all[..QUEUE_SLOTS].iter().filter(ours) {
        let name = load_name(&slot.name);
        let (wait, run) = (slot.wait.read(), slot.run.read());
        match queues.iter_mut().find(|(queue, ..)| *queue == name) {
            Some((_, w, r)) => {
                w.add(&wait);
                r.add(&run);
            }
            None => queues.push((name, wait, run)),
        }
    }
    queues.sort_by(|a, b| a.0.cmp(&b.0));
    (queues, all[QUEUE_SLOTS].wait.read(), all[QUEUE_SLOTS].run.read())
}
