"""The transaction a transactional handler runs in: its connection, its isolation, its
limits and its retries. The executor (:mod:`outbox.relay.executor`) drives it; this module holds
the rules (architecture notes, "The handler's transaction").

Connection first. A worker checks a connection out of the relay's pool *before* it calls
the handler (:meth:`HandlerConnections.acquire`), so "no connection" is told apart from
the handler's own failures. The server refusing one (``FATAL: too many connections``,
SQLSTATE 53300, or any other connect failure) or the pool's checkout timeout is the relay's
problem, not the job's: the job stays claimed (the relay's heartbeat renews its lease) and
the worker retries with capped, jittered backoff. When it still has none after the job's
lease, or once the claim is no longer held (lease lost, relay draining), the job is
released (fenced, attempt not counted) for any relay to take. One warning starts an
episode (the first worker that cannot connect) and one line ends it (a connection
obtained while no worker is waiting any more), however many workers wait in between;
episodes are logged at most once a minute (``EPISODE_LOG_INTERVAL``), since near a
connection limit they come and go many times a second.

Isolation: always READ COMMITTED (:data:`ISOLATION_LEVEL`), set on the transaction's
``BEGIN`` whatever the database's or role's ``default_transaction_isolation`` says. The
transaction ends with the fenced completion, an ``UPDATE`` of the job row, while the
relay's heartbeat renews that same row every lease/3 from another connection. Under
REPEATABLE READ or SERIALIZABLE a row updated by a transaction that committed after this
one's snapshot cannot be updated again: the completion fails with SQLSTATE 40001 every
time (PostgreSQL docs, "Transaction Isolation", 13.2.2), so every attempt of a handler
running longer than lease/3 after its first statement would fail. Under READ COMMITTED
the ``UPDATE`` waits for a concurrent heartbeat and applies to the row it left, and the
fence check keeps it safe. A handler that needs more than READ COMMITTED locks the rows it
reads before it writes on their basis (``SELECT ... FOR UPDATE``) or guards its writes
with :func:`outbox.fenced_write`; work that must run SERIALIZABLE belongs in a
transaction of its own (and a lease-mode handler).

Limits: the first statement is :data:`~outbox.db.queries.job_transaction_limits_set_local`,
a ``SET LOCAL idle_in_transaction_session_timeout`` of the job's lease: a worker paused or
hung inside the transaction cannot hold its row locks past the lease. Being local to the
transaction, it needs no startup option and works through PgBouncer in transaction mode.

Retries in place: a serialization failure (40001) or a deadlock (40P01) raised by the
handler's own statements says nothing about the job: PostgreSQL asks the application to
retry the transaction (PostgreSQL docs, "Serialization Failure Handling", 13.4). The
transaction is rolled back and the handler runs again in a new one, on the same claim and
the same attempt, up to :data:`IN_PLACE_RETRIES` times after a short jittered pause
(:func:`retry_pause`), and only while the lease is still held. After that the error
counts as one failed attempt like any other.

Cancel: an operator's cancel of a running job (``cancel_requested``, set by
``job_cancel_many``) is read by the completion itself, under the job's row lock. When it is
set, nothing of the handler's transaction commits: :func:`complete` returns
:attr:`Completion.CANCEL_REQUESTED`, the caller rolls the transaction back and then records
``cancelled`` in a short transaction of its own (:func:`record_cancel`, fenced). When the
completion took the row first, its commit makes the job ``done``, and the cancel, which
waits for the row, finds it no longer running. Whichever order the two come in, and whether
the handler watched ``job.cancel_requested`` or not, ``cancelled`` means the handler's
writes were not committed and ``done`` means they were. (A lease-mode handler's effects are
outside the database: its completion records ``cancelled`` after whatever it did.)

Sync and async: a plain ``def`` handler gets a :class:`~sqlalchemy.orm.Session`, an
``async def`` one an :class:`~sqlalchemy.ext.asyncio.AsyncSession` on a connection of the
worker thread's own :class:`~sqlalchemy.ext.asyncio.AsyncEngine` (one event loop per
worker thread, and an async engine's pool must stay on one loop: SQLAlchemy docs, "Using
multiple asyncio event loops"). Both run the same steps, :func:`begin` before the handler
and :func:`complete` after it (the async form through ``AsyncSession.run_sync``), so the
rules above are written once.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import backoff
from outbox.db import queries
from outbox.db.engine import describe
from outbox.db.poison import sqlstate
from outbox.errors import TransactionEndedError
from outbox.relay.counters import Counters

log = logging.getLogger(__name__)

#: Isolation level of every transactional handler's transaction.
ISOLATION_LEVEL = "READ COMMITTED"
#: SQLSTATEs retried in place: serialization_failure and deadlock_detected
#: (PostgreSQL docs, "PostgreSQL Error Codes", class 40).
RETRY_SQLSTATES = {"40001": "serialization failure", "40P01": "deadlock"}
#: Most in-place retries of one attempt's transaction after a 40001 or 40P01.
IN_PLACE_RETRIES = 3
#: First and longest pause before an in-place retry, seconds (half of each drawn at random).
RETRY_PAUSE_BASE = 0.02
RETRY_PAUSE_CAP = 0.2
#: First and longest wait between two tries to get a connection, seconds (half random).
CONNECT_RETRY_BASE = 0.05
CONNECT_RETRY_CAP = 2.0
#: Episodes of "no connection" (workers waiting for one) are logged at most once per this
#: many seconds, seconds: under a connection limit they can start and end many times a
#: second. ``HandlerConnections.stats`` counts them all.
EPISODE_LOG_INTERVAL = 60.0


def retryable_sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE (``"40001"`` or ``"40P01"``) when ``exc``, or an exception it was raised
    from or while handling (a handler that wraps the database error in its own), is a
    serialization failure or a deadlock; else None. Follows at most 16 links."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        code = sqlstate(current)
        if code in RETRY_SQLSTATES:
            return code
        current = current.__cause__ or current.__context__
    return None


def retry_pause(retry: int) -> float:
    """Seconds to wait before in-place retry number ``retry`` (1-based): 20 ms doubling up
    to 200 ms, up to half of it taken off at random, so two transactions that deadlocked
    do not collide again in step."""
    return backoff.retry_delay(retry, base=RETRY_PAUSE_BASE, cap=RETRY_PAUSE_CAP, jitter=0.5)


def set_limits(conn: Connection, lease_seconds: float, fence: int) -> None:
    """Run the transaction's first statement on ``conn``: the server ends the session if the
    transaction then sits idle for longer than ``lease_seconds`` (at least 1 ms), and the
    transaction carries ``fence`` (``outbox.handler_fence``) for :func:`complete` to check."""
    millis = max(1, int(lease_seconds * 1000))
    conn.execute(queries.job_transaction_limits_set_local, {"idle_timeout": str(millis), "fence": fence})


def begin(session: Session, lease_seconds: float, fence: int) -> None:
    """Begin the handler's transaction on ``session`` (its bind begins at
    :data:`ISOLATION_LEVEL`) and run its first statement, :func:`set_limits`."""
    session.begin()
    set_limits(session.connection(), lease_seconds, fence)


class Completion(enum.Enum):
    """How :func:`complete` ended the handler's transaction."""

    #: The fenced completion committed with the handler's writes: the job is ``done``.
    COMMITTED = "committed"
    #: The claim is no longer this worker's: nothing committed; the caller rolls back.
    STALE = "stale"
    #: An operator asked to cancel the job: nothing committed; the caller rolls back, then
    #: records ``cancelled`` in a transaction of its own (:func:`record_cancel`).
    CANCEL_REQUESTED = "cancel requested"


