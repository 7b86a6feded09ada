"""``nats.publish``: publish an event to NATS JetStream, once per key inside the window.

The payload is ``{"subject": ..., "data": <any JSON>, "headers": {...}}`` (``headers``
optional). The message body is the canonical JSON of ``data`` (compact, keys sorted),
so every attempt publishes the same bytes, with these headers:

    Nats-Msg-Id         the job's key: JetStream drops a repeat inside the stream's
                        duplicate window and answers with the original sequence
    Outbox-Message-Id   the job's key again, for consumers to deduplicate on (an inbox)
    Outbox-Event-Time   when the job was first attempted (RFC 3339, UTC): the same on
                        every attempt and re-claim; absent for a job never claimed
    Outbox-Ordering-Key the job's ordering key, when it has one
    Nats-Expected-Stream the effect's stream: the broker refuses (400) a subject that
                        another stream captures
    Content-Type        application/json
    traceparent, ...    whatever ``trace_headers(job)`` returns, when tracing is on

The ledger result is ``{"stream", "seq", "duplicate"}``; for a repeat the broker dropped,
``seq`` is the original message's and ``duplicate`` is true.

Outcome of an attempt, by what happened::

    PubAck (new or duplicate)                       done
    payload invalid: no subject, a wildcard or      Permanent, before any network call
      $-subject, a subject outside the stream,
      reserved or malformed headers, NaN in data
    not connected (connecting, reconnecting)        Retry: nothing was written
    no responders, 503                              Retry: nothing was stored
    400-class answer (wrong stream, message too     Permanent, with the server's
      large, invalid subject), payload over the       description
      server's max_payload
    timeout after the request was written,          UnknownOutcome: retried with the
      500, connection lost mid-request                same Nats-Msg-Id
    stream misconfigured (see ``check``)            Retry, logged as an error, until fixed
    re-attempt past the duplicate window            UnknownOutcome, nothing published
                                                    (reconcile once the dispatcher's
                                                    window ends; see below)

The guarantee: a job is stored in the stream once, provided every attempt after the first
lands inside the stream's duplicate window, counted from the first attempt. ``check``
refuses a window too short to cover a re-claim (the dispatcher's ``lease`` plus
``rescue_interval``) and a retention that forgets ids early (work-queue, interest). Past
the window, the effect will not publish again: the job's fate is unknown and a person (or
a reconciler reading the stream) decides. The effect declares that window as its
``unknown_outcome_window`` (an ``outbox.Effect`` attribute), which the dispatcher uses for
its jobs instead of its own: such jobs go to ``reconcile`` at once rather than after the
dispatcher's default 24 hours, with nothing to copy into the dispatcher.

Strict mode (``strict=True``): the stream keeps one message per subject
(``max_msgs_per_subject=1``, ``discard=new``, ``discard_new_per_subject=true``) and each
event has a subject of its own (e.g. ``orders.paid.102``). The broker then refuses a
second message on a subject (error 10077) for as long as it keeps the first, whatever
the duplicate window: a repeat past the window is found on its subject and recorded as a
duplicate, and re-attempts are never stopped by the window. The trade-off: one subject
per event (more subject state in the server, consumers filter with wildcards) and the
guarantee lasts only while the message is retained (``max_age``, limits).

Order: JetStream stores messages in the order they are acknowledged. Jobs sharing an
``ordering_key`` run one at a time, so their events reach the stream in order; a
consumer keeps that order by processing one message at a time (``max_ack_pending=1``)
or one subject partition per worker, and uses ``Outbox-Ordering-Key`` to route.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit

try:  # outbox-pg[nats]
    import nats
except ModuleNotFoundError as exc:
    raise ModuleNotFoundError(
        f"effects.nats needs {exc.name}, which is not installed: pip install 'outbox-pg[nats]'",
        name=exc.name) from exc
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, RetentionPolicy
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from outbox import (
    ConfigurationError,
    Effect,
    EffectOutcome,
    Job,
    Permanent,
    Retry,
    UnknownOutcome,
)

from ._cloudevents import Envelope, attributes, check_envelope
from ._loop import LoopThread
from ._nats_consumer import ConsumerStats, InboxConsumer, InboxEvent
from ._payload import stop_if_told, validated_payload

__all__ = [
    "ConsumerStats",
    "EventPayload",
    "InboxConsumer",
    "InboxEvent",
    "PublishEvent",
    "StreamFacts",
    "canonical_json",
    "subject_matches",
]

log = logging.getLogger("effects.nats")

MESSAGE_ID_HEADER = "Outbox-Message-Id"
EVENT_TIME_HEADER = "Outbox-Event-Time"
ORDERING_KEY_HEADER = "Outbox-Ordering-Key"
_RESERVED_PREFIXES = ("nats-", "outbox-", "ce-")
_MAX_HEADERS = 64
_MAX_SUBJECT = 1024
_STRICT_DUPLICATE = 10077  # "maximum messages per subject exceeded" (discard new)
_RECHECK_SECONDS = 60.0
_STRICT_DEFAULT_WINDOW = 24 * 3600.0
_TIMER_SLACK = 0.001
# What nats-py accepts as a header name: an HTTP token (RFC 9110).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NO_RESPONDERS = "503"  # the status of the reply when no stream listens on the subject

TraceHeaders = Callable[[Job], Mapping[str, str]]
"""Returns extra headers for an attempt (e.g. ``traceparent``); called once per attempt."""


@functools.lru_cache(maxsize=4096)  # events reuse few subjects; a refused one is not kept
def _check_subject(subject: str) -> str:
    """A publishable NATS subject: dot-separated tokens, no wildcards, no system prefix."""
    if not subject.isascii() or not subject.isprintable() or " " in subject:
        raise ValueError("must be printable ASCII without spaces")
    tokens = subject.split(".")
    if any(token == "" for token in tokens):
        raise ValueError("must not have empty tokens (leading, trailing or double dots)")
    if any(token in ("*", ">") for token in tokens):
        raise ValueError("must not contain wildcards ('*', '>'): a message has one subject")
    if tokens[0].startswith("$") or tokens[0] == "_INBOX":
        raise ValueError("must not be a system subject ($..., _INBOX...)")
    return subject


def _check_header(name: str, value: str) -> None:
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"header name {name!r} must be an HTTP token (letters, digits and "
                         "!#$%&'*+-.^_`|~)")
    if name.lower().startswith(_RESERVED_PREFIXES):
        raise ValueError(f"header {name!r} is reserved (Nats-*, Outbox-* and ce-* are set "
                         "here)")
    if "\r" in value or "\n" in value:
        raise ValueError(f"header {name!r}: value must not contain line breaks")


class EventPayload(BaseModel):
    """A ``nats.publish`` payload: ``subject``, ``data`` (any JSON), optional ``headers``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    subject: str = Field(min_length=1, max_length=_MAX_SUBJECT)
    data: JsonValue
    headers: dict[str, str] = Field(default_factory=dict, max_length=_MAX_HEADERS)
    # The CloudEvents type with envelope="cloudevents" (default: the subject).
    type: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("subject")
    @classmethod
    def _valid_subject(cls, subject: str) -> str:
        return _check_subject(subject)

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            _check_header(name, value)
        return headers


