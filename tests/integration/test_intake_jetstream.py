"""Intake from NATS JetStream on a real NATS server (OUTBOX_TEST_NATS_URL, default
nats://127.0.0.1:4222) into a real PostgreSQL: every message the sender committed has exactly
one effect in a transactional handler, through re-sends, redeliveries after a lost
acknowledgement, two relays on one durable consumer, a database outage and poison messages.
Each test makes its own stream and deletes it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.testing import wait_for
from tests.acceptance.brokers import NATS_URL, nats_missing
from tests.acceptance.proxy import TcpProxy, database_target, through

from .helpers import running_relay, running_relays
from .intake_helpers import counting_subscriber, effects, forwarded, intake_rows

nats = pytest.importorskip("nats", reason="nats-py is not installed (pip install 'outbox-relay[nats]')")

from outbox.intake.jetstream import JetStreamSource  # noqa: E402 (after the skip)

_why = nats_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

TIMEOUT = 60.0


class SenderStream:
    """A stream of the test's own binding ``<name>.>``, written as a sender would."""

    def __init__(self) -> None:
        self.name = "in" + uuid.uuid4().hex[:12]
        self.durable = "d" + uuid.uuid4().hex[:8]
        asyncio.run(self._call(lambda js: js.add_stream(name=self.name, subjects=[f"{self.name}.>"],
                                                         duplicate_window=120.0)))

    @staticmethod
    async def _call(action: Any) -> Any:
        nc = await nats.connect(NATS_URL, connect_timeout=5, allow_reconnect=False)
        try:
            return await action(nc.jetstream())
        finally:
            await nc.close()

    def send(self, messages: list[tuple[bytes, dict[str, str]]], subject: str = "orders") -> None:
        """Publish each (body, headers) with its own Nats-Msg-Id (a re-send outside the
        duplicate window is a second message to the stream)."""
        async def send(js: Any) -> None:
            for body, headers in messages:
                await js.publish(f"{self.name}.{subject}", body, headers={**headers, "Nats-Msg-Id": uuid.uuid4().hex})

        asyncio.run(self._call(send))

    def consumer_state(self) -> tuple[int, int]:
        """(messages not yet delivered, delivered and not acknowledged) of the durable consumer."""
        async def info(js: Any) -> tuple[int, int]:
            ci = await js.consumer_info(self.name, self.durable)
            return int(ci.num_pending), int(ci.num_ack_pending)

        return tuple(asyncio.run(self._call(info)))  # type: ignore[return-value]

    def source(self, **options: Any) -> JetStreamSource:
        return JetStreamSource(NATS_URL, stream=self.name, durable=self.durable, **options)

    def delete(self) -> None:
        asyncio.run(self._call(lambda js: js.delete_stream(self.name)))


@pytest.fixture
def stream() -> Iterator[SenderStream]:
    s = SenderStream()
    yield s
    s.delete()


def _settled(stream: SenderStream) -> bool:
    return stream.consumer_state() == (0, 0)


def test_each_committed_message_has_one_effect_through_resends_and_two_relays(engine: sa.Engine, settings: Any,
                                                                             stream: SenderStream) -> None:
    ob = Outbox()
    ob.intake("orders", source=stream.source(ack_wait=2), batch=20)
    counting_subscriber(ob, engine)
    sent = [forwarded(i) for i in range(200)]
    stream.send(sent)
    stream.send(sent[:40])  # the sender re-sends after a crash: new stream messages, same identities
    with running_relays(2, ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 200 and _settled(stream), TIMEOUT)
    assert set(effects(engine).values()) == {1}
    rows = intake_rows(engine, "orders")
    assert len(rows) == 200 and all(r["event_id"] is not None and r["problem"] is None for r in rows)
    with engine.connect() as conn:
        event = conn.execute(sa.text("SELECT topic, key, payload, headers FROM outbox_events "
                                     "WHERE payload->>'order_id' = '9'")).one()
    assert event.topic == "order.placed" and event.key == "order:2"
    assert event.payload == {"order_id": 9, "name": "caf\u00e9"}
    assert event.headers["Outbox-Event-Id"] == "9" and event.headers["traceparent"] == f"00-{9:032x}-{9:016x}-01"
    assert "Nats-Msg-Id" not in event.headers


