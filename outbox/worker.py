"""The job runner: claim, run the handler, heartbeat, finish.

Threads (one concurrency model: threads, with one event loop per worker thread for
``async def`` handlers):

* the **dispatcher** owns one autocommit connection and does all the claiming and
  finishing: each round it takes the outcomes the workers posted and, when the local
  buffer has room, claims more. Completions and the claim travel in one statement
  (``job_complete_claim_many``), so a busy runner pays one round trip and one commit per
  batch; failures and releases have their own statements. It holds at most
  ``concurrency + prefetch`` claims whose handlers have not returned;
  Jobs it claims for idle workers go to them at once; the rest wait in the buffer, listed
  in the relay's row of ``outbox_relays`` by the same statement;
* the **starter** hands buffered jobs to workers as they come free, on its own
  connection: one small statement unlists all it hands over at once (``relay_buffer_remove``),
  and only then do their handlers start (architecture notes, "Attempts and crashes");
* ``concurrency`` **worker threads** run handlers through the **executor**
  (:class:`JobExecutor`, which runs one job and says how it ended; ``outbox.testing.drain``
  uses the same one); a worker is free again the moment its handler returns (the claim
  stays held, and heartbeated, until its outcome is written);
* the **heartbeat** renews the leases of every claim this process holds, buffered ones
  included, in one statement every lease/3 (of the shortest lease).

Every write that changes a claimed job names its fence and requires ``status='running'``;
a row that does not come back means the report was stale and changed nothing: it is
dropped and logged (architecture notes, "Statements").

Lease mode: the handler runs outside any transaction. When a heartbeat finds the job gone
(reaped after a pause, or released), ``job.lease_lost`` becomes true, ``job.check_lease()``
raises, and the handler's result is dropped.

Transactional mode: the handler runs as ``handler(job, session)`` inside a transaction that
ends with the fenced completion; if the fence no longer matches, the whole transaction,
handler writes included, rolls back. Its connection is checked out first, its isolation is
READ COMMITTED, and a serialization failure or deadlock is retried in place
(:mod:`outbox.transaction`). An ``async def`` transactional handler gets an
``AsyncSession`` on a connection of its worker thread's own async engine (made on first
use, one connection) and the same steps.

Failures: an exception puts the job back to ``ready`` after :func:`outbox.backoff.retry_delay`
or, once attempts reach ``max_attempts``, to ``dead``; :class:`~outbox.PermanentError` goes
to ``dead`` at once. ``last_error`` holds the type, message and a bounded traceback.

Database outages: every loop retries and carries on, through the relay's shared
:class:`~outbox.reconnect.Reconnector` (short probes while the database is unreachable, all
loops released as soon as one gets through; capped backoff for other errors); an outcome
that could not be written is retried until it is, or until the relay stops (then the lease
expires and the reaper takes the job back: at-least-once).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import heapq
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from . import backoff, flow, poison, transaction
from .db import queries
from .db.engine import describe, is_disconnect, make_async_engine
from .db.tables import JOBS_CHANNEL, notify_channel
from .errors import ConfigurationError, LeaseLostError, PermanentError
from .job import Job
from .notify import Wakeup
from .reconnect import Reconnector
from .registry import Outbox, Subscriber
from .settings import OutboxSettings

log = logging.getLogger("outbox.worker")

#: Longest ``last_error`` kept, in characters (type + message + traceback).
MAX_ERROR_CHARS = 8192
MAX_MESSAGE_CHARS = 2048
#: Longest a dispatcher claims after its hint (the key of the last job it claimed) before it
#: claims from the head of the ready jobs again, seconds: how long a job that sorts before
#: the hint (released, retried early, more urgent) may wait behind a backlog.
HINT_SECONDS = 1.0
#: SQLSTATE of "terminating connection due to idle-in-transaction timeout".
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
#: Longest an idle dispatcher leaves its relay's row of ``outbox_relays`` unwritten, seconds
#: (pruning forgets relays not seen for ``maintenance.RELAY_GONE_AFTER``).
RELAY_SEEN_INTERVAL = 30.0
#: Longest stop() waits past the grace period for the dispatcher's last round to return,
#: seconds: a claim still executing then has its jobs released, not left to their leases.
STOP_ROUND_WAIT = 5.0


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
    """A :class:`Job` from a row of ``job_claim_many`` (columns in its ``RETURNING`` order)."""
    return Job(row[0], row[1], row[2], row[7], row[8], row[9], row[10] or {}, row[3], row[4], row[5],
               lease_seconds, row[11])


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
                            worker_id: str, *, schema: str | None = None) -> tuple[set[int], list[Job]]:
    """Mark ``done`` completed (fenced) and claim up to ``limit`` due jobs, in one statement
    (``job_complete_claim_many``); returns (ids completed, jobs claimed). A job of ``done``
    missing from the ids was a stale report and changed nothing."""
    completed, claimed, _ = complete_and_claim_after(conn, done, leases, limit, worker_id, None, schema=schema)
    return completed, claimed


def complete_and_claim_after(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                             worker_id: str, after: tuple[int, Any, int] | None, *,
                             buffer: BufferMark | None = None, skip: list[int] | None = None,
                             only: list[int] | None = None, schema: str | None = None,
                             ) -> tuple[set[int], list[Job], tuple[int, Any, int] | None]:
    """:func:`complete_and_claim_jobs` whose claim starts after the claim-order key ``after``
    (``(priority, run_at, id)``, as returned before; None: at the head of the ready jobs);
    also returns the key of the last job it claimed (None when it claimed none). The jobs
    claimed come back in claim order.

    ``buffer``, when given, is written to the relay's row in the same statement (see
    :class:`BufferMark`): the first ``buffer.start_now`` jobs claimed are taken as started,
    the rest as buffered. The claim leaves out the job ids in ``skip`` and, when ``only``
    is given, takes only jobs among those ids (:mod:`outbox.poison`)."""
    key = after or HEAD_KEY
    mark = buffer or BufferMark(None, 0)
    rows = _rows(conn, queries.in_schema(schema).job_complete_claim_many, {
        **_ids_fences(done), **_claim_params(leases, limit, worker_id),
        "after_priority": key[0], "after_run_at": key[1], "after_id": key[2],
        "relay": mark.relay, "start_now": mark.start_now,
        "skip": skip or [], "only": only})
    completed = {r[0] for r in rows if r[14]}
    claimed = sorted((r for r in rows if not r[14]), key=lambda r: (r[12], r[13], r[0]))
    last = (claimed[-1][12], claimed[-1][13], claimed[-1][0]) if claimed else None
    jobs = []
    for r in claimed:
        job = job_from_row(r, leases[r[2]])
        job._claim_order = (r[12], r[13], r[0])
        jobs.append(job)
    return completed, jobs, last


@dataclass(frozen=True, slots=True)
class BufferMark:
    """What a dispatcher round adds to its relay's row of ``outbox_relays`` (``relay``;
    None changes nothing): the jobs the round claims after the first ``start_now`` (in
    claim order; those go to idle workers) join the list of buffered claims. The reaper
    gives the attempt back to an expired claim still listed (migration 0003)."""

    relay: str | None
    start_now: int


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


def relay_seen(conn: Executor, worker_id: str, buffer: list[int], *, schema: str | None = None) -> None:
    """Write (or refresh) the row of relay ``worker_id`` (``host:pid:suffix``) in
    ``outbox_relays``: seen now, listing ``buffer`` (the fences it holds unstarted) and
    nothing stale (``relay_seen``)."""
    host, _, rest = worker_id.partition(":")
    pid = rest.partition(":")[0]
    _execute(conn, queries.in_schema(schema).relay_seen, {
        "relay": worker_id, "host": host, "pid": int(pid) if pid.isdigit() else 0, "buffer": buffer})


def _ids_fences(jobs: list[Job]) -> dict[str, list[int]]:
    return {"ids": [j.id for j in jobs], "fences": [j.fence for j in jobs]}


def notify_head(conn: Executor, *, schema: str | None = None) -> None:
    """Tell every relay on ``schema`` that jobs were handed back with their early place in
    the queue (``queries.jobs_notify_head``), on commit of ``conn``'s transaction."""
    channel = notify_channel(JOBS_CHANNEL, schema or "public")
    _execute(conn, queries.in_schema(schema).jobs_notify_head, {"channel": channel})


