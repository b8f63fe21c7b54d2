"""The job runner: claim, run the handler, heartbeat, finish.

Threads (one concurrency model: threads, with one event loop per worker thread for
``async def`` handlers):

* the **dispatcher** owns one autocommit connection and does all the claiming and
  finishing: each round it takes the outcomes the workers posted and, when the local
  buffer has room, claims more. Completions and the claim travel in one statement
  (``job_complete_claim_many``), so a busy runner pays one round trip and one commit per
  batch; failures and releases have their own statements. It holds at most
  ``concurrency + prefetch`` claims whose handlers have not returned;
* ``concurrency`` **worker threads** run handlers; a worker is free again the moment its
  handler returns (the claim stays held, and heartbeated, until its outcome is written);
* the **heartbeat** renews the leases of every claim this process holds, buffered ones
  included, in one statement every lease/3 (of the shortest lease).

Every write that changes a claimed job names its fence and requires ``status='running'``;
a row that does not come back means the report was stale and changed nothing: it is
dropped and logged (docs/architecture.md, "Statements").

Lease mode: the handler runs outside any transaction. When a heartbeat finds the job gone
(reaped after a pause, or released), ``job.lease_lost`` becomes true, ``job.check_lease()``
raises, and the handler's result is dropped.

Transactional mode: the handler runs as ``handler(job, session)`` inside a transaction that
ends with the fenced completion; if the fence no longer matches, the whole transaction,
handler writes included, rolls back.

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
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from . import backoff
from .db import queries
from .db.engine import describe, is_disconnect
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
# work on its hot path); the SQL is the same named statement of ``db/queries.py`` either way.

Executor = Connection | psycopg.Connection[Any]

_PSYCOPG_DIALECT = psycopg_dialect.dialect()
_COMPILED: dict[int, str] = {}


def _rows(conn: Executor, statement: TextClause, params: dict[str, Any]) -> list[Any]:
    """Run ``statement`` on ``conn`` and return its rows (indexable by column position)."""
    if isinstance(conn, psycopg.Connection):
        sql = _COMPILED.get(id(statement))
        if sql is None:  # statements are module constants: compile each once, for psycopg's paramstyle
            sql = _COMPILED[id(statement)] = str(statement.compile(dialect=_PSYCOPG_DIALECT))
        return conn.execute(sql, params).fetchall()
    return list(conn.execute(statement, params).all())


def job_from_row(row: Any, lease_seconds: float) -> Job:
    """A :class:`Job` from a row of ``job_claim_many`` (columns in its ``RETURNING`` order)."""
    return Job(row[0], row[1], row[2], row[7], row[8], row[9], row[10] or {}, row[3], row[4], row[5],
               lease_seconds, row[11])


def _claim_params(leases: dict[str, float], limit: int, worker_id: str) -> dict[str, Any]:
    consumers = list(leases)
    return {"consumers": consumers, "leases": [leases[c] for c in consumers], "limit": limit, "worker": worker_id}


def claim_jobs(conn: Executor, leases: dict[str, float], limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` due jobs of the consumers in ``leases`` (consumer -> lease
    seconds) in ``conn``'s transaction; the caller commits."""
    rows = _rows(conn, queries.job_claim_many, _claim_params(leases, limit, worker_id))
    return [job_from_row(r, leases[r[2]]) for r in rows]


#: The lowest claim-order key (priority, run_at, id): a claim "after" it starts at the head.
HEAD_KEY: tuple[int, Any, int] = (-32768, "-infinity", 0)


def complete_and_claim_jobs(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                            worker_id: str) -> tuple[set[int], list[Job]]:
    """Mark ``done`` completed (fenced) and claim up to ``limit`` due jobs, in one statement
    (``job_complete_claim_many``); returns (ids completed, jobs claimed). A job of ``done``
    missing from the ids was a stale report and changed nothing."""
    completed, claimed, _ = complete_and_claim_after(conn, done, leases, limit, worker_id, None)
    return completed, claimed