# What json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
# allow_nan=False) makes, without building an encoder per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)


def canonical_json(data: Any) -> bytes:
    """``data`` as compact JSON with sorted keys: equal data gives equal bytes.

    Raises ``ValueError`` for NaN or infinity, which JSON cannot carry.
    """
    return _CANONICAL.encode(data).encode()


@functools.lru_cache(maxsize=1024)  # jobs claimed together share their first attempt
def _event_time(first_attempted_at: datetime) -> str:
    """The ``Outbox-Event-Time`` header: RFC 3339 in UTC, to the microsecond."""
    return first_attempted_at.astimezone(UTC).isoformat(timespec="microseconds")


def subject_matches(pattern: str, subject: str) -> bool:
    """True when ``subject`` falls under the stream subject ``pattern`` (``*``, ``>``)."""
    wanted, actual = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(actual) > index
        if index >= len(actual) or (token != "*" and token != actual[index]):
            return False
    return len(actual) == len(wanted)


@dataclass(frozen=True)
class StreamFacts:
    """What ``check`` learned about the stream, in seconds where it is a duration.

    ``window`` is the effective duplicate window: the stream's ``duplicate_window``, or
    its ``max_age`` when shorter (a message gone is an id forgotten).
    """

    stream: str
    subjects: tuple[str, ...]
    duplicate_window: float
    max_age: float
    window: float
    strict: bool
    checked_at: float
    _captured: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)

    def captures(self, subject: str) -> bool:
        """Whether one of the stream's subjects captures ``subject`` (remembered)."""
        found = self._captured.get(subject)
        if found is None:
            found = any(subject_matches(p, subject) for p in self.subjects)
            if len(self._captured) < 4096:
                self._captured[subject] = found
        return found


