"""Poison rows: a data error in a batch statement is confined to the rows that cause it.

Every loop of the relay changes rows in batches: the dispatcher claims, completes, fails
and releases jobs, the heartbeat renews leases, the reaper takes expired jobs back, the
router turns events into jobs, the pruner deletes what is finished. A batch statement
fails as a whole when one of its rows makes it fail: a trigger of the application's that
raises for that row, a constraint the row violates, a value out of range. Retried as it
is, it fails the same way for ever, and one bad row stalls every job behind it.

So an error about the data (:func:`is_data_error`: SQLSTATE classes 22 data exception,
23 integrity constraint violation, 2F/38/39 routine and trigger errors, 54 program limit
exceeded, P0 PL/pgSQL ``RAISE``; PostgreSQL docs, Appendix A "PostgreSQL Error Codes") is
bisected (:func:`isolate`): the batch is split in halves and each half run again, down to
the rows that fail alone, so a batch of n rows with k bad ones costs about
``2 k log2(n)`` statements once. A row that fails alone is tried alone ``SINGLE_TRIES``
times before it counts (an error that comes and goes must not dead-letter good work).
Every other row's statement commits and the loop goes on with no extra run of any job.
When every row of a batch of ``SYSTEMIC_MIN`` or more fails alone, the statement fails for
every row, not for a few: :class:`SystemicError` is raised instead, nothing is
dead-lettered or quarantined, and the loop backs off and logs it like any database error. What happens to a row that fails alone is the caller's
rule: a job is dead-lettered with a ``last_error`` naming the database error (a fenced
write, for a claimed job); where even that write fails, the row is kept in the loop's
:class:`Quarantine` (skipped by its statements, logged once) and tried again after
``QUARANTINE_SECONDS``, so nothing committed is lost or changed by a bad row.

Any other error (the connection, the server, a lock or serialization conflict, a missing
table) is not about one row: it is raised, and the loop retries the whole batch with
backoff as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)

#: SQLSTATE classes (first two characters) of errors caused by the rows a statement touches.
DATA_ERROR_CLASSES = frozenset({"22", "23", "2F", "38", "39", "54", "P0"})
#: How long a row whose poison could not even be recorded is skipped before it is tried
#: again, seconds (the application may have fixed its trigger or constraint meanwhile).
QUARANTINE_SECONDS = 300.0
#: Times a row that fails alone is tried alone before it counts as poison: an error that
#: comes and goes (a trigger that fails at random, a constraint racing another write) must
#: not dead-letter work that succeeded.
SINGLE_TRIES = 3
#: A batch of at least this many rows of which every one fails alone is not poison: the
#: statement fails for every row (a trigger that always raises, a broken constraint), and
#: dead-lettering the whole queue one row at a time would be the wrong cure.
SYSTEMIC_MIN = 8

T = TypeVar("T")
R = TypeVar("R")


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error, or of the psycopg error a SQLAlchemy one wraps."""
    if isinstance(exc, DBAPIError):
        exc = exc.orig  # type: ignore[assignment]
    return getattr(exc, "sqlstate", None) if isinstance(exc, psycopg.Error) else None


def is_data_error(exc: BaseException) -> bool:
    """True when ``exc`` is a database error about the data a statement touched (see
    ``DATA_ERROR_CLASSES``), which retrying the same rows cannot fix."""
    state = sqlstate(exc)
    return state is not None and state[:2] in DATA_ERROR_CLASSES


class SystemicError(Exception):
    """Every row of a batch of at least ``SYSTEMIC_MIN`` rows failed alone: the statement
    fails for every row, so no row is dead-lettered; ``__cause__`` is the first row's
    database error. The loop backs off and tries the whole batch again later."""


