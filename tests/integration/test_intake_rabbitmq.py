"""Intake from a RabbitMQ queue on a real RabbitMQ (OUTBOX_TEST_AMQP_URL, default
amqp://guest:guest@127.0.0.1:5672/) into a real PostgreSQL: one effect per message the
sender committed, through re-sends, two relays on one queue, a relay that dies between its
commit and its acks (RabbitMQ requeues, the copies are dropped), and poison messages. Each
test declares its own exchange and queue and deletes them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.intake import SourceUnavailableError
from outbox.testing import wait_for
from tests.acceptance.brokers import AMQP_URL, BoundQueue, rabbitmq_missing

from .helpers import running_relay, running_relays
from .intake_helpers import counting_subscriber, effects, forwarded, intake_rows

aio_pika = pytest.importorskip("aio_pika", reason="aio-pika is not installed (pip install 'outbox-relay[rabbitmq]')")

from outbox.intake.rabbitmq import RabbitMQSource  # noqa: E402 (after the skip)

_why = rabbitmq_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

TIMEOUT = 60.0


@pytest.fixture
def queue() -> Iterator[BoundQueue]:
    q = BoundQueue()
    yield q
    q.delete()


def send(queue: BoundQueue, messages: list[tuple[bytes, dict[str, str]]], routing_key: str = "orders",
         message_id: bool = True) -> None:
    """Publish each (body, headers) to the queue's exchange, as outbox's RabbitMQ sink does
    (message_id = the idempotency key) unless ``message_id`` is False."""
    async def publish(channel: Any) -> None:
        exchange = await channel.get_exchange(queue.exchange)
        for body, headers in messages:
            await exchange.publish(aio_pika.Message(body, headers=headers, message_id=headers.get(
                "Outbox-Idempotency-Key") if message_id else None), routing_key=routing_key)

    asyncio.run(BoundQueue._call(publish))


def source(queue: BoundQueue, **options: Any) -> RabbitMQSource:
    return RabbitMQSource(AMQP_URL, queue=queue.name, **options)


def test_each_committed_message_has_one_effect_through_resends_and_two_relays(engine: sa.Engine, settings: Any,
                                                                             queue: BoundQueue) -> None:
    ob = Outbox()
    ob.intake("orders", source=source(queue, prefetch=30), batch=20)
    counting_subscriber(ob, engine)
    sent = [forwarded(i) for i in range(200)]
    send(queue, sent)
    send(queue, sent[:40])  # the sender re-sends after its own crash
    with running_relays(2, ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 200 and queue.count() == 0, TIMEOUT)
    assert set(effects(engine).values()) == {1}
    assert len(intake_rows(engine, "orders")) == 200


def test_a_relay_that_dies_between_commit_and_ack_gets_the_copies_and_drops_them(
        engine: sa.Engine, settings: Any, queue: BoundQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two batches commit, then the connection goes before their acks (as when the
    relay is killed there): RabbitMQ requeues them, delivers them again, and they are dropped."""
    ob = Outbox()
    ob.intake("orders", source=source(queue, prefetch=10), batch=10)
    counting_subscriber(ob, engine)
    real_ack = RabbitMQSource.ack
    crashes: list[int] = []

    async def ack(self: RabbitMQSource, received: Any) -> None:
        if len(crashes) < 2:
            crashes.append(len(received))
            await self.close()
            raise SourceUnavailableError("the relay died before its acks")
        await real_ack(self, received)

    monkeypatch.setattr(RabbitMQSource, "ack", ack)
    send(queue, [forwarded(i) for i in range(50)])
    with running_relay(ob, settings(poll_interval=0.2)) as relay:
        assert wait_for(lambda: len(effects(engine)) == 50 and queue.count() == 0, TIMEOUT)
        assert relay.intake is not None and relay.intake.stats["duplicates"] >= sum(crashes) > 0
    assert set(effects(engine).values()) == {1}


def test_poison_messages_are_rejected_and_acknowledged(engine: sa.Engine, settings: Any, queue: BoundQueue) -> None:
    """A body that is not JSON and a routing key the topic mapping lacks are rejected (kept
    with their bytes) and acknowledged; the good message beside them is taken in. (A message
    without ids is not sent here: aio-pika gives every message it publishes a message_id.)"""
    ob = Outbox()
    ob.intake("orders", source=source(queue), topic={"orders": "order.placed"})
    counting_subscriber(ob, engine)
    send(queue, [(b"<xml/>", {"Outbox-Idempotency-Key": "p:1"}), forwarded(1)])
    send(queue, [forwarded(2)], routing_key="elsewhere")
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 1 and queue.count() == 0
                        and len(intake_rows(engine, "orders")) == 3, TIMEOUT)
    rows = {r["identity"]: r for r in intake_rows(engine, "orders")}
    assert "not UTF-8 JSON" in rows["p:1"]["problem"] and rows["p:1"]["body"] == b"<xml/>"
    assert "no topic for subject 'elsewhere'" in rows["fwd:2"]["problem"]
    assert rows["fwd:2"]["headers"]["Outbox-Event-Id"] == "2" and rows["fwd:1"]["event_id"] is not None


