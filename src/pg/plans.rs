//! Our hot statements, prepared once per backend and kept (SPI_keepplan), so that a claim or a
//! completion does not parse and plan its SQL on every call. PostgreSQL's plan cache revalidates
//! kept plans after DDL, and checks privileges on every execution.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

thread_local! {
    static PLANS: RefCell<HashMap<String, Rc<OwnedPreparedStatement>, BuildHasherDefault<StatementHasher>>> =
        RefCell::new(HashMap::default());
}

/// Hashes a statement's length and a few words spread over its text. The map's default SipHash
/// read all of a claim's 4 KB on every call; two statements that hash alike are still told
/// apart by comparing their texts.
#[derive(Default)]
struct StatementHasher(u64);

impl Hasher for StatementHasher {
    fn write(&mut self, bytes: &[u8]) {
        const SAMPLES: usize = 16;
        let mut hash = self.0 ^ bytes.len() as u64;
        let word_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        if bytes.len() >= 8 {
            let step = (bytes.len() - 8) / SAMPLES + 1;
            // The last word too. Texts that hash alike (claims whose limits have as many digits)
            // are told apart by the map's comparison of the whole text.
            for at in (0..bytes.len() - 8).step_by(step).chain([bytes.len() - 8]) {
                hash = (hash.rotate_left(5) ^ word_at(at)).wrapping_mul(0x517c_c1b7_2722_0a95);
            }
        } else {
            for &byte in bytes {
                hash = (hash.rotate_left(5) ^ u64::from(byte)).wrapping_mul(0x517c_c1b7_2722_0a95);
            }
        }
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Executes `query` with `args`, preparing it on first use with the argument types of `args`
/// (every caller of one query passes the same types). It runs read-write (the kept plan is
/// prepared as mutating), but not through pgrx's `update`, which gives the transaction an xid
/// before the statement runs: a claim, prune or cancel that changes no row then needs no xid,
/// so an idle worker's polls write no commit record and wait for no WAL flush, and a read takes
/// none (a waiter would otherwise stand as a running transaction in every snapshot taken while
/// it sleeps). Each execution takes a fresh snapshot, as a read-write SPI statement does.
pub fn execute<'conn>(
    client: &mut SpiClient<'conn>,
    query: &str,
    args: &[DatumWithOid],
) -> SpiTupleTable<'conn> {
    let plan = kept(client, query, args);
    client.select(&*plan, None, args).expect(query)
}

/// `execute` under the kept generic plan, for a statement over arrays of a batch's jobs (see
/// `BATCH_PLANNER_SETTINGS`).
pub fn execute_generic<'conn>(
    client: &mut SpiClient<'conn>,
    query: &str,
    args: &[DatumWithOid],
) -> SpiTupleTable<'conn> {
    with_settings(BATCH_PLANNER_SETTINGS, || execute(client, query, args))
}

/// The planner settings of a statement over a batch's jobs. A generic plan: for a batch of one
/// its custom plan always looks cheaper than the generic one (the same plan, for an estimate of
/// ten jobs), so PostgreSQL planned it anew on every call (47 % of the worker's time at
/// claim_batch_size 1, once the table is large and analyzed). Each statement finds its jobs with
/// `job_id = ANY ($1)` and pairs them with their tokens in a hash join: planned while the job
/// table looked small (a new or truncated table, or one analyzed while it held a few jobs), a
/// kept plan otherwise read the whole table for every batch (first by a sequential scan, then
/// by the primary key with no condition) and went on doing so as the table grew, until the next
/// ANALYZE; and a nested loop over both arrays costs the square of the batch (12 % of the
/// worker's throughput at claim_batch_size 1000). The load reads the few handler registrations
/// whole into its hash. No JIT: a path left disabled would cost past `jit_above_cost`, as the
/// claim's did (see `CLAIM_PLANNER_SETTINGS`).
pub const BATCH_PLANNER_SETTINGS: &[(&std::ffi::CStr, &std::ffi::CStr)] = &[
    (c"plan_cache_mode", c"force_generic_plan"),
    (c"enable_seqscan", c"off"),
    (c"enable_nestloop", c"off"),
    (c"jit", c"off"),
];

