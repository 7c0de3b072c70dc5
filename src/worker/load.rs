//! Loading a claimed batch: each job's payload, handler and enqueuer, read again for a batch
//! that runs after the first (or taken from the claim's rows for the first), the handlers
//! resolved once per batch, and jobs no registration serves given back.

use super::sandbox::{gave_up_waiting, in_subtransaction, raise_again};
use crate::jobs::lease;
use crate::jobs::trust::{registration_serves, runnable_handler, RunnableHandler};
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner, as_owner, installed_at_library_version};
use crate::pg::sql_types::JsonbDatum;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::Uuid;
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// For each claimed job whose lease is still exactly ours: its payload, its kind's registered
/// handler (text, NULL when there is none), the enqueuing role, its lease expiry (Unix
/// microseconds), kind and attempt, the role that registered the handler and whether that
/// registration serves the enqueuer now (it may not: unregistered and registered again by another
/// role since the claim, or the registering role no longer holds the enqueuer's rights). Whether
/// the enqueuer may run the handler is decided in the library (`handlers::runnable_handler`),
/// once per handler, enqueuer and registering role of the batch.
pub(crate) const LOAD_JOBS: &str = concat!(
    "
    SELECT j.job_id,
           j.payload,
           h.handler,
           j.enqueued_by::pg_catalog.text,
           (pg_catalog.date_part('epoch', j.lease_expires_at) * 1000000)::pg_catalog.int8,
           j.job_kind,
           j.attempt_count,
           h.registered_by::pg_catalog.text,
           ",
    crate::registration_serves!("h.registered_by", "j.enqueued_by"),
    "
    FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.uuid[]))
         AS c(job_id, lease_token)
    JOIN durable_jobs.durable_job j ON j.job_id = c.job_id AND j.lease_token = c.lease_token
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    -- The token is the state check (see lease_fence in jobs/statements.rs).
    WHERE j.job_id = ANY ($1) AND j.lease_owner = $3"
);

pub(crate) struct LoadedJob {
    pub(crate) payload: JsonbDatum,
    /// None when the job may not run.
    pub(crate) handler: Option<RunnableHandler>,
    pub(crate) lease_expires_unix_us: i64,
    pub(crate) job_kind: String,
    pub(crate) attempt_count: i32,
    /// Given back to the queue at the load, with its attempt: its kind is no longer registered,
    /// or its registration no longer serves its enqueuer (the job waits for an external worker,
    /// as it would had that been so at the claim). Not run, and counted as nothing.
    pub(crate) given_back: bool,
}

/// Loads a batch of claimed jobs with one query; a job missing from the result lost its lease.
/// A job whose kind is no longer registered, or whose registration no longer serves its
/// enqueuer, is given back here.
pub(crate) fn load_jobs(jobs: &[(i64, Uuid)], worker_id: &str) -> HashMap<i64, LoadedJob> {
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = jobs.iter().copied().unzip();
    as_extension_owner(|| {
        let loaded: HashMap<i64, LoadedJob> = Spi::connect_mut(|client| {
            let mut runnable = RunnableHandlers::default();
            plans::execute_generic(client, LOAD_JOBS, &[ids.into(), tokens.into(), worker_id.into()])
                .map(|row| {
                    let handler: Option<String> = row.get(3).unwrap();
                    // Unregistered since the claim (which takes only registered kinds), or no
                    // longer a registration that serves the enqueuer.
                    let given_back = handler.is_none() || row.get::<bool>(9).unwrap() == Some(false);
                    let enqueuer: String = row.get(4).unwrap().unwrap();
                    let registrant: Option<String> = row.get(8).unwrap();
                    let job = LoadedJob {
                        payload: row.get(2).unwrap().unwrap(),
                        handler: if given_back { None } else { runnable.of(handler, enqueuer, registrant) },
                        lease_expires_unix_us: row.get(5).unwrap().unwrap(),
                        job_kind: row.get(6).unwrap().unwrap(),
                        attempt_count: row.get(7).unwrap().unwrap(),
                        given_back,
                    };
                    (row.get::<i64>(1).unwrap().unwrap(), job)
                })
                .collect()
        });
        give_back_marked(jobs, &loaded, worker_id);
        loaded
    })
}

/// Gives the jobs of `jobs` that the load marked `given_back` back to the queue (`release_in_batch`).
pub(crate) fn give_back_marked(jobs: &[(i64, Uuid)], loaded: &HashMap<i64, LoadedJob>, worker_id: &str) {
    let marked: Vec<(i64, Uuid)> =
        jobs.iter().filter(|(id, _)| loaded.get(id).is_some_and(|job| job.given_back)).copied().collect();
    release_in_batch(&marked, worker_id);
}

