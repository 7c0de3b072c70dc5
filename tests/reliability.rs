//! Fault and load scenarios against a real cluster. Each records every enqueued job and every
//! handler effect (a table keyed by the job's number, without a unique constraint, so a
//! duplicate would show), then checks: no job lost, no effect applied twice, no terminal job with
//! a payload, and effects matching succeeded jobs. Each prints one summary line.
//!
//! All traffic is to a cluster on 127.0.0.1 that the test starts; every loop is bounded.

use harness::{count, wait_until, workers_waiting_on, Cluster, WORKER_CONF};
use postgres::Client;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Jobs carry their number `n`; the handler fails transiently at `fail_rate`, else records `n`.
/// A job with `hold` first waits for advisory lock 4343 (`a_job_in_flight`).
const SETUP: &str = "
    CREATE TABLE public.enqueued (n bigint, job_id bigint);
    CREATE TABLE public.effects (n bigint, applied_by text);
    CREATE FUNCTION public.apply_effect(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        IF (payload->>'hold')::boolean THEN
            PERFORM pg_advisory_xact_lock(4343);
        END IF;
        IF random() < (payload->>'fail_rate')::float8 THEN
            RAISE EXCEPTION 'transient trouble' USING ERRCODE = '40001';
        END IF;
        INSERT INTO public.effects VALUES ((payload->>'n')::bigint, 'worker');
    END $$;
    SELECT durable_jobs.register_durable_job_handler('effect', 'public.apply_effect(jsonb)');";

/// Leases of 10 s: a handler waits up to its statement timeout, a little shorter than that,
/// before it is cancelled by itself, far longer than the moment between a fault's target being
/// seen at work and the fault.
const FAULT_CONF: &str = "durable_jobs.lease_duration = 10\ndurable_jobs.worker_count = 2\n\
                          max_connections = 60\n";

/// Work in flight for a fault to hit, seen, not hoped for: `holder` takes advisory lock 4343, a
/// job numbered `n` is enqueued (queue `held`, which the external workers leave alone; first in
/// claim order) whose handler waits for that lock, and this returns its job id and the pid of the
/// background worker running it, once that worker waits on the lock. Its fault must cost the job
/// that attempt: it ends succeeded with two attempts or more.
fn a_job_in_flight(cluster: &Cluster, holder: &mut Client, n: i64) -> (i64, i32) {
    holder.execute("SELECT pg_advisory_lock(4343)", &[]).unwrap();
    let job_id: i64 = holder
        .query_one(
            "INSERT INTO public.enqueued
             SELECT $1::bigint,
                    durable_jobs.enqueue_durable_job('effect', jsonb_build_object('n', $1::bigint, 'fail_rate', 0, 'hold', true),
                                                         NULL, 'held', now(), 10, priority => 100)
             RETURNING job_id",
            &[&n],
        )
        .unwrap()
        .get(0);
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    let mut pid = None;
    wait_until(Duration::from_secs(60), "a background worker in the held job's handler", || {
        pid = client
            .query_opt(
                "SELECT pid FROM pg_stat_activity
                 WHERE backend_type = 'durable_jobs worker' AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
                &[],
            )
            .unwrap()
            .map(|row| row.get(0));
        pid.is_some()
    });
    (job_id, pid.unwrap())
}

/// The job `a_job_in_flight` made ran again after its fault and succeeded.
fn assert_ran_again(client: &mut Client, job_id: i64, scenario: &str) {
    let (state, _, attempts) = harness::job_outcome(client, &format!("job_id = {job_id}"));
    assert!(
        state == "succeeded" && attempts >= 2,
        "{scenario}: the job in flight at the fault: {state}, {attempts} attempts"
    );
}

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

/// What one external step did.
enum Step {
    Idle,
    Done,
    /// The fenced call answered `stale`: the lease was lost, and the effect rolled back with it.
    Stale,
}

/// How the external workers work: each attempt fails at `fail_rate`; with `late`, every
/// `late.1`-th claim takes a `late.0`-second lease and outlives it before completing.
#[derive(Clone, Copy)]
struct ExternalWork {
    fail_rate: f64,
    work: Duration,
    late: Option<(i32, u64)>,
}

/// One claim and its outcome, the way an external worker would do it: the effect and the
/// fenced completion commit together, so a stale completion leaves no effect.
fn external_step(
    client: &mut Client,
    name: &str,
    how: ExternalWork,
    draws: &mut Draws,
    claims: &mut u64,
) -> Result<Step, postgres::Error> {
    *claims += 1;
    let late = how.late.filter(|(_, every)| *claims % every == 0);
    let lease_seconds = late.map(|(seconds, _)| seconds);
    let Some(row) = client.query_opt(
        "SELECT job_id, lease_token::text, (payload->>'n')::bigint
         FROM durable_jobs.claim_next_durable_job($1, ARRAY['default'], $2)",
        &[&name, &lease_seconds],
    )?
    else {
        return Ok(Step::Idle);
    };
    let (job_id, token, n): (i64, String, i64) = (row.get(0), row.get(1), row.get(2));
    thread::sleep(match late {
        Some((seconds, _)) => Duration::from_millis(seconds as u64 * 1000 + 300),
        None => how.work,
    });
    if draws.next_unit() < how.fail_rate {
        let outcome: String = client
            .query_one(
                "SELECT durable_jobs.fail_durable_job($1, $2, $3::text::uuid, 'target_unavailable')",
                &[&job_id, &name, &token],
            )?
            .get(0);
        return Ok(if outcome == "stale" { Step::Stale } else { Step::Done });
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
        Ok(Step::Done)
    } else {
        txn.rollback()?;
        Ok(Step::Stale)
    }
}

/// What the external workers met, for the scenario to assert.
#[derive(Default, Debug)]
struct ExternalTally {
    stale: u64,
    /// Errors of a lost connection (terminated, server stopping or crashed): reconnected.
    connection_errors: u64,
    /// Any other error: a bug, which the scenario fails on.
    unexpected_errors: Vec<String>,
}

struct ExternalWorkers {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<ExternalTally>>,
}

impl ExternalWorkers {
    fn start(cluster: &Arc<Cluster>, count: usize, how: ExternalWork) -> ExternalWorkers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|i| {
                let (cluster, stop) = (Arc::clone(cluster), Arc::clone(&stop));
                thread::spawn(move || {
                    let name = format!("external-{i}");
                    let mut draws = Draws(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1));
                    let mut claims = 0;
                    let mut tally = ExternalTally::default();
                    let connect = || {
                        let mut client = cluster.connect_when_ready(Duration::from_secs(60));
                        client.batch_execute(&format!("SET application_name = 'external-{i}'")).unwrap();
                        client
                    };
                    let mut client = connect();
                    while !stop.load(Ordering::Relaxed) {
                        match external_step(&mut client, &name, how, &mut draws, &mut claims) {
                            Ok(Step::Done) => {}
                            Ok(Step::Stale) => tally.stale += 1,
                            Ok(Step::Idle) => thread::sleep(Duration::from_millis(20)),
                            Err(error) => {
                                // Class 57 (terminated, shutting down, crashed) and 08
                                // (connection) are the faults the scenarios cause.
                                let class = error.code().map(|code| code.code()[..2].to_string());
                                if client.is_closed() || matches!(class.as_deref(), Some("57" | "08")) {
                                    tally.connection_errors += 1;
                                } else {
                                    tally.unexpected_errors.push(harness::error_text(&error));
                                }
                                client = connect();
                            }
                        }
                    }
                    tally
                })
            })
            .collect();
        ExternalWorkers { stop, threads }
    }

    /// Stops them; fails on any error that was not a lost connection. Broken on purpose: with a
    /// misspelt failure code, each fail_durable_job raised 22023, which the old loop took for a
    /// lost connection and reconnected; now the scenario fails here.
    fn stop(self) -> ExternalTally {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = ExternalTally::default();
        for thread in self.threads {
            let tally = thread.join().expect("external worker");
            total.stale += tally.stale;
            total.connection_errors += tally.connection_errors;
            total.unexpected_errors.extend(tally.unexpected_errors);
        }
        assert!(
            total.unexpected_errors.is_empty(),
            "external workers met errors: {:?}",
            total.unexpected_errors
        );
        total
    }
}