def complete(session: Session, job_id: int, fence: int, completing: Callable[[], None], *,
             keep_done: bool = True, schema: str | None = None) -> Completion:
    """End the handler's transaction on ``session``: flush the handler's writes, call
    ``completing()`` (the runner's mark that this claim's outcome is being written), run the
    fenced :data:`~outbox.db.queries.job_complete` and commit (:attr:`Completion.COMMITTED`).
    Without committing: :attr:`Completion.STALE` when the completion matched no row (the
    claim is no longer this worker's), :attr:`Completion.CANCEL_REQUESTED` when an operator
    asked to cancel the job; either way the caller rolls back, the handler's writes with it.
    Raises :class:`~outbox.errors.TransactionEndedError` (a permanent failure; the caller rolls back)
    when the handler ended the transaction :func:`begin` started (a raw ``COMMIT`` or
    ``ROLLBACK``, a closed session): its writes did not, or did not only, commit with the
    completion. ``keep_done`` false deletes the job's row instead of marking it done
    (``retention_done = 0``). ``schema``: the schema of outbox's tables (None: the process default).
    Database errors propagate."""
    session.flush()
    completing()
    row = session.execute(queries.in_schema(schema).job_complete,
                          {"id": job_id, "fence": fence, "keep_done": keep_done}).one()
    if not row.same_transaction:
        raise TransactionEndedError(
            f"the handler of job {job_id} ended its transaction itself (COMMIT, ROLLBACK or closing its session); "
            "a transactional handler's writes must commit with the job's completion, so outbox commits it: "
            "dead-lettered, since it would do the same on every attempt")
    if row.cancel_requested:
        return Completion.CANCEL_REQUESTED
    if row.completed != 1:
        return Completion.STALE
    Session.commit(session)  # the base class's: a handler's session refuses commit() from the handler
    return Completion.COMMITTED