def heartbeat_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Renew the leases of ``jobs``; returns the fences of the claims still owned (fence and
    status match). Fences, not ids: one process may hold a job's old claim (its worker
    paused past the lease) and its new claim at once, and only the new one is owned."""
    if not jobs:
        return set()
    params = {**_ids_fences(jobs), "leases": [j.lease_seconds for j in jobs]}
    return {r[1] for r in _rows(conn, queries.in_schema(schema).job_heartbeat_many, params)}


def complete_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Mark ``jobs`` done (fenced); returns the ids that changed."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.in_schema(schema).job_complete_many, _ids_fences(jobs))}


def release_jobs(conn: Executor, jobs: list[Job], *, schema: str | None = None) -> set[int]:
    """Hand ``jobs`` back as ready now, attempt not counted (fenced); returns changed ids."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.in_schema(schema).job_release_many, _ids_fences(jobs))}


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt: retry after ``delay`` seconds, unless ``permanent`` or out of attempts."""

    delay: float
    permanent: bool
    error: str


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


_DONE = Outcome.DONE
_COMMITTED = Outcome.COMMITTED
_STALE = Outcome.STALE
_RELEASE = Outcome.RELEASE


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
        """Refused inside a handler (ConfigurationError); outbox commits."""
        raise ConfigurationError(
            "a transactional handler must not commit: outbox commits its writes together with the job's completion")


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
        :data:`outbox.transaction.ISOLATION_LEVEL`; raises what connecting raises."""
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


