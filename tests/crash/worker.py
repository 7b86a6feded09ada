"""A worker process for the crash tests: ``python -m tests.crash.worker MODE [options]``.

The DSN comes from ``$OUTBOX_DATABASE_URL``. Logs go to stderr; the one result line goes
to stdout as JSON, so the parent can read it while the process lives (hold modes) or after
it exits (dispatcher modes).

Modes:

``run``           ``Dispatcher.run()`` with the table effect, until SIGTERM; prints stats.
``idle``          ``Dispatcher.run_until_idle()``; prints stats.
``--hooks 1`` uses the table effect with an ``on_done`` hook (``flow_effect``).
``--flavour async`` runs the same modes on ``AsyncDispatcher`` (the table effect wrapped in
an ``async def perform``; SIGTERM calls ``stop()`` through the event loop's handler);
``--flavour async-threads`` gives ``AsyncDispatcher`` the sync table effect itself (its
performs on the dispatcher's threads).

``hold-claim``    opens a transaction, runs the shipped claim SQL for one job, prints
                  ``{"ids": [...], "backend_pid": n}`` and hangs, never committing.
``hold-enqueue``  opens a business transaction, writes an order and enqueues its job,
                  prints ``{"job_id": n, "backend_pid": n}`` and hangs, never committing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox.sql import queries

from .flow_effect import AsyncHookedTableEffect, HookedTableEffect
from .provider import EFFECT, TableEffect


def _emit(value: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def _hang() -> None:
    threading.Event().wait()  # until killed: the point of a hold mode


class AsyncTableEffect(outbox.Effect):
    """The table effect behind an ``async def perform`` (its blocking calls on a thread)."""

    name = EFFECT

    def __init__(self, inner: TableEffect) -> None:
        self.inner = inner
        inner.hangs = False  # a hang here is a coroutine that never returns, not a thread

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await asyncio.to_thread(self.inner.perform, job)
        if job.payload.get("hang") == job.attempt:
            await asyncio.to_thread(self.inner.checkpoint, job, "hang")
            await asyncio.Event().wait()  # never returns: the stop must not wait for it
        return result


def _options(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {} if args.prefetch is None else {"prefetch": args.prefetch}
    if args.stop_timeout is not None:
        extra["stop_timeout"] = args.stop_timeout
    if args.worker_id is not None:  # a name a restarted process reuses (a pod's)
        extra["worker_id"] = args.worker_id
    return dict(
        schema=args.schema, lease=args.lease, concurrency=args.concurrency,
        poll_interval=args.poll_interval, rescue_interval=args.rescue_interval,
        backoff=outbox.Backoff(base=args.backoff_base, cap=args.backoff_cap), **extra,
    )


async def _dispatch_async(dsn: str, args: argparse.Namespace,
                          effect: TableEffect) -> outbox.DispatchStats:
    wrapped: outbox.Effect = (
        effect if args.flavour == "async-threads"  # sync perform on the dispatcher's threads
        else AsyncHookedTableEffect(effect) if isinstance(effect, HookedTableEffect)
        else AsyncTableEffect(effect))
    dispatcher = outbox.AsyncDispatcher(dsn, [wrapped], **_options(args))
    if args.mode == "idle":
        return await dispatcher.run_until_idle(timeout=args.timeout)

    def on_sigterm() -> None:  # the application owns the signals, not the dispatcher
        logging.getLogger("crash.worker").info("SIGTERM: stopping after in-flight work")
        dispatcher.stop()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    return await dispatcher.run()


def _dispatch(dsn: str, args: argparse.Namespace) -> None:
    effect = (HookedTableEffect if args.hooks else TableEffect)(dsn, args.schema)
    try:
        if args.flavour in ("async", "async-threads"):
            stats = asyncio.run(_dispatch_async(dsn, args, effect))
        elif args.mode == "run":
            stats = outbox.Dispatcher(dsn, [effect], **_options(args)).run()
        else:
            stats = outbox.Dispatcher(dsn, [effect], **_options(args)).run_until_idle(
                timeout=args.timeout)
    finally:
        effect.close()
    logging.getLogger("crash.worker").info("stats %s", stats.as_dict())
    _emit(stats.as_dict())


def _hold_claim(dsn: str, args: argparse.Namespace) -> None:
    conn = psycopg.connect(dsn, application_name="crash hold-claim")
    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
    rows = conn.execute(queries(args.schema).claim, {
        "effects": [EFFECT], "limit": 1, "lease": args.lease, "worker": f"hold:{os.getpid()}",
        "after": "{}",
    }).fetchall()
    _emit({"ids": [r[0] for r in rows], "backend_pid": conn.info.backend_pid})
    _hang()


def _hold_enqueue(dsn: str, args: argparse.Namespace) -> None:
    conn = psycopg.connect(dsn, application_name="crash hold-enqueue")
    with outbox.transaction(conn, schema=args.schema) as tx:
        conn.execute(sql.SQL("INSERT INTO {}.orders (id) VALUES (%s)").format(
            sql.Identifier(args.schema)), (args.order,))
        result = tx.enqueue(EFFECT, key=f"email-order-{args.order}", payload={})
        _emit({"job_id": result.job_id, "backend_pid": conn.info.backend_pid})
        _hang()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.crash.worker")
    parser.add_argument("mode", choices=["run", "idle", "hold-claim", "hold-enqueue"])
    parser.add_argument("--schema", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--poll-interval", type=float, default=0.2)
    parser.add_argument("--rescue-interval", type=float, default=None)
    parser.add_argument("--backoff-base", type=float, default=0.05)
    parser.add_argument("--backoff-cap", type=float, default=0.2)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--stop-timeout", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--order", type=int, default=1)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--flavour", choices=["sync", "async", "async-threads"],
                        default="sync")
    parser.add_argument("--hooks", type=int, default=0)  # 1: the effect with on_done
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s {os.getpid()} %(threadName)s %(levelname)s %(name)s: %(message)s",
    )
    dsn = os.environ["OUTBOX_DATABASE_URL"]
    {"run": _dispatch, "idle": _dispatch, "hold-claim": _hold_claim,
     "hold-enqueue": _hold_enqueue}[args.mode](dsn, args)


if __name__ == "__main__":
    main()
