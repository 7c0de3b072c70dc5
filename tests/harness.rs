//! A throwaway PostgreSQL cluster for end-to-end tests: initdb, start on a free loopback port,
//! CREATE EXTENSION durable_jobs, and stop and remove it again when dropped.
//!
//! It uses the server binaries of `PG_BIN` (default /usr/lib/postgresql/15/bin) and the
//! durable_jobs build that scripts/install-extension.sh put there. As root it runs the server as
//! the `postgres` OS user, since Postgres refuses to run as root.

use postgres::{Client, NoTls};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Cluster {
    pub data_dir: PathBuf,
    pub port: u16,
    bin_dir: PathBuf,
}

static CLUSTER_SEQUENCE: AtomicUsize = AtomicUsize::new(0);

fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

/// Runs a server binary, as the postgres OS user when we are root.
fn server_command(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `command` and panics with its output unless it succeeds.
pub fn run(mut command: Command, what: &str) {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().unwrap().port()
}

impl Cluster {
    /// A new cluster with `extra_conf` appended to postgresql.conf and the extension created.
    pub fn start(extra_conf: &str) -> Cluster {
        let cluster = Cluster::start_without_extension(extra_conf);
        cluster.connect().batch_execute("CREATE EXTENSION durable_jobs").expect("create extension");
        cluster
    }

    /// A new, running cluster with `extra_conf` appended to postgresql.conf.
    pub fn start_without_extension(extra_conf: &str) -> Cluster {
        let bin_dir =
            PathBuf::from(std::env::var("PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into()));
        let root = PathBuf::from("/var/tmp/durable_jobs_e2e");
        std::fs::create_dir_all(&root).expect("create cluster root");
        if running_as_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:").arg(&root);
                    c
                },
                "chown cluster root",
            );
        }
        let sequence = CLUSTER_SEQUENCE.fetch_add(1, Ordering::SeqCst);
        let data_dir = root.join(format!("cluster-{}-{sequence}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);

        let mut initdb = server_command(&bin_dir.join("initdb"));
        // UTF-8 whatever the machine's locale: the invalid-UTF-8 test needs the server to check input.
        initdb
            .args(["--auth=trust", "--username=postgres", "--no-sync", "--encoding=UTF8", "-D"])
            .arg(&data_dir);
        run(initdb, "initdb");

        let cluster = Cluster { data_dir, port: free_port(), bin_dir };
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             max_connections = 50\nfsync = on\nsynchronous_commit = on\n{extra_conf}\n",
            cluster.port,
            cluster.data_dir.display()
        );
        let conf_path = cluster.data_dir.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).expect("write postgresql.conf");
        cluster.pg_ctl(&["start", "-w", "-t", "60"]);
        cluster
    }

    /// A hot standby of this cluster, made by pg_basebackup and streaming from it, with
    /// `extra_conf` appended to its configuration, running.
    pub fn start_standby(&self, extra_conf: &str) -> Cluster {
        let sequence = CLUSTER_SEQUENCE.fetch_add(1, Ordering::SeqCst);
        let name = format!("cluster-{}-{sequence}", std::process::id());
        let data_dir = self.data_dir.parent().expect("cluster root").join(name);
        let _ = std::fs::remove_dir_all(&data_dir);
        let mut basebackup = server_command(&self.bin_dir.join("pg_basebackup"));
        basebackup
            .args(["-h", "127.0.0.1", "-U", "postgres", "-X", "stream", "-R", "-c", "fast", "-p"])
            .arg(self.port.to_string())
            .arg("-D")
            .arg(&data_dir);
        run(basebackup, "pg_basebackup");
        // The copy carries the primary's log; the standby's starts empty.
        let _ = std::fs::remove_file(data_dir.join("server.log"));
        let standby = Cluster { data_dir, port: free_port(), bin_dir: self.bin_dir.clone() };
        standby.append_conf(&format!(
            "port = {}\nunix_socket_directories = '{}'\n{extra_conf}",
            standby.port,
            standby.data_dir.display()
        ));
        standby.pg_ctl(&["start", "-w", "-t", "60"]);
        standby
    }

    /// Runs pg_ctl on this cluster. A server it starts has RUST_BACKTRACE=1 in its environment,
    /// as every server started on a machine that sets it does, whatever the tests' own
    /// environment: nothing of a Rust backtrace may reach a client or the log even then.
    pub fn pg_ctl(&self, args: &[&str]) {
        let mut command = server_command(&self.bin_dir.join("pg_ctl"));
        command.env("RUST_BACKTRACE", "1").env_remove("RUST_LIB_BACKTRACE");
        command.arg("-D").arg(&self.data_dir).arg("-l").arg(self.data_dir.join("server.log"));
        command.args(args);
        run(command, &format!("pg_ctl {args:?}"));
    }

    /// Appends lines to postgresql.conf (they apply at the next start or reload).
    pub fn append_conf(&self, lines: &str) {
        let path = self.data_dir.join("postgresql.conf");
        let mut conf = std::fs::read_to_string(&path).expect("read postgresql.conf");
        conf.push_str(lines);
        conf.push('\n');
        std::fs::write(&path, conf).expect("write postgresql.conf");
    }

    /// A libpq connection string for `user` to `database` of this cluster.
    pub fn dsn(&self, user: &str, database: &str) -> String {
        format!("host=127.0.0.1 port={} user={user} dbname={database}", self.port)
    }

    pub fn connection_string(&self) -> String {
        self.dsn("postgres", "postgres")
    }

    pub fn connect(&self) -> Client {
        Client::connect(&self.connection_string(), NoTls).expect("connect to test cluster")
    }

    /// Connects as another (login) role.
    pub fn connect_as(&self, role: &str) -> Client {
        Client::connect(&self.dsn(role, "postgres"), NoTls).expect("connect to test cluster as role")
    }

    /// The path of a PostgreSQL program (pg_dump, pg_restore, ...) of this cluster's version.
    pub fn program(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// Runs a server program (pg_upgrade, for instance) as the server's OS user, in `dir`.
    pub fn run_server_program(&self, name: &str, args: &[String], dir: &Path) -> std::process::Output {
        let mut command = server_command(&self.program(name));
        command.args(args).current_dir(dir);
        command.output().unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// Connects to another database of this cluster.
    pub fn connect_to(&self, database: &str) -> Client {
        Client::connect(&self.dsn("postgres", database), NoTls)
            .expect("connect to the test cluster's database")
    }

    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut command = server_command(&self.bin_dir.join("pg_ctl"));
        command.arg("-D").arg(&self.data_dir).args(["stop", "-m", "immediate", "-w"]);
        let _ = command.output();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
    }
}

/// The SQLSTATE of a failed statement, for assertions on bad input.
pub fn sqlstate(error: &postgres::Error) -> String {
    error.code().map(|c| c.code().to_string()).unwrap_or_else(|| format!("no SQLSTATE: {error}"))
}

/// postgresql.conf lines for a cluster whose background worker runs jobs quickly.
pub const WORKER_CONF: &str = "shared_preload_libraries = 'durable_jobs'\n\
                               durable_jobs.worker_enabled = on\n\
                               durable_jobs.poll_interval = '50ms'\n\
                               durable_jobs.retry_base_delay = '100ms'\n";

/// Sets `durable_jobs.intake_enabled` (a reload setting) to `value` through `client`, a session
/// that has loaded the library (which defines the setting), and waits until a new session reads it.
pub fn set_intake(cluster: &Cluster, client: &mut Client, value: &str) {
    client.batch_execute(&format!("ALTER SYSTEM SET durable_jobs.intake_enabled = {value}")).unwrap();
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
    wait_until(std::time::Duration::from_secs(10), "the reload", || {
        cluster
            .connect()
            .query_one("SELECT current_setting('durable_jobs.intake_enabled')", &[])
            .unwrap()
            .get::<_, String>(0)
            == value
    });
}

/// Polls `condition` every 100 ms until it holds; panics with `what` after `timeout`.
pub fn wait_until(timeout: std::time::Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !condition() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

impl Cluster {
    /// Connects, retrying while the server restarts (after a crash, for instance).
    pub fn connect_when_ready(&self, timeout: std::time::Duration) -> Client {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match Client::connect(&self.connection_string(), NoTls) {
                Ok(client) => return client,
                Err(error) if std::time::Instant::now() < deadline => {
                    let _ = error;
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(error) => panic!("server did not come back: {error}"),
            }
        }
    }

    /// Process ids of the running durable_jobs background workers.
    pub fn worker_pids(&self, client: &mut Client) -> Vec<i32> {
        client
            .query("SELECT pid FROM pg_stat_activity WHERE backend_type = 'durable_jobs worker'", &[])
            .expect("list workers")
            .iter()
            .map(|row| row.get(0))
            .collect()
    }

    /// Kills the background worker `victim` (one of `workers`, the pids running now) with
    /// SIGKILL, checks the kill took, and waits until the crash restart brought the workers back,
    /// every one under a new pid.
    pub fn kill_worker_and_await_restart(&self, victim: i32, workers: &[i32]) {
        let status = Command::new("kill").args(["-9", &victim.to_string()]).status().expect("kill -9");
        assert!(status.success(), "kill -9 {victim}");
        // A killed backend makes the postmaster reset every session.
        wait_until(std::time::Duration::from_secs(60), "the workers back after the kill", || {
            let mut client = self.connect_when_ready(std::time::Duration::from_secs(60));
            let now: Vec<i32> = client
                .query("SELECT pid FROM pg_stat_activity WHERE backend_type = 'durable_jobs worker'", &[])
                .map(|rows| rows.iter().map(|row| row.get(0)).collect())
                .unwrap_or_default();
            !now.is_empty() && now.iter().all(|pid| !workers.contains(pid))
        });
    }
}

/// An error's SQLSTATE and message (postgres::Error shows only "db error").
pub fn error_text(error: &postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => error.to_string(),
    }
}

/// Count of rows a query returns as its single bigint.
pub fn count(client: &mut Client, query: &str) -> i64 {
    client.query_one(query, &[]).unwrap_or_else(|e| panic!("{query}: {}", error_text(&e))).get(0)
}

/// How many background workers wait on `wait_event` (pg_stat_activity).
pub fn workers_waiting_on(client: &mut Client, wait_event: &str) -> i64 {
    let query = "SELECT count(*) FROM pg_stat_activity
                 WHERE backend_type = 'durable_jobs worker' AND wait_event = $1";
    client.query_one(query, &[&wait_event]).unwrap_or_else(|e| panic!("{query}: {}", error_text(&e))).get(0)
}

/// Waits until the one background worker sleeps (a latch wait, wait event `Extension`): an
/// enqueue then may lease it its job.
pub fn wait_for_the_workers_sleep(client: &mut Client) {
    wait_until(std::time::Duration::from_secs(30), "the worker's sleep", || {
        workers_waiting_on(client, "Extension") == 1
    });
}

/// (job_state, last_failure_code, attempt_count) of the one job `selector`, an SQL condition,
/// picks out.
pub fn job_outcome(client: &mut Client, selector: &str) -> (String, Option<String>, i32) {
    let query = format!(
        "SELECT job_state, last_failure_code, attempt_count FROM durable_jobs.durable_job WHERE {selector}"
    );
    let row = client.query_one(&query, &[]).unwrap_or_else(|e| panic!("{query}: {e}"));
    (row.get(0), row.get(1), row.get(2))
}

/// A table `public.effects (n integer)` and handler `record` for job kind `record`, which adds
/// the payload's `n` to it.
pub const RECORD_HANDLER: &str = "
    CREATE TABLE public.effects (n integer);
    CREATE FUNCTION public.record_effect(payload jsonb) RETURNS void LANGUAGE sql
        AS $$ INSERT INTO public.effects VALUES ((payload->>'n')::integer) $$;
    SELECT durable_jobs.register_durable_job_handler('record', 'public.record_effect(jsonb)');";

/// The rows of the extension's three data tables (jobs, handler registrations, queue controls),
/// to show that a dump, an upgrade or a restore kept them as they were.
pub fn extension_data(client: &mut Client) -> Vec<Vec<String>> {
    [
        ("durable_jobs.durable_job", "job_id"),
        ("durable_jobs.durable_job_handler", "job_kind"),
        ("durable_jobs.durable_job_queue", "queue_name"),
    ]
    .iter()
    .map(|(table, order_by)| table_rows(client, table, order_by))
    .collect()
}

/// Every row of `table` as text, ordered by `order_by`: a snapshot to compare whole tables with.
pub fn table_rows(client: &mut impl postgres::GenericClient, table: &str, order_by: &str) -> Vec<String> {
    let query = format!("SELECT t::text FROM {table} t ORDER BY {order_by}");
    client
        .query(&query, &[])
        .unwrap_or_else(|e| panic!("{query}: {}", error_text(&e)))
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A job as claim_next_durable_job hands it out.
pub struct Claimed {
    pub job_id: i64,
    pub lease_token: String,
    pub attempt_count: i32,
}

/// Claims the next job of any queue for `worker`.
pub fn claim(client: &mut Client, worker: &str, lease_seconds: i32) -> Option<Claimed> {
    claim_in(client, worker, None, lease_seconds)
}

/// Claims the next job of `queue` for `worker`.
pub fn claim_from(client: &mut Client, worker: &str, queue: &str, lease_seconds: i32) -> Option<Claimed> {
    claim_in(client, worker, Some(vec![queue]), lease_seconds)
}

fn claim_in(
    client: &mut Client,
    worker: &str,
    queues: Option<Vec<&str>>,
    lease_seconds: i32,
) -> Option<Claimed> {
    client
        .query_opt(
            "SELECT job_id, lease_token::text, attempt_count
             FROM durable_jobs.claim_next_durable_job($1, $2::text[], $3)",
            &[&worker, &queues, &lease_seconds],
        )
        .unwrap_or_else(|e| panic!("claim: {}", error_text(&e)))
        .map(|r| Claimed { job_id: r.get(0), lease_token: r.get(1), attempt_count: r.get(2) })
}

/// complete_durable_job for `job` as `worker`: `succeeded` or `stale`.
pub fn complete(client: &mut impl postgres::GenericClient, job: &Claimed, worker: &str) -> String {
    client
        .query_one(
            "SELECT durable_jobs.complete_durable_job($1, $2, $3::text::uuid)",
            &[&job.job_id, &worker, &job.lease_token],
        )
        .unwrap_or_else(|e| panic!("complete: {}", error_text(&e)))
        .get(0)
}

/// fail_durable_job for `job` as `worker` with `code`: `retried`, `failed` or `stale`.
pub fn fail(client: &mut impl postgres::GenericClient, job: &Claimed, worker: &str, code: &str) -> String {
    client
        .query_one(
            "SELECT durable_jobs.fail_durable_job($1, $2, $3::text::uuid, $4)",
            &[&job.job_id, &worker, &job.lease_token, &code],
        )
        .unwrap_or_else(|e| panic!("fail: {}", error_text(&e)))
        .get(0)
}

/// The value of one metric from durable_job_metrics().
pub fn metric(client: &mut Client, name: &str) -> i64 {
    client
        .query_one(
            "SELECT metric_value FROM durable_jobs.durable_job_metrics() WHERE metric_name = $1",
            &[&name],
        )
        .expect("metric")
        .get(0)
}

/// A gate that handlers wait at, opened by the test: a session of its own holds advisory lock
/// `key`, and a handler that runs `Gate::pass(key)` (a shared lock on the same key) waits there
/// (wait event `advisory`) until `open`. A handler's time at the gate is the test's to decide,
/// not a nap's length that a loaded machine may outlast or cut short.
pub struct Gate {
    holder: Client,
    key: i64,
}

impl Gate {
    pub fn closed(cluster: &Cluster, key: i64) -> Gate {
        let mut holder = cluster.connect();
        holder.execute("SELECT pg_advisory_lock($1)", &[&key]).unwrap();
        Gate { holder, key }
    }

    /// The SQL call that waits at gate `key` (for a handler's body: `SELECT` or `PERFORM` it).
    pub fn pass(key: i64) -> String {
        format!("pg_advisory_xact_lock_shared({key})")
    }

    pub fn open(&mut self) {
        let opened: bool =
            self.holder.query_one("SELECT pg_advisory_unlock($1)", &[&self.key]).unwrap().get(0);
        assert!(opened, "the gate was closed");
    }
}

/// How many sessions of `backend_type` (pg_stat_activity) wait at gate `key`.
pub fn waiting_at_gate(client: &mut Client, backend_type: &str, key: i64) -> i64 {
    sessions_at_gate(client, backend_type, key).len() as i64
}

/// The pids of the sessions of `backend_type` (pg_stat_activity) that wait at gate `key`.
pub fn sessions_at_gate(client: &mut Client, backend_type: &str, key: i64) -> Vec<i32> {
    let query = "SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                 WHERE a.backend_type = $1 AND l.locktype = 'advisory' AND NOT l.granted
                   AND l.classid = 0 AND l.objid = $2::bigint::oid AND l.objsubid = 1";
    client
        .query(query, &[&backend_type, &key])
        .unwrap_or_else(|e| panic!("{query}: {}", error_text(&e)))
        .iter()
        .map(|row| row.get(0))
        .collect()
}
