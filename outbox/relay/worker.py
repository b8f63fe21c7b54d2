"""Running one claimed job, and the statements that change claimed jobs.

* The **job statements** (:func:`claim_jobs`, :func:`complete_and_claim_after`,
  :func:`heartbeat_jobs`, :func:`complete_jobs`, :func:`fail_jobs`, :func:`release_jobs`,
  :func:`bury_job`, the relay-row statements): each runs one named statement of
  :mod:`outbox.db.queries` on a SQLAlchemy ``Connection`` or a bare psycopg one, and returns what
  the statement changed. Every write that changes a claimed job names its fence and
  requires ``status='running'``; a row that does not come back means the report was stale
  and changed nothing (architecture notes, "Statements").
* The **executor** (:class:`JobExecutor`) runs one claimed job's handler and says how it
  ended (:class:`Outcome` or :class:`Failure`), for the relay's worker threads
  (:mod:`outbox.relay.runner`) and :func:`outbox.testing.drain` alike.

Lease mode: the handler runs outside any transaction. When a heartbeat finds the job gone
(reaped after a pause, or released), ``job.lease_lost`` becomes true, ``job.check_lease()``
raises, and the handler's result is dropped.

Transactional mode: the handler runs as ``handler(job, session)`` inside a transaction that
ends with the fenced completion; if the fence no longer matches, the whole transaction,
handler writes included, rolls back; if an operator cancelled the job meanwhile, it rolls
back too and the job is then recorded ``cancelled`` in a transaction of its own
(:attr:`Outcome.CANCELLED`). Its connection is checked out first, its isolation is
READ COMMITTED, and a serialization failure or deadlock is retried in place
(:mod:`outbox.relay.transaction`). An ``async def`` transactional handler gets an
``AsyncSession`` on a connection of its worker thread's own async engine (made on first
use, one connection) and the same steps.

Failures: an exception puts the job back to ``ready`` after :func:`outbox.backoff.retry_delay`
or, once attempts reach ``max_attempts``, to ``dead``; :class:`~outbox.PermanentError` goes
to ``dead`` at once. ``last_error`` holds the type, message and a bounded traceback.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import backoff
from outbox.db import queries
from outbox.db.engine import describe
from outbox.db.tables import JOBS_CHANNEL, notify_channel
from outbox.errors import (
    HandlerMisuseError,
    HandlerTimeoutError,
    LeaseLostError,
    PermanentError,
    Snooze,
)
from outbox.job import Job
from outbox.registry import Subscriber
from outbox.relay import transaction
from outbox.relay.counters import Counters
from outbox.relay.watchdog import ASYNC_BACKSTOP_SECONDS, Watchdog
from outbox.settings import OutboxSettings
from outbox.telemetry import tracing
from outbox.telemetry.logs import job_fields

log = logging.getLogger(__name__)

#: Longest ``last_error`` kept, in characters (type + message + traceback).
MAX_ERROR_CHARS = 8192
MAX_MESSAGE_CHARS = 2048
#: SQLSTATE of "terminating connection due to idle-in-transaction timeout".
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"


# ------------------------------------------------------------------- error text


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


# --------------------------------------------------------------- job statements
#
# Each function takes either a SQLAlchemy ``Connection`` (tests, tools, the heartbeat) or a
# bare psycopg ``Connection`` (the runner's dispatcher, which skips SQLAlchemy's per-statement
# work on its hot path); the SQL is the same named statement of ``db/queries.py`` either way,
# for the tables of ``schema`` (None: the process default, ``outbox.settings.default_schema``).

Executor = Connection | psycopg.Connection[Any]

_PSYCOPG_DIALECT = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy's dialects are untyped
_COMPILED: dict[int, str] = {}


def _psycopg_sql(statement: TextClause) -> str:
    """``statement`` compiled for psycopg's paramstyle (statements are module constants or
    members of a ``queries.Statements`` kept for the life of the process: each is compiled
    once, and its ``id`` never reused)."""
    sql = _COMPILED.get(id(statement))
    if sql is None:
        sql = _COMPILED[id(statement)] = str(statement.compile(dialect=_PSYCOPG_DIALECT))
    return sql


def _rows(conn: Executor, statement: TextClause, params: dict[str, Any]) -> list[Any]:
    """Run ``statement`` on ``conn`` and return its rows (indexable by column position)."""
    if isinstance(conn, psycopg.Connection):
        return conn.execute(_psycopg_sql(statement), params).fetchall()
    return list(conn.execute(statement, params).all())


def _execute(conn: Executor, statement: TextClause, params: dict[str, Any]) -> int:
    """Run ``statement`` (no result rows) on ``conn``; returns its row count."""
    if isinstance(conn, psycopg.Connection):
        return conn.execute(_psycopg_sql(statement), params).rowcount
    return conn.execute(statement, params).rowcount


def job_from_row(row: Any, lease_seconds: float) -> Job:
    """A :class:`Job` from a row of ``job_claim_many`` (columns in its ``RETURNING`` order;
    payload and headers come as their stored JSON texts, which the job decodes on first use)."""
    job = Job.from_json(row[0], row[1], row[2], row[7], row[8], row[9], row[10], row[3], row[4], row[5],
                        lease_seconds, row[11])
    job._lease_until = row[6]
    return job


def job_from_claim_row(row: Any, lease_seconds: float) -> Job:
    """:func:`job_from_row` for a claim that also returned ``priority`` and ``run_at`` (columns
    12 and 13): the job remembers its place in the queue, which the relay's buffer keeps."""
    job = job_from_row(row, lease_seconds)
    job._claim_order = (row[12], row[13], row[0])
    return job


