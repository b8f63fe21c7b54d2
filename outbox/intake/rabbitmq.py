"""Taking messages in from a RabbitMQ queue with manual acknowledgements (``pip install
'outbox-relay[rabbitmq]'``, aio-pika, the client the RabbitMQ sink uses).

The source consumes the queue ``queue`` (the user's: it must exist, it is not declared) on a
channel of its own with a ``prefetch`` limit: RabbitMQ hands the relay at most that many
messages not yet acknowledged. Each message is acknowledged (``basic.ack``, one per message,
on the channel it came on) only after the transaction that took it in has committed. A
message not acknowledged when its channel closes (a relay killed or stopped before its
commit or its ack, a connection lost) is requeued by RabbitMQ and delivered again, marked
redelivered; a redelivery of one already taken in is dropped by its identity: the sender's
``Outbox-Idempotency-Key`` header, else its ``message_id`` property (outbox's RabbitMQ sink
sets both). Messages without either need the intake's ``identity=``. After a lost connection
the source connects anew (the relay's intake loop retries with backoff); what the old
channel delivered and was not acknowledged comes again.

An ordered intake's new holder must not consume while an earlier holder's connection still
holds deliveries (a holder paused past its lease keeps its prefetch until RabbitMQ drops
its connection): :meth:`RabbitMQSource.settle` waits until the queue has no consumer left
before this one starts, so those deliveries are requeued (in their places) first. The
connection's ``heartbeat`` (default 10 s) bounds how long RabbitMQ takes to drop a paused
peer (it allows a few missed heartbeats).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from outbox.errors import ConfigurationError
from outbox.intake import Received, Source, SourceUnavailableError, finite
from outbox.redaction import redact

log = logging.getLogger(__name__)

#: Longest queue name AMQP 0-9-1 carries (a short string).
QUEUE_NAME_MAX = 255


class RabbitMQSource(Source):
    """Consumes the queue ``queue`` of the broker at ``url`` (``amqp://`` or ``amqps://``;
    the password never shown). ``prefetch``: most messages delivered to this relay and not
    yet acknowledged (default 500; a batch never exceeds it). ``connect_timeout``: seconds
    (default 5). Raises :class:`ConfigurationError` naming the option for a bad one, or when
    aio-pika is not installed."""

    extra = "rabbitmq"

    def __init__(self, url: str = "amqp://guest:guest@127.0.0.1:5672/", *, queue: str, prefetch: int = 500,
                 connect_timeout: float = 5.0, heartbeat: int = 10) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in ("amqp", "amqps") or not urlsplit(url).hostname:
            shown = redact(url) if isinstance(url, str) else f"a {type(url).__name__}"
            raise ConfigurationError(f"RabbitMQSource: url must be an amqp:// or amqps:// URL with a host, got {shown}")
        if not isinstance(queue, str) or not queue or len(queue.encode()) > QUEUE_NAME_MAX:
            raise ConfigurationError(f"RabbitMQSource: queue must be a queue name of 1..{QUEUE_NAME_MAX} bytes, "
                                     f"got {queue!r}")
        if type(prefetch) is not int or not 1 <= prefetch <= 65_535:
            raise ConfigurationError(f"RabbitMQSource: prefetch must be an int in 1..65535, got {prefetch!r}")
        if not finite(connect_timeout) or not 0 < connect_timeout <= 3600:
            raise ConfigurationError(f"RabbitMQSource: connect_timeout must be seconds in (0, 3600], "
                                     f"got {connect_timeout!r}")
        if type(heartbeat) is not int or not 1 <= heartbeat <= 600:
            raise ConfigurationError(f"RabbitMQSource: heartbeat must be seconds, an int in 1..600, got {heartbeat!r}")
        if importlib.util.find_spec("aio_pika") is None:
            raise ConfigurationError("RabbitMQSource needs aio-pika: pip install 'outbox-relay[rabbitmq]'")
        self.url = url
        self.queue = queue
        self.prefetch = prefetch
        self.connect_timeout = float(connect_timeout)
        self.heartbeat = heartbeat
        self._connection: Any = None
        self._queue: Any = None
        self._consuming = False
        self._delivered: asyncio.Queue[Any] | None = None

    def describe(self) -> str:
        """The URL (password hidden) and the queue."""
        return f"{redact(self.url)} queue {self.queue!r}"

    async def connect(self) -> None:
        """Connect and open a channel with the prefetch limit; consuming starts at the first
        :meth:`fetch` (after :meth:`settle`, for an ordered intake). Raises
        :class:`SourceUnavailableError` when the broker cannot be reached, refuses the login,
        or the queue does not exist."""
        import aio_pika  # noqa: PLC0415 (an optional dependency, imported when used)

        await self.close()
        delivered: asyncio.Queue[Any] = asyncio.Queue()
        connection = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                connection = await aio_pika.connect(self.url, timeout=self.connect_timeout, heartbeat=self.heartbeat)
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=self.prefetch)
                queue = await channel.get_queue(self.queue, ensure=True)
        except Exception as exc:  # noqa: BLE001 - every failure to start is "unavailable", said why
            if connection is not None:
                await _quietly(connection.close())
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise SourceUnavailableError(f"cannot consume {self.describe()}: {reason}") from None
        self._connection = connection
        self._queue = queue
        self._consuming = False
        self._delivered = delivered

    async def settle(self) -> None:
        """Wait until the queue has no consumer (an earlier holder's connection gone, its
        deliveries requeued), checking every half second, for at most three heartbeats and
        ``connect_timeout``; then consuming may start. Raises :class:`SourceUnavailableError`
        when the connection is lost meanwhile."""
        deadline = asyncio.get_running_loop().time() + 3 * self.heartbeat + self.connect_timeout
        while True:
            try:
                result = await self._queue.channel.declare_queue(self.queue, passive=True)
            except Exception as exc:  # noqa: BLE001 - the channel or the connection is gone
                raise SourceUnavailableError(f"cannot read {self.describe()}: {type(exc).__name__}: {exc}") from None
            consumers = int(result.declaration_result.consumer_count)
            if consumers == 0:
                return
            if asyncio.get_running_loop().time() > deadline:
                log.warning("RabbitMQ queue %r still has %d consumer(s) after %.0f s; consuming beside them",
                            self.queue, consumers, 3 * self.heartbeat + self.connect_timeout)
                return
            await asyncio.sleep(0.5)

    async def fetch(self, limit: int, wait: float) -> list[Received]:
        """Up to ``limit`` delivered messages, waiting up to ``wait`` seconds for the first."""
        delivered = self._delivered
        if delivered is None or self._connection is None or self._connection.is_closed:
            raise SourceUnavailableError(f"not connected to {self.describe()}")
        if not self._consuming:
            try:
                await self._queue.consume(delivered.put, no_ack=False)
            except Exception as exc:  # noqa: BLE001 - the channel or the connection is gone
                raise SourceUnavailableError(f"cannot consume {self.describe()}: {type(exc).__name__}: {exc}") \
                    from None
            self._consuming = True
        try:
            first = await asyncio.wait_for(delivered.get(), wait)
        except TimeoutError:
            if self._connection.is_closed:
                raise SourceUnavailableError(f"connection to {self.describe()} closed") from None
            return []
        batch = [first]
        while len(batch) < limit and not delivered.empty():
            batch.append(delivered.get_nowait())
        return [_received(m) for m in batch]

    async def ack(self, received: Sequence[Received]) -> None:
        """Acknowledge each message on the channel it came on."""
        try:
            for message in received:
                await message.token.ack()
        except Exception as exc:  # noqa: BLE001 - a closed channel: RabbitMQ requeues them
            raise SourceUnavailableError(f"acknowledging on {self.describe()} failed "
                                         f"({type(exc).__name__}: {exc})") from None

    async def close(self) -> None:
        """Close the connection; what was delivered and not acknowledged is requeued."""
        connection, self._connection, self._delivered, self._queue = self._connection, None, None, None
        if connection is not None:
            await _quietly(connection.close())


def _received(message: Any) -> Received:
    headers: dict[str, str] = {}
    for name, value in (message.headers or {}).items():
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if isinstance(value, str):
            headers[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            headers[name] = str(value)
    return Received(body=bytes(message.body), headers=headers, subject=message.routing_key or "",
                    message_id=message.message_id or None, deliveries=2 if message.redelivered else 1,
                    token=message)


async def _quietly(closing: Any) -> None:
    try:
        await asyncio.wait_for(closing, 5)
    except Exception:  # noqa: BLE001 - closing after a failure: nothing more to say
        pass
