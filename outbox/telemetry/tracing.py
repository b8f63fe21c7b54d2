"""OpenTelemetry tracing: the publisher's trace context travels in the event's headers, and
each job runs in a CONSUMER span that is its child.

Optional: it works when the ``opentelemetry-api`` package is installed (the ``[otel]``
extra); which SDK and exporter the application configures is its own business, and outbox
never depends on one. Without the package, :data:`ENABLED` is False and publishing and
running jobs pay one check of that constant, nothing else.

**Publishing** (:func:`outbox.publish`, :func:`outbox.publish_many`): when a span is current
(its span context is valid), the global propagator (``opentelemetry.propagate``; by default
W3C ``traceparent`` and ``tracestate``, and ``baggage`` when there is baggage) writes the
current context into each event's headers, as JSON strings under the propagator's own keys.
Nothing is written when no span is current, when the caller's headers already hold any of
those keys (checked case-insensitively: the caller's context wins, whole, for that event),
or when the headers would then pass their size limit (the caller's headers are kept as
they are). The caller's headers are validated and counted against the limit without it.

**Processing** (:meth:`outbox.relay.executor.JobExecutor.run`, the one place every handler runs:
lease and transactional, ``def`` and ``async def``, in the relay and in
:func:`outbox.testing.drain`): a span of kind CONSUMER named ``process <topic>``, whose
parent is the context extracted from the job's headers (a fresh trace when they hold none).
It is the current span while the handler runs, so spans the handler starts are its
children; for a transactional handler it also covers the fenced completion. Attributes
follow OpenTelemetry's messaging semantic conventions (status Development in v1.3x, span
name ``{messaging.operation.name} {destination}``):

=================================  =====================================================
``messaging.system``               ``"outbox"`` (not in the conventions' list of systems,
                                   which allows a custom value)
``messaging.operation.name``       ``"process"``
``messaging.operation.type``       ``"process"``
``messaging.destination.name``     the event's topic
``messaging.consumer.group.name``  the consumer
``messaging.message.id``           the event id, as a string
``outbox.job.id``                  the job id
``outbox.job.attempt``             this attempt, from 1 (the conventions have no generic
                                   delivery-attempt attribute)
``outbox.job.outcome``             how the run ended: ``done``, ``committed``, ``failed``,
                                   ``snoozed``, ``stale``, ``released``, ``timed_out``
``error.type``                     on failure: the exception's qualified class name
=================================  =====================================================

A failed attempt (any exception of the handler, a misuse, a timeout) records the exception
as a span event and sets the status to ERROR with ``Type: message``; every other outcome
leaves the status unset. A lease-mode job's completion is written after the span ends, by
the relay's completer.

**Forwarding** (:mod:`outbox.relay.forwarder`): a forwarder's job runs no handler, so it has no
``process`` span; each batch sent to a broker is a PRODUCER span ``send <forwarder>``
(:func:`send_span`) linked to the publishers' contexts, which the messages carry on in their
headers unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
except ImportError:  # the [otel] extra is not installed: tracing is off
    propagate = trace = Context = None  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from outbox.job import Job

#: Whether ``opentelemetry-api`` is importable; decided once, at import.
ENABLED: bool = trace is not None

def active() -> bool:
    """Whether to make spans now: the API is installed and the application has set a tracer
    provider. Before one is set the API hands out its default proxy (and an explicit
    ``NoOpTracerProvider`` is no better): their spans record nothing, and making, entering
    and ending one per job cost the relay about 15 us of CPU per job (the relay's
    e2e throughput 10-15 % lower, measured with ``bench.e2e``). Checked per job (a call and
    an ``isinstance``), so a provider set after the relay started is followed."""
    if trace is None:
        return False
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


#: The instrumentation scope of outbox's spans.
TRACER_NAME = "outbox"
SYSTEM = "outbox"
#: Longest span status description, in characters (the message is cut, not the span).
MAX_DESCRIPTION_CHARS = 1024

# (job, span) of the job whose handler runs in this thread or task, for failure reports.
_CURRENT: ContextVar[tuple[Job, Any] | None] = ContextVar("outbox_job_span", default=None)


@dataclass(frozen=True, slots=True)
class TraceHeaders:
    """The current trace context as headers: ``members``, JSON object members to add to an
    event's headers (``"traceparent":"00-...-01"``, comma-separated, ASCII), and ``keys``,
    the propagator's keys they hold, lowercased."""

    members: str
    keys: frozenset[str]

    def taken_by(self, headers: Mapping[str, Any] | None) -> bool:
        """Whether ``headers`` (a caller's) already hold one of :attr:`keys`, in any case."""
        if not headers:
            return False
        return any(isinstance(k, str) and k.lower() in self.keys for k in headers)


@functools.cache
def _tracer() -> Any:
    """outbox's tracer, made on first use: a proxy that follows whatever tracer provider the
    application sets, before or after."""
    assert trace is not None
    return trace.get_tracer(TRACER_NAME)


