//! The example external workers of docs/examples run against a real cluster: they claim, keep
//! their lease alive through slow work, complete with their effects or fail with a stable code
//! and a message, and stop cleanly on SIGTERM.

use harness::{count, job_outcome, wait_until, Cluster};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SETUP: &str = "
    CREATE TABLE public.postcards (name text);
    SELECT durable_jobs.enqueue_durable_job('postcard', '{\"name\": \"alice\"}');
    -- Slower than its 3 s lease: only lease extension keeps it from being reclaimed.
    SELECT durable_jobs.enqueue_durable_job('postcard', '{\"name\": \"bob\", \"seconds\": 7.5}');
    SELECT durable_jobs.enqueue_durable_job('mystery', '{}');
    SELECT durable_jobs.enqueue_durable_job('postcard', '{\"name\": \"carol\", \"fail\": \"transient\"}',
                                            NULL, 'default', now(), 1);
    SELECT durable_jobs.enqueue_durable_job('postcard', '{}');
    -- Bad input of other shapes: both examples fail it alike, as invalid_request (broken on
    -- purpose, the Python example's old check, that a name is there, let job 6 succeed).
    SELECT durable_jobs.enqueue_durable_job('postcard', '{\"name\": 42}');
    SELECT durable_jobs.enqueue_durable_job('postcard', '[\"dave\"]');
    SELECT durable_jobs.enqueue_durable_job('postcard', '{\"name\": \"erin\", \"seconds\": \"soon\"}');";

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/examples")
}

/// Starts `worker` against a fresh cluster holding the SETUP jobs, with a 3 s lease (extended
/// every second by the examples' heartbeat: a loaded machine has two seconds to get one in; with
/// 1 s leases it had a third of a second), and checks what it does with them.
fn run_example_worker(mut worker: Command, what: &str) {
    let cluster = Cluster::start("");
    cluster.connect().batch_execute(SETUP).unwrap();
    let worker = worker
        .env("DURABLE_JOBS_DSN", cluster.connection_string())
        .env("DURABLE_JOBS_LEASE_SECONDS", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(what);
    check_example_worker(&cluster, worker);
}

/// Waits for the example to finish its postcard jobs, stops it with SIGTERM and checks the outcome.
fn check_example_worker(cluster: &Cluster, mut worker: Child) {
    let mut client = cluster.connect();
    wait_until(Duration::from_secs(60), "the example worker to finish every postcard job", || {
        count(
            &mut client,
            "SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NULL AND job_kind = 'postcard'",
        ) == 0
    });
    let terminated = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap();
    assert!(terminated.success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = worker.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the worker did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = worker.wait_with_output().unwrap();
    assert!(status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("stopped"));

    let succeeded = ("succeeded".to_string(), None, 1);
    assert_eq!(job_outcome(&mut client, "job_id = 1"), succeeded);
    assert_eq!(job_outcome(&mut client, "job_id = 2"), succeeded, "the slow job kept its lease");
    // A kind it does not handle is never claimed (0.3.0's examples failed it as invalid_request).
    assert_eq!(job_outcome(&mut client, "job_kind = 'mystery'"), ("available".into(), None, 0));
    for bad_input in 5..=8 {
        assert_eq!(
            job_outcome(&mut client, &format!("job_id = {bad_input}")),
            ("failed".into(), Some("invalid_request".into()), 1),
            "job {bad_input}"
        );
    }
    assert_eq!(
        job_outcome(&mut client, "job_id = 4"),
        ("failed".into(), Some("target_unavailable".into()), 1)
    );
    // Both pass their error's message, which the attempt keeps.
    let message: Option<String> = client
        .query_one("SELECT error_message FROM durable_jobs.get_durable_job_attempts(4)", &[])
        .unwrap()
        .get(0);
    assert_eq!(message.as_deref(), Some("the target is down"));
    let names: Vec<String> = client
        .query("SELECT name FROM public.postcards ORDER BY name", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, ["alice", "bob"], "effects of succeeded jobs only, once each");
}

#[test]
fn the_python_example_worker_runs_and_stops_cleanly() {
    let mut worker = Command::new("python3");
    worker.arg(examples_dir().join("python/worker.py"));
    run_example_worker(worker, "python3 with psycopg (scripts/install-prerequisites.sh installs it)");
}

#[test]
fn the_rust_example_worker_runs_and_stops_cleanly() {
    let manifest = examples_dir().join("rust/Cargo.toml");
    let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/example-rust");
    let built = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo build of the Rust example");
    assert!(built.success());
    run_example_worker(
        Command::new(target.join("debug/durable_jobs_example_worker")),
        "the built Rust example",
    );
}
