"""The Kafka sink: a forwarder's jobs produced as records to Kafka topics (forwarding notes).

The client is confluent-kafka, Python's binding of librdkafka (``pip install
'outbox-relay[kafka]'``). aiokafka was the other candidate, since it runs on the forwarder's
asyncio loop; it was dropped because its idempotent producer could not start against the
Kafka-protocol broker the tests run (it speaks only version 0 of InitProducerId, which that
broker refuses), where librdkafka's did, and librdkafka produced 38,000 records/s on one
core against the same broker (the architecture notes, "Forwarding", give the figures). A
librdkafka producer reports deliveries from ``poll()``: the sink runs one poller thread
(``outbox-kafka-poll``) that passes each report to the forwarder's loop.

One producer per sink, **idempotent** (``enable.idempotence``, hence ``acks=all``): the
broker stores each record once per producer session however often the client retries it,
and librdkafka keeps a partition's records in order through its retries. The partitioner is
``murmur2_random``, the Java client's default: murmur2 of the key bytes, positive, modulo
the partition count (librdkafka's own default, ``consistent_random``, is CRC32 and would put
a key elsewhere than other producers of the topic do); records without a key are spread at
random.

A record: topic rendered from ``topic`` (default ``"{topic}"``), key rendered from ``key``
(default ``"{key}"``; no key when the event has none), value the event's payload as stored
(``payload::text``, UTF-8, byte for byte), timestamp the event's ``created_at`` (ms), and
headers: the event's own (``traceparent`` among them when publishing recorded one), then
``Outbox-Event-Id``, ``Outbox-Topic``, ``Outbox-Key`` (only when the event has a key),
``Outbox-Idempotency-Key`` and ``Outbox-Created-At`` (ISO 8601, UTC); an event header of
one of those names is replaced (compared case-insensitively). Header values are UTF-8.

A batch is handed to the producer record by record, each right after its ``deadline`` is
checked (past it: :class:`~outbox.sinks.Expired`, not sent), without waiting for one
acknowledgement before the next hand-off; then the sink waits up to the timeout, in all,
and passes each answer on as it arrives (``answered``). What each record gets:

* acknowledged by every in-sync replica: :class:`~outbox.sinks.Delivered`;
* refused before sending, permanently: a topic name Kafka does not accept (only ASCII
  letters, digits, ``.``, ``_``, ``-``; at most 249 characters), a record over the
  producer's ``message.max.bytes`` (1,000,000 bytes by default, as the broker's);
* the broker's answer, permanent (:data:`PERMANENT_ERRORS`: record too large, invalid
  record, authorization, invalid timestamp): :class:`~outbox.sinks.Failed` ``permanent``,
  dead at once with the broker's error;
* any other error (unknown topic or partition, not enough replicas, a leader change, a
  request timeout, the record's ``message.timeout.ms`` out): librdkafka retries what is
  retriable within ``message.timeout.ms``; what is left is :class:`~outbox.sinks.Failed`,
  retried with backoff;
* no answer within the timeout: :class:`~outbox.sinks.Failed` ``unanswered`` (when no
  record of the batch was answered, the forwarder takes the broker for unreachable);
* every broker unreachable (librdkafka's ``_ALL_BROKERS_DOWN``), or the producer's local
  queue full: :class:`~outbox.sinks.Unavailable`; the sink reports not ``connected`` and
  drops the records still queued in the producer (``purge``: they were not sent), and the
  forwarder's keeper checks the cluster (a metadata request) until it answers. Jobs wait,
  attempts not counted. The producer (and its idempotent session) is kept across an outage
  and replaced after a fatal error or a batch of which no record was answered (a silent
  broker, or one restarted without its state, which refuses the old producer id with
  ``UnknownProducerId`` for as long as librdkafka retries).

The guarantee is at-least-once, as for the other brokers. The idempotent producer removes
duplicates inside one producer session only: a relay that dies after the broker stored a
record and before the job's completion commits, or a record acknowledged after the batch's
timeout (librdkafka keeps trying for ``message.timeout.ms``) while the job was sent again,
is stored twice. Consumers drop duplicates by ``Outbox-Event-Id`` (or
``Outbox-Idempotency-Key``, which also names the consumer). An ordered forwarder sends a
key's next record only after a copy of the one before was acknowledged (the relay's
ordering: one job per key at a time), so a reader that keeps the first copy of each event
id reads every key's records in commit order; a late copy may come after later records.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC
from typing import Any

from outbox.errors import ConfigurationError
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

#: A Kafka topic name: ASCII letters, digits, ``.``, ``_`` and ``-``, at most 249 characters
#: (Apache Kafka, ``org.apache.kafka.common.internals.Topic.validate``).
TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")

#: Broker error codes no retry can turn into an acknowledgement (the Kafka protocol's error
#: codes): invalid record (2), record too large (10), invalid topic (17), record batch too
#: large (18), topic and cluster authorization (29, 31), invalid timestamp (32), unsupported
#: for the message format (43). Every other code is retried.
PERMANENT_ERRORS = frozenset({2, 10, 17, 18, 29, 31, 32, 43})

#: librdkafka properties the sink sets itself and ``config`` may not: the ones its guarantees
#: rest on (idempotence, acks, the partitioner) and the ones it wires up.
OWNED_PROPERTIES = frozenset({
    "bootstrap.servers", "metadata.broker.list", "enable.idempotence", "acks", "request.required.acks",
    "partitioner", "partitioner_cb", "transactional.id", "on_delivery", "delivery.report.only.error",
    "error_cb", "logger", "enable.gapless.guarantee",
})

#: The producer settings the sink's guarantees rest on (the module notes): idempotence (hence
#: ``acks=all``) and the Java client's partitioner.
GUARANTEES: dict[str, str | bool] = {"enable.idempotence": True, "acks": "all", "partitioner": "murmur2_random"}

#: Seconds :meth:`Kafka.close` waits for the producer to deliver what it holds before dropping it.
CLOSE_TIMEOUT = 2.0

#: Seconds the poller thread blocks in one ``poll()`` (how soon it notices a stop).
POLL_SECONDS = 0.1

#: outbox's own headers; an event header of one of these names (any case) is replaced.
OUTBOX_HEADERS = ("Outbox-Event-Id", "Outbox-Topic", "Outbox-Key", "Outbox-Idempotency-Key", "Outbox-Created-At")
_OUTBOX_HEADERS_LOWER = frozenset(name.lower() for name in OUTBOX_HEADERS)

#: librdkafka error codes (``confluent_kafka.KafkaError``) the sink maps itself.
_PURGED = frozenset({-152, -151})  # _PURGE_QUEUE, _PURGE_INFLIGHT: dropped unsent by the sink
_DOWN = -187  # _ALL_BROKERS_DOWN
_TIMED_OUT = frozenset({-192, -185})  # _MSG_TIMED_OUT, _TIMED_OUT


def parse_bootstrap(bootstrap: object) -> list[str]:
    """The ``host:port`` entries of ``bootstrap`` (a string, comma-separated, or a sequence
    of strings). Raises :class:`ConfigurationError` naming what is wrong."""
    entries = bootstrap.split(",") if isinstance(bootstrap, str) else bootstrap
    if isinstance(entries, (bytes, Mapping)) or not isinstance(entries, Sequence) or not entries:
        raise ConfigurationError(f"Kafka: bootstrap must be 'host:port' (or several, comma-separated), "
                                 f"got {bootstrap!r}")
    servers = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigurationError(f"Kafka: bootstrap entries must be 'host:port' strings, got {entry!r}")
        host, _, port = entry.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in "/@ "):
            shown = entry.strip() if "@" not in entry else "<an entry with credentials>"
            raise ConfigurationError(f"Kafka: bootstrap entry {shown!r} must be host:port (a port from 1 to 65535, "
                                     "no scheme, no credentials: those are config properties)")
        servers.append(entry.strip())
    return servers


def parse_config(config: object) -> dict[str, str | int | float | bool]:
    """librdkafka properties for the producer (``{"security.protocol": "SASL_SSL", ...}``):
    string names, string, number or boolean values, none of :data:`OWNED_PROPERTIES`. Raises
    :class:`ConfigurationError` naming the property; :func:`check_config` then has librdkafka
    check the names and values."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"Kafka: config must be a mapping of librdkafka properties, got {config!r}")
    out: dict[str, str | int | float | bool] = {}
    for name, value in config.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"Kafka: config property names must be strings, got {name!r}")
        if name in OWNED_PROPERTIES:
            raise ConfigurationError(f"Kafka: config may not set {name!r}: the sink sets it (idempotent producer, "
                                     "acks=all, the murmur2 partitioner)")
        if not isinstance(value, str | int | float | bool):
            shown = "***" if "password" in name or "secret" in name else repr(value)
            raise ConfigurationError(f"Kafka: config {name!r} must be a string, number or boolean, got {shown}")
        out[name] = value
    return out


