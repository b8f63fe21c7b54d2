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

Coalescing consumers (``coalesce=True``; architecture notes, "Coalescing"): of the jobs of one
(consumer, key) only the newest event's waits; routing a newer event supersedes the older
waiting ones and marks the running ones (their attempt ends ``superseded`` rather than
waiting again), and an event overtaken by a newer one of its key gets its job ``superseded``
at once. Each round counts the jobs it superseded (:attr:`RouteResult.superseded`).

An event whose topic has no subscription is marked routed with no jobs and counted
(``unsubscribed``); subscribing later does not deliver it.

The loop (:class:`Router`, thread ``outbox-router``): a round routes up to ``route_batch``
events on one autocommit connection kept between rounds. After a full batch the next round
follows at once; otherwise the loop waits for a wake-up (``NOTIFY outbox_events`` through
the listener) or ``poll_interval`` seconds, or 0.05 s when the round held keyed events back
behind another router's batch (that batch's commit sends no NOTIFY). Wake-ups closer than
``wake_cooldown`` share one round. Jobs created wake this relay's workers, with the key of the
first one made ready (``Wakeup.lower``; other relays get it by NOTIFY). A database error
never ends the loop: the connection is thrown away and the loop retries through the relay's
:class:`~outbox.relay.reconnect.Reconnector`. The router counts the jobs it creates for the
statistics keeper (:mod:`outbox.relay.statistics`), whose thread (``outbox-statistics``) it
starts and stops beside its own, as it does its look-out's (``outbox-route-lookout``:
:meth:`Router.look_behind` on a connection of its own every second, for unrouted events
before its hint that no notification announced).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox.db import queries
from outbox.db.poison import Quarantine, SystemicError, whole_or_halves
from outbox.db.tables import JOBS_CHANNEL, notify_channel
from outbox.registry import Outbox
from outbox.relay.counters import Counters
from outbox.relay.notify import ClaimKey, Cooldown, Lookout, Wakeup
from outbox.relay.reconnect import Reconnector
from outbox.relay.statistics import StatisticsKeeper
from outbox.settings import OutboxSettings, default_schema

if TYPE_CHECKING:
    from outbox.telemetry.metrics import RelayMetrics

log = logging.getLogger(__name__)

#: Seconds the router waits before routing again after a round that held keyed events back
#: behind an earlier event another router held (it is routed by then, or about to be).
HELD_BACK_RETRY = 0.05


@dataclass(frozen=True, slots=True)
class RouteResult:
    """What one routing round did: events routed, jobs created, events with no subscriber,
    keyed events held back because an earlier event of their key was still unrouted
    outside the batch (another router held it; architecture notes, "Ordering"; coalescing
    notes), and the topics of the events with no subscriber, with how many of each."""

    events: int
    jobs: int
    unsubscribed: int
    held_back: int = 0
    #: topic -> events of it that matched no subscription
    unsubscribed_topics: Mapping[str, int] = field(default_factory=dict)
    #: claim-order key (priority, run_at, 0) just before the first job made ready, or None
    first_ready: ClaimKey | None = field(default=None, compare=False)
    #: where the next scan may start (:class:`RouteHint`): the highest id the round locked, or
    #: just below the first it held back; None when it locked none
    routed_to: int | None = field(default=None, compare=False)
    #: consumer -> jobs of it the round made ``superseded`` (coalescing consumers: older waiting
    #: jobs of a key a newer event reached, and jobs created superseded)
    superseded: Mapping[str, int] = field(default_factory=dict)


