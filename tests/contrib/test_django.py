"""outbox.contrib.django on real PostgreSQL, Django configured in-process.

The suite runs on Django's psycopg 3 backend; ``test_the_suite_passes_on_psycopg2`` runs it
again in a child process whose Django backend was made to load psycopg2 instead (Django
picks the driver once, at import, preferring psycopg 3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import outbox
from outbox import Dispatcher, Effect, IdempotencyKeyConflict, Job, NewJob
from outbox.testing import jobs

from ..integration.helpers import fetch, table

DRIVER = os.environ.get("OUTBOX_DJANGO_DRIVER", "psycopg")


def _configure(dsn: str) -> None:
    import django
    from django.conf import settings

    if DRIVER == "psycopg2":
        # Django chooses its driver when its backend is first imported; hide psycopg 3
        # from that one import so this process runs Django on psycopg2.
        saved = sys.modules["psycopg"]
        sys.modules["psycopg"] = None  # type: ignore[assignment]
        try:
            import django.db.backends.postgresql.base
        finally:
            sys.modules["psycopg"] = saved
    params = conninfo_to_dict(dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.get("dbname", "postgres"), "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""), "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
    }
    settings.configure(
        DATABASES={
            "default": {**database, "ATOMIC_REQUESTS": True},
            # psycopg 3 only: parameters bound by the server instead of the client.
            "server_binding": {**database, "OPTIONS": {"server_side_binding": True}},
        },
        INSTALLED_APPS=["outbox.contrib.django", "tests.contrib.djangoshop"],
        ROOT_URLCONF="tests.contrib.djangoshop.urls",
        ALLOWED_HOSTS=["testserver"], SECRET_KEY="not-a-secret", USE_TZ=True, MIDDLEWARE=[],
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()


@pytest.fixture(scope="module")
def django_db(dsn: str) -> Iterator[None]:
    """Django configured on the test server, with the orders table."""
    from django.conf import settings

    if not settings.configured:
        _configure(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS djangoshop_order (id int PRIMARY KEY)")
    yield
    from django.db import connections

    connections.close_all()


@pytest.fixture
def project(django_db: None, dsn: str, schema: str) -> Iterator[str]:
    """The project's outbox schema set to this test's schema; no orders left behind."""
    from django.db import connections
    from django.test import override_settings

    fetch(dsn, "DELETE FROM djangoshop_order RETURNING id")
    with override_settings(OUTBOX_SCHEMA=schema):
        yield schema
    connections.close_all()


def _orders(dsn: str) -> list[int]:
    return [int(r[0]) for r in fetch(dsn, "SELECT id FROM djangoshop_order ORDER BY id")]


def _create_order(order_id: int) -> None:
    from tests.contrib.djangoshop.models import Order

    Order.objects.create(id=order_id)


def test_django_runs_on_the_driver_under_test(project: str) -> None:
    from django.db import connection

    assert connection.Database.__name__ == DRIVER  # type: ignore[attr-defined]


def test_outermost_block_commits_its_jobs_with_the_orm_writes(dsn: str, project: str) -> None:
    from outbox.contrib.django import transaction as outbox_atomic

    with outbox_atomic() as tx:
        _create_order(1)
        result = tx.enqueue("email.send", key="email-order-1", payload={"order": 1})
    assert result.created
    assert jobs(dsn, project)["email-order-1"]["id"] == result.job_id
    assert _orders(dsn) == [1]
    with pytest.raises(RuntimeError), outbox_atomic() as tx:
        _create_order(2)
        tx.enqueue("email.send", key="email-order-2", payload={"order": 2})
        raise RuntimeError("business rule failed")
    assert list(jobs(dsn, project)) == ["email-order-1"]
    assert _orders(dsn) == [1]


def test_a_second_database_alias_with_server_side_binding(dsn: str, project: str) -> None:
    from django.db import transaction as django_transaction

    from outbox.contrib.django import transaction as outbox_atomic

    using = "server_binding"
    with django_transaction.atomic(using=using):
        with outbox_atomic(using=using) as tx:
            tx.enqueue("email.send", key="k1", payload={"n": 1}, run_at=None)
            assert tx.enqueue_many([NewJob("email.send", "k1", {"n": 1}),
                                    NewJob("email.send", "k2", {})])[1].created
            assert tx.receive("billing", "m1")
        with pytest.raises(RuntimeError), outbox_atomic(using=using) as tx:
            tx.enqueue("email.send", key="k3", payload={})
            raise RuntimeError("business rule failed")
    assert sorted(jobs(dsn, project)) == ["k1", "k2"]


def test_block_first_in_an_atomic_that_rolls_back_leaves_no_job(dsn: str, project: str) -> None:
    from django.db import transaction as django_transaction

    from outbox.contrib.django import transaction as outbox_atomic

    with pytest.raises(RuntimeError), django_transaction.atomic():
        with outbox_atomic() as tx:
            tx.enqueue("email.send", key="email-order-3", payload={})
        _create_order(3)
        assert jobs(dsn, project) == {}  # nothing committed by the block
        raise RuntimeError("the outer transaction fails")
    assert jobs(dsn, project) == {}
    assert _orders(dsn) == []


def test_a_nested_block_that_fails_rolls_back_only_its_jobs(dsn: str, project: str) -> None:
    from django.db import transaction as django_transaction

    from outbox.contrib.django import transaction as outbox_atomic

    with django_transaction.atomic():
        _create_order(4)
        with outbox_atomic() as tx:
            tx.enqueue("email.send", key="kept", payload={})
        with pytest.raises(RuntimeError), outbox_atomic() as tx:
            tx.enqueue("email.send", key="dropped", payload={})
            raise RuntimeError("business rule failed")
        with pytest.raises(IdempotencyKeyConflict), outbox_atomic() as tx:
            tx.enqueue("payment.charge", key="kept", payload={})
        _create_order(5)  # the connection is still usable
        with outbox_atomic() as tx:
            results = tx.enqueue_many([NewJob("email.send", "kept", {}),
                                       NewJob("email.send", "many", {})])
            assert [r.created for r in results] == [False, True]
    assert sorted(jobs(dsn, project)) == ["kept", "many"]
    assert _orders(dsn) == [4, 5]


def test_receive_through_django(dsn: str, project: str) -> None:
    from outbox.contrib.django import transaction as outbox_atomic

    with outbox_atomic() as tx:
        assert tx.receive("billing", "msg-1") is True
    with pytest.raises(RuntimeError), outbox_atomic() as tx:
        assert tx.receive("billing", "msg-2") is True
        raise RuntimeError("handling failed")
    with outbox_atomic() as tx:
        assert tx.receive("billing", "msg-1") is False
        assert tx.receive("billing", "msg-2") is True
    assert fetch(dsn, sql.SQL("SELECT message_id FROM {} ORDER BY 1")
                 .format(table(project, "inbox"))) == [("msg-1",), ("msg-2",)]


def test_an_atomic_requests_view_commits_or_rolls_back_with_the_request(
    dsn: str, project: str
) -> None:
    from django.test import Client

    client = Client(raise_request_exception=False)
    assert client.post("/orders/6").json() == {"order": 6}
    assert client.post("/orders/7?fail=1").status_code == 500
    assert list(jobs(dsn, project)) == ["email-order-6"]
    assert _orders(dsn) == [6]


def test_borrowing_the_driver_connection_is_the_trap_the_route_avoids(
    dsn: str, project: str
) -> None:
    """Why the route exists: under Django's outermost atomic() the driver connection is
    idle, so psycopg's own block begins and commits by itself."""
    from django.db import connection
    from django.db import transaction as django_transaction

    with pytest.raises(RuntimeError), django_transaction.atomic():
        with outbox.transaction(connection.connection, schema=project) as tx:
            tx.enqueue("email.send", key="trap", payload={})
        raise RuntimeError("the outer transaction fails")
    assert list(jobs(dsn, project)) == ["trap"]


