//! durable_job_metrics() and durable_job_metrics_prometheus(): the counters, job counts per
//! state, and per-queue gauges and histograms, under a fixed set of names. Nothing here ever
//! carries a payload, key, id, role, SQL or error text.

use crate::jobs::counters::{counter_value, Counter};
use crate::jobs::histograms::{self, HistogramValues, BUCKET_BOUNDS, QUEUE_SLOTS};
use crate::pg::privilege::{as_extension_owner, as_extension_owner_of};
use pgrx::prelude::*;

/// The `jobs_<state>` gauges in one pass over the table (a count per state would read it once
/// per state), zero for a state no job is in.
pub const JOBS_PER_STATE: &str = "
    SELECT 'jobs_' || s.state, COALESCE(c.jobs, 0)
    FROM pg_catalog.unnest(ARRAY['available', 'running', 'succeeded', 'failed', 'cancelled'])
         WITH ORDINALITY AS s(state, position)
    LEFT JOIN (SELECT j.job_state, pg_catalog.count(*) AS jobs
               FROM durable_jobs.durable_job j GROUP BY j.job_state) c ON c.job_state = s.state
    ORDER BY s.position";

/// Counters, then `jobs_<state>` gauges, always the same names in the same order.
fn collect() -> Vec<(String, i64)> {
    let mut metrics: Vec<(String, i64)> =
        Counter::ALL.iter().map(|c| (c.name().to_string(), counter_value(*c))).collect();
    as_extension_owner(|| {
        Spi::connect(|client| {
            for row in client.select(JOBS_PER_STATE, None, &[]).expect("count jobs per state") {
                metrics.push((row.get(1).unwrap().unwrap(), row.get(2).unwrap().unwrap()));
            }
        })
    });
    metrics
}

#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn durable_job_metrics() -> TableIterator<'static, (name!(metric_name, String), name!(metric_value, i64))> {
    TableIterator::new(collect())
}

/// The same metrics in Prometheus' text exposition format, for exporters that run a query.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn durable_job_metrics_prometheus() -> String {
    let metrics = collect();
    let mut text = String::new();
    for (counter, (_, value)) in Counter::ALL.iter().zip(&metrics) {
        let name = format!("durable_jobs_{}_total", counter.name());
        text.push_str(&format!("# HELP {name} {}\n# TYPE {name} counter\n{name} {value}\n", counter.help()));
    }
    text.push_str(
        "# HELP durable_jobs_jobs Jobs in the queue table, by state.\n# TYPE durable_jobs_jobs gauge\n",
    );
    for (name, value) in &metrics[Counter::ALL.len()..] {
        let state = name.trim_start_matches("jobs_");
        text.push_str(&format!("durable_jobs_jobs{{state=\"{state}\"}} {value}\n"));
    }
    text.push_str(&queue_gauges());
    text.push_str(&queue_limit_gauges());
    text.push_str(&queue_histograms());
    text
}

// Per queue with a limit per key or a rate limit (the first by name): how many keys run as many
// jobs as the limit per key, and how many of the rate limit's tokens are usable now.
const QUEUE_LIMIT_GAUGES: &str = "
    SELECT q.queue_name,
           CASE WHEN q.key_concurrency_limit IS NOT NULL THEN
               (SELECT pg_catalog.count(*) FROM (
                    SELECT FROM durable_jobs.durable_job r
                    WHERE r.queue_name = q.queue_name AND r.job_state = 'running' AND r.concurrency_key IS NOT NULL
                      AND (r.lease_expires_at > pg_catalog.clock_timestamp()
                           OR durable_jobs.durable_job_row_held(r.ctid))
                    GROUP BY r.concurrency_key
                    HAVING pg_catalog.count(*) >= q.key_concurrency_limit) k) END,
           CASE WHEN q.rate_per_second IS NOT NULL THEN
               (SELECT pg_catalog.count(*) FROM durable_jobs.durable_job_rate_token t
                WHERE t.queue_name = q.queue_name AND t.token <= q.rate_burst
                  AND t.next_at <= pg_catalog.clock_timestamp()) END
    FROM durable_jobs.durable_job_queue q
    WHERE q.key_concurrency_limit IS NOT NULL OR q.rate_per_second IS NOT NULL
    ORDER BY q.queue_name
    LIMIT $1";

/// Keys at their limit and usable rate tokens per queue, in Prometheus text (schemas from 0.6.0
/// on). Keys are counted, never labels.
fn queue_limit_gauges() -> String {
    let rows: Vec<(String, Option<i64>, Option<i64>)> = as_extension_owner_of(|installed| {
        if !installed.has_attempt_history {
            return Vec::new();
        }
        Spi::connect(|client| {
            client
                .select(QUEUE_LIMIT_GAUGES, None, &[EXPORTED_QUEUES_LIMIT.into()])
                .expect("queue limit gauges")
                .map(|row| (row.get(1).unwrap().unwrap(), row.get(2).unwrap(), row.get(3).unwrap()))
                .collect()
        })
    });
    let mut text = String::new();
    let gauges: [(&str, &str, fn(&(String, Option<i64>, Option<i64>)) -> Option<i64>); 2] = [
        (
            "durable_jobs_queue_keys_at_limit",
            "Concurrency keys running as many jobs as the queue's limit per key, per queue with such a limit.",
            |r| r.1,
        ),
        (
            "durable_jobs_queue_rate_tokens",
            "Tokens of the queue's rate limit usable now, per queue with a rate limit.",
            |r| r.2,
        ),
    ];
    for (name, help, value) in gauges {
        text.push_str(&format!(
            "# HELP {name} {help}
# TYPE {name} gauge
"
        ));
        for row in &rows {
            if let Some(value) = value(row) {
                text.push_str(&format!("{name}{{queue=\"{}\"}} {value}\n", label_value(&row.0)));
            }
        }
    }
    text
}

