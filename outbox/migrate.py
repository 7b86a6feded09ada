"""Applies the numbered SQL files of ``migrations/`` to a schema, once each, in order.

Safe to run from several processes at once: each transaction of a run holds a
transaction-level advisory lock derived from the schema name, so concurrent starts queue
up and find the work done. Migrations are forward-only; a database that records a version
this code does not know is refused rather than touched.

Online: a live system is migrated while business transactions enqueue and dispatchers
run. Each migration of an existing schema is a transaction of its own, so its locks are
held only while it runs; every lock is waited for at most ``lock_timeout``, so the run
never queues business transactions behind it for longer (a lock it cannot get in time
rolls that migration back and it tries again), and an index on a large table is built
``CONCURRENTLY`` after the run commits (the part of a file after the ``-- outbox: built
concurrently, after commit`` line), so no write waits for the build.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import scalar_row

from ._pg import configuration_error
from ._sql import bind_schema, check_schema_name
from .errors import SchemaError

__all__ = ["Index", "Migration", "build_indexes", "current_version", "latest_version", "migrate",
           "migrations"]

log = logging.getLogger("outbox.migrate")

_FILE_NAME = re.compile(r"^(\d{4})_(\w+)\.sql$")
_LOCK_NAMESPACE = "outbox.migrate:"
_INDEX_LOCK_NAMESPACE = "outbox.migrate.indexes:"
# What follows this line in a migration file is built after the run commits, each index
# CONCURRENTLY (outside any transaction), when migrate() owns the transaction.
AFTER_COMMIT = "-- outbox: built concurrently, after commit"
_INDEX = re.compile(r"^CREATE (?:UNIQUE )?INDEX IF NOT EXISTS (\w+) ON ", re.IGNORECASE)
# An index a migration drops (in its run): a later migration may drop an after-commit
# index of an earlier one, which the runner must then no longer build.
_DROPPED_INDEX = re.compile(r"^DROP INDEX (?:CONCURRENTLY )?IF EXISTS \{schema\}\.(\w+)",
                            re.IGNORECASE | re.MULTILINE)
LOCK_TIMEOUT = 1.0
LOCK_ATTEMPTS = 60
_RETRY_PAUSE = (0.2, 2.0)  # first and longest pause between attempts, seconds
_CLIENT_CHECK = "SELECT set_config('client_connection_check_interval', '1s', true)"


@dataclass(frozen=True)
class Index:
    """An index a migration builds after its run commits: its name and its statement
    (``CREATE [UNIQUE] INDEX IF NOT EXISTS name ON ...``, without CONCURRENTLY)."""

    name: str
    sql: str

    def concurrently(self) -> str:
        return re.sub(r"^CREATE (UNIQUE )?INDEX ", r"CREATE \1INDEX CONCURRENTLY ", self.sql,
                      count=1, flags=re.IGNORECASE)


@dataclass(frozen=True)
class Migration:
    """One forward-only migration file: the statements of its run, and the indexes built
    after the run commits."""

    version: int
    name: str
    sql: str
    indexes: tuple[Index, ...] = ()
    drops: tuple[str, ...] = ()  # the indexes its run drops (DROP INDEX IF EXISTS)


def _code(statement: str) -> str:
    """``statement`` without its comment lines and surrounding blanks (empty: nothing to
    run, which psycopg2 refuses to send)."""
    return "\n".join(line for line in statement.splitlines()
                     if not line.lstrip().startswith("--")).strip()


def _parse(version: int, name: str, text: str) -> Migration:
    body, marker, after = text.partition(AFTER_COMMIT)
    indexes = []
    for statement in (part.strip() for part in after.split(";")) if marker else ():
        code = _code(statement)
        if not code:
            continue
        match = _INDEX.match(code)
        if match is None:
            raise SchemaError(
                f"migration {version:04d}_{name}: only CREATE INDEX IF NOT EXISTS statements "
                f"may follow {AFTER_COMMIT!r}, found: {code.splitlines()[0]}")
        indexes.append(Index(match[1], code))
    drops = tuple(_DROPPED_INDEX.findall(_code(body)))
    return Migration(version, name, body, tuple(indexes), drops)


def _migrations_dir() -> Traversable:
    shipped = resources.files("outbox").joinpath("_migrations")
    if shipped.is_dir():
        return shipped
    # A source checkout (or an editable install): the files live at the repo's top level.
    return Path(__file__).resolve().parent.parent / "migrations"


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration this code knows, in version order, checked for gaps."""
    found = []
    for entry in _migrations_dir().iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(_parse(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise SchemaError(f"migration {expected:04d} is missing before {migration.name}")
    if not found:
        raise SchemaError("no migration files found: the package is incomplete")
    return tuple(found)


def latest_version() -> int:
    """The version the schema has once every known migration is applied."""
    return migrations()[-1].version


def _versions_table(schema: str) -> sql.Composed:
    return sql.SQL("{}.schema_migrations").format(sql.Identifier(schema))


def current_version(conn: psycopg.Connection[Any], schema: str = "outbox") -> int | None:
    """The schema's applied version, or None when outbox was never migrated there."""
    check_schema_name(schema)
    cursor = conn.cursor(row_factory=scalar_row)
    exists = cursor.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        (_versions_table(schema).as_string(conn),),
    ).fetchone()
    if not exists:
        return None
    applied = cursor.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(_versions_table(schema))
    ).fetchone()
    return int(applied) if applied is not None else 0


