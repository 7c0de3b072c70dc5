//! Whose code runs as whom, among the roles, members and groups of a real deployment: a handler
//! runs as its job's enqueuer only when the role that registered it and the role that owns it
//! already hold the enqueuer's rights (they are the enqueuer, superusers, or have its
//! privileges). A group's code never runs as its members, so one member cannot reach another's
//! rights through their group; an administrator granted a producer's role serves its jobs.

use harness::{error_text, job_outcome, wait_for_the_workers_sleep, wait_until, workers_waiting_on, Cluster};
use postgres::Client;
use std::time::Duration;

/// A worker that polls only when an enqueue's commit wakes it (a ten-minute poll interval), so
/// that it sleeps, and an enqueue may lease it its job, whenever the tests wait for that.
const WORKER_WOKEN_BY_ENQUEUES: &str = "shared_preload_libraries = 'durable_jobs'\n\
                                        durable_jobs.worker_enabled = on\n\
                                        durable_jobs.poll_interval = '10min'\n";

/// The state of job `job_id` as `client`'s own transaction sees it (get_durable_job).
fn state_in(client: &mut impl postgres::GenericClient, job_id: i64) -> String {
    client.query_one("SELECT job_state FROM durable_jobs.get_durable_job($1)", &[&job_id]).unwrap().get(0)
}

/// Waits until job `job_id` has ended (succeeded, failed or cancelled).
fn wait_until_finished(admin: &mut Client, job_id: i64) {
    wait_until(Duration::from_secs(60), &format!("job {job_id} to finish"), || {
        admin
            .query_one(
                "SELECT finished_at IS NOT NULL FROM durable_jobs.durable_job WHERE job_id = $1",
                &[&job_id],
            )
            .unwrap()
            .get(0)
    });
}

fn enqueue(client: &mut impl postgres::GenericClient, statement: &str) -> i64 {
    client.query_one(statement, &[]).unwrap_or_else(|e| panic!("{statement}: {}", error_text(&e))).get(0)
}

/// Whom the registration of `kind` serves, as durable_job_handlers shows it.
fn serves(admin: &mut Client, kind: &str) -> (bool, Option<Vec<String>>) {
    let row = admin
        .query_one(
            "SELECT serves_every_role, serves_roles::text[] FROM durable_jobs.durable_job_handlers WHERE job_kind = $1",
            &[&kind],
        )
        .unwrap();
    (row.get(0), row.get(1))
}