/// At most this many queues get their own series; the rest are counted in
/// `durable_jobs_queues_not_exported` (gauges) or share the series of queue "" (histograms).
pub const EXPORTED_QUEUES_LIMIT: i64 = QUEUE_SLOTS as i64;

// Per queue with a pending job or a control (a row resumed and unlimited is none): ready jobs
// (available, run_after passed), running jobs, and the age of the oldest ready job; the queues with
// the most ready jobs first. Reads only pending jobs (through the claim order index's states).
const QUEUE_GAUGES: &str = "
    WITH pending AS (
        SELECT j.queue_name,
               pg_catalog.count(*) FILTER (WHERE j.job_state = 'available' AND j.run_after <= pg_catalog.now()) AS ready,
               pg_catalog.count(*) FILTER (WHERE j.job_state = 'running') AS running,
               pg_catalog.min(j.run_after) FILTER (WHERE j.job_state = 'available' AND j.run_after <= pg_catalog.now())
                   AS oldest_ready
        FROM durable_jobs.durable_job j
        WHERE j.job_state IN ('available', 'running')
        GROUP BY j.queue_name),
    queues AS (
        SELECT COALESCE(p.queue_name, q.queue_name) AS queue_name,
               COALESCE(p.ready, 0) AS ready, COALESCE(p.running, 0) AS running,
               COALESCE(pg_catalog.date_part('epoch', pg_catalog.now() - p.oldest_ready), 0)::pg_catalog.float8 AS age
        FROM pending p
        FULL JOIN (SELECT queue_name FROM durable_jobs.durable_job_queue
                   WHERE paused OR concurrency_limit IS NOT NULL) q ON q.queue_name = p.queue_name)
    SELECT queue_name, ready, running, age, pg_catalog.count(*) OVER () AS queues
    FROM queues
    ORDER BY ready DESC, queue_name
    LIMIT $1";

/// The per-queue gauges in Prometheus text, with each queue as a label.
fn queue_gauges() -> String {
    let rows: Vec<(String, i64, i64, f64, i64)> = as_extension_owner(|| {
        Spi::connect(|client| {
            client
                .select(QUEUE_GAUGES, None, &[EXPORTED_QUEUES_LIMIT.into()])
                .expect("queue gauges")
                .map(|row| {
                    (
                        row.get(1).unwrap().unwrap(),
                        row.get(2).unwrap().unwrap(),
                        row.get(3).unwrap().unwrap(),
                        row.get(4).unwrap().unwrap(),
                        row.get(5).unwrap().unwrap(),
                    )
                })
                .collect()
        })
    });
    let total = rows.first().map_or(0, |row| row.4);
    let mut text = String::new();
    let gauges: [(&str, &str, fn(&(String, i64, i64, f64, i64)) -> String); 3] = [
        (
            "durable_jobs_queue_ready_jobs",
            "Jobs ready to run now (available, run_after passed), per queue.",
            |r| r.1.to_string(),
        ),
        (
            "durable_jobs_queue_running_jobs",
            "Running jobs (holding a lease, live or expired), per queue.",
            |r| r.2.to_string(),
        ),
        (
            "durable_jobs_queue_oldest_ready_age_seconds",
            "How long the oldest ready job of the queue has waited; 0 when none is ready.",
            |r| format!("{:.3}", r.3),
        ),
    ];
    for (name, help, value) in gauges {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for row in &rows {
            text.push_str(&format!("{name}{{queue=\"{}\"}} {}\n", label_value(&row.0), value(row)));
        }
    }
    text.push_str(&format!(
        "# HELP durable_jobs_queues_not_exported Queues left out of the per-queue gauges (beyond the first {EXPORTED_QUEUES_LIMIT} by ready jobs).\n\
         # TYPE durable_jobs_queues_not_exported gauge\ndurable_jobs_queues_not_exported {}\n",
        (total - rows.len() as i64).max(0)
    ));
    text
}

/// The attempts' wait and run time per queue (`jobs::histograms`), as Prometheus histograms; the
/// queues beyond the first `QUEUE_SLOTS` seen share the series of queue "" (no queue is named so).
fn queue_histograms() -> String {
    let (queues, other_wait, other_run) = histograms::read_all();
    let families: [(&str, &str, fn(&(String, HistogramValues, HistogramValues)) -> HistogramValues); 2] = [
        (
            "durable_jobs_job_queue_wait_seconds",
            "Time from a job's run_after to its attempt's claim, per queue, observed when the attempt completes or fails.",
            |q| q.1,
        ),
        (
            "durable_jobs_job_run_seconds",
            "Time from an attempt's claim to its completion or failure, per queue.",
            |q| q.2,
        ),
    ];
    let other = (String::new(), other_wait, other_run);
    let mut text = String::new();
    for (name, help, values_of) in families {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        let shared = values_of(&other);
        let rows = queues.iter().chain((shared.buckets.iter().sum::<u64>() > 0).then_some(&other));
        for queue in rows {
            let values = values_of(queue);
            let label = label_value(&queue.0);
            let mut cumulative = 0;
            for (bucket, count) in values.buckets.iter().enumerate() {
                cumulative += count;
                let bound = BUCKET_BOUNDS.get(bucket).map_or("+Inf".to_string(), |b| b.to_string());
                text.push_str(&format!("{name}_bucket{{queue=\"{label}\",le=\"{bound}\"}} {cumulative}\n"));
            }
            text.push_str(&format!(
                "{name}_sum{{queue=\"{label}\"}} {:.6}\n{name}_count{{queue=\"{label}\"}} {cumulative}\n",
                values.sum_microseconds as f64 / 1e6
            ));
        }
    }
    text
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn label_value(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