def _claim_params(leases: dict[str, float], limit: int, worker_id: str) -> dict[str, Any]:
    consumers = list(leases)
    return {"consumers": consumers, "leases": [leases[c] for c in consumers], "limit": limit, "worker": worker_id}


def claim_jobs(conn: Executor, leases: dict[str, float], limit: int, worker_id: str, *,
               schema: str | None = None) -> list[Job]:
    """Claim up to ``limit`` due jobs of the consumers in ``leases`` (consumer -> lease
    seconds) in ``conn``'s transaction; the caller commits."""
    rows = _rows(conn, queries.in_schema(schema).job_claim_many, _claim_params(leases, limit, worker_id))
    return [job_from_row(r, leases[r[2]]) for r in rows]


#: The lowest claim-order key (priority, run_at, id): a claim "after" it starts at the head.
HEAD_KEY: tuple[int, Any, int] = (-32768, "-infinity", 0)


def complete_and_claim_jobs(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                            worker_id: str, *, keep_done: bool = True,
                            schema: str | None = None) -> tuple[set[int], list[Job]]:
    """Mark ``done`` completed (fenced; deleted instead when ``keep_done`` is false, see
    :func:`complete_jobs`) and claim up to ``limit`` due jobs, in one statement
    (``job_complete_claim_many``); returns (ids completed, jobs claimed). A job of ``done``
    missing from the ids was a stale report and changed nothing."""
    completed, claimed, _ = complete_and_claim_after(conn, done, leases, limit, worker_id, None,
                                                     keep_done=keep_done, schema=schema)
    return completed, claimed


def complete_and_claim_after(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                             worker_id: str, after: tuple[int, Any, int] | None, *,
                             buffer: BufferMark | None = None, skip: list[int] | None = None,
                             only: list[int] | None = None, keep_done: bool = True, schema: str | None = None,
                             ) -> tuple[set[int], list[Job], tuple[int, Any, int] | None]:
    """:func:`complete_and_claim_jobs` whose claim starts after the claim-order key ``after``
    (``(priority, run_at, id)``, as returned before; None: at the head of the ready jobs);
    also returns the key of the last job it claimed (None when it claimed none). The jobs
    claimed come back in claim order.

    ``buffer``, when given, is written to the relay's row in the same statement (see
    :class:`BufferMark`): the first ``buffer.start_now`` jobs claimed that are not of a
    forwarder in ``buffer.forwarding`` are taken as started, the rest as buffered. The claim leaves out the job ids in ``skip`` and, when ``only``
    is given, takes only jobs among those ids (:mod:`outbox.relay.poison`)."""
    key = after or HEAD_KEY
    mark = buffer or BufferMark(None, 0)
    rows = _rows(conn, queries.in_schema(schema).job_complete_claim_many, {
        **_ids_fences(done), **_claim_params(leases, limit, worker_id), "keep_done": keep_done,
        "after_priority": key[0], "after_run_at": key[1], "after_id": key[2],
        "relay": mark.relay, "start_now": mark.start_now, "forwarding": list(mark.forwarding),
        "skip": skip or [], "only": only})
    completed = {r[0] for r in rows if r[14]}
    claimed = sorted((r for r in rows if not r[14]), key=lambda r: (r[12], r[13], r[0]))
    last = (claimed[-1][12], claimed[-1][13], claimed[-1][0]) if claimed else None
    return completed, [job_from_claim_row(r, leases[r[2]]) for r in claimed], last


