//! Fault and load scenarios against a real cluster. Each records every enqueued job and every
//! handler effect (a table keyed by the job's number, without a unique constraint, so a
//! duplicate would show), then checks: no job lost, no effect applied twice, no terminal job with
//! a payload, and effects matching succeeded jobs. Each prints one summary line.
//!
//! All traffic is to a cluster on 127.0.0.1 that the test starts; every loop is bounded.

use harness::{count, wait_until, Cluster, WORKER_CONF};
use postgres::Client;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Jobs carry their number `n`; the handler fails transiently at `fail_rate`, else records `n`.
const SETUP: &str = "
    CREATE TABLE public.enqueued (n bigint, job_id bigint);
    CREATE TABLE public.effects (n bigint, applied_by text);
    CREATE FUNCTION public.apply_effect(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        IF random() < (payload->>'fail_rate')::float8 THEN
            RAISE EXCEPTION 'transient trouble' USING ERRCODE = '40001';
        END IF;
        INSERT INTO public.effects VALUES ((payload->>'n')::bigint, 'worker');
    END $$;
    SELECT durable_jobs.register_durable_job_handler('effect', 'public.apply_effect(jsonb)');";

const FAULT_CONF: &str = "durable_jobs.lease_duration = 2\ndurable_jobs.worker_count = 2\n\
                          max_connections = 60\n";

fn enqueue(client: &mut Client, jobs: i64, fail_rate: f64) {
    client
        .execute(
            "INSERT INTO public.enqueued
             SELECT g, durable_jobs.enqueue_durable_job('effect',
                        jsonb_build_object('n', g, 'fail_rate', $2::float8),
                        NULL, 'default', now(), 10)
             FROM generate_series(1::bigint, $1::bigint) g",
            &[&jobs, &fail_rate],
        )
        .expect("enqueue");
}

/// A small deterministic generator for the external workers' failure draws.
struct Draws(u64);

impl Draws {
    fn next_unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One claim and its outcome, the way an external worker would do it: the effect and the
/// fenced completion commit together, so a stale completion leaves no effect.
fn external_step(
    client: &mut Client,
    name: &str,
    fail_rate: f64,
    draws: &mut Draws,
    work: Duration,
) -> Result<bool, postgres::Error> {
    let Some(row) = client.query_opt(
        "SELECT job_id, lease_token::text, (payload->>'n')::bigint FROM durable_jobs.claim_next_durable_job($1)",
        &[&name],
    )?
    else {
        return Ok(false);
    };
    let (job_id, token, n): (i64, String, i64) = (row.get(0), row.get(1), row.get(2));
    thread::sleep(work);
    if draws.next_unit() < fail_rate {
        client.query_one(
            "SELECT durable_jobs.fail_durable_job($1, $2, $3::text::uuid, 'target_unavailable')",
            &[&job_id, &name, &token],
        )?;
        return Ok(true);
    }
    let mut txn = client.transaction()?;
    txn.execute("INSERT INTO public.effects VALUES ($1, 'external')", &[&n])?;
    let outcome: String = txn
        .query_one(
            "SELECT durable_jobs.complete_durable_job($1, $2, $3::text::uuid)",
            &[&job_id, &name, &token],
        )?
        .get(0);
    if outcome == "succeeded" {
        txn.commit()?;
    } else {
        txn.rollback()?;
    }
    Ok(true)
}

struct ExternalWorkers {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl ExternalWorkers {
    fn start(cluster: &Arc<Cluster>, count: usize, fail_rate: f64, work: Duration) -> ExternalWorkers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|i| {
                let (cluster, stop) = (Arc::clone(cluster), Arc::clone(&stop));
                thread::spawn(move || {
                    let name = format!("external-{i}");
                    let mut draws = Draws(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1));
                    let connect = || {
                        let mut client = cluster.connect_when_ready(Duration::from_secs(60));
                        client.batch_execute(&format!("SET application_name = 'external-{i}'")).unwrap();
                        client
                    };
                    let mut client = connect();
                    while !stop.load(Ordering::Relaxed) {
                        match external_step(&mut client, &name, fail_rate, &mut draws, work) {
                            Ok(true) => {}
                            Ok(false) => thread::sleep(Duration::from_millis(20)),
                            // Terminated, or the server restarted: reconnect and go on.
                            Err(_) => client = connect(),
                        }
                    }
                })
            })
            .collect();
        ExternalWorkers { stop, threads }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            thread.join().expect("external worker");
        }
    }
}

