"""OpenTelemetry: publish puts the current trace context into the event's headers, and each
job's handler runs in a CONSUMER span that is its child, recorded with the SDK's in-memory
exporter (the SDK is a test dependency only; outbox needs the API alone)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, publish, publish_many
from outbox.publish import MAX_HEADERS_BYTES
from outbox.sinks import Delivered, Failed, Message, SendResult, Sink
from outbox.testing import drain, wait_for

from .helpers import running_relay

trace = pytest.importorskip("opentelemetry.trace", reason="opentelemetry-api is not installed")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

_EXPORTER = InMemorySpanExporter()


class _WhileTesting(SimpleSpanProcessor):
    """Exports to the in-memory exporter only during a test that asks for ``spans``: the
    global provider outlives the test (OpenTelemetry refuses to replace it), and the rest
    of the session should not pile spans up in memory."""

    active = False

    def on_end(self, span: Any) -> None:
        if self.active:
            super().on_end(span)


_PROCESSOR = _WhileTesting(_EXPORTER)


@pytest.fixture
def spans() -> Any:
    """The spans finished during the test."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_outbox_test_processor", False):
        provider.add_span_processor(_PROCESSOR)
        provider._outbox_test_processor = True  # type: ignore[attr-defined]
    _EXPORTER.clear()
    _PROCESSOR.active = True
    yield _EXPORTER
    _PROCESSOR.active = False
    _EXPORTER.clear()


def _tracer() -> Any:
    return trace.get_tracer("tests")


def _headers(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT headers FROM outbox_events ORDER BY id")).scalars())


def _job_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.CONSUMER]


def _traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_job_span_is_the_child_of_the_publishing_span(engine, spans):
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="send_receipt")
    def send_receipt(job: Job) -> None:
        with _tracer().start_as_current_span("mail"):  # the handler's own work: a child of the job's span
            pass

    with _tracer().start_as_current_span("POST /orders") as request, Session(engine) as s, s.begin():
        event_id = publish(s, "order.placed", {"order_id": 4}, key="order:4")
    assert _headers(engine) == [{"traceparent": _traceparent(request)}]

    [result] = drain(engine, ob)
    assert result.outcome == "done"
    [job_span] = _job_spans(spans)
    published = request.get_span_context()
    assert job_span.context.trace_id == published.trace_id
    assert job_span.parent.span_id == published.span_id
    assert job_span.name == "process order.placed"
    assert dict(job_span.attributes) == {
        "messaging.system": "outbox",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": "order.placed",
        "messaging.consumer.group.name": "send_receipt",
        "messaging.message.id": str(event_id),
        "outbox.job.id": result.job_id,
        "outbox.job.attempt": 1,
        "outbox.job.outcome": "done",
    }
    assert job_span.status.status_code is trace.StatusCode.UNSET
    [mail] = [s for s in spans.get_finished_spans() if s.name == "mail"]
    assert mail.parent.span_id == job_span.context.span_id


def test_failing_handler_records_the_exception_and_error_status(engine, spans):
    ob = Outbox()

    @ob.subscriber("t", consumer="c", max_attempts=2)
    def fail(job: Job) -> None:
        if job.attempt == 1:
            raise ValueError("card declined")
        raise PermanentError("no such customer")

    with _tracer().start_as_current_span("publisher"), Session(engine) as s, s.begin():
        publish(s, "t", {})
    results = drain(engine, ob, run_retries=True)
    assert [r.outcome for r in results] == ["retried", "dead"]
    first, second = _job_spans(spans)
    assert (first.attributes["outbox.job.attempt"], second.attributes["outbox.job.attempt"]) == (1, 2)
    for span, kind, message in ((first, "ValueError", "card declined"), (second, "PermanentError", "no such customer")):
        assert span.status.status_code is trace.StatusCode.ERROR
        assert span.status.description == f"{kind}: {message}"
        assert span.attributes["error.type"] == kind
        assert span.attributes["outbox.job.outcome"] == "failed"
        [event] = span.events
        assert event.name == "exception"
        assert event.attributes["exception.type"].endswith(kind)
        assert event.attributes["exception.message"] == message
    assert first.context.trace_id == second.context.trace_id  # both attempts belong to the publisher's trace


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_an_exception_without_text_is_still_recorded(engine, spans):
    ob = Outbox()

    @ob.subscriber("t", consumer="c", max_attempts=1)
    def fail(job: Job) -> None:
        raise _Unprintable()

    with Session(engine) as s, s.begin():
        publish(s, "t", {})
    [result] = drain(engine, ob)
    assert result.outcome == "dead"
    [span] = _job_spans(spans)
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.status.description == "_Unprintable: <str() raised RuntimeError>"
    assert [e.attributes["exception.type"] for e in span.events] == ["_Unprintable"]


def test_transactional_and_async_handlers_run_inside_their_span(engine, spans):
    ob = Outbox()
    seen: dict[str, Any] = {}

    @ob.subscriber("t", consumer="tx", transactional=True)
    def tx(job: Job, session: Session) -> None:
        seen["tx"] = trace.get_current_span().get_span_context()

    @ob.subscriber("t", consumer="aio")
    async def aio(job: Job) -> None:
        await asyncio.sleep(0)
        seen["aio"] = trace.get_current_span().get_span_context()

    with _tracer().start_as_current_span("publisher") as publisher, Session(engine) as s, s.begin():
        publish(s, "t", {})
    results = drain(engine, ob)
    assert [r.outcome for r in results] == ["done", "done"]
    by_consumer = {s.attributes["messaging.consumer.group.name"]: s for s in _job_spans(spans)}
    assert set(by_consumer) == {"tx", "aio"}
    for consumer, span in by_consumer.items():
        assert span.parent.span_id == publisher.get_span_context().span_id
        assert seen[consumer].span_id == span.context.span_id  # the handler's current span is the job's
    assert by_consumer["tx"].attributes["outbox.job.outcome"] == "committed"