@dataclass(frozen=True, slots=True)
class BufferMark:
    """What a dispatcher round adds to its relay's row of ``outbox_relays`` (``relay``;
    None changes nothing): the jobs the round claims that do not start at once join the
    list of buffered claims: every job of a consumer in ``forwarding`` (a forwarder's
    attempt starts when its message is handed to the broker, issue 26), and of the others
    all but the first ``start_now`` in claim order (those go to idle workers). The reaper
    gives the attempt back to an expired claim still listed (migration 0003)."""

    relay: str | None
    start_now: int
    forwarding: frozenset[str] = frozenset()

    def starts_now(self, claimed: list[Job]) -> list[Job]:
        """Of ``claimed`` (in claim order), the jobs this mark did not list: the first
        ``start_now`` that are not a forwarder's."""
        return [job for job in claimed if job.consumer not in self.forwarding][:self.start_now]


def claim_candidates(conn: Executor, consumers: list[str], limit: int, skip: list[int], *,
                     schema: str | None = None) -> list[int]:
    """Ids of up to ``limit`` due ready jobs of ``consumers`` in claim order, not locked."""
    return [r[0] for r in _rows(conn, queries.in_schema(schema).job_claim_candidates,
                                {"consumers": consumers, "limit": limit, "skip": skip})]


def bury_job(conn: Executor, job: Job, error: str, *, schema: str | None = None) -> bool:
    """Dead-letter claimed ``job`` (fenced) with ``last_error`` = ``error``; True if it changed."""
    return _execute(conn, queries.in_schema(schema).job_bury, {"id": job.id, "fence": job.fence, "error": error}) == 1


def bury_ready_job(conn: Executor, job_id: int, error: str, *, schema: str | None = None) -> bool:
    """Dead-letter ready job ``job_id`` with ``last_error`` = ``error``; True if it changed."""
    return _execute(conn, queries.in_schema(schema).job_bury_ready, {"id": job_id, "error": error}) == 1


@dataclass(frozen=True, slots=True)
class RelayInfo:
    """What a relay writes about itself in the registry (``outbox_relays``, shown by
    ``outbox-relay relays``): the outbox ``version`` it runs, the ``consumers`` it has
    handlers for and its ``concurrency`` (worker slots)."""

    version: str
    consumers: tuple[str, ...]
    concurrency: int


def package_version() -> str:
    """The installed outbox-relay distribution's version ("unknown" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:
        return "unknown"


def relay_seen(conn: Executor, worker_id: str, buffer: list[int], *, info: RelayInfo | None = None,
               schema: str | None = None) -> None:
    """Write (or refresh) the row of relay ``worker_id`` (``host:pid:suffix``) in
    ``outbox_relays``: seen now, listing ``buffer`` (the fences it holds unstarted) and
    nothing stale (``relay_seen``), with ``info`` (None keeps what the row holds)."""
    host, _, rest = worker_id.partition(":")
    pid = rest.partition(":")[0]
    _execute(conn, queries.in_schema(schema).relay_seen, {
        "relay": worker_id, "host": host, "pid": int(pid) if pid.isdigit() else 0, "buffer": buffer,
        "version": info.version if info else None, "consumers": list(info.consumers) if info else None,
        "concurrency": info.concurrency if info else None})


def relay_buffer_remove(conn: Executor, worker_id: str, fences: list[int], *, schema: str | None = None) -> None:
    """Unlist ``fences`` from relay ``worker_id``'s buffered claims (``relay_buffer_remove``):
    their handlers are about to start."""
    _execute(conn, queries.in_schema(schema).relay_buffer_remove, {"relay": worker_id, "removed": fences})


def relay_delete(conn: Executor, worker_id: str, *, schema: str | None = None) -> None:
    """Remove relay ``worker_id``'s row of ``outbox_relays`` (a clean stop)."""
    _execute(conn, queries.in_schema(schema).relay_delete, {"relay": worker_id})


def _ids_fences(jobs: list[Job]) -> dict[str, list[int]]:
    return {"ids": [j.id for j in jobs], "fences": [j.fence for j in jobs]}