struct Tally {
    jobs: i64,
    lost: i64,
    duplicated: i64,
    recovered: i64,
}

/// Waits until every job is terminal, then checks the guarantees and prints the summary.
fn drain_and_check(cluster: &Cluster, scenario: &str, jobs: i64, started: Instant) -> Tally {
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    wait_until(Duration::from_secs(600), &format!("{scenario}: every job terminal"), || {
        match client.query_one("SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NULL", &[])
        {
            Ok(row) => row.get::<_, i64>(0) == 0,
            Err(_) => {
                client = cluster.connect_when_ready(Duration::from_secs(60));
                false
            }
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let lost = count(
        &mut client,
        "SELECT count(*) FROM public.enqueued e LEFT JOIN durable_jobs.durable_job j USING (job_id)
         WHERE j.job_id IS NULL OR j.finished_at IS NULL",
    );
    let duplicated = count(
        &mut client,
        "SELECT count(*) FROM (SELECT n FROM public.effects GROUP BY n HAVING count(*) > 1) d",
    );
    let recovered = count(
        &mut client,
        "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded' AND attempt_count > 1",
    );
    let tally = Tally { jobs, lost, duplicated, recovered };
    println!(
        "{scenario}: jobs {}, lost {}, duplicated {}, recovered {}, seconds {seconds:.1}",
        tally.jobs, tally.lost, tally.duplicated, tally.recovered
    );
    assert_eq!(count(&mut client, "SELECT count(*) FROM public.enqueued"), jobs);
    assert_eq!((tally.lost, tally.duplicated), (0, 0), "{scenario}");
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NOT NULL AND payload IS NOT NULL"),
        0,
        "{scenario}: a terminal job kept its payload"
    );
    // Every succeeded job left exactly one effect, and no other job left any.
    assert_eq!(
        count(
            &mut client,
            "SELECT count(*) FROM public.enqueued e JOIN durable_jobs.durable_job j USING (job_id)
             WHERE (j.job_state = 'succeeded') <> EXISTS (SELECT 1 FROM public.effects f WHERE f.n = e.n)"
        ),
        0,
        "{scenario}: effects do not match succeeded jobs"
    );
    tally
}

/// A cluster under load: the handler set up, four external workers running beside the
/// background workers, and `jobs` enqueued, a tenth of whose attempts fail transiently.
fn start_load(conf: &str, jobs: i64) -> (Arc<Cluster>, ExternalWorkers, Instant) {
    let cluster = Arc::new(Cluster::start(conf));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();
    let started = Instant::now();
    let externals = ExternalWorkers::start(&cluster, 4, 0.1, Duration::ZERO);
    enqueue(&mut client, jobs, 0.1);
    (cluster, externals, started)
}

fn kill_a_worker(cluster: &Cluster) {
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    let mut pids = Vec::new();
    wait_until(Duration::from_secs(60), "a worker to kill", || {
        pids = cluster.worker_pids(&mut client);
        !pids.is_empty()
    });
    let victim = pids[pids.len() / 2].to_string();
    std::process::Command::new("kill").args(["-9", &victim]).status().expect("kill -9");
}

#[test]
fn soak_with_workers_external_workers_and_transient_failures() {
    const JOBS: i64 = 10_000;
    let (cluster, externals, started) =
        start_load(&format!("{WORKER_CONF}durable_jobs.worker_count = 2\n"), JOBS);
    let tally = drain_and_check(&cluster, "soak", JOBS, started);
    let mut client = cluster.connect();
    externals.stop();
    assert!(tally.recovered > 0, "about a tenth of the jobs needed a second attempt");

    // Counters agree with the rows: the workers' successes plus the external ones.
    let worker_successes = harness::metric(&mut client, "succeeded");
    let external_successes =
        count(&mut client, "SELECT count(*) FROM public.effects WHERE applied_by = 'external'");
    let succeeded =
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'");
    assert_eq!(worker_successes + external_successes, succeeded);
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM public.effects WHERE applied_by = 'worker'"),
        worker_successes
    );
    assert!(worker_successes > 0 && external_successes > 0, "both kinds of worker took part");
}

#[test]
fn kill_minus_nine_of_workers_during_the_soak() {
    const JOBS: i64 = 4_000;
    let (cluster, externals, started) = start_load(&format!("{WORKER_CONF}{FAULT_CONF}"), JOBS);
    // Several kills at uneven moments while the queue drains.
    for pause_ms in [400u64, 1100, 700] {
        thread::sleep(Duration::from_millis(pause_ms));
        kill_a_worker(&cluster);
    }
    drain_and_check(&cluster, "kill_minus_nine", JOBS, started);
    externals.stop();
    assert_workers_took_part(&cluster);
}

/// The background workers ran some of the jobs (not only the external workers).
fn assert_workers_took_part(cluster: &Cluster) {
    let mut client = cluster.connect();
    assert!(count(&mut client, "SELECT count(*) FROM public.effects WHERE applied_by = 'worker'") > 0);
}

#[test]
fn immediate_shutdown_mid_load_then_restart_and_drain() {
    const JOBS: i64 = 4_000;
    let (cluster, externals, started) = start_load(&format!("{WORKER_CONF}{FAULT_CONF}"), JOBS);
    thread::sleep(Duration::from_millis(800));
    cluster.pg_ctl(&["stop", "-m", "immediate", "-w"]);
    thread::sleep(Duration::from_millis(300));
    cluster.pg_ctl(&["start", "-w", "-t", "60"]);
    drain_and_check(&cluster, "immediate_shutdown", JOBS, started);
    externals.stop();
    assert_workers_took_part(&cluster);
}

#[test]
fn terminated_external_workers_leave_jobs_that_come_back() {
    const JOBS: i64 = 300;
    // External workers only: the background worker is off.
    let cluster = Arc::new(Cluster::start(
        "shared_preload_libraries = 'durable_jobs'\n\
                                           durable_jobs.lease_duration = 1\n",
    ));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();
    let started = Instant::now();
    let externals = ExternalWorkers::start(&cluster, 4, 0.0, Duration::from_millis(30));
    enqueue(&mut client, JOBS, 0.0);
    // Terminate the external workers' sessions a few times while they hold leases.
    let mut terminated = 0;
    for _ in 0..5 {
        thread::sleep(Duration::from_millis(300));
        terminated += client
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE application_name LIKE 'external-%'",
                &[],
            )
            .unwrap()
            .len();
    }
    let tally = drain_and_check(&cluster, "terminated_external_workers", JOBS, started);
    externals.stop();
    assert!(terminated > 0);
    assert!(tally.recovered > 0, "jobs whose holder was terminated came back after their lease");
    assert!(count(&mut client, "SELECT count(*) FROM public.effects WHERE applied_by = 'worker'") == 0);
}

