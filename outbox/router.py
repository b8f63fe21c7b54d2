"""The router: turns events into jobs, one per subscribed consumer.

Each round runs :data:`~outbox.db.queries.event_route_many` in its own transaction: lock a
batch of unrouted events with ``FOR UPDATE SKIP LOCKED``, insert one job per matching row
of ``outbox_subscriptions``, mark the events routed. Because the lock, the inserts and
the mark commit together, every (event, consumer) job is created exactly once, however
many relays route at the same time; ``UNIQUE (event_id, consumer)`` backs this up.
Events are found by ``routed_at IS NULL``, never by "id above the last one seen": identity
values are taken at insert time but become visible at commit, out of order.

An event whose topic has no subscription is marked routed with no jobs and counted
(``unsubscribed``); subscribing later does not deliver it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine

from .db import queries

log = logging.getLogger("outbox.router")


@dataclass(frozen=True, slots=True)
class RouteResult:
    """What one routing round did: events routed, jobs created, events with no subscriber."""

    events: int
    jobs: int
    unsubscribed: int


def route_batch(conn: Connection, limit: int) -> RouteResult:
    """Route up to ``limit`` unrouted events in ``conn``'s transaction; the caller commits."""
    row = conn.execute(queries.event_route_many, {"limit": limit}).one()
    return RouteResult(events=row.events, jobs=row.jobs, unsubscribed=row.unsubscribed)


def route_all(engine: Engine, limit: int = 500) -> RouteResult:
    """Route every event that is unrouted and not locked by another router, ``limit`` per
    transaction; returns the totals."""
    events = jobs = unsubscribed = 0
    while True:
        with engine.begin() as conn:
            result = route_batch(conn, limit)
        events += result.events
        jobs += result.jobs
        unsubscribed += result.unsubscribed
        if result.events < limit:
            return RouteResult(events, jobs, unsubscribed)
