//! A gateway written from docs/http-mapping.md alone: the SQLSTATE table is read from the page
//! itself, each documented error is driven by a real call, and the status the page maps it to
//! is the status the call gets; a job of another role gets the same answer as a missing one on
//! every verb, and a repeated idempotent enqueue tells 200 from 201.

use harness::{claim, complete, sqlstate, Cluster};
use postgres::{Client, Error};
use std::collections::HashMap;

/// The page's error table: SQLSTATE to HTTP status, one status each.
fn documented_statuses() -> HashMap<String, u16> {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/http-mapping.md")).unwrap();
    let table = page.split("| SQLSTATE | HTTP status |").nth(1).expect("the SQLSTATE table");
    table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let code = cells[1].split_whitespace().next().unwrap().to_string();
            let status = cells[2].parse().unwrap_or_else(|_| panic!("one status per SQLSTATE: {line}"));
            (code, status)
        })
        .collect()
}

/// What the page says a failed call answers: its SQLSTATE's status, else 500.
fn error_status(statuses: &HashMap<String, u16>, error: &Error) -> u16 {
    statuses.get(&sqlstate(error)).copied().unwrap_or(500)
}

/// POST /queues/{queue}/jobs with an Idempotency-Key.
fn post_job(
    client: &mut Client,
    statuses: &HashMap<String, u16>,
    kind: &str,
    payload: &str,
    key: Option<&str>,
) -> u16 {
    match client.query_one(
        "SELECT job_id, created FROM durable_jobs.enqueue_or_get_durable_job($1, $2::text::jsonb, $3)",
        &[&kind, &payload, &key],
    ) {
        Ok(row) if row.get::<_, bool>(1) => 201,
        Ok(_) => 200,
        Err(error) => error_status(statuses, &error),
    }
}

fn get_job(client: &mut Client, job_id: i64) -> u16 {
    match client.query_opt("SELECT * FROM durable_jobs.get_durable_job($1)", &[&job_id]).unwrap() {
        Some(_) => 200,
        None => 404,
    }
}

/// DELETE /jobs/{id}: true 200; false 409 when the job is there, else 404.
fn delete_job(client: &mut Client, statuses: &HashMap<String, u16>, job_id: i64) -> u16 {
    let cancelled = match client.query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id]) {
        Ok(row) => row.get::<_, bool>(0),
        Err(error) => return error_status(statuses, &error),
    };
    match (cancelled, get_job(client, job_id)) {
        (true, _) => 200,
        (false, 200) => 409,
        (false, _) => 404,
    }
}

/// POST /jobs/{id}/replay.
fn replay_job(client: &mut Client, statuses: &HashMap<String, u16>, job_id: i64, payload: &str) -> u16 {
    match client
        .query_opt("SELECT * FROM durable_jobs.replay_durable_job($1, $2::text::jsonb)", &[&job_id, &payload])
    {
        Ok(Some(_)) => 200,
        Ok(None) => 404,
        Err(error) => error_status(statuses, &error),
    }
}

/// GET /jobs/{id}/attempts and /diagnosis: no row, 404.
fn get_rows(client: &mut Client, function: &str, job_id: i64) -> u16 {
    let rows = client.query(&format!("SELECT * FROM durable_jobs.{function}($1)"), &[&job_id]).unwrap();
    if rows.is_empty() {
        404
    } else {
        200
    }
}

fn call_status(client: &mut Client, statuses: &HashMap<String, u16>, sql: &str) -> u16 {
    match client.batch_execute(sql) {
        Ok(()) => 200,
        Err(error) => error_status(statuses, &error),
    }
}