def current_headers() -> TraceHeaders | None:
    """The current context, as the global propagator writes it, or None when tracing is
    off or no valid span is current."""
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return None
    return TraceHeaders(",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in carrier.items()),
                        frozenset(k.lower() for k in carrier))


def _carrier(headers: Mapping[str, Any]) -> dict[str, str]:
    """The string-valued headers under lowercased keys: propagators read lowercase keys
    (as HTTP header names, the keys are taken in any case) and strings only (a header of
    another JSON type, from a caller's own scheme, is ignored rather than failing the job)."""
    return {k.lower(): v for k, v in headers.items() if type(v) is str}


@contextlib.contextmanager
def process_span(job: Job) -> Iterator[Any]:
    """The CONSUMER span of one run of ``job``'s handler, current inside the block and
    ended on leaving it (module notes). Call only when :data:`ENABLED`."""
    assert trace is not None
    parent = propagate.extract(_carrier(job.headers))  # no context in them: a new trace
    tracer = _tracer()
    attributes: dict[str, str | int] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": job.topic,
        "messaging.consumer.group.name": job.consumer,
        "messaging.message.id": str(job.event_id),
        "outbox.job.id": job.id,
        "outbox.job.attempt": job.attempt,
    }
    with tracer.start_as_current_span(f"process {job.topic}", context=parent, kind=trace.SpanKind.CONSUMER,
                                      attributes=attributes, record_exception=False,
                                      set_status_on_exception=False) as span:
        token = _CURRENT.set((job, span))
        try:
            yield span
        finally:
            _CURRENT.reset(token)


@contextlib.contextmanager
def send_span(forwarder: str, system: str, where: str, jobs: Sequence[Job]) -> Iterator[Any]:
    """The PRODUCER span of one batch a forwarder sends to its broker, ``send <forwarder>``:
    linked to each job's publishing context (the messages carry the event's headers
    unchanged, so the broker's consumers continue the publisher's trace, not this one).
    Attributes: ``messaging.system`` (the sink's extra: ``nats``, ``rabbitmq``),
    ``messaging.operation.name`` / ``messaging.operation.type`` ``send``,
    ``messaging.batch.message_count``, ``outbox.forwarder``, ``outbox.sink`` (the sink's
    description, without credentials). Call only when :data:`ENABLED`."""
    assert trace is not None
    links = []
    for job in jobs:
        context = trace.get_current_span(propagate.extract(_carrier(job.headers))).get_span_context()
        if context.is_valid:
            links.append(trace.Link(context, {"outbox.job.id": job.id}))
    attributes: dict[str, str | int] = {
        "messaging.system": system,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(jobs),
        "outbox.forwarder": forwarder,
        "outbox.sink": where,
    }
    with _tracer().start_as_current_span(
            f"send {forwarder}", kind=trace.SpanKind.PRODUCER, attributes=attributes, links=links,
            context=Context()) as span:
        yield span


def record_send(span: Any, delivered: int, failed: int, unavailable: int) -> None:
    """Count a batch's results on its :func:`send_span`; status ERROR when any message was
    not delivered."""
    span.set_attribute("outbox.forward.delivered", delivered)
    if failed or unavailable:
        span.set_attribute("outbox.forward.failed", failed)
        span.set_attribute("outbox.forward.unavailable", unavailable)
        span.set_attribute("error.type", "undelivered")
        span.set_status(trace.Status(trace.StatusCode.ERROR,
                                     f"{failed} failed, {unavailable} not sent (broker unavailable)"))


def record_failure(job: Job, exc: BaseException) -> None:
    """Record ``exc`` on the span of ``job``'s run, if one is current in this thread or
    task (a failure reported from elsewhere, a watchdog's timeout, has none): an exception
    event, ``error.type`` and status ERROR."""
    current = _CURRENT.get()
    if current is None or current[0] is not job:
        return
    span = current[1]
    kind = type(exc).__qualname__
    try:
        message = str(exc)
    except BaseException as err:  # noqa: BLE001 - a broken __str__ must not lose the failure
        message = f"<str() raised {type(err).__name__}>"
    span.set_attribute("error.type", kind)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{kind}: {message}"[:MAX_DESCRIPTION_CHARS]))
    try:  # the SDK's record_exception calls str(exc) itself
        span.record_exception(exc)
    except Exception:  # noqa: BLE001
        span.add_event("exception", {"exception.type": kind, "exception.message": message})


def set_outcome(span: Any, outcome: str, *, error: str | None = None) -> None:
    """Name how the run ended (``outbox.job.outcome``); ``error`` (a description) also
    sets status ERROR, for a failure no exception was recorded for (a timeout)."""
    span.set_attribute("outbox.job.outcome", outcome)
    if error is not None:
        span.set_attribute("error.type", outcome)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
