//! An external durable_jobs worker in Rust, with the synchronous `postgres` crate.
//!
//! Loop: claim a job -> check its payload -> do the slow part of the work while a heartbeat thread
//! extends the lease, with no transaction open -> write its effects and complete it in one short
//! transaction, or fail it with a stable failure code. SIGTERM (or
//! Ctrl-C) stops it cleanly: the job in hand is finished first, and nothing new is claimed.
//!
//!     DURABLE_JOBS_DSN="host=localhost port=5433 dbname=postgres user=app_worker password=worker-secret" \
//!         cargo run --release
//!
//! docs/runbook.md, "Roles and privileges", creates that role with what it needs: EXECUTE on
//! claim_next_durable_job, complete_durable_job, fail_durable_job and extend_durable_job_lease,
//! the table public.postcards (name text) and INSERT on it. This example's work: kind `postcard`
//! (the only kind it claims; no handler is registered for it, so the background worker leaves it
//! alone) inserts payload["name"], a string, into public.postcards, after sleeping
//! payload["seconds"] (a number, default 0) to stand for slow work. Any other payload fails as
//! `invalid_request`, as in the Python example.

use postgres::{Client, NoTls, Transaction};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// Why a job failed, as one of durable_jobs' stable failure codes, with a message the job's
/// attempt keeps (get_durable_job_attempts).
enum Failure {
    /// No retry will fix it.
    Permanent(&'static str),
    /// Worth retrying after a backoff, while attempts remain.
    Transient(&'static str),
}

impl Failure {
    fn code(&self) -> &'static str {
        match self {
            Failure::Permanent(_) => "invalid_request",
            Failure::Transient(_) => "target_unavailable",
        }
    }

    fn message(&self) -> &'static str {
        match self {
            Failure::Permanent(message) | Failure::Transient(message) => message,
        }
    }
}

/// The claim takes only these kinds: a worker never touches work it cannot do.
const HANDLED_KINDS: [&str; 1] = ["postcard"];

/// A `postcard` job's name and seconds, or a `Permanent` failure when its payload is not what the kind
/// takes: an object whose `name` is a string and whose `seconds`, if any, a number. Read with
/// the server's jsonb functions, in no transaction of ours.
fn checked(client: &mut Client, payload: &str) -> Result<(String, f64), Failure> {
    let row = client
        .query_one(
            "SELECT CASE WHEN jsonb_typeof(p) = 'object' AND jsonb_typeof(p->'name') = 'string'
                          AND coalesce(jsonb_typeof(p->'seconds'), 'number') = 'number'
                         THEN p->>'name' END,
                    CASE WHEN jsonb_typeof(p->'seconds') = 'number' THEN (p->>'seconds')::float8 ELSE 0 END,
                    coalesce(p->>'fail' = 'transient', false)
             FROM (SELECT $1::text::jsonb AS p) payload",
            &[&payload],
        )
        .map_err(|_| Failure::Permanent("the payload is not JSON"))?;
    let (name, seconds, transient): (Option<String>, f64, bool) = (row.get(0), row.get(1), row.get(2));
    let name = name.ok_or(Failure::Permanent("a postcard job needs a name, a string, and seconds, a number"))?;
    if transient {
        return Err(Failure::Transient("the target is down"));
    }
    Ok((name, seconds))
}

/// Runs inside the transaction that completes the job, so its writes commit with it.
fn write_effects(txn: &mut Transaction, name: &str) -> Result<(), Failure> {
    txn.execute("INSERT INTO public.postcards (name) VALUES ($1)", &[&name]).map_err(|_| Failure::Transient("the postcard could not be written"))?;
    Ok(())
}

/// Extends the lease on its own connection every third of the lease until told to stop.
fn heartbeat(dsn: String, job_id: i64, worker_id: String, token: String, lease: i32) -> mpsc::Sender<()> {
    let (stop, stopped) = mpsc::channel::<()>();
    thread::spawn(move || {
        let Ok(mut client) = Client::connect(&dsn, NoTls) else { return };
        let every = Duration::from_millis((lease as u64 * 1000) / 3);
        while stopped.recv_timeout(every) == Err(mpsc::RecvTimeoutError::Timeout) {
            let extended = client.query_one(
                "SELECT durable_jobs.extend_durable_job_lease($1, $2, $3::text::uuid, $4) IS NOT NULL",
                &[&job_id, &worker_id, &token, &lease],
            );
            // A stale lease cannot be revived: our completion will be refused.
            if !matches!(extended.map(|row| row.get::<_, bool>(0)), Ok(true)) {
                return;
            }
        }
    });
    stop
}

/// Claims and handles one job; Ok(false) when none was ready.
fn run_one(client: &mut Client, dsn: &str, worker_id: &str, lease: i32) -> Result<bool, postgres::Error> {
    let Some(row) = client.query_opt(
        "SELECT job_id, lease_token::text, payload::text
         FROM durable_jobs.claim_next_durable_job($1, NULL, $2, $3)",
        &[&worker_id, &lease, &HANDLED_KINDS.as_slice()],
    )?
    else {
        return Ok(false);
    };
    let (job_id, token, payload): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
    let stop_heartbeat = heartbeat(dsn.to_owned(), job_id, worker_id.to_owned(), token.clone(), lease);

    let failure = match checked(client, &payload) {
        Err(failure) => Some(failure),
        Ok((name, seconds)) => {
            // The slow part, with no transaction open: an open one would hold back vacuum for as
            // long.
            thread::sleep(Duration::from_secs_f64(seconds));
            complete_with_effects(client, &name, job_id, worker_id, &token)?
        }
    };
    if let Some(failure) = failure {
        client.execute(
            "SELECT durable_jobs.fail_durable_job($1, $2, $3::text::uuid, $4, $5)",
            &[&job_id, &worker_id, &token, &failure.code(), &failure.message()],
        )?;
    }
    let _ = stop_heartbeat.send(());
    Ok(true)
}

/// Writes a job's effects and completes it in one transaction; the failure to record, if any.
fn complete_with_effects(
    client: &mut Client,
    name: &str,
    job_id: i64,
    worker_id: &str,
    token: &str,
) -> Result<Option<Failure>, postgres::Error> {
    let mut txn = client.transaction()?;
    Ok(match write_effects(&mut txn, name) {
        Ok(()) => {
            let outcome: String = txn
                .query_one(
                    "SELECT durable_jobs.complete_durable_job($1, $2, $3::text::uuid)",
                    &[&job_id, &worker_id, &token],
                )?
                .get(0);
            // Stale: someone else owns the job now, so our effects must not count.
            if outcome == "succeeded" {
                txn.commit()?;
            } else {
                txn.rollback()?;
            }
            None
        }
        Err(failure) => {
            txn.rollback()?;
            Some(failure)
        }
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dsn = std::env::var("DURABLE_JOBS_DSN")?;
    let worker_id = std::env::var("DURABLE_JOBS_WORKER_ID").unwrap_or_else(|_| format!("rs-{}", std::process::id()));
    let lease: i32 = std::env::var("DURABLE_JOBS_LEASE_SECONDS").map_or(Ok(30), |v| v.parse())?;
    let stopping = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stopping))?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stopping))?;

    let mut client = Client::connect(&dsn, NoTls)?;
    while !stopping.load(Ordering::Relaxed) {
        if !run_one(&mut client, &dsn, &worker_id, lease)? {
            thread::sleep(Duration::from_millis(200));
        }
    }
    println!("{worker_id} stopped");
    Ok(())
}
