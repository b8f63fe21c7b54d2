"""Model-based test of ordering, poison policies and flow control (issue 10): a hypothesis
``RuleBasedStateMachine`` drives publish, routing, the relay's two claim paths, outcomes,
reaping, redrive, skip, pause and resume on a real PostgreSQL in any order it likes, and
checks the invariants of the architecture notes ("Ordering", "Flow control") after every
step. It complements :mod:`tests.integration.test_lifecycle_model`, which predicts every
column of every job for unordered consumers; here the checks are the invariants, read
from the database, so promotion (which job becomes the head, and when) is not modelled.

The world of one example: topic ``t`` with three consumers: ``ob`` (ordered, a dead job
blocks its key), ``os`` (ordered, a dead job is skipped) and ``cap`` (unordered, at most
two running jobs across all relays: claimed on the flow-control path). Events carry one
of the keys ``k0``..``k2`` or none. Two simulated relays ``r0`` and ``r1`` share one engine,
each operation its own transaction, as separate processes would be. Hypothesis
interleaves:

* publishing an event (its own transaction) and routing up to 1..4 events;
* a relay claiming 1..3 jobs by the main claim (``claim_jobs``, ``ob`` and ``os``) or by
  the limited claim (``FlowControl.claim``, ``cap``);
* a relay completing, failing (transient: ready again at once; or permanent) or snoozing
  (``Snooze(0)``: ready again at once, the attempt given back) one of its claims, then, as
  the relay's completer does once they committed, promoting the ordered keys of that job;
* lapsing a relay's leases (``lease_until`` moved into the past with SQL) and reaping,
  followed by the maintenance sweep of left-pending heads, as the relay's reaper loop does;
* redriving dead jobs, skipping a blocked key (``outbox-relay skip``), pausing and resuming
  a consumer.

Invariants after every step:

* never two running jobs of one (ordered consumer, ordering key);
* per (ordered consumer, ordering key), the unfinished jobs (status not done) in event
  order: only the first may be ready, running or dead; every later one is pending. So a job
  starts only when every earlier job of its key is done, or dead and let go (skip policy,
  or skipped: it no longer holds the key);
* no key is stuck: that first unfinished job is never pending (promotion or the sweep made
  it ready);
* claims of one key come in event order: a claim never takes a job whose key (at claim
  time) had a later event's job claimed before (a retry of the same job is fine);
* the cap is never exceeded: at most two ``cap`` jobs are running;
* a paused consumer has no job claimed while paused;
* a snooze gives the attempt back: attempts after a snooze equal attempts before the
  claim, and ``snoozes`` counts the snoozes.

Draws are indexes into lists the run builds (taken modulo their length), never strategies
whose shape depends on what the database returned, so a replayed example draws the same.
Rate limits are left out: a token bucket refills on the database clock, which would make
claims depend on elapsed time (tests/integration/test_flow_control.py covers them).

A second run repeats it with ``retention_done = 0``: each completion deletes its job.

Settings: ``max_examples=150`` (40 for the second run), scaled by the hypothesis profile
(tests/hypothesis_profiles.py), ``stateful_step_count=40``, ``deadline=None``, ``database=None`` (no example database lands in the repository).
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from outbox import Job, Outbox, publish
from outbox.admin import redrive, skip_dead_job
from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs, snooze_jobs
from outbox.errors import NotBlockingError
from outbox.relay.flow import FlowControl
from outbox.relay.maintenance import reap_expired
from outbox.relay.ordering import HeadSweeper, promote_finished
from outbox.relay.outcomes import Failure, Snoozed
from outbox.relay.router import register_subscriptions, route_batch
from outbox.settings import OutboxSettings
from tests.hypothesis_profiles import examples

TOPIC = "t"
ORDERED = ("ob", "os")
CAP = 2
KEYS = ("k0", "k1", "k2", None)
RELAYS = ("r0", "r1")
LEASE = 300.0
SETTINGS = settings(max_examples=examples(150), stateful_step_count=40, deadline=None, database=None)

INDEX = st.integers(min_value=0, max_value=10**6)


def _registry() -> Outbox:
    ob = Outbox()

    @ob.subscriber(TOPIC, consumer="ob", ordered=True, max_attempts=2)
    def blocking(job: Job) -> None: ...

    @ob.subscriber(TOPIC, consumer="os", ordered=True, on_dead="skip", max_attempts=2)
    def skipping(job: Job) -> None: ...

    @ob.subscriber(TOPIC, consumer="cap", concurrency=CAP, max_attempts=2)
    def capped(job: Job) -> None: ...

    return ob


class OrderingFlow(RuleBasedStateMachine):
    """Two relays, routing, both claim paths, outcomes and operators; see the module notes."""

    engine: sa.Engine  # set by the test
    keep_done: bool = True  # False: retention_done = 0, a completion deletes its job

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:
            for table in ("outbox_jobs", "outbox_events", "outbox_subscriptions", "outbox_consumers"):
                conn.execute(sa.text(f"DELETE FROM {table}"))
        self.registry = _registry()
        self.subscribers = {s.consumer: s for s in self.registry}
        register_subscriptions(self.engine, self.registry, OutboxSettings(_env_file=None, default_lease=LEASE))
        self.held: dict[str, list[Job]] = {r: [] for r in RELAYS}
        self.flows = {r: FlowControl(self.subscribers, {c: LEASE for c in self.subscribers}, r, 1.0)
                      for r in RELAYS}
        self.paused: set[str] = set()
        # (consumer, ordering key) -> event ids claimed, in claim order
        self.claimed_order: dict[tuple[str, str], list[int]] = {}
        self.attempts_before: dict[int, int] = {}  # job id -> attempts before its current claim
        self.snoozes: dict[int, int] = {}
        self.sweeper = HeadSweeper()
        self.conninfo = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.connections: dict[str, psycopg.Connection[Any]] = {}

    # ------------------------------------------------------------------ helpers

    def teardown(self) -> None:
        for conn in self.connections.values():
            conn.close()

    def _ordering_keys(self, ids: list[int]) -> dict[int, str | None]:
        with self.engine.connect() as c:
            return {r.id: r.ordering_key for r in c.execute(
                sa.text("SELECT id, ordering_key FROM outbox_jobs WHERE id = ANY(:ids)"), {"ids": ids})}

    def _took(self, relay: str, jobs: list[Job]) -> None:
        for job in jobs:
            assert job.consumer not in self.paused, f"job {job.id} of paused consumer {job.consumer} was claimed"
        keys = self._ordering_keys([j.id for j in jobs])
        for job in sorted(jobs, key=lambda j: j.event_id):
            self.attempts_before[job.id] = job.attempt - 1
            key = keys[job.id]
            if key is not None:
                seen = self.claimed_order.setdefault((job.consumer, key), [])
                assert not seen or seen[-1] <= job.event_id, (
                    f"{job.consumer} key {key}: event {job.event_id} claimed after {seen}")
                if not seen or seen[-1] != job.event_id:
                    seen.append(job.event_id)
        self.held[relay] += jobs

    def _promote(self, jobs: list[Job]) -> None:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            promote_finished(conn, jobs, self.subscribers)

    def _pick(self, relay: str, index: int) -> Job:
        return self.held[relay].pop(index % len(self.held[relay]))

    # -------------------------------------------------------------------- rules

    @rule(key=st.sampled_from(KEYS))
    def publish_event(self, key: str | None) -> None:
        with self.engine.begin() as conn:
            publish(conn, TOPIC, {"k": key}, key=key)

    @rule(limit=st.integers(1, 4))
    def route(self, limit: int) -> None:
        with self.engine.begin() as conn:
            route_batch(conn, limit)

    @rule(relay=st.sampled_from(RELAYS), limit=st.integers(1, 3))
    def claim_main(self, relay: str, limit: int) -> None:
        with self.engine.begin() as conn:
            jobs = claim_jobs(conn, {c: LEASE for c in ORDERED}, limit, relay)
        self._took(relay, jobs)

    @rule(relay=st.sampled_from(RELAYS), limit=st.integers(1, 3))
    def claim_limited(self, relay: str, limit: int) -> None:
        from outbox.db.jobs import job_from_row

        if relay not in self.connections:  # the dispatcher's own autocommit connection
            self.connections[relay] = psycopg.connect(self.conninfo, autocommit=True)
        rows = self.flows[relay].claim(self.connections[relay], limit, None, 0)
        self._took(relay, [job_from_row(r, LEASE) for r in rows])

    @rule(relay=st.sampled_from(RELAYS), index=INDEX, how=st.sampled_from(("done", "retry", "dead", "snooze")))
    def finish(self, relay: str, index: int, how: str) -> None:
        if not self.held[relay]:
            return
        job = self._pick(relay, index)
        with self.engine.begin() as conn:
            if how == "done":
                changed = bool(complete_jobs(conn, [job], keep_done=self.keep_done))
            elif how == "snooze":
                changed = bool(snooze_jobs(conn, [(job, Snoozed(0.0))]))
            else:
                changed = bool(fail_jobs(conn, [(job, Failure(0.0, how == "dead", f"{how} on purpose"))]))
        if changed and how == "snooze":
            self.snoozes[job.id] = self.snoozes.get(job.id, 0) + 1
            with self.engine.connect() as c:
                attempts, snoozes = c.execute(sa.text("SELECT attempts, snoozes FROM outbox_jobs WHERE id = :id"),
                                              {"id": job.id}).one()
            assert attempts == self.attempts_before[job.id], f"a snooze counted an attempt of job {job.id}"
            assert snoozes == self.snoozes[job.id]
        self._promote([job])

    @rule(relay=st.sampled_from(RELAYS))
    def lapse_and_reap(self, relay: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second'"
                                 " WHERE status = 'running' AND locked_by = :r"), {"r": relay})
        with self.engine.begin() as conn:
            reap_expired(conn)
        with self.engine.begin() as conn:
            self.sweeper.sweep(conn)

    @rule(relay=st.sampled_from(RELAYS))
    def sweep(self, relay: str) -> None:
        with self.engine.begin() as conn:
            self.sweeper.sweep(conn)

    @rule()
    def redrive_all(self) -> None:
        with self.engine.begin() as conn:
            redrive(conn, every=True)

    @rule(index=INDEX)
    def skip_blocked(self, index: int) -> None:
        with self.engine.connect() as c:
            dead = c.execute(sa.text("SELECT id FROM outbox_jobs WHERE status = 'dead' AND ordering_key IS NOT NULL"
                                     " ORDER BY id")).scalars().all()
        if not dead:
            return
        try:
            skip_dead_job(self.engine, dead[index % len(dead)])
        except NotBlockingError as exc:  # pragma: no cover - a dead job holding its key blocks it
            raise AssertionError(f"a dead job holding its key was refused: {exc}") from None

    @rule(consumer=st.sampled_from(("ob", "os", "cap")), pause=st.booleans())
    def pause_or_resume(self, consumer: str, pause: bool) -> None:
        statements = queries.in_schema(None)
        with self.engine.begin() as conn:
            conn.execute(statements.consumer_pause if pause else statements.consumer_resume, {"consumer": consumer})
        (self.paused.add if pause else self.paused.discard)(consumer)

    # -------------------------------------------------------------- invariants

    @invariant()
    def one_head_per_key(self) -> None:
        with self.engine.connect() as c:
            rows = c.execute(sa.text(
                "SELECT consumer, ordering_key, array_agg(status ORDER BY event_id) AS statuses"
                " FROM outbox_jobs WHERE ordering_key IS NOT NULL AND status <> 'done'"
                " GROUP BY consumer, ordering_key")).all()
        for r in rows:
            head, rest = r.statuses[0], r.statuses[1:]
            assert all(s == "pending" for s in rest), f"{r.consumer} {r.ordering_key}: {r.statuses}"
            assert head != "pending", f"{r.consumer} {r.ordering_key} is stuck: {r.statuses}"
            assert head in ("ready", "running", "dead"), f"{r.consumer} {r.ordering_key}: {r.statuses}"

    @invariant()
    def never_two_running_of_a_key(self) -> None:
        with self.engine.connect() as c:
            worst = c.execute(sa.text(
                "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM outbox_jobs"
                " WHERE status = 'running' AND ordering_key IS NOT NULL GROUP BY consumer, ordering_key) x")).scalar_one()
        assert worst <= 1

    @invariant()
    def cap_holds(self) -> None:
        with self.engine.connect() as c:
            running = c.execute(sa.text(
                "SELECT count(*) FROM outbox_jobs WHERE consumer = 'cap' AND status = 'running'")).scalar_one()
        assert running <= CAP

    @invariant()
    def only_ordered_jobs_wait(self) -> None:
        with self.engine.connect() as c:
            bad = c.execute(sa.text(
                "SELECT count(*) FROM outbox_jobs WHERE status = 'pending' AND ordering_key IS NULL")).scalar_one()
        assert bad == 0


def test_ordering_and_flow_control_model(engine: sa.Engine) -> None:
    machine = type("OrderingFlowOnThisDatabase", (OrderingFlow,), {"engine": engine})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_ordering_and_flow_control_model_deleting_done_jobs(engine: sa.Engine) -> None:
    """The same with ``retention_done = 0``: a completed job's row is deleted at once, so a
    finished head leaves no row behind, and every invariant must hold as before (fewer
    examples: only the completions differ)."""
    machine = type("OrderingFlowDeletingDone", (OrderingFlow,), {"engine": engine, "keep_done": False})
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=examples(40)))