struct Tally {
    recovered: i64,
}

/// Waits until every job is terminal, then checks that everything was done: every enqueued job
/// exists and succeeded (each had ten attempts for failures at most one in ten, so none may end
/// failed), left exactly one effect, and no terminal job kept its payload; prints the summary.
/// `recovered`: succeeded jobs that needed more than one attempt. Broken on purpose: with the
/// handler failing every 200th job for good (22023), the old check (a job lost only when missing
/// or unfinished) passed and this one failed ("every job succeeded").
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
    let not_succeeded = count(
        &mut client,
        "SELECT count(*) FROM public.enqueued e LEFT JOIN durable_jobs.durable_job j USING (job_id)
         WHERE j.job_state IS DISTINCT FROM 'succeeded'",
    );
    let effects = count(&mut client, "SELECT count(*) FROM public.effects");
    let duplicated = count(
        &mut client,
        "SELECT count(*) FROM (SELECT n FROM public.effects GROUP BY n HAVING count(*) > 1) d",
    );
    let recovered = count(
        &mut client,
        "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded' AND attempt_count > 1",
    );
    println!(
        "{scenario}: jobs {jobs}, not succeeded {not_succeeded}, effects {effects}, duplicated {duplicated}, \
         recovered {recovered}, seconds {seconds:.1}"
    );
    assert_eq!(count(&mut client, "SELECT count(*) FROM public.enqueued"), jobs);
    assert_eq!(not_succeeded, 0, "{scenario}: every job succeeded");
    assert_eq!((effects, duplicated), (jobs, 0), "{scenario}: one effect per job");
    assert_eq!(
        count(
            &mut client,
            "SELECT count(*) FROM public.enqueued e WHERE NOT EXISTS (SELECT 1 FROM public.effects f WHERE f.n = e.n)"
        ),
        0,
        "{scenario}: every job's own effect"
    );
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NOT NULL AND payload IS NOT NULL"),
        0,
        "{scenario}: a terminal job kept its payload"
    );
    Tally { recovered }
}