#[test]
fn a_long_open_transaction_holding_back_vacuum_while_jobs_flow() {
    const JOBS: i64 = 3_000;
    let cluster = Arc::new(Cluster::start(&format!("{WORKER_CONF}durable_jobs.worker_count = 2\n")));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();

    // An old snapshot holds back vacuum while the first half of the jobs flows.
    let mut holder = cluster.connect();
    let mut snapshot =
        holder.build_transaction().isolation_level(postgres::IsolationLevel::RepeatableRead).start().unwrap();
    snapshot.query_one("SELECT count(*) FROM durable_jobs.durable_job", &[]).unwrap();
    let started = Instant::now();
    enqueue(&mut client, JOBS / 2, 0.0);
    wait_until(Duration::from_secs(300), "the first half", || {
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'")
            == JOBS / 2
    });
    let held_rate = (JOBS / 2) as f64 / started.elapsed().as_secs_f64();
    snapshot.rollback().unwrap();
    // What autovacuum does soon after the old snapshot is gone, done now.
    client.batch_execute("VACUUM durable_jobs.durable_job").unwrap();

    let second_half = Instant::now();
    client
        .execute(
            "INSERT INTO public.enqueued
             SELECT g, durable_jobs.enqueue_durable_job('effect', jsonb_build_object('n', g, 'fail_rate', 0))
             FROM generate_series($1::bigint + 1, $1::bigint * 2) g",
            &[&(JOBS / 2)],
        )
        .unwrap();
    drain_and_check(&cluster, "long_open_transaction", JOBS, started);
    let released_rate = (JOBS / 2) as f64 / second_half.elapsed().as_secs_f64();
    println!(
        "long_open_transaction: jobs/s {held_rate:.0} while an old snapshot was held, \
         {released_rate:.0} after it ended and vacuum ran"
    );
}
