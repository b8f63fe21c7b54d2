"""Forwarders end to end on RabbitMQ (architecture notes, "Forwarding"): a relay on a real
PostgreSQL forwarding to a real broker (OUTBOX_TEST_AMQP_URL, default
amqp://guest:guest@127.0.0.1:5672/). 1,000 events reach a bound queue once each with their
properties; an unroutable message is a failed attempt, retried, never dropped; an ordered
forwarder keeps each key's order through such a retry. Skipped with the reason when
aio-pika is missing or no broker answers. Each test declares its own exchange and queue
and deletes them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox, publish_many
from outbox.testing import wait_for
from tests.acceptance.brokers import AMQP_URL, rabbitmq_missing

from .helpers import running_relay, statuses

URL = AMQP_URL
TIMEOUT = 90.0


_why = rabbitmq_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


class Broker:
    """An exchange (direct) and a queue of the test's own, bound by the routing keys given;
    :meth:`drain` returns every message in the queue, in queue order."""

    def __init__(self, bindings: list[str]) -> None:
        suffix = uuid.uuid4().hex[:12]
        self.exchange, self.queue = f"ex-{suffix}", f"q-{suffix}"
        asyncio.run(self._setup(bindings))

    async def _channel(self) -> tuple[Any, Any]:
        import aio_pika

        connection = await aio_pika.connect(URL)
        return connection, await connection.channel()

    async def _setup(self, bindings: list[str]) -> None:
        connection, channel = await self._channel()
        try:
            exchange = await channel.declare_exchange(self.exchange, "direct")
            queue = await channel.declare_queue(self.queue)
            for key in bindings:
                await queue.bind(exchange, key)
        finally:
            await connection.close()

    def bind(self, key: str) -> None:
        async def bind() -> None:
            connection, channel = await self._channel()
            try:
                queue = await channel.get_queue(self.queue)
                await queue.bind(self.exchange, key)
            finally:
                await connection.close()

        asyncio.run(bind())

    def drain(self) -> list[Any]:
        async def drain() -> list[Any]:
            connection, channel = await self._channel()
            got = []
            try:
                queue = await channel.get_queue(self.queue)
                while (message := await queue.get(fail=False, no_ack=True)) is not None:
                    got.append(message)
            finally:
                await connection.close()
            return got

        return list(asyncio.run(drain()))

    def delete(self) -> None:
        async def delete() -> None:
            connection, channel = await self._channel()
            try:
                await channel.queue_delete(self.queue)
                await channel.exchange_delete(self.exchange)
            finally:
                await connection.close()

        asyncio.run(delete())


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(["order.placed", "order.paid"])
    yield b
    b.delete()



def test_a_thousand_events_reach_the_bound_queue_once_each_with_their_properties(engine, settings, broker):
    from outbox import RabbitMQ

    ob = Outbox()
    ob.forward(["order.placed", "order.paid"], to=RabbitMQ(URL, exchange=broker.exchange, routing_key="{topic}"),
               consumer="to_rabbit")
    with Session(engine) as s, s.begin():
        ids = publish_many(s, [{"topic": "order.placed" if i % 3 else "order.paid", "key": f"order:{i}",
                                "payload": {"n": i, "note": "\u00e9t\u00e9", "x": [1.5, None, True]},
                                "headers": {"traceparent": f"00-{i:032x}-{i:016x}-01"}} for i in range(1000)])
    with running_relay(ob, settings(claim_batch=100, prefetch=100)):
        wait_for(lambda: statuses(engine, "to_rabbit").get("done") == 1000, timeout=TIMEOUT, what="1,000 jobs done")
    with engine.connect() as c:
        events = {r.id: r for r in c.execute(sa.text("SELECT id, topic, key, payload::text AS body FROM outbox_events"))}
    messages = broker.drain()
    assert len(messages) == 1000
    by_event = {int(m.headers["Outbox-Event-Id"]): m for m in messages}
    assert sorted(by_event) == sorted(ids)
    for event_id, m in by_event.items():
        e = events[event_id]
        assert m.body == e.body.encode()  # the stored JSON text, byte for byte
        assert m.message_id == f"to_rabbit:{event_id}" and m.type == e.topic and m.routing_key == e.topic
        assert m.delivery_mode == 2 and m.content_type == "application/json"
        assert m.headers["Outbox-Key"] == e.key
        n = int(e.key.split(":")[1])
        assert m.headers["traceparent"] == f"00-{n:032x}-{n:016x}-01"


def test_an_unroutable_message_is_retried_not_dropped_and_an_ordered_key_waits_for_it(engine, settings):
    """Routing key ``{key}``: key ``k1`` has no binding at first, so its first message comes
    back unroutable (``mandatory``): a failed attempt, retried with backoff. The forwarder is
    ordered, so ``k1``'s later events wait behind it while ``k0`` goes on; once ``k1`` is
    bound, its events arrive in their commit order."""
    from outbox import RabbitMQ

    broker = Broker(["k0"])
    try:
        ob = Outbox()
        ob.forward("t", to=RabbitMQ(URL, exchange=broker.exchange, routing_key="{key}"), consumer="fwd",
                   ordered=True, max_attempts=1000)
        with Session(engine) as s, s.begin():
            publish_many(s, [{"topic": "t", "key": f"k{i % 2}", "payload": {"n": i}} for i in range(20)])
        with running_relay(ob, settings(backoff_base=0.05, backoff_cap=0.3)):
            wait_for(lambda: statuses(engine, "fwd").get("done") == 10, timeout=TIMEOUT, what="k0's 10 done")

            def k1_retried() -> bool:
                with engine.connect() as c:
                    return bool(c.execute(sa.text(
                        "SELECT attempts >= 3 AND last_error LIKE '%NO_ROUTE%' FROM outbox_jobs j"
                        " JOIN outbox_events e ON e.id = j.event_id WHERE e.key = 'k1' ORDER BY e.id LIMIT 1")).scalar())

            wait_for(k1_retried, timeout=TIMEOUT, what="k1's first job retried as unroutable")
            seen = statuses(engine, "fwd")  # read once: the head moves between ready and running
            assert seen in ({"done": 10, "ready": 1, "pending": 9}, {"done": 10, "running": 1, "pending": 9}), \
                seen
            broker.bind("k1")
            wait_for(lambda: statuses(engine, "fwd").get("done") == 20, timeout=TIMEOUT, what="all 20 done")
        messages = broker.drain()
        order = {k: [int(m.headers["Outbox-Event-Id"]) for m in messages if m.headers["Outbox-Key"] == k]
                 for k in ("k0", "k1")}
        assert len(order["k0"]) == 10 and len(order["k1"]) == 10  # none dropped, none twice
        assert order["k0"] == sorted(order["k0"]) and order["k1"] == sorted(order["k1"])  # each key in order
    finally:
        broker.delete()
