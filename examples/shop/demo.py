"""``make demo`` / ``outbox demo``: the shop end to end, with a worker killed mid-run.

1. Start an embedded PostgreSQL (or use ``--dsn``), the fake email and Stripe APIs, and
   the shop's web application (uvicorn, ``examples.shop.web``).
2. Start two dispatcher processes; place orders over HTTP from several threads meanwhile.
3. Inject provider faults (5xx bursts, 429 with Retry-After, success followed by a
   timeout or a dropped connection, declined cards, and a share of Stripe's charge
   answers lost after the charge was made); kill -9 one dispatcher in the middle and
   start another; freeze one past its lease, then let it go. Each charge is a flow:
   its on_done stores the PaymentIntent on the order and enqueues the receipt, its
   on_failed marks the order payment_failed and enqueues the declined email; a charge
   whose answer was lost goes to reconcile at once and the reconciler settles it from
   Stripe's records (or Stripe's webhook does, through the inbox).
4. Wait for every job to finish and for the fake Stripe's ``payment_intent.succeeded``
   webhooks to reach the shop (``POST /webhooks/stripe``), then send every event once
   more with its id, as Stripe redelivers. Check the invariants: every business effect
   performed exactly once at its provider, none lost, none left in reconcile, each
   order's chain complete (charged with a receipt naming its PaymentIntent, or
   payment_failed with the declined email), each charged order paid once by its own
   PaymentIntent, a redelivered event changing nothing. Exit 1 if any was violated.
5. With ``--serve``, keep the shop, fresh dispatchers and the fakes running to browse.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import select
from sqlalchemy.orm import Session

from effects.testing import FakeEmailProvider, FakeStripe
from examples.shop import app
from examples.shop.web import STRIPE_CONSUMER
from outbox.testing import audit, drop_schema, jobs, ledger, received, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
DECLINED_CARD = "pm_card_chargeDeclined"
LEASE = 2.0
LOST_ANSWERS = 0.1  # the share of Stripe's charge answers lost after the charge was made
JOBS_PER_ORDER = 3  # confirmation, charge, and the receipt or the declined email
WEBHOOK_SECRET = "whsec_demo_shop_endpoint"  # the fake Stripe's and the shop's, for the demo


@dataclass
class Workers:
    """The dispatcher processes of the demo (``outbox run``), and what happened to them."""

    env: dict[str, str]
    log_dir: Path
    running: list[subprocess.Popen[str]] = field(default_factory=list)
    stats: list[dict[str, int]] = field(default_factory=list)
    killed: int = 0
    frozen: int = 0
    freezing: bool = False

    def start(self) -> subprocess.Popen[str]:
        """One more dispatcher: the product's own command, ``outbox run``, which prints
        its counters as the last line of its stderr when it stops."""
        log = self._log(len(self.running) + self.killed).open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "--log-level", "ERROR", "run",
             "examples.shop.worker:dispatcher"], cwd=REPO_ROOT, env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, text=True,
        )
        log.close()
        self.running.append(proc)
        return proc

    def _log(self, n: int) -> Path:
        return self.log_dir / f"worker-{n}.log"

    def busiest(self, dsn: str) -> subprocess.Popen[str]:
        """The worker holding the most running jobs: the one whose death tests most."""
        held = Counter(int(job["claimed_by"].split(":")[1])  # worker ids are host:pid:tag
                       for job in jobs(dsn, app.OUTBOX_SCHEMA).values()
                       if job["status"] == "running")
        return max(self.running, key=lambda proc: held.get(proc.pid, 0))

    def kill_one(self, dsn: str, console: Console) -> None:
        victim = self.busiest(dsn)
        self.running.remove(victim)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        self.killed += 1
        replacement = self.start()
        console.print(f"  [red]kill -9[/] dispatcher {victim.pid} mid-run; "
                      f"dispatcher {replacement.pid} started")

    def freeze_one(self, dsn: str, seconds: float, console: Console) -> None:
        victim = self.busiest(dsn)
        victim.send_signal(signal.SIGSTOP)
        console.print(f"  [yellow]SIGSTOP[/] dispatcher {victim.pid} for {seconds:.1f} s "
                      f"(its lease is {LEASE:.0f} s)")
        time.sleep(seconds)  # the point is to outlive the lease: a real stall
        victim.send_signal(signal.SIGCONT)
        console.print(f"  [yellow]SIGCONT[/] dispatcher {victim.pid}: its late writes are fenced")
        self.frozen += 1

    def stop_all(self) -> None:
        for proc in self.running:
            proc.send_signal(signal.SIGTERM)
        for proc in self.running:
            proc.wait(timeout=60)
        for n in range(len(self.running) + self.killed):
            lines = [ln for ln in self._log(n).read_text().splitlines() if ln.startswith("{")]
            if lines:  # a killed worker printed none
                self.stats.append(json.loads(lines[-1]))

    def total(self, counter: str) -> int:
        return sum(s.get(counter, 0) for s in self.stats)


def _database(dsn: str | None) -> str:
    if dsn:
        return dsn
    server = start_server()  # in a temporary directory, removed by stop()
    atexit.register(server.stop)
    return server.dsn


def _reset(dsn: str) -> None:
    """The shop's tables and the outbox schema, dropped and made again."""
    engine = app.engine_for(dsn)
    try:
        app.Base.metadata.drop_all(engine)
    finally:
        engine.dispose()
    drop_schema(dsn, app.OUTBOX_SCHEMA)
    app.setup(dsn)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_web(
    env: dict[str, str], log: Path, port: int = 0, log_level: str = "warning"
) -> tuple[subprocess.Popen[str], str]:
    """Start the shop's web application under uvicorn; return it and its base URL."""
    port = port or _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "examples.shop.web:create_app",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", log_level],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # the server is up once it answers
        try:
            httpx.get(f"{url}/openapi.json", timeout=1).raise_for_status()
            return proc, url
        except httpx.TransportError:
            if proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            problem = "did not start"
        except httpx.HTTPStatusError as exc:
            problem = f"answered {exc.response.status_code}"
        proc.kill()
        proc.wait()
        raise click.ClickException(
            f"the shop's web server {problem}: {log.read_text()[-500:]}")


