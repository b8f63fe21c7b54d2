"""Model-based test of fan-in: a hypothesis ``RuleBasedStateMachine`` drives the job
statements on a real PostgreSQL in any order, and after every step checks that each fan-in
has fired for an event if and only if every job of its listed consumers is done, at most
once, with the follow-up the trigger must write.

The world: consumers ``c0``, ``c1``, ``c2`` and ``u`` subscribe to topic ``t`` (two attempts
each, so dead letters are frequent); fan-in ``all`` lists ``c0, c1, c2`` (follow-ups on
``t.all``), fan-in ``one`` lists ``c1`` alone (``t.one``), so a completion of ``c1`` looks for
two fan-ins, and ``u`` is listed by none. Hypothesis interleaves, each in a transaction of its
own as separate relays would:

* publishing 1..3 keyed events and routing them (``route_batch``; follow-ups too, which no
  one subscribes to);
* claiming 1..4 jobs of any subset of the consumers (``claim_jobs``);
* completing any subset of the claims held, current or stale (``complete_jobs``), each
  batch keeping its done jobs or deleting them (``retention_done = 0``), drawn per batch; or
  one claim in a transactional handler's transaction (``job_complete``, committed only when
  it matched a row, kept or deleted);
* failing any subset (transient, due again at once, or permanent: ``fail_jobs``);
* letting the leases of some running jobs lapse and reaping (``reap_expired``): back to
  ready, or dead on the last attempt; their claims go stale;
* redriving dead jobs (``job_redrive_many``), cancelling ready or running jobs
  (``job_cancel_many``: a running one ends ``cancelled`` at its next report), and pruning done
  and cancelled jobs (``retention.prune``, events kept).

The model knows which jobs were deleted and how: a job last seen ``running`` that is gone was
deleted by its completion (done); one last seen ``done`` was pruned (done); one last seen
``cancelled`` was pruned (never done). Checked after every step, for every event and fan-in:
a follow-up exists if and only if each listed consumer's job is done (present and ``done``,
or deleted as done); never two; its key, payload and headers are the event's and name the
fan-in and the event; ``outbox_fanin_fired`` holds it, and a record without a follow-up only
where a listed job was deleted before it was done; once written, a record never changes.

A check that it catches bugs: with the record's check dropped from the function (a second
completion of an event fires again), and with a completion's delete no longer counted as
done, it fails within the run.

Determinism: every draw and precondition depends only on what earlier draws made the
database hold: each example empties the tables and restarts the identities and the fence
sequence, and the claims held are kept in id order (hypothesis replays examples by their
draws; anything else is a ``FlakyStrategyDefinition``).

Settings: ``max_examples=100``, scaled by the hypothesis profile, ``stateful_step_count=30``,
``deadline=None``, ``database=None``; one database per run, emptied by each example.
"""

from __future__ import annotations

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
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish_many
from outbox.db import queries, retention
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs
from outbox.relay import transaction
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure
from outbox.relay.router import register_subscriptions, route_batch
from outbox.settings import OutboxSettings
from tests.hypothesis_profiles import examples

CONSUMERS = ("c0", "c1", "c2", "u")
FAN_INS = {"all": ("c0", "c1", "c2"), "one": ("c1",)}
FOLLOW_TOPICS = {"all": "t.all", "one": "t.one"}
LEASE = 300.0
MAX_OPEN = 8  # no publishing while this many jobs are ready or running

SETTINGS = settings(max_examples=examples(100), stateful_step_count=30, deadline=None, database=None)


