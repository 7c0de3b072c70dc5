//! Backups: pg_dump of a database with durable_jobs, restored with pg_restore into a new one,
//! brings back every job, handler registration and queue control as it was, with the job_id
//! sequence past the restored jobs and running jobs' leases still fencing.

use harness::{count, extension_data, run, Cluster, RECORD_HANDLER};
use postgres::Client;
use std::process::Command;

#[test]
fn pg_dump_and_pg_restore_bring_back_every_job_and_lease() {
    let cluster = Cluster::start("");
    let mut client = cluster.connect();
    client
        .batch_execute(&format!(
            "{RECORD_HANDLER}
             SELECT durable_jobs.enqueue_durable_job('record', jsonb_build_object('n', g))
             FROM generate_series(1, 3) g;
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 1}}', 'key-1', queue_name => 'held');
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 2}}', queue_name => 'gone');
             SELECT durable_jobs.cancel_durable_job(job_id) FROM durable_jobs.durable_job
             WHERE queue_name = 'gone';
             SELECT durable_jobs.pause_durable_job_queue('paused');
             SELECT durable_jobs.set_durable_job_queue_concurrency('held', 3);"
        ))
        .expect("fill the queue");
    let lease = client
        .query_one(
            "SELECT job_id, lease_token::text FROM durable_jobs.claim_next_durable_job('ext-1', '{held}', 3600)",
            &[],
        )
        .expect("claim");
    let (held_job, held_token): (i64, String) = (lease.get(0), lease.get(1));
    let before = extension_data(&mut client);
    let last_job_id = count(&mut client, "SELECT max(job_id) FROM durable_jobs.durable_job");

    let dump = cluster.data_dir.with_extension("dump");
    let mut pg_dump = Command::new(cluster.program("pg_dump"));
    pg_dump
        .arg("--format=custom")
        .arg(format!("--dbname={}", cluster.connection_string()))
        .arg(format!("--file={}", dump.display()));
    run(pg_dump, "pg_dump");
    client.batch_execute("CREATE DATABASE restored").unwrap();
    let mut pg_restore = Command::new(cluster.program("pg_restore"));
    pg_restore
        .arg("--exit-on-error")
        .arg(format!("--dbname={}", cluster.dsn("postgres", "restored")))
        .arg(&dump);
    run(pg_restore, "pg_restore");
    let _ = std::fs::remove_file(&dump);

    let mut restored = cluster.connect_to("restored");
    assert_eq!(
        extension_data(&mut restored),
        before,
        "jobs, handlers and queue controls come back as they were"
    );
    let next_job_id = count(&mut restored, "SELECT durable_jobs.enqueue_durable_job('external', '{}')");
    assert!(next_job_id > last_job_id, "job_id {next_job_id} continues after {last_job_id}");
    let again = count(
        &mut restored,
        "SELECT durable_jobs.enqueue_durable_job('external', '{\"step\": 1}', 'key-1', queue_name => 'held')",
    );
    assert_eq!(again, held_job, "idempotency keys survive the restore");
    let completion = |client: &mut Client, worker: &str| -> String {
        client
            .query_one(
                "SELECT durable_jobs.complete_durable_job($1, $2, $3::text::uuid)",
                &[&held_job, &worker, &held_token],
            )
            .unwrap()
            .get(0)
    };
    assert_eq!(completion(&mut restored, "ext-2"), "stale", "the restored lease still fences");
    assert_eq!(completion(&mut restored, "ext-1"), "succeeded", "and its holder can finish the job");
}