def notify_head(conn: Executor, *, schema: str | None = None) -> None:
    """Tell every relay on ``schema`` that jobs were handed back with their early place in
    the queue (``queries.jobs_notify_head``), on commit of ``conn``'s transaction."""
    channel = notify_channel(JOBS_CHANNEL, schema or "public")
    _execute(conn, queries.in_schema(schema).jobs_notify_head, {"channel": channel})


def promote_keys(conn: Executor, params: dict[str, list[str]], *, schema: str | None = None) -> list[int]:
    """Run ``job_promote_many`` with ``params`` (``consumers``, ``keys``: the ordered keys of
    finished jobs, :func:`outbox.relay.ordering.promotion_params`); returns the ids promoted."""
    return [r[0] for r in _rows(conn, queries.in_schema(schema).job_promote_many, params)]


def heartbeat_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Renew the leases of ``jobs``; returns the fences of the claims still owned (fence and
    status match). Fences, not ids: one process may hold a job's old claim (its worker
    paused past the lease) and its new claim at once, and only the new one is owned. A job
    an operator asked to cancel gets ``job.cancel_requested`` here."""
    if not jobs:
        return set()
    params = {**_ids_fences(jobs), "leases": [j.lease_seconds for j in jobs]}
    rows = _rows(conn, queries.in_schema(schema).job_heartbeat_many, params)
    cancelled = {r[1] for r in rows if r[2]}
    for job in jobs:
        if job.fence in cancelled:
            job.mark_cancel_requested()
    return {r[1] for r in rows}


def complete_jobs(conn: Executor, jobs: list[Job], *, keep_done: bool = True, schema: str | None = None) -> set[int]:
    """Mark ``jobs`` done (fenced); returns the ids that changed. With ``keep_done`` false a
    done job's row is deleted instead (``retention_done = 0``,
    :attr:`~outbox.settings.OutboxSettings.keep_done`); one an operator asked to cancel
    is still kept, ``cancelled``."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.in_schema(schema).job_complete_many,
                                {**_ids_fences(jobs), "keep_done": keep_done})}


