"""A fresh Django project, as ``django-admin startproject`` makes it, with
``"outbox.contrib.django"`` in ``INSTALLED_APPS`` and nothing else outbox-specific: its
``manage.py migrate``, ``manage.py test`` and ``manage.py outbox``, each run as a real
command in a child process against the test PostgreSQL (a database of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.migrate import latest_version

# The application's tests: what a newcomer writes first.
_APP_TESTS = '''
from django.test import TestCase, TransactionTestCase

from outbox import Dispatcher, Effect
from outbox.contrib.django import conninfo, jobs, transaction as outbox_atomic

from .models import Order


class Record(Effect):
    name = "email.send"

    def __init__(self):
        self.seen = []

    def perform(self, job):
        self.seen.append(job.key)


def place(order_id):
    with outbox_atomic() as tx:
        Order.objects.create(id=order_id)
        tx.enqueue("email.send", key=f"email-order-{order_id}", payload={
            "from": "shop@example.com", "to": "ada@example.com",
            "subject": f"Order {order_id}", "text": "Thank you!"})


class PlacingAnOrder(TestCase):
    def test_enqueues_its_email(self):
        place(1)
        self.assertEqual([(j["effect"], j["key"], j["status"]) for j in jobs()],
                         [("email.send", "email-order-1", "pending")])


class FirstCommittedOrder(TransactionTestCase):
    def test_sees_only_its_own_job(self):
        place(2)
        self.assertEqual([j["key"] for j in jobs()], ["email-order-2"])
        effect = Record()
        Dispatcher(conninfo(), [effect]).run_until_idle(timeout=30)
        self.assertEqual(effect.seen, ["email-order-2"])


class SecondCommittedOrder(TransactionTestCase):
    def test_sees_only_its_own_job(self):
        place(3)
        self.assertEqual([j["key"] for j in jobs()], ["email-order-3"])
        effect = Record()
        Dispatcher(conninfo(), [effect]).run_until_idle(timeout=30)
        self.assertEqual(effect.seen, ["email-order-3"])
'''

_APP_MODELS = '''
from django.db import models


class Order(models.Model):
    id = models.IntegerField(primary_key=True)
'''


def _run(*args: str, cwd: Path, env: dict[str, str],
         expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == expect, (args, done.returncode, done.stdout[-3000:],
                                       done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, dsn: str) -> Path:
    """``startproject shopsite`` + ``startapp shop``, the settings edited as a newcomer
    would: the database, and two lines of ``INSTALLED_APPS``."""
    root = tmp_path_factory.mktemp("djangoproject")
    env = _environment(dsn, str(conninfo_to_dict(dsn).get("dbname", "postgres")))
    _run("-m", "django", "startproject", "shopsite", str(root), cwd=root, env=env)
    _run("manage.py", "startapp", "shop", cwd=root, env=env)
    (root / "shop" / "tests.py").write_text(_APP_TESTS)
    (root / "shop" / "models.py").write_text(_APP_MODELS)
    settings = root / "shopsite" / "settings.py"
    text = settings.read_text() + '''
INSTALLED_APPS += ["outbox.contrib.django", "shop"]

import os
DATABASES = {"default": {
    "ENGINE": "django.db.backends.postgresql", "NAME": os.environ["PROJECT_DB"],
    "USER": os.environ["PROJECT_DB_USER"], "PASSWORD": os.environ["PROJECT_DB_PASSWORD"],
    "HOST": os.environ["PROJECT_DB_HOST"], "PORT": os.environ["PROJECT_DB_PORT"]}}
'''
    settings.write_text(text)
    _run("manage.py", "makemigrations", "shop", cwd=root, env=env)
    return root


def _environment(dsn: str, name: str) -> dict[str, str]:
    params = conninfo_to_dict(dsn)
    return {**os.environ, "PYTHONPATH": "", "PROJECT_DB": name,
            "PROJECT_DB_USER": str(params.get("user", "")),
            "PROJECT_DB_PASSWORD": str(params.get("password", "")),
            "PROJECT_DB_HOST": str(params.get("host", "")),
            "PROJECT_DB_PORT": str(params.get("port", ""))}


@pytest.fixture
def database(dsn: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A database of its own, and the environment that points the project at it."""
    name = f"project_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(dsn, dbname=name), _environment(dsn, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for db in (name, f"test_{name}"):
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(db)))


def _records(conninfo: str) -> tuple[list[int], list[str]]:
    with psycopg.connect(conninfo) as conn:
        versions = [r[0] for r in conn.execute(
            "SELECT version FROM outbox.schema_migrations ORDER BY version")]
        django = [r[0] for r in conn.execute(
            "SELECT name FROM django_migrations WHERE app = 'outbox' ORDER BY id")]
    return versions, django


def test_migrate_creates_the_tables_and_test_passes(
    project: Path, database: tuple[str, dict[str, str]]
) -> None:
    conninfo, env = database
    _run("manage.py", "migrate", cwd=project, env=env)
    assert _records(conninfo) == (list(range(1, latest_version() + 1)), ["0001_initial"])
    with psycopg.connect(conninfo) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.jobs").fetchone() == (0,)
    up_to_date = _run("manage.py", "outbox", "migrate", cwd=project, env=env)
    assert f"up to date at version {latest_version():04d}" in up_to_date.stdout

    tested = _run("manage.py", "test", "shop", "-v", "2", cwd=project, env=env)
    assert "Ran 3 tests" in tested.stderr, tested.stderr[-3000:]
    assert "\nOK\n" in tested.stderr, tested.stderr[-3000:]


def test_outbox_migrate_first_then_django_migrate_agree(
    project: Path, database: tuple[str, dict[str, str]]
) -> None:
    conninfo, env = database
    applied = _run("manage.py", "outbox", "migrate", cwd=project, env=env)
    assert "applied 0001" in applied.stdout
    _run("manage.py", "migrate", cwd=project, env=env)
    assert _records(conninfo) == (list(range(1, latest_version() + 1)), ["0001_initial"])


def test_manage_py_outbox_misuse_is_one_line(
    project: Path, database: tuple[str, dict[str, str]]
) -> None:
    _, env = database
    _run("manage.py", "migrate", cwd=project, env=env)
    listed = _run("manage.py", "outbox", "--help", cwd=project, env=env).stdout
    commands = listed[listed.index("Commands:"):]
    for name in ("migrate", "run", "status", "retry", "web"):
        assert f"  {name} " in commands
    assert "demo" not in commands and "chaos" not in commands
    # --database after the sub-command means the same as before it.
    after = _run("manage.py", "outbox", "status", "--json", "--database", "default",
                 cwd=project, env=env)
    assert '"pending": 0' in after.stdout
    for args, says in [
        (("status", "--database", "nope"), "no database 'nope' in DATABASES (known: default)"),
        (("--database=nope", "status"), "no database 'nope' in DATABASES"),
        (("retry", "999999"), "no job 999999 in schema 'outbox'"),
        (("nosuch",), "No such command 'nosuch'"),
        (("status", "--bogus"), "--bogus"),
        (("demo",), "No such command 'demo'"),
    ]:
        failed = _run("manage.py", "outbox", *args, cwd=project, env=env, expect=1)
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (args, failed.stderr)
        assert "Traceback" not in failed.stderr
