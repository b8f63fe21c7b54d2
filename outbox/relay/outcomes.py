"""How one run of a claimed job's handler ended, as the executor says it
(:class:`outbox.relay.executor.JobExecutor`) and the completer writes it
(:mod:`outbox.relay.completer`):

* :class:`Outcome`: the handler did not fail; which statement, if any, is still to write
  follows from it (``DONE``: the fenced completion; ``RELEASE``: hand the job back, the
  attempt not counted; the others: nothing);
* :class:`Failure`: the attempt failed: back to ``ready`` after its ``delay``, or ``dead``
  when out of attempts or ``permanent``; its ``error`` is :func:`format_error` of the
  exception, the job's ``last_error``;
* :class:`Snoozed`: the handler raised :class:`~outbox.Snooze`: ready again after the delay,
  the attempt not counted.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError

from outbox.db.engine import describe

#: Longest ``last_error`` kept, in characters (type + message + traceback).
MAX_ERROR_CHARS = 8192
MAX_MESSAGE_CHARS = 2048


def format_error(exc: BaseException, limit: int = MAX_ERROR_CHARS) -> str:
    """``last_error`` text for ``exc``: ``Type: message`` and the innermost traceback
    frames, at most ``limit`` characters. Safe for any exception: a ``str()`` that raises,
    a message of many megabytes, NUL bytes and unpaired surrogates all give valid text."""
    try:
        # A database error's str() carries the SQL and its parameters: keep the server's words.
        message = describe(exc).partition(": ")[2] if isinstance(exc, DBAPIError) else str(exc)
    except BaseException as err:  # noqa: BLE001 - a broken __str__ must not lose the failure
        message = f"<str() raised {type(err).__name__}>"
    message = _clean(message[: MAX_MESSAGE_CHARS * 2])
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + f"... [{len(message)} chars, truncated]"
    head = f"{_clean(type(exc).__qualname__)}: {message}"
    try:
        frames = "".join(traceback.format_tb(exc.__traceback__, limit=-8)) if exc.__traceback__ else ""
    except BaseException:  # noqa: BLE001
        frames = ""
    text = head + ("\n" + _clean(frames) if frames else "")
    return text if len(text) <= limit else text[: limit - 15] + "... [truncated]"


def _clean(text: str) -> str:
    """Text PostgreSQL accepts: NUL removed, unpaired surrogates escaped."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


class Outcome(enum.Enum):
    """How running a claimed job's handler ended, when it did not fail (a failure is a
    :class:`Failure`). Which statement, if any, is still to write follows from it."""

    #: Lease mode: the handler returned; the fenced completion is still to write.
    DONE = "done"
    #: Transactional mode: the fenced completion committed with the handler's writes.
    COMMITTED = "committed"
    #: Nothing to write: the claim is no longer this worker's (lease lost, fence stale).
    STALE = "stale"
    #: Hand the job back as ready now, the attempt not counted (fenced).
    RELEASE = "release"
    #: Nothing to write: the handler ran past its timeout and the watchdog already failed
    #: the attempt; what the handler did is dropped. Its worker slot is free again.
    TIMED_OUT = "timed out"
    #: Transactional mode: an operator cancelled the job while it ran; the handler's
    #: transaction was rolled back and ``cancelled`` recorded (fenced) in a transaction of
    #: its own. Nothing to write.
    CANCELLED = "cancelled"



@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt: retry after ``delay`` seconds, unless ``permanent`` or out of
    attempts. ``timed_out``: the handler ran past its timeout (the watchdog's report, or an
    ``async def`` handler cancelled at it: :class:`~outbox.HandlerTimeoutError`); its entry
    in the job's attempt history says ``timed out``."""

    delay: float
    permanent: bool
    error: str
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Snoozed:
    """The handler raised :class:`~outbox.Snooze`: ready again in ``seconds``, the attempt
    not counted."""

    seconds: float