/// The reproduction of the escalation through a group, word for word: esc_bob, a member of
/// esc_grp, registers as the group a handler that copies esc_alice's secret, and esc_alice (the
/// group's other member) enqueues a job of that kind. Before 0.6.0 the registration served every
/// role with the group's privileges, so the job ran as esc_alice and the secret reached esc_bob's
/// table (this test failed there: `loot` held 'alice-only-secret'). Also the handler owner's side
/// of the rule: a superuser registering the group's routine for everyone still never runs it as
/// a member (before 0.6.0 it ran as esc_alice too).
#[test]
fn a_groups_code_never_runs_as_its_members() {
    let cluster = Cluster::start(WORKER_WOKEN_BY_ENQUEUES);
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE esc_grp NOLOGIN;  CREATE ROLE esc_alice LOGIN;  CREATE ROLE esc_bob LOGIN;
             GRANT esc_grp TO esc_alice;  GRANT esc_grp TO esc_bob;
             CREATE SCHEMA esc_app AUTHORIZATION esc_grp;
             GRANT USAGE ON SCHEMA durable_jobs TO esc_grp;
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA durable_jobs TO esc_grp;
             CREATE TABLE public.esc_alice_secret(s text);
             INSERT INTO public.esc_alice_secret VALUES ('alice-only-secret');
             ALTER TABLE public.esc_alice_secret OWNER TO esc_alice;
             REVOKE ALL ON public.esc_alice_secret FROM PUBLIC;",
        )
        .unwrap();
    let mut bob = cluster.connect_as("esc_bob");
    bob.batch_execute(
        "SET ROLE esc_grp;
         CREATE TABLE esc_app.loot(s text);
         CREATE FUNCTION esc_app.send_report(p jsonb) RETURNS void LANGUAGE sql
             AS $$ INSERT INTO esc_app.loot SELECT s FROM public.esc_alice_secret $$;
         SELECT durable_jobs.register_durable_job_handler('esc_send_report', 'esc_app.send_report(jsonb)');",
    )
    .unwrap();
    // A superuser's registration of the group's routine: it serves every role, but the routine's
    // owner holds no member's rights.
    admin
        .batch_execute(
            "SELECT durable_jobs.register_durable_job_handler('esc_for_all', 'esc_app.send_report(jsonb)')",
        )
        .unwrap();

    let mut alice = cluster.connect_as("esc_alice");
    // Enqueued while the worker sleeps: the enqueue's direct lease asks the rule too, and leaves
    // the job available (a lease would show it running in the enqueuing transaction).
    wait_for_the_workers_sleep(&mut admin);
    let mut transaction = alice.transaction().unwrap();
    let alices_job =
        enqueue(&mut transaction, "SELECT durable_jobs.enqueue_durable_job('esc_send_report', '{}')");
    assert_eq!(state_in(&mut transaction, alices_job), "available", "not leased at enqueue");
    transaction.commit().unwrap();
    let alices_other_job =
        enqueue(&mut alice, "SELECT durable_jobs.enqueue_durable_job('esc_for_all', '{}')");
    // The group's own job of the same kind, enqueued after esc_alice's (job_id and run_after)
    // and never leased at enqueue (enqueue_durable_jobs): the worker claims in that order, so by
    // the time it ended, esc_alice's job would have been claimed had the registration served her.
    let groups_job = enqueue(
        &mut bob,
        "SELECT job_id FROM durable_jobs.enqueue_durable_jobs('esc_send_report', ARRAY['{}'::jsonb]) AS job_id",
    );
    wait_until_finished(&mut admin, groups_job);
    let loot = |admin: &mut Client| -> i64 {
        admin.query_one("SELECT count(*) FROM esc_app.loot", &[]).unwrap().get(0)
    };
    assert_eq!(loot(&mut admin), 0, "esc_alice's secret reached the group's table");
    assert_eq!(
        job_outcome(&mut admin, &format!("job_id = {alices_job}")),
        ("available".into(), None, 0),
        "a group's registration does not serve its members: the job waits for an external worker"
    );
    assert_eq!(
        job_outcome(&mut admin, &format!("job_id = {groups_job}")),
        ("failed".into(), Some("target_rejected".into()), 1),
        "the registration serves the group's own jobs, with the group's rights only"
    );
    wait_until_finished(&mut admin, alices_other_job);
    assert_eq!(
        job_outcome(&mut admin, &format!("job_id = {alices_other_job}")),
        ("failed".into(), Some("target_rejected".into()), 1),
        "the group's routine is never run as its member, whoever registered it"
    );
    assert_eq!(loot(&mut admin), 0, "esc_alice's secret reached the group's table");
    assert_eq!(serves(&mut admin, "esc_send_report"), (false, Some(vec!["esc_grp".to_string()])));
    assert_eq!(serves(&mut admin, "esc_for_all"), (true, None));
}