def require_current(conn: psycopg.Connection[Any], schema: str) -> None:
    """Raise SchemaError unless ``schema`` is migrated to exactly this code's version;
    ``ConfigurationError`` if the role may not read it."""
    try:
        version = current_version(conn, schema)
    except psycopg.Error as exc:
        fatal = configuration_error(exc, doing=f"read schema {schema!r}")
        if fatal is None:
            raise
        raise fatal from exc
    if version is None:
        raise SchemaError(
            f"schema {schema!r} has no outbox tables: run `outbox migrate` "
            "or outbox.migrate(conn, schema=...) first"
        )
    latest = latest_version()
    if version < latest:
        raise SchemaError(
            f"schema {schema!r} is at version {version}, this code needs {latest}: "
            "run `outbox migrate`"
        )
    if version > latest:
        raise SchemaError(
            f"schema {schema!r} is at version {version}, newer than this code knows "
            f"({latest}): upgrade outbox before running it against this database"
        )


def migrate(conn: psycopg.Connection[Any], schema: str = "outbox", *,
            lock_timeout: float | None = LOCK_TIMEOUT, target: int | None = None) -> list[int]:
    """Create or upgrade the outbox tables in ``schema``; return the versions applied.

    Idempotent, and safe when several processes run it at once (an advisory lock on the
    schema name serialises their transactions; each version is applied once, by one of
    them, and the later ones find it applied), whatever the database's
    or role's ``default_transaction_isolation``: on an idle connection every transaction
    of the run is READ COMMITTED. Needs a direct connection, not one through a
    transaction-pooling PgBouncer.

    On an idle connection each pending migration of an existing schema applies in a
    transaction of its own (a new schema gets all of them in one), so a migration's locks
    are held only while it runs, not until the last of a long upgrade commits. A run that
    stops part way (a lock never granted, a crash) leaves the schema at the last version
    it applied, which every release that knows that version runs on, and the next run
    goes on from there. A run whose process dies has its server session end within about
    a second, even in a lock wait, releasing the locks its migration took (where the
    server's platform can check a client's connection).

    Online, on an idle connection: each lock is waited for at most ``lock_timeout``
    seconds (None: without bound), so business transactions never queue behind the run
    for longer; a lock not granted in time rolls that migration back and it is tried
    again, up to ``LOCK_ATTEMPTS`` times, then ``SchemaError`` (saying which versions the
    run applied). Indexes of large tables are then built ``CONCURRENTLY``, outside any
    transaction (writes go on meanwhile), and every run checks them again: one a crash
    left unbuilt or invalid is built now.

    Joined to the caller's transaction if ``conn`` is inside one: every pending migration
    applies in it (the schema reaches the target or is left as it was), the run waits for
    its locks like any statement there and builds those indexes in that transaction.
    Under REPEATABLE READ or SERIALIZABLE that transaction's snapshot may predate a
    concurrent run, which is then reported as a ``SchemaError`` (run it again) rather
    than applied twice.

    ``target`` stops at that version (None: the latest): the schema an older release
    left, for testing an upgrade from it.
    """
    check_schema_name(schema)
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return _joined(conn, schema, target)
    # Under REPEATABLE READ or SERIALIZABLE the snapshot is taken by the first statement,
    # the lock request, before the lock is granted: a run that waited would not see the
    # versions the holder just applied and would apply them again.
    previous = conn.isolation_level
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    try:
        applied = _apply(conn, schema, lock_timeout, target)
    finally:
        conn.isolation_level = previous
    build_indexes(conn, schema)
    return applied


