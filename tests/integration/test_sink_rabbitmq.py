"""The RabbitMQ sink against a real broker (OUTBOX_TEST_AMQP_URL, else
amqp://guest:guest@127.0.0.1:5672/): what lands in the queue, and how unroutable messages,
a missing exchange, an oversized message, an outage and a closed port are reported.

Each test declares its own exchange and queue with unique names and deletes them; no
PostgreSQL is involved (messages are built directly). Skipped, with the reason, when
aio-pika is not installed or no broker answers.

RabbitMQ is at-least-once: a message sent twice is stored twice, both copies with the same
``message_id`` (consumers drop duplicates by it); the duplicate test pins that down.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from outbox.sinks import Delivered, Expired, Failed, Message, SinkUnavailableError, Unavailable
from tests.acceptance.brokers import AMQP_URL, rabbitmq_missing
from tests.acceptance.proxy import TcpProxy

URL = AMQP_URL
CREATED = datetime(2024, 5, 17, 9, 30, 15, 123456, tzinfo=UTC)


_why = rabbitmq_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


def sink(**options: Any) -> Any:
    from outbox.sinks.rabbitmq import RabbitMQ

    return RabbitMQ(options.pop("url", URL), **options)


def message(n: int, *, topic: str = "order.placed", key: str | None = "order:1", body: bytes | None = None,
            headers: dict[str, str] | None = None, consumer: str = "fwd") -> Message:
    return Message(job_id=1000 + n, event_id=n, consumer=consumer, topic=topic, key=key,
                   idempotency_key=f"{consumer}:{n}", created_at=CREATED + timedelta(seconds=n),
                   body=body if body is not None else b'{"n": %d, "text": "caf\xc3\xa9"}' % n,
                   headers=headers or {})


@asynccontextmanager
async def bound_queue(exchange_type: str = "direct", binding: str = "order.placed", declare_exchange: bool = True,
                      arguments: dict[str, Any] | None = None) -> AsyncIterator[tuple[Any, str, str]]:
    """A channel, a fresh exchange name and a queue bound to it with ``binding``; deleted after."""
    import aio_pika

    name = f"hmq-test-{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(URL, timeout=5)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, durable=False, auto_delete=False, arguments=arguments)
        if declare_exchange:
            exchange = await channel.declare_exchange(name, exchange_type, auto_delete=False)
            await queue.bind(exchange, binding)
        try:
            yield channel, name, name
        finally:
            await channel.queue_delete(name)
            await channel.exchange_delete(name)
    finally:
        await connection.close()


async def drain(channel: Any, queue_name: str, expected: int) -> list[Any]:
    """Every message in the queue, after checking it holds exactly ``expected``."""
    queue = await channel.declare_queue(queue_name, passive=True)
    assert queue.declaration_result.message_count == expected
    got = []
    while (incoming := await queue.get(no_ack=True, fail=False)) is not None:
        got.append(incoming)
    assert len(got) == expected
    return got


async def wait_for(condition: Callable[[], bool], what: str, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        await asyncio.sleep(0.05)


def run(coroutine: Awaitable[None]) -> None:
    asyncio.run(coroutine)  # type: ignore[arg-type]


def test_a_thousand_messages_land_with_their_properties_and_headers():
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            assert s.connected
            messages = [message(i, key=None if i % 2 else f"order:{i}",
                                headers={"traceparent": f"00-{i:032x}-01", "Outbox-Topic": "spoofed"})
                        for i in range(1000)]
            results = await s.send_many(messages, timeout=30)
            await s.close()
            assert results == [Delivered()] * 1000
            got = await drain(channel, queue, 1000)
            by_id = {m.message_id: m for m in got}
            assert len(by_id) == 1000
            for m in messages:
                incoming = by_id[m.idempotency_key]
                assert incoming.body == m.body
                assert incoming.content_type == "application/json"
                assert incoming.delivery_mode == 2  # persistent
                assert incoming.type == "order.placed"
                assert incoming.timestamp == m.created_at.replace(microsecond=0)  # AMQP: whole seconds
                expected = {"traceparent": f"00-{m.event_id:032x}-01", "Outbox-Event-Id": str(m.event_id),
                            "Outbox-Topic": "order.placed", "Outbox-Idempotency-Key": m.idempotency_key,
                            "Outbox-Created-At": m.created_at.isoformat()}
                if m.key is not None:
                    expected["Outbox-Key"] = m.key
                assert incoming.headers == expected

    run(main())


def test_sending_again_stores_duplicates_with_the_same_message_id():
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            messages = [message(i) for i in range(10)]
            assert await s.send_many(messages, timeout=10) == [Delivered()] * 10
            assert await s.send_many(messages, timeout=10) == [Delivered()] * 10
            await s.close()
            got = await drain(channel, queue, 20)
            ids = sorted(m.message_id for m in got)
            assert ids == sorted([m.idempotency_key for m in messages] * 2)

    run(main())


def test_an_unroutable_message_fails_and_is_retried_while_the_rest_are_delivered():
    async def main() -> None:
        async with bound_queue("topic", "order.#") as (channel, exchange, queue):
            s = sink(exchange=exchange, routing_key="{topic}")
            await s.connect()
            messages = [message(0), message(1, topic="invoice.sent"), message(2)]
            results = await s.send_many(messages, timeout=10)
            assert results[0] == results[2] == Delivered()
            failed = results[1]
            assert isinstance(failed, Failed) and not failed.permanent
            assert failed.error == (f"unroutable: no queue bound to exchange {exchange!r} "
                                    "for routing key 'invoice.sent' (NO_ROUTE)")
            # The channel stays usable after a return.
            assert await s.send_many([message(3)], timeout=10) == [Delivered()]
            await s.close()
            got = await drain(channel, queue, 3)
            assert sorted(m.message_id for m in got) == ["fwd:0", "fwd:2", "fwd:3"]

    run(main())


def test_a_message_the_broker_nacks_fails_and_is_retried():
    async def main() -> None:
        # A full queue that rejects publishes: RabbitMQ answers basic.nack.
        async with bound_queue(arguments={"x-max-length": 1, "x-overflow": "reject-publish"}) as (channel, exchange,
                                                                                                 queue):
            s = sink(exchange=exchange)
            await s.connect()
            results = await s.send_many([message(0), message(1), message(2)], timeout=10)
            await s.close()
            assert results[0] == Delivered()
            assert results[1:] == [Failed("broker nacked (Nack)")] * 2
            got = await drain(channel, queue, 1)
            assert got[0].message_id == "fwd:0"

    run(main())


def test_a_missing_exchange_makes_every_message_wait_and_the_next_batch_works_once_it_exists():
    async def main() -> None:
        async with bound_queue(declare_exchange=False) as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            results = await s.send_many([message(i) for i in range(5)], timeout=10)
            for result in results:
                # the destination is missing, not the message at fault: it waits, attempt not counted
                assert isinstance(result, Unavailable), result
                assert result.error == (f"channel closed by the broker: 404 NOT_FOUND - no exchange {exchange!r} "
                                        "in vhost '/'")
            declared = await channel.declare_exchange(exchange, "direct", auto_delete=False)
            q = await channel.declare_queue(queue, passive=True)
            await q.bind(declared, "order.placed")
            # The same sink: its channel, closed by the broker, has been reopened.
            assert await s.send_many([message(9)], timeout=10) == [Delivered()]
            assert s.connected
            await s.close()
            got = await drain(channel, queue, 1)
            assert got[0].message_id == "fwd:9"

    run(main())


def test_an_exchange_deleted_while_running_makes_the_batch_wait_and_the_sink_recovers_once_it_is_back():
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            assert await s.send_many([message(0)], timeout=10) == [Delivered()]
            await channel.exchange_delete(exchange)
            results = await s.send_many([message(i) for i in range(1, 51)], timeout=10)
            for result in results:
                # the destination is missing, not the message at fault: it waits, attempt not counted
                assert isinstance(result, Unavailable), result
                assert result.error == (f"channel closed by the broker: 404 NOT_FOUND - no exchange {exchange!r} "
                                        "in vhost '/'")
            # Known missing now: the next batch is checked, not published.
            await wait_for(lambda: s.connected, "the channel to be reopened")
            assert await s.send_many([message(60)], timeout=10) == [results[0]]
            declared = await channel.declare_exchange(exchange, "direct", auto_delete=False)
            q = await channel.declare_queue(queue, passive=True)
            await q.bind(declared, "order.placed")
            assert await s.send_many([message(61)], timeout=10) == [Delivered()]
            await s.close()
            got = await drain(channel, queue, 2)
            assert sorted(m.message_id for m in got) == ["fwd:0", "fwd:61"]

    run(main())


def _max_message_size(version: str) -> tuple[int | None, str]:
    """The broker's max_message_size and where it was read, from OUTBOX_TEST_AMQP_MAX_MESSAGE_SIZE,
    else the local server's rabbitmq.conf, else the default of its version."""
    if os.environ.get("OUTBOX_TEST_AMQP_MAX_MESSAGE_SIZE"):
        return int(os.environ["OUTBOX_TEST_AMQP_MAX_MESSAGE_SIZE"]), "OUTBOX_TEST_AMQP_MAX_MESSAGE_SIZE"
    conf = Path("/etc/rabbitmq/rabbitmq.conf")
    if urlsplit(URL).hostname in ("127.0.0.1", "localhost") and os.access(conf, os.R_OK):
        found = re.search(r"^\s*max_message_size\s*=\s*(\d+)", conf.read_text(), re.M)
        if found:
            return int(found.group(1)), str(conf)
        major, minor = (int(p) for p in version.split(".")[:2])
        if major >= 4:
            return 16 * 1024 * 1024, f"the default of RabbitMQ {version} ({conf} sets none)"
        if (major, minor) >= (3, 8):
            return 128 * 1024 * 1024, f"the default of RabbitMQ {version} ({conf} sets none)"
    return None, "unknown"