def complete_and_claim_after(conn: Executor, done: list[Job], leases: dict[str, float], limit: int,
                             worker_id: str, after: tuple[int, Any, int] | None,
                             ) -> tuple[set[int], list[Job], tuple[int, Any, int] | None]:
    """:func:`complete_and_claim_jobs` whose claim starts after the claim-order key ``after``
    (``(priority, run_at, id)``, as returned before; None: at the head of the ready jobs);
    also returns the key of the last job it claimed (None when it claimed none)."""
    key = after or HEAD_KEY
    rows = _rows(conn, queries.job_complete_claim_many, {
        **_ids_fences(done), **_claim_params(leases, limit, worker_id),
        "after_priority": key[0], "after_run_at": key[1], "after_id": key[2]})
    completed = {r[0] for r in rows if r[14]}
    claimed = [r for r in rows if not r[14]]
    last = max(((r[12], r[13], r[0]) for r in claimed), default=None)
    return completed, [job_from_row(r, leases[r[2]]) for r in claimed], last


def _ids_fences(jobs: list[Job]) -> dict[str, list[int]]:
    return {"ids": [j.id for j in jobs], "fences": [j.fence for j in jobs]}


def heartbeat_jobs(conn: Executor, jobs: list[Job]) -> set[int]:
    """Renew the leases of ``jobs``; returns the fences of the claims still owned (fence and
    status match). Fences, not ids: one process may hold a job's old claim (its worker
    paused past the lease) and its new claim at once, and only the new one is owned."""
    if not jobs:
        return set()
    params = {**_ids_fences(jobs), "leases": [j.lease_seconds for j in jobs]}
    return {r[1] for r in _rows(conn, queries.job_heartbeat_many, params)}


def complete_jobs(conn: Executor, jobs: list[Job]) -> set[int]:
    """Mark ``jobs`` done (fenced); returns the ids that changed."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.job_complete_many, _ids_fences(jobs))}


def release_jobs(conn: Executor, jobs: list[Job]) -> set[int]:
    """Hand ``jobs`` back as ready now, attempt not counted (fenced); returns changed ids."""
    if not jobs:
        return set()
    return {r[0] for r in _rows(conn, queries.job_release_many, _ids_fences(jobs))}


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt: retry after ``delay`` seconds, unless ``permanent`` or out of attempts."""

    delay: float
    permanent: bool
    error: str


def fail_jobs(conn: Executor, failures: list[tuple[Job, Failure]]) -> dict[int, str]:
    """Record failed attempts (fenced); returns ``{id: new status}`` for rows that changed."""
    if not failures:
        return {}
    rows = _rows(conn, queries.job_fail_many, {
        "ids": [j.id for j, _ in failures], "fences": [j.fence for j, _ in failures],
        "delays": [f.delay for _, f in failures], "permanent": [f.permanent for _, f in failures],
        "errors": [f.error for _, f in failures],
    })
    return {r[0]: r[1] for r in rows}


# ------------------------------------------------------------------ the runner

_DONE = "done"          # lease mode: handler returned
_COMMITTED = "committed"  # transactional mode: completion already committed
_STALE = "stale"        # nothing to write: the fence no longer matches
_RELEASE = "release"


class _StaleCompletion(Exception):
    """The fenced completion inside a transactional handler's transaction matched no row."""


class HandlerSession(Session):
    """The ``Session`` given to transactional handlers. The relay owns the transaction:
    ``commit()`` raises, since the job's completion must commit with the handler's writes.
    Use ``flush()`` to send writes early, or a SAVEPOINT (``begin_nested()``)."""

    _outbox_owned = False

    def commit(self) -> None:
        """Refused inside a handler (ConfigurationError); outbox commits."""
        if not self._outbox_owned:
            raise ConfigurationError(
                "a transactional handler must not commit: outbox commits its writes together with the job's completion")
        super().commit()


