"""Races at the SQL level (issue 3, section 1), with the statements the relay runs and one
connection per actor, so the interleavings are forced rather than hoped for:

* the reaper racing a completion (and every other fenced transition): whichever takes the
  job's row lock first wins, the other changes nothing; forced in both orders with row
  locks, then raced freely a few hundred times;
* claim, route, heartbeat, outcomes and the reaper running together on many threads for
  thousands of iterations: no deadlock, no error, and the jobs end consistent.

``OUTBOX_FAULT_EVENTS`` (see ``test_faults.py``) scales the iteration counts.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from outbox import (
    Job,
    Outbox,
    fenced_write,
    publish_many,
)
from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_jobs, fail_jobs, heartbeat_jobs, release_jobs
from outbox.relay import transaction
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure
from outbox.relay.router import route_batch
from outbox.testing import wait_for

from ..integration.helpers import expire_lease, job_row, routed_jobs

SCALE = max(1, int(os.environ.get("OUTBOX_FAULT_EVENTS", "300")) // 300)

effects = sa.Table(  # what a transactional handler writes, guarded by the job's fence
    "race_effects", sa.MetaData(),
    sa.Column("job_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


def _claim(engine: sa.Engine, consumer: str = "race", lease: float = 60.0, limit: int = 1000) -> list[Job]:
    with engine.begin() as conn:
        return claim_jobs(conn, {consumer: lease}, limit, "racer")


def _transactional_complete(conn: sa.Connection, job: Job) -> bool:
    """What a transactional handler's transaction does: its fenced write, then the fenced
    completion; a completion matching no row means the caller rolls everything back."""
    transaction.set_limits(conn, job.lease_seconds, job.fence)  # the first statement, as a handler's
    fenced_write(conn, effects, key={"job_id": job.id}, values={}, fence=job.fence)
    return conn.execute(queries.job_complete,
                        {"id": job.id, "fence": job.fence, "keep_done": True}).one().completed == 1


#: name -> (statement run by the job's worker, returns whether it changed the job)
FINISHERS: dict[str, Callable[[sa.Connection, Job], bool]] = {
    "complete": lambda c, j: complete_jobs(c, [j]) == {j.id},
    "fail": lambda c, j: bool(fail_jobs(c, [(j, Failure(delay=0.0, permanent=False, error="Boom: x"))])),
    "fail_permanent": lambda c, j: bool(fail_jobs(c, [(j, Failure(delay=0.0, permanent=True, error="Bad: x"))])),
    "release": lambda c, j: release_jobs(c, [j]) == {j.id},
    "heartbeat": lambda c, j: heartbeat_jobs(c, [j]) == {j.fence},
    "transactional_complete": _transactional_complete,
}


def _finisher_result(name: str, before: dict[str, Any], after: dict[str, Any], max_attempts: int) -> None:
    """The row as the finisher ``name`` leaves it, given it won."""
    assert after["fence"] == before["fence"]
    if name in ("complete", "transactional_complete"):
        assert after["status"] == "done"
    elif name == "fail":
        assert after["status"] == ("dead" if before["attempts"] >= max_attempts else "ready")
        assert after["last_error"] == "Boom: x"
    elif name == "fail_permanent":
        assert after["status"] == "dead" and after["last_error"] == "Bad: x"
    elif name == "release":
        assert (after["status"], after["attempts"]) == ("ready", before["attempts"] - 1)
    elif name == "heartbeat":
        assert after["status"] == "running" and after["lease_until"] > before["lease_until"]


def _reaper_result(before: dict[str, Any], after: dict[str, Any], max_attempts: int) -> None:
    assert after["fence"] == before["fence"] and after["attempts"] == before["attempts"]
    assert after["status"] == ("dead" if before["attempts"] >= max_attempts else "ready")
    assert after["last_error"].startswith("LeaseExpired")


def _waiting_on_lock(engine: sa.Engine, pid: int) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                         {"p": pid}).scalar() is True


@pytest.fixture
def race_engine(engine: sa.Engine) -> sa.Engine:
    effects.metadata.create_all(engine)
    return engine


@pytest.mark.parametrize("max_attempts", [3, 1], ids=["attempts_left", "last_attempt"])
@pytest.mark.parametrize("finisher", list(FINISHERS))
def test_reaper_racing_a_finisher_exactly_one_wins(race_engine: sa.Engine, finisher: str, max_attempts: int) -> None:
    """The job's lease has expired and its slow worker reports at the very moment the
    reaper runs. Forced both ways with row locks: (1) the worker's statement holds the row
    when the reaper looks: the reaper skips it and changes nothing; (2) the reaper holds it
    when the worker's statement arrives: the worker's statement waits, then finds the job
    no longer running under its fence and changes nothing (its transactional writes roll
    back). Never both, never neither."""
    engine = race_engine
    finish = FINISHERS[finisher]
    a, b = routed_jobs(engine, "t", ["race"], n=2, max_attempts=max_attempts)
    jobs = {j.id: j for j in _claim(engine)}
    with engine.begin() as c:
        expire_lease(c, a)

    # (1) The worker's statement first: its transaction holds the row lock.
    before = job_row(engine, a)
    with engine.connect() as worker, engine.connect() as reaper:
        with worker.begin() as tx:
            assert finish(worker, jobs[a])
            with reaper.begin():
                reaper.execute(sa.text("SET LOCAL lock_timeout = '5s'"))  # a reaper that waited would fail
                reaped = reap_expired(reaper)
            assert (reaped.retried, reaped.dead) == (0, 0)
            tx.commit()
    _finisher_result(finisher, before, job_row(engine, a), max_attempts)

    # (2) The reaper first: the worker's statement blocks on the row, then finds it taken.
    with engine.begin() as c:
        expire_lease(c, b)
    before = job_row(engine, b)
    outcome: dict[str, Any] = {}
    with engine.connect() as worker, engine.connect() as reaper:
        worker_pid = worker.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        worker.commit()
        with reaper.begin() as reap_tx:
            reaped = reap_expired(reaper)
            assert reaped.retried + reaped.dead == 1

            def report() -> None:
                try:
                    with worker.begin() as tx:
                        outcome["changed"] = finish(worker, jobs[b])
                        if not outcome["changed"]:
                            tx.rollback()  # as the relay does: a stale transactional run commits nothing
                except BaseException as exc:  # noqa: BLE001 - reported below
                    outcome["error"] = exc

            thread = threading.Thread(target=report)
            thread.start()
            wait_for(lambda: _waiting_on_lock(engine, worker_pid), timeout=10, what="the worker to wait on the row")
            reap_tx.commit()
        thread.join(10)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["changed"] is False
    _reaper_result(before, job_row(engine, b), max_attempts)
    with engine.connect() as c:
        assert c.execute(sa.select(effects.c.job_id).where(effects.c.job_id == b)).first() is None
        written = c.execute(sa.select(effects.c.job_id)).scalars().all()
    assert written == ([a] if finisher == "transactional_complete" else [])


@pytest.mark.parametrize("finisher", ["complete", "transactional_complete"])
def test_reaper_and_completion_raced_freely(race_engine: sa.Engine, finisher: str) -> None:
    """The same race with no forcing: for each of a few hundred expired jobs a worker
    completes it while a reaper runs, released by one barrier. Every time exactly one of
    them changed the job, and the row shows that one's result."""
    engine = race_engine
    finish = FINISHERS[finisher]
    rounds = 150 * SCALE
    ids = routed_jobs(engine, "t", ["race"], n=rounds, max_attempts=3)
    jobs = {j.id: j for j in _claim(engine, limit=rounds)}
    wins = {"worker": 0, "reaper": 0}
    with engine.connect() as worker, engine.connect() as reaper:
        for job_id in ids:
            with engine.begin() as c:
                expire_lease(c, job_id)
            barrier = threading.Barrier(2)
            got: dict[str, Any] = {}

            def complete(job: Job = jobs[job_id]) -> None:
                barrier.wait()
                with worker.begin() as tx:
                    got["worker"] = finish(worker, job)
                    if not got["worker"]:
                        tx.rollback()

            thread = threading.Thread(target=complete)
            thread.start()
            barrier.wait()
            with reaper.begin():
                got["reaper"] = reap_expired(reaper).retried == 1
            thread.join(10)
            assert got["worker"] != got["reaper"], f"job {job_id}: {got}"
            row = job_row(engine, job_id)
            assert row["status"] == ("done" if got["worker"] else "ready"), (got, row)
            wins["worker" if got["worker"] else "reaper"] += 1
        with engine.connect() as c:
            written = set(c.execute(sa.select(effects.c.job_id)).scalars())
    done = {i for i in ids if job_row(engine, i)["status"] == "done"}
    if finisher == "transactional_complete":
        assert written == done  # effects exactly where the completion won
    print(f"{rounds} races: {wins}")


