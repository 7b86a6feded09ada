"""OpenTelemetry traces (``outbox-pg[otel]``): a PRODUCER span per enqueue, a CONSUMER span
per attempt linked to it, and the settle step.

- ``send {effect}`` (PRODUCER) is started at enqueue, inside the caller's transaction,
  as a child of whatever span is current there. Its W3C trace context (``traceparent``,
  ``tracestate``; never baggage) is stored in the job's ``trace_context`` column, not in
  the payload. ``messaging.message.id`` is the job id. A repeat (the key was known:
  nothing sent) carries ``outbox.repeat`` (a batch: ``outbox.repeats``, a count). Inside
  an ``outbox.transaction`` block the span ends with the block, and a block that rolls
  back marks it ``outbox.rolled_back`` with an error status; the ORM blocks of
  ``outbox.contrib`` end it at the enqueue.
- ``process {effect}`` (CONSUMER) covers one attempt, from the moment ``perform`` may
  start to the recording of its outcome, with a link to the enqueue's span; it is the
  current span while ``perform`` runs, so instrumented HTTP clients nest under it.
- The settle step (the recording of the outcome) is the ``settle`` event of that span,
  with ``outbox.outcome`` and ``outbox.fence_rejected`` (the fenced write changed 0
  rows: the claim was lost); the span carries both attributes too. An attempt whose
  ``perform`` raised (whether the job then retries, fails or waits for reconcile) has
  ``error.type`` (the exception's class) and an error status; an outcome the database
  refused to record ends the span all the same, marked ``outbox.unrecorded`` with the
  refusal's ``error.type``.

Attributes follow the OpenTelemetry messaging conventions (``messaging.system`` is
``outbox``, the destination is the effect name) and carry the job id and attempt number,
never a payload, a key or error text.

Cost when unused: the core never imports OpenTelemetry. Tracing is on only once the
application has imported ``opentelemetry.trace`` and set a real tracer provider; until
then each enqueue and each claim pays one dictionary lookup.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar, Token
from typing import Any

__all__ = ["Send", "activated", "attempt_failed", "attempt_span", "close_block", "enabled",
           "error_type", "open_block", "producer_span", "settle"]

SYSTEM = "outbox"
_PROPAGATOR: Any = None


def enabled() -> bool:
    """Whether spans are recorded: OpenTelemetry imported and a tracer provider set."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


_TRACER: tuple[Any, Any] | None = None  # (provider, its tracer): get_tracer is not cheap


def _tracer() -> Any:
    global _TRACER
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if _TRACER is None or _TRACER[0] is not provider:
        _TRACER = (provider, provider.get_tracer("outbox"))
    return _TRACER[1]


def _propagator() -> Any:
    global _PROPAGATOR
    if _PROPAGATOR is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


class Send:
    """The enqueue's PRODUCER span while its statement runs: ``context`` is the trace
    context to store with the job (JSON text, None when tracing is off)."""

    __slots__ = ("context", "span")

    def __init__(self, span: Any, context: str | None) -> None:
        self.span = span
        self.context = context

    def enqueued(self, job_id: int | None, created: bool) -> None:
        """One enqueue's result: ``messaging.message.id`` is the job id; a repeat (the
        key was already known: nothing was sent) is marked ``outbox.repeat``."""
        if self.span is None:
            return
        if job_id is not None:
            self.span.set_attribute("messaging.message.id", str(job_id))
        self.span.set_attribute("outbox.repeat", not created)

    def enqueued_many(self, created: int, unique: int) -> None:
        """A batch's result: how many of its ``unique`` keys were repeats."""
        if self.span is not None:
            self.span.set_attribute("outbox.repeats", unique - created)


_NOT_TRACED = Send(None, None)
# The producer spans of the innermost open ``outbox.transaction`` block (None outside
# one): they end when the block does, marked if it rolled back.
_BLOCK: ContextVar[list[Any] | None] = ContextVar("outbox_tracing_block", default=None)