def register_subscriptions(engine: Engine, registry: Outbox, settings: OutboxSettings) -> None:
    """Write ``registry``'s (topic, consumer) pairs and options to ``outbox_subscriptions``
    and its flow-control options to ``outbox_consumers``, of schema ``settings.schema_name``
    (the relay does at start, :func:`outbox.testing.drain` before routing): routing creates
    jobs for the pairs found there. Jobs of a consumer declared unordered that still hold an
    ordering key (it was ordered before) leave it: waiting ones become ready, a dead one no
    longer blocks (``job_ordering_release_many``). The registry's fan-ins are written in the
    same transaction (:func:`register_fan_ins`); a fan-in listing a consumer the registry
    does not declare raises :class:`~outbox.errors.ConfigurationError` first, writing nothing."""
    registry.check_fan_ins()
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
            "coalesce": [s.coalesce for _, s in pairs],
            "fan_in": [registry.fanned_in(topic, s.consumer) for topic, s in pairs],
            "hooks": [",".join(registry.hooks_of(s.consumer)) for _, s in pairs],
        }).all()
        flow = conn.execute(queries.in_schema(settings.schema_name).consumer_upsert_many, {
            "consumers": [s.consumer for s in subs],
            "concurrency": [s.concurrency for s in subs],
            "rate_limits": [s.rate_limit for s in subs],
        }).all()
        unordered = [s.consumer for s in subs if not s.ordered]
        released = conn.execute(queries.in_schema(settings.schema_name).job_ordering_release_many,
                                {"consumers": unordered}).all() if unordered else []
        register_fan_ins(conn, registry, settings.schema_name)
    if released:
        log.warning("%d jobs of consumers now declared unordered left their ordering keys (%d were waiting, now "
                    "ready)", len(released), sum(1 for r in released if r.status == "ready"))
    for row in changed:
        if row.updated:
            log.warning("subscription %s on %s now has this registry's options (max_attempts=%s, lease=%gs, "
                        "priority=%s, transactional=%s, ordered=%s, on_dead=%s, coalescing=%s, fan_in=%s, hooks=%s); another "
                        "registry declaring it differently would be overwritten the same way", row.consumer, row.topic,
                        row.max_attempts, row.lease_seconds, row.priority, row.transactional, row.ordered, row.on_dead,
                        row.coalescing, row.fan_in, row.hooks)
    for row in flow:
        if row.updated:
            log.warning("consumer %s now has this registry's flow control (concurrency=%s, rate_limit=%s/s)",
                        row.consumer, row.concurrency, row.rate_limit)


def register_fan_ins(conn: Connection, registry: Outbox, schema: str) -> None:
    """Write ``registry``'s fan-ins (:meth:`outbox.Outbox.after`) to ``outbox_fanins`` of
    ``schema`` in ``conn``'s transaction, and forget the fan-ins of this registry's consumers
    it no longer declares (``fanin_delete_undeclared``), logging each one changed or forgotten.
    The fan-in trigger reads them (:mod:`outbox.db.fan_in`); the subscriptions' ``fan_in``
    flags, written beside, say which consumers' jobs look for one."""
    statements = queries.in_schema(schema)
    fan_ins = registry.fan_ins
    written = conn.execute(statements.fanin_upsert_many, {"fan_ins": json.dumps([
        {"name": f.name, "topic": f.topic, "consumers": list(f.consumers), "follow_topic": f.follow_topic}
        for f in fan_ins])}).all() if fan_ins else []
    forgotten = conn.execute(statements.fanin_delete_undeclared, {
        "consumers": registry.consumers, "names": [f.name for f in fan_ins]}).all()
    for row in written:
        if row.updated:
            log.warning("fan-in %s now has this registry's definition (after %s by %s, publish %s); another "
                        "registry declaring it differently would be overwritten the same way", row.name, row.topic,
                        row.consumers, row.follow_topic)
    for row in forgotten:
        log.warning("fan-in %s (after %s by %s, publish %s) is no longer declared: forgotten, it fires no more",
                    row.name, row.topic, row.consumers, row.follow_topic)


