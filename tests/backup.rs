//! Backups: pg_dump of a database with durable_jobs, restored with pg_restore into a new one,
//! brings back every job, handler registration and queue control as it was, with the job_id
//! sequence past the restored jobs and running jobs' leases still fencing.

use harness::{claim_from, complete, count, extension_data, run, Cluster, RECORD_HANDLER};
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
    let held = claim_from(&mut client, "ext-1", "held", 3600).expect("a job to claim");
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
    assert_eq!(again, held.job_id, "idempotency keys survive the restore");
    assert_eq!(complete(&mut restored, &held, "ext-2"), "stale", "the restored lease still fences");
    assert_eq!(complete(&mut restored, &held, "ext-1"), "succeeded", "and its holder can finish the job");
}