class _Record(Effect):
    name = "email.send"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def perform(self, job: Job) -> None:
        with self.lock:
            self.seen.append(job.key)


def test_inside_a_testcase_transaction_jobs_are_visible_to_the_test_only(
    dsn: str, project: str
) -> None:
    """What Django's TestCase does: one atomic around the test, rolled back at its end."""
    from django.db import transaction as django_transaction

    from outbox.contrib.django import conninfo
    from outbox.contrib.django import jobs as enqueued
    from outbox.contrib.django import transaction as outbox_atomic

    effect = _Record()
    with django_transaction.atomic():
        with outbox_atomic() as tx:
            tx.enqueue("email.send", key="in-testcase", payload={"n": 1})
            tx.enqueue("email.send", key="for-acme", payload={}, group="acme", priority=3)
        assert [(j["key"], j["payload"], j["status"], j["group_key"], j["priority"])
                for j in enqueued()] == [("in-testcase", {"n": 1}, "pending", None, 0),
                                         ("for-acme", {}, "pending", "acme", 3)]
        stats = Dispatcher(conninfo(), [effect], schema=project).run_until_idle(timeout=30)
        assert (stats.done, effect.seen) == (0, [])
        django_transaction.set_rollback(True)
    # Committed work (TransactionTestCase) is what a dispatcher can drain.
    with outbox_atomic() as tx:
        tx.enqueue("email.send", key="committed", payload={})
    stats = Dispatcher(conninfo(), [effect], schema=project).run_until_idle(timeout=30)
    assert (stats.done, effect.seen) == (1, ["committed"])