@dataclass
class Orders:
    """The orders placed over HTTP so far, and the first failure, if any."""

    placed: list[int] = field(default_factory=list)
    failure: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _place_orders(url: str, count: int, threads: int, rng: random.Random,
                  orders: Orders) -> None:
    """Place ``count`` orders over HTTP from ``threads`` threads, each with its client."""
    plans = [(f"c{n}", DECLINED_CARD if n % 25 == 7 else "pm_card_visa",
              rng.randrange(500, 20000)) for n in range(count)]

    def place(share: list[tuple[str, str, int]]) -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                for customer, card, amount in share:
                    reply = client.post("/orders", json={
                        "customer": customer, "email": f"{customer}@customers.example",
                        "amount": amount, "payment_method": card})
                    reply.raise_for_status()
                    with orders.lock:
                        orders.placed.append(int(reply.json()["id"]))
        except httpx.HTTPError as exc:
            with orders.lock:
                orders.failure = orders.failure or f"placing an order failed: {exc}"

    pool = [threading.Thread(target=place, args=(plans[i::threads],)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def _inject_faults(email: FakeEmailProvider, stripe: FakeStripe, seed: int) -> dict[str, int]:
    """Arm one burst of every fault kind at both fakes; return what was armed."""
    for fake in (email, stripe):
        fake.fail_next(4, 503)
        fake.fail_next(3, 429, retry_after=0.5)
        fake.succeed_then_timeout(2)
        fake.succeed_then_drop(2)
        fake.drop_connection(2)
    stripe.lose_responses(LOST_ANSWERS, seed=seed)
    return {"5xx": 8, "429 + Retry-After": 6, "success then timeout": 4,
            "success then dropped": 4, "dropped before": 4}


def _job_counts(dsn: str) -> Counter[str]:
    return Counter(job["status"] for job in jobs(dsn, app.OUTBOX_SCHEMA).values())


def _drive(dsn: str, url: str, orders: int, workers: Workers, console: Console,
           seed: int) -> None:
    """Place the orders and run the chaos while showing progress, until all finished."""
    total = JOBS_PER_ORDER * orders
    killed_at = int(total * 0.35)
    frozen_at = int(total * 0.6)
    placing = Orders()
    placer = threading.Thread(target=_place_orders, daemon=True,
                              args=(url, orders, 6, random.Random(seed), placing))
    placer.start()
    deadline = time.monotonic() + 120
    with Progress(TextColumn("[bold]{task.description:<13}"), BarColumn(bar_width=24),
                  MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        placed = progress.add_task("orders placed", total=orders, detail="POST /orders")
        task = progress.add_task("jobs finished", total=total, detail="")
        while time.monotonic() < deadline:
            if placing.failure:
                raise click.ClickException(placing.failure)
            progress.update(placed, completed=len(placing.placed))
            counts = _job_counts(dsn)
            finished = counts["done"] + counts["failed"]
            if workers.killed == 0 and finished >= killed_at:
                workers.kill_one(dsn, progress.console)
            if not workers.freezing and finished >= frozen_at:
                workers.freezing = True
                threading.Thread(target=workers.freeze_one, daemon=True,
                                 args=(dsn, LEASE + 1.5, progress.console)).start()
            progress.update(task, completed=finished, detail=(
                f"running {counts['running']:>3}  pending {counts['pending']:>3}  "
                f"reconcile {counts['reconcile']:>3}"))
            if not placer.is_alive() and finished == total and workers.frozen:
                return
            time.sleep(0.1)  # a progress display refresh, not a synchronisation
    raise click.ClickException("the demo did not finish within 120 s")


def _check(dsn: str, email: FakeEmailProvider, stripe: FakeStripe) -> tuple[list[str], Any]:
    """Every job against what its provider performed; return violations and figures."""
    found = jobs(dsn, app.OUTBOX_SCHEMA)
    recorded = ledger(dsn, app.OUTBOX_SCHEMA)
    rows = [(key, j["effect"], j["status"], j["attempts"], j["last_error"], key in recorded)
            for key, j in found.items()]
    orders = len(_orders(dsn))
    violations: list[str] = []
    fakes = {"email.send": email, "payment.charge": stripe}
    for key, effect, status, _attempts, error, in_ledger in rows:
        performed = fakes[effect].performed(key)
        if status == "done" and (performed != 1 or not in_ledger):
            violations.append(f"{key}: done, performed {performed}x, ledger row {in_ledger}")
        elif status in ("pending", "running", "reconcile"):
            violations.append(f"{key}: not settled, still {status}")
        elif status == "failed" and not (effect == "payment.charge" and "card_declined" in error):
            violations.append(f"{key}: failed unexpectedly: {error}")
        if performed > 1:
            violations.append(f"{key}: performed {performed} times at the provider")
    if len(rows) != JOBS_PER_ORDER * orders:
        violations.append(f"{orders} orders but {len(rows)} jobs")
    chains = _chains(dsn)
    violations += _chain_violations(chains)
    return violations, {"orders": orders, "jobs": rows, "chains": chains,
                        "reconciled": _reconciled(dsn)}


@dataclass
class Chain:
    """One order's flow: its status and PaymentIntent, and its jobs in order."""

    order: int
    status: str
    intent: str | None
    steps: list[tuple[str, str, str | None]]  # (key, status, parent key)


def _orders(dsn: str) -> list[app.Order]:
    """The shop's orders (its own model), by id."""
    engine = app.engine_for(dsn)
    try:
        with Session(engine, expire_on_commit=False) as session:
            return list(session.scalars(select(app.Order).order_by(app.Order.id)))
    finally:
        engine.dispose()


def _chains(dsn: str) -> list[Chain]:
    by_key = jobs(dsn, app.OUTBOX_SCHEMA)
    chains = []
    for order in _orders(dsn):
        keys = [k for k in app.effect_keys(order.id) if k in by_key]
        chains.append(Chain(order.id, order.status, order.payment_intent,
                            [(k, by_key[k]["status"], by_key[k]["parent_key"]) for k in keys]))
    return chains


def _chain_violations(chains: list[Chain]) -> list[str]:
    """Each order charged with its receipt naming the intent, or declined with its email."""
    violations = []
    for chain in chains:
        keys = {key: (status, parent) for key, status, parent in chain.steps}
        charge = f"payment-order-{chain.order}"
        follow = (f"email-receipt-{chain.order}" if chain.status == "charged"
                  else f"email-declined-{chain.order}")
        if chain.status not in ("charged", "payment_failed"):
            violations.append(f"order {chain.order}: still {chain.status}")
        elif keys.get(follow) != ("done", charge):
            violations.append(f"order {chain.order}: {chain.status} but {follow} is "
                              f"{keys.get(follow)}")
        elif chain.status == "charged" and not chain.intent:
            violations.append(f"order {chain.order}: charged with no PaymentIntent stored")
    return violations


def _reconciled(dsn: str) -> Counter[str]:
    """The reconciler's decisions (its own passes and Stripe's webhooks), by kind."""
    found: Counter[str] = Counter()
    for entry in audit(dsn, app.OUTBOX_SCHEMA, actor="reconciler"):
        if entry["affected"] == 1:
            source = str(entry["detail"].get("source") or "")
            via = "Stripe's webhook" if source.startswith("stripe event") else "asked the provider"
            found[f"{entry['detail'].get('decision')} ({via})"] += 1
    return found


@dataclass
class Payments:
    """What Stripe's webhook did to the orders, and what sending each event again did."""

    paid: int = 0
    deliveries: int = 0
    redelivered: int = 0
    changed_by_redelivery: int = 0
    violations: list[str] = field(default_factory=list)


def _paid_orders(dsn: str) -> dict[int, tuple[str | None, str | None, Any]]:
    return {order.id: (order.payment_intent, order.payment_event, order.paid_at)
            for order in _orders(dsn)}


def _await_webhooks(stripe: FakeStripe, timeout: float = 60.0) -> None:
    """Until every charge's event was answered 2xx by the shop (Stripe retries others)."""
    deadline = time.monotonic() + timeout
    while True:
        answered = {event for event, _, status in stripe.delivered_events
                    if 200 <= status < 300}
        if len(answered) >= len(stripe.charges):
            return
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"{len(answered)} of {len(stripe.charges)} payment webhooks answered "
                f"2xx by the shop within {timeout:.0f} s")
        time.sleep(0.05)  # the fake's sender is a thread of its own: poll its record


def _check_payments(dsn: str, stripe: FakeStripe) -> Payments:
    """Each charged order paid by its PaymentIntent; every event sent again, as Stripe
    redelivers, answered 2xx and changing nothing."""
    result = Payments(deliveries=len(stripe.delivered_events))
    charged = {intent["metadata"].get("order_id"): intent for intent in stripe.charges}
    before = _paid_orders(dsn)
    for order, (intent_id, event_id, paid_at) in sorted(before.items()):
        intent = charged.get(str(order))
        expected = intent["id"] if intent else None
        if intent_id != expected or (paid_at is None) != (expected is None):
            result.violations.append(f"order {order}: charged by {expected}, "
                                     f"marked paid by {intent_id} at {paid_at}")
        if intent is None or event_id is None:
            continue
        result.paid += 1
        again = stripe.send_event("payment_intent.succeeded", intent, event_id=event_id)
        result.redelivered += 1
        if again.status_code != 200 or again.json().get("new") is not False:
            result.violations.append(f"order {order}: event {event_id} sent again was "
                                     f"answered {again.status_code} {again.text[:200]}")
    after = _paid_orders(dsn)
    result.changed_by_redelivery = sum(after[order] != before[order] for order in before)
    if result.changed_by_redelivery:
        result.violations.append(f"{result.changed_by_redelivery} orders changed when "
                                 f"their Stripe event was delivered again")
    recorded = len(received(dsn, STRIPE_CONSUMER, app.OUTBOX_SCHEMA))
    if recorded != len(stripe.charges):
        result.violations.append(f"{recorded} Stripe events in the inbox for "
                                 f"{len(stripe.charges)} charges")
    return result


def _summary(console: Console, figures: dict[str, Any], workers: Workers,
             email: FakeEmailProvider, stripe: FakeStripe, faults: dict[str, int],
             payments: Payments, elapsed: float) -> None:
    jobs = figures["jobs"]
    status = Counter((effect, s) for _, effect, s, *_ in jobs)
    table = Table(title="outbox demo: the shop", show_lines=False)
    table.add_column("what")
    table.add_column("figure", justify="right")
    rows = [
        ("orders placed", figures["orders"]),
        ("emails sent (once per key at the fake)", email.total_performed),
        ("email requests received (retries replayed)", email.total_requests),
        ("cards charged (once per key at the fake)", len(stripe.charges)),
        ("cards declined (once per key; the job fails, no money taken)",
         len(stripe.payment_intents) - len(stripe.charges)),
        ("charge requests received (retries replayed)", stripe.total_requests),
        ("orders paid by Stripe's webhook (once each)", payments.paid),
        ("webhook deliveries to the shop (Stripe's retries included)", payments.deliveries),
        ("Stripe events delivered again on purpose, same event id", payments.redelivered),
        ("orders those repeated events changed (0: each event handled once)",
         payments.changed_by_redelivery),
        ("jobs done", sum(n for (_, s), n in status.items() if s == "done")),
        ("jobs failed (declined cards)", sum(n for (_, s), n in status.items() if s == "failed")),
        ("jobs in reconcile", sum(n for (_, s), n in status.items() if s == "reconcile")),
        ("charge answers lost by the fake Stripe (charge made, answer dropped)",
         len(stripe.lost_responses)),
        *((f"settled by the reconciler: {what}", n)
          for what, n in sorted(figures["reconciled"].items())),
        ("receipts sent by the charge's on_done",
         sum(1 for c in figures["chains"] if c.status == "charged")),
        ("declined emails sent by the charge's on_failed",
         sum(1 for c in figures["chains"] if c.status == "payment_failed")),
        ("retries", workers.total("retried")),
        ("dispatchers killed with kill -9", workers.killed),
        ("dispatchers frozen (SIGSTOP) past their lease", workers.frozen),
        ("lease rescues (jobs of a killed or frozen dispatcher, taken back once its "
         "lease expired and performed again with the same key)", workers.total("rescued")),
        ("late results refused (the job had been taken back; fenced, not recorded twice)",
         workers.total("stale_completions")),
        ("claims a dispatcher found taken back by another (its heartbeat noticed)",
         workers.total("lost_claims")),
        ("provider faults injected (5xx, 429, timeouts, dropped connections)",
         sum(faults.values())),
        ("seconds the demo took", f"{elapsed:.1f}"),
    ]
    for what, figure in rows:
        table.add_row(what, str(figure))
    console.print(table)
    reasons = Counter(re.sub(r"\b(pi|ch|re)_\w+", r"\1_...", str(error).replace(key, "<key>"))
                      for key, _, s, _, error, _ in jobs if s == "failed")
    for reason, n in reasons.most_common():
        console.print(f"  failed x{n}: {reason}")
    _show_chains(console, figures["chains"], {k for k in stripe.lost_responses if k})


def _show_chains(console: Console, chains: list[Chain], lost: set[str]) -> None:
    """A few orders' flows: a plain one, a declined one, and ones whose answer was lost."""
    plain = [c for c in chains if c.status == "charged"
             and f"payment-order-{c.order}" not in lost][:2]
    declined = [c for c in chains if c.status == "payment_failed"][:1]
    settled = [c for c in chains if f"payment-order-{c.order}" in lost][:3]
    table = Table(title="each order's chain (a few of them)")
    table.add_column("order", justify="right")
    table.add_column("flow")
    table.add_column("order status")
    shown = {chain.order: chain for chain in [*plain, *declined, *settled]}  # each once
    for chain in shown.values():
        steps = "  ->  ".join(
            f"{key} {status}" + (" (answer lost; reconciled)" if key in lost else "")
            for key, status, _ in chain.steps if not key.startswith("email-order-"))
        table.add_row(str(chain.order), steps,
                      chain.status + (f" {chain.intent}" if chain.intent else ""))
    console.print(table)


def _browse_hint(console: Console, url: str, serving: bool) -> None:
    if not serving:
        console.print("To browse the shop, keep it running: [bold]make demo ARGS=--serve[/]"
                      " (or outbox demo --serve)")
        return
    console.print(f"[bold]The shop is running[/] at {url} with two dispatchers (Ctrl-C "
                  "stops it). Place an order, see it, try the API in a browser:")
    # One command per line, unwrapped and unstyled, so that each pastes as it is.
    for line in (f"curl -s -X POST {url}/orders -H 'content-type: application/json' -d "
                 """'{"customer": "ada", "email": "ada@example.com", "amount": 1250}'""",
                 f"curl -s {url}/orders/1", f"{url}/docs"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _serve(console: Console, url: str, workers: Workers) -> None:
    """Keep the shop and fresh dispatchers running until Ctrl-C or SIGTERM."""
    workers.running.clear()
    workers.start()
    workers.start()
    _browse_hint(console, url, serving=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        workers.stop_all()


def run_demo(dsn: str | None, orders: int, seed: int | None, serve: bool = False,
             port: int = 0) -> int:
    """Run the demo; return the exit status (0 when nothing was lost or doubled)."""
    console = Console()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per order is noise
    seed = seed if seed is not None else random.randrange(1 << 30)
    started = time.monotonic()
    console.print(f"[bold]outbox demo[/]: {orders} orders over HTTP, seed {seed}")
    database = _database(dsn)
    _reset(database)
    log_dir = Path(tempfile.mkdtemp(prefix="outbox-demo-logs-"))
    with FakeEmailProvider(latency=0.02) as email, \
            FakeStripe(latency=0.02, webhook_secret=WEBHOOK_SECRET) as stripe:
        env = {**os.environ, "OUTBOX_DATABASE_URL": database, "SHOP_EMAIL_URL": email.url,
               "SHOP_STRIPE_URL": stripe.url, "STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET,
               "SHOP_CONCURRENCY": "4",
               "SHOP_LEASE": str(LEASE), "SHOP_BACKOFF_BASE": "0.2", "SHOP_BACKOFF_CAP": "1",
               "SHOP_PROVIDER_TIMEOUT": "1.5",
               # A lost charge answer goes to reconcile at once; the reconciler asks
               # Stripe every half second.
               "SHOP_CHARGE_UNKNOWN_WINDOW": "0", "SHOP_RECONCILE_INTERVAL": "0.5",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        for key in ("RESEND_API_KEY", "STRIPE_API_KEY"):  # the demo always uses the fakes
            env.pop(key, None)
        web, url = start_web(env, log_dir / "web.log", port)
        stripe.webhook_url = f"{url}/webhooks/stripe"  # each charge is announced to the shop
        try:
            workers = Workers(env, log_dir)
            faults = _inject_faults(email, stripe, seed)
            workers.start()
            workers.start()
            try:
                _drive(database, url, orders, workers, console, seed)
            finally:
                workers.stop_all()
                email.release_stalled()
                stripe.release_stalled()
            violations, figures = _check(database, email, stripe)
            _await_webhooks(stripe)
            payments = _check_payments(database, stripe)
            violations += payments.violations
            _summary(console, figures, workers, email, stripe, faults, payments,
                     time.monotonic() - started)
            if violations:
                console.print(f"[bold red]{len(violations)} violation(s)[/]:")
                for line in violations[:20]:
                    console.print(f"  {line}")
                console.print(f"worker logs: {log_dir}")
                return 1
            console.print("[bold green]every business effect performed exactly once, none lost, "
                          "none left in reconcile; each order's chain complete; each charged "
                          "order paid once[/]")
            if serve:
                _serve(console, url, workers)
            else:
                _browse_hint(console, url, serving=False)
        finally:
            web.send_signal(signal.SIGTERM)
            web.wait(timeout=30)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


@click.command("demo")
@click.option("--dsn", envvar="OUTBOX_DEMO_DSN", default=None,
              help="Use this PostgreSQL instead of an embedded one (tables are replaced).")
@click.option("--orders", default=300, show_default=True, help="Orders to place.")
@click.option("--seed", type=int, default=None, help="Seed for the order amounts.")
@click.option("--serve", is_flag=True,
              help="Afterwards, keep the shop and its dispatchers running to browse.")
@click.option("--port", default=0, help="Port of the shop's web server (default: any free).")
def command(dsn: str | None, orders: int, seed: int | None, serve: bool, port: int) -> None:
    """Run the example shop end to end, killing a worker mid-run, and check "once"."""
    sys.exit(run_demo(dsn, orders, seed, serve, port))


if __name__ == "__main__":
    command()