def _joined(conn: psycopg.Connection[Any], schema: str, target: int | None) -> list[int]:
    try:
        return _apply_once(conn, schema, None, target, owned=False)
    except (psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateSchema, psycopg.errors.UniqueViolation,
            psycopg.errors.SerializationFailure) as exc:
        raise SchemaError(
            f"schema {schema!r} was migrated by another process after this transaction's "
            "snapshot was taken: run migrate again in a new transaction"
        ) from exc


def _apply(conn: psycopg.Connection[Any], schema: str, lock_timeout: float | None,
           target: int | None) -> list[int]:
    # One migration a transaction (all of them when the schema is new: no one uses its
    # tables yet): a migration's locks are held only while it runs, not until the last
    # one of a long upgrade commits, and each version is a schema the releases that know
    # it run on.
    applied: list[int] = []
    while True:
        step = _apply_step(conn, schema, lock_timeout, target, applied)
        if not step:
            return applied
        applied.extend(step)


def _apply_step(conn: psycopg.Connection[Any], schema: str, lock_timeout: float | None,
                target: int | None, applied: list[int]) -> list[int]:
    pause = _RETRY_PAUSE[0]
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            return _apply_once(conn, schema, lock_timeout, target, owned=True)
        except psycopg.errors.LockNotAvailable as exc:
            # None: the server's own lock_timeout (or a NOWAIT) gave up, not ours.
            waited = "in time" if lock_timeout is None else f"within {lock_timeout:g} s"
            if attempt == LOCK_ATTEMPTS:
                if applied:
                    kept = (f"this run applied {_versions(applied)} (the schema is at version "
                            f"{applied[-1]}, kept: a version every release that knows it "
                            "runs on); run it again to go on")
                else:
                    kept = "nothing was changed"
                raise SchemaError(
                    f"could not migrate schema {schema!r}: a lock it needs was not granted "
                    f"{waited} in {attempt} attempts (a long transaction holds one of its "
                    f"tables; see pg_stat_activity); {kept}"
                ) from exc
            log.warning("migrating schema %r: a lock was not granted %s (attempt %d of %d, "
                        "rolled back); trying again in %.1f s", schema, waited, attempt,
                        LOCK_ATTEMPTS, pause)
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_PAUSE[1])
    raise AssertionError("unreachable")


def _versions(applied: list[int]) -> str:
    return (f"version {applied[0]}" if len(applied) == 1
            else f"versions {applied[0]} to {applied[-1]}")


def _apply_once(conn: psycopg.Connection[Any], schema: str, lock_timeout: float | None,
                target: int | None, *, owned: bool) -> list[int]:
    """One transaction of the run: ``owned`` when ``migrate`` opened it (one migration,
    its indexes built after commit, the server told to end it with its client), else a
    savepoint in the caller's transaction, which gets every migration and the indexes."""
    def execute(statement: str, params: tuple[Any, ...] | None) -> list[tuple[Any, ...]]:
        cursor = conn.execute(statement.encode() if params is None else statement, params)
        return cursor.fetchall() if cursor.description else []

    with conn.transaction():
        if lock_timeout is not None:
            conn.execute("SELECT set_config('lock_timeout', %s, true)",
                         (f"{max(1, round(lock_timeout * 1000))}ms",))
        if owned:  # a setting of the caller's transaction is the caller's to make
            _end_with_the_client(conn)
        return apply_through(execute, schema, indexes_in_run=not owned, target=target,
                             one_at_a_time=owned)


def _end_with_the_client(conn: psycopg.Connection[Any]) -> None:
    """Have the server end this transaction soon after its client is gone.

    A run killed while its session waits for a lock (or runs a long statement) would
    otherwise keep that session, and every lock its migration took so far, until the
    wait ends: with ``lock_timeout=None``, never, and business writes queue behind it.
    PostgreSQL then checks the client's connection every second while a statement runs
    (``client_connection_check_interval``, for this transaction). A server that cannot
    (its platform lacks the check) refuses the setting: the run goes on without it."""
    try:
        with conn.transaction():  # a savepoint: a refusal leaves the run's transaction
            conn.execute(_CLIENT_CHECK)
    except (psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject):
        pass