class _Acks:
    """The acknowledgements of the publishes in flight on one connection.

    Each publish carries a reply subject of its own under one wildcard subscription and
    waits on a future of its own; one timer, set at the oldest deadline, expires those
    past ``timeout`` (``nats.errors.TimeoutError``). That is all a JetStream publish
    needs from a request: no task, timer or subscription per publish.
    """

    def __init__(self, client: NatsClient, timeout: float) -> None:
        self._client = client
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._prefix = client.new_inbox() + "."
        self._tokens = itertools.count()
        # In deadline order: every publish waits the same ``timeout``.
        self._waiting: OrderedDict[str, tuple[float, asyncio.Future[Msg]]] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    async def subscribe(self) -> None:
        await self._client.subscribe(self._prefix + "*", cb=self._on_reply)

    async def request(self, subject: str, body: bytes, headers: dict[str, str]) -> Msg:
        """Publish with a reply subject and return the reply; raises what
        ``client.publish`` would, or ``nats.errors.TimeoutError`` once written."""
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = self._loop.create_future()
        deadline = self._loop.time() + self._timeout
        self._waiting[token] = (deadline, future)
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._expire)
        try:
            await _send(self._client, subject, self._prefix + token, _header_block(headers),
                        body)
            return await future
        finally:
            self._waiting.pop(token, None)

    async def _on_reply(self, msg: Msg) -> None:
        waiting = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(msg)

    def _expire(self) -> None:
        # A timer may fire a hair early (the loop's clock resolution): count it as due.
        now = self._loop.time() + _TIMER_SLACK
        waiting = self._waiting
        while waiting:
            token = next(iter(waiting))
            deadline, future = waiting[token]
            if deadline > now:
                self._timer = self._loop.call_at(deadline, self._expire)
                return
            del waiting[token]
            if not future.done():
                future.set_exception(nats.errors.TimeoutError())
        self._timer = None


@functools.lru_cache(maxsize=1024)  # few header names, reused by every message
def _header_name(name: str) -> bytes:
    """``name`` as written in a header block; ``BadHeaderError`` unless an HTTP token."""
    if not _HEADER_NAME.fullmatch(name):
        raise nats.errors.BadHeaderError(name)
    return name.encode()


def _header_block(headers: Mapping[str, str]) -> bytes:
    """The ``NATS/1.0`` header block, byte for byte as nats-py's ``publish`` writes it:
    names checked, values stripped, a line break in a value written as a space."""
    lines = [b"NATS/1.0\r\n"]
    for name, raw in headers.items():
        if not (stripped := name.strip()):
            continue  # nats-py skips a blank name too
        value = raw.strip()
        if "\r" in value or "\n" in value:
            value = value.replace("\r", " ").replace("\n", " ")
        lines.append(b"%s: %s\r\n" % (_header_name(stripped), value.encode()))
    lines.append(b"\r\n")
    return b"".join(lines)


# The nats-py versions whose client internals ``_send`` and ``_Connection`` use (the
# extra's bound in pyproject.toml); ``check_client_internals`` names them when they differ.
SUPPORTED_NATS_PY = "nats-py >= 2.7, < 3"
_CLIENT_METHODS = ("_send_command", "_flush_pending")
_CLIENT_ATTRIBUTES = ("_flush_queue", "stats", "options")


def check_client_internals(client: object, *, connected: bool = False) -> None:
    """Raise ``ConfigurationError`` naming the supported nats-py versions unless
    ``client`` has the internals ``_send`` writes through (its write buffer and flusher,
    its counters) and, once ``connected``, the reconnection option ``_Connection`` sets.
    A renamed internal is then one clear error at start-up, not an ``AttributeError`` on
    every publish, retried as a transient failure that opens the breaker."""
    missing = [name for name in _CLIENT_METHODS if not callable(getattr(client, name, None))]
    missing += [name for name in _CLIENT_ATTRIBUTES if not hasattr(client, name)]
    stats, options = getattr(client, "stats", None), getattr(client, "options", None)
    if not isinstance(stats, dict) or not {"out_msgs", "out_bytes"} <= stats.keys():
        missing.append("stats['out_msgs'/'out_bytes']")
    if not isinstance(options, dict) or (
            connected and "max_reconnect_attempts" not in options):
        missing.append("options['max_reconnect_attempts']")
    if missing:
        try:
            version = metadata.version("nats-py")
        except metadata.PackageNotFoundError:
            version = "version unknown"
        raise ConfigurationError(
            f"effects.nats writes through nats-py's client internals, and the installed "
            f"nats-py ({version}) lacks {', '.join(dict.fromkeys(missing))}: install "
            f"{SUPPORTED_NATS_PY} (pip install 'outbox-pg[nats]')")


