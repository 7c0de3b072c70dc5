//! Many connections against one real cluster: claims never overlap, fencing holds across
//! sessions, and cancel races complete cleanly.

use harness::{claim, complete, count, fail, sqlstate, wait_until, Cluster};
use postgres::Client;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

fn enqueue(client: &mut Client, kind: &str, n: i64) -> Vec<i64> {
    let rows = client
        .query(
            "SELECT durable_jobs.enqueue_durable_job($1, jsonb_build_object('n', g))
             FROM generate_series(1::bigint, $2::bigint) g",
            &[&kind, &n],
        )
        .expect("enqueue");
    rows.iter().map(|r| r.get(0)).collect()
}

fn job_state(client: &mut Client, job_id: i64) -> String {
    client
        .query_one("SELECT job_state FROM durable_jobs.durable_job WHERE job_id = $1", &[&job_id])
        .expect("job state")
        .get(0)
}

#[test]
fn two_connections_never_claim_the_same_job() {
    let cluster = Cluster::start("");
    let mut setup = cluster.connect();
    let jobs = enqueue(&mut setup, "report", 2);

    // A holds its claim uncommitted: the row stays locked, so B must skip it, not wait.
    let mut a = cluster.connect();
    let mut b = cluster.connect();
    let mut a_txn = a.transaction().unwrap();
    let a_job: i64 = a_txn
        .query_one("SELECT job_id FROM durable_jobs.claim_next_durable_job('worker-a')", &[])
        .unwrap()
        .get(0);
    let b_job = claim(&mut b, "worker-b", 60).expect("B claims the other job").job_id;
    assert_ne!(a_job, b_job);
    assert!(claim(&mut setup, "worker-c", 60).is_none(), "a third claimer finds nothing free");
    a_txn.commit().unwrap();

    let mut claimed = vec![a_job, b_job];
    claimed.sort();
    assert_eq!(claimed, jobs);
    assert!(claim(&mut setup, "worker-c", 60).is_none(), "live leases are not reclaimed");
}

#[test]
fn racing_workers_claim_each_job_exactly_once() {
    const JOBS: i64 = 2000;
    const WORKERS: usize = 8;
    let cluster = Arc::new(Cluster::start(""));
    let jobs: HashSet<i64> = enqueue(&mut cluster.connect(), "etl_step", JOBS).into_iter().collect();

    let claims = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let cluster = Arc::clone(&cluster);
            let claims = Arc::clone(&claims);
            thread::spawn(move || {
                let mut client = cluster.connect();
                let worker = format!("racer-{w}");
                while let Some(job) = claim(&mut client, &worker, 300) {
                    assert_eq!(job.attempt_count, 1, "no job is claimed a second time");
                    assert_eq!(complete(&mut client, &job, &worker), "succeeded");
                    claims.lock().unwrap().push(job.job_id);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker thread");
    }

    let claims = claims.lock().unwrap();
    let distinct: HashSet<i64> = claims.iter().copied().collect();
    assert_eq!(claims.len() as i64, JOBS, "every job claimed once, none twice");
    assert_eq!(distinct, jobs);
    let row = cluster
        .connect()
        .query_one(
            "SELECT count(*) FILTER (WHERE job_state = 'succeeded' AND payload IS NULL
                                     AND attempt_count = 1),
                    count(*)
             FROM durable_jobs.durable_job",
            &[],
        )
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (JOBS, JOBS));
}

