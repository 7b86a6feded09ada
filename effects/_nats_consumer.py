"""``InboxConsumer``: a JetStream pull consumer whose handler runs once per message.

Messages come in batches (up to ``batch`` per fetch; the next batch is on its way while
one is handled), handled in delivery order::

    open one database transaction
      tx.receive_many(name, ids)        which messages are new (one statement)
      handler(tx, event)                for each new one, in the same transaction
    commit
    ack the batch                       (then one round trip to the server)

A crash between commit and ack redelivers the messages; ``receive`` then says False and
they are acked without handling them again. A handler that raises rolls the batch's
transaction back; the batch is then handled again with a savepoint around each message
(its inbox row and its handler's writes), so the failing message alone rolls back: the
others commit once (the handlers before it in the batch are called twice; a handler is
called at least once and committed at most once, as with any redelivery). Where messages
name an ordering key (``ordering_key``, by default the ``Outbox-Ordering-Key`` header),
the messages after a failed one with the same key in that batch are not handled: they
are nak'ed to come back after it. The failed message is nak'ed with a growing delay; on
its ``max_deliver``-th failed delivery it is parked on the dead-letter subject and
terminated, so a poison message never loops. If parking fails (no stream captures the
dead-letter subject), the message is kept and retried later: nothing is dropped. A
database that cannot be reached naks the message too, and never parks it (the message is
not at fault). A broker that goes away is waited for: the client reconnects, and
unacknowledged messages are redelivered after ``ack_wait``.

The message id is the ``Outbox-Message-Id`` header (the publishing job's key), else
``Nats-Msg-Id``, else ``<stream>:<stream sequence>`` (which only recognises redeliveries).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import psycopg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

import outbox

from ._consumer_stats import ConsumerStats

T = TypeVar("T")

__all__ = ["ConsumerStats", "InboxConsumer", "InboxEvent"]

log = logging.getLogger("effects.nats.consumer")

MESSAGE_ID_HEADER = "Outbox-Message-Id"
ORDERING_KEY_HEADER = "Outbox-Ordering-Key"
_RECONNECT_PAUSE = 0.2
SyncHandler = Callable[["outbox.Transaction", "InboxEvent"], object]
AsyncHandler = Callable[["outbox.AsyncTransaction", "InboxEvent"], Awaitable[object]]
Handler = SyncHandler | AsyncHandler
OrderingKey = Callable[["InboxEvent"], str | None]
# What happened to one message of a batch: handled (True), a repeat (False), the
# handler's error, or HELD back behind a failed message of the same ordering key.
HELD = "held"
Result = bool | Exception | str


@dataclass(frozen=True)
class InboxEvent:
    """One message as the handler sees it.

    ``data`` is the raw body (``json()`` parses it); ``deliveries`` counts deliveries of
    this message, 1 the first time.
    """

    message_id: str
    subject: str
    data: bytes
    headers: Mapping[str, str]
    stream_seq: int
    deliveries: int

    def json(self) -> Any:
        """The body parsed as JSON (raises ``ValueError`` if it is not JSON)."""
        return json.loads(self.data)


class InboxConsumer:
    """Consumes ``subject`` from ``stream`` through the durable consumer ``name``.

    Guarantee: ``handler(tx, event)`` commits at most once per message id and consumer
    name (the inbox row and the handler's writes commit together), and every message is
    eventually handled, or parked on ``dead_letter_subject`` after ``max_deliver`` failed
    deliveries. ``name`` is both the JetStream durable consumer and the inbox's consumer
    name. Messages are fetched ``batch`` at a time and handled in delivery order in one
    transaction per batch (see the module docstring for failures and ordering keys);
    ``backoff`` gives the nak delay after the n-th failure (the last value repeats).
    ``ordering_key(event)`` names a message's key (default: its ``Outbox-Ordering-Key``
    header; e.g. ``lambda e: e.subject.split(".")[2]`` where the subject names it).

    With ``pipeline=True`` a batch's handlers run in psycopg's pipeline mode: their
    statements go to the server without waiting for each answer, so a batch costs a few
    round trips instead of one per statement. A statement's answer then arrives when it
    is fetched: a handler reads results with ``fetchone``/``fetchall`` (which wait for
    them), not ``rowcount`` or ``description`` right after ``execute``; the ``tx``
    methods (``enqueue``, ``receive`` ...) wait for their own answers and work as
    usual. An error in a pipelined statement rolls the batch back, and it is handled
    again one message at a time, which names the message at fault.

    ``handler`` is a plain function called in a worker thread with an
    ``outbox.Transaction`` on this consumer's own connection (``tx.connection``), so it
    may write business rows and ``tx.enqueue`` follow-up jobs atomically; or an
    ``async def`` awaited on the consumer's loop with an ``outbox.AsyncTransaction`` on
    a ``psycopg.AsyncConnection``.
    """

    def __init__(
        self,
        conninfo: str,
        handler: Handler,
        *,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        stream: str = "EVENTS",
        name: str,
        subject: str | None = None,
        schema: str = "outbox",
        max_deliver: int = 5,
        backoff: Sequence[float] = (1.0, 5.0, 30.0),
        ack_wait: float = 30.0,
        batch: int = 256,
        dead_letter_subject: str | None = None,
        ordering_key: OrderingKey | None = None,
        connect_options: Mapping[str, Any] | None = None,
        pipeline: bool = False,
    ) -> None:
        """
        :param conninfo: The database's connection string (the inbox and your tables).
        :param handler: ``handler(tx, event)``, plain or ``async def``, run once per
            message id.
        :param servers: A NATS server URL, or a list of them.
        :param stream: The JetStream stream to consume.
        :param name: The durable consumer's name, also the inbox's consumer name.
        :param subject: Only the stream's messages on this subject (wildcards allowed);
            None: all of them.
        :param schema: The schema holding the outbox tables (the inbox among them).
        :param max_deliver: Deliveries of a failing message before it is parked on
            ``dead_letter_subject``.
        :param backoff: Seconds before the n-th redelivery of a failed message (the last
            value repeats).
        :param ack_wait: Seconds JetStream waits for an acknowledgement before it
            delivers a message again.
        :param batch: Messages fetched and handled in one transaction.
        :param dead_letter_subject: Where parked messages go; None:
            ``DLQ.<stream>.<name>``.
        :param ordering_key: A function of the event naming its ordering key; None: its
            ``Outbox-Ordering-Key`` header.
        :param connect_options: Passed to ``nats.connect`` (credentials, TLS, ...).
        :param pipeline: Run a batch's handlers in psycopg's pipeline mode.
        """
        if max_deliver < 1 or not backoff or any(not b >= 0 for b in backoff):
            raise ValueError("max_deliver must be >= 1 and backoff non-negative delays")
        self._conninfo = conninfo
        self._handler = handler
        self._servers = [servers] if isinstance(servers, str) else list(servers)
        self.stream = stream
        self.name = name
        self.subject = subject
        self.schema = schema
        self.max_deliver = max_deliver
        self.backoff = tuple(backoff)
        self.ack_wait = ack_wait
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.batch = batch
        self.ordering_key: OrderingKey = ordering_key or _ordering_key_header
        self.pipeline = pipeline
        self.dead_letter_subject = dead_letter_subject or f"DLQ.{stream}.{name}"
        self._options = {"connect_timeout": 2, "reconnect_time_wait": 0.5, "name": name}
        self._options.update(connect_options or {})
        self._db: psycopg.Connection[Any] | None = None
        self._adb: psycopg.AsyncConnection[Any] | None = None
        self._stopping: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_early = False  # stop() came before a run had its event
        self.stats = ConsumerStats()

    # -- running ---------------------------------------------------------------------

    async def run(self) -> ConsumerStats:
        """Consume until ``stop()``; reconnects to NATS and PostgreSQL as needed.

        A ``stop()`` made before ``run()`` makes it return at once; a ``stop()`` while
        the broker is unreachable (connecting or reconnecting) makes it return promptly.
        """
        return await self._consume(until_idle=False, idle_timeout=1.0)

    async def run_until_idle(self, idle_timeout: float = 0.5) -> ConsumerStats:
        """Consume until nothing is left to deliver or awaiting acknowledgement.

        Messages nak'ed with a delay count as outstanding: this returns once each was
        handled, skipped or parked (for tests and batch jobs).
        """
        return await self._consume(until_idle=True, idle_timeout=idle_timeout)

    def stop(self) -> None:
        """Ask ``run`` to return after the batch in hand; safe from any thread, before or
        during a run. A batch already fetched ahead is nak'ed, to be redelivered at once."""
        stopping, loop = self._stopping, self._loop
        if stopping is None or loop is None:
            self._stop_early = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed():
            stopping.set()
        else:
            loop.call_soon_threadsafe(stopping.set)

    async def _consume(self, *, until_idle: bool, idle_timeout: float) -> ConsumerStats:
        stopping = self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._stop_early:
            stopping.set()
        try:
            client = await self._until_stopped(nats.connect(
                servers=self._servers, max_reconnect_attempts=-1, error_cb=self._on_error,
                **self._options))
            if client is None:
                return self.stats
            return await self._consume_on(client, until_idle=until_idle,
                                          idle_timeout=idle_timeout)
        finally:
            self._stopping = self._loop = None
            self._stop_early = False

    async def _until_stopped(self, pending: Awaitable[T]) -> T | None:
        """``pending``'s result, or None as soon as ``stop()`` is asked (it is then
        cancelled): a broker that cannot be reached does not hold a stop."""
        assert self._stopping is not None
        if self._stopping.is_set():
            if inspect.iscoroutine(pending):
                pending.close()
            return None
        task = asyncio.ensure_future(pending)
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None

    async def _consume_on(self, client: NATS, *, until_idle: bool,
                          idle_timeout: float) -> ConsumerStats:
        stopping = self._stopping
        assert stopping is not None
        prefetch: asyncio.Future[list[Msg]] | None = None
        try:
            js = client.jetstream()
            subscription = await self._until_stopped(self._subscribe(js))
            if subscription is None:
                return self.stats

            def fetch() -> asyncio.Future[list[Msg]]:
                return asyncio.ensure_future(subscription.fetch(self.batch,
                                                                timeout=idle_timeout))

            while not stopping.is_set():
                fetching, prefetch = prefetch or fetch(), None
                try:
                    messages = await fetching
                except TimeoutError:  # nats-py raises its own and asyncio's
                    if until_idle and await self._idle(js):
                        break
                    continue
                except nats.errors.Error as exc:
                    # Disconnected: the client reconnects by itself; unacked messages come
                    # back after ack_wait.
                    log.info("%s: fetch failed (%s); retrying", self.name, type(exc).__name__)
                    await asyncio.sleep(_RECONNECT_PAUSE)
                    continue
                # The next batch travels while this one is handled.
                prefetch = fetch()
                try:
                    await self._process(js, messages)
                except nats.errors.Error as exc:
                    log.info("%s: lost the broker mid-batch (%s); what was not acked will "
                             "be redelivered", self.name, type(exc).__name__)
        finally:
            if prefetch is not None:
                await self._give_back(prefetch)
            await client.close()
            await asyncio.to_thread(self._close_db)
            await self._aclose_db()
        return self.stats

    async def _give_back(self, prefetch: asyncio.Future[list[Msg]]) -> None:
        """A batch fetched ahead and not handled: nak'ed, to be redelivered at once (one
        still on its way is cancelled; its messages come back after ``ack_wait``)."""
        if not prefetch.done():
            prefetch.cancel()
        # A cancelled fetch may end in nats-py's own error rather than CancelledError.
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, nats.errors.Error):
            await prefetch
        if prefetch.cancelled() or prefetch.exception() is not None:
            return
        with contextlib.suppress(nats.errors.Error):
            for message in prefetch.result():
                await message.nak()

    async def _subscribe(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """The pull subscription, waiting out a broker that is (re)starting."""
        assert self._stopping is not None
        while True:
            try:
                return await self._pull_subscribe(js)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError) as exc:
                log.info("%s: JetStream not ready (%s); retrying", self.name,
                         type(exc).__name__)
                await asyncio.sleep(_RECONNECT_PAUSE)

    async def _pull_subscribe(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=self.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            # Parking is ours: the server must not drop a message silently at its limit.
            max_deliver=-1,
            filter_subject=self.subject,
        )
        return await js.pull_subscribe(self.subject or "", durable=self.name,
                                       stream=self.stream, config=config)

    async def _on_error(self, exc: Exception) -> None:
        # nats-py would log each failed reconnection with a traceback; one line will do.
        log.info("%s: connection error %s", self.name, type(exc).__name__)

    async def _idle(self, js: JetStreamContext) -> bool:
        try:
            info = await js.consumer_info(self.stream, self.name)
        except nats.errors.Error:
            return False  # the broker is away: not idle as far as we know
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    # -- one batch ------------------------------------------------------------------

    async def _process(self, js: JetStreamContext, messages: list[Msg]) -> None:
        events = [_event(message, self.stream) for message in messages]
        try:
            if inspect.iscoroutinefunction(self._handler):
                results = await self._handle_async(events)
            else:
                results = await asyncio.to_thread(self._handle, events)
        except psycopg.OperationalError as exc:  # the database, not the messages
            results = [exc] * len(events)
        done = []
        for message, event, result in zip(messages, events, results, strict=True):
            if result is True:
                self.stats.handled += 1
            elif result is False:
                self.stats.duplicates += 1
                log.info("%s: message %s already handled; acknowledging", self.name,
                         event.message_id)
            else:
                continue
            done.append(message)
        await self._acknowledge(done)
        delays: dict[str, float] = {}  # per ordering key: when its failed message returns
        for message, event, result in zip(messages, events, results, strict=True):
            if isinstance(result, Exception):
                delay = await self._failed(js, message, event, result)
                if (key := self.ordering_key(event)) is not None:
                    delays.setdefault(key, delay)
            elif result == HELD:
                await message.nak(delay=delays.get(self.ordering_key(event) or "", 0.0))

    def _handle(self, events: list[InboxEvent]) -> list[Result]:
        """In a worker thread: the batch together, and if anything in it failed, again
        one message at a time (see ``_handle_batch_async``)."""
        db = self._connection()
        failed: dict[int, Exception] = {}  # the handler that failed is not called again
        try:
            try:
                with db.pipeline() if self.pipeline else contextlib.nullcontext():
                    return self._handle_batch(db, events, failed, together=True)
            except psycopg.OperationalError:
                raise
            except Exception as exc:
                self._retrying_one_by_one(events, exc)
            return self._handle_batch(db, events, failed, together=False)
        except psycopg.OperationalError:
            self._close_db()  # a fresh connection next time
            raise

    def _handle_batch(self, db: psycopg.Connection[Any], events: list[InboxEvent],
                      failed: dict[int, Exception], *, together: bool) -> list[Result]:
        """``_handle_batch_async``'s mirror, for a plain handler."""
        handler: SyncHandler = self._handler  # type: ignore[assignment]
        results: list[Result] = []
        with db.transaction():
            tx = outbox.Transaction(db, schema=self.schema)  # joins it
            fresh = tx.receive_many(self.name, _ids(events)) if together else []
            for index, event in enumerate(events):
                if together:
                    if fresh[index]:
                        with _noting_failure(failed, index):
                            handler(tx, event)
                    results.append(fresh[index])
                elif index in failed:
                    results.append(failed[index])
                elif self._held(event, results, events):
                    results.append(HELD)
                else:
                    results.append(self._handle_one(db, handler, event, index, failed))
        return results

    def _handle_one(self, db: psycopg.Connection[Any], handler: SyncHandler,
                    event: InboxEvent, index: int, failed: dict[int, Exception]) -> Result:
        try:
            with outbox.transaction(db, schema=self.schema) as tx:  # a savepoint
                if not tx.receive(self.name, event.message_id):
                    return False
                handler(tx, event)
            return True
        except psycopg.OperationalError:
            raise
        except Exception as exc:
            return failed.setdefault(index, exc)

    async def _handle_async(self, events: list[InboxEvent]) -> list[Result]:
        """On the loop: as ``_handle``, with an ``AsyncTransaction``."""
        db = await self._aconnection()
        failed: dict[int, Exception] = {}
        try:
            try:
                async with db.pipeline() if self.pipeline else contextlib.nullcontext():
                    return await self._handle_batch_async(db, events, failed, together=True)
            except psycopg.OperationalError:
                raise
            except Exception as exc:
                self._retrying_one_by_one(events, exc)
            return await self._handle_batch_async(db, events, failed, together=False)
        except psycopg.OperationalError:
            await self._aclose_db()
            raise

    async def _handle_batch_async(self, db: psycopg.AsyncConnection[Any],
                                  events: list[InboxEvent], failed: dict[int, Exception],
                                  *, together: bool) -> list[Result]:
        """One pass over the batch in one transaction; the results in order.

        ``together``: one ``receive_many`` for the batch, then each new message's
        handler (with ``pipeline``, its statements are sent without waiting for each
        answer); the first failure raises and the whole pass rolls back. Otherwise each
        message under a savepoint with its own inbox row, so a failure rolls back that
        message alone and is its result, and a message whose ordering key failed earlier
        in the batch is HELD.
        """
        handler: AsyncHandler = self._handler  # type: ignore[assignment]
        results: list[Result] = []
        async with db.transaction():
            tx = outbox.AsyncTransaction(db, schema=self.schema)
            fresh = await tx.receive_many(self.name, _ids(events)) if together else []
            for index, event in enumerate(events):
                if together:
                    if fresh[index]:
                        with _noting_failure(failed, index):
                            await handler(tx, event)
                    results.append(fresh[index])
                elif index in failed:
                    results.append(failed[index])
                elif self._held(event, results, events):
                    results.append(HELD)
                else:
                    results.append(await self._handle_one_async(db, handler, event, index,
                                                                failed))
        return results

    async def _handle_one_async(self, db: psycopg.AsyncConnection[Any],
                                handler: AsyncHandler, event: InboxEvent, index: int,
                                failed: dict[int, Exception]) -> Result:
        try:
            async with outbox.transaction(db, schema=self.schema) as tx:  # a savepoint
                if not await tx.receive(self.name, event.message_id):
                    return False
                await handler(tx, event)
            return True
        except psycopg.OperationalError:
            raise
        except Exception as exc:
            return failed.setdefault(index, exc)

    def _retrying_one_by_one(self, events: list[InboxEvent], exc: Exception) -> None:
        log.info("%s: a batch of %d failed (%s); handling each message under a savepoint",
                 self.name, len(events), type(exc).__name__)

    def _held(self, event: InboxEvent, results: list[Result],
              events: list[InboxEvent]) -> bool:
        """Whether an earlier message of ``event``'s ordering key failed (or was held)
        in this batch: then ``event`` waits for it."""
        key = self.ordering_key(event)
        if key is None:
            return False
        return any(isinstance(result, Exception) or result == HELD
                   for earlier, result in zip(events, results, strict=False)
                   if self.ordering_key(earlier) == key)

    async def _aconnection(self) -> psycopg.AsyncConnection[Any]:
        if self._adb is None or self._adb.closed:
            self._adb = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, application_name=f"outbox inbox {self.name}")
        return self._adb

    async def _aclose_db(self) -> None:
        adb, self._adb = self._adb, None
        if adb is not None:
            await adb.close()

    async def _acknowledge(self, messages: list[Msg]) -> None:
        """Ack every message, then one round trip to the server (a flush): a lost ack
        only means a harmless redelivery, skipped by the inbox."""
        if not messages:
            return
        try:
            for message in messages:
                await message.ack()
            await messages[0]._client.flush(timeout=5)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("%s: acks not confirmed (%s); those messages will be redelivered "
                        "and skipped", self.name, type(exc).__name__)

    async def _failed(self, js: JetStreamContext, message: Msg, event: InboxEvent,
                      exc: Exception) -> float:
        """Nak ``message`` with its backoff, or park it; the delay given (0 if parked)."""
        self.stats.failed += 1
        self.stats.errors.append(type(exc).__name__)
        log.warning("%s: message %s failed on delivery %d (%s)", self.name, event.message_id,
                    event.deliveries, type(exc).__name__)
        # An unreachable database is not the message's fault: retried, never parked.
        poison = not isinstance(exc, psycopg.OperationalError)
        if poison and event.deliveries >= self.max_deliver and await self._park(js, event, exc):
            self.stats.dead_lettered += 1
            await message.term()
            return 0.0
        delay = self.backoff[min(event.deliveries, len(self.backoff)) - 1]
        await message.nak(delay=delay)
        return delay

    async def _park(self, js: JetStreamContext, event: InboxEvent, exc: Exception) -> bool:
        """Publish the message to the dead-letter subject; False if that failed."""
        # Nats-* headers steer the broker (the id, the expected stream): not copied.
        headers = {k: v for k, v in event.headers.items() if not k.lower().startswith("nats-")}
        headers.update({
            # A consumer that dies after parking and before term parks it again: dedup.
            "Nats-Msg-Id": f"dead:{self.stream}:{self.name}:{event.stream_seq}",
            "Outbox-Dead-Letter-Reason": type(exc).__name__,
            "Outbox-Original-Subject": event.subject,
            "Outbox-Original-Stream-Seq": str(event.stream_seq),
            "Outbox-Deliveries": str(event.deliveries),
            MESSAGE_ID_HEADER: event.message_id,
        })
        try:
            await js.publish(self.dead_letter_subject, event.data, headers=headers, timeout=5.0)
        except (nats.errors.Error, TimeoutError) as error:
            log.error("%s: message %s could not be parked on %s (%s); kept for redelivery",
                      self.name, event.message_id, self.dead_letter_subject,
                      type(error).__name__)
            return False
        log.error("%s: message %s parked on %s after %d deliveries", self.name,
                  event.message_id, self.dead_letter_subject, event.deliveries)
        return True

    # -- the database connection (used from worker threads, one at a time) -------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._db is None or self._db.closed:
            self._db = psycopg.connect(self._conninfo, autocommit=True,
                                       application_name=f"outbox inbox {self.name}")
        return self._db

    def _close_db(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()


def _event(message: Msg, stream: str) -> InboxEvent:
    headers = dict(message.headers or {})
    metadata = message.metadata
    seq = metadata.sequence.stream if metadata.sequence else 0
    message_id = (headers.get(MESSAGE_ID_HEADER) or headers.get("Nats-Msg-Id")
                  or f"{stream}:{seq}")
    return InboxEvent(message_id, message.subject, message.data, headers, seq,
                      metadata.num_delivered or 1)



def _ids(events: list[InboxEvent]) -> list[str]:
    return [event.message_id for event in events]


@contextlib.contextmanager
def _noting_failure(failed: dict[int, Exception], index: int) -> Iterator[None]:
    """Remember the exception of message ``index``'s handler, and let it pass on.

    A database error is not noted: with statements pipelined it may belong to an
    earlier message, and the pass one message at a time will tell.
    """
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, psycopg.Error):
            failed[index] = exc
        raise


def _ordering_key_header(event: InboxEvent) -> str | None:
    """The ordering key the outbox's ``nats.publish`` puts on a message."""
    return event.headers.get(ORDERING_KEY_HEADER)
