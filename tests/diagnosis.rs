//! Why a job failed and why it waits: each job's attempt history, with the error text the
//! handler raised or an external worker passed, readable by exactly the roles that may see the
//! job.

use harness::{claim, complete, count, sqlstate, wait_until, Claimed, Cluster, WORKER_CONF};
use postgres::Client;
use std::time::Duration;

const PRELOADED: &str = "shared_preload_libraries = 'durable_jobs'";

/// One row of get_durable_job_attempts, as text: attempt, worker, outcome, failure code,
/// SQLSTATE, error message, and whether started_at <= ended_at (NULL while running).
type Attempt = (i32, Option<String>, String, Option<String>, Option<String>, Option<String>, Option<bool>);

fn attempts(client: &mut Client, job_id: i64) -> Vec<Attempt> {
    client
        .query(
            "SELECT attempt, worker_id, outcome, failure_code, sqlstate, error_message, started_at <= ended_at
             FROM durable_jobs.get_durable_job_attempts($1)",
            &[&job_id],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6)))
        .collect()
}

fn fail_with_message(client: &mut Client, job: &Claimed, worker: &str, code: &str, message: &str) -> String {
    client
        .query_one(
            "SELECT durable_jobs.fail_durable_job($1, $2, $3::text::uuid, $4, $5)",
            &[&job.job_id, &worker, &job.lease_token, &code, &message],
        )
        .unwrap()
        .get(0)
}

/// Roles of a small deployment: a producer, a member of it, a stranger, each allowed to read
/// job status; the producer's handler fails, quoting the card number it was given.
fn a_producer_whose_handler_fails(cluster: &Cluster) -> i64 {
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE app_producer LOGIN;  CREATE ROLE app_member LOGIN;  CREATE ROLE app_stranger LOGIN;
             GRANT app_producer TO app_member;
             GRANT USAGE ON SCHEMA durable_jobs TO app_producer, app_member, app_stranger;
             GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer),
                 durable_jobs.register_durable_job_handler(text, regprocedure),
                 durable_jobs.wait_for_durable_job(bigint, bigint, double precision),
                 durable_jobs.get_durable_job(bigint), durable_jobs.get_durable_job_attempts(bigint)
               TO app_producer, app_member, app_stranger;
             CREATE SCHEMA app AUTHORIZATION app_producer;",
        )
        .unwrap();
    let mut producer = cluster.connect_as("app_producer");
    producer
        .batch_execute(
            "CREATE FUNCTION app.charge(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
             BEGIN
                 RAISE EXCEPTION 'card % declined', payload->>'card' USING ERRCODE = 'check_violation';
             END $$;
             SELECT durable_jobs.register_durable_job_handler('charge', 'app.charge(jsonb)');",
        )
        .unwrap();
    let job_id: i64 = producer
        .query_one(
            "SELECT durable_jobs.enqueue_durable_job('charge', '{\"card\": \"4242\"}', max_attempts => 2)",
            &[],
        )
        .unwrap()
        .get(0);
    let state: String = producer
        .query_one("SELECT job_state FROM durable_jobs.wait_for_durable_job($1, NULL, 60)", &[&job_id])
        .unwrap()
        .get(0);
    assert_eq!(state, "failed");
    job_id
}

/// The handler's message is kept on each failed attempt (a retryable code would retry; this one,
/// integrity_violation, does not: max_attempts 2 still ends after one attempt), readable by the
/// enqueuer and a member of its role, and by no other role, not even through the table. (Broken
/// on purpose, every caller taken to see every job: the stranger's read fails the test.)
#[test]
fn a_failing_handlers_message_is_read_by_its_enqueuer_and_by_no_other_role() {
    let cluster = Cluster::start(WORKER_CONF);
    let job_id = a_producer_whose_handler_fails(&cluster);
    let expected = vec![(
        1,
        attempts(&mut cluster.connect(), job_id)[0].1.clone(),
        "failed".to_owned(),
        Some("integrity_violation".to_owned()),
        Some("23514".to_owned()),
        Some("card 4242 declined".to_owned()),
        Some(true),
    )];
    assert!(expected[0].1.is_some(), "the attempt names its worker");
    assert_eq!(attempts(&mut cluster.connect_as("app_producer"), job_id), expected);
    assert_eq!(attempts(&mut cluster.connect_as("app_member"), job_id), expected);
    let mut stranger = cluster.connect_as("app_stranger");
    assert_eq!(attempts(&mut stranger, job_id), vec![], "another role sees no attempt");
    assert_eq!(count(&mut stranger, &format!("SELECT count(*) FROM durable_jobs.get_durable_job({job_id})")), 0);
    let direct = stranger.query("SELECT error_message FROM durable_jobs.durable_job_attempt", &[]).unwrap_err();
    assert_eq!(sqlstate(&direct), "42501");
    let direct = cluster
        .connect_as("app_producer")
        .query("SELECT error_message FROM durable_jobs.durable_job_attempt", &[])
        .unwrap_err();
    assert_eq!(sqlstate(&direct), "42501", "the table is read through the function only");
}