# ------------------------------------------------------------------ no deadlocks


class _Actors:
    """Threads, each with its own connection, doing what the relay's loops do, in the
    same transaction shapes (relay.py, db/jobs.py, maintenance.py)."""

    CONSUMERS = {"c1": 0.15, "c2": 0.3, "c3": 0.6}  # leases, seconds: short, so reaping happens

    def __init__(self, engine: sa.Engine, iterations: int) -> None:
        self.engine = engine
        self.iterations = iterations
        self.held: list[tuple[float, Job]] = []  # (when claimed, claim)
        self.stalled: list[tuple[float, Job]] = []  # (when its report is due, claim)
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.counts: dict[str, int] = {}
        self.stop = threading.Event()
        self.followers: set[str] = set()  # followers still short of their minimum of counted steps
        self.followers_fed = threading.Event()  # set once none is: the drivers may stop
        self.published = 0
        self.tally = {"claimed": 0, "reaped": 0, "stale": 0, "lost": 0}

    def expect_followers(self, names: list[str]) -> None:
        """The followers the drivers keep feeding until each has done ``iterations // 10``
        counted steps (under load one can be starved for a while; a driver that stopped at
        its own count would leave it nothing to do)."""
        self.followers = set(names)

    def run(self, name: str, step: Callable[[sa.Connection, random.Random], bool], seed: int,
            until: threading.Event | None = None) -> None:
        """Call ``step`` ``iterations`` times and then on until every follower is fed, at
        most 4 ``iterations`` in all (a driver), or, with ``until``, until that is set (a
        follower: steps that found nothing to do are not counted)."""
        rng = random.Random(seed)
        done = 0
        with self.engine.connect() as conn:
            while not self.stop.is_set() and (
                    (done < self.iterations or (not self.followers_fed.is_set() and done < 4 * self.iterations))
                    if until is None
                    else not until.is_set()):
                try:
                    worked = step(conn, rng)
                except DBAPIError as exc:
                    self.errors.append(f"{name}: {type(exc.orig).__name__}: {str(exc.orig).splitlines()[0]}")
                    self.stop.set()
                    if conn.in_transaction():
                        conn.rollback()
                    return
                except BaseException as exc:  # noqa: BLE001
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    self.stop.set()
                    return
                if worked or until is None:
                    done += 1
                    if until is not None and done == self.iterations // 10:
                        with self.lock:
                            self.followers.discard(name)
                            if not self.followers:
                                self.followers_fed.set()
                else:
                    time.sleep(0.001)  # nothing held right now: pacing, not synchronisation
        self.counts[name] = done

    def _auto(self, conn: sa.Connection) -> sa.Connection:
        return conn.execution_options(isolation_level="AUTOCOMMIT")

    def publish(self, conn: sa.Connection, rng: random.Random) -> bool:
        with conn.begin():
            publish_many(conn, [("stress", {"i": self.published + k}) for k in range(4)])
        self.published += 4
        return True

    def route(self, conn: sa.Connection, rng: random.Random) -> bool:
        route_batch(self._auto(conn), rng.randint(1, 50))
        conn.commit()
        return True

    def claim(self, conn: sa.Connection, rng: random.Random) -> bool:
        jobs = claim_jobs(self._auto(conn), self.CONSUMERS, rng.randint(1, 20), f"w{threading.get_ident()}")
        conn.commit()
        with self.lock:
            self.held.extend((time.monotonic(), j) for j in jobs)
            self.tally["claimed"] += len(jobs)
        return True

    def heartbeat(self, conn: sa.Connection, rng: random.Random) -> bool:
        with self.lock:
            jobs = [j for _, j in rng.sample(self.held, min(len(self.held), rng.randint(1, 60)))]
        if not jobs:
            return False
        owned = heartbeat_jobs(self._auto(conn), jobs)
        conn.commit()
        with self.lock:
            self.tally["lost"] += len(jobs) - len(owned)
        return True

    def outcomes(self, conn: sa.Connection, rng: random.Random) -> bool:
        # Report claims 0-0.5 s old: many outlived their lease (0.15-0.6 s) unless the
        # heartbeat renewed them, so the reaper and re-claims race these reports.
        age = rng.uniform(0.0, 0.5)
        now = time.monotonic()
        with self.lock:
            rng.shuffle(self.held)
            ripe = [h for h in self.held if now - h[0] >= age][:30]
            taken = {id(h) for h in ripe}
            self.held = [h for h in self.held if id(h) not in taken]
        # A quarter of them stall (a paused worker): reported only a second later, after
        # the reaper has taken most of them back and claimers re-claimed them.
        stalled = [(now + 1.0, j) for _, j in ripe if rng.random() < 0.25]
        with self.lock:
            woken = [j for t, j in self.stalled if t <= now]
            self.stalled = [(t, j) for t, j in self.stalled if t > now] + stalled
        batch = [j for _, j in ripe if (now + 1.0, j) not in stalled] + woken
        if not batch:
            return False
        third = len(batch) // 3
        auto = self._auto(conn)
        changed = len(complete_jobs(auto, batch[:third]))
        changed += len(fail_jobs(auto, [(j, Failure(0.0, rng.random() < 0.2, "Boom")) for j in batch[third:2 * third]]))
        changed += len(release_jobs(auto, batch[2 * third:]))
        conn.commit()
        with self.lock:
            self.tally["stale"] += len(batch) - changed
        return True

    def transactional(self, conn: sa.Connection, rng: random.Random) -> bool:
        with self.lock:
            job = self.held.pop(rng.randrange(len(self.held)))[1] if self.held else None
        if job is None:
            return False
        # A handler's transaction limits its idle time to the job's lease (0.15-0.6 s here);
        # among two dozen threads on two cores this one can be off the CPU longer than that
        # between two statements, and the server then ends the session (the product's guard
        # for a paused handler, tested on its own). This test is about locks, so the actor's
        # transaction idles as a handler's with a longer lease would.
        with conn.begin() as tx:
            if not _transactional_complete(conn, job.replace(lease_seconds=max(job.lease_seconds, 10.0))):
                tx.rollback()
        return True

    def reap(self, conn: sa.Connection, rng: random.Random) -> bool:
        with conn.begin():
            reaped = reap_expired(conn, limit=rng.randint(1, 200))
        with self.lock:
            self.tally["reaped"] += reaped.retried + reaped.dead
        return True


