"""A subscriber's retry policy: how long a job waits after a failed attempt, and which
failures are retried at all.

Declared per subscriber (``@ob.subscriber(..., backoff=, retry_on=, dead_on=)``, the same on
``ob.forward`` and ``ob.periodic``)::

    @ob.subscriber("invoice.issued", consumer="mail_invoice",
                   backoff=Backoff(base=10, cap=600), retry_on=(ConnectionError, TimeoutError),
                   dead_on=PermissionError)
    def mail_invoice(job): ...

**Delays.** After failed attempt ``n`` a job waits
:func:`outbox.backoff.retry_delay`: ``d = min(cap, base * 2**(n-1))`` seconds less a random
share ``jitter`` of it, so within ``[(1 - jitter) * d, d]``. A :class:`Backoff` field left
None takes the relay's setting (``backoff_base``, ``backoff_cap``, ``backoff_jitter``), and
a subscriber without ``backoff=`` takes all three.

**What is retried**, checked in this order on the exception a failed attempt raised:

1. :class:`~outbox.PermanentError` (and a typed payload that does not validate, which
   raises it): dead at once, as without a policy;
2. an instance of a type in ``dead_on``: dead at once (``dead_on`` wins over ``retry_on``);
3. with ``retry_on`` given, an instance of none of its types: dead at once;
4. anything else: back to ``ready`` after the delay, or dead once the job's attempts reach
   ``max_attempts``.

A job dead by rule 2 or 3 has a ``last_error`` whose first line names the rule
(``dead at once: ValueError is in dead_on``), then the error as usual. An attempt that ran
past the subscriber's ``timeout`` (:class:`~outbox.HandlerTimeoutError`) and a lease that
expired (the reaper's) are the relay's findings, not the handler's exception: neither rule
applies to them, and they are retried until ``max_attempts`` as before. A forwarder's
failed attempt raises :class:`~outbox.ForwardingError` (a message the broker refused or did
not acknowledge in time) or :class:`~outbox.UndeliverableError` (a ``PermanentError``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from outbox import backoff
from outbox.errors import (
    ConfigurationError,
    HandlerTimeoutError,
    LeaseLostError,
    PermanentError,
    Snooze,
)
from outbox.settings import OutboxSettings

#: Exception types a policy does not take: they are not a handler's failure (``Snooze``,
#: ``LeaseLostError``) or are governed by ``max_attempts`` alone (``HandlerTimeoutError``).
NOT_A_FAILURE = (Snooze, LeaseLostError, HandlerTimeoutError)
#: Longest ``base`` or ``cap``, seconds: the longest a setting allows (``backoff_cap``, 30 days).
MAX_BACKOFF_SECONDS = 30 * 86_400.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry delays of one subscriber (``@ob.subscriber(..., backoff=Backoff(...))``):
    ``base``, the delay after the first failed attempt, and ``cap``, the longest delay,
    seconds (finite, ``0 < base <= cap <= 2592000``); ``jitter``, the share of each delay
    taken off at random, ``0..1``. A field left None takes the relay's setting
    (``backoff_base`` 1 s, ``backoff_cap`` 3600 s, ``backoff_jitter`` 0.25 by default).

    Raises :class:`~outbox.ConfigurationError` naming the field for a value out of range,
    and for ``base > cap`` when both are given; a ``base`` above the setting's cap (or a
    ``cap`` below the setting's base) is refused when the relay starts."""

    base: float | None = None
    cap: float | None = None
    jitter: float | None = None

    def __post_init__(self) -> None:
        for name in ("base", "cap"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value <= MAX_BACKOFF_SECONDS:
                raise ConfigurationError(f"Backoff: {name} must be seconds, finite, > 0 and at most "
                                         f"{MAX_BACKOFF_SECONDS:g}, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.jitter is not None:
            if isinstance(self.jitter, bool) or not isinstance(self.jitter, (int, float)) \
                    or not 0 <= self.jitter <= 1:
                raise ConfigurationError(f"Backoff: jitter must be a share in 0..1, got {self.jitter!r}")
            object.__setattr__(self, "jitter", float(self.jitter))
        if self.base is not None and self.cap is not None and self.base > self.cap:
            raise ConfigurationError(f"Backoff: base ({self.base:g}) must not exceed cap ({self.cap:g})")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """A subscriber's policy with the settings filled in (:func:`policy_of`): the delays
    (``base``, ``cap`` seconds; ``jitter`` a share) and the exception types retried
    (``retry_on``: None retries every failure) or dead at once (``dead_on``)."""

    base: float
    cap: float
    jitter: float
    retry_on: tuple[type[BaseException], ...] | None = None
    dead_on: tuple[type[BaseException], ...] = ()

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), within
        ``[(1 - jitter) * d, d]``, ``d = min(cap, base * 2**(attempt-1))``; never overflows."""
        return backoff.retry_delay(attempt, base=self.base, cap=self.cap, jitter=self.jitter, rng=rng)

    def dead_at_once(self, exc: BaseException) -> str | None:
        """Why a failed attempt that raised ``exc`` is dead at once by ``dead_on`` or
        ``retry_on`` (the first line of its ``last_error``), or None when these rules let it
        be retried. A :class:`~outbox.PermanentError` (dead at once anyway) and a timeout
        (:data:`NOT_A_FAILURE`) give None."""
        if isinstance(exc, (PermanentError, *NOT_A_FAILURE)):
            return None
        name = type(exc).__qualname__
        if self.dead_on and isinstance(exc, self.dead_on):
            return f"dead at once: {name} is in dead_on ({_names(self.dead_on)})"
        if self.retry_on is not None and not isinstance(exc, self.retry_on):
            return f"dead at once: {name} is not in retry_on ({_names(self.retry_on)})"
        return None


def _names(types: tuple[type[BaseException], ...]) -> str:
    return ", ".join(t.__qualname__ for t in types)


def policy_of(settings: OutboxSettings, backoff_: Backoff | None = None,
              retry_on: tuple[type[BaseException], ...] | None = None,
              dead_on: tuple[type[BaseException], ...] = (), *, consumer: str = "?") -> RetryPolicy:
    """The policy of a subscriber declaring ``backoff_``, ``retry_on`` and ``dead_on``, its
    Backoff's empty fields taken from ``settings``. Raises
    :class:`~outbox.ConfigurationError` naming ``consumer`` when the filled-in base exceeds
    the cap (a Backoff's ``base`` above the setting ``backoff_cap``, or its ``cap`` below
    ``backoff_base``)."""
    given = backoff_ or Backoff()
    base = settings.backoff_base if given.base is None else given.base
    cap = settings.backoff_cap if given.cap is None else given.cap
    jitter = settings.backoff_jitter if given.jitter is None else given.jitter
    if base > cap:
        which = (f"backoff base {base:g} s exceeds the setting backoff_cap ({cap:g} s): give Backoff a cap too"
                 if given.cap is None else
                 f"backoff cap {cap:g} s is below the setting backoff_base ({base:g} s): give Backoff a base too")
        raise ConfigurationError(f"subscriber {consumer!r}: {which}")
    return RetryPolicy(base=base, cap=cap, jitter=jitter, retry_on=retry_on, dead_on=dead_on)


def exception_types(value: Any, option: str, consumer: str) -> tuple[type[BaseException], ...]:
    """``value`` (an exception type, or a non-empty tuple or list of them) as a tuple, for
    the subscriber option ``option`` (``retry_on``, ``dead_on``). Raises
    :class:`~outbox.ConfigurationError` naming the option for anything else, and for types
    no policy takes: :class:`~outbox.Snooze`, :class:`~outbox.LeaseLostError`,
    :class:`~outbox.HandlerTimeoutError` (:data:`NOT_A_FAILURE`), and, in ``retry_on``,
    :class:`~outbox.PermanentError` (always dead at once)."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    shape = f"subscriber {consumer!r}: {option} must be an exception type or a non-empty tuple of them"
    if not items:
        raise ConfigurationError(f"{shape}, got an empty {type(value).__name__}")
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigurationError(f"{shape}, got {item!r}")
        if issubclass(item, NOT_A_FAILURE):
            raise ConfigurationError(
                f"subscriber {consumer!r}: {option} cannot name {item.__qualname__}: "
                + ("a timeout is retried until max_attempts" if issubclass(item, HandlerTimeoutError)
                   else "it is not a failed attempt"))
        if option == "retry_on" and issubclass(item, PermanentError):
            raise ConfigurationError(f"subscriber {consumer!r}: retry_on cannot name {item.__qualname__}: "
                                     "a PermanentError is always dead at once")
    return items


def check_policy(consumer: str, backoff_: Any, retry_on: Any, dead_on: Any,
                 ) -> tuple[Backoff | None, tuple[type[BaseException], ...] | None, tuple[type[BaseException], ...]]:
    """The declared ``backoff``, ``retry_on`` and ``dead_on`` of subscriber ``consumer``,
    checked (:class:`Backoff`, :func:`exception_types`); a type named in both
    ``retry_on`` and ``dead_on`` is refused (``dead_on`` would win: say it once). Raises
    :class:`~outbox.ConfigurationError` naming the option."""
    if backoff_ is not None and not isinstance(backoff_, Backoff):
        raise ConfigurationError(f"subscriber {consumer!r}: backoff must be a Backoff(base=, cap=, jitter=) or None, "
                                 f"got {backoff_!r}")
    retried = None if retry_on is None else exception_types(retry_on, "retry_on", consumer)
    dead = () if dead_on is None else exception_types(dead_on, "dead_on", consumer)
    both = [t.__qualname__ for t in dead if retried is not None and t in retried]
    if both:
        raise ConfigurationError(f"subscriber {consumer!r}: {', '.join(both)} is in both retry_on and dead_on "
                                 "(dead_on wins): name it in one of them")
    return backoff_, retried, dead