def wanted_indexes(version: int) -> list[Index]:
    """The after-commit indexes a schema at ``version`` has: those of the migrations it
    applied, less any a later one it applied dropped."""
    applied = [m for m in migrations() if m.version <= version]
    return [index for m in applied for index in m.indexes
            if not any(index.name in later.drops for later in applied
                       if later.version > m.version)]


def build_indexes(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """Build, ``CONCURRENTLY`` and outside any transaction, the after-commit indexes of
    every migration ``schema`` has applied that are missing or invalid, less those a
    later applied migration dropped (``wanted_indexes``; a build that was
    interrupted leaves an invalid index: it is dropped and built again). Runs on an idle
    connection; one process at a time per schema (a session advisory lock), so a second
    finds the first's work done. Returns the names built."""
    autocommit = conn.autocommit
    conn.autocommit = True  # CONCURRENTLY runs outside any transaction
    lock = (_INDEX_LOCK_NAMESPACE + schema,)
    built: list[str] = []
    try:
        version = current_version(conn, schema) or 0
        # A schema a newer release migrated meanwhile: which of these indexes it still
        # has is that release's to say (it may have dropped one of them).
        wanted = wanted_indexes(version) if version <= latest_version() else []
        if not wanted:
            return built
        # Polled, not waited for: a session waiting on the lock would be a transaction
        # the holder's CONCURRENTLY build waits to end, a deadlock.
        while conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                           lock).fetchone() != (True,):
            time.sleep(0.2)
        try:
            for index in wanted:
                valid = conn.execute(
                    "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE n.nspname = %s AND c.relname = %s", (schema, index.name)).fetchone()
                if valid is not None and valid[0]:
                    continue
                if valid is not None:  # an interrupted build's leftover
                    conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}.{}").format(
                        sql.Identifier(schema), sql.Identifier(index.name)))
                log.info("building index %s of schema %r concurrently", index.name, schema)
                conn.execute(bind_schema(index.concurrently(), schema).encode())
                built.append(index.name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", lock)
    finally:
        conn.autocommit = autocommit
    return built


Execute = Callable[[str, "tuple[Any, ...] | None"], list[tuple[Any, ...]]]


def apply_through(execute: Execute, schema: str, *, indexes_in_run: bool = True,
                  target: int | None = None, one_at_a_time: bool = False) -> list[int]:
    """Apply the pending migrations of ``schema`` with ``execute(statement, params)``, in
    the caller's transaction; return the versions applied. Their after-commit indexes are
    built in that transaction too unless ``indexes_in_run`` is False (``migrate`` builds
    them concurrently once the run commits) and the schema already existed.

    The one sequence every route runs (``migrate`` on a psycopg connection, Django's
    migrations on a Django cursor, on psycopg 3 or psycopg2): the advisory lock, the
    schema and its ``schema_migrations``, then each pending file recorded as it applies
    (up to ``target``, when given; only the next one when ``one_at_a_time``, unless the
    schema is new). Statements are plain strings with ``%s`` placeholders, so any DB-API
    cursor runs them.
    """
    check_schema_name(schema)
    execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (_LOCK_NAMESPACE + schema,))
    execute(bind_schema("CREATE SCHEMA IF NOT EXISTS {schema}", schema), None)
    execute(bind_schema("CREATE TABLE IF NOT EXISTS {schema}.schema_migrations ("
                        " version integer PRIMARY KEY,"
                        " name text NOT NULL,"
                        " applied_at timestamptz NOT NULL DEFAULT now())", schema), None)
    [(current,)] = execute(bind_schema(
        "SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations", schema), None)
    version = int(current)
    if version > latest_version():
        raise SchemaError(
            f"schema {schema!r} is at version {version}, newer than this code knows "
            f"({latest_version()}): refusing to migrate"
        )
    applied: list[int] = []
    # A schema created by this run has empty tables: its indexes are built in the run
    # (CONCURRENTLY would only wait for every older transaction of the database to end).
    indexes_in_run = indexes_in_run or version == 0
    for migration in migrations():
        if migration.version <= version or (target is not None and migration.version > target):
            continue
        if _code(migration.sql):  # a file of after-commit indexes only has no body to run
            execute(bind_schema(migration.sql, schema), None)
        if indexes_in_run:
            for index in migration.indexes:
                execute(bind_schema(index.sql, schema), None)
        execute(bind_schema("INSERT INTO {schema}.schema_migrations (version, name) "
                            "VALUES (%s, %s)", schema), (migration.version, migration.name))
        applied.append(migration.version)
        if one_at_a_time and version != 0:
            break
    return applied