class JobExecutor:
    """Runs one claimed job's handler and says how it ended: an :class:`Outcome` or a
    :class:`Failure` (the statement that records it is the caller's). Shared by the
    relay's worker threads (:class:`JobRunner`) and :func:`outbox.testing.drain`.

    Lease mode: ``handler(job)`` outside any transaction. Transactional mode: a connection
    first (:meth:`outbox.transaction.HandlerConnections.acquire`), then
    ``handler(job, session)`` between :func:`outbox.transaction.begin` and
    :func:`outbox.transaction.complete` in one READ COMMITTED transaction, run again in
    place after a serialization failure or deadlock (at most
    :data:`outbox.transaction.IN_PLACE_RETRIES` times, while the claim is held). An
    ``async def`` handler runs on the thread's event loop (:class:`WorkerContext`); an
    async transactional one gets an ``AsyncSession`` and the same steps.

    ``held(job)`` says whether the caller still holds the claim; ``stopping`` (the relay
    draining) cuts waits short; ``completing(job)`` is called as the fenced completion of
    a transactional handler is about to run, ``abandoned(job)`` when that transaction
    failed instead. ``stats["retried_in_place"]`` counts in-place retries.
    ``reraise_interrupts=True`` (for :func:`outbox.testing.drain`, which runs handlers in the
    caller's thread) lets a ``KeyboardInterrupt`` or ``SystemExit`` out of a handler, after
    its transaction rolled back, instead of recording it as the attempt's failure; the
    caller still holds the claim then and hands it back."""

    def __init__(self, settings: OutboxSettings, connections: transaction.HandlerConnections, *,
                 held: Callable[[Job], bool], stopping: threading.Event,
                 completing: Callable[[Job], None] = lambda job: None,
                 abandoned: Callable[[Job], None] = lambda job: None,
                 stats: dict[str, int] | None = None, reraise_interrupts: bool = False) -> None:
        self.reraise_interrupts = reraise_interrupts
        self.settings = settings
        self.connections = connections
        self.held = held
        self.stopping = stopping
        self.completing = completing
        self.abandoned = abandoned
        self.stats = stats if stats is not None else {"retried_in_place": 0}
        self._warned_return: set[str] = set()  # consumers whose handler returned a value (warned once)

    def run(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure:
        """Run ``sub``'s handler for ``job`` once (a transactional one perhaps again in
        place); never raises for the handler's failures."""
        if sub.transactional:
            return self._run_transactional(job, sub, context)
        try:
            if sub.is_async:
                result = context.loop.run_until_complete(sub.handler(job))
            else:
                result = sub.handler(job)
        except BaseException as exc:  # noqa: BLE001 - any failure of a handler is the job's
            return self.failure(job, exc)
        self._warn_return(sub, result)
        return _DONE

    def _run_transactional(self, job: Job, sub: Subscriber, context: WorkerContext) -> Outcome | Failure:
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
            log.info("job %s (%s) released: no database connection for its transaction", job.id, job.consumer)
            return _RELEASE
        try:
            retries = 0
            while True:
                if sub.is_async:
                    outcome = context.loop.run_until_complete(self._async_transaction_once(job, sub, conn))
                else:
                    outcome = self._transaction_once(job, sub, conn)
                if not isinstance(outcome, _RetryInPlace):
                    return outcome
                if retries >= transaction.IN_PLACE_RETRIES or not self.held(job):
                    return self.failure(job, outcome.exc)
                retries += 1
                self.stats["retried_in_place"] += 1
                log.info("job %s (%s): %s in its transaction (%s); running it again in place (%d/%d, attempt %s "
                         "not counted again)", job.id, job.consumer, transaction.RETRY_SQLSTATES[outcome.sqlstate],
                         describe(outcome.exc), retries, transaction.IN_PLACE_RETRIES, job.attempt)
                self.stopping.wait(transaction.retry_pause(retries))
        finally:
            try:
                if sub.is_async:
                    context.loop.run_until_complete(conn.close())
                else:
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - a broken connection; the pool replaces it
                log.debug("closing job %s's transaction connection failed: %s", job.id, describe(exc))

    def _transaction_once(self, job: Job, sub: Subscriber, conn: Connection) -> Outcome | Failure | _RetryInPlace:
        """One transaction on ``conn``: begin (limits), handler, complete (fenced), commit."""
        session = HandlerSession(bind=conn)
        try:
            with session:
                transaction.begin(session, job.lease_seconds, job.fence)
                result = sub.handler(job, session)
                committed = transaction.complete(session, job.id, job.fence, lambda: self.completing(job),
                                                 schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, committed, result)

    async def _async_transaction_once(self, job: Job, sub: Subscriber, conn: AsyncConnection) -> Outcome | Failure | _RetryInPlace:
        """:meth:`_transaction_once` for an ``async def`` handler: the same steps on an
        ``AsyncSession`` (its sync session runs :func:`outbox.transaction.begin` and
        :func:`outbox.transaction.complete` through ``run_sync``)."""
        session = AsyncSession(bind=conn, sync_session_class=HandlerSession)
        try:
            async with session:
                await session.run_sync(transaction.begin, job.lease_seconds, job.fence)
                result = await sub.handler(job, session)
                committed = await session.run_sync(transaction.complete, job.id, job.fence,
                                                   lambda: self.completing(job), schema=self.settings.schema_name)
        except BaseException as exc:  # noqa: BLE001
            return self._transaction_failed(job, exc)
        return self._transaction_ended(job, sub, committed, result)

    def _transaction_ended(self, job: Job, sub: Subscriber, committed: bool, result: Any) -> Outcome:
        if not committed:  # the session's close rolled the handler's writes back
            return _STALE
        self._warn_return(sub, result)
        return _COMMITTED

    def _transaction_failed(self, job: Job, exc: BaseException) -> Outcome | Failure | _RetryInPlace:
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
                            "it; counted as a failed attempt", job.id, job.consumer)
                return self.failure(job, exc)
            # The connection broke (server restart, terminated backend): not the
            # handler's failure, so the attempt does not count. The release is fenced:
            # if the commit did happen before the connection broke, it changes nothing.
            log.warning("job %s (%s): database connection lost during its transaction (%s); releasing it",
                        job.id, job.consumer, describe(exc))
            return _RELEASE
        sqlstate = transaction.retryable_sqlstate(exc)
        if sqlstate is not None and not isinstance(exc, LeaseLostError):
            return _RetryInPlace(exc, sqlstate)
        return self.failure(job, exc)

    def failure(self, job: Job, exc: BaseException) -> Outcome | Failure:
        """The outcome of an attempt that raised ``exc``: :attr:`Outcome.STALE` when the
        claim was lost (``LeaseLostError``, or ``job.lease_lost``), else a :class:`Failure`
        whose delay is :func:`outbox.backoff.retry_delay` of the attempt (``PermanentError``:
        permanent). Re-raises ``exc`` if it is a ``KeyboardInterrupt`` or ``SystemExit`` and
        the executor was made with ``reraise_interrupts``."""
        if self.reraise_interrupts and isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if isinstance(exc, LeaseLostError) or job.lease_lost:
            return _STALE
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