def _stress_registry() -> Outbox:
    """The relays' side of the stress test: handlers that take about as long as their
    lease, so heartbeats, lost leases and stale reports happen all the time."""
    ob = Outbox()
    for consumer, lease in _Actors.CONSUMERS.items():
        lease = max(lease, 0.5)  # the shortest lease a subscriber may declare
        if consumer == "c3":
            @ob.subscriber("stress", consumer=consumer, lease=lease, max_attempts=3, transactional=True)
            def tx_handler(job: Job, session: Any) -> None:
                fenced_write(session, effects, key={"job_id": job.id}, values={}, fence=job.fence)
        else:
            @ob.subscriber("stress", consumer=consumer, lease=lease, max_attempts=3)
            def handler(job: Job, lease: float = lease) -> None:
                job.wait_lease_lost(random.uniform(0, 1.5 * lease))
                if random.random() < 0.3:
                    raise RuntimeError("flaky")  # outcome batches mix completions and failures
    return ob


def test_claim_route_heartbeat_and_reaper_together_never_deadlock(race_engine: sa.Engine, settings: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Two in-process relays (router, claimers, workers, heartbeat, completer, reaper) on
    leases of 0.15-0.6 s, and beside them threads with their own connections doing the
    same statements as fast as they can: a publisher, two routers, three claimers, a
    heartbeat renewing random samples of every claim held, two outcome writers, a
    transactional completer and two reapers. Thousands of iterations: no deadlock
    (40P01) and no database error of any kind in the threads or the relays' logs;
    afterwards every event has one job per consumer, every job ends done or dead,
    attempts stay within bounds and transactional effects exist only for the claim that
    completed the job."""
    from outbox.relay.relay import Relay

    engine = race_engine
    caplog.set_level(logging.WARNING, logger="outbox")
    config = settings(reap_interval=0.05, poll_interval=0.05, concurrency=8, shutdown_grace=1.0,
                      backoff_base=0.01, backoff_cap=0.05)
    relays = [Relay(_stress_registry(), config) for _ in range(2)]
    for relay in relays:
        relay.start()
    iterations = 600 * SCALE
    actors = _Actors(engine, iterations)
    drivers = [("publish", actors.publish), ("route-1", actors.route), ("route-2", actors.route),
               ("claim-1", actors.claim), ("claim-2", actors.claim), ("claim-3", actors.claim),
               ("reap-1", actors.reap), ("reap-2", actors.reap)]
    followers = [("heartbeat", actors.heartbeat), ("outcomes-1", actors.outcomes),
                 ("outcomes-2", actors.outcomes), ("transactional", actors.transactional)]
    actors.expect_followers([name for name, _ in followers])
    drivers_done = threading.Event()
    threads = [threading.Thread(target=actors.run, args=(name, step, seed), name=name)
               for seed, (name, step) in enumerate(drivers)]
    helpers = [threading.Thread(target=actors.run, args=(name, step, 100 + seed, drivers_done), name=name)
               for seed, (name, step) in enumerate(followers)]
    t0 = time.monotonic()
    try:
        for t in threads + helpers:
            t.start()
        for t in threads:
            t.join(600)
        drivers_done.set()
        for t in helpers:
            t.join(60)
    finally:
        actors.stop.set()
        for relay in relays:
            relay.stop(grace=1.0)
    elapsed = time.monotonic() - t0
    assert not actors.errors, actors.errors
    assert all(actors.counts.get(name, 0) >= iterations for name, _ in drivers), actors.counts
    assert all(actors.counts.get(name, 0) >= iterations // 10 for name, _ in followers), actors.counts
    database_errors = [r.getMessage() for r in caplog.records
                       if "database error" in r.getMessage() or "deadlock" in r.getMessage().lower()
                       or "dropping" in r.getMessage()]
    assert not database_errors, database_errors[:5]
    relay_stats = {k: sum(r.runner.stats[k] + r.stats.get(k, 0) if k in r.runner.stats else r.stats[k]
                          for r in relays) for k in ("claimed", "completed", "stale", "lease_lost", "reaped")}
    print(f"{sum(actors.counts.values())} iterations on {len(actors.counts)} threads and 2 relays in "
          f"{elapsed:.1f}s: {actors.counts}; actors {actors.tally}; relays {relay_stats}")
    assert sum(actors.counts.values()) >= 5000
    assert actors.tally["reaped"] and actors.tally["stale"] and actors.tally["lost"]  # the races did happen

    # Drain: route what is left, let every lease expire and finish every job.
    with engine.connect() as conn:
        while route_batch(conn, 500).events:
            conn.commit()
        conn.commit()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second'"
                             " WHERE status = 'running'"))
        reap_expired(conn, limit=1_000_000)
        conn.execute(sa.text("UPDATE outbox_jobs SET run_at = now() WHERE status = 'ready' AND run_at > now()"))
    while True:
        with engine.begin() as conn:
            jobs = claim_jobs(conn, {c: 60.0 for c in _Actors.CONSUMERS}, 5000, "drain")
        if not jobs:
            break
        with engine.begin() as conn:
            complete_jobs(conn, jobs)
    with engine.connect() as c:
        events = c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE routed_at IS NOT NULL")).scalar_one()
        assert events == actors.published
        per_event = c.execute(sa.text(
            "SELECT count(*) FROM (SELECT event_id FROM outbox_jobs GROUP BY event_id"
            " HAVING count(*) <> 3 OR count(DISTINCT consumer) <> 3) x")).scalar_one()
        assert per_event == 0
        statuses = dict(c.execute(sa.text("SELECT status, count(*) FROM outbox_jobs GROUP BY 1")).all())
        assert set(statuses) <= {"done", "dead"} and sum(statuses.values()) == 3 * events, statuses
        assert c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE attempts > max_attempts")).scalar_one() == 0
        # Effects of transactional completions: only where that claim completed the job.
        orphans = c.execute(sa.text(
            "SELECT count(*) FROM race_effects r JOIN outbox_jobs j ON j.id = r.job_id"
            " WHERE j.status <> 'done' OR j.fence <> r.fence")).scalar_one()
        assert orphans == 0
    print(f"{events} events, jobs {statuses}")