class FanInModel(RuleBasedStateMachine):
    engine: sa.Engine  # set by the test

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:
            for table in ("outbox_jobs", "outbox_events", "outbox_subscriptions", "outbox_fanins",
                          "outbox_fanin_fired"):
                conn.execute(sa.text(f"DELETE FROM {table}"))
            for sequence in ("pg_get_serial_sequence('outbox_jobs', 'id')",
                             "pg_get_serial_sequence('outbox_events', 'id')", "'outbox_fence_seq'"):
                conn.execute(sa.text(f"SELECT setval({sequence}, 1, false)"))
        self.held: list[Job] = []
        self.events: dict[int, tuple[str, dict[str, Any]]] = {}  # id -> (key, payload)
        self.jobs: dict[int, tuple[int, str]] = {}  # every job seen: id -> (event, consumer)
        self.status: dict[int, str] = {}  # last seen status of each job present
        self.gone: dict[int, bool] = {}  # deleted jobs: id -> whether it was done
        self.fired: dict[tuple[int, str], int | None] = {}  # records seen: (event, fan-in) -> follow-up
        self.counter = 0

    # ------------------------------------------------------------------ plumbing

    def snapshot(self) -> None:
        """Read the jobs back; a job gone since the last look was deleted: as done when it was
        running (its completion deleted it) or done (pruned), not done when cancelled."""
        with self.engine.connect() as conn:
            rows = {r.id: r for r in conn.execute(sa.text("SELECT id, event_id, consumer, status FROM outbox_jobs"))}
        for job_id in set(self.status) - set(rows):
            last = self.status.pop(job_id)
            assert last in ("running", "done", "cancelled"), f"job {job_id} was deleted while {last}"
            self.gone[job_id] = last != "cancelled"
        for job_id, r in rows.items():
            self.jobs[job_id] = (r.event_id, r.consumer)
            self.status[job_id] = r.status

    def done(self, event_id: int, consumer: str) -> bool:
        [job_id] = [i for i, (e, c) in self.jobs.items() if e == event_id and c == consumer]
        return self.status.get(job_id) == "done" if job_id in self.status else self.gone[job_id]

    def take(self, data: st.DataObject, most: int | None = None) -> list[Job]:
        """A non-empty subset of the claims held, which are no longer held."""
        picks = data.draw(st.lists(st.sampled_from(range(len(self.held))), min_size=1,
                                   max_size=most or len(self.held), unique=True), label="claims")
        batch = [self.held[i] for i in picks]
        self.held = [j for i, j in enumerate(self.held) if i not in picks]
        return batch

    # ----------------------------------------------------------------- the world

    @initialize()
    def declare(self) -> None:
        ob = Outbox()
        for consumer in CONSUMERS:
            ob.subscriber("t", consumer=consumer, max_attempts=2, lease=LEASE)(lambda job: None)
        for name, listed in FAN_INS.items():
            ob.after("t", consumers=list(listed), publish=FOLLOW_TOPICS[name], name=name)
        register_subscriptions(self.engine, ob, OutboxSettings(_env_file=None))

    @precondition(lambda self: sum(s in ("ready", "running") for s in self.status.values()) < MAX_OPEN)
    @rule(n=st.integers(1, 3))
    def publish_and_route(self, n: int) -> None:
        items = []
        for _ in range(n):
            self.counter += 1
            items.append({"topic": "t", "payload": {"n": self.counter}, "key": f"k{self.counter % 2}",
                          "headers": {"traceparent": f"00-{self.counter:032x}-{self.counter:016x}-01"}})
        with Session(self.engine) as s, s.begin():
            ids = publish_many(s, items)
        for event_id, item in zip(ids, items, strict=True):
            self.events[event_id] = (item["key"], item["payload"])
        with self.engine.begin() as conn:
            while route_batch(conn, 100).events:
                pass

    @precondition(lambda self: "ready" in self.status.values())
    @rule(consumers=st.sets(st.sampled_from(CONSUMERS), min_size=1), limit=st.integers(1, 4))
    def claim(self, consumers: set[str], limit: int) -> None:
        with self.engine.begin() as conn:
            claimed = claim_jobs(conn, dict.fromkeys(sorted(consumers), LEASE), limit, "w")
        # In id order: the order of the claim's RETURNING varies with the plan and the heap, and
        # a later draw picks claims by their place in this list.
        self.held += sorted(claimed, key=lambda j: j.id)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), keep_done=st.booleans())
    def complete(self, data: st.DataObject, keep_done: bool) -> None:
        batch = self.take(data)
        with self.engine.begin() as conn:
            complete_jobs(conn, batch, keep_done=keep_done)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), keep_done=st.booleans())
    def complete_in_handler_transaction(self, data: st.DataObject, keep_done: bool) -> None:
        [job] = self.take(data, 1)
        with self.engine.connect() as conn:
            tx = conn.begin()
            transaction.set_limits(conn, job.lease_seconds, job.fence)
            row = conn.execute(queries.job_complete, {"id": job.id, "fence": job.fence, "keep_done": keep_done}).one()
            (tx.commit if row.completed else tx.rollback)()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        batch = self.take(data)
        failures = [(job, Failure(delay=0.0, permanent=data.draw(st.booleans(), label=f"permanent {job.id}"),
                                  error=f"failure of job {job.id}")) for job in batch]
        with self.engine.begin() as conn:
            fail_jobs(conn, failures)

    @precondition(lambda self: "running" in self.status.values())
    @rule(data=st.data())
    def lapse_and_reap(self, data: st.DataObject) -> None:
        running = sorted(i for i, s in self.status.items() if s == "running")
        lapsed = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="lapsed")
        with self.engine.begin() as conn:
            conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second' "
                                 "WHERE id = ANY (CAST(:ids AS bigint[]))"), {"ids": lapsed})
        with self.engine.begin() as conn:
            reap_expired(conn)

    @precondition(lambda self: "dead" in self.status.values())
    @rule(data=st.data())
    def redrive(self, data: st.DataObject) -> None:
        dead = sorted(i for i, s in self.status.items() if s == "dead")
        ids = data.draw(st.lists(st.sampled_from(dead), min_size=1, unique=True), label="redriven")
        with self.engine.begin() as conn:
            conn.execute(queries.job_redrive_many, {"ids": ids, "consumer": None})

    @precondition(lambda self: any(s in ("ready", "running") for s in self.status.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        open_ = sorted(i for i, s in self.status.items() if s in ("ready", "running"))
        ids = data.draw(st.lists(st.sampled_from(open_), min_size=1, max_size=2, unique=True), label="cancelled")
        with self.engine.begin() as conn:
            conn.execute(queries.job_cancel_many, {"ids": ids, "consumer": None, "statuses": ["ready", "running"],
                                                   "limit": 100})

    @precondition(lambda self: any(s in ("done", "cancelled") for s in self.status.values()))
    @rule()
    def prune(self) -> None:
        with self.engine.begin() as conn:
            retention.prune(conn, 0.0, 10_000.0)

    # ------------------------------------------------------------------ invariant

    @invariant()
    def fired_iff_every_listed_job_is_done_and_once(self) -> None:
        self.snapshot()
        with self.engine.connect() as conn:
            follows = conn.execute(sa.text(
                "SELECT id, topic, key, payload, headers FROM outbox_events WHERE topic IN ('t.all', 't.one')")).all()
            records = {(r.event_id, r.name): r.follow_event_id for r in conn.execute(sa.text(
                "SELECT event_id, name, follow_event_id FROM outbox_fanin_fired"))}
        by_fan_in: dict[tuple[int, str], list[Any]] = {}
        for f in follows:
            by_fan_in.setdefault((f.headers["fan_in_event_id"], f.headers["fan_in"]), []).append(f)
        assert set(by_fan_in) <= {(e, n) for e in self.events for n in FAN_INS}, "a follow-up of nothing"
        for event_id, (key, payload) in self.events.items():
            for name, listed in FAN_INS.items():
                expected = all(self.done(event_id, c) for c in listed)
                made = by_fan_in.get((event_id, name), [])
                assert len(made) == (1 if expected else 0), (
                    f"event {event_id}, fan-in {name}: {len(made)} follow-ups, listed jobs "
                    f"{[(c, self.done(event_id, c)) for c in listed]}")
                if expected:
                    [f] = made
                    assert (f.topic, f.key, f.payload) == (FOLLOW_TOPICS[name], key, payload)
                    assert f.headers["traceparent"] == f"00-{payload['n']:032x}-{payload['n']:016x}-01"
                    assert records.get((event_id, name)) == f.id
                elif (event_id, name) in records:
                    assert records[(event_id, name)] is None
                    assert any(self.gone.get(i) is False for i, (e, c) in self.jobs.items()
                               if e == event_id and c in listed), "settled without a listed job deleted undone"
        for fan, follow in self.fired.items():
            assert records.get(fan, "gone") == follow, f"the record of {fan} changed"
        self.fired = records


def test_fan_in_fires_iff_every_listed_job_is_done(engine):
    machine = type("FanInModelRun", (FanInModel,), {"engine": engine})
    run_state_machine_as_test(machine, settings=SETTINGS)
