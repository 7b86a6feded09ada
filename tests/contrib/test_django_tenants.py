"""outbox.contrib.django under django-tenants: an outbox in each tenant's schema.

A minimal django-tenants project (a tenant model and its domains in the public schema,
an order model in each tenant's; ``"outbox.contrib.django"`` in ``SHARED_APPS`` and
``TENANT_APPS``, ``OUTBOX_SCHEMA_PER_TENANT = True``), run in child processes against a
database of its own on the test PostgreSQL: django-tenants creates the tenants (and
``migrate_schemas`` their outbox tables), the orders and their jobs are written in each
tenant's context, and ``Dispatcher(effects=..., targets=tenant_targets)`` performs them
all, a tenant created while it runs included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..integration.helpers import fetch, table

_SETTINGS = '''
import os

SECRET_KEY = "not-a-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ALLOWED_HOSTS = [".test"]
ROOT_URLCONF = "shop.urls"
MIDDLEWARE = ["django_tenants.middleware.main.TenantMainMiddleware"]
DATABASES = {"default": {
    "ENGINE": "django_tenants.postgresql_backend", "NAME": os.environ["PROJECT_DB"],
    "USER": os.environ["PROJECT_DB_USER"], "PASSWORD": os.environ["PROJECT_DB_PASSWORD"],
    "HOST": os.environ["PROJECT_DB_HOST"], "PORT": os.environ["PROJECT_DB_PORT"]}}
DATABASE_ROUTERS = ["django_tenants.routers.TenantSyncRouter"]

SHARED_APPS = ["django_tenants", "customers", "django.contrib.contenttypes",
               "outbox.contrib.django"]
TENANT_APPS = ["django.contrib.contenttypes", "outbox.contrib.django", "shop"]
INSTALLED_APPS = SHARED_APPS + [app for app in TENANT_APPS if app not in SHARED_APPS]
TENANT_MODEL = "customers.Client"
TENANT_DOMAIN_MODEL = "customers.Domain"

OUTBOX_SCHEMA_PER_TENANT = True
'''

_CUSTOMERS_MODELS = '''
from django.db import models
from django_tenants.models import DomainMixin, TenantMixin


class Client(TenantMixin):
    name = models.CharField(max_length=100)


class Domain(DomainMixin):
    pass
'''

_SHOP_MODELS = '''
from django.db import models


class Order(models.Model):
    id = models.IntegerField(primary_key=True)
'''

_SHOP_URLS = '''
from django.db import connection
from django.http import JsonResponse
from django.urls import path

from outbox.contrib.django import transaction as outbox_atomic

from .models import Order


def place(request, order_id):
    """The order and its email, in the schema of the tenant the request's host names."""
    with outbox_atomic() as tx:
        Order.objects.create(id=order_id)
        tx.enqueue("email.send", key=f"{connection.schema_name}-order-{order_id}",
                   payload={"order": order_id})
    return JsonResponse({"schema": tx.schema})


urlpatterns = [path("orders/<int:order_id>", place)]
'''

# The child: tenants, orders and jobs in each tenant's context, then the dispatchers.
_SCENARIO = '''
import json
import os
import sys
import threading
import time
from collections import Counter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenantsite.settings")
import django

django.setup()

from django.core.management import call_command
from django.db import connection
from django.test import Client as Browser
from django_tenants.utils import tenant_context

import outbox
from customers.models import Client, Domain
from outbox.contrib.django import default_schema, flush, tenant_targets
from outbox.contrib.django import transaction as outbox_atomic
from shop.models import Order


class Record(outbox.Effect):
    name = "email.send"

    def __init__(self):
        self.lock = threading.Lock()
        self.performed = Counter()

    def perform(self, job):
        with self.lock:
            self.performed[job.key] += 1


def place(order_id, order=True):
    with outbox_atomic() as tx:
        if order:  # the orders live in the tenants' schemas only
            Order.objects.create(id=order_id)
        tx.enqueue("email.send", key=f"{connection.schema_name}-order-{order_id}",
                   payload={"order": order_id})
    return tx.schema


def new_tenant(schema):
    tenant = Client(schema_name=schema, name=schema.title())
    tenant.save(verbosity=0)  # creates the schema and runs migrate_schemas for it
    Domain.objects.create(domain=f"{schema}.test", tenant=tenant, is_primary=True)
    return tenant