def test_publish_many_injects_per_event_and_keeps_a_callers_context(engine, spans):
    ob = Outbox()
    ob.subscriber("t", consumer="c")(lambda job: None)
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with _tracer().start_as_current_span("batch") as batch, Session(engine) as s, s.begin():
        publish_many(s, [("t", {"n": 1}), {"topic": "t", "payload": {"n": 2}, "headers": {"tenant": "a"}},
                         {"topic": "t", "payload": {"n": 3}, "headers": {"TraceParent": theirs}},
                         {"topic": "t", "payload": {"n": 4}, "dedup_key": "k"}])
    ours = _traceparent(batch)
    assert _headers(engine) == [{"traceparent": ours}, {"tenant": "a", "traceparent": ours},
                                {"TraceParent": theirs}, {"traceparent": ours}]
    drain(engine, ob)
    parents = sorted((s.parent.trace_id, s.parent.span_id) for s in _job_spans(spans))
    context = batch.get_span_context()
    assert parents == sorted([(context.trace_id, context.span_id)] * 3
                             + [(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)])


def test_no_current_span_writes_no_context_and_jobs_start_a_new_trace(engine, spans):
    ob = Outbox()
    ob.subscriber("t", consumer="c")(lambda job: None)
    with Session(engine) as s, s.begin():
        publish(s, "t", {}, headers={"a": 1})
        publish(s, "t", {})
    assert _headers(engine) == [{"a": 1}, {}]
    drain(engine, ob)
    assert [s.parent for s in _job_spans(spans)] == [None, None]


def test_headers_at_their_limit_are_kept_without_the_context(engine, spans):
    filler = "x" * (MAX_HEADERS_BYTES - len('{"f":""}'))  # exactly the limit, encoded
    with _tracer().start_as_current_span("publisher"), Session(engine) as s, s.begin():
        publish(s, "t", {}, headers={"f": filler})
    assert _headers(engine) == [{"f": filler}]


def test_relay_runs_each_job_in_a_span(engine, settings, spans):
    ob = Outbox()
    done: list[int] = []
    ob.subscriber("t", consumer="c")(lambda job: done.append(job.id))
    with _tracer().start_as_current_span("publisher") as publisher, Session(engine) as s, s.begin():
        publish_many(s, [("t", {"n": n}) for n in range(3)])
    with running_relay(ob, settings(concurrency=2), maintain=False):
        wait_for(lambda: len(done) == 3 and len(_job_spans(spans)) == 3, timeout=15, what="three job spans")
    assert {s.parent.span_id for s in _job_spans(spans)} == {publisher.get_span_context().span_id}
    assert sorted(s.attributes["outbox.job.id"] for s in _job_spans(spans)) == sorted(done)


def test_without_opentelemetry_nothing_is_traced(db_url):
    """With ``opentelemetry`` not importable, tracing is off and publish writes the
    caller's headers only (a fresh interpreter, the package hidden from it)."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["opentelemetry"] = None  # import opentelemetry -> ImportError
        from sqlalchemy.orm import Session
        from outbox import publish
        from outbox.telemetry import tracing
        from outbox.db.engine import make_engine
        assert not tracing.ENABLED
        engine = make_engine({db_url.render_as_string(hide_password=False)!r})
        with Session(engine) as s, s.begin():
            publish(s, "t", {{}}, headers={{"a": 1}})
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


class _MemorySink(Sink):
    """A broker in memory: keeps every message; refuses the ones whose payload says so."""

    extra = "memory"

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._up = False

    def describe(self) -> str:
        return "memory"

    async def connect(self) -> None:
        self._up = True

    @property
    def connected(self) -> bool:
        return self._up

    async def send_many(self, messages: Sequence[Message], timeout: float) -> list[SendResult]:
        self.messages.extend(messages)
        return [Failed("refused", permanent=True) if b'"refuse"' in m.body else Delivered() for m in messages]

    async def close(self) -> None:
        self._up = False


def test_forwarded_batches_are_producer_spans_linked_to_the_publishers(engine, settings, spans):
    sink = _MemorySink()
    ob = Outbox()
    ob.forward("t", to=sink, consumer="to_memory", max_attempts=1)
    with _tracer().start_as_current_span("publisher") as publisher, Session(engine) as s, s.begin():
        publish_many(s, [("t", {"n": 1}), ("t", {"refuse": True})])
    with running_relay(ob, settings(), maintain=False):
        wait_for(lambda: len(sink.messages) == 2 and any(s.kind is trace.SpanKind.PRODUCER
                                                         for s in spans.get_finished_spans()),
                 timeout=15, what="the batch sent")
    sends = [s for s in spans.get_finished_spans() if s.kind is trace.SpanKind.PRODUCER]
    assert sum(s.attributes["messaging.batch.message_count"] for s in sends) == 2
    assert {s.name for s in sends} == {"send to_memory"}
    assert all(s.attributes["messaging.system"] == "memory" for s in sends)
    assert {link.context.span_id for s in sends for link in s.links} == {publisher.get_span_context().span_id}
    assert any(s.status.status_code is trace.StatusCode.ERROR for s in sends)  # the refused message
    # The messages carry the publisher's context on, unchanged.
    assert {m.headers["traceparent"] for m in sink.messages} == {_traceparent(publisher)}
