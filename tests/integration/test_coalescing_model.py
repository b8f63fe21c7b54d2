"""Model-based test of coalescing per key (issue 32, docs/coalescing.md): a hypothesis
``RuleBasedStateMachine`` drives publishing (committed at once, or held open so ids commit
out of order), routing, claims, outcomes, the reaper and the races between them on a real
PostgreSQL in any order it likes, and checks the invariants of coalescing after every step.
Like :mod:`tests.integration.test_ordering_model` it checks invariants read from the
database rather than predicting every column (:mod:`tests.integration.test_lifecycle_model`
does that for consumers that do not coalesce).

The world of one example: consumer ``co`` coalesces events of topics ``t`` and ``u``
(unordered), ``oc`` coalesces those of ``t`` and is ordered (a dead job lets its key go:
``on_dead='skip'``); both allow two attempts. Events carry key ``k0``, ``k1`` or none. Two
simulated relays ``r0`` and ``r1`` share one engine, each operation its own transaction, as
separate processes would be. Hypothesis interleaves:

* publishing an event (its own transaction), or publishing one on ``u`` in a transaction
  left open and committed later (its id is lower than events committed meanwhile: a late
  older event; ``u`` has no ordered subscriber, so its publishers take no key lock);
* routing up to 1..4 events;
* a relay claiming 1..3 jobs; completing, failing (retried at once, or dead), snoozing or
  releasing one of its claims, then promoting its ordered key as the relay's completer does
  once the outcome committed;
* lapsing a relay's leases and reaping, followed by the sweep of left-pending heads;
* the races, played with two connections: the first operation's transaction is left open
  while the second runs on a thread until it waits for a row lock (or finishes), then the
  first commits: a claim against the router (each first), a failure against the router
  (each first), and two routers at once;
* settling: every open publish committed, every held claim completed, then route, claim and
  complete until nothing waits; then the newest event of every (consumer, key) must have a
  job that ran (done, or dead after its attempts).

Invariants after every step:

* at most one waiting (ready or pending) job per (consumer, key), and it is the one of the
  highest event id among the key's live (waiting or running) jobs;
* a running job of a key that has a live job of a higher event id carries
  ``superseded_by`` (its attempt, should it not end done or dead, ends superseded);
* a running job is never superseded: every claim no outcome has ended yet is still running
  under its fence, whatever was routed meanwhile (the races included);
* superseded is terminal: a superseded row never changes again, has ``finished_at``, no
  ordering key and ``superseded_by`` a higher event id; no claim ever returns one;
* every routed event has exactly one job per consumer subscribed to its topic, none for
  the others;
* ordered keys: of ``oc``'s jobs of a key that are not done (superseded ones left their key),
  the first in event order is ready, running or dead and never pending, every later one
  pending.

Settings: ``max_examples=150``, scaled by the hypothesis profile (tests/hypothesis_profiles.py),
``stateful_step_count=40``, ``deadline=None``, ``database=None``.

A check that it catches bugs (each rule of ``event_route_many`` and of the outcomes dropped
in turn): without the mark in ``job_fail_many`` it fails within the default profile (two
waiting jobs of a key), and so it does with ``replaced`` superseding running jobs too (a
claim no outcome ended found superseded); without the mark in ``job_reap_many``, without the
coalescing hold-back in ``batch`` (two routers, an event committed between their
snapshots), without the "newer event unrouted" or the "newer live job" overtaking, it fails
under the ``thorough`` profile (two waiting jobs, or a waiting job older than a running one);
with an ordered key's new job ready beside its running marked head, under ``ci``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs, release_jobs, snooze_jobs
from outbox.relay.maintenance import reap_expired
from outbox.relay.ordering import HeadSweeper, promote_finished
from outbox.relay.outcomes import Failure, Snoozed
from outbox.relay.router import register_subscriptions, route_batch
from outbox.settings import OutboxSettings
from tests.hypothesis_profiles import examples

#: consumer -> the topics it coalesces
TOPICS = {"co": ("t", "u"), "oc": ("t",)}
KEYS = ("k0", "k1", None)
RELAYS = ("r0", "r1")
LEASE = 300.0
SETTINGS = settings(max_examples=examples(150), stateful_step_count=40, deadline=None, database=None)
INDEX = st.integers(min_value=0, max_value=10**6)
LIVE = ("ready", "pending", "running")


def _registry() -> Outbox:
    ob = Outbox()

    @ob.subscriber(list(TOPICS["co"]), consumer="co", coalesce=True, max_attempts=2)
    def unordered(job: Job) -> None: ...

    @ob.subscriber(list(TOPICS["oc"]), consumer="oc", coalesce=True, ordered=True, on_dead="skip", max_attempts=2)
    def ordered(job: Job) -> None: ...

    return ob


class Coalescing(RuleBasedStateMachine):
    """Two relays, routing, claims, outcomes, the reaper and their races; see the module notes."""

    engine: sa.Engine  # set by the test

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:
            for table in ("outbox_jobs", "outbox_events", "outbox_subscriptions", "outbox_consumers"):
                conn.execute(sa.text(f"DELETE FROM {table}"))
        self.registry = _registry()
        self.subscribers = {s.consumer: s for s in self.registry}
        register_subscriptions(self.engine, self.registry, OutboxSettings(_env_file=None, default_lease=LEASE))
        self.leases = {c: LEASE for c in TOPICS}
        self.held: dict[str, list[Job]] = {r: [] for r in RELAYS}
        self.open: list[Session] = []  # publishing transactions left open
        self.unended: set[tuple[int, int]] = set()  # (job id, fence) of claims no outcome has ended
        self.superseded: dict[int, tuple[Any, ...]] = {}  # id -> the row as first seen superseded
        self.sweeper = HeadSweeper()

    def teardown(self) -> None:
        for session in self.open:
            session.rollback()
            session.close()

    # ------------------------------------------------------------------ helpers

    def _took(self, relay: str, jobs: list[Job]) -> None:
        for job in jobs:
            assert job.id not in self.superseded, f"superseded job {job.id} was claimed"
            self.unended.add((job.id, job.fence))
        self.held[relay] += sorted(jobs, key=lambda j: j.id)

    def _ended(self, jobs: list[Job]) -> None:
        self.unended -= {(j.id, j.fence) for j in jobs}

    def _promote(self, jobs: list[Job]) -> None:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            promote_finished(conn, jobs, self.subscribers)

    def _outcome(self, conn: sa.Connection, job: Job, how: str) -> None:
        if how == "done":
            complete_jobs(conn, [job])
        elif how == "snooze":
            snooze_jobs(conn, [(job, Snoozed(0.0))])
        elif how == "release":
            release_jobs(conn, [job])
        else:
            fail_jobs(conn, [(job, Failure(0.0, how == "dead", f"{how} on purpose"))])

    def _race(self, first: Callable[[sa.Connection], Any], second: Callable[[sa.Connection], Any]) -> Any:
        """``first`` in a transaction left open, ``second`` on a thread until it waits for a
        row lock or ends, then ``first`` commits; returns (first's result, second's)."""
        out: dict[str, Any] = {}
        started = threading.Event()

        def run() -> None:
            try:
                with self.engine.begin() as conn:
                    out["pid"] = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                    started.set()
                    out["result"] = second(conn)
            except BaseException as exc:
                out["error"] = exc
                started.set()

        with self.engine.connect() as conn:
            tx = conn.begin()
            got = first(conn)
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            assert started.wait(10)
            deadline = time.monotonic() + 10
            with self.engine.connect() as look:
                while thread.is_alive() and time.monotonic() < deadline:
                    if look.execute(sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                                    {"p": out.get("pid")}).scalar():
                        break
                    time.sleep(0.005)
            tx.commit()
        thread.join(10)
        assert not thread.is_alive(), "the second operation of a race never finished"
        if "error" in out:
            raise out["error"]
        return got, out["result"]

    def _pick(self, relay: str, index: int) -> Job | None:
        held = self.held[relay]
        return held.pop(index % len(held)) if held else None

    # -------------------------------------------------------------------- rules

    @rule(topic=st.sampled_from(("t", "u")), key=st.sampled_from(KEYS))
    def publish_event(self, topic: str, key: str | None) -> None:
        with self.engine.begin() as conn:
            publish(conn, topic, {"k": key}, key=key)

    @precondition(lambda self: len(self.open) < 2)
    @rule(key=st.sampled_from(KEYS))
    def publish_left_open(self, key: str | None) -> None:
        session = Session(self.engine)
        session.begin()
        publish(session, "u", {"k": key, "late": True}, key=key)
        session.flush()
        self.open.append(session)

    @precondition(lambda self: bool(self.open))
    @rule(index=INDEX)
    def commit_open(self, index: int) -> None:
        session = self.open.pop(index % len(self.open))
        session.commit()
        session.close()

    @rule(limit=st.integers(1, 4))
    def route(self, limit: int) -> None:
        with self.engine.begin() as conn:
            route_batch(conn, limit)

    @rule(relay=st.sampled_from(RELAYS), limit=st.integers(1, 3))
    def claim(self, relay: str, limit: int) -> None:
        with self.engine.begin() as conn:
            jobs = claim_jobs(conn, self.leases, limit, relay)
        self._took(relay, jobs)

    @rule(relay=st.sampled_from(RELAYS), index=INDEX,
          how=st.sampled_from(("done", "retry", "dead", "snooze", "release")))
    def finish(self, relay: str, index: int, how: str) -> None:
        job = self._pick(relay, index)
        if job is None:
            return
        with self.engine.begin() as conn:
            self._outcome(conn, job, how)
        self._ended([job])
        self._promote([job])

    @rule(relay=st.sampled_from(RELAYS))
    def lapse_and_reap(self, relay: str) -> None:
        with self.engine.begin() as conn:
            lapsed = conn.execute(sa.text(
                "UPDATE outbox_jobs SET lease_until = now() - interval '1 second'"
                " WHERE status = 'running' AND locked_by = :r RETURNING id, fence"), {"r": relay}).all()
        with self.engine.begin() as conn:
            reap_expired(conn)
        self.unended -= {(r.id, r.fence) for r in lapsed}
        with self.engine.begin() as conn:
            self.sweeper.sweep(conn)

    @rule(relay=st.sampled_from(RELAYS), limit=st.integers(1, 3), route_limit=st.integers(1, 4),
          claim_first=st.booleans())
    def race_claim_and_route(self, relay: str, limit: int, route_limit: int, claim_first: bool) -> None:
        def claim(conn: sa.Connection) -> list[Job]:
            return claim_jobs(conn, self.leases, limit, relay)

        def route(conn: sa.Connection) -> Any:
            return route_batch(conn, route_limit)

        if claim_first:  # the router waits for the claim's row locks, then finds those jobs running
            jobs, _ = self._race(claim, route)
        else:  # the claim skips the rows the router holds
            _, jobs = self._race(route, claim)
        self._took(relay, jobs)

    @rule(relay=st.sampled_from(RELAYS), index=INDEX, route_limit=st.integers(1, 4),
          how=st.sampled_from(("retry", "snooze", "release", "done")), outcome_first=st.booleans())
    def race_outcome_and_route(self, relay: str, index: int, route_limit: int, how: str, outcome_first: bool) -> None:
        job = self._pick(relay, index)
        if job is None:
            return

        def outcome(conn: sa.Connection) -> None:
            self._outcome(conn, job, how)

        def route(conn: sa.Connection) -> Any:
            return route_batch(conn, route_limit)

        if outcome_first:
            self._race(outcome, route)
        else:
            self._race(route, outcome)
        self._ended([job])
        self._promote([job])

    @rule(first=st.integers(1, 4), second=st.integers(1, 4), between=st.sampled_from((None, "commit", "k0", "k1")))
    def race_two_routers(self, first: int, second: int, between: str | None) -> None:
        """Two routers at once; ``between`` the first's statement and the second's, an event
        may commit: a publishing transaction left open (a lower id than what the first
        routed) or a new event on ``u`` of a key (which the first's snapshot did not see; on
        ``u``, which no ordered consumer subscribes to, only coalescing holds events back)."""
        def then_route(conn: sa.Connection) -> Any:
            if between == "commit" and self.open:
                session = self.open.pop(0)
                session.commit()
                session.close()
            elif between in KEYS:
                with self.engine.begin() as other:
                    publish(other, "u", {"k": between, "between": True}, key=between)
            return route_batch(conn, second)

        self._race(lambda conn: route_batch(conn, first), then_route)

    @rule()
    def settle(self) -> None:
        for session in self.open:
            session.commit()
            session.close()
        self.open = []
        for relay in RELAYS:
            jobs, self.held[relay] = self.held[relay], []
            with self.engine.begin() as conn:
                complete_jobs(conn, jobs)
            self._ended(jobs)
            self._promote(jobs)
        for _ in range(100):
            with self.engine.begin() as conn:
                routed = route_batch(conn, 100).events
                jobs = claim_jobs(conn, self.leases, 100, "settle")
            for job in jobs:
                assert job.id not in self.superseded, f"superseded job {job.id} was claimed"
            with self.engine.begin() as conn:
                complete_jobs(conn, jobs)
            self._promote(jobs)
            if not routed and not jobs:
                break
        with self.engine.connect() as c:
            waiting = c.execute(sa.text(
                "SELECT count(*) FROM outbox_jobs WHERE status IN ('ready', 'pending', 'running')")).scalar_one()
            assert waiting == 0, f"{waiting} jobs still wait or run after settling"
            for consumer, topics in TOPICS.items():
                rows = c.execute(sa.text(
                    "SELECT DISTINCT ON (e.key) e.key, e.id, j.status FROM outbox_events e"
                    " LEFT JOIN outbox_jobs j ON j.event_id = e.id AND j.consumer = :c"
                    " WHERE e.key IS NOT NULL AND e.topic = ANY(:topics) ORDER BY e.key, e.id DESC"),
                    {"c": consumer, "topics": list(topics)}).all()
                for r in rows:
                    assert r.status in ("done", "dead"), (
                        f"{consumer} key {r.key}: its newest event {r.id} has a job {r.status}, not one that ran")

    # -------------------------------------------------------------- invariants

    @invariant()
    def one_waiting_job_per_key_and_it_is_the_newest(self) -> None:
        with self.engine.connect() as c:
            rows = c.execute(sa.text(
                "SELECT consumer, coalesce_key, array_agg(status ORDER BY event_id) AS statuses,"
                " array_agg(superseded_by ORDER BY event_id) AS marks"
                " FROM outbox_jobs WHERE coalesce_key IS NOT NULL AND status IN ('ready', 'pending', 'running')"
                " GROUP BY consumer, coalesce_key")).all()
        for r in rows:
            waiting = [i for i, s in enumerate(r.statuses) if s != "running"]
            assert len(waiting) <= 1, f"{r.consumer} {r.coalesce_key}: two waiting jobs, {r.statuses}"
            assert not waiting or waiting[0] == len(r.statuses) - 1, (
                f"{r.consumer} {r.coalesce_key}: the waiting job is not the newest live one, {r.statuses}")
            for i, s in enumerate(r.statuses[:-1]):  # a running job with a newer live job is marked
                assert s != "running" or r.marks[i] is not None, (
                    f"{r.consumer} {r.coalesce_key}: an older running job is not marked, {r.statuses} {r.marks}")

    @invariant()
    def a_running_job_is_never_superseded(self) -> None:
        if not self.unended:
            return
        with self.engine.connect() as c:
            rows = {r.id: r for r in c.execute(sa.text(
                "SELECT id, status, fence FROM outbox_jobs WHERE id = ANY(:ids)"),
                {"ids": [i for i, _ in self.unended]})}
        for job_id, fence in self.unended:
            row = rows.get(job_id)
            assert row is not None and (row.status, row.fence) == ("running", fence), (
                f"job {job_id} claimed under fence {fence} is now {row and (row.status, row.fence)}")

    @invariant()
    def superseded_is_terminal(self) -> None:
        with self.engine.connect() as c:
            rows = c.execute(sa.text(
                "SELECT id, event_id, status, superseded_by, finished_at, ordering_key, updated_at FROM outbox_jobs"
                " WHERE status = 'superseded' OR id = ANY(:ids)"), {"ids": list(self.superseded)}).all()
        for r in rows:
            seen = tuple(r)
            if r.id in self.superseded:
                assert self.superseded[r.id] == seen, f"superseded job {r.id} changed: {self.superseded[r.id]} -> {seen}"
                continue
            assert r.finished_at is not None and r.ordering_key is None, seen
            assert r.superseded_by is not None and r.superseded_by > r.event_id, seen
            self.superseded[r.id] = seen
        assert len(rows) == len(self.superseded)

    @invariant()
    def one_job_per_event_and_consumer(self) -> None:
        with self.engine.connect() as c:
            rows = c.execute(sa.text(
                "SELECT e.id, e.topic, array_agg(j.consumer ORDER BY j.consumer) FILTER (WHERE j.id IS NOT NULL)"
                " AS consumers FROM outbox_events e LEFT JOIN outbox_jobs j ON j.event_id = e.id"
                " WHERE e.routed_at IS NOT NULL GROUP BY e.id, e.topic")).all()
        for r in rows:
            expected = sorted(c for c, topics in TOPICS.items() if r.topic in topics)
            assert (r.consumers or []) == expected, f"event {r.id} on {r.topic}: jobs of {r.consumers}"

    @invariant()
    def ordered_keys_go_one_at_a_time(self) -> None:
        with self.engine.connect() as c:
            rows = c.execute(sa.text(
                "SELECT ordering_key, array_agg(status ORDER BY event_id) AS statuses FROM outbox_jobs"
                " WHERE consumer = 'oc' AND ordering_key IS NOT NULL AND status <> 'done' GROUP BY ordering_key")).all()
        for r in rows:
            head, rest = r.statuses[0], r.statuses[1:]
            assert head in ("ready", "running", "dead"), f"oc {r.ordering_key}: {r.statuses}"
            assert all(s == "pending" for s in rest), f"oc {r.ordering_key}: {r.statuses}"


def test_coalescing_model(engine: sa.Engine) -> None:
    machine = type("CoalescingOnThisDatabase", (Coalescing,), {"engine": engine})
    run_state_machine_as_test(machine, settings=SETTINGS)