class JobRunner:
    """Claims and runs the jobs of ``registry``'s consumers until :meth:`stop` is called.

    ``wake`` is set (by LISTEN, the router or the reaper) when new jobs may be ready;
    polling every ``settings.poll_interval`` seconds is the fallback. The runner holds up to
    ``concurrency + prefetch`` claims whose handlers have not returned: ``concurrency``
    running and up to ``prefetch`` waiting in a local buffer (their leases run from the
    claim and are heartbeated like the running ones; on SIGTERM they are released at once).
    """

    def __init__(self, engine: Engine, registry: Outbox, settings: OutboxSettings,
                 worker_id: str, wake: Wakeup, *, reconnect: Reconnector | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.worker_id = worker_id
        self.wake = wake
        self.reconnect = reconnect or Reconnector(settings.reconnect_max)  # the relay's, shared by its loops
        self.subscribers: dict[str, Subscriber] = {s.consumer: s for s in registry}
        self.leases = {s.consumer: s.lease or settings.default_lease for s in registry}
        self.stats: dict[str, int] = {k: 0 for k in (
            "claimed", "completed", "retried", "dead", "stale", "lease_lost", "released")}
        # Claims held, by fence: a fence names one claim, while a job id may be held twice
        # (an attempt that outlived its lease, and the re-claim that took it over).
        self._inflight: dict[int, Job] = {}
        self._active = 0  # claims whose handler has not returned: buffered or running
        self._finishing: set[int] = set()  # fences whose outcome is being written
        self._released: set[int] = set()  # fences released at shutdown while their handler ran
        self._lock = threading.Lock()
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[tuple[Job, Any] | None] = queue.SimpleQueue()
        self._stop_claiming = threading.Event()
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._warned_return: set[str] = set()
        # Claim-order key (priority, run_at, id) of the last job claimed: claims start after
        # it, until HINT_SECONDS after the last claim from the head (docs/performance.md).
        self._hint: tuple[int, Any, int] | None = None
        self._hint_until = 0.0
        self._conn: Any = None  # the dispatcher's own pooled connection (a PoolProxiedConnection)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the dispatcher, worker and heartbeat threads (daemon threads, so a handler
        stuck past the shutdown grace period cannot keep the process alive)."""
        if not self.subscribers:
            return
        self._spawn("outbox-dispatcher", self._dispatch_loop)
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
        held so other relays can claim it at once; flush outcomes."""
        if not self._threads:
            return
        self._stop_claiming.set()
        self._draining.set()
        self.wake.poke()
        deadline = time.monotonic() + grace
        while self.in_flight() and time.monotonic() < deadline and not (cut_short and cut_short.is_set()):
            time.sleep(0.02)
        with self._lock:
            left = [j for j in self._inflight.values() if j.fence not in self._finishing]
        if left:
            for job in left:
                job.mark_lease_lost()
            self._release_now(left)
        for _ in range(self.settings.concurrency):
            self._todo.put(None)
        self._outcomes.put(None)
        self._stopped.set()
        self.wake.poke()
        for thread in self._threads:
            thread.join(timeout=max(0.5, deadline - time.monotonic()) if thread.name == "outbox-dispatcher" else 0.05)

    def _autocommit(self) -> Connection:
        """A pooled connection on which each statement commits by itself: the heartbeat and
        the shutdown release are single atomic statements, so an explicit transaction would
        only add BEGIN and COMMIT round trips."""
        return self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def _release_now(self, jobs: list[Job]) -> None:
        try:
            with self._autocommit() as conn:
                released = release_jobs(conn, jobs)
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

        Each round takes every outcome the workers have posted and, when the buffer has
        room, claims more: completions and the claim go in one statement
        (``job_complete_claim_many``: one round trip, one commit); failures and releases,
        which are rare, in their own fenced statements. A claim that found fewer due jobs
        than it asked for marks the table drained: until a wake-up (NOTIFY, router,
        reaper) or ``poll_interval`` passes, only rounds that write completions also claim.
        """
        failures = 0
        drained_until = 0.0  # monotonic time before which a bare claim is not worth a round trip
        carry: list[tuple[Job, Any]] = []  # outcomes a failed round could not write
        closing = False
        while True:
            if self._draining.is_set():
                self._release_buffered()
            batch = carry + self._take_outcomes()
            if any(item is None for item in batch):
                closing = True
                batch = [item for item in batch if item is not None]
            want = 0 if self._stop_claiming.is_set() else self._room()
            has_done = any(o is _DONE for _, o in batch)
            claim = want > 0 and (has_done or (time.monotonic() >= drained_until and self._worth_claiming(want)))
            if not batch and not claim:
                if closing:
                    break
                timeout = max(0.0, drained_until - time.monotonic()) if drained_until else self.settings.poll_interval
                jobs_hint, _ = self.wake.wait(timeout or self.settings.poll_interval)
                if jobs_hint or time.monotonic() >= drained_until:
                    drained_until = 0.0
                continue
            try:
                claimed, from_head = self._round(batch, want if claim else 0)
                failures = self.reconnect.recovered(failures, "claim and completion")
                carry = []
            except (DBAPIError, psycopg.Error) as exc:
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
                        break
                else:
                    carry = batch
                failures = self.reconnect.backoff(failures, "claim and completion", exc, self._stopped)
                continue
            if claim and claimed < want and from_head:
                drained_until = time.monotonic() + self.settings.poll_interval
            elif claim:
                drained_until = 0.0
        self._close_connection()

    def _release_buffered(self) -> None:
        """Shutting down: hand back every claim still waiting in the buffer now, rather than
        when a worker comes free (busy workers may not, within the grace period)."""
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                return
            if job is None:  # a worker's stop sentinel: leave it for the workers
                self._todo.put(None)
                return
            self._post(job, _RELEASE)

    def _take_outcomes(self) -> list[Any]:
        batch: list[Any] = []
        while len(batch) < 1000:
            try:
                batch.append(self._outcomes.get_nowait())
            except queue.Empty:
                break
        return batch

    def _room(self) -> int:
        """How many jobs to claim now: room in the buffer, at most ``claim_batch``."""
        limit = self.settings.concurrency + self.settings.prefetch
        with self._lock:
            return max(0, min(self.settings.claim_batch, limit - self._active))

    def _worth_claiming(self, want: int) -> bool:
        """A claim of its own (no completions to carry it) is worth its round trip when it
        can take half a batch, or when a worker would otherwise sit idle."""
        with self._lock:
            idle = self._active < self.settings.concurrency
        return idle or want >= max(1, min(self.settings.claim_batch, self.settings.prefetch) // 2)

    def _connection(self) -> psycopg.Connection[Any]:
        """The dispatcher's psycopg connection, checked out of the pool once and kept
        (autocommit: every statement it runs is atomic by itself)."""
        if self._conn is None:
            raw = self.engine.raw_connection()
            raw.driver_connection.autocommit = True
            self._conn = raw
        return self._conn.driver_connection

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

    def _round(self, pending: list[tuple[Job, Any]], want: int) -> tuple[int, bool]:
        """Write the outcomes in ``pending`` and claim up to ``want`` jobs; returns how many
        were claimed and whether the claim started at the head of the ready jobs (a short
        claim after the hint does not mean the table is drained). Outcomes leave ``pending``
        as their statement commits, so after an error ``pending`` holds exactly what is
        still to write."""
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
        pending[:] = [(j, _DONE) for j in done] + failed + [(j, _RELEASE) for j in release]
        claimed: list[Job] = []
        from_head = True
        if done or want:
            conn = self._connection()
            if want:
                sent = time.monotonic()  # the database's now() of the claim is later: a safe lower bound
                hinted = self._hint is not None and time.monotonic() < self._hint_until
                completed, claimed, last = complete_and_claim_after(
                    conn, done, self.leases, want, self.worker_id, self._hint if hinted else None)
                if not hinted:
                    self._hint_until = time.monotonic() + HINT_SECONDS
                # Found fewer than asked after the hint: there may be ready jobs before it
                # (released, retried early, more urgent); the next claim starts at the head.
                self._hint = None if hinted and len(claimed) < want else last
                from_head = not hinted
                for job in claimed:
                    job._lease_bound = sent + job.lease_seconds
                self._hold(claimed)
            else:
                completed = complete_jobs(conn, done)
            self.stats["completed"] += len(completed)
            if len(completed) < len(done):
                self._stale([j for j in done if j.id not in completed])
            self._forget(done)
            del pending[:len(done)]
        if failed:
            statuses = fail_jobs(self._connection(), failed)
            self._log_failures(failed, statuses)
            self._stale([j for j, _ in failed if j.id not in statuses])
            self._forget(j for j, _ in failed)
            del pending[:len(failed)]
        if release:
            released = release_jobs(self._connection(), release)
            self.stats["released"] += len(released)
            self._stale([j for j in release if j.id not in released])
            self._forget(release)
            del pending[:]
        return len(claimed), from_head

    def _hold(self, jobs: list[Job]) -> None:
        """Take newly claimed jobs into the buffer."""
        if not jobs:
            return
        self.stats["claimed"] += len(jobs)
        with self._lock:
            self._active += len(jobs)
            for job in jobs:
                self._inflight[job.fence] = job
        for job in jobs:
            self._todo.put(job)

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
        loop: asyncio.AbstractEventLoop | None = None
        while True:
            job = self._todo.get()
            if job is None:
                break
            if self._draining.is_set() or job.lease_lost:
                self._post(job, _RELEASE)
                continue
            if time.monotonic() >= job._lease_bound:
                # It waited in the buffer past its lease (the process was paused, or starved):
                # another relay may already run it. Do not start it; hand it back (fenced: a
                # no-op if it was reaped or re-claimed meanwhile).
                log.warning("job %s (%s) fence %s not started: its lease ran out while it waited in the buffer",
                            job.id, job.consumer, job.fence)
                self._post(job, _RELEASE)
                continue
            sub = self.subscribers[job.consumer]
            if sub.is_async and loop is None:
                loop = asyncio.new_event_loop()
            outcome = self._run_transactional(job, sub) if sub.transactional else self._run_lease_mode(job, sub, loop)
            self._post(job, outcome)
        if loop is not None:
            loop.close()

    def _post(self, job: Job, outcome: Any) -> None:
        """Hand a finished handler's outcome to the dispatcher; its worker slot is free now
        (the claim stays held, and heartbeated, until the outcome is written)."""
        with self._lock:
            self._active -= 1
            self._finishing.add(job.fence)
        self._outcomes.put((job, outcome))
        self.wake.poke()

    def _run_lease_mode(self, job: Job, sub: Subscriber, loop: asyncio.AbstractEventLoop | None) -> Any:
        try:
            if sub.is_async:  # not "loop is not None": once made, the loop stays for sync handlers too
                result = loop.run_until_complete(sub.handler(job))
            else:
                result = sub.handler(job)
        except BaseException as exc:  # noqa: BLE001 - any failure of a handler is the job's
            return self._failure(job, exc)
        self._warn_return(sub, result)
        return _DONE

    def _run_transactional(self, job: Job, sub: Subscriber) -> Any:
        session = HandlerSession(self.engine)
        try:
            with session:
                session.begin()
                result = sub.handler(job, session)
                session.flush()
                with self._lock:
                    self._finishing.add(job.fence)
                if session.execute(queries.job_complete, {"id": job.id, "fence": job.fence}).rowcount != 1:
                    raise _StaleCompletion()
                session._outbox_owned = True
                session.commit()
        except _StaleCompletion:
            return _STALE
        except BaseException as exc:  # noqa: BLE001
            with self._lock:
                self._finishing.discard(job.fence)
            if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                if getattr(exc.orig, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT:
                    # The server ended the session because the handler sat idle inside its
                    # transaction for longer than the lease: the handler's doing, so the
                    # attempt counts (released, a handler that is always this slow would be
                    # retried forever). Fenced: if a pause cost this worker the job, the
                    # failure report changes nothing.
                    log.warning("job %s (%s): its transaction sat idle longer than the lease and the server ended "
                                "it; counted as a failed attempt", job.id, job.consumer)
                    return self._failure(job, exc)
                # The connection broke (server restart, terminated backend): not the
                # handler's failure, so the attempt does not count. The release is fenced:
                # if the commit did happen before the connection broke, it changes nothing.
                log.warning("job %s (%s): database connection lost during its transaction (%s); releasing it",
                            job.id, job.consumer, describe(exc))
                return _RELEASE
            return self._failure(job, exc)
        self._warn_return(sub, result)
        return _COMMITTED

    def _failure(self, job: Job, exc: BaseException) -> Any:
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
                    owned = heartbeat_jobs(conn, jobs)
                failures = self.reconnect.recovered(failures, "heartbeat")
            except DBAPIError as exc:
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
