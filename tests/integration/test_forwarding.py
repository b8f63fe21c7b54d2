"""Forwarders end to end (architecture notes, "Forwarding"): a relay on a real PostgreSQL
forwarding events to a real NATS JetStream (OUTBOX_TEST_NATS_URL, default
nats://127.0.0.1:4222): every event once in the stream, byte for byte, the job done only
after the PubAck; poison messages dead at once; a broker outage waited out. Skipped with the
reason when nats-py is missing or no NATS server answers. Each test makes its own stream and
deletes it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, publish_many
from outbox.relay.relay import Relay
from outbox.testing import wait_for
from tests.acceptance.brokers import NATS_URL, Tap, nats_missing
from tests.acceptance.proxy import TcpProxy

from .helpers import running_relay, statuses

nats = pytest.importorskip("nats", reason="nats-py is not installed (pip install 'outbox-relay[nats]')")

from outbox import JetStream  # noqa: E402 (after the skip)

TIMEOUT = 90.0


_why = nats_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


class Stream:
    """A JetStream stream of the test's own (subjects ``<name>.>``), read back with
    ``get_msg``; :meth:`messages` returns every stored message."""

    def __init__(self, **options: Any) -> None:
        self.name = "t" + uuid.uuid4().hex[:12]
        self.options = {"duplicate_window": 120.0, **options}
        self._run(self._add())

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run(coroutine)

    async def _connect(self) -> tuple[Any, Any]:
        nc = await nats.connect(NATS_URL)
        return nc, nc.jetstream()

    async def _add(self) -> None:
        nc, js = await self._connect()
        try:
            await js.add_stream(name=self.name, subjects=[f"{self.name}.>"], **self.options)
        finally:
            await nc.close()

    def count(self) -> int:
        async def count() -> int:
            nc, js = await self._connect()
            try:
                return int((await js.stream_info(self.name)).state.messages)
            finally:
                await nc.close()

        return int(self._run(count()))

    def messages(self) -> list[Any]:
        async def read() -> list[Any]:
            nc, js = await self._connect()
            try:
                info = await js.stream_info(self.name)
                return [await js.get_msg(self.name, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
            finally:
                await nc.close()

        return list(self._run(read()))

    def delete(self) -> None:
        async def delete() -> None:
            nc, js = await self._connect()
            try:
                await js.delete_stream(self.name)
            finally:
                await nc.close()

        self._run(delete())

    def set_duplicate_window(self, seconds: float) -> None:
        async def update() -> None:
            nc, js = await self._connect()
            try:
                await js.update_stream(name=self.name, subjects=[f"{self.name}.>"], duplicate_window=seconds)
            finally:
                await nc.close()

        self._run(update())


@pytest.fixture
def stream() -> Iterator[Stream]:
    s = Stream()
    yield s
    s.delete()


def _publish(engine: sa.Engine, topic: str, n: int, start: int = 0, **extra: Any) -> list[int]:
    items = [{"topic": topic, "payload": {"n": i, "name": "caf\u00e9", "amount": 12.5, "tags": ["a", "b"]},
              "key": f"order:{i}", "headers": {"traceparent": f"00-{i:032x}-{i:016x}-01"}, **extra}
             for i in range(start, start + n)]
    with Session(engine) as s, s.begin():
        return publish_many(s, items)



def _stored_payloads(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT id, payload::text FROM outbox_events")).all())


def test_a_thousand_events_land_once_each_byte_for_byte_and_every_job_completes(engine, settings, stream):
    ob = Outbox()
    ob.forward(["order.placed", "order.paid"], to=JetStream(NATS_URL, subject=stream.name + ".{topic}.{key}",
                                                             stream=stream.name), consumer="to_nats")
    ids = _publish(engine, "order.placed", 600) + _publish(engine, "order.paid", 400, start=600)
    with running_relay(ob, settings(claim_batch=100, prefetch=100)) as relay:
        wait_for(lambda: statuses(engine, "to_nats").get("done") == 1000, timeout=TIMEOUT, what="1,000 jobs done")
    stored = _stored_payloads(engine)
    messages = stream.messages()
    assert len(messages) == 1000
    by_event = {int(m.headers["Outbox-Event-Id"]): m for m in messages}
    assert sorted(by_event) == sorted(ids)  # one message per event, none twice
    with engine.connect() as c:
        events = {r.id: r for r in c.execute(sa.text("SELECT id, topic, key, created_at FROM outbox_events"))}
    for event_id, m in by_event.items():
        e = events[event_id]
        assert m.data == stored[event_id].encode()  # the payload's bytes exactly as PostgreSQL stores them
        assert m.subject == f"{stream.name}.{e.topic}.{e.key}"
        assert m.headers["Nats-Msg-Id"] == f"to_nats:{event_id}"
        assert m.headers["Outbox-Topic"] == e.topic and m.headers["Outbox-Key"] == e.key
        assert m.headers["Outbox-Idempotency-Key"] == f"to_nats:{event_id}"
        assert m.headers["Outbox-Created-At"] == e.created_at.isoformat()
        n = int(e.key.split(":")[1])
        assert m.headers["traceparent"] == f"00-{n:032x}-{n:016x}-01"  # the event's own headers pass through
    assert relay.runner.stats["forwarded"] == 1000


def test_a_message_the_stream_refuses_is_dead_at_once_and_the_rest_of_its_batch_delivered(engine, settings):
    small = Stream(max_msg_size=512)
    try:
        ob = Outbox()
        ob.forward("t", to=JetStream(NATS_URL, subject=small.name + ".{topic}"), consumer="fwd", max_attempts=5)
        _publish(engine, "t", 20)
        with Session(engine) as s, s.begin():
            [poison] = publish_many(s, [{"topic": "t", "payload": {"blob": "x" * 2000}}])
        with running_relay(ob, settings(claim_batch=100)):
            wait_for(lambda: statuses(engine, "fwd") == {"done": 20, "dead": 1}, timeout=TIMEOUT,
                     what="20 delivered and the oversized one dead")
        with engine.connect() as c:
            dead = c.execute(sa.text("SELECT attempts, last_error FROM outbox_jobs WHERE event_id = :e"),
                             {"e": poison}).one()
        assert dead.attempts == 1  # dead at once, not after max_attempts
        assert "UndeliverableError" in dead.last_error and "10054" in dead.last_error, dead.last_error
        assert small.count() == 20
    finally:
        small.delete()


def test_a_broker_outage_is_waited_out_nothing_dead_nothing_twice(engine, settings, stream):
    """Unreachable at start, then reachable, then unreachable for ~10 s mid-run: the jobs wait
    (nothing claimed, no attempt spent), the relay stays up, everything arrives once."""
    target = urlsplit(NATS_URL)
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 4222))
    proxy.start()
    proxy.stop()  # a port of our own, nothing listening on it yet
    ob = Outbox()
    ob.forward("t", to=JetStream(f"nats://127.0.0.1:{proxy.port}", subject=stream.name + ".{topic}",
                                 connect_timeout=1.0), consumer="fwd", max_attempts=2)
    try:
        with running_relay(ob, settings(claim_batch=20, prefetch=20)) as relay:
            _publish(engine, "t", 100)
            wait_for(lambda: statuses(engine, "fwd") == {"ready": 100}, timeout=TIMEOUT, what="100 routed jobs")
            time.sleep(2.0)  # a while with the broker unreachable: the relay must not claim them
            assert statuses(engine, "fwd") == {"ready": 100}
            with engine.connect() as c:
                assert c.execute(sa.text("SELECT max(attempts) FROM outbox_jobs")).scalar_one() == 0
            proxy.start()
            wait_for(lambda: statuses(engine, "fwd").get("done") == 100, timeout=TIMEOUT, what="the first 100 done")
            proxy.stop()  # the broker is unreachable from here on
            _publish(engine, "t", 200, start=100)
            outage_until = time.monotonic() + 10.0
            while time.monotonic() < outage_until:  # ~10 s of outage while events keep coming
                assert relay.runner.forwarder is not None
                time.sleep(0.5)
            assert "fwd" in relay.runner.forwarder.unavailable()
            assert statuses(engine, "fwd").get("done") == 100  # nothing was delivered meanwhile
            proxy.start()
            wait_for(lambda: statuses(engine, "fwd").get("done") == 300, timeout=TIMEOUT, what="all 300 done")
    finally:
        proxy.stop()
    assert statuses(engine, "fwd") == {"done": 300}  # no job dead for the outage (max_attempts=2)
    assert stream.count() == 300
    assert len({m.headers["Nats-Msg-Id"] for m in stream.messages()}) == 300


def test_forwarded_jobs_take_no_worker_slot(engine, settings, stream):
    """One worker slot, held by a handler that blocks: the forwarder still sends its jobs,
    through the forwarding window."""
    import threading

    release = threading.Event()
    ob = Outbox()

    @ob.subscriber("slow", consumer="blocker")
    def blocker(job: Any) -> None:
        release.wait(TIMEOUT)

    ob.forward("t", to=JetStream(NATS_URL, subject=stream.name + ".{topic}"), consumer="fwd")
    with Session(engine) as s, s.begin():
        publish_many(s, [{"topic": "slow", "payload": {}}])
    with running_relay(ob, settings(concurrency=1, prefetch=0)):
        try:
            wait_for(lambda: statuses(engine, "blocker").get("running") == 1, timeout=TIMEOUT, what="the slot taken")
            _publish(engine, "t", 50)
            wait_for(lambda: statuses(engine, "fwd").get("done") == 50, timeout=TIMEOUT,
                     what="50 forwarded while the only worker is busy")
            assert statuses(engine, "blocker") == {"running": 1}
        finally:
            release.set()
    assert stream.count() == 50


def test_a_silent_broker_costs_no_attempt(engine, settings, stream, caplog):
    """The connection stays open but nothing comes back (a partition, a stalled server): no
    PubAck arrives for any message of a batch. That is an outage, not bad messages: the jobs
    are handed back uncounted, nothing is dead-lettered, and once the broker answers again
    every event is stored once. It is logged as one outage: one warning, one line back (the
    pauses between batches that try again do not end it; issue 26, item 10)."""
    caplog.set_level(logging.INFO, logger="outbox.relay.forwarder")
    target = urlsplit(NATS_URL)
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 4222))
    proxy.start()
    ob = Outbox()
    ob.forward("t", to=JetStream(f"nats://127.0.0.1:{proxy.port}", subject=stream.name + ".{topic}"),
               consumer="fwd", max_attempts=2, timeout=0.5)
    relay = Relay(ob, settings(claim_batch=20, prefetch=20))
    relay.start()
    try:
        _publish(engine, "t", 20)
        wait_for(lambda: statuses(engine, "fwd").get("done") == 20, timeout=TIMEOUT, what="the first 20 done")
        mark = len(caplog.records)
        proxy.freeze()
        _publish(engine, "t", 40, start=20)
        silent_until = time.monotonic() + 6.0  # many 0.5 s timeouts' worth of silence
        while time.monotonic() < silent_until:
            assert "dead" not in statuses(engine, "fwd")
            time.sleep(0.2)
        with engine.connect() as c:
            assert c.execute(sa.text("SELECT max(attempts) FROM outbox_jobs")).scalar_one() <= 1
        proxy.thaw()
        wait_for(lambda: statuses(engine, "fwd").get("done") == 60, timeout=TIMEOUT, what="all 60 done")
    finally:
        proxy.thaw()
        relay.stop()
        proxy.stop()
    assert statuses(engine, "fwd") == {"done": 60}
    assert len({m.headers["Nats-Msg-Id"] for m in stream.messages()}) == 60 and stream.count() == 60
    said = [r.getMessage() for r in caplog.records[mark:] if r.name == "outbox.relay.forwarder"]
    assert [m.split(" (")[0].split(" to ")[0] for m in said] == ["forwarder fwd: broker unreachable",
                                                                 "forwarder fwd: connected"], said


# ------------------------------------------------- the duplicate window (issue 26, item 3)


def _window_lines(caplog: pytest.LogCaptureFixture, stream: Stream, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "outbox.sinks.jetstream" and r.levelno == level and f"stream {stream.name}:" in r.getMessage()]


@pytest.mark.parametrize("named", [True, False], ids=["stream given", "stream learnt from the PubAck"])
def test_a_duplicate_window_shorter_than_the_resend_span_is_warned_about_once(engine, settings, caplog, named):
    """A stream with duplicate_window 2 s, a forwarder with lease 8 s: a relay that dies after
    the stream stored a message sends it again some 8 s later, after the window, and the
    stream stores it twice. The relay warns once, naming the stream, its window and the span
    with its parts: at start when the stream is given, at the first PubAck otherwise."""
    caplog.set_level(logging.INFO, logger="outbox.sinks.jetstream")
    short = Stream(duplicate_window=2.0)
    try:
        ob = Outbox()
        ob.forward("t", to=JetStream(NATS_URL, subject=short.name + ".{topic}", stream=short.name if named else None),
                   consumer="fwd", lease=8, timeout=1)
        with running_relay(ob, settings(reap_interval=1.0, poll_interval=0.5)):
            if named:  # at start, before anything is sent
                wait_for(lambda: _window_lines(caplog, short), timeout=TIMEOUT, what="the warning at start")
                assert short.count() == 0
            _publish(engine, "t", 10)
            wait_for(lambda: statuses(engine, "fwd").get("done") == 10, timeout=TIMEOUT, what="10 done")
            wait_for(lambda: _window_lines(caplog, short), timeout=TIMEOUT, what="the warning")
            _publish(engine, "t", 10, start=10)  # more batches, the same stream and window: no new line
            wait_for(lambda: statuses(engine, "fwd").get("done") == 20, timeout=TIMEOUT, what="20 done")
    finally:
        short.delete()
    [warning] = _window_lines(caplog, short)
    print(warning)
    assert warning.startswith(f"JetStream stream {short.name}: duplicate_window 2 s is shorter than the 9.5 s within "
                              "which a message may be sent again (forwarder fwd: the longer of: after a relay dies, lease 8 s + "
                              "reap interval 1 s + poll interval 0.5 s = 9.5 s; ")
    assert "set the stream's duplicate_window above 9.5 s" in warning


def test_a_duplicate_window_longer_than_the_resend_span_is_not_warned_about(engine, settings, caplog, stream):
    caplog.set_level(logging.INFO, logger="outbox.sinks.jetstream")
    ob = Outbox()
    ob.forward("t", to=JetStream(NATS_URL, subject=stream.name + ".{topic}", stream=stream.name), consumer="fwd",
               lease=8)
    with running_relay(ob, settings()):
        _publish(engine, "t", 10)
        wait_for(lambda: statuses(engine, "fwd").get("done") == 10, timeout=TIMEOUT, what="10 done")
        sink = ob["fwd"].sink
        wait_for(lambda: sink._windows.get(stream.name) == 120.0, timeout=TIMEOUT, what="the window read")
    assert [r.getMessage() for r in caplog.records if r.name == "outbox.sinks.jetstream"] == []


def test_a_duplicate_window_changed_while_the_relay_runs_is_read_again(engine, settings, caplog, stream, monkeypatch):
    """The window is the stream owner's and may change at any time: the sink reads it again
    every WINDOW_CHECK_INTERVAL seconds while it sends (here 0.5 s) and after a reconnect;
    shortened below the span it warns, lengthened again it says so."""
    from outbox.sinks import jetstream

    monkeypatch.setattr(jetstream, "WINDOW_CHECK_INTERVAL", 0.5)
    caplog.set_level(logging.INFO, logger="outbox.sinks.jetstream")
    ob = Outbox()
    ob.forward("t", to=JetStream(NATS_URL, subject=stream.name + ".{topic}"), consumer="fwd", lease=8)
    relay = Relay(ob, settings())
    relay.start()
    sent = 0

    def publish_until(condition: Any, what: str) -> None:
        def step() -> Any:
            nonlocal sent
            _publish(engine, "t", 1, start=sent)  # a batch: where the sink looks at the clock
            sent += 1
            return condition()

        wait_for(step, timeout=TIMEOUT, interval=0.2, what=what)

    try:
        publish_until(lambda: ob["fwd"].sink._windows.get(stream.name) == 120.0, "the window read")
        assert _window_lines(caplog, stream) == []
        stream.set_duplicate_window(2.0)
        publish_until(lambda: _window_lines(caplog, stream), "the warning about the shortened window")
        stream.set_duplicate_window(60.0)
        publish_until(lambda: _window_lines(caplog, stream, logging.INFO), "the line about the window long enough")
        wait_for(lambda: statuses(engine, "fwd").get("done") == sent, timeout=TIMEOUT, what="all done")
    finally:
        relay.stop()
    [warning] = _window_lines(caplog, stream)
    assert f"stream {stream.name}: duplicate_window 2 s is shorter than the " in warning
    [back] = _window_lines(caplog, stream, logging.INFO)
    assert back.startswith(f"JetStream stream {stream.name}: duplicate_window 60 s now covers the ")


def test_a_silent_message_holds_no_other_job_for_its_timeout(engine, settings, stream):
    """One message is never acknowledged: its subject reaches a core NATS subscriber that
    never answers, so its PubAck never comes, and its forwarder's timeout is long. Every
    other job, claimed with it or after it, is done while the silent one still waits for its
    first answer: a job completes on its own acknowledgement, not its batch's slowest, and
    jobs claimed later are sent at once, not after the batch in flight (issue 26, item 9 (a):
    2 of 10 jobs waited a silent broker's 15 s)."""
    silent_timeout = 60.0  # the others must not wait for it: they are done long before
    mute = "mute" + uuid.uuid4().hex[:12]
    tap = Tap(mute + ".>")  # a responder that never answers
    ob = Outbox()
    ob.forward([f"{stream.name}.ok", f"{mute}.x"], to=JetStream(NATS_URL, subject="{topic}"), consumer="fwd",
               timeout=silent_timeout)
    with Session(engine) as s, s.begin():  # the silent event first: one claim, one hand-off with the others
        [silent] = publish_many(s, [{"topic": f"{mute}.x", "payload": {"n": -1}}])
        publish_many(s, [{"topic": f"{stream.name}.ok", "payload": {"n": n}} for n in range(9)])
    try:
        with running_relay(ob, settings()):
            wait_for(lambda: statuses(engine, "fwd").get("done") == 9, timeout=TIMEOUT,
                     what="the 9 jobs claimed with the silent one done")
            _publish(engine, f"{stream.name}.ok", 10, start=9)
            wait_for(lambda: statuses(engine, "fwd").get("done") == 19, timeout=TIMEOUT,
                     what="the 10 jobs claimed after it done")
            with engine.connect() as c:
                row = c.execute(sa.text("SELECT j.status, j.attempts, j.last_error FROM outbox_jobs j "
                                        "WHERE j.event_id = :e"), {"e": silent}).one()
            assert len(tap.ids()) == 1  # it was sent, once, and is still waiting for its answer
    finally:
        tap.close()
    assert tuple(row) == ("running", 1, None), row
    assert stream.count() == 19
