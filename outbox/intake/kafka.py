"""Taking records in from Kafka topics in a consumer group (``pip install
'outbox-relay[kafka]'``, confluent-kafka, the client the Kafka sink uses).

The source is a librdkafka consumer of the consumer group ``group``, subscribed to
``topics``: the group shares the topics' partitions among the relays that run the intake
(a rebalance moves them when a relay comes or goes). Offsets are never committed by the
client on its own (``enable.auto.commit`` and ``enable.auto.offset.store`` off): after the
transaction that took a batch in has committed, the source commits, synchronously, the
offset after the batch's last record of each partition. Every record before a committed
offset is therefore in the database, and a commit that did not happen (a relay killed
between its transaction and its offset commit, a commit lost in an outage, one the group
refused because a rebalance gave the partition to another relay) leaves the offset behind:
whoever reads the partition next starts from it, reads those records again and drops them
by their identity: the sender's ``Outbox-Idempotency-Key`` header, else the record's
position ``<topic>/<partition>/<offset>`` (the same on every read; a producer's re-send is
a new record at a new offset, which only the header, or the intake's ``identity=``,
recognizes). A topic deleted and created again numbers its records from 0 again: give
its intake a new name then, or positions remembered from before drop new records.

Records are read ``read_committed`` (a producer transaction's records once it committed,
never those of one that aborted). A group without a committed offset for a partition
starts at ``auto_offset_reset``, as does one whose committed offset is gone (retention).
The consumer, and its place in the group, is kept across a broker outage (librdkafka
reconnects; the relay checks the cluster with a metadata request until it answers) and
replaced after a fatal error. A relay that does not fetch for librdkafka's
``max.poll.interval.ms`` (5 minutes by default: a database outage holding its batch, an
intake stopped at its ``max_backlog``) leaves the group and joins again at its next
fetch; its partitions went to the others meanwhile, and its late commit is refused and
ignored (the records come again, and are dropped). librdkafka's calls block: each runs on
a worker thread, one at a time per consumer, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from outbox.errors import ConfigurationError
from outbox.intake import Received, Source, SourceUnavailableError, finite
from outbox.sinks.kafka import TOPIC_NAME, parse_bootstrap

log = logging.getLogger(__name__)

#: librdkafka properties the source sets itself and ``config`` may not: the ones its
#: guarantees rest on (no automatic commit, read_committed) and its options and wiring.
OWNED_PROPERTIES = frozenset({
    "bootstrap.servers", "metadata.broker.list", "group.id", "enable.auto.commit", "auto.commit.enable",
    "enable.auto.offset.store", "auto.offset.reset", "isolation.level", "enable.partition.eof", "error_cb",
    "logger", "on_commit",
})

#: Longest consumer group id the source accepts.
GROUP_MAX = 255

#: librdkafka error codes (``confluent_kafka.KafkaError``) the source maps itself.
_EOF = -191  # _PARTITION_EOF: the end of a partition reached (not an error)
_POLL_EXCEEDED = -147  # _MAX_POLL_EXCEEDED: left the group for not fetching; librdkafka joins again
_DOWN = -187  # _ALL_BROKERS_DOWN
#: A commit refused because the partitions moved: ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID,
#: REBALANCE_IN_PROGRESS, STALE_MEMBER_EPOCH, _ASSIGNMENT_LOST.
_MOVED = frozenset({22, 25, 27, 113, -142})


class KafkaSource(Source):
    """Reads ``topics`` of the Kafka cluster at ``bootstrap_servers`` as a member of the
    consumer group ``group`` (the module notes say when a record comes again).

    ``bootstrap_servers``: ``"host:port"``, several comma-separated. ``topics``: the topic
    names (a non-empty list; no patterns). ``group``: the consumer group id (every relay
    running the intake joins it; one group per intake). ``auto_offset_reset``: where a
    partition without a committed offset starts, ``"earliest"`` (default) or ``"latest"``.
    ``connect_timeout``: seconds :meth:`connect` waits for the cluster's metadata (default
    5). ``config``: more librdkafka consumer properties, passed through: TLS and SASL
    (``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``, ...)
    and tuning (``session.timeout.ms``, ``max.poll.interval.ms``,
    ``partition.assignment.strategy``, ...); not the ones in :data:`OWNED_PROPERTIES`.
    Raises :class:`ConfigurationError` naming the option for a bad one (``config`` is
    checked by librdkafka itself), or when confluent-kafka is not installed."""

    extra = "kafka"

    def __init__(self, bootstrap_servers: str, *, topics: Sequence[str], group: str,
                 auto_offset_reset: str = "earliest", connect_timeout: float = 5.0,
                 config: Mapping[str, str | int | float | bool] | None = None) -> None:
        if not isinstance(bootstrap_servers, str):
            raise ConfigurationError(f"KafkaSource: bootstrap_servers must be 'host:port' (or several, "
                                     f"comma-separated), got {bootstrap_servers!r}")
        try:
            self.bootstrap = ",".join(parse_bootstrap(bootstrap_servers))
        except ConfigurationError as exc:
            raise ConfigurationError(f"KafkaSource: bootstrap_servers: {str(exc).removeprefix('Kafka: ')}") from None
        if isinstance(topics, (str, bytes, Mapping)) or not isinstance(topics, Sequence) or not topics:
            raise ConfigurationError(f"KafkaSource: topics must be a non-empty list of topic names, got {topics!r}")
        for topic in topics:
            if not isinstance(topic, str) or not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
                raise ConfigurationError(f"KafkaSource: topics: {topic!r} is not a Kafka topic name (only ASCII "
                                         "letters, digits, '.', '_', '-'; at most 249 characters)")
        if (not isinstance(group, str) or not group.strip() or len(group) > GROUP_MAX
                or any(not c.isprintable() for c in group)):
            raise ConfigurationError(f"KafkaSource: group must be a consumer group id (1..{GROUP_MAX} printable "
                                     f"characters), got {group!r}")
        if auto_offset_reset not in ("earliest", "latest"):
            raise ConfigurationError(f"KafkaSource: auto_offset_reset must be 'earliest' or 'latest', "
                                     f"got {auto_offset_reset!r}")
        if not finite(connect_timeout) or not 0 < connect_timeout <= 3600:
            raise ConfigurationError(f"KafkaSource: connect_timeout must be seconds in (0, 3600], "
                                     f"got {connect_timeout!r}")
        self.config = _parse_config(config)
        if importlib.util.find_spec("confluent_kafka") is None:
            raise ConfigurationError("KafkaSource needs confluent-kafka: pip install 'outbox-relay[kafka]'")
        self.topics = tuple(dict.fromkeys(topics))
        self.group = group
        self.auto_offset_reset = auto_offset_reset
        self.connect_timeout = float(connect_timeout)
        _check_config(self._settings(None))
        self._conn: _Connection | None = None

    def describe(self) -> str:
        """The bootstrap servers (credentials are ``config`` properties, never shown), the
        topics and the group: ``"kafka 127.0.0.1:9092 topics orders group 'billing'"``."""
        return f"kafka {self.bootstrap} topics {','.join(self.topics)} group {self.group!r}"

    async def connect(self) -> None:
        """Start the consumer (once; again after :meth:`close` or a fatal error), check that
        the cluster answers a metadata request within ``connect_timeout`` seconds and holds
        every topic, then subscribe (joining the group). Raises
        :class:`SourceUnavailableError` saying why when it does not."""
        import confluent_kafka  # noqa: PLC0415 (an optional dependency, imported when used)

        conn = self._conn
        if conn is None or conn.fatal is not None:
            await self.close()
            conn = _Connection()
            conn.consumer = confluent_kafka.Consumer(self._settings(conn.on_error))
            self._conn = conn
        try:
            metadata = await conn.call(conn.consumer.list_topics, timeout=self.connect_timeout)
        except (confluent_kafka.KafkaException, RuntimeError) as exc:
            raise SourceUnavailableError(f"cannot reach Kafka at {self.bootstrap} within "
                                         f"{self.connect_timeout:g} s ({_text(exc)})") from None
        missing = [t for t in self.topics if t not in metadata.topics or metadata.topics[t].error is not None]
        if missing:
            raise SourceUnavailableError(f"Kafka at {self.bootstrap} has no topic {', '.join(missing)}")
        if not conn.subscribed:
            conn.consumer.subscribe(list(self.topics))
            conn.subscribed = True
        conn.down = conn.problem = None

    async def fetch(self, limit: int, wait: float) -> list[Received]:
        """Up to ``limit`` records, waiting up to ``wait`` seconds for the first. Raises
        :class:`SourceUnavailableError` when every broker is down, after a fatal error or
        an error of a topic (it no longer exists, access refused): after the records read
        with it, at the next fetch."""
        import confluent_kafka  # noqa: PLC0415

        conn = self._conn
        if conn is None or not conn.subscribed:
            raise SourceUnavailableError(f"not connected to {self.describe()}")
        if conn.trouble() is not None:
            raise SourceUnavailableError(f"{self.describe()}: {conn.trouble()}")
        try:
            messages = await conn.call(_consume, conn.consumer, limit, wait)
        except (confluent_kafka.KafkaException, RuntimeError) as exc:  # RuntimeError: closed meanwhile
            raise SourceUnavailableError(f"fetch from {self.describe()} failed ({_text(exc)})") from None
        received = []
        for message in messages:
            error = message.error()
            if error is None:
                received.append(_received(message))
            elif error.fatal():
                conn.fatal = str(error)
            elif error.code() == _POLL_EXCEEDED:
                log.info("%s: left the group for not fetching in time (%s); joining again", self.describe(), error)
            elif error.code() != _EOF:
                conn.problem = conn.problem or str(error)
        if not received and conn.down is not None and conn.fatal is None and conn.problem is None:
            # The report of an outage can come after its end (librdkafka queues it): ask.
            with contextlib.suppress(confluent_kafka.KafkaException, RuntimeError):
                await conn.call(conn.consumer.list_topics, timeout=min(self.connect_timeout, 1.0))
                conn.down = None
        # Records read with an error are handed over first: their offsets are past, and the
        # next commit must not cover records that were never taken in.
        if not received and conn.trouble() is not None:
            raise SourceUnavailableError(f"{self.describe()}: {conn.trouble()}")
        return received

    async def ack(self, received: Sequence[Received]) -> None:
        """Commit, synchronously, the offset after the last record of each partition in
        ``received``. A commit the group refuses because a rebalance moved the partitions
        is logged and ignored (the records are read again and dropped); any other failure
        raises :class:`SourceUnavailableError`."""
        import confluent_kafka  # noqa: PLC0415

        if not received:
            return
        conn = self._conn
        if conn is None:
            raise SourceUnavailableError(f"not connected to {self.describe()}")
        last: dict[tuple[str, int], int] = {}
        for message in received:
            topic, partition, offset = message.token
            last[(topic, partition)] = max(offset, last.get((topic, partition), -1))
        offsets = [confluent_kafka.TopicPartition(t, p, o + 1) for (t, p), o in sorted(last.items())]
        codes: list[int | None]
        try:
            answered = await conn.call(conn.consumer.commit, offsets=offsets, asynchronous=False)
            failed = [tp for tp in answered or () if tp.error is not None]
            codes, why = [tp.error.code() for tp in failed], "; ".join(f"{tp.topic}[{tp.partition}]: {tp.error}"
                                                                    for tp in failed)
        except (confluent_kafka.KafkaException, RuntimeError) as exc:
            codes, why = [_code(exc)], _text(exc)
        if not codes:
            return
        if all(code in _MOVED for code in codes):
            log.info("%s: offsets not committed, the partitions moved to another member (%s); their records "
                     "will be read again and dropped", self.describe(), why)
            return
        raise SourceUnavailableError(f"committing offsets on {self.describe()} failed ({why})")

    async def close(self) -> None:
        """Close the consumer (it leaves the group; its partitions go to the others); safe
        when not open. What was fetched and not committed is read again from the
        committed offsets."""
        conn, self._conn = self._conn, None
        if conn is not None and conn.consumer is not None:
            try:
                await conn.call(conn.consumer.close)
            except Exception:  # noqa: BLE001 - closing after a failure: nothing more to say
                pass

    def _settings(self, on_error: Callable[[Any], None] | None) -> dict[str, Any]:
        """The consumer's librdkafka properties (``config``, then the source's own)."""
        settings: dict[str, Any] = {
            "client.id": "outbox-intake", **self.config, "group.id": self.group, "enable.auto.commit": False,
            "enable.auto.offset.store": False, "auto.offset.reset": self.auto_offset_reset,
            "isolation.level": "read_committed", "enable.partition.eof": False, "logger": _LibrdkafkaLog()}
        if on_error is not None:
            settings |= {"bootstrap.servers": self.bootstrap, "error_cb": on_error}
        return settings


class _Connection:
    """One consumer, the lock its calls take turns on, and what its error callback saw:
    every broker down (``down``, cleared once a metadata request is answered again), a
    fatal error (``fatal``: the consumer is replaced), an error of a topic (``problem``)."""

    def __init__(self) -> None:
        self.consumer: Any = None
        self.subscribed = False
        self.lock = threading.Lock()
        self.down: str | None = None
        self.fatal: str | None = None
        self.problem: str | None = None

    def trouble(self) -> str | None:
        return self.fatal or self.down or self.problem

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on a worker thread, after the consumer's calls before."""
        def locked() -> Any:
            with self.lock:
                return function(*args, **kwargs)

        return await asyncio.to_thread(locked)

    def on_error(self, error: Any) -> None:
        """librdkafka's error callback (on the thread of a consumer call): every broker down,
        or a fatal error; the others (a broker's connection lost) librdkafka retries itself."""
        if error.fatal():
            self.fatal = str(error)
        elif error.code() == _DOWN:
            self.down = f"every broker is unreachable ({error})"