/// Every documented error the API can give a gateway, each from a real call, gets the status the
/// page maps it to, and needs no message text. Not driven here: 40001 and 40P01 (races), 42704
/// (a database without the extension has none of its functions to call). (Broken on purpose,
/// intake off raising 55000 again as before 0.6.0: the page maps it to 409, not 503.)
#[test]
fn each_documented_error_maps_to_its_status() {
    let statuses = documented_statuses();
    let cluster = Cluster::start("shared_preload_libraries = 'durable_jobs'");
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE app_producer LOGIN;  CREATE ROLE app_other LOGIN;  CREATE ROLE app_nobody LOGIN;
             GRANT USAGE ON SCHEMA durable_jobs TO app_producer, app_other, app_nobody;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_or_get_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                 durable_jobs.get_durable_job(bigint), durable_jobs.cancel_durable_job(bigint),
                 durable_jobs.replay_durable_job(bigint, jsonb, integer),
                 durable_jobs.wait_for_durable_job(bigint, bigint, double precision),
                 durable_jobs.list_durable_jobs(text, text[], text, integer, text),
                 durable_jobs.get_durable_job_attempts(bigint), durable_jobs.diagnose_durable_job(bigint)
               TO app_producer, app_other;",
        )
        .unwrap();
    let mut producer = cluster.connect_as("app_producer");
    assert_eq!(post_job(&mut producer, &statuses, "mail", r#"{"n": 1}"#, Some("key-1")), 201);
    assert_eq!(
        post_job(&mut producer, &statuses, "mail", r#"{"n": 1}"#, Some("key-1")),
        200,
        "the same job again"
    );
    let cases: [(&str, &str, u16); 7] = [
        ("a NULL kind", "SELECT durable_jobs.enqueue_or_get_durable_job(NULL, '{}')", 400),
        ("a kind outside the alphabet", "SELECT durable_jobs.enqueue_or_get_durable_job('no kind!', '{}')", 400),
        ("a payload that is not JSON", "SELECT durable_jobs.enqueue_or_get_durable_job('mail', '{')", 400),
        ("a key bound to another payload", "SELECT durable_jobs.enqueue_or_get_durable_job('mail', '{\"n\": 2}', 'key-1')", 409),
        (
            "a wait under REPEATABLE READ",
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT * FROM durable_jobs.wait_for_durable_job(1, NULL, 1);",
            500,
        ),
        ("a cursor used with other filters", "SELECT * FROM durable_jobs.list_durable_jobs('mail', NULL, NULL, 10, 'not-a-cursor')", 400),
        (
            "a wait the gateway's timeout ends",
            "SET statement_timeout = '200ms'; SELECT * FROM durable_jobs.wait_for_durable_job(1, NULL, 30);",
            504,
        ),
    ];
    for (what, sql, expected) in cases {
        let mut client = cluster.connect_as("app_producer");
        assert_eq!(call_status(&mut client, &statuses, sql), expected, "{what}");
    }
    let mut nobody = cluster.connect_as("app_nobody");
    assert_eq!(
        call_status(&mut nobody, &statuses, "SELECT durable_jobs.enqueue_or_get_durable_job('mail', '{}')"),
        403
    );
    assert_eq!(
        call_status(
            &mut admin,
            &statuses,
            "SET durable_jobs.max_payload_size = 1; SET ROLE app_producer;
             SELECT durable_jobs.enqueue_or_get_durable_job('mail', jsonb_build_object('big', repeat('x', 2000)));
             RESET ROLE; RESET durable_jobs.max_payload_size;",
        ),
        413
    );
    admin.batch_execute("RESET ROLE; RESET durable_jobs.max_payload_size").unwrap();

    // The producer's job, succeeded; another, failed.
    let job = claim(&mut admin, "w", 60).unwrap();
    assert_eq!(complete(&mut admin, &job, "w"), "succeeded");
    assert_eq!(replay_job(&mut producer, &statuses, job.job_id, r#"{"n": 1}"#), 409, "a succeeded job");
    assert_eq!(post_job(&mut producer, &statuses, "mail", r#"{"n": 3}"#, None), 201);
    let failed = claim(&mut admin, "w", 60).unwrap();
    assert_eq!(harness::fail(&mut admin, &failed, "w", "invalid_request"), "failed");
    assert_eq!(replay_job(&mut producer, &statuses, failed.job_id, r#"{"n": 4}"#), 422, "another payload");

    harness::set_intake(&cluster, &mut admin, "off");
    let mut producer = cluster.connect_as("app_producer");
    assert_eq!(post_job(&mut producer, &statuses, "mail", r#"{"n": 5}"#, None), 503, "intake off");
    assert_eq!(
        post_job(&mut producer, &statuses, "mail", r#"{"n": 1}"#, Some("key-1")),
        200,
        "a repeat still"
    );
    assert_eq!(replay_job(&mut producer, &statuses, failed.job_id, r#"{"n": 3}"#), 503, "intake off");
}

/// Another role's job is a 404 on every verb, exactly as a job that does not exist; its owner
/// gets 200 (or 409 for a cancel of an ended job). (Broken on purpose, cancel raising 42501 for
/// another role's job again: the stranger got 403.)
#[test]
fn another_roles_job_is_a_404_on_every_verb() {
    let statuses = documented_statuses();
    let cluster = Cluster::start("shared_preload_libraries = 'durable_jobs'");
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE ROLE app_producer LOGIN;  CREATE ROLE app_other LOGIN;
             GRANT USAGE ON SCHEMA durable_jobs TO app_producer, app_other;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_or_get_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                 durable_jobs.get_durable_job(bigint), durable_jobs.cancel_durable_job(bigint),
                 durable_jobs.replay_durable_job(bigint, jsonb, integer),
                 durable_jobs.get_durable_job_attempts(bigint), durable_jobs.diagnose_durable_job(bigint)
               TO app_producer, app_other;",
        )
        .unwrap();
    let mut producer = cluster.connect_as("app_producer");
    assert_eq!(post_job(&mut producer, &statuses, "mail", "{}", None), 201);
    let job = claim(&mut admin, "w", 60).unwrap();
    assert_eq!(harness::fail(&mut admin, &job, "w", "invalid_request"), "failed");
    let missing = i64::MAX;
    let mut other = cluster.connect_as("app_other");
    for job_id in [job.job_id, missing] {
        let answers = [
            get_job(&mut other, job_id),
            get_rows(&mut other, "get_durable_job_attempts", job_id),
            get_rows(&mut other, "diagnose_durable_job", job_id),
            replay_job(&mut other, &statuses, job_id, "{}"),
            delete_job(&mut other, &statuses, job_id),
        ];
        assert_eq!(answers, [404; 5], "job {job_id}");
    }
    let answers = [
        get_job(&mut producer, job.job_id),
        get_rows(&mut producer, "get_durable_job_attempts", job.job_id),
        get_rows(&mut producer, "diagnose_durable_job", job.job_id),
    ];
    assert_eq!(answers, [200; 3]);
    assert_eq!(delete_job(&mut producer, &statuses, job.job_id), 409, "an ended job");
    assert_eq!(replay_job(&mut producer, &statuses, job.job_id, "{}"), 200);
    assert_eq!(delete_job(&mut producer, &statuses, job.job_id), 200);
}
