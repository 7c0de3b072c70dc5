//! diagnose_durable_job: why a job is where it is, as every reason that holds now, each a stable
//! word with a sentence for people. Visible as `get_durable_job` shows the job. The sentences
//! name other roles, routines and other roles' jobs only to a caller that may read them anyway:
//! one that sees every job, or may read the view that shows them (queue controls, handlers,
//! the queue summary).

use crate::api::status::sees_all_jobs;
use crate::jobs::arguments;
use crate::jobs::trust::{registration_serves, runnable_handler};
use crate::jobs::wakeup;
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_of, caller};
use crate::pg::settings;
use pgrx::prelude::*;

// The job, its queue's controls and its kind's registration, with the times the sentences show
// as text (in the caller's DateStyle and TimeZone).
const JOB_AND_SURROUNDINGS: &str = concat!(
    "
    SELECT j.job_state, j.queue_name, j.job_kind, j.enqueued_by::pg_catalog.text, j.attempt_count,
           j.max_attempts, j.run_after > pg_catalog.clock_timestamp(), j.run_after::pg_catalog.text,
           j.lease_owner, j.lease_expires_at > pg_catalog.clock_timestamp(), j.lease_expires_at::pg_catalog.text,
           j.finished_at::pg_catalog.text,
           COALESCE(q.paused, false), q.changed_by::pg_catalog.text, q.changed_at::pg_catalog.text,
           q.concurrency_limit,
           CASE WHEN q.concurrency_limit IS NOT NULL
                THEN durable_jobs.durable_job_queue_running(q.queue_name) END,
           h.handler, h.registered_by::pg_catalog.text,
           (SELECT p.proowner::pg_catalog.regrole::pg_catalog.text FROM pg_catalog.pg_proc p
            WHERE p.oid = pg_catalog.to_regprocedure(h.handler)),
           pg_catalog.current_database()::pg_catalog.text,
           $2 OR pg_catalog.has_table_privilege($3, 'durable_jobs.durable_job_queue_controls', 'SELECT'),
           $2 OR pg_catalog.has_table_privilege($3, 'durable_jobs.durable_job_handlers', 'SELECT'),
           $2 OR pg_catalog.has_table_privilege($3, 'durable_jobs.durable_job_queue_summary', 'SELECT'),
           j.concurrency_key, q.key_concurrency_limit,
           CASE WHEN j.concurrency_key IS NOT NULL AND q.key_concurrency_limit IS NOT NULL
                THEN (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job r
                      WHERE r.queue_name = j.queue_name AND r.concurrency_key = j.concurrency_key
                        AND r.job_state = 'running'
                        AND (r.lease_expires_at > pg_catalog.clock_timestamp()
                             OR durable_jobs.durable_job_row_held(r.ctid))) END,
           q.rate_per_second, q.rate_burst,
           (SELECT pg_catalog.min(t.next_at)::pg_catalog.text FROM durable_jobs.durable_job_rate_token t
            WHERE t.queue_name = j.queue_name AND t.token <= q.rate_burst
            HAVING pg_catalog.min(t.next_at) > pg_catalog.clock_timestamp())
    FROM durable_jobs.durable_job j
    LEFT JOIN durable_jobs.durable_job_queue q ON q.queue_name = j.queue_name
    LEFT JOIN durable_jobs.durable_job_handler h ON h.job_kind = j.job_kind
    WHERE j.job_id = $1 AND ",
    crate::visible_to_caller!()
);

/// What the diagnosis reads of a job and around it.
struct Job {
    state: String,
    queue: String,
    kind: String,
    enqueuer: String,
    attempts: i32,
    max_attempts: i32,
    due_later: bool,
    run_after: String,
    lease_owner: Option<String>,
    lease_live: Option<bool>,
    lease_expires_at: Option<String>,
    finished_at: Option<String>,
    paused: bool,
    paused_by: Option<String>,
    paused_at: Option<String>,
    limit: Option<i32>,
    running: Option<i64>,
    handler: Option<String>,
    registered_by: Option<String>,
    handler_owner: Option<String>,
    database: String,
    /// The caller may read who controls queues, who registered handlers, how many jobs run.
    reads_controls: bool,
    reads_handlers: bool,
    reads_summary: bool,
    concurrency_key: Option<String>,
    key_limit: Option<i32>,
    key_running: Option<i64>,
    rate: Option<f64>,
    burst: Option<i32>,
    /// When the queue's next token comes, if none is usable now.
    next_token_at: Option<String>,
}