@contextmanager
def producer_span(effect: str, count: int | None = None) -> Iterator[Send]:
    """Around one enqueue (or a batch of ``count``): the ``Send`` whose ``context`` is
    stored with the job. An error leaving the block marks the span failed (by type
    only) and ends it; otherwise the span ends now, or with the enclosing
    ``outbox.transaction`` block (see ``open_block``)."""
    if not enabled():
        yield _NOT_TRACED
        return
    from opentelemetry import trace

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue", "messaging.destination.name": effect}
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    span = _tracer().start_span(f"send {effect}", kind=trace.SpanKind.PRODUCER,
                                attributes=attributes)
    try:
        carrier: dict[str, str] = {}
        _propagator().inject(carrier, context=trace.set_span_in_context(span))
        yield Send(span, json.dumps(carrier, separators=(",", ":"), sort_keys=True)
                   if carrier else None)
    except BaseException as exc:
        _failed(span, exc)
        span.end()
        raise
    block = _BLOCK.get()
    if block is None:
        span.end()
    else:
        block.append(span)


def open_block() -> Token[list[Any] | None] | None:
    """An ``outbox.transaction`` block begins: the producer spans of its enqueues end
    when it ends (``close_block``), so a block that rolls back marks them
    ``outbox.rolled_back`` with an error status: nothing was sent. None when tracing is
    off. A block nested in another hands its spans to the outer one on success."""
    return _BLOCK.set([]) if enabled() else None


def close_block(token: Token[list[Any] | None] | None, error: BaseException | None) -> None:
    """The block of ``token`` ended, with ``error`` if it rolled back."""
    if token is None:
        return
    spans = _BLOCK.get() or []
    with suppress(ValueError):  # ended in another context than it began: end them here
        _BLOCK.reset(token)
    outer = _BLOCK.get()
    if error is None and outer is not None and outer is not spans:
        outer.extend(spans)
        return
    for span in spans:
        if error is not None:
            span.set_attribute("outbox.rolled_back", True)
            _failed(span, error)
        span.end()


def error_type(exc: BaseException) -> str:
    """The ``error.type`` of an exception: its fully qualified class name (the bare
    name for builtins), never its message."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _failed(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type(exc))
    span.set_status(Status(StatusCode.ERROR))  # no description: it could hold a payload


def attempt_span(job_id: int, effect: str, attempt: int, trace_context: Any) -> Any:
    """Start the CONSUMER span of one attempt, linked to the enqueue's span if known."""
    from opentelemetry import trace

    links = []
    if isinstance(trace_context, dict):
        carrier = {k: v for k, v in trace_context.items() if isinstance(v, str)}
        linked = trace.get_current_span(_propagator().extract(carrier)).get_span_context()
        if linked.is_valid:
            links.append(trace.Link(linked))
    # A new trace of its own (the attempt may come hours after the enqueue), linked.
    return _tracer().start_span(
        f"process {effect}", context=trace.set_span_in_context(trace.INVALID_SPAN),
        kind=trace.SpanKind.CONSUMER, links=links, attributes={
            "messaging.system": SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": effect,
            "messaging.message.id": str(job_id), "outbox.attempt": attempt})


@contextmanager
def activated(span: Any) -> Iterator[None]:
    """Make ``span`` current while ``perform`` runs (nothing when there is no span)."""
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False, record_exception=False,
                        set_status_on_exception=False):
        yield


def attempt_failed(span: Any, exc: BaseException) -> None:
    """``perform`` raised ``exc``: the attempt failed, whatever the job does next (a
    retry too): ``error.type`` and an error status on its span."""
    _failed(span, exc)


def settle(span: Any, effect: str, outcome: str, error: BaseException | None = None) -> None:
    """Record the settle step (an event: half the cost of a child span) and end the
    attempt's span. ``error``: the outcome could not be written at all (the span is
    marked ``outbox.unrecorded`` with the error's type)."""
    from opentelemetry import trace

    rejected = outcome == "lost" and error is None
    attributes = {"outbox.outcome": outcome, "outbox.fence_rejected": rejected}
    if error is not None:
        attributes["outbox.unrecorded"] = True
    span.add_event("settle", attributes)
    span.set_attributes(attributes)
    if error is not None:
        _failed(span, error)
    elif outcome in ("failed", "reconcile", "retry"):
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