def wait_for(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main():
    if sys.argv[1:2] == ["flush"]:  # flush SCHEMA: what TransactionTestCase runs there
        with tenant_context(Client.objects.get(schema_name=sys.argv[2])):
            flush()
        return
    call_command("migrate_schemas", shared=True, interactive=False, verbosity=0)
    found = {"public": default_schema()}
    alpha, beta = new_tenant("alpha"), new_tenant("beta")
    # alpha through a request (the tenant middleware sets the connection to its schema),
    answer = Browser().post("/orders/1", HTTP_HOST="alpha.test")
    assert answer.status_code == 200, answer.content
    found["request"] = answer.json()["schema"]
    connection.set_schema_to_public()  # the middleware leaves the connection on alpha
    # beta in a tenant_context, the public schema outside any tenant.
    with tenant_context(beta):
        found["tenant_context"] = place(1)
        place(2)
    found["outside"] = place(1, order=False)
    reads = []

    def targets():
        listed = tenant_targets()
        reads.append([t.schema for t in listed])
        return listed

    effect = Record()
    first = outbox.Dispatcher(effects=[effect], targets=targets).run_until_idle(timeout=60)
    # A dispatcher running on: a tenant created after its first read, served at a later one.
    running = outbox.Dispatcher(effects=[effect], targets=targets, targets_interval=0.3,
                                poll_interval=0.2)
    runner = threading.Thread(target=running.run)
    runner.start()
    try:
        wait_for(lambda: len(reads) >= 2, "the running dispatcher's first read")
        gamma = new_tenant("gamma")
        connection.set_tenant(gamma)
        found["set_tenant"] = place(7)
        connection.set_schema_to_public()
        wait_for(lambda: "gamma-order-7" in effect.performed, "gamma's job")
    finally:
        running.stop()
        runner.join(60)
    print("RESULT " + json.dumps({
        "schemas": found, "reads": reads, "performed": effect.performed,
        "first_run_done": first.done}))


main()
'''


def _run(*args: str, cwd: Path, env: dict[str, str],
         expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == expect, (args, done.returncode, done.stdout[-3000:],
                                       done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory,
            dsn: str) -> Iterator[tuple[Path, dict[str, str], str]]:
    """The project's files, their migrations made, and a database of its own."""
    root = tmp_path_factory.mktemp("djangotenants")
    files = {"tenantsite/__init__.py": "", "tenantsite/settings.py": _SETTINGS,
             "customers/__init__.py": "", "customers/models.py": _CUSTOMERS_MODELS,
             "shop/__init__.py": "", "shop/models.py": _SHOP_MODELS,
             "shop/urls.py": _SHOP_URLS, "scenario.py": _SCENARIO}
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    name = f"tenants_{uuid.uuid4().hex[:10]}"
    params = conninfo_to_dict(dsn)
    env = {**os.environ, "PYTHONPATH": "", "DJANGO_SETTINGS_MODULE": "tenantsite.settings",
           "PROJECT_DB": name, "PROJECT_DB_USER": str(params.get("user", "")),
           "PROJECT_DB_PASSWORD": str(params.get("password", "")),
           "PROJECT_DB_HOST": str(params.get("host", "")),
           "PROJECT_DB_PORT": str(params.get("port", ""))}
    _run("-m", "django", "makemigrations", "customers", "shop", cwd=root, env=env)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield root, env, make_conninfo(dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                     .format(sql.Identifier(name)))


def _rows(conninfo: str, query: str, schema: str, name: str) -> list[tuple[Any, ...]]:
    """``query`` with ``{}`` the table ``schema.name``."""
    return fetch(conninfo, sql.SQL(query).format(table(schema, name)))


def test_each_tenant_has_its_outbox_and_one_dispatcher_serves_them_all(
    project: tuple[Path, dict[str, str], str],
) -> None:
    root, env, conninfo = project
    done = _run("scenario.py", cwd=root, env=env)
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))

    # Enqueued into the schema of the tenant the connection was set to.
    assert result["schemas"] == {"public": "public", "request": "alpha",
                                 "tenant_context": "beta", "outside": "public",
                                 "set_tenant": "gamma"}
    # The targets: the public schema (SHARED_APPS) and each tenant's (TENANT_APPS); the
    # tenant created while the dispatcher ran, from a later read on.
    reads = result["reads"]
    assert reads[0] == ["public", "alpha", "beta"]
    assert reads[-1] == ["public", "alpha", "beta", "gamma"]
    assert all(read in (reads[0], reads[-1]) for read in reads)
    # Every job performed once, the first four by run_until_idle.
    keys = {"public": ["public-order-1"], "alpha": ["alpha-order-1"],
            "beta": ["beta-order-1", "beta-order-2"], "gamma": ["gamma-order-7"]}
    assert result["performed"] == {key: 1 for found in keys.values() for key in found}
    assert result["first_run_done"] == 4
    # Each job's row, its ledger row and its order are in its own tenant's schema.
    for schema, expected in keys.items():
        ledger = _rows(conninfo, "SELECT key FROM {} ORDER BY key", schema, "effect_results")
        assert [key for key, in ledger] == expected, schema
        jobs = _rows(conninfo, "SELECT key, status FROM {} ORDER BY key", schema, "jobs")
        assert jobs == [(key, "done") for key in expected], schema
        if schema != "public":
            orders = _rows(conninfo, "SELECT count(*) FROM {}", schema, "shop_order")
            assert orders == [(len(expected),)], schema
        # Made by migrate_schemas, recorded by Django in that schema.
        recorded = _rows(conninfo, "SELECT name FROM {} WHERE app = 'outbox'", schema,
                         "django_migrations")
        assert recorded == [("0001_initial",)], schema

    # manage.py outbox status on every tenant's outbox: one line each.
    status = _run("-m", "django", "outbox", "status", "--targets",
                  "outbox.contrib.django:tenant_targets", cwd=root, env=env)
    lines = status.stdout.strip().splitlines()
    assert [line.partition(": ")[0].rpartition("#")[2] for line in lines] == list(keys), lines
    assert all(": up, done " in line for line in lines), lines
    password = env["PROJECT_DB_PASSWORD"]
    assert not password or password not in status.stdout + status.stderr

    # flush in a tenant's schema empties the outbox's tables, not the tenant's own.
    _run("scenario.py", "flush", "beta", cwd=root, env=env)
    for name, count in [("jobs", 0), ("effect_results", 0), ("shop_order", 2)]:
        assert _rows(conninfo, "SELECT count(*) FROM {}", "beta", name) == [(count,)], name
    assert _rows(conninfo, "SELECT count(*) FROM {}", "alpha", "jobs") == [(1,)]