/// A cluster under load: the handler set up, four external workers running beside the
/// background workers, and `jobs` enqueued whose attempts fail transiently at `fail_rate`.
fn start_load(conf: &str, jobs: i64, fail_rate: f64) -> (Arc<Cluster>, ExternalWorkers, Instant) {
    let cluster = Arc::new(Cluster::start(conf));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();
    let started = Instant::now();
    let externals =
        ExternalWorkers::start(&cluster, 4, ExternalWork { fail_rate, work: Duration::ZERO, late: None });
    enqueue(&mut client, jobs, fail_rate);
    (cluster, externals, started)
}

/// Kills a background worker with SIGKILL, checks the kill took, and waits until the server has
/// restarted its workers (new pids).
fn kill_a_worker(cluster: &Cluster) {
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    let mut pids = Vec::new();
    wait_until(Duration::from_secs(60), "a worker to kill", || {
        pids = cluster.worker_pids(&mut client);
        !pids.is_empty()
    });
    cluster.kill_worker_and_await_restart(pids[pids.len() / 2], &pids);
}

/// Counters agree with the rows: the background workers' successes are their effects, the SQL
/// API's (`sql_api_succeeded`, counted since 0.6.0, when `succeeded` counted the background
/// workers' only and was compared with their effects alone) the external workers'. (Counting
/// each success before its batch commits, broken on purpose, went unnoticed in these scenarios:
/// no fault here rolls a batch back after a success, as cancels land inside a job's
/// subtransaction and the worker obeys a terminate between batches.)
fn assert_counters_match_rows(client: &mut Client, scenario: &str) {
    let by_sql_api = harness::metric(client, "sql_api_succeeded");
    assert_eq!(
        harness::metric(client, "succeeded") - by_sql_api,
        count(client, "SELECT count(*) FROM public.effects WHERE applied_by = 'worker'"),
        "{scenario}: the succeeded counter against the workers' effects"
    );
    assert_eq!(
        by_sql_api,
        count(client, "SELECT count(*) FROM public.effects WHERE applied_by = 'external'"),
        "{scenario}: the sql_api_succeeded counter against the external workers' effects"
    );
}

