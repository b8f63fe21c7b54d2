"""Flow control per consumer, enforced by the database across all relays: pause / resume,
concurrency caps and rate limits (architecture notes, "Flow control").

State. One row of ``outbox_consumers`` per consumer: ``concurrency`` (most running jobs,
NULL: no cap) and ``rate_limit`` (most claims per second, NULL: none), which every relay
writes from its registry at start, and ``paused_at`` (NULL: not paused), ``tokens`` and
``refilled_at`` (the rate limit's bucket), which a relay start never touches. The
database's row is what counts, not a relay's registry: relays of one deploy declare the
same options, and the last relay to start wins when they differ.

Pause. Every claim statement leaves out the consumers whose ``paused_at`` is set, by a
subquery on ``outbox_consumers`` inside the statement, so a pause holds for every relay
and every claim whose snapshot is taken after the pause committed; it survives relay
restarts (a row, not a flag in memory). Routing goes on: the consumer's jobs accumulate
as ``ready`` and nothing is lost; ``resume`` clears ``paused_at`` and notifies the relays,
which claim the backlog at once. A claim already in flight when the pause commits (its
snapshot is older) may still take jobs, and jobs already claimed (running or in a relay's
prefetch buffer) run to their end: pause stops new claims, it never cancels work.

Caps and rate limits. A consumer with either is left out of the main claim (the same
subquery) and claimed here, on a path of its own, in one transaction of two statements:

1. ``consumer_lock_limited_many`` locks the consumers' rows ``FOR UPDATE``, in consumer
   order (so two relays locking several rows never deadlock), and only those not paused;
2. ``job_claim_limited_many`` then refills each bucket on the database clock, computes each
   consumer's allowance = min(concurrency - its running jobs, floor(tokens), room), claims
   up to it (``FOR UPDATE SKIP LOCKED``, claim order priority, run_at, id), takes the tokens,
   and lists the buffered claims in the relay's row of ``outbox_relays`` exactly as the
   main claim does (``BufferMark``), so fences, leases, heartbeats and the reaper treat
   these claims like any other.

Why two statements and not one: under READ COMMITTED a statement's snapshot is taken when
it starts. A single statement that locked the consumer row and then counted running jobs
would, after waiting for the lock, re-read only the locked row (EvalPlanQual); its count
of running jobs would still come from the snapshot taken before the wait, and miss the
jobs the previous lock holder claimed and committed meanwhile, so two relays could each
see room for the same slot. The second statement starts after the lock is held, so its
snapshot contains every claim committed by every relay that held the lock before: the
count is exact, and the cap holds cluster-wide. "Running" counts every claim, including
jobs prefetched into a relay's buffer whose handler has not started.

Token bucket. Rate r claims per second, capacity max(1, r): one second of burst. On each
claim the bucket is refilled by r x (seconds since ``refilled_at``), by
``statement_timestamp()`` of the claim statement (taken after the lock, so it never goes
backwards between lock holders), capped at the capacity; each claimed job takes one token
and only whole tokens are spent. A new bucket (``refilled_at`` NULL) starts full. So an
idle consumer may take up to max(1, r) jobs at once, then r per second: over any window of
t seconds at most r x t + max(1, r) claims. The bucket is one row, so every relay shares it.

Waiting. The dispatcher never spins on a full cap or an empty bucket. After each limited
claim this module knows when it is worth trying again: at once if the claim was cut short
by the room of this relay (more is claimable), when the next token is due for a consumer
whose bucket ran dry, else (cap full, or nothing ready) after ``poll_interval``; a
completion of one of its consumers' jobs written by this relay, or a jobs wake-up (NOTIFY,
router), makes it due at once. Other relays' completions are seen within ``poll_interval``.

Costs. A relay with no limited consumer never runs this path; the main claim pays one
hashed SubPlan over ``outbox_consumers`` (a handful of rows). A limited claim costs one
transaction (BEGIN, two statements, COMMIT) and serialises the relays on the consumers'
rows for its duration (about a millisecond); running jobs are counted through
``ix_outbox_jobs_lease`` and ready ones found through ``ix_outbox_jobs_ready``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from outbox.db import queries
from outbox.db.jobs import claim_order
from outbox.registry import Subscriber

_DIALECT = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy's dialects are untyped
_SQL: dict[int, str] = {}


def _sql(statement: TextClause) -> str:
    """``statement`` compiled for psycopg's paramstyle, once per statement object."""
    sql = _SQL.get(id(statement))
    if sql is None:
        sql = _SQL[id(statement)] = str(statement.compile(dialect=_DIALECT))
    return sql


def is_limited(sub: Subscriber) -> bool:
    """Whether ``sub`` declares a concurrency cap or a rate limit (claimed by :class:`FlowControl`)."""
    return sub.concurrency is not None or sub.rate_limit is not None


