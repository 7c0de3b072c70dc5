//! A queue's rate limit: at most `rate_burst + rate_per_second · T` claims start its jobs in any
//! window of T seconds, shared by every worker and connection. The bucket is one row per token
//! (`durable_job_rate_token`, 1 to the burst), each usable once its `next_at` has come; a claim
//! takes a token by locking a usable row (SKIP LOCKED) and moving its `next_at` one period
//! (burst / rate seconds) past the claim. A token is used at most once a period, so in any
//! window each of the burst's tokens starts at most 1 + T / period jobs. An open claim
//! transaction holds only the token it took; one that rolls back gives it back.
//!
//! A claim that finds no token takes nothing from that queue for the rest of its statement, and
//! remembers when the queue's next token comes (`next_token_at`), for the background worker to
//! sleep until then instead of a poll interval.

use crate::jobs::held_rows::row_held;
use crate::pg::plans;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

/// What one claim statement was given: the jobs that took a token, with the time the token was
/// taken at (the job's start), and the queues that had none left. `transaction` as in
/// `jobs::slots`.
#[derive(Default)]
struct Claim {
    transaction: u32,
    tokens: HashMap<i64, pg_sys::TimestampTz>,
    spent: HashSet<String>,
}

thread_local! {
    static CLAIM: RefCell<Claim> = RefCell::new(Claim::default());
    /// The earliest time a token comes back in a queue whose claim found none, since the last
    /// `next_token_at` (PostgreSQL timestamp microseconds).
    static NEXT_TOKEN: Cell<Option<i64>> = const { Cell::new(None) };
}

/// Starts a statement that may take tokens (see `slots::new_claim`).
pub fn new_claim() {
    CLAIM.with(|claim| {
        *claim.borrow_mut() =
            Claim { transaction: crate::jobs::slots::local_transaction(), ..Claim::default() }
    });
}

/// When the next token comes in a queue whose claim found none since the last call, if one does.
pub fn next_token_at() -> Option<pg_sys::TimestampTz> {
    NEXT_TOKEN.with(|next| next.take())
}

// The usable token of queue $1 that became usable first, locked and moved a period past the time
// it returns, which the claimed job records as its start: the bound then holds for the starts.
const TAKE_TOKEN: &str = "
    WITH now AS (SELECT pg_catalog.clock_timestamp() AS at)
    UPDATE durable_jobs.durable_job_rate_token t
    SET next_at = now.at + pg_catalog.make_interval(secs => q.rate_burst / q.rate_per_second)
    FROM durable_jobs.durable_job_queue q, now
    WHERE q.queue_name = $1 AND t.queue_name = $1 AND t.next_at <= now.at
      AND t.token = (SELECT s.token FROM durable_jobs.durable_job_rate_token s
                     WHERE s.queue_name = $1 AND s.token <= q.rate_burst
                       AND s.next_at <= pg_catalog.clock_timestamp()
                     ORDER BY s.next_at
                     LIMIT 1
                     FOR UPDATE OF s SKIP LOCKED)
    RETURNING now.at";

// When queue $1's next token comes, in timestamp microseconds; NULL when one is usable now (or
// locked by a claim in progress) or the queue has no rate limit.
const NEXT_TOKEN_AT: &str = "
    SELECT ((pg_catalog.date_part('epoch', pg_catalog.min(t.next_at)) - 946684800) * 1000000)::pg_catalog.int8
    FROM durable_jobs.durable_job_rate_token t
    JOIN durable_jobs.durable_job_queue q ON q.queue_name = t.queue_name AND t.token <= q.rate_burst
    WHERE t.queue_name = $1
    HAVING pg_catalog.min(t.next_at) > pg_catalog.clock_timestamp()";

/// Takes a token of `queue` for `job_id`; false when none is usable.
fn take(queue: &str, job_id: i64) -> bool {
    let known = CLAIM.with(|claim| {
        let mut claim = claim.borrow_mut();
        if claim.transaction != crate::jobs::slots::local_transaction() {
            *claim = Claim { transaction: crate::jobs::slots::local_transaction(), ..Claim::default() };
        }
        if claim.tokens.contains_key(&job_id) {
            return Some(true);
        }
        claim.spent.contains(queue).then_some(false)
    });
    if let Some(known) = known {
        return known;
    }
    let taken_at = Spi::connect_mut(|client| {
        let taken = plans::execute(client, TAKE_TOKEN, &[queue.into()]);
        if !taken.is_empty() {
            return taken.first().get_one::<TimestampWithTimeZone>().unwrap();
        }
        let next = plans::execute(client, NEXT_TOKEN_AT, &[queue.into()]);
        if let Some(Some(at)) = (!next.is_empty()).then(|| next.first().get_one::<i64>().unwrap()) {
            NEXT_TOKEN.with(|next| next.set(Some(next.get().map_or(at, |earlier: i64| earlier.min(at)))));
        }
        None
    });
    CLAIM.with(|claim| {
        let mut claim = claim.borrow_mut();
        match taken_at {
            Some(at) => {
                claim.tokens.insert(job_id, at.into_inner());
            }
            None => {
                claim.spent.insert(queue.to_owned());
            }
        }
    });
    taken_at.is_some()
}

/// The C functions defined here, by SQL name (see `slots::C_FUNCTIONS`).
#[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
pub const C_FUNCTIONS: [&str; 2] = ["durable_job_take_rate_token", "durable_job_rate_token_taken_at"];

crate::v1_function_info!(pg_finfo_durable_job_take_rate_token, pg_finfo_durable_job_rate_token_taken_at);

/// `durable_jobs.durable_job_rate_token_taken_at(job_id int8)` (STRICT): when this claim
/// statement took a token for the job, NULL if it took none.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_rate_token_taken_at(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let job_id = (*fcinfo).args.as_slice(1)[0].value.value() as i64;
        let at = CLAIM.with(|claim| {
            let claim = claim.borrow();
            (claim.transaction == crate::jobs::slots::local_transaction())
                .then(|| claim.tokens.get(&job_id).copied())
                .flatten()
        });
        match at {
            Some(at) => pg_sys::Datum::from(at),
            None => {
                (*fcinfo).isnull = true;
                pg_sys::Datum::from(0)
            }
        }
    }
}

/// `durable_jobs.durable_job_take_rate_token(queue text, job_id int8, row_version tid)`
/// (STRICT): whether the claim took a token of the queue for the job. A row another transaction
/// holds gets none, as it gets no place (`slots::take_for_row`).
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn durable_job_take_rate_token(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let args = (*fcinfo).args.as_slice(3);
        if row_held(fcinfo, args[2].value.cast_mut_ptr()) {
            return pg_sys::Datum::from(false);
        }
        let queue = String::from_datum(args[0].value, false).unwrap();
        pg_sys::Datum::from(take(&queue, args[1].value.value() as i64))
    }
}