def _consume(consumer: Any, limit: int, wait: float) -> list[Any]:
    """What the consumer holds, up to ``limit``; when it holds nothing, the first record to
    come within ``wait`` seconds and what came with it (librdkafka's ``consume`` waits its
    whole timeout unless ``limit`` records come)."""
    messages: list[Any] = consumer.consume(num_messages=limit, timeout=0)
    if not messages:
        messages = consumer.consume(num_messages=1, timeout=max(wait, 0.0))
        if messages and limit > 1:
            messages += consumer.consume(num_messages=limit - 1, timeout=0)
    return messages


def _received(message: Any) -> Received:
    headers: dict[str, str] = {}
    for name, value in message.headers() or ():
        if isinstance(value, bytes):
            try:
                headers[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                continue
    key = message.key()
    try:
        text_key = key.decode("utf-8") if isinstance(key, bytes) else None
    except UnicodeDecodeError:
        text_key = None
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    return Received(body=message.value() or b"", headers=headers, subject=topic,
                    message_id=f"{topic}/{partition}/{offset}", key=text_key, token=(topic, partition, offset))


def _parse_config(config: object) -> dict[str, str | int | float | bool]:
    """librdkafka consumer properties: string names, string, number or boolean values, none
    of :data:`OWNED_PROPERTIES`. Raises :class:`ConfigurationError` naming the property."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"KafkaSource: config must be a mapping of librdkafka properties, got {config!r}")
    out: dict[str, str | int | float | bool] = {}
    for name, value in config.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"KafkaSource: config property names must be strings, got {name!r}")
        if name in OWNED_PROPERTIES:
            raise ConfigurationError(f"KafkaSource: config may not set {name!r}: the source sets it (its options, "
                                     "no automatic commit, read_committed)")
        if not isinstance(value, str | int | float | bool):
            shown = "***" if "password" in name or "secret" in name else repr(value)
            raise ConfigurationError(f"KafkaSource: config {name!r} must be a string, number or boolean, got {shown}")
        out[name] = value
    return out


def _check_config(settings: Mapping[str, Any]) -> None:
    """Have librdkafka check the consumer's properties by building a consumer with no
    bootstrap server (which opens no connection), then closing it. Raises
    :class:`ConfigurationError` with librdkafka's answer."""
    import confluent_kafka  # noqa: PLC0415 (an optional dependency, imported when used)

    try:
        confluent_kafka.Consumer(dict(settings)).close()
    except confluent_kafka.KafkaException as exc:
        raise ConfigurationError(f"KafkaSource: librdkafka refuses config: {_text(exc)}") from None


def _code(exc: BaseException) -> int | None:
    """The ``KafkaError`` code a ``KafkaException`` carries, else None."""
    code = getattr(exc.args[0] if exc.args else None, "code", None)
    return code() if callable(code) else None


def _text(exc: BaseException) -> str:
    """librdkafka's description of the error ``exc`` carries, else ``"Type: message"``."""
    error = exc.args[0] if exc.args else None
    text = getattr(error, "str", None)
    return str(text()) if callable(text) else f"{type(exc).__name__}: {exc}"


class _LibrdkafkaLog:
    """Where librdkafka's own log lines go (its ``logger`` property): this module's logger,
    at DEBUG (they repeat every reconnect attempt while a broker is down)."""

    def log(self, level: int, fmt: str, *args: object) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("librdkafka: " + fmt, *args)
