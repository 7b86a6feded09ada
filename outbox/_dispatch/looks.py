"""Looks at polled databases, and which of them can be skipped without connecting.

A fleet's databases past its look-outs' budget are polled (``fleet.Scout``): every poll
interval, each is asked whether a target in it has work. Most of them, most of the
time, have none, and asking costs a connection to each. One connection per server can
read ``pg_stat_database`` and ``pg_stat_activity`` for every database on it instead
(``database_counters``), and a database whose write counters (``tup_inserted``,
``tup_updated``, ``tup_deleted``, and ``stats_reset``) have not moved since its last
look, none of whose client backends changed state since, and whose last look said its
next job falls due later than now, has nothing new: its look is skipped
(``must_look``).

Why that is safe, and its bounds:

    writes    a job becomes claimable either by a write in its database (an enqueue, a
              completion freeing its ordering key, an operator's retry, a parent's
              done) or by the clock (its ``available_at``, a lease's end, a group
              pause's end): the look remembers the earliest of the clock's
              (``target_due_next``'s ``next_in``), and a write moves the counters
    lag       a backend's counters reach the shared statistics when it goes idle, at
              most once a second, and one that flushed less than a second before holds
              them up to 10 s (PostgreSQL 15+; the collector's 0.5 s before); a backend
              that exits flushes at once. A live backend's commit is seen at once
              instead as its state change (``changed_at``: ``pg_stat_activity``, of
              the client backends not named ``outbox ...``, the dispatchers' own), when
              the reading role may see that backend (the same role, or
              ``pg_read_all_stats``); otherwise its write is seen within that lag. And
              ``every`` (the dispatcher's ``quiet_look_interval``) bounds any miss:
              every database is looked at at least that often, whatever it shows
    baseline  what a look is compared against was read before it: a write after that
              read is seen by the look or shows at a later round
    identity  a row is matched to a database by the server's start time and the
              database's oid, both read by the look itself on its own connection: a
              restarted server, a database dropped and made again, or a connection
              string that reaches another server than its host names, finds no row and
              is looked at as before. So is a database reached through a pooler, one
              whose server cannot be named from its connection string (several hosts, a
              service file), and any database when the counters cannot be read
    xact_commit read, not compared: every look commits a transaction in the database it
              looks at, so it would call every look's database moved at the next round

The look itself (``look``) and the counters' read (``read_counters``) are steps
(``outbox._steps``): one text for ``Dispatcher``'s blocking connections and
``AsyncDispatcher``'s asyncio ones. No I/O here.

A database within the budget has a listening look-out instead, which keeps a connection
LISTENing on its target schemas' channels: an enqueue that notifies wakes its target at
once. Such a look-out asks a schema (``ask``: one small statement) only when something
may have changed there since it was last asked (``must_ask``), not every poll interval:

    notified  an enqueue that notifies wakes its target; a schema not asked since its
              channel was LISTENed to (a new target, a new connection: nothing
              remembered) is asked
    turns     a turn of the target that ended after its last look began: what the turn
              left behind (a retry's backoff, a lease, a job enqueued while it ran whose
              notification it made moot) is asked about after it
    clock     the look said when the schema could next be due with nothing written
              (``target_due_quiet``'s ``next_in``: a future ``run_at``, a backoff, a
              lease to rescue, a group pause's end) and that time has come
    silenced  an enqueue sends no NOTIFY while a dispatcher serving its effect is marked
              awake (``awake``): the look also says when the latest such mark it sees
              ends, and the schema is asked again then. A fleet's turns never mark (they
              run until idle); a mark made after the look, by another dispatcher, is that
              dispatcher's to act on (its last claim before it sleeps sees the job); if it
              died marked, its jobs wait for the next rule
    every     ``quiet_look_interval`` (the safety net: a notification lost with the
              connection, a mark made by a dispatcher that then died): every schema is
              asked at least that often
Enqueues outside READ COMMITTED always notify. A look-out through a pooler cannot
LISTEN: it asks every schema every poll interval, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .._sql import queries
from .._steps import Statement, Step

__all__ = ["Asked", "Counters", "Due", "Identity", "Looked", "Seen", "ask", "asked_after",
           "look", "must_ask", "must_look", "read_counters", "seen_after", "server_key"]

# A target whose schema is missing or not readable: that target is marked down, the
# others of its database are still asked.
UNREADABLE = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName,
              psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedColumn)


@dataclass(frozen=True)
class Identity:
    """Which database of which server: the server's start time (epoch seconds) and the
    database's oid."""

    server: float
    datid: int