/// The way a deployment serves a producer: its administrator is granted the producer's role
/// (`GRANT app_producer TO app_admin`), registers a handler it owns, and the producer's job runs
/// as the producer. A role the administrator holds no rights of is not served, even with every
/// grant to enqueue and to execute the handler.
#[test]
fn an_administrator_granted_the_producers_role_serves_its_jobs() {
    let cluster = Cluster::start(WORKER_WOKEN_BY_ENQUEUES);
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE app_producer LOGIN;  CREATE ROLE app_admin LOGIN;  CREATE ROLE app_stranger LOGIN;
             GRANT app_producer TO app_admin;
             CREATE SCHEMA app AUTHORIZATION app_admin;
             GRANT USAGE ON SCHEMA durable_jobs TO app_producer, app_admin, app_stranger;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                 durable_jobs.enqueue_durable_jobs(text, jsonb[], text[], text, timestamptz, integer, integer, text),
                 durable_jobs.get_durable_job(bigint)
               TO app_producer, app_stranger;
             GRANT EXECUTE ON FUNCTION durable_jobs.register_durable_job_handler(text, regprocedure) TO app_admin;",
        )
        .unwrap();
    let mut app_admin = cluster.connect_as("app_admin");
    app_admin
        .batch_execute(
            "CREATE TABLE app.welcome_mail (sent_as name, address text);
             CREATE FUNCTION app.send_welcome(payload jsonb) RETURNS void LANGUAGE sql
                 AS $$ INSERT INTO app.welcome_mail VALUES (current_user, payload->>'to') $$;
             GRANT USAGE ON SCHEMA app TO app_producer, app_stranger;
             GRANT INSERT ON app.welcome_mail TO app_producer, app_stranger;
             SELECT durable_jobs.register_durable_job_handler('send_welcome', 'app.send_welcome(jsonb)');",
        )
        .unwrap();
    let strangers_job = enqueue(
        &mut cluster.connect_as("app_stranger"),
        "SELECT durable_jobs.enqueue_durable_job('send_welcome', '{\"to\": \"eve@example.com\"}')",
    );
    let mut producer = cluster.connect_as("app_producer");
    // Never leased at enqueue (enqueue_durable_jobs): claimed after the stranger's job, which
    // was enqueued first (claims go by run_after and job_id), had the registration served it.
    let producers_job = enqueue(
        &mut producer,
        "SELECT job_id FROM durable_jobs.enqueue_durable_jobs('send_welcome',
                                                             ARRAY['{\"to\": \"ada@example.com\"}'::jsonb]) AS job_id",
    );
    wait_until_finished(&mut admin, producers_job);
    assert_eq!(job_outcome(&mut admin, &format!("job_id = {producers_job}")), ("succeeded".into(), None, 1));
    assert_eq!(job_outcome(&mut admin, &format!("job_id = {strangers_job}")), ("available".into(), None, 0));
    // And through the enqueue that leases its job to a sleeping worker (running in its own
    // transaction already), which runs it without a claim.
    wait_for_the_workers_sleep(&mut admin);
    let mut transaction = producer.transaction().unwrap();
    let producers_next_job = enqueue(
        &mut transaction,
        "SELECT durable_jobs.enqueue_durable_job('send_welcome', '{\"to\": \"grace@example.com\"}')",
    );
    assert_eq!(state_in(&mut transaction, producers_next_job), "running", "leased at enqueue");
    transaction.commit().unwrap();
    wait_until_finished(&mut admin, producers_next_job);
    assert_eq!(
        job_outcome(&mut admin, &format!("job_id = {producers_next_job}")),
        ("succeeded".into(), None, 1)
    );
    let sent: Vec<(String, String)> = admin
        .query("SELECT sent_as::text, address FROM app.welcome_mail ORDER BY address", &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let expected = [("app_producer", "ada@example.com"), ("app_producer", "grace@example.com")];
    assert_eq!(sent, expected.map(|(role, address)| (role.to_string(), address.to_string())));
    assert_eq!(
        serves(&mut admin, "send_welcome"),
        (false, Some(vec!["app_admin".to_string(), "app_producer".to_string()]))
    );
}