/// Gives `jobs`, claimed but not started, back to the queue with their attempts, in the batch's
/// transaction (they stay running, their rows locked, until it commits). A job whose row another
/// session holds, or a wait for the table given up, leaves that job to its lease, as any job the
/// batch does not run; nothing else of the batch is lost with it.
pub(crate) fn release_in_batch(jobs: &[(i64, Uuid)], worker_id: &str) {
    if jobs.is_empty() {
        return;
    }
    match in_subtransaction(|| {
        lease::release_unstarted(jobs, worker_id);
        true
    }) {
        Ok(_) => {}
        Err(error) if gave_up_waiting(&error) => {}
        Err(error) => raise_again(error),
    }
}

/// A batch's jobs share a few handlers, enqueuers and registering roles: each is checked once.
#[derive(Default)]
pub(crate) struct RunnableHandlers(HashMap<(String, String, String), Option<RunnableHandler>>);

impl RunnableHandlers {
    fn of(
        &mut self,
        registered: Option<String>,
        enqueuer: String,
        registrant: Option<String>,
    ) -> Option<RunnableHandler> {
        let (registered, registrant) = (registered?, registrant?);
        *self.0.entry((registered, enqueuer, registrant)).or_insert_with_key(
            |(registered, enqueuer, registrant)| runnable_handler(registered, enqueuer, registrant),
        )
    }
}

/// A job as a claim of the worker (a poll's, or one ahead) returned it, kept past that claim's
/// commit, so that the transaction that runs it right after does not read it again: its lease
/// was exactly ours when the claim committed, a moment before, and a lease lost since (a cancel,
/// say) is found by the fenced completion, which then rolls the handler's writes back, as for a
/// lease lost while the handler runs.
pub(crate) struct ClaimedRow {
    lease_token: Uuid,
    payload: Vec<u8>,
    handler: Option<String>,
    registered_by: Option<String>,
    enqueued_by: String,
    lease_expires_unix_us: i64,
    job_kind: String,
    attempt_count: i32,
}

impl ClaimedRow {
    pub(crate) fn of(job: lease::ClaimedJob) -> (i64, ClaimedRow) {
        let row = ClaimedRow {
            lease_token: job.lease_token,
            payload: job.payload.to_bytes(),
            handler: job.handler,
            registered_by: job.registered_by,
            enqueued_by: job.enqueued_by,
            lease_expires_unix_us: unix_us(job.lease_expires_at),
            job_kind: job.job_kind,
            attempt_count: job.attempt_count,
        };
        (job.job_id, row)
    }
}

/// A claim's rows by job id, and the extension they were claimed from (its pg_extension oid).
#[derive(Default)]
pub(crate) struct ClaimedRows {
    pub(crate) extension: pg_sys::Oid,
    pub(crate) rows: HashMap<i64, ClaimedRow>,
}

/// `load_jobs`, from the claim's rows instead of the table, as the extension owner (resolving a
/// handler needs USAGE on its schema): None unless the extension is the one the rows were
/// claimed from, at this library's version (the job table locked, as the load's statement
/// locks it, so that DDL waits for the batch), and the rows hold every job of the batch under
/// its lease.
pub(crate) fn loaded_from_claim(
    jobs: &[(i64, Uuid)],
    claimed: &ClaimedRows,
    worker_id: &str,
) -> Option<HashMap<i64, LoadedJob>> {
    let installed = installed_at_library_version().filter(|row| row.extension == claimed.extension)?;
    let rows: Vec<(i64, &ClaimedRow)> = jobs
        .iter()
        .map(|(job_id, lease_token)| {
            claimed.rows.get(job_id).filter(|row| row.lease_token == *lease_token).map(|row| (*job_id, row))
        })
        .collect::<Option<_>>()?;
    as_owner(installed.owner, || {
        let mut runnable = RunnableHandlers::default();
        let loaded: HashMap<i64, LoadedJob> = rows
            .into_iter()
            .map(|(job_id, row)| {
                // The claim judged the registration a moment ago; the registering role's
                // memberships may have changed since, as at a load.
                let given_back = !row
                    .registered_by
                    .as_deref()
                    .is_some_and(|registrant| registration_serves(registrant, &row.enqueued_by));
                let job = LoadedJob {
                    payload: JsonbDatum::from_bytes(&row.payload),
                    handler: if given_back {
                        None
                    } else {
                        runnable.of(row.handler.clone(), row.enqueued_by.clone(), row.registered_by.clone())
                    },
                    lease_expires_unix_us: row.lease_expires_unix_us,
                    job_kind: row.job_kind.clone(),
                    attempt_count: row.attempt_count,
                    given_back,
                };
                (job_id, job)
            })
            .collect();
        give_back_marked(jobs, &loaded, worker_id);
        Some(loaded)
    })
}

/// A timestamp as Unix microseconds (PostgreSQL counts from 2000-01-01).
pub(crate) fn unix_us(at: TimestampWithTimeZone) -> i64 {
    const POSTGRES_EPOCH_UNIX_US: i64 = 946_684_800_000_000;
    pg_sys::TimestampTz::from(at) + POSTGRES_EPOCH_UNIX_US
}

pub(crate) fn now_unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}