def test_a_message_over_the_servers_max_message_size_fails_permanently():
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            version = str(s._connection.transport.connection.server_properties.get("version", "0.0"))
            limit, source = _max_message_size(version)
            if limit is None or limit > 128 * 1024 * 1024:
                await s.close()
                pytest.skip(f"RabbitMQ {version}'s max_message_size is {limit or 'unknown'} ({source}): too large to "
                            "send past on a shared broker; set OUTBOX_TEST_AMQP_MAX_MESSAGE_SIZE for a smaller one")
            big = message(1, body=b"[" + b"0," * (limit // 2) + b"0]")
            assert len(big.body) > limit
            results = await s.send_many([message(0), big, message(2)], timeout=60)
            failed = results[1]
            assert isinstance(failed, Failed) and failed.permanent, failed
            assert failed.error.startswith("channel closed by the broker: 406 PRECONDITION_FAILED - message size")
            # Not at fault: confirmed before the close, or handed back uncounted.
            for other in (results[0], results[2]):
                assert isinstance(other, (Delivered, Unavailable)), other
            await wait_for(lambda: s.connected, "the channel to be reopened")
            assert await s.send_many([message(3)], timeout=10) == [Delivered()]
            await s.close()
            delivered = 1 + sum(isinstance(r, Delivered) for r in (results[0], results[2]))
            got = await drain(channel, queue, delivered)
            assert "fwd:3" in {m.message_id for m in got} and "fwd:1" not in {m.message_id for m in got}

    run(main())


def test_an_outage_makes_messages_unavailable_and_the_sink_reconnects_by_itself():
    async def main() -> None:
        parts = urlsplit(URL)
        proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5672))
        proxy.start()
        try:
            netloc = parts.netloc.rsplit("@", 1)
            host = f"127.0.0.1:{proxy.port}"
            proxied = urlunsplit((parts.scheme, f"{netloc[0]}@{host}" if len(netloc) == 2 else host, parts.path,
                                  "reconnect_interval=0.2", ""))
            async with bound_queue() as (channel, exchange, queue):
                s = sink(url=proxied, exchange=exchange)
                await s.connect()
                assert await s.send_many([message(0)], timeout=10) == [Delivered()]
                proxy.stop()
                await wait_for(lambda: not s.connected, "the sink to notice the outage")
                results = await s.send_many([message(1), message(2)], timeout=2)
                assert all(isinstance(r, Unavailable) for r in results), results
                proxy.start()
                await wait_for(lambda: s.connected, "the sink to reconnect")
                assert await s.send_many([message(3)], timeout=10) == [Delivered()]
                await s.close()
                assert not s.connected
                got = await drain(channel, queue, 2)
                assert sorted(m.message_id for m in got) == ["fwd:0", "fwd:3"]
        finally:
            proxy.stop()

    run(main())


