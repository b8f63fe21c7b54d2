"""Taking messages in from NATS JetStream: a durable pull consumer (``pip install
'outbox-relay[nats]'``).

The source binds (or creates) the durable consumer ``durable`` of ``stream``, filtered to
``subject`` when given, with explicit acks: a message stays the consumer's until it is
acknowledged, and is delivered again ``ack_wait`` seconds after a delivery that was not (a
relay killed before its commit or its ack, a relay paused past it). Messages are fetched in
batches; each is acknowledged (``+ACK``) only after the transaction that took it in has
committed, and the acknowledgements are flushed before the next fetch. The identity of a
message is the sender's ``Outbox-Idempotency-Key``, else its ``Nats-Msg-Id`` (the id
JetStream deduplicates publishes by): the same message delivered twice is taken in once.
Several relays may run the same intake: they share the durable consumer, which hands each
message to one of them at a time.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
from collections.abc import Sequence
from typing import Any

from outbox.errors import ConfigurationError
from outbox.intake import Received, Source, SourceUnavailableError, finite
from outbox.redaction import redact
from outbox.sinks.jetstream import STREAM_NAME, parse_servers

log = logging.getLogger(__name__)


class JetStreamSource(Source):
    """A durable pull consumer of a JetStream stream.

    ``url``: as :class:`~outbox.JetStream`'s (one or several ``nats://`` servers,
    credentials never shown). ``stream``: the stream's name. ``durable``: the durable
    consumer's name (created on first connect when missing, with the options below; an
    existing one is used as it is). ``subject``: the consumer's filter subject (None: the
    whole stream). ``ack_wait``: seconds after an unacknowledged delivery before the
    message is delivered again (default 30). ``max_ack_pending``: most messages delivered
    and not acknowledged at once, over every relay (default 1,000). ``connect_timeout``:
    seconds (default 5). Raises :class:`ConfigurationError` naming the option for a bad
    one, or when nats-py is not installed."""

    extra = "nats"

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, stream: str, durable: str,
                 subject: str | None = None, ack_wait: float = 30.0, max_ack_pending: int = 1000,
                 connect_timeout: float = 5.0) -> None:
        self.servers = parse_servers(url)
        for option, value in (("stream", stream), ("durable", durable)):
            if not isinstance(value, str) or not STREAM_NAME.fullmatch(value) or len(value.encode()) > 255:
                raise ConfigurationError(f"JetStreamSource: {option} must be a name (no whitespace, '.', '*', '>', "
                                         f"slashes; at most 255 bytes), got {value!r}")
        if subject is not None and (not isinstance(subject, str) or not subject or any(c.isspace() for c in subject)):
            raise ConfigurationError(f"JetStreamSource: subject must be None or a subject filter, got {subject!r}")
        if not finite(ack_wait) or not 1 <= ack_wait <= 86_400:
            raise ConfigurationError(f"JetStreamSource: ack_wait must be seconds in 1..86400, got {ack_wait!r}")
        if type(max_ack_pending) is not int or not 1 <= max_ack_pending <= 1_000_000:
            raise ConfigurationError(f"JetStreamSource: max_ack_pending must be an int in 1..1000000, "
                                     f"got {max_ack_pending!r}")
        if not finite(connect_timeout) or not 0 < connect_timeout <= 3600:
            raise ConfigurationError(f"JetStreamSource: connect_timeout must be seconds in (0, 3600], "
                                     f"got {connect_timeout!r}")
        if importlib.util.find_spec("nats") is None:
            raise ConfigurationError("JetStreamSource needs the NATS client: pip install 'outbox-relay[nats]'")
        self.stream = stream
        self.durable = durable
        self.subject = subject
        self.ack_wait = float(ack_wait)
        self.max_ack_pending = max_ack_pending
        self.connect_timeout = float(connect_timeout)
        self._nc: Any = None
        self._sub: Any = None

    def describe(self) -> str:
        """The servers (secrets hidden), the stream, the durable consumer and the filter."""
        where = ",".join(redact(s) for s in self.servers)
        return f"{where} stream {self.stream} durable {self.durable}" + (f" subject {self.subject}" if self.subject
                                                                         else "")

    async def connect(self) -> None:
        """Connect and bind the durable consumer (creating it when missing). Raises
        :class:`SourceUnavailableError` when NATS cannot be reached or the stream does not
        exist."""
        import nats  # noqa: PLC0415 (an optional dependency, imported when used)
        import nats.errors  # noqa: PLC0415
        import nats.js.errors  # noqa: PLC0415
        from nats.js.api import AckPolicy, ConsumerConfig  # noqa: PLC0415

        await self.close()

        async def quiet(exc: Exception) -> None:
            return None  # a lost connection is reported by fetch and ack, once, by the relay's loop

        try:
            nc = await asyncio.wait_for(
                nats.connect(servers=self.servers, allow_reconnect=True, max_reconnect_attempts=-1,
                             connect_timeout=math.ceil(self.connect_timeout), error_cb=quiet),
                self.connect_timeout)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise SourceUnavailableError(f"cannot reach NATS at {','.join(redact(s) for s in self.servers)} "
                                         f"within {self.connect_timeout:g} s ({type(exc).__name__}: {exc})") from None
        try:
            config = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT,
                                    ack_wait=self.ack_wait, max_ack_pending=self.max_ack_pending,
                                    filter_subject=self.subject)
            self._sub = await nc.jetstream().pull_subscribe(self.subject or "", durable=self.durable,
                                                            stream=self.stream, config=config)
        except (TimeoutError, OSError, nats.errors.Error, nats.js.errors.Error) as exc:
            await nc.close()
            raise SourceUnavailableError(f"cannot bind durable consumer {self.durable!r} of stream {self.stream!r} "
                                         f"({type(exc).__name__}: {exc})") from None
        self._nc = nc

    async def fetch(self, limit: int, wait: float) -> list[Received]:
        """Up to ``limit`` messages, waiting up to ``wait`` seconds for the first."""
        import nats.errors  # noqa: PLC0415

        if self._sub is None or not self._nc.is_connected:
            raise SourceUnavailableError("not connected to NATS")
        try:
            messages = await self._sub.fetch(batch=limit, timeout=max(wait, 0.05))
        except TimeoutError:  # nats.errors.TimeoutError is one too: nothing came in time
            return []
        except (OSError, nats.errors.Error) as exc:
            raise SourceUnavailableError(f"fetch from {self.durable!r} failed ({type(exc).__name__}: {exc})") from None
        received = []
        for msg in messages:
            headers = {k: v for k, v in (msg.headers or {}).items() if isinstance(v, str)}
            try:
                deliveries = int(msg.metadata.num_delivered)
            except Exception:  # noqa: BLE001 - a message without JetStream metadata (should not happen)
                deliveries = 1
            received.append(Received(body=bytes(msg.data), headers=headers, subject=msg.subject,
                                     message_id=headers.get("Nats-Msg-Id"), deliveries=deliveries, token=msg))
        return received

    async def settle(self) -> None:
        """When the durable consumer holds deliveries nobody acknowledged (a previous holder of
        an ordered intake died with them), wait ``ack_wait`` for them to become due again:
        the server then delivers them ahead of newer messages."""
        import nats.errors  # noqa: PLC0415

        try:
            pending = int((await self._sub.consumer_info()).num_ack_pending)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise SourceUnavailableError(f"consumer info of {self.durable!r} failed ({type(exc).__name__}: {exc})") \
                from None
        if pending:
            log.info("JetStream durable %r holds %d deliveries nobody acknowledged: waiting ack_wait (%g s) for them "
                     "to come back ahead of newer messages", self.durable, pending, self.ack_wait)
            await asyncio.sleep(self.ack_wait)

    async def ack(self, received: Sequence[Received]) -> None:
        """Acknowledge each message and flush the acknowledgements to the server."""
        import nats.errors  # noqa: PLC0415

        try:
            for message in received:
                await message.token.ack()
            await self._nc.flush(timeout=5)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise SourceUnavailableError(f"acknowledging on {self.durable!r} failed ({type(exc).__name__}: {exc})") \
                from None

    async def close(self) -> None:
        """Close the connection (unacknowledged messages come again after ``ack_wait``)."""
        nc, self._nc, self._sub = self._nc, None, None
        if nc is not None:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - closing after a failure: nothing more to say
                pass
