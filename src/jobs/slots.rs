//! Concurrency limits by place: a queue's (`durable_job_queue_slot`, 1 to its limit) and each
//! key's in a queue with a per-key limit (`durable_job_key_slot`). A claim takes a place for a
//! job by locking a free place's row (SKIP LOCKED) and then checking, with a snapshot taken after
//! the lock, that no running job holds it; the claimed job records its places (`queue_slot`,
//! `key_slot`). A place is held while a job that recorded it runs (a live lease, or a lapsed one
//! whose row another transaction holds: a worker's batch runs its later jobs on leases renewed in
//! its own transaction). An open claim transaction so holds only the places it took, and
//! whoever locks a place next sees the job that took it once that transaction commits.
//!
//! A claim statement asks for places row by row, before the statement's own claims may be
//! visible, so the places handed out in one statement are remembered until the next
//! (`new_claim`), and a queue or key found full stays full for the rest of the statement.
//! (Some 440 lines: the statements, the memo and the C functions of the two kinds of places are
//! one mechanism.)

use crate::jobs::held_rows::row_held;
use crate::pg::plans;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

/// Whose places: a queue's own, or one key's in a queue.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Pool {
    queue: String,
    key: Option<String>,
}

/// What one claim statement was given: each job's place in its queue's pool and in its key's
/// (by job and whether the pool is a key's), and the pools with no place left. `transaction`: the local transaction it belongs to, a guard against a statement that
/// did not call `new_claim`.
#[derive(Default)]
struct Claim {
    transaction: u32,
    places: HashMap<(i64, bool), (Pool, i32)>,
    full: HashSet<Pool>,
    /// Queues found to have room for one more start (a free place and a usable rate token,
    /// locks aside) in this statement.
    open: HashSet<String>,
}

thread_local! {
    static CLAIM: RefCell<Claim> = RefCell::new(Claim::default());
}

pub(crate) fn local_transaction() -> u32 {
    #[cfg(any(feature = "pg15", feature = "pg16"))]
    let lxid = unsafe { (*pg_sys::MyProc).lxid };
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    let lxid = unsafe { (*pg_sys::MyProc).vxid.lxid };
    lxid
}

/// Starts a statement that may take places: forgets what the one before was given (its claims
/// are visible to the next statement, and a place it locked for a job it did not claim is free
/// again for this transaction).
pub fn new_claim() {
    CLAIM.with(|claim| *claim.borrow_mut() = Claim { transaction: local_transaction(), ..Claim::default() });
}

// A running job that holds its places: a live lease, or a lapsed one another transaction holds.
macro_rules! holds_places {
    () => {
        "j.job_state = 'running'
           AND (j.lease_expires_at > pg_catalog.clock_timestamp() OR durable_jobs.durable_job_row_held(j.ctid))"
    };
}

