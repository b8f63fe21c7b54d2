"""Outbox: the registry of subscribers, declared in Python with ``@ob.subscriber``.

A subscriber is a (topic, consumer) pair and a handler. The relay writes every pair to
``outbox_subscriptions`` when it starts, so routing is deterministic and visible with SQL;
a consumer name is unique within a registry. Declarations are validated when made, so a
bad option fails at import time of the application module, not in the middle of a run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from .errors import ConfigurationError, InvalidEventError
from .job import Job
from .publish import check_name

#: Most attempts a subscriber may allow.
MAX_ATTEMPTS_LIMIT = 1000

#: A lease-mode handler: ``handler(job)``, a ``def`` or an ``async def``; what it returns is
#: ignored. The decorator returns it unchanged, so its own type is kept.
LeaseHandlerT = TypeVar("LeaseHandlerT", bound=Callable[[Job], object])
#: A transactional handler: ``handler(job, session)``.
TransactionalHandlerT = TypeVar("TransactionalHandlerT", bound=Callable[[Job, Any], object])
#: Either, when ``transactional`` is not a literal.
HandlerT = TypeVar("HandlerT", bound=Callable[..., object])


@dataclass(frozen=True, slots=True)
class Subscriber:
    """One declared subscriber: ``handler`` runs for every event on ``topic``, once per
    event for ``consumer``. ``lease`` is seconds, or None for the relay's default lease.
    ``transactional`` handlers take ``(job, session)`` (an ``AsyncSession`` when
    ``is_async``) and run inside the transaction that completes the job; the others take
    ``(job)`` and run outside any transaction.
    ``priority``: lower runs first (default 0)."""

    topic: str
    consumer: str
    handler: Callable[..., Any]
    max_attempts: int
    lease: float | None
    transactional: bool
    priority: int
    is_async: bool


class Outbox:
    """The registry of subscribers of one application.

    >>> ob = Outbox()
    >>> @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=5)
    ... def send_receipt(job): ...
    """

    def __init__(self) -> None:
        self._subscribers: dict[str, Subscriber] = {}

    @overload
    def subscriber(
        self, topic: str, *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[False] = ..., priority: int = ...,
    ) -> Callable[[LeaseHandlerT], LeaseHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str, *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: Literal[True], priority: int = ...,
    ) -> Callable[[TransactionalHandlerT], TransactionalHandlerT]: ...

    @overload
    def subscriber(
        self, topic: str, *, consumer: str | None = ..., max_attempts: int = ..., lease: float | None = ...,
        transactional: bool, priority: int = ...,
    ) -> Callable[[HandlerT], HandlerT]: ...

    def subscriber(
        self,
        topic: str,
        *,
        consumer: str | None = None,
        max_attempts: int = 5,
        lease: float | None = None,
        transactional: bool = False,
        priority: int = 0,
    ) -> Callable[[Any], Any]:
        """Decorator declaring ``handler`` as consumer ``consumer`` (default: the
        function's ``module.qualname``) of events on ``topic``.

        ``max_attempts``: 1..1000 attempts before the job is dead-lettered (default 5).
        ``lease``: seconds a claim lasts without a heartbeat (heartbeats run every
        lease/3); default the relay's ``default_lease``. ``transactional``: run the handler
        as ``handler(job, session)`` inside the transaction that completes the job: a
        ``Session`` for a plain ``def``, an ``AsyncSession`` for an ``async def`` (the same
        fenced commit either way). ``priority``: -32768..32767, lower first.

        Raises :class:`ConfigurationError` naming the option for bad values, a duplicate
        consumer name, or a handler whose signature does not fit its mode. Returns the
        handler unchanged, and type checkers see it so: ``@ob.subscriber(...)`` on
        ``def f(job: Job) -> None`` leaves ``f`` typed as that function; a lease-mode
        handler must accept ``(Job)``, a transactional one ``(Job, session)``.
        """

        def register(handler: HandlerT) -> HandlerT:
            name = consumer if consumer is not None else f"{handler.__module__}.{handler.__qualname__}"
            sub = _validated(topic, name, handler, max_attempts, lease, transactional, priority)
            if sub.consumer in self._subscribers:
                raise ConfigurationError(f"consumer {sub.consumer!r} is declared twice; consumer names must be unique")
            self._subscribers[sub.consumer] = sub
            return handler

        return register

    def __iter__(self) -> Iterator[Subscriber]:
        return iter(self._subscribers.values())

    def __len__(self) -> int:
        return len(self._subscribers)

    def __getitem__(self, consumer: str) -> Subscriber:
        return self._subscribers[consumer]

    @property
    def consumers(self) -> list[str]:
        """Names of the declared consumers, in declaration order."""
        return list(self._subscribers)


def _validated(topic: Any, consumer: Any, handler: Any, max_attempts: Any, lease: Any,
               transactional: Any, priority: Any) -> Subscriber:
    try:
        check_name(topic, "topic")
        check_name(consumer, "consumer")
    except InvalidEventError as exc:
        raise ConfigurationError(f"subscriber {exc}") from None
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
    return Subscriber(topic, consumer, handler, max_attempts, lease, transactional, priority, is_async)


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