def check_config(config: Mapping[str, str | int | float | bool]) -> None:
    """Have librdkafka check ``config`` (names, values, combinations such as SASL without a
    user name) by building a producer with the sink's own settings and no bootstrap server,
    which opens no connection. Raises :class:`ConfigurationError` with librdkafka's answer."""
    import confluent_kafka  # noqa: PLC0415 (an optional dependency, imported when used)

    try:
        confluent_kafka.Producer({**config, **GUARANTEES, "logger": _LibrdkafkaLog()})
    except confluent_kafka.KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        text = error.str() if hasattr(error, "str") else str(error)
        raise ConfigurationError(f"Kafka: librdkafka refuses config: {text}") from None


class Kafka(Sink):
    """Produces a forwarder's jobs as records to Kafka (the module notes say what a record
    carries and what each outcome becomes).

    ``bootstrap``: ``"host:port"``, several comma-separated, or a list of them.
    ``topic``: a template of ``{topic}``, ``{key}``, ``{consumer}`` naming the Kafka topic
    (default ``"{topic}"``; a rendered name Kafka does not accept fails that record
    permanently). ``key``: a template for the record key (default ``"{key}"``; an event
    without a key gets a record without one), or None for no key at all. ``connect_timeout``:
    seconds :meth:`connect` waits for the cluster's metadata (default 5). ``config``: more
    librdkafka producer properties, passed through: TLS and SASL (``security.protocol``,
    ``ssl.ca.location``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``, ...) and
    tuning (``linger.ms``, ``compression.type``, ``message.max.bytes``,
    ``message.timeout.ms``, ...); not the ones in :data:`OWNED_PROPERTIES`.

    Needs ``pip install 'outbox-relay[kafka]'`` (confluent-kafka). Raises
    :class:`ConfigurationError` naming the option for a bad one (``config`` is checked by
    librdkafka itself, :func:`check_config`), or when confluent-kafka is not installed."""

    extra = "kafka"

    def __init__(self, bootstrap: str | Sequence[str] = "127.0.0.1:9092", *, topic: str = "{topic}",
                 key: str | None = "{key}", connect_timeout: float = 5.0,
                 config: Mapping[str, str | int | float | bool] | None = None) -> None:
        self.servers = parse_bootstrap(bootstrap)
        self.bootstrap = ",".join(self.servers)  # librdkafka's bootstrap.servers, and where logs say it sends
        try:
            self.topic = Template(topic, "topic")
            self.key = None if key is None else Template(key, "key")
        except ConfigurationError as exc:
            raise ConfigurationError(f"Kafka: {exc}") from None
        literal = self.topic.text.format(topic="t", key="k", consumer="c")
        if not TOPIC_NAME.fullmatch(literal):
            raise ConfigurationError(f"Kafka: topic template {self.topic.text!r} holds characters a Kafka topic "
                                     "name may not (only ASCII letters, digits, '.', '_', '-')")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float)) or not (
                0 < connect_timeout <= 3600):
            raise ConfigurationError(f"Kafka: connect_timeout must be seconds, more than 0 and at most 3600, "
                                     f"got {connect_timeout!r}")
        self.config = parse_config(config)
        if importlib.util.find_spec("confluent_kafka") is None:
            raise ConfigurationError("the Kafka sink needs confluent-kafka: pip install 'outbox-relay[kafka]'")
        check_config(self.config)
        self.connect_timeout = float(connect_timeout)
        self._producer: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._broken: str | None = None  # why the cluster is taken for unreachable (the keeper checks it again)
        # Why the producer is to be replaced (a fatal error, or a batch no record of which was
        # answered): the next connect starts a new producer, with a new producer id.
        self._fatal: str | None = None

    def describe(self) -> str:
        """The bootstrap servers (credentials are ``config`` properties, never shown) and the
        topic template: ``"kafka 127.0.0.1:9092 topic {topic}"``."""
        return f"kafka {self.bootstrap} topic {self.topic.text}"

    @property
    def connected(self) -> bool:
        """Whether the producer runs and the cluster answered since librdkafka last found
        every broker down."""
        return self._producer is not None and self._broken is None and self._fatal is None

    async def connect(self) -> None:
        """Start the producer (once; again only after a fatal error) and check that the
        cluster answers a metadata request within ``connect_timeout`` seconds. Raises
        :class:`SinkUnavailableError` saying why when it does not."""
        import confluent_kafka  # noqa: PLC0415 (an optional dependency, imported when used)

        if self._producer is None or self._fatal is not None or self._loop is not asyncio.get_running_loop():
            await self.close()
            self._loop = asyncio.get_running_loop()
            # The config passed check_config when the sink was built: librdkafka takes it.
            self._producer = confluent_kafka.Producer({
                "client.id": "outbox", **self.config, **GUARANTEES, "bootstrap.servers": self.bootstrap,
                "error_cb": self._on_error, "logger": _LibrdkafkaLog()})
            self._fatal = None
            self._stop = threading.Event()
            self._poller = threading.Thread(target=self._poll, args=(self._producer, self._stop),
                                            name="outbox-kafka-poll", daemon=True)
            self._poller.start()
        try:
            await asyncio.to_thread(self._producer.list_topics, timeout=self.connect_timeout)
        except confluent_kafka.KafkaException as exc:
            raise SinkUnavailableError(f"cannot reach Kafka at {self.bootstrap} within "
                                       f"{self.connect_timeout:g} s ({exc.args[0] if exc.args else exc})") from None
        self._broken = None

    async def send_many(self, messages: Sequence[Message], timeout: float,
                        answered: Answered | None = None) -> list[SendResult]:
        """Hand ``messages`` to the producer, each right after its deadline check, then wait up to
        ``timeout`` seconds in all for the acknowledgements; one result per message, in order,
        each passed to ``answered`` as it arrives (the module notes map the answers)."""
        producer, loop = self._producer, asyncio.get_running_loop()
        results: list[SendResult | None] = [None] * len(messages)
        if not self.connected:
            why = self._fatal or self._broken or "not connected"
            return [Unavailable(f"Kafka at {self.bootstrap}: {why}")] * len(messages)
        futures: dict[int, asyncio.Future[Any]] = {}
        for i, message in enumerate(messages):
            if time.monotonic() >= message.deadline:
                results[i] = Expired("not sent: its deadline passed before the hand-off to the producer")
                continue
            try:
                topic, key, headers, timestamp = self._record(message)
            except ValueError as exc:
                results[i] = Failed(str(exc), permanent=True)
                continue
            future: asyncio.Future[Any] = loop.create_future()
            try:
                producer.produce(topic, value=message.body, key=key, headers=headers, timestamp=timestamp,
                                 on_delivery=functools.partial(self._delivered, loop, future))
            except BufferError as exc:  # the local queue is full: the broker does not keep up or is away
                results[i] = Unavailable(f"the Kafka producer's queue is full ({exc})")
                continue
            except Exception as exc:  # noqa: BLE001 - a KafkaException names the record's own problem
                results[i] = self._outcome(_error_of(exc), describe_error(exc))
                continue
            futures[i] = future
            if answered is not None:
                future.add_done_callback(functools.partial(self._arrived, answered, i))
        pending: set[asyncio.Future[Any]] = set()
        if futures:
            _, pending = await asyncio.wait(futures.values(), timeout=timeout)
        for i, future in futures.items():
            if future in pending:
                results[i] = Failed(f"no acknowledgement within {timeout:g}s", unanswered=True)
            else:
                results[i] = self._answer(future)
        if futures and len(pending) == len(futures) and self._fatal is None:
            # Not one answer: the broker is silent, or it refuses this producer's session for
            # good (a restarted broker that lost its state answers UnknownProducerId, which
            # librdkafka retries until message.timeout.ms). A new producer settles both.
            self._fatal = f"no record of a batch of {len(futures)} answered within {timeout:g}s"
            log.info("Kafka at %s: %s; the producer is replaced", self.bootstrap, self._fatal)
        return [result if result is not None else Failed("no result") for result in results]

    async def close(self) -> None:
        """Give the producer :data:`CLOSE_TIMEOUT` seconds to deliver what it holds, drop the
        rest (those jobs are handed back and sent again) and stop it; safe when not started."""
        producer, poller, self._producer, self._poller = self._producer, self._poller, None, None
        if producer is None:
            return
        await asyncio.to_thread(producer.flush, CLOSE_TIMEOUT)
        producer.purge()
        await asyncio.to_thread(producer.flush, 0)
        self._stop.set()
        if poller is not None:
            await asyncio.to_thread(poller.join, CLOSE_TIMEOUT)

    def _record(self, message: Message) -> tuple[str, bytes | None, list[tuple[str, bytes]], int]:
        """(topic, key, headers, timestamp in ms) of ``message``'s record. Raises
        :class:`ValueError` naming the event for a topic name Kafka does not accept (a
        permanent failure)."""
        topic = self.topic.render(message)
        if not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
            raise ValueError(f"event {message.event_id}: topic {topic[:80]!r} is not a Kafka topic name (only ASCII "
                             "letters, digits, '.', '_', '-'; at most 249 characters)")
        key = None
        if self.key is not None and not ("key" in self.key.fields and message.key is None):
            key = self.key.render(message).encode()
        headers = [(name, value.encode()) for name, value in message.headers.items()
                   if name.lower() not in _OUTBOX_HEADERS_LOWER]
        headers += [("Outbox-Event-Id", str(message.event_id).encode()), ("Outbox-Topic", message.topic.encode()),
                    ("Outbox-Idempotency-Key", message.idempotency_key.encode()),
                    ("Outbox-Created-At", message.created_at.astimezone(UTC).isoformat().encode())]
        if message.key is not None:
            headers.append(("Outbox-Key", message.key.encode()))
        return topic, key, headers, int(message.created_at.timestamp() * 1000)

    @staticmethod
    def _poll(producer: Any, stop: threading.Event) -> None:
        """The poller thread: serve delivery reports and errors until ``stop``."""
        while not stop.is_set():
            producer.poll(POLL_SECONDS)

    @staticmethod
    def _delivered(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], error: Any, _: Any) -> None:
        """librdkafka's delivery report (poller thread): hand the error, or None, to the loop."""
        def settle() -> None:
            if not future.done():
                future.set_result(error)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed: nobody waits for the answer any more
            pass

    def _on_error(self, error: Any) -> None:
        """librdkafka's error callback (poller thread): every broker down, or a fatal error."""
        loop = self._loop
        if loop is None or not (error.code() == _DOWN or error.fatal()):
            return
        try:
            loop.call_soon_threadsafe(self._mark_down, str(error), bool(error.fatal()))
        except RuntimeError:
            pass

    def _mark_down(self, why: str, fatal: bool) -> None:
        """The cluster is unreachable (or the producer failed for good): report not connected
        and drop the records still queued unsent (their jobs are handed back)."""
        if fatal:
            self._fatal = why
        elif self._broken is None:
            self._broken = why
        else:
            return
        log.info("Kafka at %s: %s; records not yet sent are dropped (their jobs wait)", self.bootstrap, why)
        if self._producer is not None:
            self._producer.purge(in_queue=True, in_flight=False, blocking=False)

    def _arrived(self, answered: Answered, index: int, future: asyncio.Future[Any]) -> None:
        answered(index, self._answer(future))

    def _answer(self, future: asyncio.Future[Any]) -> SendResult:
        error = future.result()
        return Delivered() if error is None else self._outcome(error.code(), str(error))

    def _outcome(self, code: int | None, text: str) -> SendResult:
        """The result for a record librdkafka or the broker refused with ``code`` (a
        ``KafkaError`` code; None for another exception), ``text`` its description."""
        if code in PERMANENT_ERRORS:
            return Failed(f"refused by Kafka: {text}", permanent=True)
        if code in _PURGED:
            return Unavailable(f"not sent: dropped from the producer's queue while Kafka was unreachable ({text})")
        if code == _DOWN:
            return Unavailable(f"Kafka at {self.bootstrap} is unreachable ({text})")
        if code in _TIMED_OUT:
            return Failed(f"no acknowledgement from Kafka ({text})", unanswered=True)
        return Failed(f"Kafka: {text}")


class _LibrdkafkaLog:
    """Where librdkafka's own log lines go (its ``logger`` property): this module's logger,
    at DEBUG, since they repeat every reconnect attempt (a refused connection each 100 ms or
    so while a broker is down), and the forwarder logs each change of the broker's state once."""

    def log(self, level: int, fmt: str, *args: object) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("librdkafka: " + fmt, *args)


def _error_of(exc: BaseException) -> int | None:
    """The ``KafkaError`` code a ``KafkaException`` carries, else None."""
    error = exc.args[0] if exc.args else None
    code = getattr(error, "code", None)
    return code() if callable(code) else None