def route_batch(conn: Connection, limit: int, skip: Sequence[int] = (),
                only: Sequence[int] | None = None, *, after: int = 0, schema: str | None = None) -> RouteResult:
    """Route up to ``limit`` unrouted events of ``schema`` (None: the process default,
    :func:`outbox.settings.default_schema`) with ids above ``after`` in ``conn``'s
    transaction; the caller commits. Events whose id is in ``skip`` are left out; ``only``,
    when given, limits the batch to those ids."""
    row = conn.execute(queries.in_schema(schema).event_route_many, {
        "limit": limit, "skip": list(skip), "only": None if only is None else list(only), "after": after,
        "channel": notify_channel(JOBS_CHANNEL, schema or default_schema())}).one()
    topics = dict(zip(row.unsubscribed_topics, row.unsubscribed_counts)) if row.unsubscribed_topics else {}
    first = None if row.first_priority is None else (row.first_priority, row.first_run_at, 0)
    routed_to = row.scanned_to if row.first_held is None else min(row.scanned_to, row.first_held - 1)
    superseded = dict(zip(row.superseded_consumers, row.superseded_counts)) if row.superseded_consumers else {}
    return RouteResult(events=row.events, jobs=row.jobs, unsubscribed=row.unsubscribed, held_back=row.held_back,
                       unsubscribed_topics=topics, first_ready=first, routed_to=routed_to, superseded=superseded)


def route_round(conn: Connection, limit: int, quarantine: Quarantine, *, after: int = 0,
                schema: str | None = None) -> RouteResult:
    """One routing round on an autocommit connection: :func:`route_batch` of up to
    ``limit`` events, leaving out the events in ``quarantine``. A data error (a trigger or
    constraint of the application's on the jobs or events table failing for one event) is
    confined to the events that cause it (:mod:`outbox.db.poison`): the batch is routed by
    halves, and an event that fails alone is quarantined, logged with the database error:
    it stays unrouted (nothing is lost; ``status`` counts it), is tried again after
    ``QUARANTINE_SECONDS``, and every other event is routed. Returns the totals. ``after``
    and ``schema`` as for :func:`route_batch` (the halves search from the first id)."""
    skip = quarantine.ids()
    candidates = queries.in_schema(schema).event_route_candidates
    parts, poisoned = whole_or_halves(
        "routing", lambda: route_batch(conn, limit, skip, after=after, schema=schema),
        lambda: list(conn.execute(candidates, {"limit": limit, "skip": skip}).scalars()),
        lambda part: route_batch(conn, len(part), skip, part, schema=schema))
    for event_id, exc in poisoned:
        quarantine.add(event_id, exc, "routing")
    topics: collections.Counter[str] = collections.Counter()
    superseded: collections.Counter[str] = collections.Counter()
    for p in parts:
        topics.update(p.unsubscribed_topics)
        superseded.update(p.superseded)
    firsts = [p.first_ready for p in parts if p.first_ready is not None]
    return RouteResult(events=sum(p.events for p in parts) + len(poisoned), jobs=sum(p.jobs for p in parts),
                       unsubscribed=sum(p.unsubscribed for p in parts), held_back=sum(p.held_back for p in parts),
                       unsubscribed_topics=dict(topics), first_ready=min(firsts) if firsts else None,
                       routed_to=parts[0].routed_to if len(parts) == 1 and not poisoned else None,
                       superseded=dict(superseded))


