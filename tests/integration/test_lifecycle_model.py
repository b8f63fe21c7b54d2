"""Model-based test of the job lifecycle: a hypothesis ``RuleBasedStateMachine`` drives the
job statements on a real PostgreSQL in any order it likes, and a plain Python model says
what every job row must be after each step.

The world of one example: consumers ``c0`` and ``c1`` subscribe to topic ``t``, ``c2`` to
topic ``u``; topic ``x`` has no subscriber. Each example draws every consumer's
``max_attempts`` (1..3, so dead-lettering is frequent) and priority (0..1), then publishes
and routes a few events. Three simulated workers, ``w0`` (every consumer), ``w1`` (``c0``,
``c1``) and ``w2`` (``c1``, ``c2``), share one engine, but every operation is its own
transaction, as separate processes would be. Hypothesis interleaves:

* publishing 1..3 events and routing up to 1..4 of them (``route_batch``);
* a worker claiming 1..3 jobs (``claim_jobs``), and heartbeating, completing
  (``complete_jobs``, or the single-row ``job_complete`` that ends a transactional handler's
  transaction, rolled back when it matches no row), failing (transient with no delay, so the
  job is due again at once, or with an hour's delay, or permanent) or releasing any subset of
  the claims it holds, current or stale;
* a worker completing any subset of the claims it holds (current or stale, or none) and
  claiming 0..3 more in one transaction (``complete_and_claim_jobs``, the runner's
  ``job_complete_many`` then ``job_claim_after_many``): the claim takes what a claim alone
  would have taken just before, so never a job completed in the same round (it was running
  before, and is finished when the claim's snapshot is taken), and nothing with a limit of 0;
* pausing a worker: the database-side ``lease_until`` of its claims is moved into the past
  with SQL (no sleeping), and maybe the reaper runs and another worker claims at once. The
  paused worker keeps its claims and acts again whenever hypothesis picks it: before the
  reaper ran (its heartbeat or finish still wins) or after (its claims are stale);
* the reaper (``reap_expired``) and redrive of dead jobs (by ids, by consumer, both, or all);
* a relay re-declaring a consumer with new ``max_attempts`` and priority
  (``register_subscriptions``): jobs routed afterwards get them, existing jobs keep theirs.

The model predicts every column of every job: status, fence, attempts, max_attempts,
priority, locked_by, last_error, and the timestamps (run_at, lease_until, finished_at,
updated_at, created_at) from the database clock of the operation's own transaction
(``SELECT now()`` in it), and which jobs a claim picks (``priority, run_at, id`` among due
ready jobs). Checked apart from those columns (``history_matches_the_model``): ``started_at``,
which each claim sets to its own ``now()``, and the attempt history, entry by entry (attempt,
start, end, relay, outcome, error): a failure appends ``failed`` (``timed out`` when drawn so)
or ``dead``, a release ``released``, the reaper ``lease expired`` or ``dead`` with its note;
completions append nothing, and redrive keeps what was there.

Determinism: every precondition and every draw depends only on the model, and only on what
in it follows from earlier draws, never on the database's clock or on an order the database
does not promise (hypothesis replays and extends examples by their draws; a draw or a set of
runnable rules that differs between two runs of one prefix is a ``FlakyStrategyDefinition``).
So the rules decide on the model's own clock, not on timestamps: which ready jobs are due
and their queue order come from the step whose transaction set ``run_at`` (a transient
failure with an hour's delay is not due), and which leases have run out from the pauses
(a ``lapsed`` flag, cleared by a claim or heartbeat), not from comparing ``lease_until`` with
``now()``. A worker holds the jobs of each claim in id order, not in the order of the claim
statement's ``RETURNING``, which changes with the plan and the heap layout (so with
(auto)vacuum and analyze timing, which is what varies under load); that order, and with it
which job got which fence, is not predicted. Each of these choices is checked against the database:
its clock gives the same due jobs in the same order and the same expired leases, and routing
gives a batch's jobs ids in (event, consumer) order.

Checked after every operation: its result equals the prediction (jobs claimed, the fences
they got, the ids completed or released, each failed job's new status, the fences still owned
after a heartbeat, reaper counts, ids redriven, routing counts and the (event, consumer) jobs
created); every row the operation must not change is identical, column by column, before
and after (in particular every row named only by stale claims). Checked after every step
(``@invariant``): every row equals the model; no two workers hold a valid claim on one job
(a claim is (job id, fence); valid while the row is running with that fence), and each
running job's valid claim is held by the worker in ``locked_by``; a done or dead job never
changes except through redrive; fences only grow (never lower on a row; a claim's fences
are the sequence's next values, above every earlier one, also when a completion shares the
statement; no two jobs carry one fence); ``0 <= attempts <= max_attempts``; status in the
known set; running rows, and only they, have a lease; done and dead rows, and only they,
have ``finished_at``.

The same machine runs a second time with ``retention_done = 0`` (``keep_done`` false): each
completion deletes the job's row in the statement that completes it, and the model drops the
job; stale claims of deleted jobs stay with their workers, and their reports must change
nothing.

Settings: ``max_examples=200`` (60 for the second run), scaled by the hypothesis profile
(tests/hypothesis_profiles.py), ``stateful_step_count=40``, ``deadline=None`` (database
round trips vary), ``database=None`` (no example database is written, so nothing lands in
the repository; a failure prints its steps). One database per test run (the ``engine``
fixture); each example empties the tables and restarts the identities and the fence
sequence (``DELETE`` and ``setval``, far cheaper than ``TRUNCATE``). Runtime (every example,
the ``thorough`` profile) on a 2-core
machine with other suites running: about 35 s against a local PostgreSQL 15, about 25 s
against the embedded server. A typical run makes some 8,000 operations: ~2,000 claims,
~300 complete-and-claims (~250 jobs completed and ~230 claimed by them, a third of them with
a limit of 0), ~300 reaper rounds that take jobs back, ~200 take-overs (a paused worker's
job re-claimed by another), ~300 dead-letterings, and ~450 stale reports (complete, fail,
release, heartbeat) against jobs reaped, dead, done or re-claimed, each of which must change
nothing.

A check that it catches bugs: with the fence test dropped from ``job_complete_many`` (from
its lock and its update; the update's alone is redundant with the lock's, and dropping it
changes nothing) it fails within the run (a paused worker's completion overwrote its
successor's claim), and so it does with the status test dropped from ``job_heartbeat_many``
(a stale heartbeat renewed the lease of a dead-lettered job). The same for the runner's
round (``job_complete_many`` then ``job_claim_after_many``): without the fence test in its
completion (lock and update) a paused worker's complete-and-claim completed a job another
worker had re-claimed; with its pick not testing ``status = 'ready'``, running jobs took
up the limit and it claimed too few; and with a limit of 0 passed as no limit (``LIMIT
NULL``) it claimed every due job. (The claim update's own ``j.status = 'ready'`` cannot be caught here: the
pick locked only rows that were ready in the same snapshot, so without concurrent writers
the recheck never filters anything.)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from outbox import Job, Outbox
from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_and_claim_jobs, complete_jobs, fail_jobs, heartbeat_jobs, release_jobs
from outbox.db.queries import HISTORY_KEPT
from outbox.db.tables import JOB_STATUSES
from outbox.relay import transaction
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure, format_error
from outbox.relay.relay import register_subscriptions
from outbox.relay.router import route_batch
from outbox.settings import OutboxSettings
from tests.hypothesis_profiles import examples

from .helpers import db_now, publish_events

TOPICS = {"t": ("c0", "c1"), "u": ("c2",), "x": ()}
CONSUMERS = ("c0", "c1", "c2")
LEASES = {"c0": 300.0, "c1": 450.0, "c2": 600.0}  # seconds; no lease runs out unless paused
WORKERS = {"w0": ("c0", "c1", "c2"), "w1": ("c0", "c1"), "w2": ("c1", "c2")}
FINISHED = ("done", "dead")
MAX_WORK = 6  # no publishing while this many events and jobs are open: the steps go to the lifecycle

# Every column the model predicts exactly (last_error is compared on its own).
COLUMNS = ("id", "event_id", "consumer", "status", "priority", "run_at", "attempts", "max_attempts",
           "lease_until", "fence", "locked_by", "created_at", "updated_at", "finished_at")

SETTINGS = settings(max_examples=examples(200), stateful_step_count=40, deadline=None, database=None)


@dataclasses.dataclass
class ModelJob:
    """What one job row must hold."""

    id: int
    event_id: int
    consumer: str
    priority: int
    max_attempts: int
    created_at: dt.datetime
    run_at: dt.datetime
    updated_at: dt.datetime
    status: str = "ready"
    attempts: int = 0
    fence: int = 0
    locked_by: str | None = None
    lease_until: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    last_error: str | re.Pattern[str] | None = None  # exact text, or the reaper's note as a pattern
    # Checked apart from COLUMNS (history_matches_the_model): the claim's now(), and the
    # attempts appended to outbox_jobs.history (error: exact text, or the reaper's pattern).
    started_at: dt.datetime | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Not columns: what the rules decide on instead of comparing database timestamps (see the
    # module docstring). run_step: the step whose transaction set run_at (None: an hour ahead,
    # not due in this example); lapsed: a pause moved the lease of this claim into the past.
    run_step: int | None = 0
    lapsed: bool = False

    def row(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c in COLUMNS}


def _reaper_note(m: ModelJob) -> re.Pattern[str]:
    return re.compile(
        rf"LeaseExpired: lease expired at .+ on attempt {m.attempts} of {m.max_attempts}"
        rf" \(worker {m.locked_by}, fence {m.fence}\)")


def _claim_key(job: Job) -> tuple[int, int]:
    return job.id, job.fence


class JobLifecycle(RuleBasedStateMachine):
    """Workers, reaper, redrive and router against the model; see the module docstring."""

    engine: sa.Engine  # set by the test
    keep_done: bool  # set by the test: False runs with retention_done = 0 (a completion deletes the job)

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:  # DELETE and setval: 20 times faster than TRUNCATE here
            for table in ("outbox_jobs", "outbox_events", "outbox_subscriptions"):
                conn.execute(sa.text(f"DELETE FROM {table}"))
            for sequence in ("pg_get_serial_sequence('outbox_jobs', 'id')",
                             "pg_get_serial_sequence('outbox_events', 'id')", "'outbox_fence_seq'"):
                conn.execute(sa.text(f"SELECT setval({sequence}, 1, false)"))
        self.jobs: dict[int, ModelJob] = {}
        self.unrouted: dict[int, str] = {}  # event id -> topic
        self.subs: dict[str, tuple[int, int]] = {}  # consumer -> (max_attempts, priority)
        self.held: dict[str, list[Job]] = {w: [] for w in WORKERS}  # claims each worker holds
        self.frozen: dict[int, dict[str, Any]] = {}  # done and dead rows as they must stay
        self.deleted: set[int] = set()  # jobs whose completion deleted them (keep_done False)
        self.max_fence = 0  # highest fence handed out so far
        self.fence_seen: dict[int, int] = {}
        self.errors = 0
        self.redeclared = 0
        self.step = 0  # transactions run so far: the model's clock, ticking with the database's
        self._rows: dict[int, dict[str, Any]] | None = {}

    # ------------------------------------------------------------------ plumbing

    def rows(self) -> dict[int, dict[str, Any]]:
        """Every job row, by id (cached until the next operation)."""
        if self._rows is None:
            with self.engine.connect() as conn:
                self._rows = {r["id"]: dict(r) for r in conn.execute(sa.text("SELECT * FROM outbox_jobs")).mappings()}
        return self._rows

    def run(self, op: Callable[[sa.Connection, dt.datetime], Any]) -> tuple[Any, dt.datetime, dict, dict]:
        """Run ``op(conn, now)`` in a transaction of its own; returns its value, the
        transaction's ``now()`` and the job rows before and after."""
        before = self.rows()
        self.step += 1
        with self.engine.begin() as conn:
            now = db_now(conn)
            value = op(conn, now)
        self._rows = None
        return value, now, before, self.rows()

    def assert_only_changed(self, before: dict, after: dict, changed: Iterable[int], what: str,
                            stale: Iterable[int] = ()) -> None:
        """Rows outside ``changed`` are identical before and after; ``stale`` (ids named
        only by stale claims) get their own message."""
        changed, stale = set(changed), set(stale)
        assert set(before) - set(after) <= changed & self.deleted, f"{what}: rows disappeared"
        for job_id, row in before.items():
            if job_id not in changed:
                how = " with a stale fence" if job_id in stale else ""
                assert after[job_id] == row, f"{what}{how} changed job {job_id}: {row} -> {after[job_id]}"

    def valid(self, job: Job) -> bool:
        m = self.jobs.get(job.id)  # None: its completion deleted it
        return m is not None and m.status == "running" and m.fence == job.fence

    def pick(self, data: st.DataObject, worker: str, min_size: int = 1) -> list[Job]:
        """A subset of ``worker``'s claims (non-empty unless ``min_size`` is 0), which it
        stops holding."""
        held = self.held[worker]
        indexes = data.draw(st.lists(st.sampled_from(range(len(held))), min_size=min_size, max_size=len(held),
                                     unique=True), label=f"claims of {worker}")
        batch = [held[i] for i in indexes]
        self.held[worker] = [j for i, j in enumerate(held) if i not in indexes]
        return batch

    def stale_ids(self, batch: list[Job]) -> set[int]:
        """Jobs named in ``batch`` by stale claims only."""
        return {j.id for j in batch} - {j.id for j in batch if self.valid(j)}

    def freeze(self, after: dict, ids: Iterable[int]) -> None:
        for job_id in ids:
            if job_id not in self.deleted:
                self.frozen[job_id] = after[job_id]

    def open_work(self) -> int:
        """Unrouted events plus ready and running jobs (with nothing open, publish is
        possible, so some rule always is)."""
        return len(self.unrouted) + sum(1 for m in self.jobs.values() if m.status in ("ready", "running"))

    def holding(self) -> list[str]:
        """Workers holding claims."""
        return [w for w in WORKERS if self.held[w]]

    def owning(self) -> list[str]:
        """Workers holding at least one valid claim."""
        return [w for w in WORKERS if any(self.valid(j) for j in self.held[w])]

    # --------------------------------------------------------------- the world

    @initialize(max_attempts=st.tuples(*[st.integers(1, 3)] * len(CONSUMERS)),
                priorities=st.tuples(*[st.integers(0, 1)] * len(CONSUMERS)),
                first=st.integers(1, 6))
    def subscribe_and_publish(self, max_attempts: tuple[int, ...], priorities: tuple[int, ...], first: int) -> None:
        ob = Outbox()
        for topic, consumers in TOPICS.items():
            for c in consumers:
                i = CONSUMERS.index(c)
                self.subs[c] = (max_attempts[i], priorities[i])
                ob.subscriber(topic, consumer=c, max_attempts=max_attempts[i], priority=priorities[i],
                              lease=LEASES[c])(lambda job: None)
        register_subscriptions(self.engine, ob, OutboxSettings(_env_file=None))
        self.publish(topic="t", n=first)
        self.route(limit=first)

    @precondition(lambda self: self.redeclared < 2)  # else swarm testing can fill examples with it
    @rule(consumer=st.sampled_from(CONSUMERS), max_attempts=st.integers(1, 3), priority=st.integers(0, 1))
    def redeclare(self, consumer: str, max_attempts: int, priority: int) -> None:
        """A relay starts with new options for ``consumer``: jobs routed from now on get them,
        jobs that exist keep theirs."""
        self.redeclared += 1
        [topic] = [t for t, consumers in TOPICS.items() if consumer in consumers]
        ob = Outbox()
        ob.subscriber(topic, consumer=consumer, max_attempts=max_attempts, priority=priority,
                      lease=LEASES[consumer])(lambda job: None)
        before = self.rows()
        register_subscriptions(self.engine, ob, OutboxSettings(_env_file=None))
        self.subs[consumer] = (max_attempts, priority)
        with self.engine.connect() as conn:
            subs = {r.consumer: (r.topic, r.max_attempts, r.priority)
                    for r in conn.execute(queries.subscription_list)}
        assert subs == {c: (t, *self.subs[c]) for t, cs in TOPICS.items() for c in cs}
        self._rows = None
        self.assert_only_changed(before, self.rows(), (), "redeclare")

    @precondition(lambda self: self.open_work() < MAX_WORK)
    @rule(topic=st.sampled_from(sorted(TOPICS)), n=st.integers(1, 3))
    def publish(self, topic: str, n: int) -> None:
        before = self.rows()
        ids = publish_events(self.engine, topic, [{"n": i, "quote": "it's \"x\"; --"} for i in range(n)])
        assert len(ids) == n and len(set(ids)) == n
        assert not set(ids) & set(self.unrouted)
        self.unrouted.update(dict.fromkeys(ids, topic))
        self._rows = None
        self.assert_only_changed(before, self.rows(), (), "publish")

    @precondition(lambda self: self.unrouted)
    @rule(limit=st.integers(1, 4))
    def route(self, limit: int) -> None:
        result, now, before, after = self.run(lambda conn, now: route_batch(conn, limit))
        batch = sorted(self.unrouted)[:limit]
        pairs = {(e, c) for e in batch for c in TOPICS[self.unrouted[e]]}
        assert (result.events, result.jobs, result.unsubscribed) == (
            len(batch), len(pairs), sum(1 for e in batch if not TOPICS[self.unrouted[e]]))
        new = {i: after[i] for i in sorted(set(after) - set(before))}
        assert {(r["event_id"], r["consumer"]) for r in new.values()} == pairs and len(new) == len(pairs)
        # Which job gets which id decides claim order among equals, so it must not vary from
        # one replay to the next: the statement inserts in (event, consumer) order.
        assert [(r["event_id"], r["consumer"]) for r in new.values()] == sorted(pairs), "route: job id order"
        for job_id, row in new.items():
            max_attempts, priority = self.subs[row["consumer"]]
            self.jobs[job_id] = ModelJob(id=job_id, event_id=row["event_id"], consumer=row["consumer"],
                                         priority=priority, max_attempts=max_attempts,
                                         created_at=now, run_at=now, updated_at=now, run_step=self.step)
        for e in batch:
            del self.unrouted[e]
        with self.engine.connect() as conn:
            unrouted = set(conn.execute(sa.text("SELECT id FROM outbox_events WHERE routed_at IS NULL")).scalars())
        assert unrouted == set(self.unrouted)
        self.assert_only_changed(before, after, (), "route")

    # ---------------------------------------------------------------- workers

    @precondition(lambda self: any(m.status == "ready" for m in self.jobs.values()))
    @rule(worker=st.sampled_from(sorted(WORKERS)), limit=st.integers(1, 3))
    def claim(self, worker: str, limit: int) -> None:
        self.claim_as(worker, limit)

    def claim_as(self, worker: str, limit: int) -> None:
        leases = {c: LEASES[c] for c in WORKERS[worker]}

        def op(conn: sa.Connection, now: dt.datetime) -> tuple[list[Job], int]:
            next_fence = self.next_fence(conn)
            return claim_jobs(conn, leases, limit, worker), next_fence

        (jobs, next_fence), now, before, after = self.run(op)
        jobs = self.take_claims(worker, jobs, self.expect_claim(worker, limit, now), next_fence, now, "claim")
        self.assert_only_changed(before, after, {j.id for j in jobs}, "claim")

    @staticmethod
    def next_fence(conn: sa.Connection) -> int:
        """The value ``nextval('outbox_fence_seq')`` returns next (in ``conn``'s transaction)."""
        last, called = conn.execute(sa.text("SELECT last_value, is_called FROM outbox_fence_seq")).one()
        return last + 1 if called else last

    def expect_claim(self, worker: str, limit: int, now: dt.datetime) -> list[int]:
        """Ids of the jobs a claim of up to ``limit`` by ``worker`` takes, run at ``now`` on
        the model's current state: its due ready jobs in queue order."""
        consumers = WORKERS[worker]
        # Due and queue order from the model's steps; the same from the database clock, or
        # the model's clock has lost step with it (e.g. the clock stepped back).
        due = sorted((m for m in self.jobs.values()
                      if m.status == "ready" and m.consumer in consumers and m.run_step is not None),
                     key=lambda m: (m.priority, m.run_step, m.id))
        by_clock = sorted((m for m in self.jobs.values()
                           if m.status == "ready" and m.consumer in consumers and m.run_at <= now),
                          key=lambda m: (m.priority, m.run_at, m.id))
        assert [m.id for m in by_clock] == [m.id for m in due], "due jobs: database clock != model steps"
        return [m.id for m in due[:limit]]

    def take_claims(self, worker: str, jobs: list[Job], expected: list[int], next_fence: int,
                    now: dt.datetime, what: str) -> list[Job]:
        """Check the jobs a claim returned against ``expected`` (``expect_claim``) and the
        fence sequence's next value before it ran, record them in the model and give them
        to ``worker``; returns them in id order."""
        assert sorted(j.id for j in jobs) == sorted(expected), f"{what} of {worker}: claimed the wrong jobs"
        # RETURNING order (so which job got which fence) varies with the plan and the heap
        # layout, which vacuum timing changes: the worker holds its claims in id order, which
        # the model knows, so that the claims a later draw picks by index are the same ones on
        # every replay.
        jobs = sorted(jobs, key=lambda j: j.id)
        assert sorted(j.fence for j in jobs) == list(range(next_fence, next_fence + len(jobs))), f"{what}: fences"
        assert all(j.fence > self.max_fence for j in jobs), f"{what} reused a fence"
        for job in jobs:
            m = self.jobs[job.id]
            assert (job.event_id, job.consumer, job.attempt, job.max_attempts, job.lease_seconds) == (
                m.event_id, m.consumer, m.attempts + 1, m.max_attempts, LEASES[m.consumer])
            m.status, m.attempts, m.fence, m.locked_by = "running", m.attempts + 1, job.fence, worker
            m.started_at = now
            m.lease_until, m.updated_at, m.lapsed = now + dt.timedelta(seconds=LEASES[m.consumer]), now, False
            self.max_fence = max(self.max_fence, job.fence)
        self.held[worker].extend(jobs)
        return jobs

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        batch = self.pick(data, worker)
        self.held[worker].extend(batch)  # a heartbeat finishes nothing: the worker keeps its claims
        owned, now, before, after = self.run(lambda conn, now: heartbeat_jobs(conn, batch))
        valid = [j for j in batch if self.valid(j)]
        assert owned == {j.fence for j in valid}, f"heartbeat of {worker}: owned fences"
        for job in valid:
            m = self.jobs[job.id]
            m.lease_until, m.updated_at, m.lapsed = now + dt.timedelta(seconds=job.lease_seconds), now, False
        self.assert_only_changed(before, after, {j.id for j in valid}, "heartbeat", self.stale_ids(batch))

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        batch = self.pick(data, worker)
        stale = self.stale_ids(batch)
        done, now, before, after = self.run(lambda conn, now: complete_jobs(conn, batch, keep_done=self.keep_done))
        expected = self.expect_complete(batch)
        assert done == expected, f"complete of {worker}"
        self.mark_done(expected, now)
        self.assert_only_changed(before, after, expected, "complete", stale)
        self.freeze(after, expected)

    def expect_complete(self, batch: list[Job]) -> set[int]:
        """Ids a fenced completion of ``batch`` marks done: those of its valid claims."""
        return {j.id for j in batch if self.valid(j)}

    @staticmethod
    def ended(m: ModelJob, now: dt.datetime, outcome: str, error: str | re.Pattern[str] | None) -> None:
        """The running attempt of ``m`` ended at ``now`` other than as done: its entry is
        appended to the history (the newest ``HISTORY_KEPT`` kept). Called before the
        attempt count or the relay of ``m`` change."""
        m.history = [*m.history, {"attempt": m.attempts, "started_at": m.started_at, "ended_at": now,
                                  "relay": m.locked_by, "outcome": outcome, "error": error}][-HISTORY_KEPT:]

    def mark_done(self, ids: Iterable[int], now: dt.datetime) -> None:
        """The jobs ``ids`` completed at ``now``: done, or gone when done jobs are not kept."""
        for job_id in ids:
            if not self.keep_done:
                del self.jobs[job_id]
                self.deleted.add(job_id)
                continue
            m = self.jobs[job_id]
            m.status, m.lease_until, m.finished_at, m.updated_at = "done", None, now, now

    @precondition(lambda self: self.holding())
    @rule(data=st.data(), limit=st.integers(0, 3))
    def complete_and_claim(self, data: st.DataObject, limit: int) -> None:
        """The runner's hot round (``complete_and_claim_jobs``: ``job_complete_many`` then
        ``job_claim_after_many``): a subset of a worker's claims (current or stale) marked done
        and up to ``limit`` more jobs claimed, in one transaction. The claim takes what a claim
        alone would have taken just before: the jobs being completed were running before and
        are finished when the claim starts, so they are never among them; nothing when
        ``limit`` is 0."""
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        batch = self.pick(data, worker, min_size=0)  # none: the runner only wants more jobs
        stale = self.stale_ids(batch)
        leases = {c: LEASES[c] for c in WORKERS[worker]}

        def op(conn: sa.Connection, now: dt.datetime) -> tuple[tuple[set[int], list[Job]], int]:
            next_fence = self.next_fence(conn)
            return complete_and_claim_jobs(conn, batch, leases, limit, worker, keep_done=self.keep_done), next_fence

        ((done, jobs), next_fence), now, before, after = self.run(op)
        expected_done = self.expect_complete(batch)
        expected_claim = self.expect_claim(worker, limit, now)  # the model before the statement
        assert not expected_done & set(expected_claim)
        assert done == expected_done, f"complete_and_claim of {worker}: completed"
        assert not done & {j.id for j in jobs}, f"complete_and_claim of {worker} claimed a job it completed"
        self.mark_done(expected_done, now)
        jobs = self.take_claims(worker, jobs, expected_claim, next_fence, now, "complete_and_claim")
        claimed = {j.id for j in jobs}
        self.assert_only_changed(before, after, expected_done | claimed, "complete_and_claim", stale - claimed)
        self.freeze(after, expected_done)

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def complete_in_handler_transaction(self, data: st.DataObject) -> None:
        """A transactional handler's ending: ``job_complete`` for one claim, committed only if
        it matched a row, else rolled back (with the handler's writes)."""
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        held = self.held[worker]
        job = held.pop(data.draw(st.integers(0, len(held) - 1), label="claim"))
        valid = self.valid(job)
        before = self.rows()
        self.step += 1
        with self.engine.connect() as conn:
            tx = conn.begin()
            now = db_now(conn)
            transaction.set_limits(conn, job.lease_seconds, job.fence)  # the handler transaction's first statement
            count = conn.execute(queries.job_complete, {"id": job.id, "fence": job.fence,
                                                        "keep_done": self.keep_done}).one().completed
            if count == 1:
                tx.commit()
            else:
                tx.rollback()
        self._rows = None
        after = self.rows()
        assert count == (1 if valid else 0), f"job_complete of {worker} for job {job.id} fence {job.fence}"
        if valid:
            self.mark_done([job.id], now)
        self.assert_only_changed(before, after, {job.id} if valid else (), "job_complete",
                                 () if valid else {job.id})
        if valid:
            self.freeze(after, [job.id])

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        batch = self.pick(data, worker)
        failures = []
        for job in batch:
            permanent = data.draw(st.booleans(), label=f"permanent {job.id}")
            delay = data.draw(st.sampled_from([0.0, 0.0, 0.0, 3600.0]), label=f"delay {job.id}")
            timed_out = data.draw(st.booleans(), label=f"timed out {job.id}")
            self.errors += 1
            text = format_error(RuntimeError(f"failure {self.errors} of {worker}: 'q' \"dq\"; --\x00 \udcff ✓"))
            failures.append((job, Failure(delay=delay, permanent=permanent, error=text, timed_out=timed_out)))
        stale = self.stale_ids(batch)
        statuses, now, before, after = self.run(lambda conn, now: fail_jobs(conn, failures))
        expected = {}
        for job, failure in failures:
            if not self.valid(job):
                continue
            m = self.jobs[job.id]
            dead = failure.permanent or m.attempts >= m.max_attempts
            expected[job.id] = "dead" if dead else "ready"
            self.ended(m, now, "dead" if dead else "timed out" if failure.timed_out else "failed", failure.error)
            m.status, m.lease_until, m.last_error, m.updated_at = expected[job.id], None, failure.error, now
            if dead:
                m.finished_at = now
            else:
                m.run_at, m.finished_at = now + dt.timedelta(seconds=failure.delay), None
                m.run_step = self.step if failure.delay == 0 else None
        assert statuses == expected, f"fail of {worker}"
        self.assert_only_changed(before, after, expected, "fail", stale)
        self.freeze(after, [i for i, s in expected.items() if s == "dead"])

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self.holding()), label="worker")
        batch = self.pick(data, worker)
        stale = self.stale_ids(batch)
        released, now, before, after = self.run(lambda conn, now: release_jobs(conn, batch))
        expected = {j.id for j in batch if self.valid(j)}
        assert released == expected, f"release of {worker}"
        for job_id in expected:
            m = self.jobs[job_id]
            self.ended(m, now, "released", None)  # no relay lists it as buffered: a started attempt
            # run_at is kept: the job was due when claimed, so it goes back to the head of the queue.
            m.status, m.attempts, m.lease_until, m.updated_at = "ready", m.attempts - 1, None, now
        self.assert_only_changed(before, after, expected, "release", stale)

    @precondition(lambda self: self.owning())
    @rule(data=st.data(), then=st.sampled_from(["", "reap", "reap and claim"]))
    def pause(self, data: st.DataObject, then: str) -> None:
        """The worker stops (SIGSTOP, a long GC pause) past its leases: ``lease_until`` of the
        jobs it still owns moves one second into the past. It keeps its claims, and acts again
        whenever hypothesis next picks it: before the reaper ran (a heartbeat or a finish
        still wins), or after the reaper took the jobs back and other workers re-claimed them
        (every report of its is stale). ``then``: while it is paused, a reaper runs, and maybe
        another worker claims (each in its own transaction, invariants checked after each),
        so that a take-over does not always need a long chain of steps."""
        worker = data.draw(st.sampled_from(self.owning()), label="worker")
        owned = [j for j in self.held[worker] if self.valid(j)]

        def op(conn: sa.Connection, now: dt.datetime) -> None:
            for job in owned:
                conn.execute(sa.text(
                    "UPDATE outbox_jobs SET lease_until = now() - interval '1 second'"
                    " WHERE id = :id AND fence = :fence AND status = 'running'"), {"id": job.id, "fence": job.fence})

        _, now, before, after = self.run(op)
        for job in owned:
            self.jobs[job.id].lease_until, self.jobs[job.id].lapsed = now - dt.timedelta(seconds=1), True
        self.assert_only_changed(before, after, {j.id for j in owned}, "pause")
        if then:
            self.check_invariants_now()
            self.reap()
        taken = [self.jobs[j.id] for j in owned if self.jobs[j.id].status == "ready"]
        claimers = sorted(w for w in WORKERS if w != worker and any(m.consumer in WORKERS[w] for m in taken))
        if then == "reap and claim" and claimers:
            # Another worker claims until it has one of the jobs taken back (they queue last).
            claimer = data.draw(st.sampled_from(claimers), label="claimer")
            for _ in range(3):
                self.check_invariants_now()
                self.claim_as(claimer, 3)
                if any(m.status == "running" for m in taken):
                    break

    # ------------------------------------------------------------ maintenance

    @precondition(lambda self: any(m.status == "running" and m.lapsed for m in self.jobs.values()))
    @rule()
    def reap(self) -> None:
        """The reaper, whenever some lease has run out (the jobs with live leases must stay).
        Which ones have: those a pause made lapse, and by the database clock the same ones."""
        result, now, before, after = self.run(lambda conn, now: reap_expired(conn))
        expired = [m for m in self.jobs.values() if m.status == "running" and m.lapsed]
        by_clock = [m for m in self.jobs.values() if m.status == "running" and m.lease_until < now]
        assert by_clock == expired, "expired leases: database clock != pauses"
        dead = [m for m in expired if m.attempts >= m.max_attempts]
        assert (result.retried, result.dead) == (len(expired) - len(dead), len(dead)), "reaper counts"
        for m in expired:
            m.last_error = _reaper_note(m)
            self.ended(m, now, "dead" if m in dead else "lease expired", m.last_error)
            m.status = "dead" if m in dead else "ready"
            m.run_at, m.lease_until, m.updated_at, m.run_step, m.lapsed = now, None, now, self.step, False
            m.finished_at = now if m in dead else None
        self.assert_only_changed(before, after, {m.id for m in expired}, "reap")
        self.freeze(after, [m.id for m in dead])

    @precondition(lambda self: any(m.status == "dead" for m in self.jobs.values()))
    @rule(data=st.data(), how=st.sampled_from(["ids", "consumer", "ids and consumer", "all"]))
    def redrive_dead(self, data: st.DataObject, how: str) -> None:
        ids: list[int] | None = None
        consumer: str | None = None
        if "ids" in how:
            ids = data.draw(st.lists(st.sampled_from(sorted(self.jobs)), max_size=4, unique=True), label="ids")
        if "consumer" in how:
            consumer = data.draw(st.sampled_from(CONSUMERS), label="consumer")
        got, now, before, after = self.run(lambda conn, now: list(conn.execute(
            queries.in_schema().job_redrive_many, {"ids": ids, "consumer": consumer}).scalars()))
        expected = {m.id for m in self.jobs.values() if m.status == "dead"
                    and (ids is None or m.id in ids) and (consumer is None or m.consumer == consumer)}
        assert sorted(got) == sorted(expected), f"redrive ids={ids} consumer={consumer}"
        for job_id in expected:
            m = self.jobs[job_id]
            m.status, m.attempts, m.run_at, m.finished_at, m.updated_at = "ready", 0, now, None, now
            m.run_step = self.step
            del self.frozen[job_id]
        self.assert_only_changed(before, after, expected, "redrive")

    # ------------------------------------------------------------- invariants

    def check_invariants_now(self) -> None:
        """Every invariant, between the operations of one step."""
        self.rows_match_the_model()
        self.at_most_one_valid_claim_per_job()
        self.finished_jobs_never_change()
        self.fences_only_grow()
        self.rows_are_well_formed()

    @invariant()
    def rows_match_the_model(self) -> None:
        rows = self.rows()
        assert set(rows) == set(self.jobs), "job ids differ from the model"
        for job_id, m in self.jobs.items():
            row = rows[job_id]
            assert {c: row[c] for c in COLUMNS} == m.row(), f"job {job_id}: database != model"
            if isinstance(m.last_error, re.Pattern):
                assert m.last_error.fullmatch(row["last_error"] or ""), f"job {job_id}: {row['last_error']!r}"
            else:
                assert row["last_error"] == m.last_error, f"job {job_id}: last_error"

    @invariant()
    def history_matches_the_model(self) -> None:
        """``started_at`` and the attempt history, apart from COLUMNS: every field of every
        entry predicted (the reaper's error as a pattern)."""
        rows = self.rows()
        for job_id, m in self.jobs.items():
            row = rows[job_id]
            assert row["started_at"] == m.started_at, f"job {job_id}: started_at"
            stored = row["history"] or []
            assert (row["history"] is None) == (not m.history), f"job {job_id}: history written for no attempt"
            assert len(stored) == len(m.history), f"job {job_id}: history {stored} != model {m.history}"
            for got, want in zip(stored, m.history, strict=True):
                times = {k: dt.datetime.fromisoformat(got[k]) if got[k] else None for k in ("started_at", "ended_at")}
                error = want["error"]
                assert {**got, **times, "error": None} == {**want, "error": None}, f"job {job_id}: {got} != {want}"
                if isinstance(error, re.Pattern):
                    assert error.fullmatch(got["error"] or ""), f"job {job_id}: history error {got['error']!r}"
                else:
                    assert got["error"] == error, f"job {job_id}: history error"

    @invariant()
    def at_most_one_valid_claim_per_job(self) -> None:
        rows = self.rows()
        holders: dict[int, list[str]] = defaultdict(list)
        for worker, claims in self.held.items():
            assert len({_claim_key(j) for j in claims}) == len(claims), f"{worker} holds a claim twice"
            for job in claims:
                row = rows.get(job.id)  # None: a stale claim of a job another worker's completion deleted
                if row is not None and row["status"] == "running" and row["fence"] == job.fence:
                    holders[job.id].append(worker)
        for job_id, row in rows.items():
            if row["status"] == "running":
                assert holders[job_id] == [row["locked_by"]], f"job {job_id} valid claims held by {holders[job_id]}"
            else:
                assert not holders[job_id], f"job {job_id} is {row['status']} but claimed by {holders[job_id]}"

    @invariant()
    def finished_jobs_never_change(self) -> None:
        rows = self.rows()
        for job_id, row in self.frozen.items():
            assert rows[job_id] == row, f"{row['status']} job {job_id} changed without a redrive: {rows[job_id]}"

    @invariant()
    def fences_only_grow(self) -> None:
        rows = self.rows()
        for job_id, row in rows.items():
            assert row["fence"] >= self.fence_seen.get(job_id, 0), f"job {job_id}: fence went down"
            self.fence_seen[job_id] = row["fence"]
        claimed = [row["fence"] for row in rows.values() if row["fence"]]
        assert len(claimed) == len(set(claimed)), "two jobs carry the same fence"
        assert max(claimed, default=0) <= self.max_fence

    @invariant()
    def rows_are_well_formed(self) -> None:
        for job_id, row in self.rows().items():
            assert row["status"] in JOB_STATUSES, f"job {job_id}: status {row['status']!r}"
            assert 0 <= row["attempts"] <= row["max_attempts"], f"job {job_id}: attempts {row['attempts']}"
            assert (row["status"] == "running") == (row["lease_until"] is not None), f"job {job_id}: lease"
            assert (row["status"] in FINISHED) == (row["finished_at"] is not None), f"job {job_id}: finished_at"


def test_job_lifecycle_matches_the_model(engine):
    machine = type("JobLifecycleOnThisDatabase", (JobLifecycle,), {"engine": engine, "keep_done": True})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_job_lifecycle_deleting_done_jobs_matches_the_model(engine):
    """``retention_done = 0``: every completion deletes the job's row in the statement that
    completes it (the model drops the job), and every other guarantee holds as with done
    rows kept; a stale completion of a deleted job changes nothing. Fewer examples: the
    rules are the same, only the completions differ."""
    machine = type("JobLifecycleDeletingDone", (JobLifecycle,), {"engine": engine, "keep_done": False})
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=examples(60)))
