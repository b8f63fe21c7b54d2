"""Maintenance: the reaper and the pruner (dead letters and redrive are the operator's:
:mod:`outbox.admin`).

Reaper: a job whose lease expired (its worker crashed, hung or was paused longer than the
lease) goes back to ``ready``, or to ``dead`` when that was its last attempt, with
``last_error`` saying the lease expired. It locks with ``SKIP LOCKED``, so any number of
relays may reap at once, and a job being completed at that very moment (its row locked)
is skipped rather than overwritten; the completion's own fence check then decides.

Pruner: what it deletes, and how a row that cannot be deleted is kept, are the rules of
:mod:`outbox.db.retention` (``outbox-relay prune`` applies them too). When the server's
autovacuum is off (for the server or for ``outbox_jobs``), the relay vacuums both tables
itself after each pruning round, and says so once at start.

Upkeep that needs ownership: ``ANALYZE`` (:class:`outbox.relay.statistics.StatisticsKeeper`)
and ``VACUUM`` (above) of the queue's tables are allowed only to their owner (the role that
ran ``outbox-relay migrate``), the database's owner, a superuser or, on PostgreSQL 17 and
later, a role granted ``MAINTAIN`` on them. A relay running as a role of its own without it
skips both, saying so in one WARNING (:class:`TableUpkeep`), and leaves them to autovacuum
(operations notes, "Roles").

The loop (:class:`Maintenance`, thread ``outbox-maintenance``): every ``reap_interval``
seconds a reaper round, then the ordered keys' sweep (heads left pending, promoted:
:class:`outbox.relay.ordering.HeadSweeper`), in a transaction after the reaping's; every
``prune_interval`` seconds (the first 5 s after start at most) a pruning round, the gone
relays' rows, and the vacuum when autovacuum is off. A pruning round deletes in batches for
up to ``reap_interval`` seconds; one that had more to delete is followed by another after
the next reaper round, until the pruner has caught up. Jobs handed back wake this relay's
workers and, through ``NOTIFY``, every relay. A database error never ends the loop: it
retries at once, then through the relay's :class:`~outbox.relay.reconnect.Reconnector`.

Every function works on the tables of its ``schema`` argument (None: the process default,
:func:`outbox.settings.default_schema`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox.db import queries
from outbox.db.jobs import notify_head
from outbox.db.poison import (
    Quarantine,
    SystemicError,
    describe_error,
    try_record,
    whole_or_halves,
)
from outbox.db.retention import PRUNE_BATCH, prune, prune_intake, prune_relays
from outbox.relay.counters import Counters
from outbox.relay.notify import Wakeup
from outbox.relay.ordering import HeadSweeper
from outbox.relay.reconnect import Reconnector
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

REAP_BATCH = 1000


@dataclass(frozen=True, slots=True)
class ReapResult:
    """Jobs taken back by one reaper round: ``retried`` (back to ready, attempt counted),
    ``dead`` (that was the last attempt), ``unstarted`` (back to ready with the attempt
    given back: the claim sat in a relay's prefetch buffer and its handler never ran),
    ``superseded`` (a coalescing consumer's job a newer event of its key replaced while it
    ran: it ends ``superseded`` rather than run again; architecture notes, "Coalescing")."""

    retried: int
    dead: int
    unstarted: int = 0
    superseded: int = 0


def reap_expired(conn: Connection, limit: int = REAP_BATCH, quarantine: Quarantine | None = None, *,
                 schema: str | None = None) -> ReapResult:
    """Take back up to ``limit`` jobs whose lease expired (database clock), in ``conn``'s
    transaction; logs one line per job dead-lettered.

    A data error is confined to the jobs that cause it (:mod:`outbox.db.poison`): the expired
    jobs are reaped by halves, each try in a SAVEPOINT, and a job whose reaping fails alone
    is dead-lettered with a ``last_error`` naming the error, or, where even that fails,
    kept in ``quarantine`` (skipped by later rounds for a while)."""
    quarantine = quarantine if quarantine is not None else Quarantine("job")
    skip = quarantine.ids()
    statements = queries.in_schema(schema)

    def reap(only: Sequence[int] | None) -> Sequence[Any]:
        with conn.begin_nested():
            return conn.execute(statements.job_reap_many, {
                "limit": limit, "skip": skip, "only": None if only is None else list(only)}).all()

    parts, poisoned = whole_or_halves(
        "reaping", lambda: reap(None),
        lambda: list(conn.execute(statements.job_reap_candidates, {"limit": limit, "skip": skip}).scalars()), reap)
    rows = [row for part in parts for row in part]
    if poisoned:
        buried = _bury_many(conn, poisoned, statements.job_bury_expired, "reaping", quarantine)
        log.error("reaper: dead-lettered %d jobs whose reaping fails (%s)", len(buried),
                  describe_error(poisoned[0][1]))
    dead = [r for r in rows if r.status == "dead"]
    superseded = sum(1 for r in rows if r.status == "superseded")
    unstarted = sum(1 for r in rows if r.unstarted and r.status != "superseded")
    for r in dead:
        log.error("dead-lettered job %s (%s): lease expired on its last attempt (%s)", r.id, r.consumer, r.attempts,
                  extra={"job_id": r.id, "consumer": r.consumer, "attempt": r.attempts, "outcome": "dead"})
    retried = len(rows) - len(dead) - unstarted - superseded
    if retried:
        log.info("reaper: %d jobs with expired leases back to ready", retried)
    if unstarted:
        log.info("reaper: %d jobs whose relay stopped before starting them back to ready, attempt not counted",
                 unstarted)
    if superseded:
        log.info("reaper: %d jobs with expired leases superseded (a newer event of their key waits to run)",
                 superseded)
    return ReapResult(retried=retried, dead=len(dead), unstarted=unstarted, superseded=superseded)


def _bury_many(conn: Connection, poisoned: list[tuple[int, BaseException]], statement: Any, doing: str,
               quarantine: Quarantine) -> list[int]:
    """Dead-letter each job of ``poisoned`` (id, error) with ``statement`` (``:id``,
    ``:error``), each in a SAVEPOINT; a job even that fails for goes to ``quarantine``.
    Returns the ids dead-lettered."""
    buried = []
    for job_id, exc in poisoned:
        error = f"{doing.capitalize()} failed for this job: {describe_error(exc)}"

        def write() -> bool:
            with conn.begin_nested():
                return conn.execute(statement, {"id": job_id, "error": error}).rowcount == 1

        dead = try_record(write)
        if dead is None:
            quarantine.add(job_id, exc, doing)
        elif dead:
            buried.append(job_id)
    return buried


def autovacuum_enabled(conn: Connection, *, schema: str | None = None) -> bool:
    """True when the server's autovacuum will visit ``outbox_jobs`` (on globally, not off
    for the table)."""
    return bool(conn.execute(queries.in_schema(schema).autovacuum_enabled).scalar_one())


class TableUpkeep:
    """Whether this relay's role may ``ANALYZE`` and ``VACUUM`` outbox's queue tables
    (``outbox_jobs``, ``outbox_events``; see the module notes), asked of the database each
    time one of them is due, so a privilege granted later is used from then on. The first
    time the answer is no, one WARNING says what is skipped and what it costs; never again
    for this object (one per relay, shared by its router and maintenance loops:
    thread-safe)."""

    def __init__(self, schema: str | None = None) -> None:
        self.statements = queries.in_schema(schema)
        self.denied = 0  #: times the answer was no
        self._warned = False
        self._lock = threading.Lock()

    def permitted(self, conn: Connection) -> bool:
        """Ask on ``conn`` (any transaction state); warn once when the answer is no."""
        if conn.execute(self.statements.job_tables_maintainable).scalar_one():
            return True
        with self._lock:
            self.denied += 1
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("role %s may not ANALYZE or VACUUM %s.outbox_jobs and %s.outbox_events (only their owner "
                        "may, or on PostgreSQL 17+ a role granted MAINTAIN): this relay skips both and leaves them "
                        "to autovacuum; if autovacuum is off, the owner must run them (see the Roles section of "
                        "the operations notes)", conn.execute(self.statements.current_role_name).scalar_one(),
                        self.statements.schema, self.statements.schema)
        return False


def vacuum_tables(conn: Connection, *, schema: str | None = None) -> None:
    """``VACUUM`` ``outbox_jobs`` and ``outbox_events`` (``conn`` must be in autocommit).
    The relay does this after pruning only when autovacuum is off: a queue's table turns
    over every row it holds many times a minute, and without vacuum its dead rows, and
    with them every index and every claim's scan, grow without bound."""
    conn.execute(queries.in_schema(schema).job_tables_vacuum)


