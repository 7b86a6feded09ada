"""OpenTelemetry traces (``outbox[otel]``): a PRODUCER span per enqueue, a CONSUMER span
per attempt linked to it, and the settle step.

- ``send {effect}`` (PRODUCER) is started at enqueue, inside the caller's transaction,
  as a child of whatever span is current there. Its W3C trace context (``traceparent``,
  ``tracestate``; never baggage) is stored in the job's ``trace_context`` column, not in
  the payload.
- ``process {effect}`` (CONSUMER) covers one attempt, from the moment ``perform`` may
  start to the recording of its outcome, with a link to the enqueue's span; it is the
  current span while ``perform`` runs, so instrumented HTTP clients nest under it.
- The settle step (the recording of the outcome) is the ``settle`` event of that span,
  with ``outbox.outcome`` and ``outbox.fence_rejected`` (the fenced write changed 0
  rows: the claim was lost); the span carries both attributes too.

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
from contextlib import contextmanager
from typing import Any

__all__ = ["activated", "attempt_span", "enabled", "producer_span", "settle"]

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


@contextmanager
def producer_span(effect: str, count: int | None = None) -> Iterator[str | None]:
    """Around one enqueue (or a batch of ``count``): the trace context to store, as JSON
    text, or None when tracing is off. The span ends when the block does; an error
    leaving the block marks it failed (by type only)."""
    if not enabled():
        yield None
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
        yield json.dumps(carrier, separators=(",", ":"), sort_keys=True) if carrier else None
    except BaseException as exc:
        _failed(span, exc)
        raise
    finally:
        span.end()


def _failed(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(exc).__qualname__)
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


def settle(span: Any, effect: str, outcome: str) -> None:
    """Record the settle step (an event: half the cost of a child span) and end the
    attempt's span."""
    from opentelemetry import trace

    rejected = outcome == "lost"
    attributes = {"outbox.outcome": outcome, "outbox.fence_rejected": rejected}
    span.add_event("settle", attributes)
    span.set_attributes(attributes)
    if outcome in ("failed", "reconcile"):
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