@dataclass(frozen=True)
class Counters:
    """A database's row of ``pg_stat_database`` (``database_counters``)."""

    server: float
    datid: int
    xact_commit: int
    tup_inserted: int
    tup_updated: int
    tup_deleted: int
    stats_reset: float | None
    read_at: float = 0.0  # the server's clock when read (epoch seconds)
    # the latest state change of its client backends but dispatchers' (None: none seen)
    changed_at: float | None = None

    @property
    def identity(self) -> Identity:
        return Identity(self.server, self.datid)

    @property
    def writes(self) -> tuple[int, int, int, float | None]:
        """What moves when anything is written (and when the counters are reset)."""
        return self.tup_inserted, self.tup_updated, self.tup_deleted, self.stats_reset


ServerRows = Mapping[Identity, Counters]
"""One server's counters, by database."""


@dataclass(frozen=True)
class Due:
    """One target's answer to a look (``target_due``)."""

    due: bool
    # seconds until a job could be due with nothing written (asked with ``identify``)
    next_in: float | None = None


@dataclass(frozen=True)
class Looked:
    """What a look at one database found: where it was, and each target schema's
    answer (or the error that made it unreadable)."""

    identity: Identity | None
    answers: Mapping[str, Due | psycopg.Error]

    @property
    def found_work(self) -> bool:
        return any(isinstance(a, Due) and a.due for a in self.answers.values())


@dataclass(frozen=True)
class Seen:
    """A database's last look: the counters read before it, when it began (monotonic
    seconds), and when its next job falls due with nothing written (None: none will)."""

    counters: Counters
    at: float
    next_due: float | None


@lru_cache(maxsize=4096)
def server_key(dsn: str) -> str | None:
    """The server a connection string names, for reading its databases' counters on
    one connection: host, address and port; None when it cannot be told (several
    hosts, a service file). Only a grouping: each row is still matched by identity."""
    params = conninfo_to_dict(dsn)
    if "service" in params:
        return None
    host, addr = str(params.get("host") or ""), str(params.get("hostaddr") or "")
    port = str(params.get("port") or "")
    if "," in host or "," in addr or "," in port:
        return None
    return f"{host}|{addr}|{port}"


def must_look(seen: Seen | None, rows: ServerRows | None, now: float, *,
              every: float) -> bool:
    """Whether a polled database must be looked at now: unless its counters stand
    where they stood before its last look, none of its client backends (dispatchers'
    aside) changed state since they were read, that look said no job falls due before
    now, and it was less than ``every`` seconds ago. A database never looked at, or
    whose row is missing (counters unreadable, another server, a pooler), is looked at."""
    if seen is None or rows is None:
        return True
    current = rows.get(seen.counters.identity)
    if current is None:
        return True
    if now - seen.at >= every:
        return True
    if seen.next_due is not None and now >= seen.next_due:
        return True
    if current.changed_at is not None and current.changed_at > seen.counters.read_at:
        return True  # a backend did something since: a commit, seen before its counters
    return current.writes != seen.counters.writes


