"""Ordered delivery per key: the rules, in one place (architecture notes, "Ordering").

A subscriber declared ``ordered=True`` gets the jobs of one event key one at a time, in the
commit order of the events' transactions; events without a key stay unordered.

**States.** Of the unfinished jobs of one (consumer, ordering key), only the *head* (the
one with the lowest event id) is ever ``ready`` or ``running``; every later one is
``pending``. ``pending`` is not claimable and sits outside ``ix_outbox_jobs_ready``, so the
claim statement is untouched and costs the same with 100,000 jobs waiting behind one
blocked key. "Unfinished" means ready, running, pending, or dead while still holding its
``ordering_key``; ``done`` and ``cancelled`` are finished. ``ix_outbox_jobs_ordering``
(consumer, ordering_key, event_id) holds exactly the rows with a key that are not done.

* A retry keeps the order: a job in backoff is ``ready`` with a future ``run_at`` and its
  followers stay ``pending``. A reaped or released job goes back to ``ready`` with its key:
  it keeps its place.
* ``on_dead='block'`` (default): a dead job keeps its key and blocks it (only it) until it
  is redriven (it is the head, so it becomes ``ready`` and runs first) or skipped
  (``outbox-relay skip``, :func:`outbox.admin.skip_dead_job`: the key is dropped and the next job goes).
  ``on_dead='skip'``: every statement that makes a job dead (``job_fail_many``,
  ``job_reap_many``, the poison bury statements) drops its ``ordering_key`` in the same
  update, so it no longer counts, and the next job is promoted.

**Which order.** "Earlier" is the commit order of the publishing transactions, for
transactions publishing the same key. Ids are drawn at insert and commit out of order, so
``publish`` takes a transaction-scoped advisory lock on the key before the row's id is
drawn (``event_insert``): a second transaction publishing the key waits until the first
ends, and then draws a higher id. One key's ids therefore commit in id order, and "lower id"
means "committed earlier". Routing keeps that order across routers: with ``SKIP LOCKED``
router B could otherwise route e11 while router A still holds e10 of the same key, so
``event_route_many`` routes a keyed event only when no earlier event of its key is
unrouted outside its own batch; a held-back event is taken by a later round.

**Routing an ordered job.** The router inserts the job ``pending`` when its (consumer, key)
has an unfinished job, or an earlier job in the same batch; else ``ready``. It locks the
key's first two unfinished jobs ``FOR KEY SHARE``; a head that finished meanwhile is dropped
by the lock's re-read of its newest version, and a second unfinished job seen in the
snapshot keeps the key busy whatever became of the head. ``FOR KEY SHARE`` waits only for
``FOR UPDATE``, which every statement that finishes a job takes on it first; claims
(``FOR NO KEY UPDATE SKIP LOCKED``) and promotions (``FOR NO KEY UPDATE``) neither wait for
it nor make it wait. (With ``FOR SHARE``, a claim statement that had locked a ready head,
and whose completion part then waited for a running head the router held, deadlocked with
the router, which waited for the claimed head: found by the adversarial test, 8 deadlocks
in 75 s with three relays on five hot keys.)

**Promotion** (``job_promote_many``): for each key whose head is ``pending``, the head
becomes ``ready`` (``run_at = greatest(run_at, now())``). It runs as a statement of its own
*after* the outcome that finished a key's job (done; dead under ``skip``; a transactional
handler's completion) has committed: :func:`promote_finished`, called by the dispatcher
after each round of outcomes and by ``outbox.testing.drain``. Why this cannot strand a job,
with W finishing job h (statement C, commit, then statement P = promotion) and router R
inserting job n of the same key:

1. C commits before R's snapshot: R sees h finished; n is ``ready`` (or ``pending`` behind
   another unfinished job, which is then the head and will be promoted in turn).
2. C commits after R's snapshot, but R's ``FOR KEY SHARE`` reaches h after C locked it: R
   waits for W's commit, re-reads h (done: passed over) and n is ``ready``.
3. R locks h first: C's update of h waits until R commits, so R's commit comes before C's,
   and P, which starts after C's commit, sees n ``pending`` and promotes it.

A promotion running in C's own transaction would take its snapshot before R's commit in
case 3 and strand n; hence "after the commit". Two promotions of one key take turns on the
head's row lock and the second finds it no longer pending. The router locks job rows in id
order, like the completion, heartbeat, failure and promotion statements, and waits only
for the ``FOR UPDATE`` locks of those that finish jobs (which wait for nothing but id-ordered
row locks), so none of them can deadlock with another. One strand remains possible: when the router saw a second
unfinished job p behind the head and p is promoted, run and finished (and its promotion
run) between the router's snapshot and the router's lock on p; the sweep below promotes n
then.

**Sweep.** A relay killed between a completion and its promotion leaves a head pending.
The reaper loop runs :class:`HeadSweeper` every round: a skip scan of
``ix_outbox_jobs_ordering`` reads up to ``SWEEP_KEYS`` keys' heads (one index probe per key,
whatever waits behind them), resuming where the previous pass stopped, and promotes the
pending ones; every key is visited once per ``keys / SWEEP_KEYS`` rounds.

**Cost and limits.** Publishing a key serialises the transactions that publish it: the
second waits for the first's commit. Two transactions that publish keys A and B in opposite
orders deadlock; PostgreSQL aborts one with 40P01 after ``deadlock_timeout``. Publish one
aggregate per transaction, or its keys in a fixed order (``publish_many`` locks the keys of
one statement in a fixed order itself). Keys are locked by a 32-bit hash, so two keys may
share a lock: that only serialises a little more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import Connection

from outbox.db import queries
from outbox.db.jobs import Executor, promote_keys
from outbox.db.promotion import promote, promote_params
from outbox.job import Job
from outbox.registry import Subscriber

log = logging.getLogger(__name__)

#: Keys whose heads one sweep pass reads (and, where pending, promotes).
SWEEP_KEYS = 500


def promotion_params(jobs: Iterable[Job], subscribers: Mapping[str, Subscriber]) -> dict[str, list[str]] | None:
    """``promote_params`` for the keys of ``jobs`` whose consumer (in ``subscribers``) is
    ordered; None when no job is ordered and keyed. Jobs whose outcome did not finish them (a
    retry) may be passed: their promotion finds the head ready and changes nothing."""
    return promote_params((j.consumer, j.key) for j in jobs
                          if j.key is not None and (sub := subscribers.get(j.consumer)) is not None and sub.ordered)


def promote_finished(conn: Executor, jobs: Iterable[Job], subscribers: Mapping[str, Subscriber], *,
                     schema: str | None = None) -> list[Any]:
    """After the outcomes of ``jobs`` committed: promote the next job of each ordered key
    they belong to (``promotion_params``); no statement runs when none is ordered. Returns
    the promoted jobs' rows (``id``, ``consumer``, ``ordering_key``, ``priority``, ``run_at``)."""
    params = promotion_params(jobs, subscribers)
    return [] if params is None else promote_keys(conn, params, schema=schema)


class HeadSweeper:
    """Promotes heads left pending (a relay killed between a completion and its promotion),
    ``keys`` keys per :meth:`sweep`, resuming after the last key the previous pass read."""

    def __init__(self, keys: int = SWEEP_KEYS) -> None:
        if keys < 1:
            raise ValueError(f"keys must be at least 1, got {keys}")
        self.keys = keys
        self.after = ("", "")

    def sweep(self, conn: Connection, *, schema: str | None = None) -> list[int]:
        """One bounded pass; returns the ids promoted. Starts again from the first key when
        the pass reached the last one."""
        rows = conn.execute(queries.in_schema(schema).job_ordering_heads_list, {
            "after_consumer": self.after[0], "after_key": self.after[1], "limit": self.keys}).all()
        self.after = (rows[-1].consumer, rows[-1].ordering_key) if len(rows) == self.keys else ("", "")
        stalled = [(r.consumer, r.ordering_key) for r in rows if r.status in ("pending", "cancelled")]
        promoted = promote(conn, stalled, schema=schema)
        if promoted:
            log.info("ordering: %d pending heads promoted by the sweep", len(promoted))
        return promoted