class FlowControl:
    """The claim path of one dispatcher for its consumers that have a concurrency cap or a
    rate limit, and the clock that says when that claim is worth a round trip.

    ``subscribers``: consumer -> :class:`~outbox.registry.Subscriber` of this relay;
    ``leases``: consumer -> lease seconds; ``poll_interval``: longest wait, seconds.
    Not thread-safe: the dispatcher thread alone calls it."""

    def __init__(self, subscribers: Mapping[str, Subscriber], leases: Mapping[str, float], worker_id: str,
                 poll_interval: float, *, schema: str | None = None) -> None:
        self.consumers = sorted(c for c, s in subscribers.items() if is_limited(s))
        self.unlimited = len(subscribers) > len(self.consumers)
        self.leases = [leases[c] for c in self.consumers]
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.statements = queries.in_schema(schema)
        self._due_at = 0.0  # time.monotonic() from which a limited claim is worth trying
        self.claims = 0  # limited claim transactions run (each costs its round trips)

    @property
    def active(self) -> bool:
        """Whether this relay has limited consumers at all."""
        return bool(self.consumers)

    def room(self, want: int) -> int:
        """The share of ``want`` (jobs the dispatcher may claim now) the limited claim takes
        this round: 0 unless it is due; half (at least one) when the relay also has other
        consumers, so a backlog of theirs never starves the limited ones; else all."""
        if not self.consumers or want <= 0 or time.monotonic() < self._due_at:
            return 0
        return max(1, want // 2) if self.unlimited else want

    def wait_seconds(self) -> float:
        """Seconds until the limited claim is due again (0: now; ``poll_interval`` when idle)."""
        if not self.consumers:
            return self.poll_interval
        return max(0.0, min(self.poll_interval, self._due_at - time.monotonic()))

    def poke(self) -> None:
        """Make the limited claim due at once (new jobs may be ready, or a slot came free)."""
        self._due_at = 0.0

    def finished(self, consumers: Iterable[str]) -> None:
        """The dispatcher is writing outcomes for jobs of ``consumers``: if one is limited,
        a slot may come free, so the limited claim is due at once."""
        if self.consumers and not set(self.consumers).isdisjoint(consumers):
            self._due_at = 0.0

    def claim(self, conn: psycopg.Connection[Any], room: int, relay: str | None, start_now: int,
              excluded: frozenset[str] = frozenset(), forwarding: frozenset[str] = frozenset()) -> list[Any]:
        """Claim up to ``room`` jobs of the limited consumers on ``conn`` (autocommit; one
        transaction here), but those in ``excluded`` (forwarders whose broker is down);
        returns the claimed rows in claim order, read by column name: those of
        ``job_claim_after_many`` (``priority`` and ``run_at`` among them). The
        claims that start later are listed as buffered in ``relay``'s row of
        ``outbox_relays`` (None: not listed): every job of a forwarder in ``forwarding``, and
        of the others all but the first ``start_now``. Database errors propagate (nothing
        claimed: the transaction rolled back)."""
        consumers = [c for c in self.consumers if c not in excluded] if excluded else self.consumers
        if room <= 0 or not consumers:
            return []
        self.claims += 1
        with conn.transaction():
            locked: list[Any] = conn.cursor(row_factory=namedtuple_row).execute(
                _sql(self.statements.consumer_lock_limited_many), {"consumers": consumers}).fetchall()
            if not locked:  # paused, or no cap or limit in the database
                self._due_at = time.monotonic() + self.poll_interval
                return []
            names = [r.consumer for r in locked]
            leases = dict(zip(self.consumers, self.leases, strict=True))
            rows: list[Any] = conn.cursor(row_factory=namedtuple_row).execute(
                _sql(self.statements.job_claim_limited_many), {
                "consumers": names, "leases": [leases[c] for c in names], "limit": room,
                "worker": self.worker_id, "relay": relay, "start_now": start_now,
                "forwarding": list(forwarding)}).fetchall()
        rows.sort(key=claim_order)
        self._schedule(locked, rows, room)
        return rows

    def _schedule(self, locked: list[Any], rows: list[Any], room: int) -> None:
        """When the next limited claim is due, from the buckets as locked and what was claimed."""
        if len(rows) >= room:
            self._due_at = 0.0  # cut short by this relay's room: more may be claimable now
            return
        taken: dict[str, int] = {}
        for r in rows:
            taken[r.consumer] = taken.get(r.consumer, 0) + 1
        wait = self.poll_interval
        for r in locked:
            if r.rate_limit is None:
                continue
            left = r.tokens - taken.get(r.consumer, 0)
            if left < 1:
                wait = min(wait, (1 - left) / r.rate_limit)
        self._due_at = time.monotonic() + wait