def test_the_body_hash_identity_takes_messages_without_ids_once(engine: sa.Engine, settings: Any,
                                                               queue: BoundQueue) -> None:
    from outbox.intake import body_hash

    ob = Outbox()
    ob.intake("orders", source=source(queue), topic="order.placed", identity=body_hash)
    counting_subscriber(ob, engine)
    plain = [(f'{{"order_id": {i}}}'.encode(), {}) for i in range(20)]
    send(queue, plain + plain[:5], message_id=False)
    with running_relay(ob, settings(poll_interval=0.2)):
        assert wait_for(lambda: len(effects(engine)) == 20 and queue.count() == 0, TIMEOUT)
    assert set(effects(engine).values()) == {1}
    assert all(r["identity"].startswith("sha256:") for r in intake_rows(engine, "orders"))


def test_an_ordered_intake_is_taken_in_by_one_relay_at_a_time_in_queue_order(engine: sa.Engine, settings: Any,
                                                                          queue: BoundQueue) -> None:
    """RabbitMQ spreads a queue's messages over its consumers; an ordered intake has one
    consumer across relays (the others stand by, unconnected), so each key's events are
    written, and handled by an ordered subscriber, in queue order."""
    ob = Outbox()
    ob.intake("orders", source=source(queue, prefetch=5), batch=5, ordered=True)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE seen (n serial PRIMARY KEY, key text NOT NULL, seq int NOT NULL)")

    @ob.subscriber("order.placed", consumer="log", transactional=True, ordered=True)
    def log_it(job: Any, session: Any) -> None:
        session.execute(sa.text("INSERT INTO seen (key, seq) VALUES (:k, :s)"), {"k": job.key, "s": job.payload["seq"]})

    keys, per_key = 5, 30
    with running_relays(3, ob, settings(poll_interval=0.2)) as relays:
        send(queue, [(json.dumps({"seq": s}).encode(), {"Outbox-Idempotency-Key": f"s:{k}:{s}",
                                                         "Outbox-Topic": "order.placed", "Outbox-Key": f"k{k}"})
                     for s in range(per_key) for k in range(keys)])
        with engine.connect() as conn:
            def count() -> int:
                return int(conn.execute(sa.text("SELECT count(*) FROM seen")).scalar_one())

            assert wait_for(lambda: count() == keys * per_key and queue.count() == 0, TIMEOUT)
        assert sum(1 for r in relays if r.intake is not None and r.intake.stats["batches"] > 0) == 1
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, seq FROM seen ORDER BY n")).all()
    for k in range(keys):
        assert [seq for key, seq in rows if key == f"k{k}"] == list(range(per_key))


def test_a_new_holder_waits_until_the_old_holders_deliveries_are_requeued(queue: BoundQueue) -> None:
    """settle(): while another consumer (a paused holder) holds deliveries, the new holder
    does not consume; once that consumer's connection is gone, the requeued messages come
    first, in their places (a holder paused past its lease kept its prefetch, and the next
    one consumed the messages behind them first)."""
    send(queue, [forwarded(i) for i in range(6)])

    async def scenario() -> list[str]:
        old = await aio_pika.connect(AMQP_URL)
        channel = await old.channel()
        await channel.set_qos(prefetch_count=3)
        held: asyncio.Queue[Any] = asyncio.Queue()
        await (await channel.get_queue(queue.name)).consume(held.put)  # holds 3, never acks
        for _ in range(3):
            await asyncio.wait_for(held.get(), 10)
        fresh = source(queue, heartbeat=5)
        await fresh.connect()
        settling = asyncio.create_task(fresh.settle())
        await asyncio.sleep(1.5)
        assert not settling.done()  # the old holder is still there
        await old.close()  # its connection gone: RabbitMQ requeues its three
        await asyncio.wait_for(settling, 10)
        got: list[str] = []
        while len(got) < 6:
            got += [m.headers["Outbox-Idempotency-Key"] for m in await fresh.fetch(10, 2)]
        await fresh.close()
        return got

    assert asyncio.run(scenario()) == [f"fwd:{i}" for i in range(6)]
