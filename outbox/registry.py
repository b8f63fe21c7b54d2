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
from outbox.fan_in import FanIn, listing_problem, loop_of, make_fan_in
from outbox.intake import Intake, Received, Source, TopicRule, declare
from outbox.job import Job
from outbox.publish import check_name
from outbox.retry import Backoff, RetryPolicy, check_policy, policy_of
from outbox.schedule import Schedule, make_schedule
from outbox.settings import OutboxSettings
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

#: ``retry_on=`` / ``dead_on=``: an exception type or a tuple of them.
ExceptionTypes = type[BaseException] | tuple[type[BaseException], ...]

#: What a dead job does to its key under ``ordered=True``.
OnDead = Literal["block", "skip"]

#: A lease-mode handler: ``handler(job)``, a ``def`` or an ``async def``; what it returns is
#: ignored. The decorator returns it unchanged, so its own type is kept.
LeaseHandlerT = TypeVar("LeaseHandlerT", bound=Callable[[Job], object])
#: A transactional handler: ``handler(job, session)``.
TransactionalHandlerT = TypeVar("TransactionalHandlerT", bound=Callable[[Job, Any], object])
#: A failure hook: ``hook(failure)`` (:class:`~outbox.JobFailure`), a ``def`` or an ``async def``.
HookT = TypeVar("HookT", bound=Callable[..., object])
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
    validated as (``handler`` then decodes it first: :mod:`outbox.typed_events`).
    ``backoff``, ``retry_on``, ``dead_on``: the retry policy (:mod:`outbox.retry`; None,
    None, (): the relay's settings, every failure retried). ``coalesce``: of the jobs of one
    event key, only the newest event's runs; older waiting ones end ``superseded``
    (architecture notes, "Coalescing")."""

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
    backoff: Backoff | None = None
    retry_on: tuple[type[BaseException], ...] | None = None
    dead_on: tuple[type[BaseException], ...] = ()


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
        #: failure hooks of every consumer of the registry (declared with consumer=None), by kind
        self._hooks_everywhere: dict[str, list[Callable[..., Any]]] = {}
        #: consumers listed by a fan-in, by topic
        self._fanned_in: dict[str, set[str]] = {}
        #: the fan-ins (:meth:`after`), by name
        self._fan_ins: dict[str, FanIn] = {}

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[False] = ..., priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ..., backoff: Backoff | None = ...,
        retry_on: ExceptionTypes | None = ..., dead_on: ExceptionTypes | None = ..., coalesce: bool = ...,
    ) -> Callable[[LeaseHandlerT], LeaseHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[True], priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ..., backoff: Backoff | None = ...,
        retry_on: ExceptionTypes | None = ..., dead_on: ExceptionTypes | None = ..., coalesce: bool = ...,
    ) -> Callable[[TransactionalHandlerT], TransactionalHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str | Sequence[str], *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: bool, priority: int = ...,
        ordered: bool = ..., on_dead: OnDead = ..., concurrency: int | None = ...,
        rate_limit: str | float | None = ..., timeout: float | None = ...,
        payload: type[BaseModel] | None = ..., backoff: Backoff | None = ...,
        retry_on: ExceptionTypes | None = ..., dead_on: ExceptionTypes | None = ..., coalesce: bool = ...,
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
        backoff: Backoff | None = None,
        retry_on: ExceptionTypes | None = None,
        dead_on: ExceptionTypes | None = None,
        coalesce: bool = False,
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

        Retry policy (:mod:`outbox.retry`): ``backoff``, a :class:`~outbox.Backoff` of this
        subscriber's retry delays (its fields left None, and no ``backoff``: the relay's
        settings); ``retry_on``, an exception type or a tuple of them: a failure raising
        anything else is dead at once; ``dead_on``, the same for failures dead at once
        (it wins over ``retry_on``). A :class:`~outbox.PermanentError` is dead at once
        whatever they say; a timeout and an expired lease are retried until
        ``max_attempts``.

        ``coalesce``: only the newest event of a key runs (architecture notes, "Coalescing"): when an event
        of a key is routed while an older job of that key waits (ready, or pending behind
        an ordered key's head), the older job ends ``superseded`` and never runs; a running
        job is never superseded (should its attempt fail, it ends ``superseded`` rather than
        run again). Newer means a higher event id: an event routed after a newer one of its
        key has a waiting or running job is itself superseded at once. Events without a key
        never coalesce.

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
            sub = _with_flow(sub, ordered, on_dead, concurrency, rate_limit, timeout)
            self._add(_with_coalesce(_with_policy(sub, backoff, retry_on, dead_on), coalesce))
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
        backoff: Backoff | None = None,
        retry_on: ExceptionTypes | None = None,
        dead_on: ExceptionTypes | None = None,
        coalesce: bool = False,
    ) -> None:
        """Declare a forwarder: consumer ``consumer`` of ``topic`` (one or a sequence) whose
        jobs are sent to the broker ``to`` (a :class:`~outbox.sinks.Sink`:
        :class:`~outbox.JetStream`, :class:`~outbox.RabbitMQ`, :class:`~outbox.Kafka`), one message per event, with
        the full job lifecycle: claimed, fenced, retried with backoff, dead-lettered
        (forwarding notes). A job completes only once the broker has
        acknowledged its message.

        ``timeout``: seconds (0.01..86400, default 10) the relay waits for the broker's
        acknowledgements of a batch; a message unacknowledged by then is a failed attempt.
        The other options are :meth:`subscriber`'s; a forwarder's failed attempt raises
        :class:`~outbox.ForwardingError` (refused, or not acknowledged in time), which
        ``retry_on`` / ``dead_on`` may name, or :class:`~outbox.UndeliverableError` (dead at once).
        With ``coalesce``, only the newest event of a key is sent (older waiting jobs end
        ``superseded``).

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
        self._add(dataclasses.replace(_with_coalesce(_with_policy(sub, backoff, retry_on, dead_on), coalesce), sink=to))

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
        for f in self._fan_ins.values():  # a fan-in declared before the consumer it lists
            problem = listing_problem(f, sub.consumer, {sub.consumer: sub}) if sub.consumer in f.consumers else None
            if problem is not None:
                raise ConfigurationError(f"fan-in {f.name!r} {problem}")
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
                                             "on_dead", "concurrency", "rate_limit", "timeout", "backoff",
                                             "retry_on", "dead_on", "coalesce"}
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

    def after(self, topic: str, *, consumers: Sequence[str], publish: str, name: str | None = None) -> FanIn:
        """Declare a fan-in (:mod:`outbox.fan_in`): when every consumer of ``consumers`` has
        done its job of an event on ``topic``, one event is published on ``publish``, in the
        transaction that records the last of those completions, with the original event's key
        and payload, its trace context, and the headers ``fan_in`` (``name``) and
        ``fan_in_event_id`` (the original event's id). Once per event, across relays and
        crashes; a dead listed job holds it back until a redrive ends done, a cancelled one
        means it never fires for that event. The follow-up's subscribers are declared as
        any (``@ob.subscriber(publish, ...)``); a fan-in of their topic makes a chain.

        ``consumers``: 1..100 distinct consumers, each a subscriber of ``topic`` that does
        not coalesce, declared before or after this call (checked at the declaration of
        either, and when the relay starts). ``name``: the fan-in's durable name (default:
        the ``publish`` topic; unique within the registry): rename it and it fires again for
        events finishing after the rename.

        Returns the :class:`~outbox.fan_in.FanIn`. Raises :class:`ConfigurationError` naming
        the problem: a bad topic, name or consumer list, a name declared twice, a listed
        consumer already declared that does not subscribe to ``topic`` or coalesces, or a
        ``publish`` topic that would close a loop of fan-ins (follow-ups for ever)."""
        declared = make_fan_in(topic, consumers, publish, name)
        if declared.name in self._fan_ins:
            raise ConfigurationError(f"fan-in {declared.name!r} is declared twice; pass name= to tell them apart")
        for consumer in declared.consumers:
            problem = listing_problem(declared, consumer, self._subscribers) if consumer in self._subscribers else None
            if problem is not None:
                raise ConfigurationError(f"fan-in {declared.name!r} {problem}")
        loop = loop_of(declared, list(self._fan_ins.values()))
        if loop is not None:
            raise ConfigurationError(f"fan-in {declared.name!r}: publishing on {declared.follow_topic!r} closes a loop "
                                     f"of fan-ins ({' -> '.join(loop)}): its follow-ups would never end")
        self._fan_ins[declared.name] = declared
        self._fanned_in.setdefault(declared.topic, set()).update(declared.consumers)
        return declared

    @property
    def fan_ins(self) -> list[FanIn]:
        """The declared fan-ins, in declaration order."""
        return list(self._fan_ins.values())

    def check_fan_ins(self) -> None:
        """Raise :class:`ConfigurationError` when a fan-in lists a consumer the registry does
        not declare (the one check :meth:`after` cannot make when the consumer comes later;
        the relay makes it when it starts, before writing anything)."""
        for f in self._fan_ins.values():
            for consumer in f.consumers:
                problem = listing_problem(f, consumer, self._subscribers)
                if problem is not None:
                    raise ConfigurationError(f"fan-in {f.name!r} {problem}")

    def __iter__(self) -> Iterator[Subscriber]:
        return iter(self._subscribers.values())

    def __len__(self) -> int:
        return len(self._subscribers)

    def __getitem__(self, consumer: str) -> Subscriber:
        return self._subscribers[consumer]

    def retry_policies(self, settings: OutboxSettings) -> dict[str, RetryPolicy]:
        """Each consumer's retry policy (:func:`outbox.retry.policy_of`), its backoff's empty
        fields taken from ``settings``. Raises :class:`ConfigurationError` naming the
        consumer whose backoff does not fit the settings (base above the cap)."""
        return {s.consumer: policy_of(settings, s.backoff, s.retry_on, s.dead_on, consumer=s.consumer) for s in self}

    def on_dead(self, consumer: str | Sequence[str] | None = None) -> Callable[[HookT], HookT]:
        """Decorator declaring a failure hook called after a job of ``consumer`` (a consumer
        name, a list of them, or None: every consumer of this registry, those declared later
        too) went ``dead``, by any path: its last attempt failed, :class:`~outbox.PermanentError`,
        ``dead_on`` / ``retry_on``, a lease that expired on its last attempt, a poison row.

        The hook is ``hook(failure)``, a ``def`` or an ``async def``, given a
        :class:`~outbox.JobFailure`; the relay calls it after the job's transaction
        committed, at least once, in a thread of its own (:mod:`outbox.hooks`): for alerts,
        never able to change the job's outcome. What it returns is ignored; if it raises or
        runs past ``hook_timeout`` it is called again later, a bounded number of times.

        Raises :class:`ConfigurationError` for a consumer name this registry has not declared
        (declare the subscriber first) or a hook that does not take one argument. Returns
        the hook unchanged."""
        return self._hook("dead", consumer)

    def on_retry(self, consumer: str | Sequence[str] | None = None) -> Callable[[HookT], HookT]:
        """Decorator declaring a failure hook called after a job of ``consumer`` failed an
        attempt and went back to ``ready`` to be retried (a failure with attempts left, or a
        lease that expired with attempts left; not a snooze, a release or a redrive).
        Otherwise as :meth:`on_dead`."""
        return self._hook("retry", consumer)

    def _hook(self, kind: str, consumer: Any) -> Callable[[HookT], HookT]:
        option = f"on_{kind}"
        if consumer is None:
            consumers: tuple[str, ...] | None = None
        else:
            consumers = (consumer,) if isinstance(consumer, str) else tuple(consumer) \
                if isinstance(consumer, Sequence) else ()
            if not consumers or not all(isinstance(c, str) for c in consumers):
                raise ConfigurationError(f"{option}: consumer must be a consumer name, a non-empty list of them or None, "
                                         f"got {consumer!r}")
            unknown = [c for c in consumers if c not in self._subscribers]
            if unknown:
                raise ConfigurationError(f"{option}: consumer {unknown[0]!r} is not declared in this registry "
                                         "(declare its subscriber first)")

        def register(hook: HookT) -> HookT:
            if not callable(hook):
                raise ConfigurationError(f"{option}: the hook must be callable, got {hook!r}")
            try:
                inspect.signature(hook).bind(None)
            except TypeError:
                raise ConfigurationError(f"{option}: hook {getattr(hook, '__qualname__', hook)!r} must accept "
                                         f"(failure), its signature is {inspect.signature(hook)}") from None
            except ValueError:
                pass  # no signature (some builtins): trust it
            if consumers is None:
                self._hooks_everywhere.setdefault(kind, []).append(hook)
            else:
                for name in consumers:
                    self._hooks.setdefault(name, {}).setdefault(kind, []).append(hook)
            return hook

        return register

    def hooks_for(self, consumer: str, kind: str) -> list[tuple[str, Callable[..., Any]]]:
        """The failure hooks of ``kind`` (``"dead"``, ``"retry"``) for ``consumer``: those
        declared for every consumer, then those naming it, each with its name
        (``module.qualname``, ``#2``, ``#3`` appended to a name met again), which a due call
        remembers once the hook returned."""
        hooks = [*self._hooks_everywhere.get(kind, ()), *self._hooks.get(consumer, {}).get(kind, ())]
        named: list[tuple[str, Callable[..., Any]]] = []
        seen: dict[str, int] = {}
        for hook in hooks:
            name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', type(hook).__qualname__)}"
            seen[name] = seen.get(name, 0) + 1
            named.append((name if seen[name] == 1 else f"{name}#{seen[name]}", hook))
        return named

    def hooks_of(self, consumer: str) -> tuple[str, ...]:
        """The kinds of failure hook (``"dead"``, ``"retry"``) declared for ``consumer`` (by
        name or for every consumer), sorted; empty when none."""
        return tuple(kind for kind in ("dead", "retry") if self.hooks_for(consumer, kind))

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


def _with_policy(sub: Subscriber, backoff: Any, retry_on: Any, dead_on: Any) -> Subscriber:
    checked, retried, dead = check_policy(sub.consumer, backoff, retry_on, dead_on)
    return dataclasses.replace(sub, backoff=checked, retry_on=retried, dead_on=dead)


def _with_coalesce(sub: Subscriber, coalesce: Any) -> Subscriber:
    if type(coalesce) is not bool:
        raise ConfigurationError(f"subscriber {sub.consumer!r}: coalesce must be True or False, got {coalesce!r}")
    return dataclasses.replace(sub, coalesce=coalesce)


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