class Maintenance:
    """The maintenance loop (see the module notes): reaper, ordered keys' sweep, pruner and,
    when autovacuum is off, vacuum, for the tables of ``settings.schema_name``, until
    ``stop`` is set (the relay's stop event, shared by its parts: :meth:`stop` sets it).

    ``wake_workers`` is set after a round that handed jobs back or promoted heads;
    ``reconnect`` paces the retries after a database error; ``upkeep`` (default: one of
    its own) says whether this role may VACUUM, shared with the statistics keeper so the
    warning comes once. Settings read: ``reap_interval``, ``prune_interval``,
    ``retention_done``, ``retention_events`` (seconds).

    ``stats`` counts ``reaped`` (every job taken back), ``reaped_dead``,
    ``reaped_unstarted``, ``promoted``, ``pruned_jobs``, ``pruned_events``, ``vacuums`` and
    ``vacuums_skipped`` (not permitted). :meth:`reap` and :meth:`prune` are one round of
    each, for tests and callers without a thread; they raise the database's errors.
    """

    #: The names ``stats`` counts, from 0.
    COUNTS = ("reaped", "reaped_dead", "reaped_unstarted", "pruned_jobs", "pruned_events", "pruned_intake", "vacuums",
              "vacuums_skipped", "promoted")

    def __init__(self, engine: Engine, settings: OutboxSettings, *, stop: threading.Event, wake_workers: Wakeup,
                 reconnect: Reconnector, upkeep: TableUpkeep | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.schema = settings.schema_name
        self.stop_event = stop
        self.wake_workers = wake_workers
        self.reconnect = reconnect
        self.upkeep = upkeep if upkeep is not None else TableUpkeep(self.schema)
        # Rows each round skips for a while: their statement fails alone and recording it did too (poison.py).
        self.reap_quarantine = Quarantine("job")
        self.prune_quarantine = Quarantine("row")
        self.head_sweeper = HeadSweeper()  # ordered keys' heads left pending (outbox.relay.ordering, "Sweep")
        self.stats = Counters(self.COUNTS)
        self._warned_autovacuum = False
        #: Whether the last pruning round stopped with rows left to delete (its time was up).
        self.prune_behind = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the loop's thread (``outbox-maintenance``)."""
        self._thread = threading.Thread(target=self.run, name="outbox-maintenance", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Set the stop event; returns at once (:meth:`join` waits). A round under way finishes."""
        self.stop_event.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end, up to ``timeout`` seconds; True when it has (or never started)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        return self._thread is None or not self._thread.is_alive()

    def run(self) -> None:
        """The loop: rounds until the stop event is set; never raises for database errors.
        A pruning round that stopped with rows left to delete (its time was up: see
        :meth:`prune`) is followed by another after the next reaper round, not after
        ``prune_interval``, so the pruner keeps up with any rate the database can delete at."""
        failures = 0
        next_prune = time.monotonic() + min(5.0, self.settings.prune_interval)
        while not self.stop_event.wait(self.settings.reap_interval if not failures else 0):
            try:
                self.reap()
                if time.monotonic() >= next_prune:
                    self.prune()
                    next_prune = time.monotonic() + (0.0 if self.prune_behind else self.settings.prune_interval)
                failures = self.reconnect.recovered(failures, "maintenance")
            except (DBAPIError, SystemicError) as exc:  # SystemicError: a statement that fails for every row
                failures = self.reconnect.backoff(failures, "maintenance", exc, self.stop_event)

    def reap(self) -> ReapResult:
        """One reaper round (:func:`reap_expired`, then ``NOTIFY`` every relay when jobs went
        back to ready), then, once that committed, one pass of the ordered keys' sweep; wakes
        this relay's workers when either handed jobs back, and counts both in ``stats``."""
        with self.engine.begin() as conn:
            reaped = reap_expired(conn, quarantine=self.reap_quarantine, schema=self.schema)
            if reaped.retried or reaped.unstarted:  # back with their early place: every relay claims from the head
                notify_head(conn, schema=self.schema)
        with self.engine.begin() as conn:  # after the reaping committed (outbox.relay.ordering, "Sweep")
            promoted = self.head_sweeper.sweep(conn, schema=self.schema)
        if promoted:
            self.stats.add("promoted", len(promoted))
            self.wake_workers.set()
        self.stats.add("reaped", reaped.retried + reaped.dead + reaped.unstarted + reaped.superseded)
        self.stats.add("reaped_dead", reaped.dead)
        self.stats.add("reaped_unstarted", reaped.unstarted)
        if reaped.retried or reaped.unstarted:
            self.wake_workers.rewind()
        return reaped

    def prune(self) -> tuple[int, int]:
        """One pruning round: batches of :func:`prune` with ``retention_done`` and
        ``retention_events`` (``PRUNE_BATCH`` rows of each kind, a transaction each, the
        first with :func:`prune_relays`) until one is not full, or for at most
        ``reap_interval`` seconds (the reaper's round comes next; :attr:`prune_behind` then
        says rows are left); then the vacuum when autovacuum is off. Returns (jobs, events)
        deleted and counts them in ``stats``.

        Before issue 28 a round was one batch a minute: 5,000 done jobs a minute at most,
        while a relay at half its default capacity finishes 54,000 (900 jobs/s), so at that
        rate the done jobs of a day's retention were never all pruned and the table grew for
        as long as the rate lasted (performance notes, "Retention")."""
        jobs = events = 0
        deadline = time.monotonic() + self.settings.reap_interval
        first = True
        while True:
            with self.engine.begin() as conn:
                batch_jobs, batch_events = prune(conn, self.settings.retention_done, self.settings.retention_events,
                                                 PRUNE_BATCH, self.prune_quarantine, schema=self.schema)
                if first:
                    prune_relays(conn, schema=self.schema)
                remembered = prune_intake(conn, self.settings.intake_retention, PRUNE_BATCH, schema=self.schema)
            first = False
            jobs, events = jobs + batch_jobs, events + batch_events
            self.stats.add("pruned_intake", remembered)
            full = batch_jobs >= PRUNE_BATCH or batch_events >= PRUNE_BATCH or remembered >= PRUNE_BATCH
            self.prune_behind = full
            if not full or time.monotonic() >= deadline or self.stop_event.is_set():
                break
        self.stats.add("pruned_jobs", jobs)
        self.stats.add("pruned_events", events)
        if jobs or events:
            log.info("pruned %d done, cancelled or superseded jobs and %d finished events", jobs, events)
        self._vacuum_if_autovacuum_is_off()
        return jobs, events

    def _vacuum_if_autovacuum_is_off(self) -> None:
        """Vacuum the queue's tables when autovacuum will not (see the module notes)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if autovacuum_enabled(conn, schema=self.schema):
                return
            if not self._warned_autovacuum:
                self._warned_autovacuum = True
                log.warning("autovacuum is off for outbox_jobs; this relay vacuums outbox_jobs and outbox_events "
                            "itself after each pruning round (every %.0fs)", self.settings.prune_interval)
            if not self.upkeep.permitted(conn):
                self.stats.add("vacuums_skipped")
                return
            vacuum_tables(conn, schema=self.schema)
        self.stats.add("vacuums")