/// A registering role that loses the enqueuer's rights while a batch runs (its membership
/// revoked between the claim and a job's turn): the later jobs of the batch go back to the queue
/// with their attempts, unrun, as jobs it no longer serves, and count as claimed only once they
/// run. Failed before: they failed `target_rejected` (the check at the call), and every job of
/// the claim counted as claimed, given back or not.
#[test]
fn a_membership_revoked_while_a_batch_runs_gives_its_later_jobs_back() {
    let cluster = Cluster::start(&format!("{WORKER_WOKEN_BY_ENQUEUES}durable_jobs.claim_batch_size = 5\n"));
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE rv_producer LOGIN;  CREATE ROLE rv_admin LOGIN;
             GRANT rv_producer TO rv_admin;
             GRANT USAGE ON SCHEMA durable_jobs TO rv_producer, rv_admin;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_durable_jobs(text, jsonb[], text[], text, timestamptz, integer, integer, text)
               TO rv_producer;
             GRANT EXECUTE ON FUNCTION durable_jobs.register_durable_job_handler(text, regprocedure) TO rv_admin;
             CREATE TABLE public.rv_done (n integer);
             GRANT INSERT ON public.rv_done TO rv_producer;
             CREATE FUNCTION public.rv_work(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
             BEGIN
                 IF (payload->>'n')::integer = 1 THEN
                     PERFORM pg_advisory_xact_lock(4848);
                 END IF;
                 INSERT INTO public.rv_done VALUES ((payload->>'n')::integer);
             END $$;
             SELECT pg_advisory_lock(4848);",
        )
        .unwrap();
    cluster
        .connect_as("rv_admin")
        .batch_execute("SELECT durable_jobs.register_durable_job_handler('rv', 'public.rv_work(jsonb)')")
        .unwrap();
    let mut producer = cluster.connect_as("rv_producer");
    let ids: Vec<i64> = producer
        .query(
            "SELECT job_id FROM durable_jobs.enqueue_durable_jobs('rv',
                 ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}']::jsonb[]) AS job_id ORDER BY job_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    wait_until(Duration::from_secs(30), "the first job waiting for the test's lock", || {
        workers_waiting_on(&mut admin, "advisory") == 1
    });
    let running =
        "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'running' AND attempt_count = 1";
    assert_eq!(harness::count(&mut admin, running), 3, "one claim took the three jobs");
    // Committed before the lock goes (one simple query would be one transaction).
    admin.batch_execute("REVOKE rv_producer FROM rv_admin").unwrap();
    admin.batch_execute("SELECT pg_advisory_unlock(4848)").unwrap();
    wait_until_finished(&mut admin, ids[0]);
    wait_for_the_workers_sleep(&mut admin);
    assert_eq!(job_outcome(&mut admin, &format!("job_id = {}", ids[0])), ("succeeded".into(), None, 1));
    for job_id in &ids[1..] {
        assert_eq!(
            job_outcome(&mut admin, &format!("job_id = {job_id}")),
            ("available".into(), None, 0),
            "job {job_id}"
        );
    }
    assert_eq!(harness::metric(&mut admin, "claimed"), 1, "only the job that ran counts as claimed");
    // Granted again, the registration serves them: the next enqueue's commit wakes the worker,
    // whose claim takes them once they are due again (a job given back is, a second later).
    admin.batch_execute("GRANT rv_producer TO rv_admin").unwrap();
    wait_until(Duration::from_secs(30), "the given-back jobs due again", || {
        harness::count(
            &mut admin,
            "SELECT count(*) FROM durable_jobs.durable_job WHERE run_after > clock_timestamp()",
        ) == 0
    });
    producer
        .execute("SELECT durable_jobs.enqueue_durable_jobs('rv', ARRAY['{\"n\": 4}']::jsonb[])", &[])
        .unwrap();
    wait_until(Duration::from_secs(30), "every job", || {
        harness::count(
            &mut admin,
            "SELECT count(*) FROM durable_jobs.durable_job WHERE job_state = 'succeeded'",
        ) == 4
    });
    assert_eq!(harness::metric(&mut admin, "claimed"), 4);
    assert_eq!(harness::count(&mut admin, "SELECT count(*) FROM public.rv_done"), 4);
}
