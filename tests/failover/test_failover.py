"""The primary dies (kill -9) and its standby is promoted, while orders flow and a
dispatcher with a multi-host DSN (``target_session_attrs=read-write``) runs: it resumes
by itself, every order the new primary holds gets its effect, and no job is left stuck."""

from __future__ import annotations

import threading
import time

import psycopg

import outbox
from outbox import Dispatcher

from .support import Orders, Pair, pair, prepare, wait_until

RESUME_WITHIN = 30.0  # seconds from the promotion to the first effect on the new primary


class Shop:
    """Orders placed one by one through the multi-host DSN, as an application does:
    a failed order is given up (its outcome, if the commit was cut off, unknown) and
    the next one tried on a new connection."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.acknowledged: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.count = 0

    def run(self) -> None:
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        while not self.stop.is_set():
            key = f"order-{self.count}"
            self.count += 1
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=2)
                with conn.transaction(), outbox.transaction(conn) as tx:
                    conn.execute("INSERT INTO orders (key) VALUES (%s)", (key,))
                    tx.enqueue("order.charge", key=key, payload={})
                self.acknowledged.append(key)
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                self.stop.wait(0.05)
            else:
                self.stop.wait(0.002)
        if conn is not None:
            conn.close()


def _on(servers: Pair, query: str) -> list[tuple[object, ...]]:
    return servers.standby.execute(query)


def test_kill_the_primary_promote_the_standby_the_dispatcher_resumes() -> None:
    with pair() as servers:
        prepare(servers.primary)
        orders = Orders()
        dispatcher = Dispatcher(servers.dsn, effects=[orders.effect()], lease=2.0,
                                poll_interval=0.2)
        runner = threading.Thread(target=dispatcher.run)
        shop = Shop(servers.dsn)
        runner.start()
        shop.thread.start()
        try:
            wait_until(lambda: len(orders.seen()) >= 200, 60, "effects before the failover")
            servers.primary.kill9()
            servers.standby.promote()
            promoted = time.monotonic()
            before = set(shop.acknowledged)
            wait_until(lambda: bool(set(shop.acknowledged) - before), 30,
                       "an order placed on the new primary")
            first_new = sorted(set(shop.acknowledged) - before)[0]
            resumed = wait_until(lambda: first_new in orders.seen(), RESUME_WITHIN,
                                 "the first effect of an order on the new primary")
            assert time.monotonic() - promoted < RESUME_WITHIN, resumed
            wait_until(lambda: len(shop.acknowledged) >= len(before) + 100, 30,
                       "orders after the failover")
        finally:
            shop.stop.set()
            shop.thread.join(30)
        try:
            def settled() -> bool:
                return not _on(servers, "SELECT 1 FROM outbox.jobs WHERE status <> 'done'"
                                        " LIMIT 1")

            wait_until(settled, 60, "every job on the new primary done")
        finally:
            dispatcher.stop()
            runner.join(30)
        assert not runner.is_alive()
        kept = {str(key) for (key,) in _on(servers, "SELECT key FROM orders")}
        jobs = {str(key) for (key,) in _on(servers, "SELECT key FROM outbox.jobs")}
        assert kept == jobs  # an order and its job commit together, or neither
        # No effect lost for an order the new primary holds (each is in the ledger too).
        assert kept <= orders.seen()
        ledger = {str(key) for (key,) in _on(servers, "SELECT key FROM outbox.effect_results")}
        assert ledger == kept
        # Every order acknowledged after the promotion is there and was performed.
        after = set(shop.acknowledged) - before
        assert after <= kept
        assert len(kept) >= 300