#[test]
fn soak_with_workers_external_workers_and_transient_failures() {
    const JOBS: i64 = 10_000;
    let cluster = Arc::new(Cluster::start(&format!("{WORKER_CONF}durable_jobs.worker_count = 2\n")));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();
    let started = Instant::now();
    // Every 25th external claim takes a one-second lease and outlives it: its completion must
    // come back stale and leave no effect, while another worker runs the job.
    let externals = ExternalWorkers::start(
        &cluster,
        4,
        ExternalWork { fail_rate: 0.1, work: Duration::ZERO, late: Some((1, 25)) },
    );
    enqueue(&mut client, JOBS, 0.1);
    let tally = drain_and_check(&cluster, "soak", JOBS, started);
    let externals = externals.stop();
    println!("soak: external {externals:?}");
    assert!(tally.recovered > 0, "about a tenth of the jobs needed a second attempt");
    assert!(externals.stale > 0, "late external completions were stale");
    assert_eq!(externals.connection_errors, 0, "no fault in the soak");
    assert_counters_match_rows(&mut client, "soak");
    let external_successes =
        count(&mut client, "SELECT count(*) FROM public.effects WHERE applied_by = 'external'");
    assert!(
        harness::metric(&mut client, "succeeded") > 0 && external_successes > 0,
        "both kinds of worker took part"
    );
}

/// The first kill hits a worker seen running a handler (`a_job_in_flight`); two more land at
/// uneven moments while the queue drains, on whatever is in flight then. Broken on purpose:
/// with the aimed kill replaced by releasing the lock, the held job ran once and the test failed
/// (it asserted `recovered > 0` before, which a fast machine that drained the queue before the
/// kills would have failed).
#[test]
fn kill_minus_nine_of_workers_during_the_soak() {
    const JOBS: i64 = 4_000;
    let (cluster, externals, started) = start_load(&format!("{WORKER_CONF}{FAULT_CONF}"), JOBS, 0.0);
    let mut holder = cluster.connect();
    let (held_job, pid) = a_job_in_flight(&cluster, &mut holder, JOBS + 1);
    let mut client = cluster.connect();
    let pids = cluster.worker_pids(&mut client);
    // The crash restart ends every session, the holder's too, and its lock with it.
    cluster.kill_worker_and_await_restart(pid, &pids);
    for pause_ms in [300u64, 500] {
        thread::sleep(Duration::from_millis(pause_ms));
        kill_a_worker(&cluster);
    }
    drain_and_check(&cluster, "kill_minus_nine", JOBS + 1, started);
    let externals = externals.stop();
    assert_ran_again(&mut cluster.connect(), held_job, "kill_minus_nine");
    assert!(externals.connection_errors > 0, "the kills reset the external workers' sessions too");
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
    let (cluster, externals, started) = start_load(&format!("{WORKER_CONF}{FAULT_CONF}"), JOBS, 0.0);
    // Stop while jobs are in flight: a handler a background worker is seen running, five claimed
    // here (committed, never finished), and whatever else the workers are running.
    let mut holder = cluster.connect();
    let (held_job, _) = a_job_in_flight(&cluster, &mut holder, JOBS + 1);
    let mut client = cluster.connect();
    let held: Vec<i64> = (0..5)
        .filter_map(|_| harness::claim(&mut client, "held-at-the-stop", 1).map(|job| job.job_id))
        .collect();
    assert_eq!(held.len(), 5);
    let in_flight =
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'running'");
    drop(client);
    cluster.pg_ctl(&["stop", "-m", "immediate", "-w"]);
    cluster.pg_ctl(&["start", "-w", "-t", "60"]);
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    assert_eq!(count(&mut client, "SELECT 1::bigint"), 1, "the server came back");
    let tally = drain_and_check(&cluster, "immediate_shutdown", JOBS + 1, started);
    externals.stop();
    println!("immediate_shutdown: {in_flight} jobs running just before the stop");
    assert!(tally.recovered >= 5, "jobs in flight at the stop ran again after it");
    assert_ran_again(&mut client, held_job, "immediate_shutdown");
    assert_eq!(
        count(
            &mut client,
            &format!(
                "SELECT count(*) FROM durable_jobs.durable_job
                 WHERE job_id IN ({}) AND job_state = 'succeeded' AND attempt_count >= 2",
                held.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
            )
        ),
        5,
        "the five held at the stop ran again after their leases"
    );
    assert_workers_took_part(&cluster);
}