def seen_after(looked: Looked, rows: ServerRows | None, at: float, *,
               pooled: bool) -> Seen | None:
    """What to remember of a look that began at ``at`` (monotonic seconds), given the
    counters read before it: None (look again next round) when it cannot be compared
    later: through a pooler, not identified, its row not among ``rows``, or a target
    unreadable. A look that found work comes back next round (its turn's writes would
    bring it back anyway)."""
    if pooled or looked.identity is None or rows is None:
        return None
    counters = rows.get(looked.identity)
    if counters is None:
        return None
    nexts: list[float] = []
    for answer in looked.answers.values():
        if not isinstance(answer, Due):
            return None
        if answer.due:
            nexts.append(0.0)
        elif answer.next_in is not None:
            nexts.append(max(0.0, answer.next_in))
    return Seen(counters, at, at + min(nexts) if nexts else None)


@dataclass(frozen=True)
class Asked:
    """A listened schema's last look: when it began (monotonic seconds), and when it
    must be asked again with nothing written nor notified meanwhile (None: only at
    ``every``)."""

    at: float
    next_due: float | None


def must_ask(asked: Asked | None, now: float, *, last_turn: float, every: float) -> bool:
    """Whether a listened schema, idle and not woken, must be asked now: never asked
    (since its LISTEN), a turn of it ended after its last look began (``last_turn``,
    monotonic; 0: none), the time that look gave has come, or that look is ``every``
    seconds old."""
    if asked is None or last_turn >= asked.at:
        return True
    if now - asked.at >= every:
        return True
    return asked.next_due is not None and now >= asked.next_due


def asked_after(answer: Due | psycopg.Error | None, at: float) -> Asked | None:
    """What to remember of a listened schema's look that began at ``at`` (monotonic):
    None (ask again next round) when it found work (its turn comes; asked after it
    anyway) or could not read the schema. ``next_in`` is counted from the server's
    clock at the statement, later than ``at``: the time remembered is never late."""
    if not isinstance(answer, Due) or answer.due:
        return None
    return Asked(at, None if answer.next_in is None else at + max(0.0, answer.next_in))


def ask(schemas: Sequence[str], effects: str) -> Step[Looked]:
    """A listening look-out's question to each of one database's target ``schemas``:
    is it due, and when must it be asked again (``target_due_quiet``). A schema whose
    awake marks cannot be read (a role without rights there, a schema migrated before
    them) is asked as before (``target_due``) and answers ``next_in`` 0: asked every
    round. A schema missing or unreadable is that target's answer; any other error
    ends the look."""
    answers: dict[str, Due | psycopg.Error] = {}
    for schema in schemas:
        q = queries(schema)
        try:
            rows = yield Statement(q.target_due_quiet, {"effects": effects}, row=Due)
            answers[schema] = rows[0]
            continue
        except UNREADABLE as exc:
            answers[schema] = exc
        try:
            rows = yield Statement(q.target_due, {"effects": effects}, row=Due)
        except UNREADABLE:
            continue  # the first error is the answer
        answers[schema] = Due(rows[0].due, next_in=0.0)
    return Looked(None, answers)


def read_counters(schema: str) -> Step[dict[Identity, Counters]]:
    """Every database's counters on the connection's server, by identity (``schema``
    only names the bound query set; the statement reads no schema)."""
    rows = yield Statement(queries(schema).database_counters, {}, row=Counters)
    return {row.identity: row for row in rows}


def look(schemas: Sequence[str], effects: str, *, identify: bool = True) -> Step[Looked]:
    """Ask each of one database's target ``schemas`` whether it has work for
    ``effects`` (a text array literal: ``Settings.effect_names``); with ``identify``
    (the polling look-out's looks), where the connection is (``database_identity``)
    first, and when each next could (``target_due_next``). A schema missing or
    unreadable is that target's answer; any other error ends the look."""
    found: list[Identity] = []
    if identify:
        found = yield Statement(queries(schemas[0]).database_identity, {}, row=Identity)
    answers: dict[str, Due | psycopg.Error] = {}
    for schema in schemas:
        try:
            q = queries(schema)
            rows = yield Statement(q.target_due_next if identify else q.target_due,
                                   {"effects": effects}, row=Due)
        except UNREADABLE as exc:
            answers[schema] = exc
            continue
        answers[schema] = rows[0]
    return Looked(found[0] if found else None, answers)