#[test]
fn completion_after_lease_expiry_is_stale_and_does_not_overwrite_the_reclaim() {
    let cluster = Cluster::start("");
    let mut first = cluster.connect();
    let mut second = cluster.connect();
    let job_id = enqueue(&mut first, "slow", 1)[0];

    let lost = claim(&mut first, "worker-1", 1).unwrap();
    thread::sleep(Duration::from_millis(1500));
    // Expired but not yet reclaimed: the late holder is already stale.
    assert_eq!(complete(&mut first, &lost, "worker-1"), "stale");
    assert_eq!(job_state(&mut first, job_id), "running");

    let taken = claim(&mut second, "worker-2", 60).expect("expired lease is reclaimed");
    assert_eq!((taken.job_id, taken.attempt_count), (job_id, 2));
    assert_ne!(taken.lease_token, lost.lease_token);

    // Every fenced call of the old holder is refused and changes nothing.
    assert_eq!(complete(&mut first, &lost, "worker-1"), "stale");
    assert_eq!(fail(&mut first, &lost, "worker-1", "target_unavailable"), "stale");
    let extended: Option<std::time::SystemTime> = first
        .query_one(
            "SELECT durable_jobs.extend_durable_job_lease($1, 'worker-1', $2::text::uuid)",
            &[&job_id, &lost.lease_token],
        )
        .unwrap()
        .get(0);
    assert_eq!(extended, None);
    let row = first
        .query_one(
            "SELECT lease_owner, lease_token::text, last_failure_code
             FROM durable_jobs.durable_job WHERE job_id = $1",
            &[&job_id],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "worker-2");
    assert_eq!(row.get::<_, String>(1), taken.lease_token);
    assert_eq!(row.get::<_, Option<String>>(2), None);

    assert_eq!(complete(&mut second, &taken, "worker-2"), "succeeded");
    assert_eq!(job_state(&mut first, job_id), "succeeded");
}

/// Across transactions, unlike a pg_test, where now() stands still. Broken on purpose: with the
/// claim's `run_after <= now()` dropped, the first claim took the job and the test failed.
#[test]
fn a_retried_job_is_claimable_only_after_its_backoff() {
    let cluster = Cluster::start("durable_jobs.retry_base_delay = '4s'\n");
    let mut client = cluster.connect();
    let job_id = enqueue(&mut client, "later", 1)[0];
    let job = claim(&mut client, "w", 60).unwrap();
    assert_eq!(fail(&mut client, &job, "w", "target_unavailable"), "retried");
    // The first retry waits 2 to 4 s (base delay 4 s times a jitter factor in [0.5, 1)), from the
    // failure's own clock (run_after and updated_at come from one UPDATE). (It was measured from
    // a later statement's clock before, with no slack at the smallest jitter.)
    let waits: f64 = client
        .query_one(
            "SELECT extract(epoch FROM run_after - updated_at)::float8 FROM durable_jobs.durable_job WHERE job_id = $1",
            &[&job_id],
        )
        .unwrap()
        .get(0);
    assert!((2.0..4.0).contains(&waits), "{waits}");
    assert!(claim(&mut client, "w", 60).is_none(), "not claimable before its backoff ends");
    let mut again = None;
    wait_until(Duration::from_secs(30), "the job claimable once its backoff ended", || {
        again = claim(&mut client, "w", 60);
        again.is_some()
    });
    let again = again.unwrap();
    assert_eq!((again.job_id, again.attempt_count), (job_id, 2));
    let claimed_after_its_backoff: bool = client
        .query_one(
            "SELECT lease_expires_at - interval '60 seconds' >= run_after FROM durable_jobs.durable_job WHERE job_id = $1",
            &[&job_id],
        )
        .unwrap()
        .get(0);
    assert!(claimed_after_its_backoff, "claimed before its run_after");
}

#[test]
fn cancel_while_running_makes_the_holder_stale() {
    let cluster = Cluster::start("");
    let mut worker = cluster.connect();
    let mut operator = cluster.connect();
    let job_id = enqueue(&mut operator, "cancellable", 1)[0];
    let job = claim(&mut worker, "worker-1", 60).unwrap();

    let cancelled: bool =
        operator.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id]).unwrap().get(0);
    assert!(cancelled);
    assert_eq!(complete(&mut worker, &job, "worker-1"), "stale");
    let row = operator
        .query_one(
            "SELECT job_state, payload IS NULL, lease_token IS NULL
             FROM durable_jobs.durable_job WHERE job_id = $1",
            &[&job_id],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "cancelled");
    assert!(row.get::<_, bool>(1) && row.get::<_, bool>(2));
}