async def _send(client: NatsClient, subject: str, reply: str, header_block: bytes,
                body: bytes) -> None:
    """Write one HPUB as ``client.publish(subject, body, reply=..., headers=...)`` does.

    nats-py takes headers only as a dict and encodes them anew with a regex and a
    translation per header, a third of a publish's cost here; this writes the block
    made by ``_header_block``. It goes through the client's own write buffer and
    flusher (``_send_command``, ``_flush_pending``: nats-py's internals, which its
    ``publish`` uses the same way), so ordering, reconnection and flushing are the
    client's. Raises what ``publish`` raises before writing.
    """
    if client.is_closed:
        raise nats.errors.ConnectionClosedError
    if client.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not client.is_connected:  # nothing is buffered while disconnected (pending_size=0)
        raise nats.errors.OutboundBufferLimitError
    command = b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
        subject.encode(), reply.encode(), len(header_block),
        len(header_block) + len(body), header_block, body)
    client.stats["out_msgs"] += 1
    client.stats["out_bytes"] += len(body)
    await client._send_command(command)
    if client._flush_queue is not None and client._flush_queue.empty():
        await client._flush_pending()


class _Connection:
    """One reconnecting NATS connection, made on first use, bound to one event loop
    (nats-py's clients are). With ``closes_with_loop`` it closes itself when that loop
    shuts down its async generators (``asyncio.run`` does, before closing the loop)."""

    def __init__(self, servers: list[str], options: Mapping[str, Any], what: str,
                 timeout: float, *, closes_with_loop: bool = False) -> None:
        self._servers = servers
        self._options = dict(options)
        self._what = what
        self._timeout = timeout
        self._closes_with_loop = closes_with_loop
        self._client: NatsClient | None = None
        self._acks: _Acks | None = None
        self._lock: asyncio.Lock | None = None
        self._closer: AsyncGenerator[None, None] | None = None
        # One stream check at a time: hundreds of publishes in flight must not each
        # ask for the stream's info when the facts go stale.
        self.checking: asyncio.Lock | None = None

    @property
    def client(self) -> NatsClient | None:
        return self._client

    async def get(self) -> NatsClient:
        """The connected client; raises ``Retry`` when the broker cannot be reached."""
        if self._client is not None and not self._client.is_closed:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is None or self._client.is_closed:
                client = await self._connect()
                acks = _Acks(client, self._timeout)
                await acks.subscribe()
                self._client, self._acks = client, acks
                if self._closes_with_loop and self._closer is None:
                    self._closer = self._close_at_shutdown()
                    await anext(self._closer)
        return self._client

    async def acks(self) -> tuple[NatsClient, _Acks]:
        """The connected client and the waiter of its publishes' acknowledgements."""
        client = self._client
        if client is None or client.is_closed:
            client = await self.get()
        assert self._acks is not None
        return client, self._acks

    async def _close_at_shutdown(self) -> AsyncGenerator[None, None]:
        """Suspended for as long as the loop runs; finalised at its shutdown."""
        try:
            yield
        finally:
            await self.close()

    async def _connect(self) -> NatsClient:
        try:
            client = await nats.connect(
                servers=self._servers,
                # No buffering while disconnected: a publish then fails before a byte is
                # written, which is what makes "not connected" a safe Retry.
                pending_size=0,
                allow_reconnect=True,
                # One try per server now: an unreachable broker is a Retry of the job, not
                # a perform that hangs. Once connected, reconnect forever (below).
                max_reconnect_attempts=1,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnect,
                reconnected_cb=self._on_reconnect,
                **self._options,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise Retry(f"{self._what}: could not connect ({type(exc).__name__})") from exc
        check_client_internals(client, connected=True)
        # nats-py reads this option on every reconnection round.
        client.options["max_reconnect_attempts"] = -1
        return client

    async def close(self) -> None:
        client, self._client, self._acks = self._client, None, None
        if client is not None and not client.is_closed:
            await client.close()

    async def _on_error(self, exc: Exception) -> None:
        log.debug("%s: connection error %s", self._what, type(exc).__name__)

    async def _on_disconnect(self) -> None:
        log.info("%s: disconnected; reconnecting", self._what)

    async def _on_reconnect(self) -> None:
        log.info("%s: reconnected", self._what)


def _server_list(servers: str | Sequence[str]) -> list[str]:
    listed = [servers] if isinstance(servers, str) else list(servers)
    if not listed or not all(isinstance(s, str) and s for s in listed):
        raise ValueError("servers must be a NATS URL or a non-empty list of them")
    return listed


def _hosts(servers: list[str]) -> str:
    """Hosts and ports only: server URLs may carry credentials."""
    return ",".join(f"{urlsplit(s).hostname}:{urlsplit(s).port or 4222}" for s in servers)


class PublishEvent(Effect):
    """Publishes ``nats.publish`` jobs to the JetStream stream ``stream``.

    Guarantees: every attempt publishes the same bytes with ``Nats-Msg-Id`` = the job's
    key, so the broker stores the event once while attempts stay inside the stream's
    duplicate window; past it, the effect refuses to publish again (see the module
    docstring). ``check()`` (also run on first use and every minute) refuses a stream
    whose window cannot cover a re-claim after ``lease`` + ``rescue_interval`` (give the
    dispatcher's values) or whose retention forgets ids early.

    ``perform`` publishes on the event loop that awaits it (an ``AsyncDispatcher``'s, or
    ``Dispatcher``'s loop for async effects), over one reconnecting connection per loop:
    publishes from concurrent jobs are in flight together on it, each awaiting its own
    acknowledgement. That connection closes when its loop shuts down (``asyncio.run``
    and both dispatchers finalise a loop's async generators) or on ``close()``.
    ``check()``, called from synchronous code, uses a private loop of its own. Reasons
    and logs carry the job key, the subject's stream and the server's hosts, never the
    data or credentials in server URLs.

    ``trace_headers(job)``, when given, returns extra headers for each attempt (the
    tracing integration passes one that injects ``traceparent``). With
    ``envelope="cloudevents"`` each message is also a CloudEvent in binary mode
    (``ce-id`` = the job key, ``ce-source`` = ``source``, ``ce-type`` = the payload's
    ``type`` or the subject, ``ce-time`` = the first attempt; see
    ``effects._cloudevents``). ``connect_options`` are passed to ``nats.connect``
    (credentials, TLS, ``connect_timeout`` ...).
    """
    #: Seconds a publish waits for its acknowledgement. Not a perform timeout (that is
    #: ``Effect.timeout``, read from the class, which this effect leaves None).
    timeout: float

    name = "nats.publish"
    payload_model = EventPayload

    def __init__(
        self,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        stream: str = "EVENTS",
        *,
        timeout: float = 5.0,
        lease: float = 30.0,
        rescue_interval: float = 5.0,
        strict: bool = False,
        trace_headers: TraceHeaders | None = None,
        connect_options: Mapping[str, Any] | None = None,
        envelope: Envelope = None,
        source: str = "/outbox",
    ) -> None:
        """
        :param servers: A NATS server URL, or a list of them (of one cluster).
        :param stream: The JetStream stream the events are stored in.
        :param timeout: Seconds a publish waits for the broker's acknowledgement.
        :param lease: The dispatcher's ``lease`` (seconds), which the stream's duplicate
            window must cover.
        :param rescue_interval: The dispatcher's ``rescue_interval`` (seconds), likewise.
        :param strict: The stream keeps one message per subject, so a repeat is refused
            for as long as the first is kept, whatever the duplicate window.
        :param trace_headers: A function of the job returning extra headers for each
            attempt (``traceparent``).
        :param connect_options: Passed to ``nats.connect`` (credentials, TLS, ...).
        :param envelope: None for the payload's data as it is, or ``"cloudevents"`` for a
            CloudEvent in binary mode.
        :param source: The CloudEvents ``source`` attribute, with that envelope.
        """
        if not stream or any(c in stream for c in " .*>\t"):
            raise ValueError(f"stream must be a JetStream stream name, got {stream!r}")
        if not timeout > 0 or not lease > 0 or not rescue_interval >= 0:
            raise ValueError("timeout and lease must be positive, rescue_interval not negative")
        check_envelope(envelope, source)
        check_client_internals(NatsClient())  # a client not connected: nothing is opened
        self.envelope, self.source = envelope, source
        self._servers = _server_list(servers)
        self.stream = stream
        self.timeout = timeout
        self.lease = lease
        self.rescue_interval = rescue_interval
        self.strict = strict
        self._trace_headers = trace_headers
        self._what = f"nats.publish to stream {stream} at {_hosts(self._servers)}"
        options: dict[str, Any] = {"connect_timeout": 2, "reconnect_time_wait": 0.5,
                                   "name": "outbox"}
        options.update(connect_options or {})
        self._options = options
        self._connection = _Connection(self._servers, options, self._what,  # check()'s
                                       timeout)
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Connection] = (
            weakref.WeakKeyDictionary())
        self._facts: StreamFacts | None = None
        self._loop: LoopThread | None = None
        self._loop_lock = threading.Lock()

    # -- the effect -----------------------------------------------------------------

    async def perform(self, job: Job) -> dict[str, Any]:
        """Publish the job's event; return ``{"stream", "seq", "duplicate"}``.

        Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as drawn in the module
        docstring. Validation happens before any network call.
        """
        event = validated_payload(EventPayload, job)
        try:
            body = canonical_json(event.data)
        except ValueError as exc:
            raise Permanent(f"invalid nats.publish payload for job {job.key}: "
                            "data: not JSON (NaN or infinity)") from exc
        headers = self._headers(job, event)
        stop_if_told(job, f"nats.publish job {job.key}")
        return await self._publish(self._here(), job, event.subject, body, headers)

    @property
    def unknown_outcome_window(self) -> float | None:
        """Seconds after a job's first attempt during which re-publishing is safe.

        The stream's effective duplicate window, known after ``check()`` (None before).
        In strict mode the broker refuses repeats for as long as it keeps a message:
        ``max_age`` when the stream has one, else 24 hours. The dispatcher reads it at
        each decision about these jobs (``outbox.Effect.unknown_outcome_window``) and
        uses it instead of its own window; before the first check, its own applies.
        """
        if self._facts is None:
            return None
        if self._facts.strict:
            return self._facts.max_age or _STRICT_DEFAULT_WINDOW
        return self._facts.window

    @property
    def connected(self) -> bool:
        """True while the connection is up (False before first use and while reconnecting).

        For health checks; ``perform`` does not need it (it answers ``Retry`` instead).
        """
        connections = [self._connection, *list(self._by_loop.values())]
        return any(c.client is not None and c.client.is_connected for c in connections)

    def check(self) -> StreamFacts:
        """Connect and check the stream now; raise ``ConfigurationError`` if it is unfit.

        Refused: a missing stream or one without subjects; retention other than
        ``limits``; an effective duplicate window shorter than ``lease`` +
        ``rescue_interval``; in strict mode, a stream not keeping one message per
        subject with ``discard=new`` per subject. Each message says which setting to
        change. Raises ``ConnectionError`` when the broker cannot be reached.
        """
        try:
            return self._on_loop().call(self._check())
        except Retry as exc:
            raise ConnectionError(exc.reason) from exc

    def close(self) -> None:
        """Close the connection and its event loop; the effect cannot publish afterwards."""
        with self._loop_lock:
            loop, self._loop = self._loop, None
            by_loop = list(self._by_loop.items())
            self._by_loop.clear()
        for other, connection in by_loop:
            _close_on(other, connection)
        if loop is not None:
            loop.call(self._connection.close(), timeout=10.0)
            loop.stop()

    def __enter__(self) -> PublishEvent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PublishEvent(servers={_hosts(self._servers)!r}, stream={self.stream!r})"

    # -- connections ----------------------------------------------------------------

    def _here(self) -> _Connection:
        """The connection of the running loop, made on its first publish."""
        loop = asyncio.get_running_loop()
        connection = self._by_loop.get(loop)
        if connection is None:
            with self._loop_lock:
                # A connection holds its loop: forget those of loops that have closed.
                for gone in [old for old in self._by_loop if old.is_closed()]:
                    del self._by_loop[gone]
                connection = self._by_loop.setdefault(loop, _Connection(
                    self._servers, self._options, self._what, self.timeout,
                    closes_with_loop=True))
        return connection

    def _on_loop(self) -> LoopThread:
        with self._loop_lock:
            if self._loop is None:
                self._loop = LoopThread(f"nats.publish:{self.stream}")
            return self._loop

    async def _publish(
        self, connection: _Connection, job: Job, subject: str, body: bytes,
        headers: dict[str, str],
    ) -> dict[str, Any]:
        client, acks = await connection.acks()
        facts = await self._current_facts(connection, client, job)
        if not facts.captures(subject):
            raise Permanent(f"{self._about(job)}: subject is not one of the stream's "
                            f"subjects ({', '.join(facts.subjects)}); nothing published")
        if job.attempt > 1:
            self._refuse_past_window(job, facts)
        if len(body) > client.max_payload:
            raise Permanent(f"{self._about(job)}: message of {len(body)} bytes exceeds the "
                            f"server's max_payload ({client.max_payload}); nothing published")
        if not client.is_connected:
            raise Retry(f"{self._about(job)}: not connected to NATS; nothing sent")
        try:
            result = _read_ack(await acks.request(subject, body, headers))
        except nats.js.errors.APIError as exc:
            if facts.strict and exc.err_code == _STRICT_DUPLICATE:
                return await self._strict_duplicate(client, subject, job)
            raise _api_outcome(exc, self._about(job)) from exc
        except Exception as exc:
            outcome = _transport_outcome(exc, self._about(job))
            if outcome is None:
                raise
            raise outcome from exc
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: seq %s%s", self._about(job), result["seq"],
                      " (duplicate)" if result["duplicate"] else "")
        return result

    def _about(self, job: Job) -> str:
        """What a reason or log line says about the attempt (never data or credentials)."""
        return f"nats.publish job {job.key} to stream {self.stream}"

    async def _strict_duplicate(
        self, client: NatsClient, subject: str, job: Job
    ) -> dict[str, Any]:
        """The broker refused a second message on the subject: find and report the first."""
        what = self._about(job)
        try:
            stored = await client.jetstream().get_last_msg(self.stream, subject)
        except Exception as exc:
            raise Retry(f"{what}: subject already holds a message; reading it failed "
                        f"({type(exc).__name__})") from exc
        stored_id = (stored.headers or {}).get("Nats-Msg-Id")
        if stored_id != job.key:
            raise Permanent(f"{what}: subject already holds another event "
                            f"(seq {stored.seq}); in strict mode each event needs its own "
                            "subject")
        return {"stream": self.stream, "seq": stored.seq, "duplicate": True}

    def _refuse_past_window(self, job: Job, facts: StreamFacts) -> None:
        if facts.strict or job.attempt <= 1 or job.first_attempted_at is None:
            return
        elapsed = (datetime.now(UTC) - job.first_attempted_at).total_seconds()
        # An earlier attempt may have stored the message as late as its own timeout.
        if elapsed + self.timeout >= facts.window:
            raise UnknownOutcome(
                f"{self._about(job)}: attempt {job.attempt} comes {elapsed:.0f} s after the "
                f"first, past the stream's duplicate window ({facts.window:.0f} s); an earlier "
                "attempt may have been stored, so publishing again could duplicate it: not "
                "published"
            )

    async def _current_facts(
        self, connection: _Connection, client: NatsClient, job: Job
    ) -> StreamFacts:
        facts = self._facts
        if facts is not None and time.monotonic() - facts.checked_at < _RECHECK_SECONDS:
            return facts
        if connection.checking is None:
            connection.checking = asyncio.Lock()
        async with connection.checking:
            facts = self._facts  # checked meanwhile by another publish on this loop?
            if facts is not None and time.monotonic() - facts.checked_at < _RECHECK_SECONDS:
                return facts
            try:
                return await self._check(client)
            except ConfigurationError as exc:
                log.error("%s", exc)
                raise Retry(f"{self._about(job)}: stream unfit: {exc}") from exc

    async def _check(self, client: NatsClient | None = None) -> StreamFacts:
        client = client or await self._connection.get()
        try:
            info = await client.jetstream().stream_info(self.stream)
        except nats.js.errors.NotFoundError as exc:
            raise ConfigurationError(
                f"JetStream stream {self.stream!r} does not exist at {_hosts(self._servers)}: "
                "create it (e.g. nats stream add) with retention=limits"
            ) from exc
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            raise Retry(f"{self._what}: stream info failed ({type(exc).__name__})") from exc
        facts = _judge(info.config, self.stream, self.lease + self.rescue_interval, self.strict)
        self._facts = facts
        return facts

    def _headers(self, job: Job, event: EventPayload) -> dict[str, str]:
        headers = dict(event.headers)
        if self._trace_headers is not None:
            headers.update(self._trace_headers(job))
        headers["Nats-Msg-Id"] = headers[MESSAGE_ID_HEADER] = job.key
        headers["Content-Type"] = "application/json"
        if job.first_attempted_at is not None:
            headers[EVENT_TIME_HEADER] = _event_time(job.first_attempted_at)
        if job.ordering_key is not None:
            headers[ORDERING_KEY_HEADER] = job.ordering_key
        if self.envelope == "cloudevents":
            headers.update(attributes(job, source=self.source,
                                      type_=event.type or event.subject, prefix="ce-"))
        # The broker refuses the message (400) if its subject belongs to another stream.
        headers["Nats-Expected-Stream"] = self.stream
        return headers