// The lowest place of the queue ($1) that no running job holds, except those given out in this
// statement ($3), locked; with the queue's limit. No row: none (or the queue has no limit now).
// $2, the key, is not used.
const LOCK_FREE_QUEUE_PLACE: &str = concat!(
    "
    SELECT s.slot, q.concurrency_limit
    FROM durable_jobs.durable_job_queue q
    JOIN durable_jobs.durable_job_queue_slot s ON s.queue_name = q.queue_name AND s.slot <= q.concurrency_limit
    WHERE q.queue_name = $1 AND $2::pg_catalog.text IS NULL AND s.slot <> ALL ($3)
      AND NOT EXISTS (SELECT FROM durable_jobs.durable_job j
                      WHERE j.queue_name = $1 AND j.queue_slot = s.slot AND ",
    holds_places!(),
    ")
    ORDER BY s.slot
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED"
);

// Whether place $3 of the queue is still free once locked (a claim that took it may have
// committed after the locking statement's snapshot), and no job runs outside the places 1 to
// $4 (started before the limit was set, or above a lowered one: the queue is full until they end).
const QUEUE_PLACE_STILL_FREE: &str = concat!(
    "
    SELECT $2::pg_catalog.text IS NULL AND NOT EXISTS (
        SELECT FROM durable_jobs.durable_job j
        WHERE j.queue_name = $1
          AND (j.queue_slot = $3 OR j.queue_slot IS NULL OR j.queue_slot NOT BETWEEN 1 AND $4) AND ",
    holds_places!(),
    ")"
);

// The same for the places of key $2 in queue $1.
const LOCK_FREE_KEY_PLACE: &str = concat!(
    "
    SELECT s.slot, q.key_concurrency_limit
    FROM durable_jobs.durable_job_queue q
    JOIN durable_jobs.durable_job_key_slot s
      ON s.queue_name = q.queue_name AND s.concurrency_key = $2 AND s.slot <= q.key_concurrency_limit
    WHERE q.queue_name = $1 AND s.slot <> ALL ($3)
      AND NOT EXISTS (SELECT FROM durable_jobs.durable_job j
                      WHERE j.queue_name = $1 AND j.concurrency_key = $2 AND j.key_slot = s.slot AND ",
    holds_places!(),
    ")
    ORDER BY s.slot
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED"
);
const KEY_PLACE_STILL_FREE: &str = concat!(
    "
    SELECT NOT EXISTS (
        SELECT FROM durable_jobs.durable_job j
        WHERE j.queue_name = $1 AND j.concurrency_key = $2
          AND (j.key_slot = $3 OR j.key_slot IS NULL OR j.key_slot NOT BETWEEN 1 AND $4) AND ",
    holds_places!(),
    ")"
);

/// Makes the places of key $2 in queue $1 that are missing, up to the queue's per-key limit;
/// the count of those it made. Every statement that makes them first takes the key's
/// transaction advisory lock, without waiting: the insert then never waits for another
/// transaction's insert of the same place (while another holds the lock, this makes none).
/// Run by a keyed enqueue, and by a claim that finds none of a key's places.
pub const MAKE_KEY_PLACES: &str = "
    WITH missing AS (
        SELECT place FROM durable_jobs.durable_job_queue q,
                          pg_catalog.generate_series(1, q.key_concurrency_limit) AS place
        WHERE q.queue_name = $1
          AND NOT EXISTS (SELECT FROM durable_jobs.durable_job_key_slot s
                          WHERE s.queue_name = $1 AND s.concurrency_key = $2 AND s.slot = place)),
    made AS (
        INSERT INTO durable_jobs.durable_job_key_slot (queue_name, concurrency_key, slot)
        SELECT $1, $2, place FROM missing
        WHERE pg_catalog.pg_try_advisory_xact_lock(
                  pg_catalog.hashtext('durable_jobs key places'), pg_catalog.hashtext($1 || ' ' || $2))
        ON CONFLICT DO NOTHING
        RETURNING 1)
    SELECT pg_catalog.count(*) FROM made";

// Whether queue $1 could start one more job, its places' and tokens' locks aside: a free place
// of its concurrency limit (and no job running outside the places), and a usable token of its
// rate limit. Asked before a claim locks a place of the queue or of a key, so that no place is
// locked for a job the queue's other limits then refuse (it would stay locked, unused, to the
// end of the claiming transaction).
macro_rules! queue_open {
    ($select:literal, $close:literal) => {
        concat!(
    $select,
    "(q.concurrency_limit IS NULL
            OR (EXISTS (SELECT FROM durable_jobs.durable_job_queue_slot s
                        WHERE s.queue_name = $1 AND s.slot <= q.concurrency_limit
                          AND NOT EXISTS (SELECT FROM durable_jobs.durable_job j
                                          WHERE j.queue_name = $1 AND j.queue_slot = s.slot AND ",
    holds_places!(),
    "))
                AND NOT EXISTS (SELECT FROM durable_jobs.durable_job j
                                WHERE j.queue_name = $1
                                  AND (j.queue_slot IS NULL OR j.queue_slot NOT BETWEEN 1 AND q.concurrency_limit)
                                  AND ",
    holds_places!(),
    ")))
       AND (q.rate_per_second IS NULL
            OR EXISTS (SELECT FROM durable_jobs.durable_job_rate_token t
                       WHERE t.queue_name = $1 AND t.token <= q.rate_burst
                         AND t.next_at <= pg_catalog.clock_timestamp()))",
    $close,
    "
    FROM durable_jobs.durable_job_queue q
    WHERE q.queue_name = $1"
        )
    };
}
const QUEUE_OPEN: &str = queue_open!("SELECT ", "");

// Whether queue $1 is closed to claims now: paused, or without room (QUEUE_OPEN). No row: open.
const QUEUE_CLOSED: &str = queue_open!("SELECT q.paused OR NOT (", ")");

/// Whether `queue` takes no claim now (paused, full, or out of rate tokens): a claim of only
/// such queues reads none of their jobs.
pub fn queue_closed(client: &mut pgrx::spi::SpiClient, queue: &str) -> bool {
    let rows = plans::execute(client, QUEUE_CLOSED, &[queue.into()]);
    !rows.is_empty() && rows.first().get_one::<bool>().unwrap() == Some(true)
}

/// How many places a claim tries, one after another, for one job: a place is found taken after
/// its lock only when a claim of it committed between two statements.
const TRIES: usize = 3;

/// A place of `pool` for `job_id`, locked to the end of the transaction; None when none is free.
fn take(pool: Pool, job_id: i64) -> Option<i32> {
    let given = CLAIM.with(|claim| {
        let mut claim = claim.borrow_mut();
        if claim.transaction != local_transaction() {
            *claim = Claim { transaction: local_transaction(), ..Claim::default() };
        }
        if let Some((_, place)) = claim.places.get(&(job_id, pool.key.is_some())) {
            return Err(Some(*place));
        }
        let queue_pool = Pool { queue: pool.queue.clone(), key: None };
        if claim.full.contains(&pool) || claim.full.contains(&queue_pool) {
            return Err(None);
        }
        Ok(claim.places.values().filter(|(p, _)| *p == pool).map(|(_, place)| *place).collect::<Vec<i32>>())
    });
    let mut given = match given {
        Ok(given) => given,
        Err(answer) => return answer,
    };
    let (lock_free, still_free) = match pool.key {
        None => (LOCK_FREE_QUEUE_PLACE, QUEUE_PLACE_STILL_FREE),
        Some(_) => (LOCK_FREE_KEY_PLACE, KEY_PLACE_STILL_FREE),
    };
    let place = Spi::connect_mut(|client| {
        if !CLAIM.with(|claim| claim.borrow().open.contains(&pool.queue)) {
            let open = plans::execute(client, QUEUE_OPEN, &[pool.queue.as_str().into()]);
            let open = open.is_empty() || open.first().get_one::<bool>().unwrap() == Some(true);
            if !open {
                CLAIM.with(|claim| {
                    claim.borrow_mut().full.insert(Pool { queue: pool.queue.clone(), key: None })
                });
                return None;
            }
            CLAIM.with(|claim| claim.borrow_mut().open.insert(pool.queue.clone()));
        }
        let mut made = false;
        for _ in 0..TRIES {
            let args = [pool.queue.as_str().into(), pool.key.as_deref().into(), given.clone().into()];
            let rows = plans::execute(client, lock_free, &args);
            let Some(row) = rows.into_iter().next() else {
                // A key whose places were not made (enqueued before its queue had a per-key
                // limit, or while it was set): made now, once.
                let key = pool.key.as_deref();
                if key.is_some() && !made {
                    made = true;
                    let made_now =
                        plans::execute(client, MAKE_KEY_PLACES, &[pool.queue.as_str().into(), key.into()])
                            .first()
                            .get_one::<i64>()
                            .unwrap();
                    if made_now > Some(0) {
                        continue;
                    }
                }
                return None;
            };
            let place: i32 = row.get(1).unwrap().unwrap();
            let limit: i32 = row.get(2).unwrap().unwrap();
            if place_still_free(client, still_free, &pool, place, limit) {
                return Some(place);
            }
            // Locked by this transaction now, and taken: not asked for again in this statement.
            given.push(place);
        }
        None
    });
    CLAIM.with(|claim| {
        let mut claim = claim.borrow_mut();
        match place {
            Some(place) => {
                claim.places.insert((job_id, pool.key.is_some()), (pool, place));
            }
            None => {
                claim.full.insert(pool);
            }
        }
    });
    place
}

/// `statement` (QUEUE_PLACE_STILL_FREE or KEY_PLACE_STILL_FREE), with a snapshot taken now. At
/// READ COMMITTED every statement takes one; a REPEATABLE READ or SERIALIZABLE transaction would
/// read its own, older one, which need not show a claim of the place that committed since, so
/// the statement runs with the latest snapshot.
fn place_still_free(
    client: &mut pgrx::spi::SpiClient,
    statement: &str,
    pool: &Pool,
    place: i32,
    limit: i32,
) -> bool {
    if unsafe { pg_sys::XactIsoLevel } < pg_sys::XACT_REPEATABLE_READ as i32 {
        let args = [pool.queue.as_str().into(), pool.key.as_deref().into(), place.into(), limit.into()];
        return plans::execute(client, statement, &args).first().get_one::<bool>().unwrap() == Some(true);
    }
    let text = std::ffi::CString::new(statement).unwrap();
    unsafe {
        let mut types = [pg_sys::TEXTOID, pg_sys::TEXTOID, pg_sys::INT4OID, pg_sys::INT4OID];
        let plan = pg_sys::SPI_prepare(text.as_ptr(), 4, types.as_mut_ptr());
        assert!(!plan.is_null(), "a place's check did not prepare");
        let key = pool.key.as_deref().into_datum();
        let mut values = [
            pool.queue.as_str().into_datum().unwrap(),
            key.unwrap_or(pg_sys::Datum::from(0)),
            place.into_datum().unwrap(),
            limit.into_datum().unwrap(),
        ];
        let nulls = [
            b' ' as std::ffi::c_char,
            if key.is_some() { b' ' } else { b'n' } as std::ffi::c_char,
            b' ' as _,
            b' ' as _,
        ];
        let status = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_ptr(),
            pg_sys::GetLatestSnapshot(),
            std::ptr::null_mut(),
            false,
            false,
            1,
        );
        assert_eq!(status, pg_sys::SPI_OK_SELECT as i32, "a place's check");
        let table = pg_sys::SPI_tuptable;
        let mut is_null = false;
        let free = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, 1, &mut is_null);
        let free = !is_null && bool::from_datum(free, false) == Some(true);
        pg_sys::SPI_freetuptable(table);
        pg_sys::SPI_freeplan(plan);
        free
    }
}

/// The C functions defined here, by SQL name: they pin no search_path (they name every object
/// with its schema), as a `SET` clause would cost a GUC save and restore on every call.
#[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
pub const C_FUNCTIONS: [&str; 4] = [
    "durable_job_take_queue_slot",
    "durable_job_taken_queue_slot",
    "durable_job_take_key_slot",
    "durable_job_taken_key_slot",
];

crate::v1_function_info!(
    pg_finfo_durable_job_take_queue_slot,
    pg_finfo_durable_job_taken_queue_slot,
    pg_finfo_durable_job_take_key_slot,
    pg_finfo_durable_job_taken_key_slot
);

/// The int4 result, or NULL.
unsafe fn place_datum(fcinfo: pg_sys::FunctionCallInfo, place: Option<i32>) -> pg_sys::Datum {
    match place {
        Some(place) => pg_sys::Datum::from(place),
        None => {
            unsafe { (*fcinfo).isnull = true };
            pg_sys::Datum::from(0)
        }
    }
}

/// Text argument `n` (STRICT functions: never NULL).
unsafe fn text_argument(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> String {
    unsafe { String::from_datum((*fcinfo).args.as_slice(n + 1)[n].value, false).unwrap() }
}

/// A place of `pool` for the job (argument `job`) whose row version is argument `job + 1`. A
/// claim asks before it locks the job's row: a row another transaction holds (a claim of it in
/// progress, or committed since the claim's snapshot) gets no place, so that a job the claim
/// will skip takes none from the jobs after it.
unsafe fn take_for_row(fcinfo: pg_sys::FunctionCallInfo, pool: Pool, job: usize) -> pg_sys::Datum {
    unsafe {
        let args = (*fcinfo).args.as_slice(job + 2);
        if row_held(fcinfo, args[job + 1].value.cast_mut_ptr()) {
            return place_datum(fcinfo, None);
        }
        let place = take(pool, args[job].value.value() as i64);
        place_datum(fcinfo, place)
    }
}

/// The place the current claim statement took for the job (argument 0) in its queue's pool or
/// its key's, NULL if none.
unsafe fn taken(fcinfo: pg_sys::FunctionCallInfo, in_key: bool) -> pg_sys::Datum {
    unsafe {
        let job_id = (*fcinfo).args.as_slice(1)[0].value.value() as i64;
        let place = CLAIM.with(|claim| {
            let claim = claim.borrow();
            if claim.transaction != local_transaction() {
                return None;
            }
            claim.places.get(&(job_id, in_key)).map(|(_, place)| *place)
        });
        place_datum(fcinfo, place)
    }
}

/// `durable_jobs.durable_job_take_queue_slot(queue text, job_id int8, row_version tid)`.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_take_queue_slot(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe { take_for_row(fcinfo, Pool { queue: text_argument(fcinfo, 0), key: None }, 1) }
}

/// `durable_jobs.durable_job_take_key_slot(queue text, concurrency_key text, job_id int8,
/// row_version tid)`.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_take_key_slot(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let pool = Pool { queue: text_argument(fcinfo, 0), key: Some(text_argument(fcinfo, 1)) };
        take_for_row(fcinfo, pool, 2)
    }
}

/// `durable_jobs.durable_job_taken_queue_slot(job_id int8)`.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_taken_queue_slot(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe { taken(fcinfo, false) }
}

/// `durable_jobs.durable_job_taken_key_slot(job_id int8)`.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_taken_key_slot(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe { taken(fcinfo, true) }
}