class JobRunner:
    """Claims and runs the jobs of ``registry``'s consumers until :meth:`stop` is called.

    ``wake`` is set (by LISTEN, the router or the reaper) when new jobs may be ready;
    polling every ``settings.poll_interval`` seconds is the fallback. The runner holds up to
    ``concurrency + prefetch`` claims whose handlers have not returned: ``concurrency``
    running and up to ``prefetch`` waiting in the dispatcher's buffer (their leases run from
    the claim and are heartbeated like the running ones; on SIGTERM they are released at
    once).

    Attempts and crashes: a claim counts an attempt, and the relay's row of
    ``outbox_relays`` lists the fences of its buffered claims, written in the statement that
    claims them and rewritten (without it) before a buffered job goes to a worker; the
    reaper gives the attempt back to an expired claim still listed. So a ``kill -9`` never
    charges a job whose handler had not started, and a handler that kills its process is
    charged each time it starts. No statement per job: claims are listed by the claim
    statement itself, and the **starter** thread unlists buffered jobs in one small
    statement for every worker that came free meanwhile, before it hands them over.
    """

    def __init__(self, engine: Engine, registry: Outbox, settings: OutboxSettings,
                 worker_id: str, wake: Wakeup, *, reconnect: Reconnector | None = None,
                 async_engine: Callable[[], AsyncEngine] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.schema = settings.schema_name  # every statement below runs on this schema's tables
        self.statements = queries.in_schema(self.schema)
        self.worker_id = worker_id
        self.wake = wake
        self.reconnect = reconnect or Reconnector(settings.reconnect_max)  # the relay's, shared by its loops
        self.subscribers: dict[str, Subscriber] = {s.consumer: s for s in registry}
        self.leases = {s.consumer: s.lease or settings.default_lease for s in registry}
        self.stats: dict[str, int] = {k: 0 for k in (
            "claimed", "completed", "retried", "dead", "stale", "lease_lost", "released", "retried_in_place")}
        # Handlers run in the worker threads through one executor; an async transactional
        # handler's thread makes an async engine of one connection on first use.
        self._async_engine = async_engine or (lambda: make_async_engine(
            engine.url, pool_size=1, max_overflow=0, application_name="outbox-relay",
            prepared_statements=settings.pooler == "none"))
        # Claims held, by fence: a fence names one claim, while a job id may be held twice
        # (an attempt that outlived its lease, and the re-claim that took it over).
        self._inflight: dict[int, Job] = {}
        # Claimed jobs whose handler has not started, in claim order (under the lock): the
        # dispatcher appends, the starter takes from the head; _buffered holds their fences
        # until the starter's statement has unlisted them (stop() leaves those alone).
        self._buffer: collections.deque[Job] = collections.deque()
        self._buffered: set[int] = set()
        # Workers taken: jobs handed to a worker whose handler has not returned, plus slots
        # reserved by a statement in flight that will hand jobs over (so none is over-issued).
        self._issued = 0
        self._finishing: set[int] = set()  # fences whose outcome is being written
        self._released: set[int] = set()  # fences released at shutdown while their handler ran
        self._lock = threading.Lock()
        self._start_wake = threading.Condition(self._lock)  # buffer grew, a worker came free, stopping
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[tuple[Job, Any] | None] = queue.SimpleQueue()
        self._stop_claiming = threading.Event()
        self._draining = threading.Event()
        self._stopped = threading.Event()
        # Set by the dispatcher between two rounds once it has seen _stop_claiming: no claim
        # is in flight after that, so what stop() counts is everything the runner holds.
        self._claims_closed = threading.Event()
        self._threads: list[threading.Thread] = []
        # Claim-order key (priority, run_at, id) of the last job claimed: claims start after
        # it, until HINT_SECONDS after the last claim from the head (performance notes).
        self._hint: tuple[int, Any, int] | None = None
        self._hint_until = 0.0
        self._conn: Any = None  # the dispatcher's own pooled connection (a PoolProxiedConnection)
        self._seen_at = 0.0  # time.monotonic() of the last write of this relay's row
        self._abandoned = False  # closing, buffered claims could not be released
        # Ready jobs whose claim fails alone and could not even be dead-lettered (poison.py).
        self._quarantine = poison.Quarantine("job")
        self._claim_failures = 0  # claims in a row that failed for every job (poison.SystemicError)
        self._claims_paused_until = 0.0
        # Flow control (architecture notes, "Flow control"): capped and rate-limited consumers
        # are claimed on a path of their own, which says when it is next worth a round trip.
        self.flow = flow.FlowControl(self.subscribers, self.leases, worker_id, settings.poll_interval,
                                     schema=self.schema)
        self.executor = JobExecutor(settings, transaction.HandlerConnections(engine, settings.reconnect_max),
                                    held=self._holds, stopping=self._draining, completing=self._mark_finishing,
                                    abandoned=self._unmark_finishing, stats=self.stats)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the dispatcher, worker and heartbeat threads (daemon threads, so a handler
        stuck past the shutdown grace period cannot keep the process alive)."""
        if not self.subscribers:
            return
        self._spawn("outbox-dispatcher", self._dispatch_loop)
        self._spawn("outbox-starter", self._start_loop)
        for n in range(self.settings.concurrency):
            self._spawn(f"outbox-worker-{n}", self._work_loop)
        self._spawn("outbox-heartbeat", self._heartbeat_loop)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def in_flight(self) -> int:
        """Claims this runner holds: buffered, running, or waiting for their outcome to be written."""
        with self._lock:
            return len(self._inflight)

    def stop(self, grace: float, cut_short: threading.Event | None = None) -> None:
        """Stop claiming; release buffered claims at once; let running handlers finish for up
        to ``grace`` seconds (or until ``cut_short`` is set); release (fenced) what is still
        held so other relays can claim it at once; flush outcomes.

        A claim in flight when this is called is waited for (the dispatcher says when it has
        stopped claiming, at most ``grace`` seconds): counting what is held before that
        would miss the jobs the claim is about to return."""
        if not self._threads:
            return
        self._stop_claiming.set()
        self._draining.set()
        self.wake.poke()
        deadline = time.monotonic() + grace
        cut = cut_short or threading.Event()
        while not self._claims_closed.wait(0.02) and time.monotonic() < deadline and not cut.is_set():
            pass
        while self.in_flight() and time.monotonic() < deadline and not cut.is_set():
            time.sleep(0.02)
        with self._lock:
            # Buffered claims are the dispatcher's to release (it does at once when draining).
            left = [j for j in self._inflight.values()
                    if j.fence not in self._finishing and j.fence not in self._buffered]
        if left:
            for job in left:
                job.mark_lease_lost()
            self._release_now(left)
        for _ in range(self.settings.concurrency):
            self._todo.put(None)
        self._outcomes.put(None)
        self._stopped.set()
        self.wake.poke()
        with self._start_wake:
            self._start_wake.notify_all()
        for thread in self._threads:
            if thread.name in ("outbox-dispatcher", "outbox-starter"):
                # Past the grace period only while a round is still out (a claim that returns
                # late must still have its jobs released before the process exits).
                thread.join(timeout=max(0.5, deadline - time.monotonic()) + STOP_ROUND_WAIT)
            else:
                thread.join(timeout=0.05)

    def _autocommit(self) -> Connection:
        """A pooled connection on which each statement commits by itself: the heartbeat and
        the shutdown release are single atomic statements, so an explicit transaction would
        only add BEGIN and COMMIT round trips."""
        return self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def _release_now(self, jobs: list[Job]) -> None:
        try:
            with self._autocommit() as conn:
                released = release_jobs(conn, jobs, schema=self.schema)
                if released:
                    notify_head(conn, schema=self.schema)
        except DBAPIError as exc:
            log.warning("could not release %d jobs on shutdown (%s); their leases will expire", len(jobs), describe(exc))
            return
        self.stats["released"] += len(released)
        log.info("released %d jobs still running after the grace period", len(released))
        with self._lock:
            for job in jobs:
                if self._inflight.pop(job.fence, None) is not None:
                    self._released.add(job.fence)

    # ------------------------------------------------------------- dispatcher

    def _dispatch_loop(self) -> None:
        """Claim jobs and write outcomes, on one dedicated autocommit connection.

        Each round takes every outcome the workers have posted, hands buffered jobs to the
        workers that are free and, when the buffer has room, claims more: completions, the
        claim and the relay's buffer list go in one statement (``job_complete_claim_many``:
        one round trip, one commit); failures and releases, which are rare, in their own
        fenced statements. A claim that found fewer due jobs than it asked for marks the
        table drained: until a wake-up (NOTIFY, router, reaper) or ``poll_interval`` passes,
        only rounds that write completions also claim.

        Stopping: once it sees ``_stop_claiming`` it claims no more and says so
        (``_claims_closed``); while draining it releases every buffered claim; it exits
        when stop() has queued its marker and every outcome is written, so no claim it
        holds outlives the relay unreleased.
        """
        failures = 0
        drained_until = 0.0  # monotonic time before which a bare claim is not worth a round trip
        carry: list[tuple[Job, Any]] = []  # outcomes a failed round could not write
        closing = False
        while True:
            if self._stop_claiming.is_set():
                self._claims_closed.set()  # between rounds: no claim is in flight any more
            elif not failures:
                self._mark_seen()
            batch = carry + self._take_outcomes()
            if any(item is None for item in batch):
                closing = True
                batch = [item for item in batch if item is not None]
            want = 0 if self._stop_claiming.is_set() else self._room()
            has_done = any(o is _DONE for _, o in batch)
            self.flow.finished(j.consumer for j, _ in batch)  # flow control: a capped slot may be free
            limited = self.flow.room(want)  # flow control: the limited claim's share, 0 unless due
            want -= limited
            claim = want > 0 and (has_done or (time.monotonic() >= drained_until and self._worth_claiming(want)))
            with self._lock:
                to_release = bool(self._buffer) and self._draining.is_set()
            if not batch and not claim and not to_release and not limited:
                if closing:
                    break
                timeout = max(0.0, drained_until - time.monotonic()) if drained_until else self.settings.poll_interval
                timeout = min(timeout or self.settings.poll_interval, self.flow.wait_seconds())  # flow control
                jobs_hint, _ = self.wake.wait(min(timeout or self.settings.poll_interval, RELAY_SEEN_INTERVAL))
                if jobs_hint:
                    self.flow.poke()  # flow control: new jobs may be ready for a limited consumer
                if jobs_hint or time.monotonic() >= drained_until:
                    drained_until = 0.0
                continue
            try:
                claimed, from_head = self._round(batch, want if claim else 0, limited)
                failures = self.reconnect.recovered(failures, "claim and completion")
                carry = []
            except (DBAPIError, psycopg.Error, poison.SystemicError) as exc:
                self._drop_connection(exc)
                if self._stopped.is_set() or (not is_disconnect(exc) and failures >= 3):
                    # A closing relay, or an error that retrying will not fix: the leases
                    # expire and the reaper hands the jobs out again (at-least-once).
                    if batch:
                        log.error("dropping %d outcomes (%s); the jobs return when their leases expire",
                                  len(batch), describe(exc))
                    self._forget(j for j, _ in batch)
                    carry = []
                    if closing:
                        self._abandon_buffer()
                        break
                else:
                    carry = batch
                failures = self.reconnect.backoff(failures, "claim and completion", exc, self._stopped)
                continue
            except Exception:  # noqa: BLE001 - a bug must not stop the relay's claiming for good
                log.exception("unexpected error in the dispatcher's round; retrying its outcomes")
                carry = batch
                failures = self.reconnect.backoff(failures, "claim and completion", RuntimeError("unexpected"),
                                                  self._stopped, log_failure=False)
                continue
            if claim and claimed < want and from_head:
                drained_until = time.monotonic() + self.settings.poll_interval
            elif claim:
                drained_until = 0.0
        self._unregister()
        self._close_connection()

    def _abandon_buffer(self) -> None:
        """Closing without a database: forget the buffered claims. Their leases expire and
        the reaper gives each its attempt back, since the relay's row still lists them."""
        with self._lock:
            if self._buffer:
                log.warning("%d buffered jobs could not be released; they return, attempt not counted, "
                            "when their leases expire", len(self._buffer))
            for job in self._buffer:
                self._inflight.pop(job.fence, None)
            self._buffered.clear()
            self._buffer.clear()
        self._abandoned = True

    def _take_outcomes(self) -> list[Any]:
        batch: list[Any] = []
        while len(batch) < 1000:
            try:
                batch.append(self._outcomes.get_nowait())
            except queue.Empty:
                break
        return batch

    def _room(self) -> int:
        """How many jobs to claim now: room in the buffer, at most ``claim_batch``; none
        while claims are paused (:meth:`_pause_claims`)."""
        if time.monotonic() < self._claims_paused_until:
            return 0
        limit = self.settings.concurrency + self.settings.prefetch
        with self._lock:
            held = self._issued + len(self._buffer)
        return max(0, min(self.settings.claim_batch, limit - held))

    def _worth_claiming(self, want: int) -> bool:
        """A claim of its own (no completions to carry it) is worth its round trip when it
        can take half a batch, or when a worker would otherwise sit idle."""
        with self._lock:
            idle = self.settings.concurrency - self._issued > len(self._buffer)
        return idle or want >= max(1, min(self.settings.claim_batch, self.settings.prefetch) // 2)

    def _connection(self) -> psycopg.Connection[Any]:
        """The dispatcher's psycopg connection, checked out of the pool once and kept
        (autocommit: every statement it runs is atomic by itself). A new one first writes
        this relay's row of ``outbox_relays`` (its buffer list lives there)."""
        if self._conn is None:
            raw = self.engine.raw_connection()
            driver = cast(psycopg.Connection[Any], raw.driver_connection)  # the engine's driver is psycopg
            driver.autocommit = True
            try:
                relay_seen(driver, self.worker_id, self._buffer_fences(), schema=self.schema)
            except BaseException:
                raw.invalidate()
                raise
            self._conn = raw
            self._seen_at = time.monotonic()
        return cast(psycopg.Connection[Any], self._conn.driver_connection)

    def _mark_seen(self) -> None:
        """Refresh this relay's row every ``RELAY_SEEN_INTERVAL`` seconds, busy or idle, so
        pruning never takes it for a dead relay's, and drop stale fences from its list.
        Errors are left to the next round."""
        if time.monotonic() - self._seen_at < RELAY_SEEN_INTERVAL:
            return
        try:
            fresh = self._conn is None
            conn = self._connection()  # a new connection writes the row itself
            if not fresh:
                relay_seen(conn, self.worker_id, self._buffer_fences(), schema=self.schema)
            self._seen_at = time.monotonic()
        except (DBAPIError, psycopg.Error) as exc:
            self._drop_connection(exc)

    def _unregister(self) -> None:
        """A clean stop: every claim is finished or released, so this relay's row goes (a
        relay that could not release its buffer keeps it, for the reaper)."""
        if self._abandoned:
            return
        try:
            _execute(self._connection(), self.statements.relay_delete, {"relay": self.worker_id})
        except (DBAPIError, psycopg.Error) as exc:
            log.info("could not remove this relay's row of outbox_relays (%s); pruning will", describe(exc))

    def _drop_connection(self, exc: BaseException) -> None:
        """After an error: a broken connection is thrown away (the next round checks out a
        new one); a healthy one, in autocommit, is kept."""
        conn = self._conn
        if conn is None:
            return
        driver = conn.driver_connection
        if is_disconnect(exc) or driver is None or driver.closed or driver.broken:
            self._conn = None
            try:
                conn.invalidate()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def _round(self, pending: list[tuple[Job, Any]], want: int, limited: int = 0) -> tuple[int, bool]:
        """Write the outcomes in ``pending`` and claim up to ``want`` jobs (and up to ``limited``
        of the capped or rate-limited consumers, :meth:`_claim_limited`); returns how many
        were claimed and whether the claim started at the head of the ready jobs (a short
        claim after the hint does not mean the table is drained). Claimed jobs go to idle
        workers at once (their slots reserved before the statement, so they were never
        listed as buffered) and the rest into the buffer, listed by the same statement;
        the starter hands buffered jobs over. While draining, the buffer is released.
        Outcomes leave ``pending`` as their statement commits, so after an error
        ``pending`` holds exactly what is still to write."""
        # Each statement commits on its own (autocommit): each locks the rows it finishes in
        # id order, and the claim skips locked rows, so with no transaction holding one
        # statement's locks while the next one waits, none of them (nor a concurrent
        # heartbeat) can deadlock. Each is fenced, so each alone is safe.
        unwritten: list[tuple[Job, Any]] = []
        done: list[Job] = []
        failed: list[tuple[Job, Failure]] = []
        release: list[Job] = []
        for item in pending:
            job, outcome = item
            if job.lease_lost or outcome is _STALE or outcome is _COMMITTED:
                unwritten.append(item)
            elif outcome is _DONE:
                done.append(job)
            elif outcome is _RELEASE:
                release.append(job)
            else:
                failed.append(item)
        if unwritten:
            self.stats["completed"] += sum(1 for _, o in unwritten if o is _COMMITTED)
            self._stale([j for j, o in unwritten if o is not _COMMITTED])
            self._forget(j for j, _ in unwritten)
        drained = self._take_buffer() if self._draining.is_set() else []
        release += drained
        # Off the buffer now: carried like any outcome if a statement below fails.
        pending[:] = [(j, _DONE) for j in done] + failed + [(j, _RELEASE) for j in release]
        claimed: list[Job] = []
        from_head = True
        if done or want:
            conn = self._connection()
            start_now = self._reserve(want)
            sent = time.monotonic()  # the database's now() of the claim is later: a safe lower bound
            rewound = want > 0 and self.wake.take_rewind()  # jobs were handed back ahead of the hint
            hinted = want > 0 and self._hint is not None and time.monotonic() < self._hint_until and not rewound
            mark = BufferMark(self.worker_id, start_now)
            buried: set[int] = set()
            try:
                try:
                    completed, claimed, last = complete_and_claim_after(
                        conn, done, self.leases, want, self.worker_id, self._hint if hinted else None,
                        buffer=mark, skip=self._quarantine.ids(), schema=self.schema)
                except psycopg.Error as exc:
                    if not poison.is_data_error(exc):
                        raise
                    log.warning("claim and completion failed (%s); running them by halves to find the rows that "
                                "cause it", poison.describe_error(exc))
                    completed, buried, claimed = self._complete_and_claim_by_halves(conn, done, want, mark)
                    last, hinted = None, True  # claim from the head next time
                else:
                    if want:
                        self._claim_failures = 0
            except BaseException:
                self._unreserve(start_now)
                raise
            if want:
                if not hinted:
                    self._hint_until = time.monotonic() + HINT_SECONDS
                # Found fewer than asked after the hint: there may be ready jobs before it
                # (released, retried early, more urgent); the next claim starts at the head.
                self._hint = None if hinted and len(claimed) < want else last
                from_head = not hinted
            for job in claimed:
                job._lease_bound = sent + job.lease_seconds
            self._unreserve(start_now - min(start_now, len(claimed)))
            self._issue(claimed[:start_now])
            self._hold(claimed[start_now:])
            self.stats["completed"] += len(completed)
            if len(completed) + len(buried) < len(done):
                self._stale([j for j in done if j.id not in completed and j.id not in buried])
            self._forget(done)
            del pending[:len(done)]
        if failed:
            statuses, buried = self._by_halves("recording a failed attempt", failed, lambda part: fail_jobs(
                self._connection(), list(part), schema=self.schema), job_of=lambda item: item[0], merged={})
            self._log_failures(failed, statuses)
            self._stale([j for j, _ in failed if j.id not in statuses and j.id not in buried])
            self._forget(j for j, _ in failed)
            del pending[:len(failed)]
        if release:
            released, buried = self._by_halves("releasing", release, lambda part: release_jobs(
                self._connection(), list(part), schema=self.schema))
            self.stats["released"] += len(released)
            if released:
                notify_head(self._connection(), schema=self.schema)
            self._stale([j for j in release if j.id not in released and j.id not in buried])
            self._forget(release)
            pending[:] = []
        if limited:  # flow control: capped and rate-limited consumers, a claim of their own, after the outcomes
            self._claim_limited(limited)
        return len(claimed), from_head

    def _claim_limited(self, room: int) -> None:
        """Flow control: claim up to ``room`` jobs of the capped or rate-limited consumers
        (:class:`outbox.flow.FlowControl`), handed over like any claim: idle workers first,
        the rest buffered (listed by the same transaction)."""
        start_now = self._reserve(room)
        sent = time.monotonic()
        try:
            rows = self.flow.claim(self._connection(), room, self.worker_id, start_now)
        except BaseException:
            self._unreserve(start_now)
            raise
        claimed = []
        for r in rows:
            job = job_from_row(r, self.leases[r[2]])
            job._claim_order = (r[12], r[13], r[0])
            job._lease_bound = sent + job.lease_seconds
            claimed.append(job)
        self._unreserve(start_now - min(start_now, len(claimed)))
        self._issue(claimed[:start_now])
        self._hold(claimed[start_now:])

    def _complete_and_claim_by_halves(self, conn: psycopg.Connection[Any], done: list[Job], want: int,
                                      mark: BufferMark) -> tuple[set[int], set[int], list[Job]]:
        """After a data error of the combined statement: the completions by halves, then
        the claim (with the buffer list) alone and, if that fails too, by halves of its
        candidates, each half writing the buffer list as it then stands. A job that fails
        alone is dead-lettered naming the error (or quarantined); the others go on.
        Returns (ids completed, ids of ``done`` dead-lettered, jobs claimed in claim order)."""
        completed, buried = self._by_halves("completing", done, lambda part: complete_jobs(conn, list(part),
                                                                                            schema=self.schema))
        start_left = mark.start_now
        claimed: list[Job] = []

        def claim(only: list[int] | None) -> list[Job]:
            nonlocal start_left
            _, got, _ = complete_and_claim_after(
                conn, [], self.leases, want if only is None else len(only), self.worker_id, None,
                buffer=BufferMark(mark.relay, start_left), skip=self._quarantine.ids(), only=only,
                schema=self.schema)
            start_left = max(0, start_left - len(got))
            return got

        if not want:  # only the buffer list to write: no row of a job to blame
            return completed, buried, claim(None)
        try:
            parts, poisoned = poison.whole_or_halves(
                "claiming", lambda: claim(None),
                lambda: claim_candidates(conn, list(self.leases), want, self._quarantine.ids(), schema=self.schema),
                lambda part: claim(list(part)))
        except poison.SystemicError as exc:
            self._pause_claims(exc)
            return completed, buried, claimed
        self._claim_failures = 0
        for part in parts:
            claimed += part
        for job_id, failure in poisoned:
            error = f"Claiming failed for this job: {poison.describe_error(failure)}"
            dead = poison.try_record(lambda: bury_ready_job(conn, job_id, error, schema=self.schema))
            if dead is None:
                self._quarantine.add(job_id, failure, "claiming")
            elif dead:
                self.stats["dead"] += 1
                log.error("dead-lettered job %s: %s", job_id, error)
        return completed, buried, claimed

    def _pause_claims(self, exc: poison.SystemicError) -> None:
        """Every job a claim takes fails: claim nothing for a capped, growing while (the
        rounds go on writing outcomes and starting buffered jobs); logged once per episode."""
        self._claim_failures += 1
        delay = backoff.retry_delay(self._claim_failures, base=1.0, cap=max(1.0, self.settings.reconnect_max),
                                    jitter=0.25)
        self._claims_paused_until = time.monotonic() + delay
        if self._claim_failures == 1:
            log.error("claiming paused: the claim fails for every job it takes, so none is dead-lettered (%s); "
                      "trying again with backoff", exc)

    def _by_halves(self, doing: str, items: list[Any], run: Callable[[Any], Any],
                   job_of: Callable[[Any], Job] = lambda item: item, merged: Any = None) -> tuple[Any, set[int]]:
        """Run a fenced batch statement over ``items`` (jobs, or (job, failure) pairs);
        returns its result merged (a set of ids, or a dict) and the ids of the jobs it
        dead-lettered. On a data error it runs by halves (:func:`outbox.poison.isolate`) and
        dead-letters each job that fails alone, naming the error (fenced); a job even that
        fails for is left to its lease (the reaper meets the same error and quarantines
        it). ``merged`` is the empty result to merge into (default: a set). Other errors
        propagate."""
        parts, poisoned = poison.isolate(items, run)
        merged = set() if merged is None else merged
        for part in parts:
            merged.update(part)
        buried_ids: set[int] = set()
        if not poisoned:
            return merged, buried_ids
        conn = self._connection()
        for item, exc in poisoned:
            job = job_of(item)
            error = f"{doing.capitalize()} failed for this job: {poison.describe_error(exc)}"
            buried = poison.try_record(lambda: bury_job(conn, job, error, schema=self.schema))
            if buried is None:
                log.error("job %s (%s) fence %s: %s, and so did dead-lettering it; left to its lease",
                          job.id, job.consumer, job.fence, error)
            elif buried:
                self.stats["dead"] += 1
                buried_ids.add(job.id)
                log.error("dead-lettered job %s (%s) fence %s: %s", job.id, job.consumer, job.fence, error)
        return merged, buried_ids

    def _buffer_fences(self) -> list[int]:
        with self._lock:
            return list(self._buffered)

    def _take_buffer(self) -> list[Job]:
        """Draining: everything still buffered, off the buffer (to be released)."""
        with self._lock:
            jobs = list(self._buffer)
            self._buffer.clear()
            for job in jobs:
                self._buffered.discard(job.fence)
        return jobs

    def _reserve(self, want: int) -> int:
        """Reserve the idle workers (at most ``want``) for jobs about to be claimed, so the
        starter does not hand buffered jobs to them meanwhile; returns how many."""
        with self._lock:
            n = max(0, min(want, self.settings.concurrency - self._issued))
            self._issued += n
        return n

    def _unreserve(self, n: int) -> None:
        if n:
            with self._start_wake:
                self._issued -= n
                if self._buffer:
                    self._start_wake.notify()

    def _hold(self, jobs: list[Job]) -> None:
        """Take newly claimed jobs into the buffer (the relay's row lists them)."""
        if not jobs:
            return
        self.stats["claimed"] += len(jobs)
        with self._start_wake:
            for job in jobs:
                self._inflight[job.fence] = job
                self._buffered.add(job.fence)
            if self._buffer and jobs[0]._claim_order < self._buffer[-1]._claim_order:
                # Claimed from the head after a hint: jobs handed back by another relay sort
                # before the backlog already buffered, and start first, as in the table.
                merged = heapq.merge(self._buffer, jobs, key=lambda j: j._claim_order)
                self._buffer = collections.deque(merged)
            else:
                self._buffer.extend(jobs)
            self._start_wake.notify()

    def _issue(self, claimed: list[Job]) -> None:
        """Hand jobs just claimed to the workers reserved for them (never listed as buffered)."""
        if not claimed:
            return
        self.stats["claimed"] += len(claimed)
        with self._lock:
            for job in claimed:
                self._inflight[job.fence] = job
        for job in claimed:
            self._todo.put(job)

    # ------------------------------------------------------------- starter

    def _start_loop(self) -> None:
        """Hand buffered jobs to idle workers, on a connection of its own: take as many from
        the head of the buffer as workers are idle, unlist them in the relay's row
        (``relay_buffer_remove``, one small statement for all of them), and only once that
        has committed give them to the workers. So a job whose handler may have started is
        never listed, and a worker that finishes waits one short round trip, shared by every
        worker that came free meanwhile, not for the dispatcher's claim. A buffered job
        whose lease ran out while it waited (the process was paused, or starved) is
        released instead (fenced: a no-op if it was reaped or re-claimed meanwhile)."""
        failures = 0
        conn: Any = None
        while True:
            with self._start_wake:
                while not self._stopped.is_set() and (
                        self._draining.is_set() or not self._buffer
                        or self._issued >= self.settings.concurrency):
                    self._start_wake.wait(0.5)
                if self._stopped.is_set():
                    break
                jobs, expired = self._take_startable()
            for job in expired:
                log.warning("job %s (%s) fence %s not started: its lease ran out while it waited in the buffer",
                            job.id, job.consumer, job.fence)
                with self._lock:
                    self._finishing.add(job.fence)
                self._outcomes.put((job, _RELEASE))
                self.wake.poke()
            if not jobs:
                continue
            try:
                if conn is None:
                    conn = self.engine.raw_connection()
                    conn.driver_connection.autocommit = True
                _execute(conn.driver_connection, self.statements.relay_buffer_remove,
                         {"relay": self.worker_id, "removed": [j.fence for j in jobs]})
                failures = self.reconnect.recovered(failures, "starting buffered jobs")
            except (DBAPIError, psycopg.Error) as exc:
                with self._start_wake:
                    self._buffer.extendleft(reversed(jobs))  # back at the head, still listed
                    self._issued -= len(jobs)
                if conn is not None and (is_disconnect(exc) or conn.driver_connection is None
                                         or conn.driver_connection.closed or conn.driver_connection.broken):
                    try:
                        conn.invalidate()
                    except Exception:  # noqa: BLE001 - it is being thrown away
                        pass
                    conn = None
                failures = self.reconnect.backoff(failures, "starting buffered jobs", exc, self._stopped)
                continue
            with self._lock:
                for job in jobs:
                    self._buffered.discard(job.fence)
            for job in jobs:
                self._todo.put(job)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def _take_startable(self) -> tuple[list[Job], list[Job]]:
        """(Under the lock.) Off the head of the buffer, as many jobs as workers are idle,
        their slots taken; and the ones whose lease ran out while they waited."""
        jobs: list[Job] = []
        expired: list[Job] = []
        free = self.settings.concurrency - self._issued
        now = time.monotonic()
        while self._buffer and len(jobs) < free:
            job = self._buffer.popleft()
            if job.lease_lost or now >= job._lease_bound:
                self._buffered.discard(job.fence)
                expired.append(job)
            else:
                jobs.append(job)
        self._issued += len(jobs)
        return jobs, expired

    def _stale(self, jobs: list[Job]) -> None:
        """Log and count reports that changed nothing because the claim was no longer owned."""
        for job in jobs:
            if job.fence in self._released:
                log.info("result of job %s (%s) dropped: the relay released it at shutdown", job.id, job.consumer)
            else:
                self.stats["stale"] += 1
                log.warning("stale report dropped: job %s (%s) fence %s no longer owns the job",
                            job.id, job.consumer, job.fence)

    def _log_failures(self, failed: list[tuple[Job, Failure]], statuses: dict[int, str]) -> None:
        for job, failure in failed:
            status = statuses.get(job.id)
            if status == "dead":
                self.stats["dead"] += 1
                log.error("dead-lettered job %s (%s, event %s) after attempt %s/%s: %s", job.id, job.consumer,
                          job.event_id, job.attempt, job.max_attempts, failure.error.splitlines()[0][:300])
            elif status == "ready":
                self.stats["retried"] += 1
                log.info("job %s (%s) failed attempt %s/%s, retry in %.1fs: %s", job.id, job.consumer, job.attempt,
                         job.max_attempts, failure.delay, failure.error.splitlines()[0][:200])

    def _forget(self, jobs: Any) -> None:
        with self._lock:
            for job in jobs:
                self._inflight.pop(job.fence, None)
                self._finishing.discard(job.fence)

    # ------------------------------------------------------------- workers

    def _work_loop(self) -> None:
        context = WorkerContext(self._async_engine)
        try:
            while True:
                job = self._todo.get()
                if job is None:
                    break
                if self._draining.is_set() or job.lease_lost:
                    self._post(job, _RELEASE)
                    continue
                self._post(job, self.executor.run(job, self.subscribers[job.consumer], context))
        finally:
            context.close()

    def _post(self, job: Job, outcome: Any) -> None:
        """Hand a finished handler's outcome to the dispatcher; its worker slot is free now
        (the claim stays held, and heartbeated, until the outcome is written)."""
        with self._start_wake:
            self._issued -= 1
            self._finishing.add(job.fence)
            if self._buffer:  # the starter sleeps while the buffer is empty: no need to wake it
                self._start_wake.notify()
        self._outcomes.put((job, outcome))
        self.wake.poke()

    def _holds(self, job: Job) -> bool:
        """Whether this runner still holds ``job``'s claim: not lost to a heartbeat, and its
        lease not past the local bound renewed by each heartbeat."""
        return not job.lease_lost and time.monotonic() < job._lease_bound

    def _mark_finishing(self, job: Job) -> None:
        """A transactional handler's completion is about to run: a heartbeat that misses
        the row from now on must not take it for a lost lease."""
        with self._lock:
            self._finishing.add(job.fence)

    def _unmark_finishing(self, job: Job) -> None:
        with self._lock:
            self._finishing.discard(job.fence)

    # ------------------------------------------------------------- heartbeat

    def _heartbeat_loop(self) -> None:
        interval = min(self.leases.values()) / 3
        failures = 0
        while not self._stopped.wait(interval if not failures else 0):
            with self._lock:
                jobs = [j for j in self._inflight.values() if not j.lease_lost]
            if not jobs:
                continue
            sent = time.monotonic()
            try:
                with self._autocommit() as conn:
                    owned = self._heartbeat(conn, jobs)
                failures = self.reconnect.recovered(failures, "heartbeat")
            except (DBAPIError, poison.SystemicError) as exc:
                # Never longer than half a second between tries: leases are at stake.
                failures = self.reconnect.backoff(failures, "heartbeat", exc, self._stopped, cap=0.5)
                continue
            for job in jobs:
                if job.fence in owned:
                    job._lease_bound = sent + job.lease_seconds
            with self._lock:
                lost = [j for j in jobs
                        if j.fence not in owned and j.fence in self._inflight and j.fence not in self._finishing]
            for job in lost:
                job.mark_lease_lost()
                self.stats["lease_lost"] += 1
                log.warning("lease lost: job %s (%s) fence %s was taken back; its result will be dropped",
                            job.id, job.consumer, job.fence)


    def _heartbeat(self, conn: Connection, jobs: list[Job]) -> set[int]:
        """Renew the leases of ``jobs``; returns the fences still owned. A data error is
        confined to the jobs that cause it (:mod:`outbox.poison`): each is dead-lettered
        naming the error (fenced), or, where even that fails, reported not owned, so its
        worker is told and its lease runs out."""
        parts, poisoned = poison.isolate(jobs, lambda part: heartbeat_jobs(conn, list(part), schema=self.schema))
        owned: set[int] = set().union(*parts)
        for job, exc in poisoned:
            error = f"Renewing the lease failed for this job: {poison.describe_error(exc)}"
            buried = poison.try_record(lambda: bury_job(conn, job, error, schema=self.schema))
            log.error("job %s (%s) fence %s: %s%s", job.id, job.consumer, job.fence, error,
                      "; dead-lettered" if buried else "; dead-lettering it failed too, its lease will run out")
        return owned
