"""Intake, the inbox: messages taken in from brokers and webhooks as local events, exactly once.

An intake (``Outbox.intake``) names a :class:`Source` (a JetStream durable pull consumer, a
RabbitMQ queue, Kafka topics in a consumer group, or signed webhooks) and how a message
becomes an event: its topic, its dedup identity and its key. The relay runs every broker
intake of its registry (``outbox-relay intake-http`` serves the webhook ones); each round
takes a batch from the source and, in **one transaction** of the receiving database:

* looks the batch's identities up in ``outbox_intake``: a message taken in before (a broker
  redelivery, the sender's re-send after its own crash) is dropped;
* writes one event per new message (topic, key, payload, headers: the sender's event id,
  key, headers and trace context travel in the headers) and one row of ``outbox_intake`` per
  new message naming the event it became; a message that cannot become an event (not UTF-8
  JSON, too large, no topic, no identity) is *rejected*: its row keeps the reason and its
  first bytes (:data:`KEPT_BODY_BYTES`), visible with ``outbox-relay intake rejected``;

then commits, and only then acknowledges the whole batch to the broker (taken, dropped and
rejected alike: a poison message never blocks the stream). A crash between the commit and
the acknowledgement makes the broker deliver the batch again; the identities are known by
then and it is dropped. A crash before the commit acknowledges nothing: the broker delivers
again and the messages are taken in then. From the event on, routing, handlers, fencing,
ordering and dead letters are those of any local event: a transactional handler with fenced
writes gives exactly one effect per message the sender committed.

The identity of a message (:func:`identity_of`), first found of: the intake's ``identity=``
(a function of the :class:`Received` message, say :func:`body_hash`), the sender's
``Outbox-Idempotency-Key`` header (an outbox forwarder's ``<consumer>:<event id>``, the same
on every re-send), the broker's message id (JetStream's ``Nats-Msg-Id``, RabbitMQ's
``message_id``, a webhook's ``webhook-id``, a Kafka record's position
``<topic>/<partition>/<offset>``: a re-read is dropped, a producer's re-send is caught only by
the header or ``identity=``). Identities are remembered
``intake_retention`` seconds (default 14 days: longer than Kafka's default retention of 7
days, the longest span over which a broker delivers a message again unless told to).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.db.event_rules import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.errors import ConfigurationError, InvalidEventError, OutboxError
from outbox.publish import EventDraft, check_name, make_event

#: First bytes of a rejected message's body kept in ``outbox_intake.body``.
KEPT_BODY_BYTES = 65_536
#: Longest identity, characters: a longer one (or one PostgreSQL cannot store: a NUL, a lone
#: surrogate) rejects its message, recorded under ``unfit:`` and a hash of it. The primary
#: key's btree refuses entries over about 2.7 kB.
MAX_IDENTITY_LENGTH = 512

#: Headers outbox's forwarders add; the sender's idempotency key is the default identity,
#: its key the default key and its topic the default topic of an intake.
IDEMPOTENCY_HEADER = "Outbox-Idempotency-Key"
KEY_HEADER = "Outbox-Key"
TOPIC_HEADER = "Outbox-Topic"

#: Headers that steer a broker, not describe an event: not copied into the event's headers.
BROKER_HEADERS = frozenset({"nats-msg-id", "nats-expected-stream", "nats-expected-last-msg-id",
                            "nats-expected-last-sequence", "nats-expected-last-subject-sequence", "nats-rollup",
                            "nats-ttl"})


@dataclass(frozen=True, slots=True)
class Received:
    """One message as a source received it. ``body``: its bytes. ``headers``: its headers,
    as strings (a header that is not text is dropped by the source). ``subject``: where it
    was addressed (a JetStream subject, a RabbitMQ routing key, a Kafka topic, a webhook's
    ``type``, or its intake's name when it has none). ``message_id``: the broker's id of it,
    or None. ``key``: the record key (Kafka), or None. ``token``: the source's handle to
    acknowledge it. ``deliveries``: how many times the broker has delivered it (1: first)."""

    body: bytes
    headers: Mapping[str, str]
    subject: str
    message_id: str | None = None
    key: str | None = None
    deliveries: int = 1
    token: Any = field(default=None, compare=False, repr=False)


class SourceUnavailableError(OutboxError):
    """Raised by a :class:`Source` when the broker cannot be reached; the relay retries."""


class Source(abc.ABC):
    """Where an intake takes messages from. Subclasses validate their options in
    ``__init__`` (raising :class:`ConfigurationError`), import their client library only in
    :meth:`connect`, and implement the coroutines below; a source is used by one relay,
    from one event loop, one call at a time."""

    #: The pip extra that installs the client library.
    extra: str = ""
    #: Whether the relay runs it (False for webhooks, which ``outbox-relay intake-http`` serves).
    pulled: bool = True

    @abc.abstractmethod
    def describe(self) -> str:
        """Where it reads, for logs, without credentials."""

    async def connect(self) -> None:  # noqa: B027 - a source without a connection (webhooks)
        """Open the connection (and what it needs: a durable consumer, a channel with a
        prefetch). Raises :class:`SourceUnavailableError` when the broker cannot be reached."""

    async def fetch(self, limit: int, wait: float) -> list[Received]:
        """Up to ``limit`` messages, waiting at most ``wait`` seconds for the first; [] when
        none came. Raises :class:`SourceUnavailableError` when the connection is down."""
        raise NotImplementedError

    async def ack(self, received: Sequence[Received]) -> None:
        """Acknowledge ``received`` (all from :meth:`fetch`, in order): the broker will not
        deliver them again. Called only after their transaction committed. Raises
        :class:`SourceUnavailableError` when the connection is down (they come again)."""
        raise NotImplementedError

    async def settle(self) -> None:  # noqa: B027 - nothing to wait for by default
        """Called once an ordered intake's relay has taken over, before its first fetch: wait
        until what the broker delivered to an earlier holder and was never acknowledged is
        delivered again ahead of newer messages (JetStream: up to ``ack_wait``)."""

    async def close(self) -> None:  # noqa: B027 - nothing to close by default
        """Close the connection; safe to call when it is not open. What was fetched and not
        acknowledged is delivered again by the broker."""


#: An intake's topic: one topic for every message, a mapping from subject to topic (a
#: subject not in it is rejected), or a function of the message returning the topic.
TopicRule = str | Mapping[str, str] | Callable[[Received], str] | None


@dataclass(frozen=True, slots=True)
class Intake:
    """One declared intake (``Outbox.intake``): messages of ``source`` become events.
    ``topic``: :data:`TopicRule` (None: the sender's ``Outbox-Topic`` header).
    ``identity``: a function of the :class:`Received` message giving its dedup identity
    (None: the default chain, :func:`identity_of`). ``key``: a function giving the event's
    key (None: the ``Outbox-Key`` header, else the record key). ``batch``: most messages per
    transaction. ``max_backlog``: the intake stops taking messages while this many events
    wait to be routed or jobs of its topics' consumers are ready (None: never).
    ``max_payload_bytes``: the largest body taken in (larger ones are rejected).
    ``ordered``: one relay at a time takes it in, so events are written in the order the
    broker delivers (the relay's intake loop notes)."""

    name: str
    source: Source
    topic: TopicRule = None
    identity: Callable[[Received], str] | None = None
    key: Callable[[Received], str | None] | None = None
    batch: int = 500
    max_backlog: int | None = 10_000
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    ordered: bool = False

    def topics(self) -> tuple[str, ...] | None:
        """The topics this intake can write, when known from its declaration (a topic or a
        mapping); None for a function or the sender's header."""
        if isinstance(self.topic, str):
            return (self.topic,)
        if isinstance(self.topic, Mapping):
            return tuple(sorted(set(self.topic.values())))
        return None


def declare(name: Any, source: Any, topic: Any, identity: Any, key: Any, batch: Any, max_backlog: Any,
            max_payload_bytes: Any, ordered: Any = False) -> Intake:
    """An :class:`Intake` from ``Outbox.intake``'s arguments; raises
    :class:`ConfigurationError` naming the option that is wrong."""
    try:
        check_name(name, "intake")
    except InvalidEventError as exc:
        raise ConfigurationError(f"intake name: {exc.problem}") from None
    where = f"intake {name!r}"
    if not isinstance(source, Source):
        raise ConfigurationError(f"{where}: source= must be a Source (JetStreamSource(...), RabbitMQSource(...), "
                                 f"KafkaSource(...), Webhook(...)), got {source!r}")
    if isinstance(topic, str):
        _check_topic(topic, where)
    elif isinstance(topic, Mapping):
        if not topic:
            raise ConfigurationError(f"{where}: topic= mapping is empty")
        for subject, mapped in topic.items():
            if not isinstance(subject, str):
                raise ConfigurationError(f"{where}: topic= mapping's keys must be subjects (str), got {subject!r}")
            _check_topic(mapped, where)
    elif topic is not None and not callable(topic):
        raise ConfigurationError(f"{where}: topic= must be a topic, a mapping from subject to topic, a function "
                                 f"of the message, or None (the sender's Outbox-Topic header), got {topic!r}")
    for option, value in (("identity", identity), ("key", key)):
        if value is not None and not callable(value):
            raise ConfigurationError(f"{where}: {option}= must be a function of the message or None, got {value!r}")
    if type(batch) is not int or not 1 <= batch <= 10_000:
        raise ConfigurationError(f"{where}: batch must be an int in 1..10000, got {batch!r}")
    if max_backlog is not None and (type(max_backlog) is not int or max_backlog < 1):
        raise ConfigurationError(f"{where}: max_backlog must be a positive int or None, got {max_backlog!r}")
    if max_backlog is not None and max_backlog < batch:
        raise ConfigurationError(f"{where}: max_backlog ({max_backlog}) must be at least batch ({batch}): the intake "
                                 "fetches a batch only while the backlog plus a batch fits")
    if type(max_payload_bytes) is not int or not 1 <= max_payload_bytes <= 256 * 1024 * 1024:
        raise ConfigurationError(f"{where}: max_payload_bytes must be an int in 1..268435456, got {max_payload_bytes!r}")
    if type(ordered) is not bool:
        raise ConfigurationError(f"{where}: ordered must be True or False, got {ordered!r}")
    if ordered and not source.pulled:
        raise ConfigurationError(f"{where}: ordered=True is for broker sources; webhooks arrive in no order")
    return Intake(name, source, topic, identity, key, batch, max_backlog, max_payload_bytes, ordered)


def _check_topic(topic: Any, where: str) -> None:
    try:
        check_name(topic, "topic")
    except InvalidEventError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def body_hash(message: Received) -> str:
    """An identity for messages that carry none: ``sha256:<hex>`` of the subject and the
    body. Two messages with the same subject and body are then the same message (taken in
    once), so use it only where that holds."""
    digest = hashlib.sha256(message.subject.encode() + b"\x00" + message.body).hexdigest()
    return f"sha256:{digest}"


def identity_of(intake: Intake, message: Received) -> str | None:
    """The dedup identity of ``message`` (module notes): ``intake.identity(message)``, else
    the ``Outbox-Idempotency-Key`` header, else the broker's message id; None when there is
    none. Raises what ``intake.identity`` raises."""
    if intake.identity is not None:
        return intake.identity(message)
    header = _header(message.headers, IDEMPOTENCY_HEADER)
    return header if header else message.message_id or None


@dataclass(frozen=True, slots=True)
class Arrival:
    """What one message becomes: an event (``event``), or rejected (``problem``). ``identity``
    is its dedup identity (for a message without one, :func:`body_hash` with a prefix
    ``unidentified:``, so the same poison message is recorded once)."""

    identity: str
    message: Received
    event: EventDraft | None = None
    problem: str | None = None


def arrival(intake: Intake, message: Received) -> Arrival:
    """Decide what ``message`` becomes under ``intake``'s rules. Never raises: an error of
    the intake's own functions, or anything the message makes fail (a body nested too deep
    to parse), rejects the message, naming it."""
    try:
        return _arrival(intake, message)
    except Exception as exc:  # noqa: BLE001 - whatever a hostile message makes fail rejects it, never the intake
        return Arrival(_unidentified(message), message, problem=clean_text(f"{type(exc).__name__}: {exc}"))


def _arrival(intake: Intake, message: Received) -> Arrival:
    try:
        identity = identity_of(intake, message)
    except Exception as exc:  # noqa: BLE001 - a user function's failure rejects the message
        return Arrival(_unidentified(message), message,
                       problem=clean_text(f"identity= raised {type(exc).__name__}: {exc}"))
    if not isinstance(identity, str) or not identity:
        why = ("no identity: no Outbox-Idempotency-Key header and no message id (pass identity= to the intake, "
               "say outbox.intake.body_hash)" if identity is None else f"identity= returned {identity!r}")
        return Arrival(_unidentified(message), message, problem=clean_text(why))
    if len(identity) > MAX_IDENTITY_LENGTH or clean_text(identity) != identity:
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()
        return Arrival(f"unfit:sha256:{digest}", message,
                       problem=f"identity of {len(identity)} characters is over {MAX_IDENTITY_LENGTH} or holds a NUL or "
                               "a lone surrogate")
    if len(message.body) > intake.max_payload_bytes:
        return Arrival(identity, message, problem=f"body of {len(message.body)} bytes is over the intake's "
                                                  f"max_payload_bytes {intake.max_payload_bytes}")
    try:
        payload = json.loads(message.body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return Arrival(identity, message, problem=clean_text(f"body is not UTF-8 JSON: {exc}"))
    try:
        topic = topic_of(intake, message)
        key = key_of(intake, message)
    except Exception as exc:  # noqa: BLE001 - a user function's failure rejects the message
        return Arrival(identity, message, problem=clean_text(str(exc) if isinstance(exc, LookupError) else
                                                             f"{type(exc).__name__}: {exc}"))
    headers = {name: value for name, value in message.headers.items() if name.lower() not in BROKER_HEADERS}
    try:
        event = make_event(topic, payload, key, headers, max_payload_bytes=intake.max_payload_bytes)
    except InvalidEventError as exc:
        return Arrival(identity, message, problem=clean_text(f"not a valid event: {exc}"))
    return Arrival(identity, message, event=event)


def clean_text(value: str) -> str:
    """``value`` as PostgreSQL text can hold it: a NUL written ``\\u0000`` and a lone
    surrogate as its escape (``\\udc80``); anything else unchanged."""
    if "\x00" in value:
        value = value.replace("\x00", "\\u0000")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def topic_of(intake: Intake, message: Received) -> str:
    """The topic ``message`` is taken in under; raises :class:`LookupError` naming what is
    missing (a subject the mapping lacks, no ``Outbox-Topic`` header)."""
    rule = intake.topic
    if isinstance(rule, str):
        return rule
    if isinstance(rule, Mapping):
        if message.subject not in rule:
            raise LookupError(f"no topic for subject {message.subject!r} in the intake's topic= mapping")
        return rule[message.subject]
    if rule is None:
        topic = _header(message.headers, TOPIC_HEADER)
        if topic is None:
            raise LookupError("no topic: the message has no Outbox-Topic header and the intake declares no topic=")
        return topic
    topic = rule(message)
    if not isinstance(topic, str):
        raise LookupError(f"topic= returned {topic!r}, not a topic name")
    return topic


def key_of(intake: Intake, message: Received) -> str | None:
    """The event key of ``message``: ``intake.key(message)``, else its ``Outbox-Key`` header,
    else its record key."""
    if intake.key is not None:
        return intake.key(message)
    return _header(message.headers, KEY_HEADER) or message.key


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lowered), None)
    return value


def _unidentified(message: Received) -> str:
    return "unidentified:" + body_hash(message)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def finite(value: float) -> bool:
    """Whether ``value`` is a finite number (for sources' time options)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
