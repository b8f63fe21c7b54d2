"""Retention: what the pruner deletes, shared by the relay's pruner
(:mod:`outbox.relay.maintenance`) and ``outbox-relay prune`` (:func:`outbox.admin.prune_now`).

Done, cancelled and superseded jobs finished more than ``retention_done`` seconds ago go first, then
events older than ``retention_events`` seconds that have no job left, then the rows of relays
gone for ``RELAY_GONE_AFTER`` seconds that hold no running job, and the messages intakes took
in more than ``intake_retention`` seconds ago (:func:`prune_intake`). Dead jobs are never pruned:
they wait for a person (``outbox-relay dead``, ``outbox-relay redrive``). Work is done in
bounded batches (``PRUNE_BATCH`` rows of each kind per call), so pruning never holds long
locks. A row whose delete fails with a data error (a trigger, a foreign key of the
application's pointing at an event) is found by halves (:mod:`outbox.db.poison`) and kept in
the caller's quarantine: it stays, logged, and every other row is pruned.

Every function works on the tables of its ``schema`` argument (None: the process default,
:func:`outbox.settings.default_schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from outbox.db import queries
from outbox.db.poison import Quarantine, whole_or_halves

#: Rows of each kind (done jobs, cancelled jobs, superseded jobs, events) one :func:`prune` call deletes at most.
PRUNE_BATCH = 5000
#: Seconds after which a relay that stopped writing its row of ``outbox_relays`` (a live one
#: does at least every :data:`outbox.db.tables.RELAY_SEEN_INTERVAL`) and holds no running job
#: is forgotten by the pruner.
RELAY_GONE_AFTER = 600.0


def prune(conn: Connection, done_older_than: float, events_older_than: float,
          limit: int = PRUNE_BATCH, quarantine: Quarantine | None = None, *,
          schema: str | None = None) -> tuple[int, int]:
    """Delete up to ``limit`` done jobs, up to ``limit`` cancelled jobs and up to ``limit``
    superseded jobs finished more than ``done_older_than`` seconds ago (counted together) and up to
    ``limit`` finished events older than ``events_older_than`` seconds; returns the counts
    (jobs, events). A row whose delete fails with a data error (a trigger, a foreign key of
    the application's pointing at an event) is found by halves (:mod:`outbox.db.poison`) and
    kept in ``quarantine``: it stays, logged, and every other row is pruned."""
    quarantine = quarantine if quarantine is not None else Quarantine("row")
    statements = queries.in_schema(schema)
    jobs = _prune_by_halves(conn, statements.job_prune_done_many, statements.job_prune_candidates,
                            done_older_than, limit, quarantine, "pruning the done job")
    jobs += _prune_by_halves(conn, statements.job_prune_cancelled_many, statements.job_prune_cancelled_candidates,
                             done_older_than, limit, quarantine, "pruning the cancelled job")
    jobs += _prune_by_halves(conn, statements.job_prune_superseded_many, statements.job_prune_superseded_candidates,
                             done_older_than, limit, quarantine, "pruning the superseded job")
    events = _prune_by_halves(conn, statements.event_prune_many, statements.event_prune_candidates,
                              events_older_than, limit, quarantine, "pruning the event")
    return jobs, events


def _prune_by_halves(conn: Connection, delete: Any, candidates: Any, older_than: float, limit: int,
                     quarantine: Quarantine, doing: str) -> int:
    skip = quarantine.ids()

    def run(only: Sequence[int] | None) -> int:
        with conn.begin_nested():
            return len(conn.execute(delete, {"older_than": older_than, "limit": limit, "skip": skip,
                                             "only": None if only is None else list(only)}).all())

    parts, poisoned = whole_or_halves(
        doing, lambda: run(None),
        lambda: list(conn.execute(candidates, {"older_than": older_than, "limit": limit, "skip": skip}).scalars()), run)
    for row_id, exc in poisoned:
        quarantine.add(row_id, exc, doing)
    return sum(parts)


def prune_relays(conn: Connection, older_than: float = RELAY_GONE_AFTER, *, schema: str | None = None) -> int:
    """Forget relays (rows of ``outbox_relays``) not seen for ``older_than`` seconds that
    hold no running job: killed relays, whose buffer lists no claim the reaper could still
    meet. Returns how many were removed."""
    return conn.execute(queries.in_schema(schema).relay_prune_many, {"older_than": older_than}).rowcount


def prune_intake(conn: Connection, older_than: float, limit: int = PRUNE_BATCH, *, schema: str | None = None) -> int:
    """Forget up to ``limit`` messages intakes took in more than ``older_than`` seconds ago
    (``intake_retention``); rejected ones stay. Returns how many were forgotten."""
    return conn.execute(queries.in_schema(schema).intake_prune_many,
                        {"older_than": older_than, "limit": limit}).rowcount