def isolate(items: Sequence[T], run: Callable[[Sequence[T]], R]) -> tuple[list[R], list[tuple[T, BaseException]]]:
    """Run ``run(items)``; if it raises a data error, split ``items`` in halves and run
    each, recursively, down to single items, each of which is tried up to
    ``SINGLE_TRIES`` times. Returns (results of every successful run, in order; (item,
    error) for every item that failed alone every time). ``run`` must be atomic (one
    statement in autocommit, or its own transaction), so a failed run changed nothing.
    Errors that are not data errors propagate at once, and so does a data error of a run
    with no items (it cannot be about one of them). Raises :class:`SystemicError` when
    every one of at least ``SYSTEMIC_MIN`` items failed alone."""
    results, poisoned = _halves(items, run)
    if len(items) >= SYSTEMIC_MIN and len(poisoned) == len(items):
        raise SystemicError(f"all {len(items)} rows fail: {describe_error(poisoned[0][1])}") from poisoned[0][1]
    return results, poisoned


def _halves(items: Sequence[T], run: Callable[[Sequence[T]], R]) -> tuple[list[R], list[tuple[T, BaseException]]]:
    tries = SINGLE_TRIES if len(items) == 1 else 1
    for _ in range(tries):
        try:
            return [run(items)], []
        except (psycopg.Error, DBAPIError) as exc:
            if not is_data_error(exc) or not items:  # with no rows, the error is not about a row
                raise
            error = exc
    if len(items) == 1:
        return [], [(items[0], error)]
    mid = len(items) // 2
    head, head_bad = _halves(items[:mid], run)
    tail, tail_bad = _halves(items[mid:], run)
    return head + tail, head_bad + tail_bad


def whole_or_halves(what: str, whole: Callable[[], R], candidates: Callable[[], Sequence[T]],
                    part: Callable[[Sequence[T]], R]) -> tuple[list[R], list[tuple[T, BaseException]]]:
    """Run a batch statement as a whole (``whole()``); if it fails with a data error, log
    it once (``what`` names the loop), list the rows the batch would take
    (``candidates()``) and run ``part(rows)`` by halves with :func:`isolate`. Returns (the
    results that succeeded, (row, error) for every row that failed alone); errors that are
    not data errors propagate, and :class:`SystemicError` when every row fails."""
    try:
        return [whole()], []
    except (psycopg.Error, DBAPIError) as exc:
        if not is_data_error(exc):
            raise
        log.warning("%s failed (%s); running it by halves to find the rows that cause it", what, describe_error(exc))
    return isolate(candidates(), part)


def try_record(write: Callable[[], bool]) -> bool | None:
    """Run ``write``, a statement that dead-letters one poison row (True if it changed the
    row); None when that write itself fails with a data error (the caller then quarantines
    the row or leaves it to its lease). Other errors propagate."""
    try:
        return write()
    except (psycopg.Error, DBAPIError) as exc:
        if not is_data_error(exc):
            raise
        return None


class Quarantine:
    """Ids one loop skips because even recording their poison failed, each until
    ``QUARANTINE_SECONDS`` after it was added. ``what`` names the rows in the log ("job",
    "event"). Thread-safe: the dispatchers of one job runner share one."""

    def __init__(self, what: str, seconds: float = QUARANTINE_SECONDS) -> None:
        self.what = what
        self.seconds = seconds
        self._until: dict[int, float] = {}
        self._lock = threading.Lock()

    def add(self, row_id: int, exc: BaseException, doing: str) -> None:
        """Skip ``row_id`` for a while; logs the database error once per quarantine."""
        with self._lock:
            new = row_id not in self._until
            self._until[row_id] = time.monotonic() + self.seconds
        if new:
            log.error("%s %s quarantined: %s fails for it alone (%s); it stays as it is, skipped for %.0fs, "
                      "then tried again", self.what, row_id, doing, describe_error(exc), self.seconds)

    def ids(self) -> list[int]:
        """The ids to skip now (expired ones are dropped)."""
        now = time.monotonic()
        with self._lock:
            for row_id in [i for i, until in self._until.items() if until <= now]:
                del self._until[row_id]
            return list(self._until)

    def __len__(self) -> int:
        return len(self._until)


def describe_error(exc: BaseException) -> str:
    """``SQLSTATE Type: first line of the server's message`` of a database error, for a
    log line or a ``last_error``; never the statement or its parameters."""
    orig: Any = exc.orig if isinstance(exc, DBAPIError) else exc
    text = str(orig).strip()
    message = text.splitlines()[0] if text else type(orig).__name__
    state = sqlstate(exc)
    return f"{type(orig).__name__}{f' [{state}]' if state else ''}: {message}"