type Reason = (&'static str, String);

/// The reasons, worked out as the extension owner: resolving a handler asks for USAGE on its
/// schema, which the caller need not have.
fn reasons_for(job_id: i64) -> Vec<Reason> {
    let caller = caller();
    as_extension_owner_of(|installed| {
        let sees_all = sees_all_jobs(&caller, installed.owner);
        let job = Spi::connect_mut(|client| {
            let args = [job_id.into(), sees_all.into(), caller.role_oid.into()];
            let rows = plans::execute(client, JOB_AND_SURROUNDINGS, &args);
            rows.into_iter().next().map(|row| Job {
                state: row.get(1).unwrap().expect("job_state"),
                queue: row.get(2).unwrap().expect("queue_name"),
                kind: row.get(3).unwrap().expect("job_kind"),
                enqueuer: row.get(4).unwrap().expect("enqueued_by"),
                attempts: row.get(5).unwrap().expect("attempt_count"),
                max_attempts: row.get(6).unwrap().expect("max_attempts"),
                due_later: row.get(7).unwrap().expect("run_after"),
                run_after: row.get(8).unwrap().expect("run_after"),
                lease_owner: row.get(9).unwrap(),
                lease_live: row.get(10).unwrap(),
                lease_expires_at: row.get(11).unwrap(),
                finished_at: row.get(12).unwrap(),
                paused: row.get(13).unwrap().expect("paused"),
                paused_by: row.get(14).unwrap(),
                paused_at: row.get(15).unwrap(),
                limit: row.get(16).unwrap(),
                running: row.get(17).unwrap(),
                handler: row.get(18).unwrap(),
                registered_by: row.get(19).unwrap(),
                handler_owner: row.get(20).unwrap(),
                database: row.get(21).unwrap().expect("current_database"),
                reads_controls: row.get(22).unwrap().unwrap_or(false),
                reads_handlers: row.get(23).unwrap().unwrap_or(false),
                reads_summary: row.get(24).unwrap().unwrap_or(false),
                concurrency_key: row.get(25).unwrap(),
                key_limit: row.get(26).unwrap(),
                key_running: row.get(27).unwrap(),
                rate: row.get(28).unwrap(),
                burst: row.get(29).unwrap(),
                next_token_at: row.get(30).unwrap(),
            })
        });
        job.map(|job| diagnose(&job)).unwrap_or_default()
    })
}

/// Why the background workers run no job of this database now, if they do not. Nothing on a
/// standby: the primary's workers run its jobs.
fn why_no_worker_runs(database: &str) -> Option<String> {
    if unsafe { pgrx::pg_sys::RecoveryInProgress() } {
        return None;
    }
    if !wakeup::preloaded() {
        return Some("durable_jobs is not in shared_preload_libraries: no background worker runs".into());
    }
    if settings::WORKER_COUNT.get() == 0 {
        return Some("durable_jobs.worker_count is 0: no background worker runs".into());
    }
    if !settings::WORKER_ENABLED.get() {
        return Some("durable_jobs.worker_enabled is off: the background workers claim no job".into());
    }
    let workers_database = settings::DATABASE.get().map(|name| name.to_string_lossy().into_owned());
    if workers_database.as_deref() != Some(database) {
        return Some(format!(
            "the background workers work in database {}, not in this one",
            workers_database.unwrap_or_default()
        ));
    }
    if wakeup::awake_workers() == 0 {
        return Some(
            "no background worker is running now (one is starting, or restarting after an error)".into(),
        );
    }
    None
}

/// Why the background workers do not run a pending job of a kind they have a handler for.
fn handler_reasons(job: &Job, handler: &str, registered_by: &str, reasons: &mut Vec<Reason>) {
    if !registration_serves(registered_by, &job.enqueuer) {
        let by = match job.reads_handlers {
            true => format!("{registered_by}, which"),
            false => "a role that".to_string(),
        };
        reasons.push((
            "handler_does_not_serve_enqueuer",
            format!(
                "the handler of kind {} was registered by {by} holds none of the rights of {}, the job's enqueuer: \
                 the background workers leave the job to external workers",
                job.kind, job.enqueuer
            ),
        ));
        return;
    }
    if runnable_handler(handler, &job.enqueuer, registered_by).is_none() {
        let why = match (&job.handler_owner, job.reads_handlers) {
            (None, true) => format!("the handler {handler} does not exist"),
            (Some(owner), true) => format!(
                "{} may not run the handler {handler}: it may not execute it, or its owner {owner} holds none \
                 of its rights",
                job.enqueuer
            ),
            (_, false) => format!(
                "{} may not run the handler of kind {}: it is gone, {} may not execute it, or its owner holds \
                 none of its rights",
                job.enqueuer, job.kind, job.enqueuer
            ),
        };
        reasons.push((
            "handler_not_executable",
            format!("{why}; a background worker that claims the job fails it target_rejected"),
        ));
    }
    if let Some(why) = why_no_worker_runs(&job.database) {
        reasons.push(("worker_off", why));
    }
}

fn diagnose(job: &Job) -> Vec<Reason> {
    let mut reasons = Vec::new();
    match job.state.as_str() {
        "succeeded" | "failed" | "cancelled" => {
            let at = job.finished_at.as_deref().unwrap_or("an unknown time");
            reasons.push(("finished", format!("the job ended {} at {at}", job.state)));
            return reasons;
        }
        "running" => {
            let owner = job.lease_owner.as_deref().unwrap_or_default();
            let until = job.lease_expires_at.as_deref().unwrap_or_default();
            let detail = if job.lease_live == Some(true) {
                format!(
                    "attempt {} of {} runs on worker {owner}, its lease until {until}",
                    job.attempts, job.max_attempts
                )
            } else if job.attempts < job.max_attempts {
                format!(
                    "attempt {} lost its lease (worker {owner}) at {until}: a claim takes the job again when its \
                     queue lets it",
                    job.attempts
                )
            } else {
                format!(
                    "attempt {}, its last, lost its lease (worker {owner}) at {until}: the job ends lease_expired",
                    job.attempts
                )
            };
            reasons.push(("running", detail));
            // A lapsed lease waits for its queue as an available job does.
            if job.lease_live == Some(true) || job.attempts >= job.max_attempts {
                return reasons;
            }
            queue_reasons(job, &mut reasons);
            return reasons;
        }
        _ => {}
    }
    if job.due_later {
        let retry = if job.attempts > 0 {
            format!(", a retry after attempt {}", job.attempts)
        } else {
            String::new()
        };
        reasons.push(("scheduled_later", format!("the job is due at {}{retry}", job.run_after)));
    }
    let open = queue_reasons(job, &mut reasons);
    match (&job.handler, &job.registered_by) {
        (Some(handler), Some(registered_by)) => handler_reasons(job, handler, registered_by, &mut reasons),
        _ => reasons.push((
            "no_handler",
            format!(
                "no handler is registered for kind {}: only an external worker that claims it runs the job",
                job.kind
            ),
        )),
    }
    if !job.due_later && open {
        reasons.push((
            "ready",
            format!(
                "nothing in queue {} holds the job back: the next claim of its queue and kind takes it",
                job.queue
            ),
        ));
    }
    reasons
}

/// The reasons the job's queue gives (paused, full); whether it admits a claim now.
fn queue_reasons(job: &Job, reasons: &mut Vec<Reason>) -> bool {
    if job.paused {
        let since = match job.reads_controls {
            true => format!(
                ", since {} by {}",
                job.paused_at.as_deref().unwrap_or_default(),
                job.paused_by.as_deref().unwrap_or_default()
            ),
            false => String::new(),
        };
        reasons.push(("queue_paused", format!("queue {} is paused{since}", job.queue)));
    }
    let full =
        matches!((job.limit, job.running), (Some(limit), Some(running)) if running >= i64::from(limit));
    if full {
        let detail = match job.reads_summary {
            true => format!(
                "queue {} runs {} jobs, its concurrency limit",
                job.queue,
                job.running.unwrap_or_default()
            ),
            false => format!("queue {} runs as many jobs as its concurrency limit", job.queue),
        };
        reasons.push(("queue_at_concurrency_limit", detail));
    }
    // Other roles' jobs may share the key: their count only to who reads the queue summary.
    let key_full = matches!((job.key_limit, job.key_running), (Some(limit), Some(running)) if running >= i64::from(limit));
    if key_full {
        let key = job.concurrency_key.as_deref().unwrap_or_default();
        let detail = match job.reads_summary {
            true => format!(
                "concurrency key {key} runs {} jobs in queue {}, the queue's limit per key",
                job.key_running.unwrap_or_default(),
                job.queue
            ),
            false => {
                format!("concurrency key {key} runs as many jobs as the limit per key of queue {}", job.queue)
            }
        };
        reasons.push(("key_at_concurrency_limit", detail));
    }
    if let (Some(rate), Some(burst), Some(next)) = (job.rate, job.burst, &job.next_token_at) {
        reasons.push((
            "rate_limited",
            format!(
                "queue {} starts at most {rate} jobs a second (burst {burst}); its next start is at {next}",
                job.queue
            ),
        ));
    }
    !job.paused && !full && !key_full && job.next_token_at.is_none()
}

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn diagnose_durable_job(
    job_id: Option<i64>,
) -> TableIterator<'static, (name!(reason, String), name!(detail, String))> {
    let job_id = arguments::required(job_id, "job_id");
    let reasons = reasons_for(job_id);
    TableIterator::new(reasons.into_iter().map(|(reason, detail)| (reason.to_string(), detail)))
}
