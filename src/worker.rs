//! The background worker: poll, claim one job whose kind has a handler, run it, repeat.
//!
//! Transaction 1 claims and commits the lease, so a crash after it loses nothing: the job is
//! claimed again once the lease expires. Transaction 2 runs the handler (see `execution`).

use crate::execution;
use crate::lease;
use crate::metrics::{self, Counter};
use crate::privilege::with_pinned_search_path;
use crate::retention;
use crate::settings;
use crate::wakeup;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

pub const WORKER_TYPE: &str = "durable_jobs worker";

/// Registers `durable_jobs.worker_count` workers; called from _PG_init while preloading.
pub fn register_workers() {
    for number in 1..=settings::WORKER_COUNT.get() {
        BackgroundWorkerBuilder::new(&format!("{WORKER_TYPE} {number}"))
            .set_type(WORKER_TYPE)
            .set_library("durable_jobs")
            .set_function("durable_jobs_worker_main")
            .set_argument(Some(pg_sys::Datum::from(number)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(Some(Duration::from_secs(5)))
            .load();
    }
}

unsafe extern "C-unwind" {
    // PostgreSQL's own SIGTERM handler: it makes the next CHECK_FOR_INTERRUPTS exit, also in
    // the middle of a handler's statement, where pgrx's flag-only handler would wait for it.
    fn die(signal: std::ffi::c_int);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn durable_jobs_worker_main(argument: pg_sys::Datum) {
    let number = argument.value() as i32;
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    unsafe { pg_sys::pqsignal(pg_sys::SIGTERM as i32, Some(die)) };
    BackgroundWorker::connect_worker_to_spi(Some(&settings::database()), None);
    set_application_name(number);
    wakeup::publish_worker(number);
    log!("{WORKER_TYPE} {number} started");

    let worker_id = format!("durable_jobs-worker-{number}");
    let mut last_prune = Instant::now();
    loop {
        pg_sys::check_for_interrupts!();
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let enabled = settings::WORKER_ENABLED.get();
        let found_job = enabled && poll_once(&worker_id);
        if enabled && last_prune.elapsed() >= PRUNE_EVERY {
            prune_finished_jobs();
            last_prune = Instant::now();
        }
        if !found_job && !BackgroundWorker::wait_latch(Some(settings::poll_interval())) {
            break;
        }
    }
    log!("{WORKER_TYPE} {number} stopped");
}

/// Names the worker in pg_stat_activity.application_name, beside its backend_type.
fn set_application_name(number: i32) {
    let name = std::ffi::CString::new(format!("{WORKER_TYPE} {number}")).expect("no NUL");
    unsafe {
        pg_sys::SetConfigOption(
            c"application_name".as_ptr(),
            name.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
        );
    }
}

/// One poll: claim up to `durable_jobs.claim_batch_size` jobs and run them, each in its own
/// subtransaction, all finished in one commit. Returns whether any job was claimed.
fn poll_once(worker_id: &str) -> bool {
    let claimed = BackgroundWorker::transaction(|| {
        if !extension_ready() {
            return None;
        }
        let lease_seconds = settings::default_lease_seconds();
        let batch = settings::CLAIM_BATCH_SIZE.get();
        let jobs = with_pinned_search_path(|| lease::claim_jobs(worker_id, None, lease_seconds, true, batch));
        Some(jobs.into_iter().map(|job| (job.job_id, job.lease_token)).collect::<Vec<_>>())
    });
    match claimed {
        // Quietly wait for CREATE EXTENSION (or ALTER EXTENSION UPDATE).
        None => false,
        Some(jobs) if jobs.is_empty() => {
            metrics::count(Counter::IdlePolls);
            false
        }
        Some(jobs) => {
            for _ in &jobs {
                metrics::count(Counter::Claimed);
            }
            BackgroundWorker::transaction(|| execution::run_jobs(&jobs, worker_id));
            true
        }
    }
}

const PRUNE_EVERY: Duration = Duration::from_secs(1);
const PRUNE_BATCH: i64 = 1000;
const PRUNE_BATCHES_PER_ROUND: usize = 20;

/// Deletes jobs finished longer than `durable_jobs.retention_period` ago, in small batches, one
/// transaction each, so that no long lock or transaction holds up the queue.
fn prune_finished_jobs() {
    let retention = settings::RETENTION_PERIOD.get();
    if retention == 0 {
        return;
    }
    for _ in 0..PRUNE_BATCHES_PER_ROUND {
        let deleted = BackgroundWorker::transaction(|| {
            if !extension_ready() {
                return 0;
            }
            let older_than = Interval::from_seconds(f64::from(retention));
            with_pinned_search_path(|| retention::delete_finished_jobs(older_than, PRUNE_BATCH))
        });
        if deleted < PRUNE_BATCH {
            break;
        }
    }
}

/// Whether this database has the extension at the version of this library; an older schema
/// may lack what the worker uses, so the worker waits for `ALTER EXTENSION durable_jobs UPDATE`.
fn extension_ready() -> bool {
    Spi::get_one_with_args::<bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension
                        WHERE extname = 'durable_jobs' AND extversion = $1)",
        &[env!("CARGO_PKG_VERSION").into()],
    )
    .ok()
    .flatten()
    .unwrap_or(false)
}