def record_cancel(conn: Connection, job_id: int, fence: int, *, schema: str | None = None) -> bool:
    """Record ``cancelled`` for job ``job_id`` under claim ``fence`` in a short transaction
    of its own on ``conn`` (:data:`~outbox.db.queries.job_cancel_claimed`, fenced), after
    :func:`complete` returned :attr:`Completion.CANCEL_REQUESTED` and the handler's
    transaction was rolled back. Returns whether the row changed (False: the claim was lost
    meanwhile). Database errors propagate."""
    with conn.begin():
        rows = conn.execute(queries.in_schema(schema).job_cancel_claimed, {"id": job_id, "fence": fence}).all()
    return len(rows) == 1


class HandlerConnections:
    """Connections for transactional handlers, checked out of ``engine``'s pool before the
    handler runs, each beginning its transactions at :data:`ISOLATION_LEVEL` (the driver's
    ``BEGIN ISOLATION LEVEL``, no extra round trip; SQLAlchemy docs, "Setting Transaction
    Isolation Levels"). Shared by all the worker threads of one runner.

    ``reconnect_max`` (seconds) caps the wait between two tries to get a connection."""

    def __init__(self, engine: Engine, reconnect_max: float) -> None:
        self.engine = engine.execution_options(isolation_level=ISOLATION_LEVEL)
        self.cap = max(CONNECT_RETRY_BASE, min(CONNECT_RETRY_CAP, reconnect_max))
        self.stats = Counters(("connect_failures", "connect_episodes", "released_no_connection"))
        self._lock = threading.Lock()
        self._waiting = 0  # workers between their first failed try and a connection (or giving up)
        self._episode = False
        self._warned_at = -EPISODE_LOG_INTERVAL  # time.monotonic() of the last episode logged
        self._logged = False  # the current episode was logged (so its end is too)

    def acquire(self, held: Callable[[], bool], wait_limit: float, wake: threading.Event,
                connect: Callable[[], Any] | None = None) -> Any:
        """A connection for one job's transaction, or None when none could be had while
        ``held()`` stayed true, within ``wait_limit`` seconds of waiting: the caller then
        releases the job (attempt not counted). Connect failures (a ``DBAPIError`` such as
        the server's ``too many connections``, SQLSTATE 53300) and the pool's
        ``TimeoutError`` are retried with capped jittered backoff; ``wake`` (the relay
        draining) cuts a wait short. Never raises for a connection problem.

        ``connect`` makes the connection (default: a ``Connection`` of this object's
        engine); an async transactional handler's worker passes one that opens an
        ``AsyncConnection`` of its own async engine, so both kinds share the waiting, the
        episode logging and :attr:`stats`."""
        failures = 0
        deadline = time.monotonic() + wait_limit
        connect = connect or self.engine.connect
        while True:
            try:
                conn = connect()
            except (DBAPIError, sa.exc.TimeoutError) as exc:
                failures += 1
                self._failed(exc, first=failures == 1)
                pause = backoff.retry_delay(failures, base=CONNECT_RETRY_BASE, cap=self.cap, jitter=0.5)
                if held() and time.monotonic() + pause < deadline:
                    wake.wait(pause)
                    if held():
                        continue
                self._done(recovered=False)
                return None
            if failures or self._episode:
                self._done(recovered=True, waited=failures > 0)
            return conn

    def _failed(self, exc: BaseException, first: bool) -> None:
        with self._lock:
            self.stats.add("connect_failures")
            if first:
                self._waiting += 1
            if self._episode:
                return
            self._episode = True
            self.stats.add("connect_episodes")
            now = time.monotonic()
            self._logged = now - self._warned_at >= EPISODE_LOG_INTERVAL
            if not self._logged:
                return
            self._warned_at = now
        log.warning("transactional handlers cannot get a database connection (%s); their jobs wait for one, "
                    "attempt not counted, and are released if none comes within their lease", describe(exc))

    def _done(self, recovered: bool, waited: bool = True) -> None:
        with self._lock:
            if waited:
                self._waiting -= 1
            if not recovered:
                self.stats.add("released_no_connection")
            end = recovered and self._episode and self._waiting == 0
            if end:
                self._episode = False
            end = end and self._logged
        if end:
            log.info("transactional handlers get database connections again (%d failed tries so far)",
                     self.stats["connect_failures"])