def test_connecting_to_a_closed_port_raises_sink_unavailable_at_once():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free, and nothing listens once closed

    async def main() -> None:
        s = sink(url=f"amqp://guest:secret@127.0.0.1:{port}/", connect_timeout=60)
        with pytest.raises(SinkUnavailableError) as raised:
            await s.connect()
        # Refused, not timed out: the 60 s timeout did not run out.
        assert "timed out" not in str(raised.value)
        assert f"127.0.0.1:{port}" in str(raised.value) and "secret" not in str(raised.value)
        assert not s.connected
        await s.close()
        await s.close()

    run(main())


def test_close_is_safe_when_never_connected_and_sending_then_reports_unavailable():
    async def main() -> None:
        s = sink(exchange="whatever")
        await s.close()
        assert not s.connected
        assert await s.send_many([message(0)], timeout=1) == [Unavailable(f"not connected to RabbitMQ at "
                                                                          f"{s.describe()}")]

    run(main())


def test_a_routing_key_that_cannot_be_rendered_fails_permanently_without_stopping_the_batch():
    async def main() -> None:
        async with bound_queue("topic", "#") as (channel, exchange, queue):
            s = sink(exchange=exchange, routing_key="{topic}.{key}")
            await s.connect()
            results = await s.send_many([message(0, key=None), message(1, key="k" * 300), message(2, key="a"),
                                         message(3, key="b", headers={"CC": "x"}), message(4, key="c")],
                                        timeout=10)
            await s.close()
            assert isinstance(results[0], Failed) and results[0].permanent and "has no key" in results[0].error
            assert isinstance(results[1], Failed) and results[1].permanent and "255 bytes" in results[1].error
            assert results[2] == Delivered()
            # CC is read by the broker (a string closes the channel with 406 and fails the whole
            # batch): refused alone, before sending; the message after it is delivered
            assert isinstance(results[3], Failed) and results[3].permanent and "'CC'" in results[3].error
            assert results[4] == Delivered()
            got = await drain(channel, queue, 2)
            assert sorted(m.message_id for m in got) == ["fwd:2", "fwd:4"]

    run(main())


