'use strict';
// Peer benchmark: graphile-worker 0.17.3 on an already running cluster.
//   node bench.js <connection-string> drain|latency <jobs>
// drain:   graphile_drain_jobs_per_s N
// latency: graphile_latency_p50_ms N / graphile_latency_p99_ms N (enqueue call to task start)

// Read when graphile-worker loads: without it every job formats a "Completed task" line.
process.env.NO_LOG_SUCCESS = '1';
const { EventEmitter } = require('events');
const { run, runMigrations, makeWorkerUtils, Logger } = require('graphile-worker');

const [connectionString, mode, jobsArg] = process.argv.slice(2);
const jobs = Number(jobsArg);
if (!connectionString || !['drain', 'latency'].includes(mode) || !Number.isInteger(jobs) || jobs < 1) {
  console.error('usage: node bench.js <connection-string> drain|latency <jobs>');
  process.exit(2);
}

// Warnings and errors to stderr; stdout carries only the figures.
const logger = new Logger(() => (level, message) => {
  if (level === 'error' || level === 'warning') console.error(`graphile-worker ${level}: ${message}`);
});
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const now = () => process.hrtime.bigint();
const ms = (ns) => Number(ns) / 1e6;
// A promise that is only raced may settle after the race: never let that crash the process.
const quiet = (p) => { p.catch(() => {}); return p; };

// Throughput settings as in graphile-worker's own perfTest/graphile.config.js.
// localQueue, completeJobBatchDelay and failJobBatchDelay exist only as preset options in 0.17.3.
const workerOptions = (events, taskList) => ({
  connectionString,
  concurrency: 24,
  maxPoolSize: 25,
  noHandleSignals: true,
  logger,
  events,
  taskList,
  parsedCronItems: [], // never read a crontab file from the cwd
  preset: {
    worker: {
      preparedStatements: true,
      localQueue: { size: 500 },
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
    },
  },
});

// Like PostgreSQL's percentile_cont, as bench/run.sh uses for durable_jobs.
function percentile(sorted, p) {
  const pos = p * (sorted.length - 1);
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

async function main() {
  let runner;
  let utils;
  let timer;
  try {
    await runMigrations({ connectionString, logger });
    utils = await makeWorkerUtils({ connectionString, logger });
    const q = (sql) => utils.withPgClient((c) => c.query(sql));
    const remaining = async () =>
      Number((await q('SELECT count(*) AS n FROM graphile_worker._private_jobs')).rows[0].n);
    await q('TRUNCATE graphile_worker._private_jobs');

    // Resolves when the task has run `jobs` times; rejects on a job error or a dead pool.
    let ran = 0;
    let allRan;
    const done = quiet(new Promise((resolve, reject) => {
      allRan = resolve;
      timer = setTimeout(() => reject(new Error(`timed out with ${ran} of ${jobs} jobs run`)), 60000 + jobs * 20);
    }));
    const events = new EventEmitter();
    const failed = quiet(new Promise((_, reject) => {
      events.on('job:error', ({ job, error }) => reject(new Error(`job ${job.id} failed: ${error.message}`)));
    }));
    const started = new Map(); // job id -> task start (ns)
    const taskList = {
      noop: async (_payload, helpers) => {
        if (mode === 'latency') started.set(String(helpers.job.id), now());
        if (++ran === jobs) allRan();
      },
    };
    // All jobs done only once their completions are committed (batched, so after the task ran).
    const finish = async () => {
      const stopped = quiet(runner.promise.then(() => { throw new Error('worker stopped early'); }));
      await Promise.race([done, failed, stopped]);
      while ((await remaining()) > 0) await sleep(2);
    };

    if (mode === 'drain') {
      await q(`SELECT count(*) FROM graphile_worker.add_jobs(array(
                 SELECT ('noop', '{}', null, null, null, null, null, null)::graphile_worker.job_spec
                 FROM generate_series(1, ${jobs})))`);
      await q('VACUUM ANALYZE graphile_worker._private_jobs');
      // Clock starts when the worker pool is created, after run()'s connect and migration check.
      let t0;
      events.once('pool:create', () => { t0 = now(); });
      runner = await run(workerOptions(events, taskList));
      quiet(runner.promise);
      await finish();
      const seconds = Number(now() - t0) / 1e9;
      console.log(`graphile_drain_jobs_per_s ${Math.round(jobs / seconds)}`);
    } else {
      const listening = new Promise((r) => events.once('pool:listen:success', r));
      runner = await run(workerOptions(events, taskList));
      quiet(runner.promise);
      await Promise.race([listening, done]);
      await sleep(200); // let the first (empty) fetch finish so every job is a NOTIFY wake-up
      const enqueued = new Map(); // job id -> time before add_job was sent (ns)
      await utils.withPgClient(async (client) => {
        for (let i = 0; i < jobs; i++) {
          const t = now();
          const { rows } = await client.query("SELECT id FROM graphile_worker.add_job('noop')");
          enqueued.set(String(rows[0].id), t);
          await sleep(5);
        }
      });
      await finish();
      const lat = [...enqueued].map(([id, t]) => {
        if (!started.has(id)) throw new Error(`no start recorded for job ${id}`);
        return ms(started.get(id) - t);
      }).sort((a, b) => a - b);
      console.log(`graphile_latency_p50_ms ${percentile(lat, 0.5).toFixed(2)}`);
      console.log(`graphile_latency_p99_ms ${percentile(lat, 0.99).toFixed(2)}`);
    }
  } finally {
    clearTimeout(timer);
    if (runner) await runner.stop().catch((e) => console.error(`graphile bench: stopping runner: ${e.message}`));
    if (utils) await utils.release();
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(`graphile bench (${mode}) failed: ${e && e.stack ? e.stack : e}`);
    process.exit(1);
  },
);
