"""The demo's JetStream stream: where its fourth consumer, the forwarder ``forward_to_nats``,
sends ``order.placed``.

``outbox-relay demo`` makes one stream per run, named ``OUTBOX_DEMO_<run id>`` and bound to
the subject ``<stream>.order.placed`` alone, so runs sharing one NATS server never see each
other's messages. Its duplicate window is longer than the whole run can take (orders, faults
and drain), so every re-send after a kill or a pause is dropped by ``Nats-Msg-Id`` and the
stream ends with exactly one message per committed order. The demo reads every message back
for its invariant table and deletes the stream at the end, whatever happened, so a shared
server does not fill up.

Forwarding is skipped, with the reason, when nats-py is not installed or no NATS server with
JetStream answers at the URL; the rest of the demo runs unchanged.

Each call opens its own short connection in its own event loop: the demo is synchronous and
calls this a few times per run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from outbox.demo.app import TOPIC
from outbox.redaction import redact
from outbox.sinks.jetstream import parse_servers

#: Seconds the demo waits for NATS to answer (connect, stream calls) before it skips forwarding.
CONNECT_TIMEOUT = 2

T = TypeVar("T")


class ForwardingSkipped(Exception):  # noqa: N818 - a reason, not a failure of the demo
    """Forwarding cannot run in this demo; the message says why, in one line."""


@dataclass(frozen=True)
class StoredMessage:
    """One message of the stream: its sequence, ``Nats-Msg-Id``, ``Outbox-Event-Id`` (None
    when absent or not a number) and the ``order_id`` of its JSON body (None when absent)."""

    seq: int
    msg_id: str | None
    event_id: int | None
    order_id: int | None


class DemoStream:
    """The run's stream on the NATS server at ``url`` (see the module notes). Build it with
    :meth:`create`; :meth:`messages` reads it back, :meth:`delete` removes it."""

    def __init__(self, url: str, name: str, duplicate_window: float) -> None:
        self.url = url
        self.name = name
        self.duplicate_window = duplicate_window

    @property
    def subject(self) -> str:
        """The one subject the stream binds: ``<stream>.order.placed``."""
        return f"{self.name}.{TOPIC}"

    @classmethod
    def create(cls, url: str, duplicate_window: float) -> DemoStream:
        """Make a new stream with a unique name and ``duplicate_window`` seconds. Raises
        :class:`ForwardingSkipped` when nats-py is missing, ``url`` is not a NATS URL, or the
        server cannot be reached or has no JetStream (within :data:`CONNECT_TIMEOUT`)."""
        if importlib.util.find_spec("nats") is None:
            raise ForwardingSkipped("nats-py is not installed (pip install 'outbox-relay[nats]')")
        try:
            parse_servers(url)
        except Exception as exc:  # noqa: BLE001 - ConfigurationError; reported as the reason
            raise ForwardingSkipped(str(exc)) from None
        stream = cls(url, f"OUTBOX_DEMO_{uuid.uuid4().hex[:12].upper()}", duplicate_window)

        async def add(js: Any) -> None:
            from nats.js.api import StorageType, StreamConfig

            await js.add_stream(StreamConfig(name=stream.name, subjects=[stream.subject], storage=StorageType.FILE,
                                             duplicate_window=duplicate_window))

        stream._call(add)
        return stream

    def messages(self) -> list[StoredMessage]:
        """Every message the stream holds, in sequence order."""

        async def read(js: Any) -> list[StoredMessage]:
            from nats.js.errors import NotFoundError

            info = await js.stream_info(self.name)
            found: list[StoredMessage] = []
            if not info.state.messages:
                return found
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    raw = await js.get_msg(self.name, seq)
                except NotFoundError:  # a deleted sequence; the demo deletes none
                    continue
                found.append(_stored(seq, raw.headers or {}, raw.data or b""))
            return found

        return self._call(read)

    def resend(self, count: int) -> int:
        """Publish the stream's first ``count`` messages again, bodies and headers as stored
        but each with a new ``Nats-Msg-Id``, as a sender re-sending after a crash past the
        duplicate window does: the stream stores them as new messages. Returns how many."""
        async def again(js: Any) -> int:
            info = await js.stream_info(self.name)
            last = min(info.state.last_seq, info.state.first_seq + count - 1)
            sent = 0
            for seq in range(info.state.first_seq, last + 1):
                raw = await js.get_msg(self.name, seq)
                headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
                await js.publish(raw.subject, raw.data or b"", headers={**headers, "Nats-Msg-Id": uuid.uuid4().hex})
                sent += 1
            return sent

        return self._call(again)

    def unfinished(self, durable: str) -> int:
        """Messages the durable consumer ``durable`` has not delivered yet or not seen
        acknowledged (0: everything in the stream was taken and acknowledged)."""
        async def read(js: Any) -> int:
            info = await js.consumer_info(self.name, durable)
            return int(info.num_pending) + int(info.num_ack_pending)

        return self._call(read)

    def redelivered(self, durable: str) -> int:
        """How many messages the stream's durable consumer ``durable`` delivered more than once."""
        async def read(js: Any) -> int:
            return int((await js.consumer_info(self.name, durable)).num_redelivered)

        return self._call(read)

    def delete(self) -> None:
        """Delete the stream (nothing happens when it is gone already)."""

        async def remove(js: Any) -> None:
            from nats.js.errors import NotFoundError

            try:
                await js.delete_stream(self.name)
            except NotFoundError:
                pass

        self._call(remove)

    def _call(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``work(jetstream_context)`` on a connection of its own. Raises
        :class:`ForwardingSkipped` saying why when NATS does not answer."""
        import nats.aio.client
        from nats.errors import Error as NatsError

        async def main() -> T:
            # nats-py retries a first connection that fails every reconnect_time_wait, whatever
            # allow_reconnect says, and logs each failure at ERROR unless given an error_cb: the
            # first failure it reports ends the attempt.
            failures: list[Exception] = []
            failed = asyncio.Event()

            async def error(exc: Exception) -> None:
                failures.append(exc)
                failed.set()

            nc = nats.aio.client.Client()
            connecting = asyncio.ensure_future(nc.connect(
                servers=parse_servers(self.url), connect_timeout=CONNECT_TIMEOUT, allow_reconnect=False,
                max_reconnect_attempts=0, error_cb=error))
            waiting = asyncio.ensure_future(failed.wait())
            await asyncio.wait({connecting, waiting}, timeout=CONNECT_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if not connecting.done() or connecting.cancelled() or connecting.exception() is not None:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                await asyncio.gather(nc.close(), return_exceptions=True)
                why: BaseException = TimeoutError("no answer")
                if failures:
                    why = failures[0]
                elif connecting.done() and not connecting.cancelled():
                    why = connecting.exception() or why
                raise ForwardingSkipped(f"no NATS server answers at {self._where()} ({_describe(why)})")
            try:
                async with asyncio.timeout(30):
                    return await work(nc.jetstream(timeout=CONNECT_TIMEOUT))
            except (NatsError, TimeoutError) as exc:
                raise ForwardingSkipped(f"JetStream at {self._where()} did not serve the demo "
                                        f"({_describe(exc)})") from None
            finally:
                await nc.close()

        return asyncio.run(main())

    def _where(self) -> str:
        """The servers of :attr:`url`, secrets hidden (:func:`outbox.redaction.redact`)."""
        return ",".join(redact(server) for server in parse_servers(self.url))


def _stored(seq: int, headers: dict[str, str], data: bytes) -> StoredMessage:
    event_id = headers.get("Outbox-Event-Id")
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    order_id = body.get("order_id") if isinstance(body, dict) else None
    return StoredMessage(seq=seq, msg_id=headers.get("Nats-Msg-Id"),
                         event_id=int(event_id) if event_id is not None and event_id.isdigit() else None,
                         order_id=order_id if isinstance(order_id, int) else None)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