/// Background workers cancelled and terminated (no crash: shared memory and its counters stay)
/// while they run batches: a cancel rolls back what it hits, the jobs run again, and the
/// counters count only what committed. A cancel and a terminate each hit a worker seen running a
/// handler (`a_job_in_flight`); forty more signals land at fixed moments on whatever runs then.
/// Broken on purpose: with the two aimed signals left out, the held jobs ran once (it counted
/// signals sent before, which proved nothing of what they hit).
#[test]
fn terminated_background_workers_mid_batch() {
    const JOBS: i64 = 3_000;
    let (cluster, externals, started) = start_load(&format!("{WORKER_CONF}{FAULT_CONF}"), JOBS, 0.1);
    let mut client = cluster.connect();
    let mut holder = cluster.connect();
    let mut held_jobs = Vec::new();
    for (n, signal) in [(JOBS + 1, "pg_cancel_backend"), (JOBS + 2, "pg_terminate_backend")] {
        let (held_job, pid) = a_job_in_flight(&cluster, &mut holder, n);
        let signalled: bool = client.query_one(&format!("SELECT {signal}($1)"), &[&pid]).unwrap().get(0);
        assert!(signalled, "{signal} reached the worker");
        // Then the lock goes, for the job's next attempt, which ends before the next held job
        // comes (a retry of this one would otherwise be the handler seen waiting).
        holder.execute("SELECT pg_advisory_unlock(4343)", &[]).unwrap();
        wait_until(Duration::from_secs(60), "the held job's next attempt", || {
            count(&mut client, &format!("SELECT count(*) FROM durable_jobs.durable_job WHERE job_id = {held_job} AND finished_at IS NOT NULL")) == 1
        });
        held_jobs.push(held_job);
    }
    // Load, not proof (the two aimed signals are that; this counted the signals sent before).
    for round in 0..40 {
        thread::sleep(Duration::from_millis(75));
        // Mostly query cancels, which roll back whatever batch or job they hit; now and then a
        // terminate, which the worker obeys between batches.
        let signal = if round % 10 == 9 { "pg_terminate_backend" } else { "pg_cancel_backend" };
        count(
            &mut client,
            &format!(
                "SELECT count(*) FROM (SELECT {signal}(pid) FROM pg_stat_activity
                                       WHERE backend_type = 'durable_jobs worker') t"
            ),
        );
    }
    drain_and_check(&cluster, "terminated_background_workers", JOBS + 2, started);
    externals.stop();
    for held_job in held_jobs {
        assert_ran_again(&mut client, held_job, "terminated_background_workers");
    }
    assert_counters_match_rows(&mut client, "terminated_background_workers");
    assert_workers_took_part(&cluster);
}

/// A worker terminated while the second job of a batch runs, after the first succeeded in its
/// subtransaction: the whole batch rolls back, both jobs run again after their leases, and the
/// counters (shared memory, which a terminate keeps) count each success once, as the rows do.
/// Deliberate break: counting `succeeded` as each job's subtransaction succeeds (in run_job)
/// instead of publishing the batch's tally after its commit made the counter 3 against 2 rows.
#[test]
fn a_batch_rolled_back_after_a_success_counts_none_of_it() {
    let cluster = Cluster::start(&format!(
        "{WORKER_CONF}durable_jobs.lease_duration = 10\ndurable_jobs.claim_batch_size = 10\n"
    ));
    let mut client = cluster.connect();
    client.batch_execute(SETUP).unwrap();
    client
        .batch_execute(
            "CREATE FUNCTION public.effect_then_wait(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO public.effects VALUES ((payload->>'n')::bigint, 'worker');
                 IF (payload->>'wait')::boolean THEN
                     PERFORM pg_advisory_xact_lock(4242);
                 END IF;
             END $$;
             SELECT durable_jobs.register_durable_job_handler('effect_then_wait', 'public.effect_then_wait(jsonb)');",
        )
        .unwrap();
    let mut blocker = cluster.connect();
    blocker.execute("SELECT pg_advisory_lock(4242)", &[]).unwrap();
    let first_pids = cluster.worker_pids(&mut client);
    // One transaction, so that one claim takes both, the quick one first (job_id order).
    client
        .batch_execute(
            "BEGIN;
             SELECT durable_jobs.enqueue_durable_job('effect_then_wait', '{\"n\": 1, \"wait\": false}');
             SELECT durable_jobs.enqueue_durable_job('effect_then_wait', '{\"n\": 2, \"wait\": true}');
             COMMIT;",
        )
        .unwrap();
    wait_until(Duration::from_secs(30), "the second job's handler waiting on the lock", || {
        workers_waiting_on(&mut client, "advisory") == 1
    });
    // The first job succeeded in its subtransaction; nothing of the batch has committed.
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'running'"),
        2
    );
    count(
        &mut client,
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                               WHERE backend_type = 'durable_jobs worker') t",
    );
    blocker.execute("SELECT pg_advisory_unlock(4242)", &[]).unwrap();
    wait_until(Duration::from_secs(60), "both jobs succeeded after their leases", || {
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'") == 2
    });
    let new_pids = cluster.worker_pids(&mut client);
    assert!(!new_pids.is_empty() && new_pids != first_pids, "the worker was terminated and restarted");
    assert_eq!(
        count(&mut client, "SELECT min(attempt_count)::bigint FROM durable_jobs.durable_job"),
        2,
        "both jobs ran again: the first job's success went with its batch"
    );
    assert_eq!(
        harness::table_rows(&mut client, "public.effects", "n"),
        ["(1,worker)", "(2,worker)"],
        "one effect per job"
    );
    assert_counters_match_rows(&mut client, "a_batch_rolled_back_after_a_success");
}

