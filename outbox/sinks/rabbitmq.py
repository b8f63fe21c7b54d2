"""The RabbitMQ sink: a forwarder's jobs published to an AMQP 0-9-1 exchange (forwarding
notes).

One robust connection (aio-pika's ``connect_robust``: it reconnects by itself, every few
seconds, and reopens its channels) and one channel in publisher-confirm mode. The exchange
is the user's: the sink never declares it, not even passively, so a missing exchange is
reported per message and starts working once somebody declares it. Each message goes out
``mandatory``, persistent, with the job's idempotency key as ``message_id``.

A batch is published without waiting for one confirm before the next publish; then the
sink waits up to the timeout, in all, for the broker's answers, and maps each (an ack,
return or nack is passed on as it arrives, ``answered``; several batches may be in flight):

* the message's ``deadline`` passed when its publish was about to start (checked by its
  publish task, right before aio-pika takes the channel) -> :class:`Expired`, not sent.

* ``basic.ack`` -> :class:`Delivered`.
* ``basic.return`` (mandatory, no queue bound for the routing key) -> :class:`Failed`, not
  permanent: it is retried with backoff, since a binding may be added; never a silent drop.
* ``basic.nack`` -> :class:`Failed` ("broker nacked").
* no answer within the timeout -> :class:`Failed` ("no confirm within Ns"), or
  :class:`Unavailable` when the connection went down meanwhile.
* the broker closes the channel (a channel error stops every publish behind it, and the
  broker drops the frames it still receives on that channel): every message of the batch
  without an answer gets the broker's reply code and text. ``404`` (no such exchange) is
  :class:`Failed`, not permanent (the exchange may be declared later); a ``406`` naming a
  message over the server's ``max_message_size`` is :class:`Failed` *permanent* for the
  messages over that size, and :class:`Unavailable` for the others of the batch (they are
  not at fault and their fate is unknown: handed back, attempt not counted, sent again);
  any other code is :class:`Failed`, not permanent. aio-pika reopens the channel; the
  sink reports not ``connected`` until it has.
* the connection is lost -> :class:`Unavailable`.

RabbitMQ gives at-least-once here: a crash or a lost confirm between the broker storing a
message and the job completing sends it again, with the same ``message_id``; consumers drop
duplicates by ``message_id``.

Logs (issue 26, item 10): the forwarder reports its broker's state, once per change
(unreachable, back); the sink adds one INFO line per lost connection, naming the cause, and
logs a channel the broker closed and an exchange found missing at DEBUG only, since each
message's result carries them (:attr:`destination_problem` tells the forwarder the second).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import re
import time
from collections.abc import Sequence
from datetime import UTC
from typing import Any
from urllib.parse import urlsplit

from outbox.errors import ConfigurationError
from outbox.redaction import redact
from outbox.sinks import (
    Answered,
    Delivered,
    Expired,
    Failed,
    Message,
    SendResult,
    Sink,
    SinkUnavailableError,
    Template,
    Unavailable,
    describe_error,
)

log = logging.getLogger(__name__)

#: AMQP 0-9-1 short strings (routing key, message_id, type) hold at most this many bytes.
SHORTSTR_MAX = 255

#: RabbitMQ's channel-close text for a message over ``max_message_size`` (rabbit_channel,
#: ``check_msg_size``): "message size N is larger than [configured ]max size M".
_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")

#: Reply codes of the channel errors aiormq raises as classes without the code.
#: Message headers RabbitMQ itself acts on (lower case): refused in an event's own headers.
_BROKER_HEADERS = frozenset({"cc", "bcc"})

_REPLY_CODES = {"ChannelAccessRefused": 403, "ChannelNotFoundEntity": 404,
                "ChannelLockedResource": 405, "ChannelPreconditionFailed": 406}

#: What a publish task returns when its message's deadline had passed and nothing was published.
_NOT_SENT = object()


class RabbitMQ(Sink):
    """Publishes each job to ``exchange`` (``""``: the default exchange, where the routing
    key names a queue) with the routing key rendered from ``routing_key`` (a
    :class:`Template` over ``{topic}``, ``{key}``, ``{consumer}``; at most 255 bytes
    rendered, a longer one fails the message permanently). ``url``: ``amqp://`` or
    ``amqps://``, with credentials and vhost (aio-pika URL parameters such as
    ``?reconnect_interval=2`` pass through). ``connect_timeout``: seconds for the first
    connection. Needs ``pip install 'outbox-relay[rabbitmq]'`` (aio-pika); raises
    :class:`ConfigurationError` naming the option for a bad one, or when aio-pika is
    missing.

    Message properties: ``content_type`` ``application/json``, persistent
    ``delivery_mode``, ``message_id`` = the job's idempotency key, ``timestamp`` = the
    event's ``created_at``, ``type`` = the topic. Headers: the event's own, plus
    ``Outbox-Event-Id``, ``Outbox-Topic``, ``Outbox-Key`` (only when the event has a key),
    ``Outbox-Idempotency-Key``, ``Outbox-Created-At`` (ISO 8601, UTC); outbox's names win
    over an event header of the same name."""

    extra = "rabbitmq"

    def __init__(self, url: str = "amqp://guest:guest@127.0.0.1:5672/", *, exchange: str = "",
                 routing_key: str = "{topic}", connect_timeout: float = 5.0) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in ("amqp", "amqps") or not urlsplit(url).hostname:
            shown = redact(url) if isinstance(url, str) else repr(url)
            raise ConfigurationError(f"RabbitMQ url must be an amqp:// or amqps:// URL with a host, got {shown}")
        if not isinstance(exchange, str):
            raise ConfigurationError(f"RabbitMQ exchange must be a string (\"\" for the default exchange), "
                                     f"got {exchange!r}")
        if len(exchange.encode()) > SHORTSTR_MAX:
            raise ConfigurationError(f"RabbitMQ exchange name is longer than {SHORTSTR_MAX} bytes: {exchange!r}")
        if (isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float))
                or not connect_timeout > 0):
            raise ConfigurationError(f"RabbitMQ connect_timeout must be a positive number of seconds, "
                                     f"got {connect_timeout!r}")
        self.routing_key = Template(routing_key, "routing key")
        if importlib.util.find_spec("aio_pika") is None:
            raise ConfigurationError("the RabbitMQ sink needs aio-pika: pip install 'outbox-relay[rabbitmq]'")
        self.url = url
        self.exchange = exchange
        self.connect_timeout = float(connect_timeout)
        self._connection: Any = None
        self._channel: Any = None
        self._exchange: Any = None
        self._missing: str | None = None  # the broker's 404 while the exchange is known missing

    def describe(self) -> str:
        """``"amqp://guest:***@127.0.0.1:5672/ exchange 'orders' routing key {topic}"``: the URL
        with its password hidden (:func:`outbox.redaction.redact`), the exchange and the
        routing key template."""
        where = redact(self.url)
        exchange = repr(self.exchange) if self.exchange else "(default)"
        return f"{where} exchange {exchange} routing key {self.routing_key.text}"

    @property
    def connected(self) -> bool:
        """True while the connection is up and the publishing channel open (False while aio-pika
        reconnects or reopens the channel after the broker closed it)."""
        connection, channel = self._connection, self._channel
        return (connection is not None and channel is not None and not connection.is_closed
                and connection.connected.is_set() and not channel.is_closed)

    @property
    def destination_problem(self) -> str | None:
        """The broker's 404 while the exchange is known missing (found at connect, or by a
        batch; each batch checks again), else None."""
        return self._missing

    async def connect(self) -> None:
        """Connect (within ``connect_timeout``) and open a channel with publisher confirms;
        afterwards aio-pika reconnects by itself. Raises :class:`SinkUnavailableError` saying
        why when the broker cannot be reached or refuses the login."""
        import aio_pika

        if self.connected:
            return
        await self.close()
        connection = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                connection = await aio_pika.connect_robust(self.url, timeout=self.connect_timeout)
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        except Exception as exc:
            if connection is not None:
                await _quietly(connection.close())
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise SinkUnavailableError(f"RabbitMQ at {self.describe()} is unreachable: {reason}") from exc
        connection.close_callbacks.add(self._on_connection_close)
        connection.reconnect_callbacks.add(self._on_reconnect)
        channel.close_callbacks.add(self._on_channel_close)
        self._connection = connection
        self._channel = channel
        # Not declared: the exchange is the user's. Its existence is checked on a throwaway
        # channel (a passive declare of a missing exchange closes the channel it runs on).
        self._exchange = (channel.default_exchange if not self.exchange
                          else await channel.get_exchange(self.exchange, ensure=False))
        try:
            async with asyncio.timeout(self.connect_timeout):
                self._missing = await self._probe_exchange()
        except Exception as exc:
            await self.close()
            raise SinkUnavailableError(f"RabbitMQ at {self.describe()}: checking the exchange failed: "
                                       f"{_describe(exc)}") from exc
        if self._missing:  # the forwarder reports it (destination_problem), once
            log.debug("RabbitMQ at %s: %s; its messages wait until it is declared", self.describe(), self._missing)

    async def send_many(self, messages: Sequence[Message], timeout: float,
                        answered: Answered | None = None) -> list[SendResult]:
        """Publish ``messages`` to the exchange, all before waiting for any confirm, then wait up
        to ``timeout`` seconds in all; one result per message, in order, each broker answer
        passed to ``answered`` as it arrives (the mapping of broker answers to results is in
        the module's notes). A message whose ``deadline`` has passed when its publish starts
        is not sent (:class:`Expired`)."""
        import aio_pika

        results: list[SendResult | None] = [None] * len(messages)
        if not await self._ready(timeout):
            return [Unavailable(f"not connected to RabbitMQ at {self.describe()}")] * len(messages)
        if self._missing:
            # Publishing to a missing exchange closes the channel, and publishes still in
            # flight behind the close can make the broker drop the whole connection (504
            # CHANNEL_ERROR): while it is known missing, check it instead of publishing.
            try:
                async with asyncio.timeout(timeout):
                    self._missing = await self._probe_exchange()
            except Exception as exc:
                return [Unavailable(f"checking the exchange on RabbitMQ failed: {_describe(exc)}")] * len(messages)
            if self._missing:  # the destination is missing, not the messages at fault: they wait
                return [Unavailable(self._missing)] * len(messages)
        tasks: dict[int, asyncio.Task[Any]] = {}
        routing_keys: dict[int, str] = {}
        for i, message in enumerate(messages):
            try:
                routing_keys[i] = self._routing_key(message)
                outgoing = self._message(message, aio_pika)
            except ValueError as exc:
                results[i] = Failed(str(exc), permanent=True)
                continue
            tasks[i] = asyncio.ensure_future(self._publish(outgoing, routing_keys[i], message.deadline))
            if answered is not None:
                tasks[i].add_done_callback(functools.partial(self._answer_arrived, answered, i, routing_keys[i]))
        if tasks:
            _, pending = await asyncio.wait(tasks.values(), timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        closed = self._broker_close(tasks.values())
        if closed is not None and _reply_parts(closed)[0] == 404:
            self._missing = _close_error(closed)
        for i, task in tasks.items():
            results[i] = self._result(task, messages[i], routing_keys[i], closed, timeout, task in pending)
        return [result if result is not None else Failed("no result") for result in results]

    async def close(self) -> None:
        """Close the channel and the connection (no more reconnecting); safe when not open."""
        connection, self._connection, self._channel, self._exchange = self._connection, None, None, None
        if connection is not None:
            await _quietly(connection.close())

    async def _ready(self, timeout: float) -> bool:
        """Whether the channel is usable now, waiting up to ``timeout`` for aio-pika to reopen a
        channel the broker closed while the connection stays up."""
        if self._connection is None or self._channel is None:
            return False
        if self.connected:
            return True
        if self._connection.is_closed or not self._connection.connected.is_set():
            return False
        try:
            async with asyncio.timeout(timeout):
                await self._channel.ready()
        except TimeoutError:
            return False
        return self.connected

    async def _probe_exchange(self) -> str | None:
        """None when the exchange exists (or is the default one), else the broker's answer to a
        passive declare on a throwaway channel, as a channel-close error text."""
        from aiormq.exceptions import ChannelNotFoundEntity

        if not self.exchange:
            return None
        probe = await self._connection.transport.connection.channel(publisher_confirms=False)
        try:
            await probe.exchange_declare(self.exchange, passive=True)
        except ChannelNotFoundEntity as exc:
            return _close_error(exc)
        finally:
            if not probe.is_closed:
                await probe.close()
        return None

    def _routing_key(self, message: Message) -> str:
        routing_key = self.routing_key.render(message)
        if len(routing_key.encode()) > SHORTSTR_MAX:
            raise ValueError(f"routing key {routing_key[:60]!r}... of event {message.event_id} is longer than "
                             f"{SHORTSTR_MAX} bytes")
        return routing_key

    @staticmethod
    def _message(message: Message, aio_pika: Any) -> Any:
        for what, value in (("idempotency key (message_id)", message.idempotency_key), ("topic (type)", message.topic)):
            if len(value.encode()) > SHORTSTR_MAX:
                raise ValueError(f"the {what} of event {message.event_id} is longer than {SHORTSTR_MAX} bytes")
        for name in message.headers:
            if name.lower() in _BROKER_HEADERS:
                # RabbitMQ reads these (sender-selected distribution: an array of routing keys);
                # a string closes the channel (406) and fails the whole batch with it.
                raise ValueError(f"event {message.event_id}: header {name!r} is read by RabbitMQ itself (CC / BCC "
                                 "route the message to more queues), which an event may not set")
        headers: dict[str, Any] = dict(message.headers)
        headers.update({"Outbox-Event-Id": str(message.event_id), "Outbox-Topic": message.topic,
                        "Outbox-Idempotency-Key": message.idempotency_key,
                        "Outbox-Created-At": message.created_at.astimezone(UTC).isoformat()})
        if message.key is not None:
            headers["Outbox-Key"] = message.key
        else:
            headers.pop("Outbox-Key", None)
        return aio_pika.Message(message.body, headers=headers, content_type="application/json",
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=message.idempotency_key,
                                timestamp=message.created_at, type=message.topic)

    @staticmethod
    def _broker_close(tasks: Any) -> BaseException | None:
        """The channel error the broker closed the channel with during this batch, if any."""
        from aiormq.exceptions import ChannelClosed

        for task in tasks:
            if task.done() and not task.cancelled() and isinstance(task.exception(), ChannelClosed):
                return task.exception()  # type: ignore[no-any-return]
        return None

    async def _publish(self, outgoing: Any, routing_key: str, deadline: float) -> Any:
        """Publish one message and wait for its confirm, unless its ``deadline`` has passed
        (then :data:`_NOT_SENT`, nothing published)."""
        if time.monotonic() >= deadline:
            return _NOT_SENT
        return await self._exchange.publish(outgoing, routing_key, mandatory=True)

    def _answer_arrived(self, answered: Answered, index: int, routing_key: str, task: asyncio.Task[Any]) -> None:
        """A publish task ended: tell ``answered`` when it ended with the broker's answer."""
        result = self._answer(task, routing_key)
        if result is not None:
            answered(index, result)

    @staticmethod
    def _answer(task: asyncio.Task[Any], routing_key: str) -> SendResult | None:
        """The result of an ended publish task that holds the broker's own answer for its
        message (ack, return, nack), or None (not sent, or ended otherwise: the batch decides)."""
        from aiormq.exceptions import DeliveryError, PublishError
        from pamqp.commands import Basic

        if task.cancelled():
            return None
        exc = task.exception()
        if exc is None:
            answer = task.result()
            if answer is _NOT_SENT:
                return None
            if isinstance(answer, Basic.Ack):
                return Delivered()
            return Failed(f"unexpected broker answer {answer!r}")
        if isinstance(exc, PublishError):
            frame: Any = exc.frame  # the basic.return
            exchange = repr(frame.exchange) if frame.exchange else "(default)"
            return Failed(f"unroutable: no queue bound to exchange {exchange} for routing key {routing_key!r} "
                          f"({frame.reply_text})")
        if isinstance(exc, DeliveryError):
            return Failed(f"broker nacked ({type(exc.frame).__name__})")
        return None

    def _result(self, task: asyncio.Task[Any], message: Message, routing_key: str, closed: BaseException | None,
                timeout: float, timed_out: bool) -> SendResult:
        answer = self._answer(task, routing_key)
        if answer is not None:
            return answer
        if not task.cancelled() and task.exception() is None:  # its deadline had passed: not published
            return Expired("not sent: its deadline passed before the publish")
        exc = None if task.cancelled() else task.exception()
        if closed is not None:
            return _after_close(closed, message)
        if not self.connected:
            return Unavailable(f"connection to RabbitMQ lost before the confirm ({_describe(exc)})")
        if timed_out:
            return Failed(f"no confirm within {timeout:g}s", unanswered=True)
        return Failed(f"publish failed: {_describe(exc)}")

    def _on_connection_close(self, _: Any, exc: BaseException | None) -> None:
        # INFO: the forwarder warns once if the broker stays unreachable; this line keeps the cause.
        if self._connection is not None and not self._connection.close_called:
            log.info("connection to RabbitMQ at %s lost (%s); reconnecting", self.describe(), _describe(exc))

    def _on_reconnect(self, _: Any) -> None:
        log.info("reconnected to RabbitMQ at %s", self.describe())

    def _on_channel_close(self, _: Any, exc: BaseException | None) -> None:
        # DEBUG: the messages' results carry the reply code and text (the forwarder's outage
        # warning for a 404, the dead letter's or retry's line for the others).
        from aiormq.exceptions import ChannelClosed

        if isinstance(exc, ChannelClosed):
            log.debug("RabbitMQ closed the publishing channel: %s; reopening", _reply(exc))


def _after_close(closed: BaseException, message: Message) -> SendResult:
    """The result of a message left without an answer when the broker closed the channel with
    ``closed`` (see the module's notes)."""
    code, text = _reply_parts(closed)
    error = _close_error(closed)
    if code == 404:  # the exchange is gone: an outage of the destination, no message's fault
        return Unavailable(error)
    too_large = _TOO_LARGE.search(text) if code == 406 else None
    if too_large is None:
        return Failed(error)
    if len(message.body) > int(too_large.group(2)):
        return Failed(error, permanent=True)
    return Unavailable(f"{error} (caused by another message of the batch; this one was not confirmed)")


def _close_error(closed: BaseException) -> str:
    return f"channel closed by the broker: {_reply(closed)}"


def _reply_parts(exc: BaseException) -> tuple[int | None, str]:
    args = exc.args
    if len(args) >= 2 and (args[0] is None or isinstance(args[0], int)):
        return args[0], str(args[1])
    return _REPLY_CODES.get(type(exc).__name__), str(args[0]) if args else type(exc).__name__


def _reply(exc: BaseException) -> str:
    code, text = _reply_parts(exc)
    return f"{code} {text}" if code else text


def _describe(exc: BaseException | None) -> str:
    return "cancelled" if exc is None else describe_error(exc)


async def _quietly(closing: Any) -> None:
    try:
        await closing
    except Exception as exc:  # closing a broken connection may fail; nothing is left to do
        log.debug("closing the RabbitMQ connection: %s", _describe(exc))