/// With durable_jobs.keep_error_messages off, attempts keep their codes and no message, from the
/// background worker and from external workers alike; only a superuser may change the setting.
/// (Broken on purpose, the setting ignored: the worker's attempt kept its message.)
#[test]
fn with_keep_error_messages_off_attempts_keep_codes_only() {
    let cluster = Cluster::start(&format!("{WORKER_CONF}durable_jobs.keep_error_messages = off\n"));
    let job_id = a_producer_whose_handler_fails(&cluster);
    let kept = attempts(&mut cluster.connect_as("app_producer"), job_id);
    assert_eq!(kept.len(), 1);
    assert_eq!((kept[0].3.as_deref(), kept[0].4.as_deref(), kept[0].5.as_deref()), (Some("integrity_violation"), Some("23514"), None));

    let mut client = cluster.connect();
    let external: i64 = client
        .query_one("SELECT durable_jobs.enqueue_durable_job('external', '{}', queue_name => 'ext')", &[])
        .unwrap()
        .get(0);
    let job = harness::claim_from(&mut client, "worker-1", "ext", 60).expect("the job");
    assert_eq!(fail_with_message(&mut client, &job, "worker-1", "target_rejected", "550 no such user"), "failed");
    let kept = attempts(&mut client, external);
    assert_eq!((kept[0].3.as_deref(), kept[0].5.as_deref()), (Some("target_rejected"), None));

    let refused = cluster
        .connect_as("app_producer")
        .batch_execute("SET durable_jobs.keep_error_messages = on")
        .unwrap_err();
    assert_eq!(sqlstate(&refused), "42501");
}

/// An external worker's attempts: a failure with its message (cut to 2000 characters), a lease
/// that lapsed and was taken over, a success; then a cancel while running; pruning the job
/// deletes its attempts.
#[test]
fn an_external_workers_attempts_are_kept_with_their_messages() {
    let cluster = Cluster::start(PRELOADED);
    let mut client = cluster.connect();
    let job_id: i64 = client
        .query_one("SELECT durable_jobs.enqueue_durable_job('mail', '{}', max_attempts => 5)", &[])
        .unwrap()
        .get(0);
    client.batch_execute("SET durable_jobs.retry_base_delay = 1").unwrap();

    let first = claim(&mut client, "worker-1", 60).expect("attempt 1");
    assert_eq!(attempts(&mut client, job_id)[0].2, "running");
    let long = "x".repeat(2500);
    assert_eq!(fail_with_message(&mut client, &first, "worker-1", "target_unavailable", &long), "retried");

    wait_until(Duration::from_secs(10), "the retry to be due", || {
        count(&mut client, &format!("SELECT count(*) FROM durable_jobs.durable_job WHERE job_id = {job_id} AND run_after <= clock_timestamp()")) == 1
    });
    let second = claim(&mut client, "worker-2", 1).expect("attempt 2");
    wait_until(Duration::from_secs(10), "attempt 2's lease to lapse", || {
        count(&mut client, &format!("SELECT count(*) FROM durable_jobs.durable_job WHERE job_id = {job_id} AND lease_expires_at <= clock_timestamp()")) == 1
    });
    assert_eq!(attempts(&mut client, job_id)[1].2, "lease_expired", "a lapsed lease ended the attempt");
    let third = claim(&mut client, "worker-3", 60).expect("attempt 3");
    assert_eq!((second.attempt_count, third.attempt_count), (2, 3));
    assert_eq!(complete(&mut client, &third, "worker-3"), "succeeded");

    let history = attempts(&mut client, job_id);
    let summary: Vec<(i32, Option<&str>, &str, Option<&str>)> =
        history.iter().map(|a| (a.0, a.1.as_deref(), a.2.as_str(), a.3.as_deref())).collect();
    assert_eq!(
        summary,
        [
            (1, Some("worker-1"), "failed", Some("target_unavailable")),
            (2, Some("worker-2"), "lease_expired", None),
            (3, Some("worker-3"), "succeeded", None),
        ]
    );
    assert_eq!(history[0].5.as_deref(), Some("x".repeat(2000).as_str()), "the message, cut to 2000 characters");
    assert!(history.iter().all(|a| a.6 == Some(true)), "each attempt ended after it started: {history:?}");

    let cancelled: i64 = client.query_one("SELECT durable_jobs.enqueue_durable_job('mail', '{}')", &[]).unwrap().get(0);
    let running = claim(&mut client, "worker-1", 60).expect("the second job");
    assert_eq!(running.job_id, cancelled);
    client.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&cancelled]).unwrap();
    assert_eq!(attempts(&mut client, cancelled)[0].2, "cancelled");
    assert_eq!(complete(&mut client, &running, "worker-1"), "stale");
    assert_eq!(attempts(&mut client, cancelled).len(), 1, "a stale completion records nothing");

    client.query_one("SELECT durable_jobs.prune_durable_jobs('0 seconds')", &[]).unwrap();
    assert_eq!(count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job_attempt"), 0);
}