/// External workers' sessions terminated while they work: what they held comes back after its
/// lease and runs once. One session of the test claims a job and is terminated holding it (aimed:
/// the job must run again); the external workers' sessions are terminated five times meanwhile.
/// (Before, only those unaimed terminations, counted as sent, stood for the proof; broken on
/// purpose, a claim that never takes a lapsed lease, the aimed job stays running and the test
/// fails.)
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
    enqueue(&mut client, JOBS, 0.0);
    let mut victim = cluster.connect();
    let victim_pid: i32 = victim.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let held = harness::claim_from(&mut victim, "external-victim", "default", 1).expect("a job to hold");
    let ended: bool = client.query_one("SELECT pg_terminate_backend($1)", &[&victim_pid]).unwrap().get(0);
    assert!(ended, "the holder was terminated");
    let externals = ExternalWorkers::start(
        &cluster,
        4,
        ExternalWork { fail_rate: 0.0, work: Duration::from_millis(30), late: None },
    );
    wait_until(Duration::from_secs(60), "the external workers' sessions", || {
        count(&mut client, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'external-%'")
            == 4
    });
    // Terminate the external workers' sessions a few times while they work.
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
    wait_until(Duration::from_secs(60), "the held job to run again", || {
        harness::job_outcome(&mut client, &format!("job_id = {}", held.job_id)).0 == "succeeded"
    });
    let tally = drain_and_check(&cluster, "terminated_external_workers", JOBS, started);
    let externals = externals.stop();
    assert!(terminated > 0);
    assert!(externals.connection_errors > 0, "the terminations reached the external workers");
    assert!(tally.recovered > 0, "jobs whose holder was terminated came back after their lease");
    assert_ran_again(&mut client, held.job_id, "terminated_external_workers");
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
    // While the snapshot is held, vacuum may remove none of the versions the jobs left.
    client.batch_execute("CREATE EXTENSION pgstattuple").unwrap();
    client.batch_execute("VACUUM durable_jobs.durable_job").unwrap();
    let dead = |client: &mut Client| {
        count(client, "SELECT dead_tuple_count FROM pgstattuple('durable_jobs.durable_job')")
    };
    let dead_while_held = dead(&mut client);
    assert!(dead_while_held >= JOBS, "each job left at least two dead versions: {dead_while_held}");
    snapshot.rollback().unwrap();
    // What autovacuum does soon after the old snapshot is gone, done now: it removes them. One
    // CI run left 60 of 3,000, about one heap page's worth: most likely a page a worker's poll
    // had pinned, whose dead versions vacuum leaves for the next round ("not removed due to
    // cleanup lock contention"). Autovacuum comes back for them, so vacuum again a few times; a
    // horizon still held would keep them through every round.
    let mut dead_after = i64::MAX;
    for _ in 0..20 {
        client.batch_execute("VACUUM durable_jobs.durable_job").unwrap();
        dead_after = dead(&mut client);
        if dead_after * 100 <= dead_while_held {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        dead_after * 100 <= dead_while_held,
        "vacuum reclaimed {dead_while_held} dead versions, {dead_after} left"
    );

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
         {released_rate:.0} after it ended and vacuum ran; dead versions {dead_while_held} held, {dead_after} after"
    );
}

