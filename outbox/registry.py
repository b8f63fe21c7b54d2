"""Outbox: the registry of subscribers, declared in Python with ``@ob.subscriber``.

A subscriber is a (topic, consumer) pair and a handler. The relay writes every pair to
``outbox_subscriptions`` when it starts, so routing is deterministic and visible with SQL;
a consumer name is unique within a registry. Declarations are validated when made, so a
bad option fails at import time of the application module, not in the middle of a run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from pydantic import BaseModel

from outbox import typed_events
from outbox.db.event_rules import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.errors import ConfigurationError, InvalidEventError
from outbox.intake import Intake, Received, Source, TopicRule, declare
from outbox.job import Job
from outbox.publish import check_name
from outbox.schedule import Schedule, make_schedule
from outbox.sinks import Sink

_Handler = TypeVar("_Handler", bound=Callable[..., Any])

#: Most attempts a subscriber may allow.
MAX_ATTEMPTS_LIMIT = 1000
#: Most running jobs a concurrency cap may allow.
MAX_CONCURRENCY = 10_000
#: Seconds per unit of a rate limit string (``"100/s"``, ``"6000/m"``, ``"1/h"``).
RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}

#: Seconds a forwarder waits, by default, for the broker to acknowledge a batch.
FORWARD_TIMEOUT = 10.0

#: What a dead job does to its key under ``ordered=True``.
OnDead = Literal["block", "skip"]

#: A lease-mode handler: ``handler(job)``, a ``def`` or an ``async def``; what it returns is
#: ignored. The decorator returns it unchanged, so its own type is kept.
LeaseHandlerT = TypeVar("LeaseHandlerT", bound=Callable[[Job], object])
#: A transactional handler: ``handler(job, session)``.
TransactionalHandlerT = TypeVar("TransactionalHandlerT", bound=Callable[[Job, Any], object])
#: Either, when ``transactional`` is not a literal.
HandlerT = TypeVar("HandlerT", bound=Callable[..., object])


@dataclass(frozen=True, slots=True)
class Subscriber:
    """One declared subscriber: ``handler`` runs for every event on one of ``topics``, once
    per event for ``consumer``. A forwarder (:meth:`Outbox.forward`) has a ``sink`` instead:
    its jobs are sent to that broker (``handler`` is :func:`forwarded_by_sink`, never
    called). ``lease`` is seconds, or None for the relay's default lease.
    ``transactional`` handlers take ``(job, session)`` (an ``AsyncSession`` when
    ``is_async``) and run inside the transaction that completes the job; the others take
    ``(job)`` and run outside any transaction.
    ``priority``: lower runs first (default 0).

    Ordering and flow control (architecture notes, "Ordering" and "Flow control"):
    ``ordered``: the jobs of one event key run one at a time, in the commit order of their
    events; ``on_dead``: ``"block"`` (a dead job holds its key back until redriven or
    skipped) or ``"skip"`` (the key goes on). ``concurrency``: most running jobs of this
    consumer across all relays (None: no cap). ``rate_limit``: most claims per second across
    all relays (None: no limit). ``timeout``: seconds a handler may run before its attempt
    is failed (None: no limit); a forwarder's is how long it waits for the broker's
    acknowledgements of a batch. ``payload_type``: the pydantic model the payload is
    validated as (``handler`` then decodes it first: :mod:`outbox.typed_events`)."""

    topics: tuple[str, ...]
    consumer: str
    handler: Callable[..., Any]
    max_attempts: int
    lease: float | None
    transactional: bool
    priority: int
    is_async: bool
    ordered: bool = False
    on_dead: str = "block"
    concurrency: int | None = None
    rate_limit: float | None = None
    timeout: float | None = None
    sink: Sink | None = None
    payload_type: type[BaseModel] | None = None
    coalesce: bool = False


def forwarded_by_sink(job: Job) -> None:
    """The ``handler`` of a forwarder's :class:`Subscriber`: its jobs go to its sink, so
    reaching this is a bug; raises :class:`ConfigurationError`."""
    raise ConfigurationError(f"job {job.id} of {job.consumer!r} belongs to a forwarder: its sink sends it, "
                             "no handler runs it")


class Outbox:
    """The registry of subscribers of one application.

    >>> ob = Outbox()
    >>> @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=5)
    ... def send_receipt(job): ...
    """

    def __init__(self) -> None:
        self._subscribers: dict[str, Subscriber] = {}
        self._schedules: dict[str, Schedule] = {}
        self._intakes: dict[str, Intake] = {}
        #: failure hooks by consumer, then by kind ("dead", "retry")
        self._hooks: dict[str, dict[str, list[Callable[..., Any]]]] = {}
        #: consumers listed by a fan-in, by topic
        self._fanned_in: dict[str, set[str]] = {}

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[False] = ..., priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ...,
    ) -> Callable[[LeaseHandlerT], LeaseHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[True], priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ...,
    ) -> Callable[[TransactionalHandlerT], TransactionalHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: bool, priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ...,
    ) -> Callable[[HandlerT], HandlerT]: ...

    def subscriber(
        self,
        topic: str | Sequence[str],
        *,
        consumer: str | None = None,
        max_attempts: int = 5,
        lease: float | None = None,
        transactional: bool = False,
        priority: int = 0,
        ordered: bool = False,
        on_dead: OnDead = "block",
        concurrency: int | None = None,
        rate_limit: str | float | None = None,
        timeout: float | None = None,
        payload: type[BaseModel] | None = None,
    ) -> Callable[[Any], Any]:
        """Decorator declaring ``handler`` as consumer ``consumer`` (default: the
        function's ``module.qualname``) of events on ``topic`` (a topic, or a sequence of
        them: one consumer of several topics, ordered across them by key when ``ordered``).

        ``max_attempts``: 1..1000 attempts before the job is dead-lettered (default 5).
        ``lease``: seconds a claim lasts without a heartbeat (heartbeats run every
        lease/3); default the relay's ``default_lease``. ``transactional``: run the handler
        as ``handler(job, session)`` inside the transaction that completes the job: a
        ``Session`` for a plain ``def``, an ``AsyncSession`` for an ``async def`` (the same
        fenced commit either way). ``priority``: -32768..32767, lower first.

        ``ordered``: for one event key, at most one job of this consumer runs at a time, and
        only once every job of an earlier event of that key (earlier: its publishing
        transaction committed first) is done; events without a key stay unordered.
        ``on_dead`` (ordered only): ``"block"`` (default) keeps the key waiting behind a dead
        job until it is redriven or skipped (``outbox-relay skip``); ``"skip"`` lets the key go
        on. ``concurrency``: 1..10000 running jobs of this consumer at most, across all relays.
        ``rate_limit``: claims per second across all relays, a positive number or a string
        ``"N/s"``, ``"N/m"`` or ``"N/h"``. ``timeout``: seconds (0.01..86400) an attempt may
        run; then it is failed and counted, as if the handler had raised.
        ``payload``: a pydantic model class the payload is validated as before each attempt
        (``job.payload`` is then an instance; one that does not validate is dead at once);
        a first parameter annotated ``Job[Model]`` declares it too (:mod:`outbox.typed_events`).

        Raises :class:`ConfigurationError` naming the option for bad values, a duplicate
        consumer name, or a handler whose signature does not fit its mode. Returns the
        handler unchanged, and type checkers see it so: ``@ob.subscriber(...)`` on
        ``def f(job: Job) -> None`` leaves ``f`` typed as that function; a lease-mode
        handler must accept ``(Job)``, a transactional one ``(Job, session)``.
        """

        def register(handler: HandlerT) -> HandlerT:
            name = consumer if consumer is not None else f"{handler.__module__}.{handler.__qualname__}"
            sub = _validated(topic, name, handler, max_attempts, lease, transactional, priority)
            model = typed_events.declared_payload(handler, payload, f"consumer {name!r}")
            if model is not None:
                sub = dataclasses.replace(sub, handler=typed_events.typed_handler(handler, model), payload_type=model)
            self._add(_with_flow(sub, ordered, on_dead, concurrency, rate_limit, timeout))
            return handler

        return register

    def forward(
        self,
        topic: str | Sequence[str],
        *,
        to: Sink,
        consumer: str,
        max_attempts: int = 5,
        lease: float | None = None,
        priority: int = 0,
        ordered: bool = False,
        on_dead: OnDead = "block",
        concurrency: int | None = None,
        rate_limit: str | float | None = None,
        timeout: float = FORWARD_TIMEOUT,
    ) -> None:
        """Declare a forwarder: consumer ``consumer`` of ``topic`` (one or a sequence) whose
        jobs are sent to the broker ``to`` (a :class:`~outbox.sinks.Sink`:
        :class:`~outbox.JetStream`, :class:`~outbox.RabbitMQ`, :class:`~outbox.Kafka`), one message per event, with
        the full job lifecycle: claimed, fenced, retried with backoff, dead-lettered
        (forwarding notes). A job completes only once the broker has
        acknowledged its message.

        ``timeout``: seconds (0.01..86400, default 10) the relay waits for the broker's
        acknowledgements of a batch; a message unacknowledged by then is a failed attempt.
        The other options are :meth:`subscriber`'s.

        Raises :class:`ConfigurationError` naming the option for bad values, a sink that is
        not a :class:`~outbox.sinks.Sink`, or a consumer name already declared.
        """
        if not isinstance(to, Sink):
            raise ConfigurationError(f"forwarder {consumer!r}: to= must be a Sink (JetStream(...), RabbitMQ(...), Kafka(...)), "
                                     f"got {to!r}")
        if timeout is None:
            raise ConfigurationError(f"forwarder {consumer!r}: timeout must be seconds in 0.01..86400, got None")
        sub = _validated(topic, consumer, forwarded_by_sink, max_attempts, lease, False, priority)
        sub = _with_flow(sub, ordered, on_dead, concurrency, rate_limit, timeout)
        self._add(dataclasses.replace(sub, sink=to))

    def intake(
        self,
        name: str,
        *,
        source: Source,
        topic: TopicRule = None,
        identity: Callable[[Received], str] | None = None,
        key: Callable[[Received], str | None] | None = None,
        batch: int = 500,
        max_backlog: int | None = 10_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        ordered: bool = False,
    ) -> Intake:
        """Declare an intake (the inbox, :mod:`outbox.intake`): the messages of ``source``
        become events of this database, each once, whatever the broker redelivers or the
        sender re-sends. The relay runs it (``outbox-relay intake-http`` serves a
        :class:`~outbox.intake.webhooks.Webhook` source); subscribers handle its events as any.

        ``name``: the intake's durable name (its identities are remembered under it; unique
        within the registry). ``source``: a :class:`~outbox.intake.jetstream.JetStreamSource`,
        :class:`~outbox.intake.rabbitmq.RabbitMQSource`, :class:`~outbox.intake.kafka.KafkaSource`
        or :class:`~outbox.intake.webhooks.Webhook`. ``topic``: the events' topic: a name, a
        mapping from the message's subject (JetStream subject, RabbitMQ routing key, Kafka
        topic, webhook ``type``) to a name (a subject not in it is rejected), a function of
        the :class:`~outbox.intake.Received` message, or None (default: the sender's
        ``Outbox-Topic`` header, which outbox's forwarders send). ``identity``: a function
        giving a message's dedup identity (default: the ``Outbox-Idempotency-Key`` header,
        else the broker's message id; :func:`outbox.intake.body_hash` for messages with
        neither). ``key``: a function giving the event's key (default: the ``Outbox-Key``
        header, else the record key). ``batch``: 1..10000 messages per transaction (default
        500). ``max_backlog``: stop taking in while this many events wait to be routed or
        jobs of the topics' consumers are ready (default 10,000; None: never).
        ``max_payload_bytes``: larger bodies are rejected (default publish's 1 MiB).
        ``ordered``: one relay at a time takes this intake in (the others stand by), so the
        events are written in the order the broker delivers them and an ordered subscriber
        sees each key in the sender's order (Kafka keeps it per partition, RabbitMQ per
        queue, JetStream per stream); default False: every relay takes in at once.

        Returns the :class:`~outbox.intake.Intake`. Raises :class:`ConfigurationError`
        naming the option for a bad value or a name declared twice."""
        declared = declare(name, source, topic, identity, key, batch, max_backlog, max_payload_bytes, ordered)
        if declared.name in self._intakes:
            raise ConfigurationError(f"intake {declared.name!r} is declared twice; intake names must be unique")
        self._intakes[declared.name] = declared
        return declared

    @property
    def intakes(self) -> list[Intake]:
        """The declared intakes, in declaration order."""
        return list(self._intakes.values())

    def _add(self, sub: Subscriber) -> None:
        if sub.consumer in self._subscribers:
            raise ConfigurationError(f"consumer {sub.consumer!r} is declared twice; consumer names must be unique")
        self._subscribers[sub.consumer] = sub

    def periodic(
        self,
        cron: str,
        *,
        topic: str,
        payload: Any = None,
        name: str | None = None,
        timezone: Any = "UTC",
        catch_up: bool = False,
        **subscriber_options: Any,
    ) -> Callable[[_Handler], _Handler]:
        """Declare a schedule: at every slot of ``cron`` in ``timezone``, the relays publish
        one event on ``topic`` with ``payload`` (default ``{}``), exactly once per slot however
        many relays run (:mod:`outbox.schedule`).

        ``cron``: croniter's syntax, 5 fields (minute hour day-of-month month day-of-week) or 6
        (the 6th is seconds). ``timezone``: an IANA name or a ``zoneinfo.ZoneInfo`` (default
        UTC); slots are wall-clock times there. ``name``: the schedule's durable name in
        ``outbox_schedules`` (default: ``topic``; unique within the registry). ``catch_up``:
        after a time with no relay running, publish every missed slot (at most 1,000) instead
        of only the latest one.

        The schedule is declared by this call. The returned decorator may then be applied to
        a handler, which it subscribes to ``topic`` as :meth:`subscriber` does, with consumer
        ``name`` unless ``subscriber_options`` names one (the other options are
        :meth:`subscriber`'s); or left unused, for a schedule whose topic other subscribers
        (or other registries) consume. Needs croniter (``pip install 'outbox-relay[cron]'``).

        Raises :class:`ConfigurationError` naming the problem: croniter missing, a bad cron
        expression, an unknown time zone, a payload that is not JSON, a name declared twice,
        or (when decorating) a bad subscriber option.
        """
        schedule_name = topic if name is None else name
        schedule = make_schedule(cron, topic=topic, payload={} if payload is None else payload, name=schedule_name,
                                 timezone=timezone, catch_up=catch_up)
        if schedule.name in self._schedules:
            raise ConfigurationError(f"schedule {schedule.name!r} is declared twice; pass name= to tell them apart")
        unknown = set(subscriber_options) - {"consumer", "max_attempts", "lease", "transactional", "priority", "ordered",
                                             "on_dead", "concurrency", "rate_limit", "timeout"}
        if unknown:
            raise ConfigurationError(f"schedule {schedule.name!r}: unknown options {sorted(unknown)}")
        self._schedules[schedule.name] = schedule
        options = {"consumer": schedule.name, **subscriber_options}

        def subscribe(handler: _Handler) -> _Handler:
            register: Callable[[_Handler], _Handler] = self.subscriber(topic, **options)
            register(handler)
            return handler

        return subscribe

    @property
    def schedules(self) -> list[Schedule]:
        """The declared schedules, in declaration order."""
        return list(self._schedules.values())

    def __iter__(self) -> Iterator[Subscriber]:
        return iter(self._subscribers.values())

    def __len__(self) -> int:
        return len(self._subscribers)

    def __getitem__(self, consumer: str) -> Subscriber:
        return self._subscribers[consumer]

    def hooks_of(self, consumer: str) -> tuple[str, ...]:
        """The kinds of failure hook (``"dead"``, ``"retry"``) declared for ``consumer``, sorted;
        empty when none."""
        return tuple(sorted(kind for kind, calls in self._hooks.get(consumer, {}).items() if calls))

    def fanned_in(self, topic: str, consumer: str) -> bool:
        """Whether a fan-in of ``topic`` lists ``consumer``: its jobs' completions then look
        for a fan-in to fire."""
        return consumer in self._fanned_in.get(topic, ())

    @property
    def consumers(self) -> list[str]:
        """Names of the declared consumers, in declaration order."""
        return list(self._subscribers)


def _topics(topic: Any, consumer: Any) -> tuple[str, ...]:
    """The topics of one declaration: a name, or a non-empty sequence of distinct names."""
    topics = (topic,) if isinstance(topic, str) or not isinstance(topic, Sequence) else tuple(topic)
    if not topics:
        raise ConfigurationError(f"subscriber {consumer!r}: topic must be a topic name or a non-empty list of them")
    try:
        for name in topics:
            check_name(name, "topic")
    except InvalidEventError as exc:
        raise ConfigurationError(f"subscriber {exc}") from None
    if len(set(topics)) != len(topics):
        raise ConfigurationError(f"subscriber {consumer!r}: topic names a topic twice: {list(topics)!r}")
    return topics


def _validated(topic: Any, consumer: Any, handler: Any, max_attempts: Any, lease: Any,
               transactional: Any, priority: Any) -> Subscriber:
    try:
        check_name(consumer, "consumer")
    except InvalidEventError as exc:
        raise ConfigurationError(f"subscriber {exc}") from None
    topics = _topics(topic, consumer)
    if not callable(handler):
        raise ConfigurationError(f"subscriber {consumer!r}: handler must be callable")
    if type(max_attempts) is not int or not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise ConfigurationError(f"subscriber {consumer!r}: max_attempts must be an int in 1..{MAX_ATTEMPTS_LIMIT}, got {max_attempts!r}")
    if lease is not None:
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not math.isfinite(lease) or not 0.5 <= lease <= 86_400:
            raise ConfigurationError(f"subscriber {consumer!r}: lease must be seconds in 0.5..86400, got {lease!r}")
        lease = float(lease)
    if type(transactional) is not bool:
        raise ConfigurationError(f"subscriber {consumer!r}: transactional must be True or False, got {transactional!r}")
    if type(priority) is not int or not -32768 <= priority <= 32767:
        raise ConfigurationError(f"subscriber {consumer!r}: priority must be an int in -32768..32767, got {priority!r}")
    # An object whose __call__ is ``async def`` is a coroutine function too; missing it
    # would let the relay drop the never-awaited coroutine and mark the job done.
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004
    _check_arity(consumer, handler, 2 if transactional else 1)
    return Subscriber(topics, consumer, handler, max_attempts, lease, transactional, priority, is_async)


def _with_flow(sub: Subscriber, ordered: Any, on_dead: Any, concurrency: Any, rate_limit: Any,
               timeout: Any) -> Subscriber:
    consumer = sub.consumer
    if type(ordered) is not bool:
        raise ConfigurationError(f"subscriber {consumer!r}: ordered must be True or False, got {ordered!r}")
    if on_dead not in ("block", "skip"):
        raise ConfigurationError(f"subscriber {consumer!r}: on_dead must be 'block' or 'skip', got {on_dead!r}")
    if on_dead != "block" and not ordered:
        raise ConfigurationError(f"subscriber {consumer!r}: on_dead={on_dead!r} needs ordered=True")
    if concurrency is not None and (type(concurrency) is not int or not 1 <= concurrency <= MAX_CONCURRENCY):
        raise ConfigurationError(f"subscriber {consumer!r}: concurrency must be an int in 1..{MAX_CONCURRENCY} or None, "
                                 f"got {concurrency!r}")
    per_second = None if rate_limit is None else parse_rate(rate_limit, consumer)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or not 0.01 <= timeout <= 86_400:
            raise ConfigurationError(f"subscriber {consumer!r}: timeout must be seconds in 0.01..86400 or None, "
                                     f"got {timeout!r}")
        timeout = float(timeout)
    return dataclasses.replace(sub, ordered=ordered, on_dead=on_dead, concurrency=concurrency,
                               rate_limit=per_second, timeout=timeout)


def parse_rate(value: Any, consumer: str = "?") -> float:
    """Claims per second from a rate limit: a positive finite number (per second) or a
    string ``"N/s"``, ``"N/m"``, ``"N/h"`` (N a positive number). Raises
    :class:`ConfigurationError` naming the consumer and the value otherwise."""
    problem = f"subscriber {consumer!r}: rate_limit must be a positive number per second or 'N/s', 'N/m', 'N/h', got {value!r}"
    if isinstance(value, str):
        count, _, unit = value.strip().partition("/")
        if unit.strip() not in RATE_UNITS:
            raise ConfigurationError(problem)
        try:
            number = float(count)
        except ValueError:
            raise ConfigurationError(problem) from None
        value_per_second = number / RATE_UNITS[unit.strip()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value_per_second = float(value)
    else:
        raise ConfigurationError(problem)
    if not math.isfinite(value_per_second) or value_per_second <= 0:
        raise ConfigurationError(problem)
    return value_per_second


def _check_arity(consumer: str, handler: Callable[..., Any], positional: int) -> None:
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature; trust them
    try:
        signature.bind(*range(positional))
    except TypeError:
        shape = "(job, session)" if positional == 2 else "(job)"
        raise ConfigurationError(
            f"subscriber {consumer!r}: handler {getattr(handler, '__qualname__', handler)!r} "
            f"must accept {shape}, its signature is {signature}") from None