def test_a_lost_acknowledgement_redelivers_and_the_copy_is_dropped(engine: sa.Engine, settings: Any,
                                                                  stream: SenderStream,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between the commit and the ack: the first batches' acks never reach NATS
    (as when a relay dies right after its commit); NATS delivers them again after ack_wait
    and the relay drops them as taken in."""
    ob = Outbox()
    ob.intake("orders", source=stream.source(ack_wait=1), batch=10)
    counting_subscriber(ob, engine)
    real_ack = JetStreamSource.ack
    lost: list[int] = []

    async def ack(self: JetStreamSource, received: Any) -> None:
        if len(lost) < 3:
            lost.append(len(received))
            return
        await real_ack(self, received)

    monkeypatch.setattr(JetStreamSource, "ack", ack)
    stream.send([forwarded(i) for i in range(30)])
    with running_relay(ob, settings(poll_interval=0.2)) as relay:
        assert wait_for(lambda: len(effects(engine)) == 30 and _settled(stream), TIMEOUT)
        assert relay.intake is not None
        assert relay.intake.stats["duplicates"] >= sum(lost) > 0
    assert set(effects(engine).values()) == {1}


def test_poison_messages_are_kept_rejected_and_never_block_the_stream(engine: sa.Engine, settings: Any,
                                                                      stream: SenderStream) -> None:
    ob = Outbox()
    ob.intake("orders", source=stream.source(), topic={f"{stream.name}.orders": "order.placed"},
              max_payload_bytes=1000)
    counting_subscriber(ob, engine)
    good = forwarded(1)
    stream.send([(b"\xff not json", {"Outbox-Idempotency-Key": "p:1"}), good,
                 (b'{"order_id": 2, "pad": "' + b"x" * 2000 + b'"}', {"Outbox-Idempotency-Key": "p:2"}),
                 (b'{"order_id": 3}', {}),  # no identity (no header; the test sends its own Nats-Msg-Id)
                 forwarded(4)])
    stream.send([(b'{"order_id": 5}', {"Outbox-Idempotency-Key": "p:5"})], subject="elsewhere")
    with running_relay(ob, settings(poll_interval=0.2, metrics_port=0)) as relay:
        assert wait_for(lambda: len(effects(engine)) == 3 and _settled(stream), TIMEOUT)
        assert relay.intake is not None and relay.intake.stats["rejected"] == 3
        assert relay.metrics_server is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{relay.metrics_server.port}/metrics", timeout=10) as answer:
            scraped = answer.read().decode()
        assert 'outbox_intake_messages_total{intake="orders",result="rejected"} 3.0' in scraped
        assert 'outbox_intake_messages_total{intake="orders",result="taken"} 3.0' in scraped
    rows = {r["identity"]: r for r in intake_rows(engine, "orders")}
    assert "not UTF-8 JSON" in rows["p:1"]["problem"] and rows["p:1"]["body"] == b"\xff not json"
    assert "max_payload_bytes 1000" in rows["p:2"]["problem"] and rows["p:2"]["body_size"] > 2000
    assert "no topic for subject" in rows["p:5"]["problem"] and rows["p:5"]["subject"] == f"{stream.name}.elsewhere"
    assert effects(engine) == {1: 1, 3: 1, 4: 1}  # order 3 identified by its Nats-Msg-Id


def test_a_database_outage_holds_the_batch_unacknowledged_until_it_commits(engine: sa.Engine, settings: Any,
                                                                           db_url: sa.URL, stream: SenderStream) -> None:
    proxy = TcpProxy(database_target(db_url))
    proxy.start()
    ob = Outbox()
    ob.intake("orders", source=stream.source(ack_wait=2), batch=10)
    counting_subscriber(ob, engine)
    try:
        with running_relay(ob, settings(database_url=through(db_url, proxy).render_as_string(hide_password=False),
                                        poll_interval=0.2, reconnect_max=1.0)):
            stream.send([forwarded(i) for i in range(10)])
            assert wait_for(lambda: len(effects(engine)) == 10, TIMEOUT)
            proxy.stop()
            stream.send([forwarded(i) for i in range(10, 40)])
            assert wait_for(lambda: stream.consumer_state()[1] > 0, TIMEOUT)  # delivered, held, not acknowledged
            assert len(intake_rows(engine, "orders")) == 10
            proxy.start()
            assert wait_for(lambda: len(effects(engine)) == 40 and _settled(stream), TIMEOUT)
    finally:
        proxy.stop()
    assert set(effects(engine).values()) == {1}


def test_an_ordered_intake_keeps_each_keys_order_through_lost_acks_and_a_takeover(
        engine: sa.Engine, settings: Any, stream: SenderStream, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two relays, one ordered intake: one takes in, the other stands by; acks are lost now and
    then (redeliveries); the holder stops mid-stream and the other takes over. An ordered
    subscriber on the receiving side sees every key's messages once each, in the sender's order."""
    ob = Outbox()
    ob.intake("orders", source=stream.source(ack_wait=1), batch=7, ordered=True)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE seen (n serial PRIMARY KEY, key text NOT NULL, seq int NOT NULL)")

    @ob.subscriber("order.placed", consumer="log", transactional=True, ordered=True)
    def log_it(job: Any, session: Any) -> None:
        session.execute(sa.text("INSERT INTO seen (key, seq) VALUES (:k, :s)"), {"k": job.key, "s": job.payload["seq"]})

    real_ack = JetStreamSource.ack
    calls: list[int] = []

    async def ack(self: JetStreamSource, received: Any) -> None:
        calls.append(len(received))
        if len(calls) % 5 == 2:  # every fifth ack is lost: those messages come again after ack_wait
            return
        await real_ack(self, received)

    monkeypatch.setattr(JetStreamSource, "ack", ack)
    keys, per_key = 6, 25

    def messages(seqs: range) -> list[tuple[bytes, dict[str, str]]]:
        return [(json.dumps({"seq": s}).encode(), {"Outbox-Idempotency-Key": f"s:{k}:{s}", "Outbox-Topic": "order.placed",
                                                    "Outbox-Key": f"k{k}"}) for s in seqs for k in range(keys)]

    def seen() -> dict[str, list[int]]:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT key, seq FROM seen ORDER BY n")).all()
        by_key: dict[str, list[int]] = {}
        for key, seq in rows:
            by_key.setdefault(key, []).append(seq)
        return by_key

    with running_relays(2, ob, settings(poll_interval=0.2)) as relays:
        for start in range(0, 10, 2):  # while both relays run
            stream.send(messages(range(start, start + 2)))
            time.sleep(0.2)
        assert wait_for(lambda: sum(map(len, seen().values())) == keys * 10, TIMEOUT)
        holders = [r for r in relays if r.intake is not None and r.intake.stats["batches"] > 0]
        assert len(holders) == 1
        holders[0].stop()  # the other relay takes over
        for start in range(10, per_key, 3):
            stream.send(messages(range(start, min(start + 3, per_key))))
            time.sleep(0.2)
        assert wait_for(lambda: sum(map(len, seen().values())) == keys * per_key and _settled(stream), TIMEOUT)
    assert seen() == {f"k{k}": list(range(per_key)) for k in range(keys)}


def test_the_documented_receiving_service_runs_as_written(engine: sa.Engine, settings: Any,
                                                         stream: SenderStream) -> None:
    """docs/intake.md's first example (its stream, durable and server replaced by this test's)
    takes in what an outbox forwarder sends, re-sends included, and bills each order once."""
    from tests import docs_pages

    block = next(b for b in docs_pages.blocks(docs_pages.DOCS / "intake.md") if b.language == "python")
    source = (block.text.replace('"ORDERS"', repr(stream.name)).replace('durable="billing"', f"durable={stream.durable!r}")
              .replace('"nats://127.0.0.1:4222"', repr(NATS_URL)))
    assert source != block.text
    namespace: dict[str, Any] = {}
    exec(compile(source, str(block), "exec"), namespace)  # noqa: S102 - the documented module, as written
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE bills (order_id int PRIMARY KEY, cents int NOT NULL)")
    sent = [(json.dumps({"order_id": i, "total_cents": 100 * i}).encode(),
             {**forwarded(i)[1], "Outbox-Key": f"customer:{i % 3}"}) for i in range(1, 21)]
    stream.send(sent)
    stream.send(sent[:5])  # re-sent
    with running_relay(namespace["ob"], settings(poll_interval=0.2)):
        assert wait_for(lambda: _bills(engine) == {i: 100 * i for i in range(1, 21)} and _settled(stream), TIMEOUT)


def _bills(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT order_id, cents FROM bills")).all())


def test_the_intake_stops_at_its_backlog_and_the_broker_keeps_the_rest(engine: sa.Engine, settings: Any,
                                                                      stream: SenderStream) -> None:
    """max_backlog=30 with the only consumer paused: the intake takes in about the backlog (a
    batch more at most) and leaves the rest in the stream; resumed, everything comes in once."""
    from outbox import admin

    ob = Outbox()
    ob.intake("orders", source=stream.source(), batch=10, max_backlog=30)
    counting_subscriber(ob, engine)
    with engine.begin() as conn:
        admin.pause(conn, "book")
    stream.send([forwarded(i) for i in range(200)])
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(intake_rows(engine, "orders")) >= 30, TIMEOUT)
        time.sleep(3)  # three backlog readings: it stays stopped
        held = len(intake_rows(engine, "orders"))
        assert 20 <= held <= 30 and stream.consumer_state()[0] >= 160, held
        with engine.begin() as conn:
            admin.resume(conn, "book")
        assert wait_for(lambda: len(effects(engine)) == 200 and _settled(stream), TIMEOUT)
    assert set(effects(engine).values()) == {1}


def test_a_message_the_database_refuses_is_rejected_and_the_rest_taken_in(engine: sa.Engine, settings: Any,
                                                                          stream: SenderStream) -> None:
    """An application's trigger refuses one event (an error no check of outbox's foresees):
    that message is rejected with the database's error, acknowledged, and the others of its
    batch and after it are taken in (it was retried for ever, holding the stream)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("""
            CREATE FUNCTION refuse_13() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload->>'order_id' = '13' THEN RAISE EXCEPTION 'order 13 is refused'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_13 BEFORE INSERT ON outbox_events FOR EACH ROW EXECUTE FUNCTION refuse_13();
        """)
    ob = Outbox()
    ob.intake("orders", source=stream.source(), batch=10)
    counting_subscriber(ob, engine)
    stream.send([forwarded(i) for i in range(30)])
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 29 and _settled(stream), TIMEOUT)
    rows = {r["identity"]: r for r in intake_rows(engine, "orders")}
    assert "the database refused it" in rows["fwd:13"]["problem"] and "order 13 is refused" in rows["fwd:13"]["problem"]
    assert 13 not in effects(engine) and set(effects(engine).values()) == {1}


def test_slow_intake_functions_keep_an_ordered_intakes_lock(engine: sa.Engine, settings: Any,
                                                           stream: SenderStream) -> None:
    """The intake's functions run beside the lock's pings, not in their way: an identity
    function taking 0.3 s a message, batches of 10 (3 s each) under a 1 s lease still
    commit (the holder lost its lock batch after batch before)."""
    def slow_identity(message: Any) -> str:
        time.sleep(0.3)
        return str(message.headers["Outbox-Idempotency-Key"])

    ob = Outbox()
    ob.intake("orders", source=stream.source(), batch=10, ordered=True, identity=slow_identity)
    counting_subscriber(ob, engine)
    stream.send([forwarded(i) for i in range(20)])
    with running_relay(ob, settings(poll_interval=0.2, default_lease=1.0)) as relay:
        assert wait_for(lambda: len(effects(engine)) == 20 and _settled(stream), TIMEOUT)
        assert relay.intake is not None and relay.intake.stats["batches"] >= 2


def test_an_unreachable_server_fails_connect_within_its_timeout() -> None:
    from outbox.intake import SourceUnavailableError

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = JetStreamSource(f"nats://u:pw@127.0.0.1:{port}", stream="S", durable="d", connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(SourceUnavailableError) as refused:
        asyncio.run(source.connect())
    assert time.monotonic() - started < 3 and "pw" not in str(refused.value)