def test_conninfo_is_what_django_connects_with(dsn: str, project: str) -> None:
    from outbox.contrib.django import conninfo

    info = conninfo_to_dict(conninfo())
    expected = conninfo_to_dict(dsn)
    assert info["host"] == expected["host"]
    assert info["dbname"] == expected.get("dbname", "postgres")
    assert not {"context", "cursor_factory", "prepare_threshold"} & set(info)
    with psycopg.connect(conninfo()) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_manage_py_outbox_runs_the_cli_on_databases(
    dsn: str, project: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import CommandError, call_command
    from django.test import override_settings

    from outbox.contrib.django import transaction as outbox_atomic

    before = os.environ.get("OUTBOX_DATABASE_URL")
    other = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with override_settings(OUTBOX_SCHEMA=other):
            call_command("outbox", "migrate")
            assert f"schema {other!r}: applied" in capsys.readouterr().out
            with outbox_atomic() as tx:
                tx.enqueue("email.send", key="k", payload={})
            call_command("outbox", "status", "--json")
            report = json.loads(capsys.readouterr().out)
            assert (report["schema"], report["jobs"]["pending"]) == (other, 1)
            with pytest.raises(CommandError) as failed:
                call_command("outbox", "retry", "999999")
            assert failed.value.returncode == 1
            assert str(failed.value) == f"no job 999999 in schema {other!r}"
            call_command("outbox", "--database", "default", "run", "--help")
            assert "MODULE:DISPATCHER" in capsys.readouterr().out
            call_command("outbox", "run", "--help", "--database", "server_binding")
            assert "MODULE:DISPATCHER" in capsys.readouterr().out
            # Plug-ins start servers of their own and ignore DATABASES: not offered here.
            with pytest.raises(CommandError, match="No such command 'demo'"):
                call_command("outbox", "demo", "--help")
    finally:
        _drop(dsn, other)
    assert os.environ.get("OUTBOX_DATABASE_URL") == before


def test_migrate_upgrades_the_schema_and_flush_empties_it(
    dsn: str, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``manage.py migrate`` applies the SQL files through Django (recorded by both),
    a later ``migrate`` applies the SQL files an upgraded outbox brings, and ``flush``
    empties the outbox tables but keeps the schema's version."""
    from django.core.management import call_command
    from django.test import override_settings

    from outbox.contrib.django import transaction as outbox_atomic

    migrate_module = sys.modules["outbox.migrate"]  # the package exports the function
    other = f"t_{uuid.uuid4().hex[:12]}"
    every = migrate_module.migrations()
    versions = sql.SQL("SELECT version FROM {} ORDER BY 1").format(
        table(other, "schema_migrations"))
    try:
        with override_settings(OUTBOX_SCHEMA=other):
            # An older outbox, which knew only the first SQL file.
            monkeypatch.setattr(migrate_module, "migrations", lambda: every[:1])
            call_command("migrate", "outbox", verbosity=0)
            assert fetch(dsn, versions) == [(1,)]
            assert fetch(dsn, "SELECT name FROM django_migrations WHERE app = 'outbox'") == [
                ("0001_initial",)]
            monkeypatch.setattr(migrate_module, "migrations", lambda: every)
            call_command("migrate", "outbox", verbosity=0)  # nothing new for Django
            assert fetch(dsn, versions) == [(m.version,) for m in every]

            with outbox_atomic() as tx:
                tx.enqueue("email.send", key="k", payload={})
                assert tx.receive("billing", "m1")
            call_command("flush", interactive=False, verbosity=0)
            for name in ("jobs", "inbox"):
                assert fetch(dsn, sql.SQL("SELECT count(*) FROM {}").format(
                    table(other, name))) == [(0,)]
            assert fetch(dsn, versions) == [(m.version,) for m in every]
    finally:
        _drop(dsn, other)
        fetch(dsn, "DELETE FROM django_migrations WHERE app = 'outbox' RETURNING id")


def test_enqueue_into_an_unmigrated_schema_says_to_migrate(dsn: str, project: str) -> None:
    from django.test import override_settings

    from outbox.contrib.django import transaction as outbox_atomic

    with override_settings(OUTBOX_SCHEMA="never_migrated"), \
            pytest.raises(outbox.SchemaError, match=r"schema 'never_migrated' has no outbox "
                                                    r"tables .*`manage.py migrate`"), \
            outbox_atomic() as tx:
        tx.enqueue("email.send", key="k", payload={})


def test_an_outbox_per_tenant_schema_needs_django_tenants(django_db: None) -> None:
    # The project runs on Django's own backend: a tenant's schema is nowhere to be read.
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from outbox.contrib.django import default_schema, tenant_targets
    from outbox.contrib.django import transaction as outbox_atomic

    assert default_schema() == "outbox"
    with override_settings(OUTBOX_SCHEMA_PER_TENANT=True):
        with pytest.raises(ImproperlyConfigured,
                           match=r"needs django-tenants' backend on DATABASES\['default'\]"):
            outbox_atomic()
        with override_settings(OUTBOX_SCHEMA="outbox"), \
                pytest.raises(ImproperlyConfigured, match="remove OUTBOX_SCHEMA"):
            default_schema()
    with pytest.raises(ImproperlyConfigured, match="set OUTBOX_SCHEMA_PER_TENANT = True"):
        tenant_targets()


def _drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# Not run again on psycopg2: this test itself, and the trap, which needs psycopg 3's
# connection for outbox.transaction().
_PSYCOPG3_ONLY = ("test_the_suite_passes_on_psycopg2",
                  "test_borrowing_the_driver_connection_is_the_trap_the_route_avoids")


def test_the_suite_passes_on_psycopg2(dsn: str) -> None:
    assert DRIVER == "psycopg", "the child run must not start another one"
    root = Path(__file__).parents[2]
    here = Path(__file__).relative_to(root).as_posix()
    env = {**os.environ, "OUTBOX_DJANGO_DRIVER": "psycopg2", "OUTBOX_TEST_DSN": dsn}
    deselect = [arg for name in _PSYCOPG3_ONLY for arg in ("--deselect", f"{here}::{name}")]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", here, "-q", "-p", "no:cacheprovider", *deselect],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert "13 passed, 2 deselected" in child.stdout, child.stdout[-3000:]