class RouteHint:
    """Where the router's next scan of unrouted events starts (issue 28): after the highest
    id its last round locked, so a round does not read again through the index entries of
    the events routed before, which a long-held snapshot elsewhere keeps from being removed.

    Ids commit out of order: an event whose transaction commits after higher ids were routed
    sorts before the hint. Its notification names the first id its statement wrote
    (``from <id>``, the events' trigger since migration 0009), and :meth:`lower` takes the
    next scan back to it. What nothing announces (a notification missed while the listener
    reconnected, a relay without LISTEN, events another router locked and then rolled back,
    quarantined events whose time is up) the router's look-out finds and lowers the hint to
    (:class:`outbox.relay.notify.Lookout`, :meth:`Router.look_behind`).
    Thread-safe: the listener and the look-out lower it while the router's thread routes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._after: int | None = None  # None: no hint yet, scan from the first id
        self._lowest: int | None = None  # lowest id announced since the round in flight started
        self._in_flight: int | None = None  # what the round in flight was started with

    def lower(self, event_id: int) -> None:
        """An event with id ``event_id`` (and maybe higher ids) committed: the next scan
        starts below it."""
        with self._lock:
            self._lowest = event_id if self._lowest is None else min(self._lowest, event_id)

    def after(self) -> int | None:
        """The id the next round routes after unless lowered (None: no round locked an event yet)."""
        with self._lock:
            return self._after

    def start(self) -> int:
        """The id the next round routes after (0: from the first)."""
        with self._lock:
            self._in_flight, self._lowest = self._lowest, None
            if self._after is None:
                return 0
            if self._in_flight is not None:
                return min(self._after, self._in_flight - 1)
            return self._after

    def routed(self, routed_to: int | None) -> None:
        """The round in flight committed; ``routed_to`` is where the next may start (None:
        it locked no event)."""
        with self._lock:
            self._in_flight = None
            if routed_to is not None:
                self._after = routed_to

    def failed(self) -> None:
        """The round in flight failed: what was announced before it started still waits."""
        with self._lock:
            if self._in_flight is not None:
                self._lowest = self._in_flight if self._lowest is None else min(self._lowest, self._in_flight)
            self._in_flight = None


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
    superseded: collections.Counter[str] = collections.Counter()
    while True:
        with engine.begin() as conn:
            result = route_batch(conn, limit, schema=schema)
        events += result.events
        jobs += result.jobs
        unsubscribed += result.unsubscribed
        superseded.update(result.superseded)
        if result.events < limit:
            return RouteResult(events, jobs, unsubscribed, superseded=dict(superseded))


class Router:
    """The router's loop (see the module notes) and the statistics keeper's thread beside it.

    Routes the events of ``settings.schema_name`` through ``engine`` until ``stop`` is set
    (the relay's stop event, shared by its parts: :meth:`stop` sets it). ``wake`` is set by
    the listener on ``NOTIFY outbox_events``; ``wake_workers`` is set after a round that
    created jobs; ``reconnect`` paces the retries after a database error; ``statistics``
    (default: a :class:`~outbox.relay.statistics.StatisticsKeeper` of the same schema)
    counts the jobs created and runs its ANALYZEs in its own thread; ``metrics``, when
    given, counts the events routed. Settings read: ``route_batch``, ``poll_interval``,
    ``wake_cooldown`` (seconds).

    ``stats`` counts ``events_routed``, ``jobs_created``, ``events_unsubscribed`` and
    ``jobs_superseded`` (coalescing consumers' jobs the rounds made ``superseded``);
    ``quarantine`` holds the events whose routing fails alone (:mod:`outbox.db.poison`);
    ``unsubscribed_topics`` warns about topics with no subscriber. :meth:`run_round` is one
    round, for tests and callers without a thread.
    """

    #: The names ``stats`` counts, from 0.
    COUNTS = ("events_routed", "jobs_created", "events_unsubscribed", "jobs_superseded")

    def __init__(self, engine: Engine, settings: OutboxSettings, *, stop: threading.Event, wake: threading.Event,
                 wake_workers: Wakeup, reconnect: Reconnector, statistics: StatisticsKeeper | None = None,
                 metrics: RelayMetrics | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.stop_event = stop
        self.wake = wake
        self.wake_workers = wake_workers
        self.reconnect = reconnect
        self.statistics = statistics if statistics is not None else StatisticsKeeper(
            engine, schema=settings.schema_name)
        self.metrics = metrics
        self.quarantine = Quarantine("event")
        self.unsubscribed_topics = UnsubscribedTopics()
        #: Where the next round's scan starts; the listener lowers it (``Listener(on_events=...)``).
        self.hint = RouteHint()
        self.stats = Counters(self.COUNTS)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the router's thread (``outbox-router``), the keeper's (``outbox-statistics``)
        and the look-out's (``outbox-route-lookout``)."""
        lookout = Lookout(self.engine, self.look_behind, "route-lookout", self.stop_event, self.reconnect)
        for name, target in (("outbox-router", self.run), ("outbox-statistics", self._keep_statistics),
                             ("outbox-route-lookout", lookout.run)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Set the stop event and wake its threads; returns at once (:meth:`join` waits).
        A round under way finishes (it is one statement)."""
        self.stop_event.set()
        self.wake.set()
        self.statistics.wake()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for its threads to end, up to ``timeout`` seconds each; True when they have."""
        for thread in self._threads:
            thread.join(timeout=timeout)
        return not any(thread.is_alive() for thread in self._threads)

    def run(self) -> None:
        """The loop: rounds until the stop event is set; never raises for database errors."""
        failures = 0
        cooldown = Cooldown(self.settings.wake_cooldown)
        conn: Connection | None = None  # kept between rounds: no pool checkout and pre-ping per round
        while not self.stop_event.is_set():
            cooldown.wait(self.stop_event.wait)  # NOTIFYs closer than the cooldown share a round
            cooldown.started()
            try:
                if conn is None:
                    # One statement, atomic by itself: no BEGIN/COMMIT round trips needed.
                    conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                result = self.run_round(conn)
                failures = self.reconnect.recovered(failures, "router")
            except (DBAPIError, SystemicError) as exc:  # SystemicError: a statement that fails for every row
                if conn is not None:
                    with contextlib.suppress(Exception):  # it is being thrown away
                        conn.invalidate()  # whatever broke, the next round starts on a fresh connection
                        conn.close()
                    conn = None
                failures = self.reconnect.backoff(failures, "router", exc, self.stop_event)
                continue
            if result.events >= self.settings.route_batch:
                cooldown.skip()  # a full batch: more events may be waiting
            else:
                # Events held back behind another router's batch (architecture notes, "Ordering")
                # go once it commits, which sends no NOTIFY: look again soon.
                self.wake.wait(min(HELD_BACK_RETRY, self.settings.poll_interval) if result.held_back
                               else self.settings.poll_interval)
                self.wake.clear()
        if conn is not None:
            conn.close()

    def run_round(self, conn: Connection) -> RouteResult:
        """One round on ``conn`` (autocommit): :func:`route_round` of up to ``route_batch``
        events, then wake the workers when jobs were created, count the jobs for the
        statistics keeper (no query), and add to ``stats``, the metrics and the warnings
        about topics with no subscriber. Raises what :func:`route_round` raises."""
        after = self.hint.start()
        try:
            result = route_round(conn, self.settings.route_batch, self.quarantine, after=after,
                                 schema=self.settings.schema_name)
        except BaseException:
            self.hint.failed()
            raise
        self.hint.routed(result.routed_to)
        if result.first_ready is not None:  # claims start no later than the first job made ready
            self.wake_workers.lower(result.first_ready)
        elif result.jobs:
            self.wake_workers.set()
        self.statistics.count(result.jobs)  # no query: the keeper's thread runs the ANALYZE
        self.stats.add("events_routed", result.events)
        self.stats.add("jobs_created", result.jobs)
        if self.metrics is not None and result.events:
            self.metrics.routed(result.events, result.unsubscribed)
        if result.superseded:
            self.stats.add("jobs_superseded", sum(result.superseded.values()))
            if self.metrics is not None:
                self.metrics.jobs_counted("superseded", result.superseded)
        if result.unsubscribed:
            self.stats.add("events_unsubscribed", result.unsubscribed)
            self.unsubscribed_topics.routed(result.unsubscribed_topics)  # a WARNING per topic, once a minute
        return result

    def look_behind(self, conn: Connection) -> int | None:
        """The first unrouted event at or below the hint (``event_first_unrouted_before``,
        quarantined ids left out) on ``conn``: the hint is lowered to it and the router woken.
        Returns its id, or None when there is none or no round has routed yet (a round then
        starts from the first id anyway)."""
        after = self.hint.after()
        if after is None:
            return None
        first = conn.execute(queries.in_schema(self.settings.schema_name).event_first_unrouted_before,
                             {"after": after, "skip": self.quarantine.ids()}).scalar()
        if first is not None:
            self.hint.lower(first)
            self.wake.set()
        return first

    def _keep_statistics(self) -> None:
        self.statistics.run(self.stop_event)
