// Graphile Worker's side of the graphile section (benchmarks/graphile.py), one process.
//
//   node drain.js seed N
//       installs Graphile Worker's schema and adds N no-op jobs with its bulk path
//       (addJobs, 5,000 a call); prints {"seconds": ...}.
//   node drain.js drain N SETTINGS_JSON
//       builds the worker's options from SETTINGS_JSON (see `preset` below), opens and
//       warms its connection pool, prints {"ready": true}, waits for a line on stdin,
//       then drains with runOnce (its `--once` mode: every job, then return, completions
//       flushed) and prints what it did.
//
// The database is given by the PG* environment variables (PGHOST, PGPORT, PGUSER,
// PGDATABASE, PGPASSWORD). Every line printed on stdout is one JSON object; warnings
// and errors of the worker's logger go to stderr.
"use strict";

const { EventEmitter } = require("events");
const readline = require("readline");
const { Pool } = require("pg");
const { Logger, makeWorkerUtils, runOnce } = require("graphile-worker");

const TASK = "noop";
const CHUNK = 5000;

// Warnings and errors reach stderr (the section logs them): a setting the worker ignores
// or doubts is said there. Debug and info are dropped.
const logger = new Logger((scope) => (level, message) => {
  if (level === "warning" || level === "error") {
    process.stderr.write(`graphile-worker ${level}: ${message}\n`);
  }
});

function say(object) {
  process.stdout.write(JSON.stringify(object) + "\n");
}

function count(text, what) {
  const n = Number.parseInt(text, 10);
  if (!Number.isInteger(n) || n < 1) {
    throw new Error(`${what} must be a positive integer, got ${JSON.stringify(text)}`);
  }
  return n;
}

// A connection that fails says so and ends the process, rather than crashing it
// unexplained (Graphile Worker asks a pool given to it for both handlers).
function makePool(max) {
  const pool = new Pool({ max });
  const fail = (error) => {
    process.stderr.write(`connection error: ${error}\n`);
    process.exit(1);
  };
  pool.on("error", fail);
  pool.on("connect", (client) => client.on("error", fail));
  return pool;
}

async function seed(jobs) {
  const pool = makePool(1);
  try {
    const utils = await makeWorkerUtils({ pgPool: pool, logger });
    await utils.migrate();
    const started = process.hrtime.bigint();
    for (let first = 0; first < jobs; first += CHUNK) {
      const specs = [];
      for (let i = first; i < Math.min(jobs, first + CHUNK); i++) {
        specs.push({ identifier: TASK, payload: { n: i } });
      }
      await utils.addJobs(specs);
    }
    const seconds = Number(process.hrtime.bigint() - started) / 1e9;
    await utils.release();
    say({ seeded: jobs, seconds });
  } finally {
    await pool.end();
  }
}

// SETTINGS_JSON: {"concurrency": int, "pool": int, "local_queue": int (-1: off),
// "refetch_delay_ms": int or null, "complete_batch_delay": int (-1: off),
// "fail_batch_delay": int (-1: off), "prepared_statements": bool}. "pool" sizes the pg
// pool given to the worker; every other one is a preset.worker option. (Given at the top
// level of run()'s options, as RunnerOptions, localQueue and the batch delays are not
// options at all: the worker drops them with a console warning.)
function preset(settings) {
  const worker = {
    concurrentJobs: settings.concurrency,
    preparedStatements: settings.prepared_statements,
    completeJobBatchDelay: settings.complete_batch_delay,
    failJobBatchDelay: settings.fail_batch_delay,
    // The jobs are all due when the drain starts; a poll never comes into it.
    pollInterval: 1000,
  };
  if (settings.local_queue > 0) {
    worker.localQueue = { size: settings.local_queue };
    if (settings.refetch_delay_ms != null) {
      worker.localQueue.refetchDelay = { durationMs: settings.refetch_delay_ms };
    }
  }
  return { worker };
}

async function drain(jobs, settings) {
  const pool = makePool(settings.pool);
  // Open every connection of the pool before the clock, as the section's other peers
  // connect before it.
  const clients = await Promise.all(Array.from({ length: settings.pool }, () => pool.connect()));
  for (const client of clients) client.release();

  const events = new EventEmitter();
  const fetches = [];
  events.on("localQueue:getJobs:complete", ({ jobs: fetched }) => fetches.push(fetched.length));
  let performed = 0;
  const distinct = new Set();
  const taskList = { [TASK]: async (payload, helpers) => {
    performed++;
    distinct.add(helpers.job.id);
  } };
  const options = { pgPool: pool, taskList, logger, events, noHandleSignals: true,
                    preset: preset(settings) };

  say({ ready: true });
  const lines = readline.createInterface({ input: process.stdin });
  await new Promise((resolve) => lines.once("line", resolve));
  lines.close();

  const cpu = process.cpuUsage();
  const started = process.hrtime.bigint();
  await runOnce(options);
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  const used = process.cpuUsage(cpu);
  say({ done: true, jobs, performed, distinct: distinct.size, seconds,
        cpu_seconds: (used.user + used.system) / 1e6, fetches: fetches.length,
        largest_fetch: Math.max(0, ...fetches) });
  await pool.end();
}

async function main() {
  const [mode, jobsText, settingsText] = process.argv.slice(2);
  const jobs = count(jobsText, "N");
  if (mode === "seed") {
    await seed(jobs);
  } else if (mode === "drain") {
    await drain(jobs, JSON.parse(settingsText));
  } else {
    throw new Error(`mode must be seed or drain, got ${JSON.stringify(mode)}`);
  }
}

main().catch((error) => {
  process.stderr.write(`${error && error.stack ? error.stack : error}\n`);
  process.exit(1);
});