def _close_on(loop: asyncio.AbstractEventLoop, connection: _Connection) -> None:
    """Close ``connection`` on its own loop, from any thread. A loop that is not running
    (or is this thread's own, which cannot be waited for here) closes it at its shutdown."""
    if loop.is_closed() or not loop.is_running():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        loop.create_task(connection.close())
        return
    with contextlib.suppress(Exception):  # the loop may stop meanwhile: it closes it then
        asyncio.run_coroutine_threadsafe(connection.close(), loop).result(10.0)


def _judge(config: Any, stream: str, needed: float, strict: bool) -> StreamFacts:
    """The stream's facts, or ``ConfigurationError`` naming the setting to change."""
    subjects = tuple(config.subjects or ())
    if not subjects:
        raise ConfigurationError(f"stream {stream!r} has no subjects to publish to")
    retention = config.retention
    if retention not in (None, RetentionPolicy.LIMITS):
        raise ConfigurationError(
            f"stream {stream!r} has retention={getattr(retention, 'value', retention)}: a "
            "consumed message's id is forgotten, so a re-sent event could be stored "
            "twice; use retention=limits"
        )
    duplicate_window = float(config.duplicate_window or 0)
    max_age = float(config.max_age or 0)
    window = min(duplicate_window, max_age) if max_age > 0 else duplicate_window
    if window < needed:
        setting = "max_age" if max_age and max_age < duplicate_window else "duplicate_window"
        raise ConfigurationError(
            f"stream {stream!r} remembers message ids for {window:g} s ({setting}), less "
            f"than a re-claim can take (lease + rescue_interval = {needed:g} s): raise "
            f"{setting} (e.g. nats stream edit {stream} --dupe-window=1h)"
        )
    if strict and not (
        config.discard == DiscardPolicy.NEW
        and config.discard_new_per_subject
        and config.max_msgs_per_subject == 1
    ):
        raise ConfigurationError(
            f"strict mode needs stream {stream!r} with max_msgs_per_subject=1, "
            "discard=new and discard_new_per_subject=true"
        )
    return StreamFacts(stream, subjects, duplicate_window, max_age, window, strict,
                       time.monotonic())