#[test]
fn cancel_waits_for_an_uncommitted_complete_and_then_loses() {
    let cluster = Arc::new(Cluster::start(""));
    let mut worker = cluster.connect();
    let job_id = enqueue(&mut worker, "race", 1)[0];
    let job = claim(&mut worker, "worker-1", 60).unwrap();

    let mut txn = worker.transaction().unwrap();
    let outcome: String = txn
        .query_one(
            "SELECT durable_jobs.complete_durable_job($1, 'worker-1', $2::text::uuid)",
            &[&job_id, &job.lease_token],
        )
        .unwrap()
        .get(0);
    assert_eq!(outcome, "succeeded");

    let mut operator = cluster.connect();
    let operator_pid: i32 = operator.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let canceller = thread::spawn(move || -> bool {
        operator.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id]).unwrap().get(0)
    });
    // The cancel blocks on the row lock of the uncommitted completion (seen waiting, not guessed
    // from a pause).
    let mut watcher = cluster.connect();
    wait_until(Duration::from_secs(10), "the cancel waiting for a lock", || {
        watcher
            .query_one(
                "SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = $1",
                &[&operator_pid],
            )
            .unwrap()
            .get(0)
    });
    assert!(!canceller.is_finished(), "cancel waits for the completing transaction");
    txn.commit().unwrap();
    assert!(!canceller.join().unwrap(), "a succeeded job cannot be cancelled");
    assert_eq!(job_state(&mut cluster.connect(), job_id), "succeeded");
}

#[test]
fn documented_roles_can_do_exactly_their_part() {
    let cluster = Cluster::start("");
    let mut admin = cluster.connect();
    // The GRANTs of docs/runbook.md, "Roles and privileges".
    admin
        .batch_execute(
            "CREATE ROLE app_producer LOGIN;
             CREATE ROLE other_producer LOGIN;
             CREATE ROLE app_worker LOGIN;
             CREATE ROLE nobody LOGIN;
             GRANT USAGE ON SCHEMA durable_jobs TO app_producer, other_producer, app_worker;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                 durable_jobs.enqueue_durable_jobs(text, jsonb[], text[], text, timestamptz, integer, integer, text),
                 durable_jobs.cancel_durable_job(bigint)
               TO app_producer, other_producer;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.claim_next_durable_job(text, text[], integer, text[]),
                 durable_jobs.complete_durable_job(bigint, text, uuid),
                 durable_jobs.fail_durable_job(bigint, text, uuid, text, text),
                 durable_jobs.extend_durable_job_lease(bigint, text, uuid, integer)
               TO app_worker;",
        )
        .unwrap();

    let mut producer = cluster.connect_as("app_producer");
    let mut other = cluster.connect_as("other_producer");
    let mut worker = cluster.connect_as("app_worker");
    let mut nobody = cluster.connect_as("nobody");

    let job_id: i64 = producer
        .query_one("SELECT durable_jobs.enqueue_durable_job('mail', '{\"id\": 7}')", &[])
        .unwrap()
        .get(0);
    let enqueued_by: String = admin
        .query_one("SELECT enqueued_by::text FROM durable_jobs.durable_job WHERE job_id = $1", &[&job_id])
        .unwrap()
        .get(0);
    assert_eq!(enqueued_by, "app_producer");
    let batch = producer
        .query("SELECT * FROM durable_jobs.enqueue_durable_jobs('mail', ARRAY['{}', '{}']::jsonb[])", &[])
        .unwrap();
    assert_eq!(batch.len(), 2);
    // Only the first job takes part in what follows.
    admin.batch_execute(&format!("DELETE FROM durable_jobs.durable_job WHERE job_id <> {job_id}")).unwrap();

    let denied = |client: &mut Client, statement: &str| {
        let error = client.batch_execute(statement).expect_err(statement);
        assert_eq!(sqlstate(&error), "42501", "{statement}: {error}");
    };
    // Nothing for a role without grants, not even reading the table.
    denied(&mut nobody, "SELECT durable_jobs.enqueue_durable_job('mail', '{}')");
    denied(&mut nobody, "SELECT * FROM durable_jobs.durable_job");
    denied(&mut nobody, "SELECT * FROM durable_jobs.claim_next_durable_job('w')");
    // A producer cannot claim, read the table, or cancel another role's job.
    denied(&mut producer, "SELECT * FROM durable_jobs.claim_next_durable_job('w')");
    denied(&mut producer, "SELECT * FROM durable_jobs.durable_job");
    denied(&mut producer, "UPDATE durable_jobs.durable_job SET priority = 5");
    // Another producer's cancel finds no job of its own: false, as for a missing job (42501
    // before 0.6.0).
    let cancelled: bool =
        other.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id]).unwrap().get(0);
    assert!(!cancelled);
    // A worker cannot enqueue or cancel.
    denied(&mut worker, "SELECT durable_jobs.enqueue_durable_job('mail', '{}')");
    denied(&mut worker, &format!("SELECT durable_jobs.cancel_durable_job({job_id})"));
    assert_eq!(job_state(&mut admin, job_id), "available", "refused calls changed nothing");

    // The worker runs the job; the owner cancels its own second job.
    let job = claim(&mut worker, "w", 60).expect("worker claims");
    assert_eq!(job.job_id, job_id);
    assert_eq!(complete(&mut worker, &job, "w"), "succeeded");
    let second: i64 = producer
        .query_one("SELECT durable_jobs.enqueue_durable_job('mail', '{\"id\": 8}')", &[])
        .unwrap()
        .get(0);
    let cancelled: bool =
        producer.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&second]).unwrap().get(0);
    assert!(cancelled);
}