/// `execute` for a claim, planned with no sort and no bitmap scan, so that its only plan reads
/// the claim-order index in order and stops at the limit. The planner cannot know how many
/// candidates pass the claim's filters (clock comparisons, anti-joins, the handler check) and
/// guesses a few hundred: with a backlog of a few thousand jobs among many finished ones it
/// fetched and sorted the whole backlog for every claim (4.4 ms per claim of 50 with 5,000
/// waiting among 40,000 finished jobs, against 0.7 ms in order).
pub fn execute_in_claim_order<'conn>(
    client: &mut SpiClient<'conn>,
    query: &str,
    args: &[DatumWithOid],
) -> SpiTupleTable<'conn> {
    with_settings(CLAIM_PLANNER_SETTINGS, || execute(client, query, args))
}

/// The planner settings of a claim (see `execute_in_claim_order`). They apply to every planning
/// of its kept plan, the first and any after an invalidation (an ANALYZE of the job table). The
/// generic plan (an index scan in claim order, pgrx test
/// `the_kept_claim_plan_needs_no_argument_to_be_an_index_scan`): left to choose, PostgreSQL
/// planned the worker's claim anew on every call once a large analyzed table made the generic
/// plan's estimate look dearer (worker test `the_workers_statements_are_planned_once_not_per_job`).
/// No JIT: the claim's estimated cost grows with the queue and passes `jit_above_cost`
/// (100,000) on a large one, and compiling its expressions took 19 ms per claim, against 1.4 ms
/// to run it.
pub const CLAIM_PLANNER_SETTINGS: &[(&std::ffi::CStr, &std::ffi::CStr)] = &[
    (c"plan_cache_mode", c"force_generic_plan"),
    (c"enable_sort", c"off"),
    (c"enable_bitmapscan", c"off"),
    (c"jit", c"off"),
];

/// Runs `f` with `settings` in a GUC nest level of its own; an error unwinds them with the
/// (sub)transaction.
fn with_settings<R>(settings: &[(&std::ffi::CStr, &std::ffi::CStr)], f: impl FnOnce() -> R) -> R {
    unsafe {
        let level = pgrx::pg_sys::NewGUCNestLevel();
        for (name, value) in settings {
            crate::pg::privilege::set_at_this_level(name, value);
        }
        let result = f();
        pgrx::pg_sys::AtEOXact_GUC(true, level);
        result
    }
}

/// Runs `f` under a new snapshot: a one-off SPI read (not a kept plan) in a transaction without
/// an xid runs read-only, on the active snapshot, which would otherwise be the calling
/// statement's, however old.
pub fn with_fresh_snapshot<R>(f: impl FnOnce() -> R) -> R {
    unsafe { pgrx::pg_sys::PushActiveSnapshot(pgrx::pg_sys::GetTransactionSnapshot()) };
    let result = f();
    // On an error the (sub)transaction's abort pops it.
    unsafe { pgrx::pg_sys::PopActiveSnapshot() };
    result
}

/// The kept plan of `query`, prepared on first use.
fn kept(client: &mut SpiClient<'_>, query: &str, args: &[DatumWithOid]) -> Rc<OwnedPreparedStatement> {
    // The map is not borrowed while the statement runs: a handler the statement calls may call
    // the extension's own functions, which use this map too.
    let kept = PLANS.with(|plans| plans.borrow().get(query).cloned());
    match kept {
        Some(plan) => plan,
        None => {
            let types: Vec<PgOid> = args.iter().map(|arg| PgOid::from(arg.oid())).collect();
            let plan = Rc::new(client.prepare_mut(query, &types).expect(query).keep());
            PLANS.with(|plans| plans.borrow_mut().insert(query.to_owned(), Rc::clone(&plan)));
            plan
        }
    }
}
