"""Brokers for the process-level forwarding tests: a JetStream stream and a RabbitMQ
exchange with a queue bound to it, each of the test's own (unique names, deleted after),
read back from a synchronous test.

Where the brokers are: ``OUTBOX_TEST_NATS_URL`` (default ``nats://127.0.0.1:4222``) and
``OUTBOX_TEST_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``), as in the
integration tests. :func:`nats_missing` and :func:`rabbitmq_missing` say why a broker cannot
be used here (client library not installed, nothing answering), or None: a test skips with
that reason, and the fault suite leaves its forwarder out.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

NATS_URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
AMQP_URL = os.environ.get("OUTBOX_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _unreachable(url: str, default_port: int, env: str) -> str | None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc}); set {env}"
    return None


def nats_missing() -> str | None:
    """Why JetStream cannot be used here, or None."""
    if importlib.util.find_spec("nats") is None:
        return "nats-py is not installed (pip install 'outbox-relay[nats]')"
    why = _unreachable(NATS_URL, 4222, "OUTBOX_TEST_NATS_URL")
    return f"NATS: {why}" if why else None


def rabbitmq_missing() -> str | None:
    """Why RabbitMQ cannot be used here, or None."""
    if importlib.util.find_spec("aio_pika") is None:
        return "aio-pika is not installed (pip install 'outbox-relay[rabbitmq]')"
    why = _unreachable(AMQP_URL, 5672, "OUTBOX_TEST_AMQP_URL")
    return f"RabbitMQ: {why}" if why else None


@dataclass(frozen=True)
class Stored:
    """One message as the broker holds it: body, headers (strings), and the broker's message id
    (JetStream's ``Nats-Msg-Id`` header, RabbitMQ's ``message_id`` property)."""

    body: bytes
    headers: dict[str, str]
    message_id: str | None


class Stream:
    """A JetStream stream of the test's own, binding the subjects ``<name>.>`` with a two-minute
    duplicate window; created on construction, removed by :meth:`delete`."""

    def __init__(self, prefix: str = "t") -> None:
        self.name = prefix + uuid.uuid4().hex[:12]
        self.subject = self.name + ".{topic}"
        asyncio.run(self._call(lambda js: js.add_stream(name=self.name, subjects=[f"{self.name}.>"],
                                                         duplicate_window=120.0)))

    @staticmethod
    async def _call(action: Any) -> Any:
        import nats

        nc = await nats.connect(NATS_URL, connect_timeout=5, allow_reconnect=False)
        try:
            return await action(nc.jetstream())
        finally:
            await nc.close()

    def count(self) -> int:
        """Messages stored now."""
        async def count(js: Any) -> int:
            return int((await js.stream_info(self.name)).state.messages)

        return int(asyncio.run(self._call(count)))

    def messages(self) -> list[Stored]:
        """Every stored message, in stream order."""
        async def read(js: Any) -> list[Stored]:
            state = (await js.stream_info(self.name)).state
            if not state.messages:
                return []
            got = [await js.get_msg(self.name, seq) for seq in range(state.first_seq, state.last_seq + 1)]
            return [Stored(m.data or b"", dict(m.headers or {}), (m.headers or {}).get("Nats-Msg-Id")) for m in got]

        return list(asyncio.run(self._call(read)))

    def delete(self) -> None:
        asyncio.run(self._call(lambda js: js.delete_stream(self.name)))


class BoundQueue:
    """A RabbitMQ topic exchange and a durable queue bound to it with ``#`` (every routing key),
    both of the test's own; declared on construction, deleted by :meth:`delete`."""

    def __init__(self) -> None:
        self.name = f"hkill-{uuid.uuid4().hex[:12]}"
        self.exchange = self.name

        async def declare(channel: Any) -> None:
            exchange = await channel.declare_exchange(self.exchange, "topic", durable=False, auto_delete=False)
            queue = await channel.declare_queue(self.name, durable=True, auto_delete=False)
            await queue.bind(exchange, "#")

        asyncio.run(self._call(declare))

    @staticmethod
    async def _call(action: Any) -> Any:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL, timeout=5)
        try:
            return await action(await connection.channel())
        finally:
            await connection.close()

    def count(self) -> int:
        """Messages waiting in the queue now."""
        async def count(channel: Any) -> int:
            queue = await channel.declare_queue(self.name, passive=True)
            return int(queue.declaration_result.message_count)

        return int(asyncio.run(self._call(count)))

    def messages(self) -> list[Stored]:
        """Every message in the queue, taken off it (acknowledged), in queue order."""
        async def drain(channel: Any) -> list[Stored]:
            queue = await channel.declare_queue(self.name, passive=True)
            got: list[Stored] = []
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                headers = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in (message.headers or {}).items()}
                got.append(Stored(message.body, headers, message.message_id))
            return got

        return list(asyncio.run(self._call(drain)))

    def delete(self) -> None:
        async def delete(channel: Any) -> None:
            await channel.queue_delete(self.name)
            await channel.exchange_delete(self.exchange)

        asyncio.run(self._call(delete))


class Tap:
    """Every message published to ``subject`` (a NATS subject, wildcards allowed), as a core
    subscriber of its own connection sees it: JetStream's deduplication does not hide a
    re-send from it, so it counts sends, not stored messages. Listens from construction
    (returns once subscribed) until :meth:`close`, in a thread with its own event loop."""

    def __init__(self, subject: str) -> None:
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closing: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._listen(subject),),
                                        name="test-nats-tap", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise AssertionError(f"the NATS tap could not subscribe to {subject}: {self._error!r}")

    async def _listen(self, subject: str) -> None:
        import nats

        self._closing = asyncio.Event()
        try:
            nc = await nats.connect(NATS_URL, connect_timeout=5)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise

        async def seen(msg: Any) -> None:
            with self._lock:
                self._ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))

        await nc.subscribe(subject, cb=seen)
        await nc.flush()
        self._ready.set()
        try:
            await self._closing.wait()
        finally:
            await nc.close()

    def ids(self) -> list[str]:
        """The ``Nats-Msg-Id`` of every message seen so far, in arrival order."""
        with self._lock:
            return list(self._ids)

    def close(self) -> None:
        if self._closing is not None:
            self._loop.call_soon_threadsafe(self._closing.set)
        self._thread.join(10)
        self._loop.close()
