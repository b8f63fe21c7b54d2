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

The router counts the jobs it creates for the statistics keeper
(:mod:`outbox.relay.statistics`), which keeps the planner's statistics of ``outbox_jobs``
current after bursts.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection, Engine

from outbox.db import queries
from outbox.registry import Outbox
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
