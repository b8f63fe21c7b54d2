"""The statistics keeper: keeps the planner's statistics of ``outbox_jobs`` current
while the router fills it.

What and why: the claim reads ``ix_outbox_jobs_ready`` in claim order only while the
planner's statistics say the table holds many ready jobs. After a burst into a table that
was never analysed, or was analysed while quiet, every claim would sort the whole ready
backlog instead, and autovacuum's own ANALYZE comes a minute or more later. The router is
the one part that knows when many ready jobs have just arrived, so it counts them and this
keeper runs ``ANALYZE outbox_jobs`` once they are many relative to what the table held at
its last analyze (the rule is in :class:`StatisticsKeeper`).

When: in a relay the keeper has a thread of its own (``outbox-statistics``). The router's
loop only counts (:meth:`StatisticsKeeper.count`, no query) and the ANALYZE runs beside it,
so routing never waits for one. Each ANALYZE runs in a short transaction with a
transaction-local ``lock_timeout``; an ANALYZE that cannot get its lock at once, or fails,
is skipped and tried again later after a capped backoff; nothing is raised.

Ownership: only the table's owner (or, on PostgreSQL 17 and later, a role granted
``MAINTAIN``) may ANALYZE it; a relay whose role may not skips it, warned once by
:class:`outbox.relay.maintenance.TableUpkeep`, and leaves the statistics to autovacuum.

The measurements behind the rule's defaults are in the performance notes, "Measurements
behind the defaults".
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox import backoff
from outbox.db import queries
from outbox.db.engine import describe
from outbox.relay.maintenance import TableUpkeep

log = logging.getLogger(__name__)


class AnalyzeOutcome(enum.Enum):
    """What one call of :meth:`StatisticsKeeper.routed` did."""

    #: Nothing: too few jobs routed since the last ANALYZE, or waiting to retry.
    NOT_DUE = "not due"
    #: ``ANALYZE outbox_jobs`` ran and committed.
    ANALYZED = "analyzed"
    #: Another session held a conflicting lock for longer than ``lock_timeout``
    #: (autovacuum, another relay's ANALYZE, a schema change): tried again later.
    SKIPPED = "skipped"
    #: Any other database error (logged at INFO): tried again later.
    FAILED = "failed"
    #: This role may not ANALYZE the table (not its owner: :class:`outbox.relay.maintenance.TableUpkeep`
    #: warned once); asked again after ``retry_cap`` seconds.
    NOT_PERMITTED = "not permitted"


class StatisticsKeeper:
    """Runs ``ANALYZE outbox_jobs`` after the router has created many jobs relative to
    what the table held at its last analyze, so the claim's plan follows bursts.

    Rule: ANALYZE once the jobs routed since this keeper's last ANALYZE exceed
    ``max(floor, min(fraction * reltuples, at_most))``, where ``reltuples`` is
    ``pg_class.reltuples`` of ``outbox_jobs`` (its row count at the last ANALYZE or VACUUM
    by anyone; a table never analysed counts as 0). ``floor`` (jobs, default 1,000) spares a
    nearly empty table an ANALYZE every round; ``fraction`` (default 1.0: once the table
    may have doubled) scales the trigger with the table; ``at_most`` (jobs, default
    100,000) caps it, so a table holding a day of done jobs still gets an ANALYZE after
    every 100,000 new jobs. The claim's plan needs only statistics that do not say "almost
    no ready jobs" after a burst: a count off by half picks the same plan, so an ANALYZE
    per doubling is enough, and each one costs in proportion to the table (PostgreSQL reads
    every page of a small table, a sample of a large one). ``reltuples`` is read only when
    the count passes the trigger computed from the previous read, so a call that is not due
    sends no query. With several relays each keeper counts the jobs its own router created;
    an ANALYZE by any of them, or by autovacuum, raises ``reltuples`` and so the others'
    triggers.

    The first of these ANALYZEs also analyses ``outbox_events`` if it never was
    (``reltuples`` -1: a new database, autovacuum off or not yet awake); later ones leave it
    to autovacuum. Without any statistics the planner guesses that few events are unrouted
    and the route's pick reads and sorts every unrouted event; with statistics from any
    moment it walks ``ix_outbox_events_unrouted`` in id order and stops at the batch.
    ``events_analyzed`` counts those.

    Threads: :meth:`count` (the router's thread: counts, no query) wakes :meth:`run` (the
    keeper's own thread) when an ANALYZE is due. :meth:`routed` counts and analyses in the
    caller's thread, for tests and a caller without a thread; it is not to be called while
    :meth:`run` runs.

    Locks and errors: each ANALYZE runs in a short transaction of its own on a pooled
    connection with a transaction-local ``lock_timeout`` (seconds, default 0.1). ANALYZE
    takes a SHARE UPDATE EXCLUSIVE lock, which conflicts with autovacuum and with another
    relay's ANALYZE but with no job statement. A lock timeout means someone else is
    vacuuming or analysing the table: the keeper skips quietly (DEBUG) and tries again after
    a capped, jittered backoff (``retry_base`` seconds, default 1, doubling up to
    ``retry_cap``, default 60) on a later call. Keeping the timeout below the server's
    ``deadlock_timeout`` (1 s by default) also means the keeper never waits long enough to
    make PostgreSQL cancel an autovacuum that holds the lock. Any other database error is
    logged at INFO and retried the same way; nothing is raised.

    Ownership: when this relay's role may not ANALYZE the table (``upkeep``,
    :class:`outbox.relay.maintenance.TableUpkeep`, warns once) the ANALYZE is not sent, and
    asked again after ``retry_cap`` seconds. ``schema``: the schema whose ``outbox_jobs`` is
    kept (None: the process default).

    Counts: ``analyzed``, ``skipped``, ``failed`` and ``denied`` (not permitted) count the
    outcomes; ``pending`` is the jobs routed since the last ANALYZE.
    """

    def __init__(self, engine: Engine, *, floor: int = 1000, fraction: float = 1.0, at_most: int = 100_000,
                 lock_timeout: float = 0.1, retry_base: float = 1.0, retry_cap: float = 60.0, schema: str | None = None,
                 upkeep: TableUpkeep | None = None) -> None:
        self.engine = engine
        self.statements = queries.in_schema(schema)  # outbox_jobs of this schema
        self.upkeep = upkeep if upkeep is not None else TableUpkeep(schema)
        self.floor = floor
        self.fraction = fraction
        self.at_most = at_most
        self.lock_timeout = lock_timeout
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.pending = 0
        self.analyzed = self.skipped = self.failed = self.denied = self.events_analyzed = 0
        self._trigger = float(floor)  # from the last reltuples read
        self._misses = 0  # skips and failures in a row
        self._events_have_statistics = False  # outbox_events analysed, by anyone, seen once
        self._retry_at = 0.0  # time.monotonic() before which no ANALYZE is tried
        self._lock = threading.Lock()  # pending: added to by the router's thread, taken by the keeper's
        self._due = threading.Event()  # count() saw pending pass the trigger, or wake() was called

    def count(self, jobs: int) -> None:
        """Count ``jobs`` just created by the router; no query. When they take ``pending`` past
        the trigger, :meth:`run` (in its own thread) wakes and runs the ANALYZE."""
        with self._lock:
            self.pending += jobs
            due = self.pending > self._trigger
        if due:
            self._due.set()

    def wake(self) -> None:
        """Wake :meth:`run` now (the relay stopping: it then sees its ``stop`` event set)."""
        self._due.set()

    def run(self, stop: threading.Event, poll: float = 1.0) -> None:
        """The keeper's thread: wait until :meth:`count` finds an ANALYZE due, or ``poll``
        seconds (a skipped one is retried after its backoff even with no more jobs routed),
        then ANALYZE if the rule says so; until ``stop`` is set (and :meth:`wake` called, or
        ``poll`` passed). Never raises for database errors (see :meth:`routed`)."""
        while not stop.is_set():
            self._due.wait(poll)
            self._due.clear()
            if stop.is_set():
                return
            self.routed(0)

    def routed(self, jobs: int) -> AnalyzeOutcome:
        """Count ``jobs`` just created by the router and ANALYZE ``outbox_jobs`` if the rule
        says so. Call it after every routing round, also with 0: a skipped ANALYZE is
        retried on a later call even when no more jobs arrive. Never raises for database
        errors; returns what it did."""
        with self._lock:
            self.pending += jobs
            taken = self.pending  # jobs counted while the ANALYZE runs count towards the next one
        if taken <= self._trigger or time.monotonic() < self._retry_at:
            return AnalyzeOutcome.NOT_DUE
        started = time.perf_counter()
        try:
            with self.engine.begin() as conn:
                before = conn.execute(self.statements.job_table_reltuples).scalar_one()
                self._trigger = self._trigger_for(before)
                if taken <= self._trigger:  # analysed or vacuumed by someone else meanwhile
                    return AnalyzeOutcome.NOT_DUE
                if not self.upkeep.permitted(conn):  # PostgreSQL would skip it with a warning of its own
                    self.denied += 1
                    self._retry_at = time.monotonic() + self.retry_cap
                    return AnalyzeOutcome.NOT_PERMITTED
                timeout = f"{max(1, round(self.lock_timeout * 1000))}ms"
                conn.execute(self.statements.lock_timeout_set_local, {"timeout": timeout})
                conn.execute(self.statements.job_table_analyze)
                after = conn.execute(self.statements.job_table_reltuples).scalar_one()
                events_analyzed = not self._events_have_statistics and not conn.execute(
                    self.statements.event_table_analysed).scalar_one()
                if events_analyzed:
                    conn.execute(self.statements.event_table_analyze)
        except SQLAlchemyError as exc:
            return self._missed(exc)
        self._events_have_statistics = True  # analysed by someone, or just now: they keep them
        self.events_analyzed += events_analyzed
        log.debug("analysed outbox_jobs after %d routed jobs (%.0f rows before, %.0f now) in %.1f ms",
                  taken, before, after, (time.perf_counter() - started) * 1000)
        self.analyzed += 1
        with self._lock:
            self.pending -= taken
        self._trigger = self._trigger_for(after)
        self._misses = 0
        self._retry_at = 0.0
        return AnalyzeOutcome.ANALYZED

    def _trigger_for(self, reltuples: float) -> float:
        """Jobs routed after which the next ANALYZE is due, for a table of ``reltuples`` rows."""
        return max(float(self.floor), min(self.fraction * reltuples, float(self.at_most)))

    def _missed(self, exc: SQLAlchemyError) -> AnalyzeOutcome:
        self._misses += 1
        delay = backoff.retry_delay(self._misses, base=self.retry_base, cap=self.retry_cap, jitter=0.5)
        self._retry_at = time.monotonic() + delay
        if isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available
            self.skipped += 1
            log.debug("ANALYZE outbox_jobs skipped: another session holds a conflicting lock (autovacuum or "
                      "another relay's ANALYZE); next try in %.1fs", delay)
            return AnalyzeOutcome.SKIPPED
        self.failed += 1
        log.info("ANALYZE outbox_jobs failed (%s); routing goes on, next try in %.1fs", describe(exc), delay)
        return AnalyzeOutcome.FAILED