#[test]
fn polling_an_empty_queue_takes_no_transaction_id() {
    // An external worker polls in a loop: a claim, prune or cancel that changes nothing must not
    // cost a transaction id, a commit record and a WAL flush each time.
    let cluster = Cluster::start("");
    let mut client = cluster.connect();
    let job = enqueue(&mut client, "done", 1)[0];
    let claimed = claim(&mut client, "w", 60).expect("the job");
    assert_eq!(complete(&mut client, &claimed, "w"), "succeeded");
    let calls = [
        "SELECT count(*) FROM durable_jobs.claim_next_durable_job('w')".to_string(),
        "SELECT durable_jobs.prune_durable_jobs('1 hour')".to_string(),
        format!("SELECT durable_jobs.cancel_durable_job({job})"),
    ];
    for call in calls {
        let mut transaction = client.transaction().unwrap();
        transaction.query(call.as_str(), &[]).unwrap();
        let xid: Option<String> =
            transaction.query_one("SELECT pg_current_xact_id_if_assigned()::text", &[]).unwrap().get(0);
        assert_eq!(xid, None, "{call} took a transaction id");
    }
}

#[test]
fn intake_switch_stops_enqueue_but_not_claims() {
    let cluster = Cluster::start("");
    let mut client = cluster.connect();
    let job_id = enqueue(&mut client, "k", 1)[0];
    let keyed: i64 = client
        .query_one("SELECT durable_jobs.enqueue_durable_job('k', '{\"n\": 1}', 'key-1')", &[])
        .unwrap()
        .get(0);
    harness::set_intake(&cluster, &mut client, "off");
    let mut client = cluster.connect();
    let identity = |client: &mut Client| -> i64 {
        client.query_one("SELECT last_value FROM durable_jobs.durable_job_job_id_seq", &[]).unwrap().get(0)
    };
    let identity_before = identity(&mut client);
    for refused in [
        "SELECT durable_jobs.enqueue_durable_job('k', '{}')",
        // A new key, and a key bound to another payload: each would take something in.
        "SELECT durable_jobs.enqueue_durable_job('k', '{\"n\": 1}', 'key-2')",
        "SELECT durable_jobs.enqueue_durable_job('k', '{\"n\": 2}', 'key-1')",
        "SELECT durable_jobs.enqueue_durable_jobs('k', ARRAY['{\"n\": 1}', '{\"n\": 3}']::jsonb[], ARRAY['key-1', 'key-3'])",
    ] {
        // 25006 since 0.6.0 (55000 before, which a gateway could not tell from a wrong state).
        let error = client.batch_execute(refused).expect_err("intake is off");
        assert_eq!(sqlstate(&error), "25006", "{refused}");
    }
    // Producers retry enqueues after timeouts: the key's own job comes back, nothing is taken in.
    let again: i64 = client
        .query_one("SELECT durable_jobs.enqueue_durable_job('k', '{\"n\": 1}', 'key-1')", &[])
        .unwrap()
        .get(0);
    assert_eq!(again, keyed);
    let again: Vec<i64> = client
        .query(
            "SELECT durable_jobs.enqueue_durable_jobs('k', ARRAY['{\"n\": 1}']::jsonb[], ARRAY['key-1'])",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(again, vec![keyed]);
    let (again, created): (i64, bool) = client
        .query_one("SELECT * FROM durable_jobs.enqueue_or_get_durable_job('k', '{\"n\": 1}', 'key-1')", &[])
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!((again, created), (keyed, false));
    assert_eq!(identity(&mut client), identity_before, "no identity value was drawn");
    assert_eq!(count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job"), 2);

    let job = claim(&mut client, "w", 60).expect("claims go on");
    assert_eq!(job.job_id, job_id);
    assert_eq!(complete(&mut client, &job, "w"), "succeeded");

    harness::set_intake(&cluster, &mut client, "on");
    let mut client = cluster.connect();
    assert_eq!(enqueue(&mut client, "k", 1).len(), 1);
}

#[test]
fn a_queue_concurrency_limit_holds_across_connections() {
    const LIMIT: i64 = 3;
    let cluster = Arc::new(Cluster::start(""));
    let mut setup = cluster.connect();
    setup
        .batch_execute(&format!(
            "SELECT durable_jobs.set_durable_job_queue_concurrency('limited', {LIMIT});
             SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k',
                 ARRAY(SELECT jsonb_build_object('n', g) FROM generate_series(1, 120) g), NULL, 'limited');"
        ))
        .unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Each worker holds its lease a while, so that claims pile up against the limit.
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let cluster = Arc::clone(&cluster);
            thread::spawn(move || {
                let mut client = cluster.connect();
                let worker = format!("limited-{w}");
                let mut idle_rounds = 0;
                while idle_rounds < 20 {
                    match claim(&mut client, &worker, 60) {
                        Some(job) => {
                            idle_rounds = 0;
                            thread::sleep(Duration::from_millis(15));
                            assert_eq!(complete(&mut client, &job, &worker), "succeeded");
                        }
                        None => {
                            idle_rounds += 1;
                            thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })
        })
        .collect();
    let monitor = {
        let (cluster, done) = (Arc::clone(&cluster), Arc::clone(&done));
        thread::spawn(move || {
            let mut client = cluster.connect();
            let mut highest = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let running: i64 = client
                    .query_one(
                        "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'running'",
                        &[],
                    )
                    .unwrap()
                    .get(0);
                highest = highest.max(running);
            }
            highest
        })
    };
    for worker in workers {
        worker.join().unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let highest = monitor.join().unwrap();
    let succeeded: i64 = setup
        .query_one("SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'", &[])
        .unwrap()
        .get(0);
    assert_eq!(succeeded, 120, "every job ran");
    assert!(highest <= LIMIT, "{highest} jobs ran at once under a limit of {LIMIT}");
    assert!(highest >= 2, "the workers did run in parallel ({highest})");
}

#[test]
fn a_pause_that_meets_the_queues_first_control_being_made_pauses_it() {
    // The queue has no control row yet; one session sets its first concurrency limit and has
    // not committed when another pauses it. The pause waits for that row and then pauses the
    // queue. Failed before: its insert found the row and did nothing, returned false ("already
    // paused") and left the queue open.
    let cluster = Cluster::start("");
    let mut limiter = cluster.connect();
    let mut pauser = cluster.connect();
    let mut watcher = cluster.connect();
    let mut limiting = limiter.transaction().unwrap();
    limiting.execute("SELECT durable_jobs.set_durable_job_queue_concurrency('q', 5)", &[]).unwrap();
    let pause = thread::spawn(move || {
        pauser.query_one("SELECT durable_jobs.pause_durable_job_queue('q')", &[]).unwrap().get::<_, bool>(0)
    });
    wait_until(Duration::from_secs(10), "the pause to wait for the row", || {
        count(
            &mut watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%pause_durable_job_queue%'",
        ) == 1
    });
    limiting.commit().unwrap();
    assert!(pause.join().unwrap(), "the pause reported the queue paused already");
    let (paused, limit): (bool, Option<i32>) = watcher
        .query_one(
            "SELECT paused, concurrency_limit FROM durable_jobs.durable_job_queue WHERE queue_name = 'q'",
            &[],
        )
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!((paused, limit), (true, Some(5)));
}