def _read_ack(reply: Msg) -> dict[str, Any]:
    """The ledger result from JetStream's answer to a publish, ``{"stream", "seq",
    "duplicate"}``. Raises as nats-py's ``js.publish`` would: ``NoStreamResponseError``
    when no stream listens, ``APIError`` (by code) for an error answer, and ``ValueError``
    for an answer that is not a PubAck."""
    if reply.headers and reply.headers.get("Status") == _NO_RESPONDERS:
        raise nats.js.errors.NoStreamResponseError
    answer = json.loads(reply.data)
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    if "error" in answer:
        nats.js.errors.APIError.from_error(answer["error"])  # raises
    try:
        return {"stream": answer["stream"], "seq": answer["seq"],
                "duplicate": answer.get("duplicate", False) is True}
    except KeyError as exc:
        raise ValueError(f"the answer has no {exc}") from None


def _api_outcome(exc: nats.js.errors.APIError, what: str) -> EffectOutcome:
    """The one place JetStream's answers become outcomes."""
    detail = f"{what}: JetStream answered {exc.code} (err_code {exc.err_code}: " \
             f"{exc.description})"
    if isinstance(exc, nats.js.errors.ServiceUnavailableError) or exc.code == 503:
        return Retry(detail + "; nothing stored")
    if exc.code is not None and 400 <= exc.code < 500:
        return Permanent(detail)
    return UnknownOutcome(detail)


def _transport_outcome(exc: Exception, what: str) -> EffectOutcome | None:
    """The one place nats-py's client errors become outcomes (see the module table)."""
    name = type(exc).__name__
    if isinstance(exc, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError):
        return Retry(f"{what}: no responders (JetStream unavailable); nothing stored")
    if isinstance(exc, nats.errors.OutboundBufferLimitError | nats.errors.ConnectionClosedError
                  | nats.errors.ConnectionDrainingError
                  | nats.errors.ConnectionReconnectingError):
        return Retry(f"{what}: not connected ({name}); nothing sent")
    if isinstance(exc, nats.errors.MaxPayloadError):
        return Permanent(f"{what}: message too large for the server; nothing published")
    if isinstance(exc, nats.errors.BadSubjectError | nats.errors.BadHeaderError):
        return Permanent(f"{what}: refused by the client ({name}); nothing published")
    # ValueError: an answer that is not a PubAck.
    if isinstance(exc, TimeoutError | nats.errors.Error | OSError | ValueError):
        return UnknownOutcome(f"{what}: {name} after the request was written; the broker "
                              "may have stored it")
    return None

