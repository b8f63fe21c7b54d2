"""The router: turns events into jobs, one per subscribed consumer.

Each round runs :data:`~outbox.db.queries.event_route_many` in its own transaction: lock a
batch of unrouted events with ``FOR UPDATE SKIP LOCKED``, insert one job per matching row
of ``outbox_subscriptions``, mark the events routed. Because the lock, the inserts and
the mark commit together, every (event, consumer) job is created exactly once, however
many relays route at the same time; ``UNIQUE (event_id, consumer)`` backs this up.
Events are found by ``routed_at IS NULL``, never by "id above the last one seen": identity
values are taken at insert time but become visible at commit, out of order.

Ordered consumers (architecture notes, "Ordering"): a keyed event waits, unrouted, while an
earlier event of its key is unrouted outside the batch, and an ordered consumer's job is
created ``pending`` behind the unfinished jobs of its key (:mod:`outbox.relay.ordering`).

An event whose topic has no subscription is marked routed with no jobs and counted
(``unsubscribed``); subscribing later does not deliver it.

Statistics (:class:`StatisticsKeeper`): the router is the one part that knows when
``outbox_jobs`` has just received many ready jobs, so it keeps the planner's statistics
of that table current. Without them a burst into a table that was never analysed (or
analysed while quiet) makes every claim sort the whole ready backlog instead of reading
``ix_outbox_jobs_ready`` in claim order, and autovacuum's analyze comes a minute or more
later (performance notes, finding 1). An ANALYZE that cannot get its lock at once, or
fails, is skipped and tried again later; it never stops routing.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox import backoff
from outbox.db import queries
from outbox.db.engine import describe
from outbox.registry import Outbox
from outbox.relay.maintenance import TableUpkeep
from outbox.relay.poison import Quarantine, whole_or_halves
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouteResult:
    """What one routing round did: events routed, jobs created, events with no subscriber,
    keyed events held back because an earlier event of their key was still unrouted
    outside the batch (another router held it; architecture notes, "Ordering"), and the
    topics of the events with no subscriber, with how many of each."""

    events: int
    jobs: int
    unsubscribed: int
    held_back: int = 0
    #: topic -> events of it that matched no subscription
    unsubscribed_topics: Mapping[str, int] = field(default_factory=dict)


def register_subscriptions(engine: Engine, registry: Outbox, settings: OutboxSettings) -> None:
    """Write ``registry``'s (topic, consumer) pairs and options to ``outbox_subscriptions``
    and its flow-control options to ``outbox_consumers``, of schema ``settings.schema_name``
    (the relay does at start, :func:`outbox.testing.drain` before routing): routing creates
    jobs for the pairs found there. Jobs of a consumer declared unordered that still hold an
    ordering key (it was ordered before) leave it: waiting ones become ready, a dead one no
    longer blocks (``job_ordering_release_many``)."""
    subs = list(registry)
    if not subs:
        return
    pairs = [(topic, s) for s in subs for topic in s.topics]
    with engine.begin() as conn:
        changed = conn.execute(queries.in_schema(settings.schema_name).subscription_upsert_many, {
            "topics": [topic for topic, _ in pairs],
            "consumers": [s.consumer for _, s in pairs],
            "max_attempts": [s.max_attempts for _, s in pairs],
            "leases": [s.lease or settings.default_lease for _, s in pairs],
            "priorities": [s.priority for _, s in pairs],
            "transactional": [s.transactional for _, s in pairs],
            "ordered": [s.ordered for _, s in pairs],
            "on_dead": [s.on_dead for _, s in pairs],
        }).all()
        flow = conn.execute(queries.in_schema(settings.schema_name).consumer_upsert_many, {
            "consumers": [s.consumer for s in subs],
            "concurrency": [s.concurrency for s in subs],
            "rate_limits": [s.rate_limit for s in subs],
        }).all()
        unordered = [s.consumer for s in subs if not s.ordered]
        released = conn.execute(queries.in_schema(settings.schema_name).job_ordering_release_many,
                                {"consumers": unordered}).all() if unordered else []
    if released:
        log.warning("%d jobs of consumers now declared unordered left their ordering keys (%d were waiting, now "
                    "ready)", len(released), sum(1 for r in released if r.status == "ready"))
    for row in changed:
        if row.updated:
            log.warning("subscription %s on %s now has this registry's options (max_attempts=%s, lease=%gs, "
                        "priority=%s, transactional=%s, ordered=%s, on_dead=%s); another registry declaring it "
                        "differently would be overwritten the same way", row.consumer, row.topic, row.max_attempts,
                        row.lease_seconds, row.priority, row.transactional, row.ordered, row.on_dead)
    for row in flow:
        if row.updated:
            log.warning("consumer %s now has this registry's flow control (concurrency=%s, rate_limit=%s/s)",
                        row.consumer, row.concurrency, row.rate_limit)


def route_batch(conn: Connection, limit: int, skip: Sequence[int] = (),
                only: Sequence[int] | None = None, *, schema: str | None = None) -> RouteResult:
    """Route up to ``limit`` unrouted events of ``schema`` (None: the process default,
    :func:`outbox.settings.default_schema`) in ``conn``'s transaction; the caller commits.
    Events whose id is in ``skip`` are left out; ``only``, when given, limits the batch to
    those ids."""
    row = conn.execute(queries.in_schema(schema).event_route_many, {
        "limit": limit, "skip": list(skip), "only": None if only is None else list(only)}).one()
    topics = dict(zip(row.unsubscribed_topics, row.unsubscribed_counts)) if row.unsubscribed_topics else {}
    return RouteResult(events=row.events, jobs=row.jobs, unsubscribed=row.unsubscribed, held_back=row.held_back,
                       unsubscribed_topics=topics)


def route_round(conn: Connection, limit: int, quarantine: Quarantine, *, schema: str | None = None) -> RouteResult:
    """One routing round on an autocommit connection: :func:`route_batch` of up to
    ``limit`` events, leaving out the events in ``quarantine``. A data error (a trigger or
    constraint of the application's on the jobs or events table failing for one event) is
    confined to the events that cause it (:mod:`outbox.relay.poison`): the batch is routed by
    halves, and an event that fails alone is quarantined, logged with the database error:
    it stays unrouted (nothing is lost; ``status`` counts it), is tried again after
    ``QUARANTINE_SECONDS``, and every other event is routed. Returns the totals. ``schema``
    as for :func:`route_batch`."""
    skip = quarantine.ids()
    candidates = queries.in_schema(schema).event_route_candidates
    parts, poisoned = whole_or_halves(
        "routing", lambda: route_batch(conn, limit, skip, schema=schema),
        lambda: list(conn.execute(candidates, {"limit": limit, "skip": skip}).scalars()),
        lambda part: route_batch(conn, len(part), skip, part, schema=schema))
    for event_id, exc in poisoned:
        quarantine.add(event_id, exc, "routing")
    topics: collections.Counter[str] = collections.Counter()
    for p in parts:
        topics.update(p.unsubscribed_topics)
    return RouteResult(events=sum(p.events for p in parts) + len(poisoned), jobs=sum(p.jobs for p in parts),
                       unsubscribed=sum(p.unsubscribed for p in parts), held_back=sum(p.held_back for p in parts),
                       unsubscribed_topics=dict(topics))


#: Shortest time between two warnings about one topic with no subscriber, seconds.
UNSUBSCRIBED_WARN_INTERVAL = 60.0


class UnsubscribedTopics:
    """Warns about events on topics with no subscriber, naming the topic, at most once per
    ``interval`` seconds per topic (``clock``: monotonic seconds): the first round that
    meets a topic warns at once; the events of it met until the next warning are counted
    and that warning reports them. Such an event is marked routed with no jobs, so a
    misspelled topic loses every event published on it: the warning is the one trace. At
    most ``max_topics`` topics are remembered (past that, the ones warned about longest ago
    are forgotten, and may be warned about again early). Not thread-safe: one per router loop."""

    def __init__(self, interval: float = UNSUBSCRIBED_WARN_INTERVAL, *, clock: Callable[[], float] = time.monotonic,
                 max_topics: int = 10_000) -> None:
        self.interval = interval
        self.clock = clock
        self.max_topics = max_topics
        self._warned_at: dict[str, float] = {}  # topic -> clock() of its last warning, oldest first
        self._unreported: collections.Counter[str] = collections.Counter()
        self.warnings = 0

    def routed(self, topics: Mapping[str, int]) -> None:
        """Account for one routing round's events without a subscriber (topic -> how many)."""
        if not topics:
            return
        now = self.clock()
        for topic, n in topics.items():
            self._unreported[topic] += n
            last = self._warned_at.get(topic)
            if last is not None and now - last < self.interval:
                continue
            events = self._unreported.pop(topic)
            self._warned_at.pop(topic, None)
            self._warned_at[topic] = now
            self.warnings += 1
            since = "" if last is None else f" in the last {now - last:.0f}s"
            log.warning("router: %d events on topic %r matched no subscription%s (marked routed, no jobs: they are "
                        "not delivered to a consumer that subscribes later)", events, topic, since,
                        extra={"topic": topic, "events": events})
        while len(self._warned_at) > self.max_topics:
            oldest = next(iter(self._warned_at))
            del self._warned_at[oldest]
            self._unreported.pop(oldest, None)


def route_all(engine: Engine, limit: int = 500, *, schema: str | None = None) -> RouteResult:
    """Route every event of ``schema`` (None: the process default) that is unrouted and not
    locked by another router, ``limit`` per transaction; returns the totals."""
    events = jobs = unsubscribed = 0
    while True:
        with engine.begin() as conn:
            result = route_batch(conn, limit, schema=schema)
        events += result.events
        jobs += result.jobs
        unsubscribed += result.unsubscribed
        if result.events < limit:
            return RouteResult(events, jobs, unsubscribed)


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
    ``pg_class.reltuples`` of ``outbox_jobs`` (the row count at the last ANALYZE or VACUUM
    by anyone; a table never analysed counts as 0). ``floor`` (jobs, default 1,000) spares a
    nearly empty table an ANALYZE every round; ``fraction`` (default 1.0: once the table
    may have doubled) scales the trigger with the table, and ``at_most`` (jobs, default
    100,000) caps it, so a table of done jobs kept for a day still gets an ANALYZE after
    every 100,000 new ready jobs. What the claim's plan needs is only that the statistics
    do not say "almost no ready jobs" while a burst has put many there: a count off by
    half picks the same plan. ANALYZE reads every page below 3,000 pages and a sample of
    30,000 rows above (default statistics target), so it costs in proportion to the table
    up to tens of milliseconds: with autovacuum's fraction of 0.1 a burst of 150,000 jobs
    into an empty table runs about 40 of them by the rule's arithmetic, doubling about 8
    (measured: 15 % less database CPU per job, +14 % end to end; performance notes, "Issue 14"). ``reltuples`` is read only
    when the count passes the trigger computed from the previous read, so a round that is
    not due costs no query. With several relays each counts the jobs it routed itself; an
    ANALYZE by any of them, or by autovacuum, raises ``reltuples`` and so the others' trigger.

    The first of these ANALYZEs also analyses ``outbox_events`` if it never was (``reltuples``
    -1: a new database, autovacuum off or not yet awake); later ones leave it to autovacuum.
    Without any statistics the planner rates ``routed_at IS NULL`` at 0.5 % of the table, and
    with a backlog the route's pick of 500 then read and sorted every unrouted event through a
    bitmap scan; with statistics from any moment (a few unrouted: an estimate of a handful; a
    burst: thousands) it walks ``ix_outbox_events_unrouted`` in id order and stops at the
    batch (performance notes, "Issue 14"). ``events_analyzed`` counts those.

    In a relay the keeper has a thread of its own (:meth:`run`): the router's loop only
    counts (:meth:`count`, no query) and the ANALYZE runs beside it. Run inline, each
    ANALYZE held up routing for its duration (tens of milliseconds at 100,000 jobs, up to
    hundreds on a large table), then once per 10 % of growth: during a steady stream, dozens
    of stalls a minute, each one adding its length to the commit-to-handler latency of every
    event published meanwhile (performance notes, "Issue 14", latency). :meth:`routed`
    counts and analyses in the caller's thread: for tests and a caller without a thread.

    Each ANALYZE runs in a short transaction of its own on a pooled connection, with a
    transaction-local ``lock_timeout`` (seconds, default 0.1). ANALYZE takes a SHARE
    UPDATE EXCLUSIVE lock, which conflicts with autovacuum and with another relay's
    ANALYZE, but not with routing, claiming or any other job statement. A lock timeout
    means someone else is vacuuming or analysing the table: the keeper skips quietly
    (DEBUG) and tries again after a capped, jittered backoff (``retry_base`` doubling up to
    ``retry_cap`` seconds) on a later call. Keeping the timeout below the server's
    ``deadlock_timeout`` (1 s by default) also means the keeper never waits long enough to
    make PostgreSQL cancel an autovacuum that holds the lock ("Routine Vacuuming", "The
    Autovacuum Daemon": a conflicting lock request interrupts autovacuum). Any other
    database error is logged at INFO and retried the same way; nothing is raised.

    The relay's role must own ``outbox_jobs`` (it does when it ran the migrations);
    otherwise (``upkeep``, :class:`outbox.relay.maintenance.TableUpkeep`, says so once) the
    ANALYZE is not sent and the statistics are left to autovacuum. One keeper per router
    loop: :meth:`count` may be called from the router's thread while :meth:`run` runs in
    another; :meth:`routed` is not to be called while :meth:`run` runs. ``analyzed``,
    ``skipped``, ``failed`` and ``denied`` (not permitted) count the outcomes; ``pending``
    is the jobs routed since the last ANALYZE.
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