def test_a_message_past_its_deadline_is_not_published_and_answers_are_told_as_they_arrive():
    """Issue 26, item 2: a message whose deadline (its claim's lease, less a margin) has
    passed is not handed to the broker (``Expired``); item 9 (a): each broker answer is told
    to ``answered`` as it arrives, before the batch's call returns."""
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            told: list[tuple[int, Any]] = []
            late = replace(message(2), deadline=time.monotonic() - 1)
            results = await s.send_many([message(0), message(1), late, message(3)], timeout=10,
                                        answered=lambda i, r: told.append((i, r)))
            told_when_returned = list(told)
            await s.close()
            assert results == [Delivered(), Delivered(), Expired("not sent: its deadline passed before the publish"),
                               Delivered()]
            assert sorted(told_when_returned) == [(0, Delivered()), (1, Delivered()), (3, Delivered())]
            got = await drain(channel, queue, 3)
            assert sorted(m.message_id for m in got) == ["fwd:0", "fwd:1", "fwd:3"]

    run(main())


def test_batches_in_flight_at_once_are_answered_each_on_its_own():
    """Two send_many calls in flight at once on one sink (the forwarder no longer waits for
    one batch before it sends the next): both delivered, every message once."""
    async def main() -> None:
        async with bound_queue() as (channel, exchange, queue):
            s = sink(exchange=exchange)
            await s.connect()
            first, second = await asyncio.gather(s.send_many([message(i) for i in range(50)], timeout=10),
                                                 s.send_many([message(i) for i in range(50, 80)], timeout=10))
            await s.close()
            assert first == [Delivered()] * 50 and second == [Delivered()] * 30
            got = await drain(channel, queue, 80)
            assert sorted(m.message_id for m in got) == sorted(f"fwd:{i}" for i in range(80))

    run(main())