/// Limits hold through a crash: a queue limited to three running jobs and to one per key, drained
/// by two background workers (batches of ten) and three external claimers while a worker is
/// killed with SIGKILL (its leases lapse and are claimed again). Every handler, background or
/// external, records how many jobs of the queue, and of its key, ran then (live leases): never
/// more than the limits; and every job took effect once. Broken on purpose (the claim's key
/// condition removed), a handler saw two jobs of its key running.
#[test]
fn limits_hold_while_a_worker_is_killed() {
    const JOBS: i64 = 400;
    let cluster =
        Arc::new(Cluster::start(&format!("{WORKER_CONF}{FAULT_CONF}durable_jobs.claim_batch_size = 10\n")));
    let mut client = cluster.connect();
    client
        .batch_execute(&format!(
            "CREATE TABLE public.seen (n bigint, running bigint, running_key bigint, applied_by text);
             CREATE FUNCTION public.note_limits(payload jsonb, who text DEFAULT 'worker') RETURNS void
             LANGUAGE sql AS $$
                 INSERT INTO public.seen
                 SELECT ($1->>'n')::bigint, count(*), count(*) FILTER (WHERE concurrency_key = $1->>'key'), who
                 FROM durable_jobs.durable_job
                 WHERE queue_name = 'limited' AND job_state = 'running' AND lease_expires_at > clock_timestamp() $$;
             CREATE FUNCTION public.note_limits_of_worker(payload jsonb) RETURNS void LANGUAGE sql
                 AS $$ SELECT public.note_limits($1) $$;
             SELECT durable_jobs.register_durable_job_handler('limited_work', 'public.note_limits_of_worker(jsonb)');
             SELECT durable_jobs.set_durable_job_queue_concurrency('limited', 3);
             SELECT durable_jobs.set_durable_job_queue_key_concurrency('limited', 1);
             SELECT count(*) FROM (
                 SELECT durable_jobs.enqueue_durable_job('limited_work', jsonb_build_object('n', g, 'key', 'k' || (g % 7)),
                                                         queue_name => 'limited', concurrency_key => 'k' || (g % 7))
                 FROM generate_series(1, {JOBS}) g) enqueued;"
        ))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // External claimers: claim, record, complete in one transaction; a connection the crash
    // restart ended is opened again.
    let externals: Vec<_> = (0..3)
        .map(|i| {
            let (cluster, stop) = (Arc::clone(&cluster), Arc::clone(&stop));
            thread::spawn(move || {
                let mut client = cluster.connect_when_ready(Duration::from_secs(60));
                while !stop.load(Ordering::Relaxed) {
                    let round = client.batch_execute(&format!(
                        "BEGIN;
                         SELECT public.note_limits(c.payload, 'external'),
                                durable_jobs.complete_durable_job(c.job_id, 'external-{i}', c.lease_token)
                         FROM durable_jobs.claim_next_durable_job('external-{i}', ARRAY['limited']) c;
                         COMMIT;"
                    ));
                    if round.is_err() {
                        thread::sleep(Duration::from_millis(50));
                        client = cluster.connect_when_ready(Duration::from_secs(60));
                    }
                }
            })
        })
        .collect();
    wait_until(Duration::from_secs(60), "a hundred jobs to run", || {
        count(&mut client, "SELECT count(*) FROM public.seen") >= 100
    });
    kill_a_worker(&cluster);
    let mut client = cluster.connect_when_ready(Duration::from_secs(60));
    wait_until(Duration::from_secs(120), "every job to run", || {
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'")
            == JOBS
    });
    stop.store(true, Ordering::Relaxed);
    for external in externals {
        external.join().unwrap();
    }
    assert!(count(&mut client, "SELECT max(running) FROM public.seen") <= 3, "never more than three running");
    assert_eq!(count(&mut client, "SELECT max(running_key) FROM public.seen"), 1, "never two of a key");
    assert_eq!(count(&mut client, "SELECT count(DISTINCT n) FROM public.seen"), JOBS);
    assert_eq!(count(&mut client, "SELECT count(*) FROM public.seen"), JOBS, "each job took effect once");
    assert!(
        count(&mut client, "SELECT count(*) FROM public.seen WHERE applied_by = 'external'") > 0
            && count(&mut client, "SELECT count(*) FROM public.seen WHERE applied_by = 'worker'") > 0,
        "both kinds of worker took part"
    );
}