def release_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Hand ``jobs`` back as ready now, attempt not counted (fenced); returns changed ids."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.in_schema(schema).job_release_many, _ids_fences(jobs))}


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt: retry after ``delay`` seconds, unless ``permanent`` or out of
    attempts. ``timed_out``: the handler ran past its timeout (the watchdog's report)."""

    delay: float
    permanent: bool
    error: str
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Snoozed:
    """The handler raised :class:`~outbox.Snooze`: ready again in ``seconds``, the attempt
    not counted."""

    seconds: float


def snooze_jobs(conn: Executor, snoozed: list[tuple[Job, Snoozed]], *, schema: str | None = None) -> set[int]:
    """Put snoozed jobs back to ready after their delay, attempt given back, ``snoozes + 1``
    (fenced, ``job_snooze_many``); returns the ids that changed."""
    if not snoozed:
        return set()
    return {r[0] for r in _rows(conn, queries.in_schema(schema).job_snooze_many, {
        "ids": [j.id for j, _ in snoozed], "fences": [j.fence for j, _ in snoozed],
        "delays": [s.seconds for _, s in snoozed]})}


def fail_jobs(conn: Executor, failures: list[tuple[Job, Failure]], *, schema: str | None = None) -> dict[int, str]:
    """Record failed attempts (fenced); returns ``{id: new status}`` for rows that changed."""
    if not failures:
        return {}
    rows = _rows(conn, queries.in_schema(schema).job_fail_many, {
        "ids": [j.id for j, _ in failures], "fences": [j.fence for j, _ in failures],
        "delays": [f.delay for _, f in failures], "permanent": [f.permanent for _, f in failures],
        "errors": [f.error for _, f in failures],
    })
    return {r[0]: r[1] for r in rows}


# ------------------------------------------------------------------ the runner

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


_DONE = Outcome.DONE
_COMMITTED = Outcome.COMMITTED
_STALE = Outcome.STALE
_RELEASE = Outcome.RELEASE
_CANCELLED = Outcome.CANCELLED
#: What a transaction rolled back for an operator's cancel returns, the cancel still to record.
_CancelRequested = Literal[transaction.Completion.CANCEL_REQUESTED]
#: ``outbox.job.outcome`` of a span whose run ended with an Outcome (:mod:`outbox.telemetry.tracing`).
_SPAN_OUTCOMES = {Outcome.DONE: "done", Outcome.COMMITTED: "committed", Outcome.STALE: "stale",
                  Outcome.RELEASE: "released", Outcome.TIMED_OUT: "timed_out", Outcome.CANCELLED: "cancelled"}


@dataclass(frozen=True, slots=True)
class _RetryInPlace:
    """A transactional handler's transaction failed with a serialization failure or a
    deadlock (``sqlstate``); it runs again in place, the attempt not counted again."""

    exc: BaseException
    sqlstate: str


class HandlerSession(Session):
    """The ``Session`` given to transactional handlers. The relay owns the transaction:
    ``commit()`` raises, since the job's completion must commit with the handler's writes.
    Use ``flush()`` to send writes early, or a SAVEPOINT (``begin_nested()``). An
    ``async def`` handler gets an ``AsyncSession`` around one of these, so the same holds."""

    def commit(self) -> None:
        """Refused inside a handler (:class:`~outbox.errors.HandlerMisuseError`: the job is
        dead at once); outbox commits."""
        raise HandlerMisuseError(
            "a transactional handler must not commit: outbox commits its writes together with the job's completion")


def check_returned(sub: Subscriber, result: Any) -> None:
    """Raise :class:`~outbox.errors.HandlerMisuseError` when a handler returned an awaitable
    (a ``def`` handler that returns a coroutine, or an ``async def`` one that returns
    another): the work it stands for never ran, and retrying cannot change that. A
    coroutine is closed first, so Python does not warn it was never awaited."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise HandlerMisuseError(
            f"the handler of {sub.consumer!r} returned {type(result).__name__} {getattr(result, '__qualname__', '')!s} "
            "instead of running it: declare it `async def` (outbox awaits it) or await the call inside it")


class WorkerContext:
    """What one worker thread keeps for the handlers it runs, each made on first use: an
    event loop for ``async def`` handlers, and for async transactional handlers an
    :class:`~sqlalchemy.ext.asyncio.AsyncEngine` of one connection made by
    ``async_engine`` (an async engine's pool must stay on one event loop). A thread that
    never runs an ``async def`` handler makes neither. Not thread-safe: one per thread;
    :meth:`close` at the end."""

    def __init__(self, async_engine: Callable[[], AsyncEngine]) -> None:
        self._make_async_engine = async_engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_engine: AsyncEngine | None = None
        self._transaction_engine: AsyncEngine | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """This thread's event loop."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def connect_async(self) -> AsyncConnection:
        """A started ``AsyncConnection`` of this thread's async engine, its transactions at
        :data:`outbox.relay.transaction.ISOLATION_LEVEL`; raises what connecting raises."""
        if self._transaction_engine is None:
            self._async_engine = self._make_async_engine()
            self._transaction_engine = self._async_engine.execution_options(
                isolation_level=transaction.ISOLATION_LEVEL)
        return self.loop.run_until_complete(self._transaction_engine.connect().start())

    def close(self) -> None:
        """Dispose of the async engine and close the event loop (if made)."""
        if self._async_engine is not None:
            try:
                self.loop.run_until_complete(self._async_engine.dispose())
            except Exception:  # noqa: BLE001 - closing down
                pass
            self._async_engine = self._transaction_engine = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None


async def bounded(awaitable: Any, seconds: float | None) -> Any:
    """Await ``awaitable`` for at most ``seconds`` (None: no bound); past it, the awaitable
    is cancelled and :class:`~outbox.HandlerTimeoutError` raised (a ``TimeoutError`` of the
    handler's own propagates as it is)."""
    if seconds is None:
        return await awaitable
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise HandlerTimeoutError(seconds) from None
        raise


class JobExecutor:
    """Runs one claimed job's handler and says how it ended: an :class:`Outcome` or a
    :class:`Failure` (the statement that records it is the caller's). Shared by the
    relay's worker threads (:class:`JobRunner`) and :func:`outbox.testing.drain`.

    Lease mode: ``handler(job)`` outside any transaction. Transactional mode: a connection
    first (:meth:`outbox.relay.transaction.HandlerConnections.acquire`), then
    ``handler(job, session)`` between :func:`outbox.relay.transaction.begin` and
    :func:`outbox.relay.transaction.complete` in one READ COMMITTED transaction, run again in
    place after a serialization failure or deadlock (at most
    :data:`outbox.relay.transaction.IN_PLACE_RETRIES` times, while the claim is held). An
    ``async def`` handler runs on the thread's event loop (:class:`WorkerContext`); an
    async transactional one gets an ``AsyncSession`` and the same steps.

    ``held(job)`` says whether the caller still holds the claim; ``stopping`` (the relay
    draining) cuts waits short; ``completing(job)`` is called as the fenced completion of
    a transactional handler is about to run, ``abandoned(job)`` when that transaction
    failed instead. ``stats["retried_in_place"]`` counts in-place retries.
    ``reraise_interrupts=True`` (for :func:`outbox.testing.drain`, which runs handlers in the
    caller's thread) lets a ``KeyboardInterrupt`` or ``SystemExit`` out of a handler, after
    its transaction rolled back, instead of recording it as the attempt's failure; the
    caller still holds the claim then and hands it back.

    Timeouts (a subscriber's ``timeout``, seconds): an ``async def`` handler is cancelled
    (``asyncio.timeout``) and its attempt fails with :class:`~outbox.HandlerTimeoutError`.
    A ``def`` handler is watched by ``watchdog`` (:mod:`outbox.relay.watchdog`), armed once the
    handler's connection (if any) is had: if it fires, the run ends as
    :attr:`Outcome.TIMED_OUT` whenever the handler returns, and a transactional handler's
    transaction rolls back instead of completing. Without a watchdog, a ``def`` handler is
    not bounded. ``raise Snooze(seconds)`` ends the run as :class:`Snoozed`."""

    def __init__(self, settings: OutboxSettings, connections: transaction.HandlerConnections, *,
                 held: Callable[[Job], bool], stopping: threading.Event,
                 completing: Callable[[Job], None] = lambda job: None,
                 abandoned: Callable[[Job], None] = lambda job: None,
                 stats: Counters | None = None, reraise_interrupts: bool = False,
                 watchdog: Watchdog | None = None) -> None:
        self.reraise_interrupts = reraise_interrupts
        self.watchdog = watchdog
        self.settings = settings
        self.connections = connections
        self.held = held
        self.stopping = stopping
        self.completing = completing
        self.abandoned = abandoned
        self.stats = stats if stats is not None else Counters(("retried_in_place",))
        self._warned_return: set[str] = set()  # consumers whose handler returned a value (warned once)

    def run(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        """Run ``sub``'s handler for ``job`` once (a transactional one perhaps again in
        place); never raises for the handler's failures. With OpenTelemetry installed, the
        run is a CONSUMER span, child of the publisher's context (:mod:`outbox.telemetry.tracing`)."""
        if not tracing.active():
            return self._run(job, sub, context)
        with tracing.process_span(job) as span:
            outcome = self._run(job, sub, context)
            if isinstance(outcome, Failure):
                tracing.set_outcome(span, "failed")
            elif isinstance(outcome, Snoozed):
                tracing.set_outcome(span, "snoozed")
            elif outcome is Outcome.TIMED_OUT:
                tracing.set_outcome(span, "timed_out", error=f"the handler ran past its timeout of {sub.timeout}s")
            else:
                tracing.set_outcome(span, _SPAN_OUTCOMES[outcome])
        return outcome

    def _run(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        try:
            if sub.transactional:
                outcome = self._run_transactional(job, sub, context)
            else:
                self._arm(job, sub)
                try:
                    if sub.is_async:
                        result = context.loop.run_until_complete(bounded(sub.handler(job), sub.timeout))
                    else:
                        result = sub.handler(job)
                    check_returned(sub, result)
                except BaseException as exc:  # noqa: BLE001 - any failure of a handler is the job's
                    outcome = self.failure(job, exc)
                else:
                    self._warn_return(sub, result)
                    outcome = _DONE
        finally:
            timed_out = self.watchdog is not None and self.watchdog.end(job)
        if timed_out:
            log.info("result of job %s (%s) dropped: its handler ran past its timeout and the job was handed back",
                     job.id, job.consumer, extra=job_fields(job, outcome="timed_out"))
            return Outcome.TIMED_OUT
        return outcome

    def _arm(self, job: Job, sub: Subscriber) -> None:
        """Start the watchdog on ``job``'s handler, if it has a timeout (an ``async def``
        one past its own cancellation, as a backstop)."""
        if self.watchdog is not None and sub.timeout is not None:
            self.watchdog.arm(job, sub.timeout + (ASYNC_BACKSTOP_SECONDS if sub.is_async else 0.0))

    def _completing(self, job: Job) -> None:
        """A transactional handler returned and its completion is about to run: refused
        (the transaction rolls back) if the watchdog already failed the attempt."""
        if self.watchdog is not None and self.watchdog.disarm(job):
            raise LeaseLostError(f"job {job.id}: the handler ran past its timeout; its attempt was failed and "
                                 "the job handed back")
        self.completing(job)

    def _run_transactional(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure | Snoozed:
        """Get a connection first (waiting while the claim is held; released, attempt not
        counted, without one), then run the handler and the fenced completion in one
        transaction, retried in place after a serialization failure or deadlock while the
        claim is held."""
        conn = self.connections.acquire(lambda: self.held(job) and not self.stopping.is_set(),
                                        job.lease_seconds, self.stopping,
                                        context.connect_async if sub.is_async else None)
        if conn is None:
            if job.lease_lost:
                return _STALE
            log.info("job %s (%s) released: no database connection for its transaction", job.id, job.consumer,
                     extra=job_fields(job, outcome="released"))
            return _RELEASE
        self._arm(job, sub)
        try:
            retries = 0
            while True:
                if sub.is_async:
                    outcome = context.loop.run_until_complete(self._async_transaction_once(job, sub, conn))
                else:
                    outcome = self._transaction_once(job, sub, conn)
                if outcome is transaction.Completion.CANCEL_REQUESTED:
                    return self._record_cancel(job, sub, conn, context)
                if not isinstance(outcome, _RetryInPlace):
                    return outcome
                if retries >= transaction.IN_PLACE_RETRIES or not self.held(job):
                    return self.failure(job, outcome.exc)
                retries += 1
                self.stats.add("retried_in_place")
                log.info("job %s (%s): %s in its transaction (%s); running it again in place (%d/%d, attempt %s "
                         "not counted again)", job.id, job.consumer, transaction.RETRY_SQLSTATES[outcome.sqlstate],
                         describe(outcome.exc), retries, transaction.IN_PLACE_RETRIES, job.attempt,
                         extra=job_fields(job, outcome="retried_in_place", sqlstate=outcome.sqlstate))
                self.stopping.wait(transaction.retry_pause(retries))
                job.restore_input()  # the rerun sees the payload the first run saw, not what it changed
        finally:
            try:
                if sub.is_async:
                    context.loop.run_until_complete(conn.close())
                else:
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - a broken connection; the pool replaces it
                log.debug("closing job %s's transaction connection failed: %s", job.id, describe(exc))

    def _record_cancel(self, job: Job, sub: Subscriber, conn: Any, context: WorkerContext) -> Outcome:
        """The handler's transaction was rolled back because an operator cancelled the job:
        record ``cancelled`` (fenced) in a transaction of its own on ``conn``. If that
        statement fails (the connection broke), the job is released instead, whose fenced
        statement records ``cancelled`` too (``job_release_many``)."""
        try:
            if sub.is_async:
                recorded = context.loop.run_until_complete(conn.run_sync(
                    transaction.record_cancel, job.id, job.fence, schema=self.settings.schema_name))
            else:
                recorded = transaction.record_cancel(conn, job.id, job.fence, schema=self.settings.schema_name)
        except DBAPIError as exc:
            log.warning("job %s (%s): its handler's transaction was rolled back for a cancel, but recording the "
                        "cancel failed (%s); releasing it, which records cancelled", job.id, job.consumer,
                        describe(exc), extra=job_fields(job, outcome="released"))
            return _RELEASE
        return _CANCELLED if recorded else _STALE

    def _transaction_once(self, job: Job, sub: Subscriber, conn: Connection,
                          ) -> Outcome | Failure | Snoozed | _RetryInPlace | _CancelRequested:
        """One transaction on ``conn``: begin (limits), handler, complete (fenced), commit;
        :attr:`~outbox.relay.transaction.Completion.CANCEL_REQUESTED` when it was rolled back
        because an operator cancelled the job (the cancel is still to record)."""
        session = HandlerSession(bind=conn)
        try:
            with session:
                transaction.begin(session, job.lease_seconds, job.fence)
                result = sub.handler(job, session)
                check_returned(sub, result)  # before the completion: a misuse rolls the writes back
                completion = transaction.complete(session, job.id, job.fence, lambda: self._completing(job),
                                                  keep_done=self.settings.keep_done, schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, completion, result)

    async def _async_transaction_once(self, job: Job, sub: Subscriber, conn: AsyncConnection,
                                      ) -> Outcome | Failure | Snoozed | _RetryInPlace | _CancelRequested:
        """:meth:`_transaction_once` for an ``async def`` handler: the same steps on an
        ``AsyncSession`` (its sync session runs :func:`outbox.relay.transaction.begin` and
        :func:`outbox.relay.transaction.complete` through ``run_sync``)."""
        session = AsyncSession(bind=conn, sync_session_class=HandlerSession)
        try:
            async with session:
                await session.run_sync(transaction.begin, job.lease_seconds, job.fence)
                result = await bounded(sub.handler(job, session), sub.timeout)
                check_returned(sub, result)
                completion = await session.run_sync(transaction.complete, job.id, job.fence,
                                                    lambda: self._completing(job), keep_done=self.settings.keep_done,
                                                    schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, completion, result)

    def _transaction_ended(self, job: Job, sub: Subscriber, completion: transaction.Completion,
                           result: Any) -> Outcome | _CancelRequested:
        """The outcome of a handler's transaction that :func:`outbox.relay.transaction.complete`
        ended; unless it committed, the session's close has rolled the handler's writes back."""
        if completion is transaction.Completion.CANCEL_REQUESTED:
            return completion
        if completion is transaction.Completion.STALE:
            return _STALE
        self._warn_return(sub, result)
        return _COMMITTED

    def _transaction_failed(self, job: Job, exc: BaseException) -> Outcome | Failure | Snoozed | _RetryInPlace:
        """The outcome of a handler's transaction that raised ``exc`` (rolled back)."""
        self.abandoned(job)
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            if getattr(exc.orig, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT:
                # The server ended the session because the handler sat idle inside its
                # transaction for longer than the lease: the handler's doing, so the
                # attempt counts (released, a handler that is always this slow would be
                # retried forever). Fenced: if a pause cost this worker the job, the
                # failure report changes nothing.
                log.warning("job %s (%s): its transaction sat idle longer than the lease and the server ended "
                            "it; counted as a failed attempt", job.id, job.consumer,
                            extra=job_fields(job, outcome="failed"))
                return self.failure(job, exc)
            # The connection broke (server restart, terminated backend): not the
            # handler's failure, so the attempt does not count. The release is fenced:
            # if the commit did happen before the connection broke, it changes nothing.
            log.warning("job %s (%s): database connection lost during its transaction (%s); releasing it",
                        job.id, job.consumer, describe(exc), extra=job_fields(job, outcome="released"))
            return _RELEASE
        sqlstate = transaction.retryable_sqlstate(exc)
        if sqlstate is not None and not isinstance(exc, LeaseLostError):
            return _RetryInPlace(exc, sqlstate)
        return self.failure(job, exc)

    def failure(self, job: Job, exc: BaseException) -> Outcome | Failure | Snoozed:
        """The outcome of an attempt that raised ``exc``: :attr:`Outcome.STALE` when the
        claim was lost (``LeaseLostError``, or ``job.lease_lost``), :class:`Snoozed` for a
        :class:`~outbox.Snooze`, else a :class:`Failure`
        whose delay is :func:`outbox.backoff.retry_delay` of the attempt (``PermanentError``:
        permanent). Re-raises ``exc`` if it is a ``KeyboardInterrupt`` or ``SystemExit`` and
        the executor was made with ``reraise_interrupts``."""
        if self.reraise_interrupts and isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if isinstance(exc, LeaseLostError) or job.lease_lost:
            return _STALE
        if isinstance(exc, Snooze):
            return Snoozed(exc.seconds)
        if tracing.active():
            tracing.record_failure(job, exc)
        s = self.settings
        return Failure(
            delay=backoff.retry_delay(job.attempt, base=s.backoff_base, cap=s.backoff_cap, jitter=s.backoff_jitter),
            permanent=isinstance(exc, PermanentError),
            error=format_error(exc),
        )

    def _warn_return(self, sub: Subscriber, result: Any) -> None:
        if result is not None and sub.consumer not in self._warned_return:
            self._warned_return.add(sub.consumer)
            log.warning("handler of %s returned %s; the value is ignored (handlers return None)",
                        sub.consumer, type(result).__name__)


