"""The JetStream sink against a real NATS server (OUTBOX_TEST_NATS_URL, default
nats://127.0.0.1:4222), skipped with the reason when nats-py is missing or the server does
not answer. Each test makes its own stream (unique name, subjects ``<name>.>``, a duplicate
window) and deletes it. No PostgreSQL: the messages are built directly."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

import pytest

from outbox.sinks import Delivered, Expired, Failed, Message, SinkUnavailableError, Unavailable
from tests.acceptance.brokers import NATS_URL, nats_missing
from tests.acceptance.proxy import TcpProxy

nats = pytest.importorskip("nats", reason="nats-py is not installed (pip install 'outbox-relay[nats]')")

from outbox.sinks.jetstream import JetStream  # noqa: E402 (after the skip)

_why = nats_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

CREATED = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))


def message(i: int, *, topic: str = "order.placed", key: str | None = "order:{i}", body: bytes | None = None,
            headers: dict[str, str] | None = None, consumer: str = "fwd") -> Message:
    return Message(job_id=1000 + i, event_id=i, consumer=consumer, topic=topic,
                   key=None if key is None else key.format(i=i), idempotency_key=f"{consumer}:{i}",
                   created_at=CREATED, body=body if body is not None else b'{"n": %d, "s": "\xc3\xa9"}' % i,
                   headers=headers if headers is not None else {"trace": f"t-{i}"})


def run(test: Callable[[Any, str], Awaitable[None]], **stream: Any) -> None:
    """Runs ``test(js, prefix)`` with a stream of its own on subjects ``<prefix>.>``, deleted after."""

    async def main() -> None:
        prefix = "t" + uuid.uuid4().hex[:12]
        nc = await nats.connect(NATS_URL)
        js = nc.jetstream()
        await js.add_stream(name=prefix, subjects=[f"{prefix}.>"], duplicate_window=stream.pop("window", 120.0),
                            **stream)
        try:
            await test(js, prefix)
        finally:
            await js.delete_stream(prefix)
            await nc.close()

    asyncio.run(main())


async def ignore(msg: Any) -> None:
    """A core subscriber's callback that never replies (the publisher's PubAck never comes)."""


async def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {seconds} s"
        await asyncio.sleep(0.02)


async def stored(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


def test_a_thousand_messages_are_stored_once_each_with_their_headers_and_resent_as_duplicates():
    async def test(js: Any, prefix: str) -> None:
        sink = JetStream(NATS_URL, subject=prefix + ".{topic}", stream=prefix, max_pending=64)
        await sink.connect()
        try:
            assert sink.connected
            msgs = [message(i, key=None if i % 10 == 0 else "order:{i}",
                            headers={"trace": f"t-{i}", "Outbox-Topic": "forged", "nats-msg-id": "forged"})
                    for i in range(1, 1001)]
            # 1,000 messages through a pending window of 64: the sends past it wait for PubAcks
            assert await sink.send_many(msgs, 30) == [Delivered(duplicate=False)] * 1000
            assert await stored(js, prefix) == 1000
            by_id = {m.idempotency_key: m for m in msgs}
            for seq in range(1, 1001):
                got = await js.get_msg(prefix, seq)
                sent = by_id.pop(got.headers["Nats-Msg-Id"])
                assert got.subject == f"{prefix}.order.placed"
                assert got.data == sent.body
                expected = {"Nats-Msg-Id": sent.idempotency_key, "Nats-Expected-Stream": prefix,
                            "Outbox-Event-Id": str(sent.event_id), "Outbox-Topic": "order.placed",
                            "Outbox-Idempotency-Key": sent.idempotency_key,
                            "Outbox-Created-At": "2024-05-06T05:08:09.123456+00:00", "trace": f"t-{sent.event_id}"}
                if sent.key is not None:
                    expected["Outbox-Key"] = sent.key
                assert got.headers == expected, seq
            assert by_id == {}

            assert await sink.send_many(msgs, 30) == [Delivered(duplicate=True)] * 1000
            assert await stored(js, prefix) == 1000
        finally:
            await sink.close()
        assert not sink.connected

    run(test)


def test_messages_no_retry_can_deliver_fail_permanently_and_the_rest_of_the_batch_is_delivered():
    async def test(js: Any, prefix: str) -> None:
        sink = JetStream(NATS_URL, subject=prefix + ".{topic}.{key}")
        await sink.connect()
        try:
            probe = await nats.connect(NATS_URL)
            limit = probe.max_payload  # the server's
            await probe.close()
            batch = [message(1), message(2, key=None), message(3, body=b"x" * limit), message(4),
                     message(5, key="k" * 4000), message(6, headers={"bad header": "v"}),
                     message(7, headers={"multi": "line\nbreak"}), message(8, key="a b"), message(9, key="a.*"),
                     message(10, key=""), message(11, headers={"Nats-Rollup": "all"}),
                     message(12, headers={"nats-expected-last-sequence": "3"})]
            results = await sink.send_many(batch, 10)
            assert results[0] == results[3] == Delivered()
            failed = {i + 1: r for i, r in enumerate(results) if i not in (0, 3)}
            assert all(isinstance(r, Failed) and r.permanent for r in failed.values()), failed
            reasons = {i: r.error for i, r in failed.items() if isinstance(r, Failed)}
            assert "has no key" in reasons[2] and "{key}" in reasons[2]
            assert f"max_payload of {limit} bytes" in reasons[3] and "body " + str(limit) in reasons[3]
            assert "over the 3840-byte limit" in reasons[5]
            assert "'bad header'" in reasons[6] and "'multi'" in reasons[7]
            assert "whitespace" in reasons[8] and "wildcard" in reasons[9] and "empty token" in reasons[10]
            # an event's own NATS control header would steer the stream (Nats-Rollup purges it)
            assert "control header" in reasons[11] and "'Nats-Rollup'" in reasons[11]
            assert "control header" in reasons[12]
            assert sink.connected  # nothing oversized or malformed reached the server
            assert await stored(js, prefix) == 2

            other = JetStream(NATS_URL, subject="nobody" + prefix + ".{topic}")
            await other.connect()
            try:
                assert await other.send_many([message(1)], 5) == [
                    Failed(f"no JetStream stream binds subject nobody{prefix}.order.placed", permanent=True)]
            finally:
                await other.close()
        finally:
            await sink.close()

    run(test)


def test_jetstream_api_errors_map_to_failures_permanent_when_retrying_cannot_help():
    async def test(js: Any, prefix: str) -> None:
        wrong = JetStream(NATS_URL, subject=prefix + ".{topic}", stream="not" + prefix)
        full = JetStream(NATS_URL, subject=prefix + ".{topic}")
        await wrong.connect()
        await full.connect()
        try:
            [r] = await wrong.send_many([message(1)], 5)
            assert isinstance(r, Failed) and r.permanent and "10060" in r.error and "not" + prefix in r.error
            big = await full.send_many([message(2, body=b"y" * 300)], 5)
            assert isinstance(big[0], Failed) and big[0].permanent and "10054" in big[0].error
            assert await full.send_many([message(3), message(4)], 5) == [Delivered(), Delivered()]
            [r] = await full.send_many([message(5)], 5)  # max_msgs 2 and discard new: may clear, retried
            assert isinstance(r, Failed) and not r.permanent and "10077" in r.error
            assert await stored(js, prefix) == 2
        finally:
            await wrong.close()
            await full.close()

    run(test, max_msg_size=256, max_msgs=2, discard="new")


def test_an_unanswered_publish_times_out_retryable_and_leaves_nothing_in_the_way_of_the_next_batch():
    async def test(js: Any, prefix: str) -> None:
        silent = await nats.connect(NATS_URL)  # a core subscriber: a responder that never answers
        await silent.subscribe(f"silent{prefix}.>", cb=ignore)
        await silent.flush()
        mute = JetStream(NATS_URL, subject=f"silent{prefix}" + ".{topic}", max_pending=5)
        await mute.connect()
        try:
            results = await mute.send_many([message(i) for i in range(5)], 0.5)
            assert results == [Failed("no PubAck within 0.5 s", unanswered=True)] * 5
            # the same sink (window of 5) now reaches the stream: the five unanswered
            # publishes do not hold the window
            mute.subject = type(mute.subject)(prefix + ".{topic}", "subject")
            assert await mute.send_many([message(i) for i in range(10)], 10) == [Delivered()] * 10
        finally:
            await mute.close()
            await silent.close()

    run(test)


def test_an_outage_makes_sends_unavailable_and_after_reconnecting_resends_are_deduplicated():
    async def test(js: Any, prefix: str) -> None:
        parts = urlsplit(NATS_URL)
        proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 4222))
        proxy.start()
        sink = JetStream(f"nats://127.0.0.1:{proxy.port}", subject=prefix + ".{topic}", connect_timeout=2)
        await sink.connect()
        try:
            first = [message(i) for i in range(20)]
            assert await sink.send_many(first[:10], 10) == [Delivered()] * 10

            proxy.stop()
            await wait_for(lambda: not sink.connected, "disconnected")
            results = await sink.send_many(first, 5)
            assert len(results) == 20 and all(isinstance(r, Unavailable) for r in results), results

            proxy.start()
            await wait_for(lambda: sink.connected, "reconnected")
            results = await sink.send_many(first, 10)
            assert results == [Delivered(duplicate=True)] * 10 + [Delivered()] * 10
            assert await stored(js, prefix) == 20
        finally:
            proxy.stop()
            await sink.close()

    run(test)


def test_a_batch_cut_off_by_the_outage_is_unavailable_not_failed():
    async def test(js: Any, prefix: str) -> None:
        parts = urlsplit(NATS_URL)
        proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 4222))
        proxy.start()
        silent = await nats.connect(NATS_URL)  # holds the PubAcks back: the cut comes while they are awaited
        await silent.subscribe(f"silent{prefix}.>", cb=ignore)
        await silent.flush()
        sink = JetStream(f"nats://127.0.0.1:{proxy.port}", subject=f"silent{prefix}" + ".{topic}")
        await sink.connect()
        try:
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, proxy.stop)
            # the batch's timeout is 600 s: the disconnection, not the timeout, ends the wait
            results = await asyncio.wait_for(sink.send_many([message(i) for i in range(5)], 600), 60)
            assert all(isinstance(r, Unavailable) for r in results), results
        finally:
            proxy.stop()
            await sink.close()
            await silent.close()

    run(test)


def test_an_outage_while_a_send_waits_for_room_in_the_window_ends_the_batch_unavailable():
    async def test(js: Any, prefix: str) -> None:
        parts = urlsplit(NATS_URL)
        proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 4222))
        proxy.start()
        silent = await nats.connect(NATS_URL)  # never answers: the second send waits for room
        await silent.subscribe(f"silent{prefix}.>", cb=ignore)
        await silent.flush()
        sink = JetStream(f"nats://127.0.0.1:{proxy.port}", subject=f"silent{prefix}" + ".{topic}", max_pending=1)
        await sink.connect()
        try:
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, proxy.stop)
            # the batch's timeout is 600 s: the disconnection ends the wait for room too
            results = await asyncio.wait_for(sink.send_many([message(i) for i in range(5)], 600), 60)
            assert results == [Unavailable("the connection to NATS was lost before the PubAck")] * 5, results
        finally:
            proxy.stop()
            await sink.close()
            await silent.close()

    run(test)


def test_connecting_to_a_closed_port_raises_sink_unavailable_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    sink = JetStream(f"nats://user:secret@127.0.0.1:{port}", connect_timeout=0.5)

    async def main() -> None:
        started = time.monotonic()
        with pytest.raises(SinkUnavailableError) as caught:
            await sink.connect()
        assert time.monotonic() - started < 10
        assert f"nats://user:***@127.0.0.1:{port}" in str(caught.value) and "secret" not in str(caught.value)
        assert not sink.connected
        assert await sink.send_many([message(1)], 1) == [Unavailable("not connected to NATS")]
        await sink.close()  # safe when never connected

    asyncio.run(main())



def test_a_message_past_its_deadline_is_not_published_and_answers_are_told_as_they_arrive():
    """Issue 26, item 2: a message whose deadline (its claim's lease, less a margin) has
    passed is not handed to the server (``Expired``); item 9 (a): each PubAck is told to
    ``answered`` as it arrives, before the batch's call returns."""
    async def test(js: Any, prefix: str) -> None:
        sink = JetStream(NATS_URL, subject=prefix + ".{topic}")
        await sink.connect()
        try:
            told: list[tuple[int, Any]] = []
            batch = [message(0), message(1), replace(message(2), deadline=time.monotonic() - 1), message(3)]
            results = await sink.send_many(batch, 10, answered=lambda i, r: told.append((i, r)))
            told_when_returned = list(told)
        finally:
            await sink.close()
        assert results == [Delivered(), Delivered(), Expired("not sent: its deadline passed before the publish"),
                           Delivered()]
        assert sorted(told_when_returned) == [(0, Delivered()), (1, Delivered()), (3, Delivered())]
        assert await stored(js, prefix) == 3

    run(test)


def test_a_send_waiting_for_room_is_not_published_once_its_deadline_passes():
    """max_pending 1 and a publish nobody answers: the next message waits for room; its
    deadline passes first, so it is not sent at all (``Expired``, not a failed attempt), and
    the stream stores nothing of it."""
    async def test(js: Any, prefix: str) -> None:
        silent = await nats.connect(NATS_URL)
        await silent.subscribe(f"silent{prefix}.>", cb=ignore)
        await silent.flush()
        sink = JetStream(NATS_URL, subject="{topic}", max_pending=1)
        await sink.connect()
        try:
            waiting = replace(message(1, topic=f"{prefix}.x"), deadline=time.monotonic() + 0.5)
            results = await sink.send_many([message(0, topic=f"silent{prefix}.x"), waiting], 3)
        finally:
            await sink.close()
            await silent.close()
        assert results == [Failed("no PubAck within 3 s", unanswered=True),
                           Expired("not sent: its deadline passed before the publish")]
        assert await stored(js, prefix) == 0

    run(test)


def test_batches_in_flight_at_once_are_answered_each_on_its_own():
    """Two send_many calls at once on one sink: one waits for a PubAck nobody sends, the
    other is answered and returns meanwhile (a batch no longer waits behind another)."""
    async def test(js: Any, prefix: str) -> None:
        silent = await nats.connect(NATS_URL)
        await silent.subscribe(f"silent{prefix}.>", cb=ignore)
        await silent.flush()
        sink = JetStream(NATS_URL, subject="{topic}")
        await sink.connect()
        try:
            mute = asyncio.ensure_future(sink.send_many([message(0, topic=f"silent{prefix}.x")], 5))
            answered = await sink.send_many([message(i, topic=f"{prefix}.x") for i in range(1, 11)], 5)
            assert not mute.done()
            assert answered == [Delivered()] * 10
            assert await mute == [Failed("no PubAck within 5 s", unanswered=True)]
        finally:
            await sink.close()
            await silent.close()
        assert await stored(js, prefix) == 10

    run(test)
