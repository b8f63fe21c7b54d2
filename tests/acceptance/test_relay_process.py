"""The relay as a process (``python -m outbox.ops.cli run --app relayapp:ob``): end to end, the
log lines worth knowing, SIGTERM drain and release, and lost database connections."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import publish
from outbox.relay.maintenance import reap_expired
from outbox.testing import wait_for

APP = '''
"""A small application for the relay process tests: every handler run is written to
table ``runs`` (start and end), so the test sees what ran, where and with which fence."""
import os
import time

import sqlalchemy as sa

from outbox import Job, Outbox, PermanentError
from outbox.db.engine import make_engine

ob = Outbox()
_engine = None


def record(job: Job, phase: str) -> None:
    global _engine
    if _engine is None:
        _engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=4, application_name="test-app")
    with _engine.begin() as c:
        c.execute(sa.text("INSERT INTO runs (job_id, attempt, fence, phase, pid) VALUES (:j, :a, :f, :p, :pid)"),
                  {"j": job.id, "a": job.attempt, "f": job.fence, "p": phase, "pid": os.getpid()})


@ob.subscriber("work", consumer="worker", max_attempts=5)
def work(job: Job) -> None:
    record(job, "start")
    seconds = job.payload.get("sleep", 0)
    if os.environ.get("APP_BLOCK") == "1":
        seconds = job.payload.get("block", seconds)
    time.sleep(seconds)  # simulated work; SIGTERM must let it finish or release it
    record(job, "end")


@ob.subscriber("sticky", consumer="sticky", lease=1.5, max_attempts=5)
def sticky(job: Job) -> None:
    record(job, "start")
    if job.attempt == 1:
        job.wait_lease_lost(20)  # a worker stuck until the relay tells it the lease is gone
    record(job, "end")


@ob.subscriber("suicide", consumer="suicide", lease=1, max_attempts=3)
def suicide(job: Job) -> None:
    record(job, "start")
    os.kill(os.getpid(), 9)  # a handler that takes its process down, every time


@ob.subscriber("late_bomb", consumer="late_bomb", lease=1, max_attempts=3)
def late_bomb(job: Job) -> None:
    record(job, "start")
    if job.attempt == 1:
        time.sleep(job.payload["after"])
        os.kill(os.getpid(), 9)  # a handler that takes its process down a moment after it started
    record(job, "end")


@ob.subscriber("poison", consumer="poison", max_attempts=5)
def poison(job: Job) -> None:
    raise PermanentError(f"order {job.payload['order']} cannot be handled")
'''


class RelayProcess:
    """One ``outbox-relay run`` subprocess; its log goes to a file."""

    def __init__(self, cwd: Path, url: str, name: str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.log_path = cwd / f"{name}.log"
        self._log = open(self.log_path, "wb")
        environ = {**os.environ, "OUTBOX_DATABASE_URL": url, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ.pop("OUTBOX_TEST_DATABASE_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.ops.cli", "run", "--app", "relayapp:ob", "--reap-interval", "0.2", *flags],
            cwd=cwd, env=environ, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self) -> None:
        wait_for(lambda: "relay started" in self.log or self.proc.poll() is not None, timeout=20, what="relay start")
        assert self.proc.poll() is None, self.log

    def terminate(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def relays(tmp_path: Path, db_url: URL) -> Iterator:
    (tmp_path / "relayapp.py").write_text(textwrap.dedent(APP))
    url = db_url.render_as_string(hide_password=False)
    started: list[RelayProcess] = []

    def start(*flags: str, env: dict[str, str] | None = None, wait: bool = True) -> RelayProcess:
        relay = RelayProcess(tmp_path, url, f"relay{len(started)}", *flags, env=env)
        started.append(relay)
        if wait:
            relay.wait_started()
        return relay

    yield start
    for relay in started:
        relay.kill()


@pytest.fixture
def runs(engine):
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE runs (id bigserial PRIMARY KEY, job_id bigint, attempt int, fence bigint,"
                          " phase text, pid int)"))

    def rows(phase: str | None = None) -> list[tuple]:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(sa.text(
                "SELECT job_id, attempt, fence, phase, pid FROM runs WHERE CAST(:p AS text) IS NULL OR phase = :p ORDER BY id"),
                {"p": phase})]

    return rows


def _publish(engine: sa.Engine, topic: str, payloads: list[dict]) -> list[int]:
    with Session(engine) as s, s.begin():
        return [publish(s, topic, p) for p in payloads]


def _jobs(engine: sa.Engine, consumer: str | None = None) -> list[dict]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT * FROM outbox_jobs WHERE CAST(:c AS text) IS NULL OR consumer = :c ORDER BY id"),
            {"c": consumer}).mappings()]


def _all(engine: sa.Engine, consumer: str, status: str, n: int) -> bool:
    jobs = _jobs(engine, consumer)
    return len(jobs) == n and all(j["status"] == status for j in jobs)


# ---------------------------------------------------------------------------- tests


def test_relay_process_runs_events_end_to_end_and_logs_state_changes(engine, relays, runs):
    relay = relays("--concurrency", "4")
    assert "relay started" in relay.log
    _publish(engine, "work", [{"n": i} for i in range(20)])
    _publish(engine, "poison", [{"order": 7}])
    [sticky_event] = _publish(engine, "sticky", [{"n": 0}])

    wait_for(lambda: _all(engine, "worker", "done", 20), timeout=20, what="20 worker jobs done")
    wait_for(lambda: _all(engine, "poison", "dead", 1), timeout=20, what="poison job dead")
    [dead] = _jobs(engine, "poison")
    assert dead["attempts"] == 1 and "PermanentError: order 7 cannot be handled" in dead["last_error"]
    wait_for(lambda: "dead-lettered job" in relay.log, timeout=10, what="dead-letter log line")
    worker_ids = sorted(x["id"] for x in _jobs(engine, "worker"))
    assert sorted(r[0] for r in runs("end") if r[0] in worker_ids) == worker_ids  # each ran once

    # Take the sticky job's lease away (as if its worker had paused): the relay's heartbeat
    # notices, tells the handler and logs it; the re-claim finishes the job.
    wait_for(lambda: _all(engine, "sticky", "running", 1), timeout=10, what="sticky job claimed")
    [job] = _jobs(engine, "sticky")
    wait_for(lambda: (job["id"], 1, job["fence"], "start") in [r[:4] for r in runs()], timeout=10,
             what="sticky handler running")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second' WHERE id = :id"),
                     {"id": job["id"]})
        assert reap_expired(conn).retried == 1
    wait_for(lambda: f"lease lost on 1 job (sticky 1; id {job['id']})" in relay.log, timeout=10,
             what="lease lost log line")
    wait_for(lambda: _all(engine, "sticky", "done", 1), timeout=10, what="sticky job done")
    [done] = _jobs(engine, "sticky")
    assert done["attempts"] == 2 and done["fence"] > job["fence"]

    assert relay.terminate(timeout=15) == 0, relay.log
    assert "Traceback" not in relay.log, relay.log


@pytest.mark.slow
def test_sigterm_lets_in_flight_jobs_finish_and_exits_0(engine, relays, runs):
    relay = relays("--concurrency", "4", "--shutdown-grace", "10")
    ids = _publish(engine, "work", [{"sleep": 1.5} for _ in range(4)])
    wait_for(lambda: len(runs("start")) == 4, timeout=15, what="4 handlers running")
    t0 = time.monotonic()
    assert relay.terminate(timeout=15) == 0, relay.log
    assert time.monotonic() - t0 < 10
    assert len(runs("end")) == 4
    jobs = _jobs(engine, "worker")
    assert [j["id"] for j in jobs] == sorted(r[0] for r in runs("end"))
    assert [j["status"] for j in jobs] == ["done"] * 4 and [j["attempts"] for j in jobs] == [1] * 4
    assert sorted(j["event_id"] for j in jobs) == ids
    assert "SIGTERM received" in relay.log and "released" not in relay.log.split("SIGTERM received")[1].split(
        "relay stopped")[0]


@pytest.mark.slow
def test_sigterm_releases_a_job_running_past_the_grace_so_another_relay_takes_it_at_once(engine, relays, runs):
    first = relays("--concurrency", "2", "--shutdown-grace", "1", env={"APP_BLOCK": "1"})
    _publish(engine, "work", [{"block": 60}])
    wait_for(lambda: len(runs("start")) == 1, timeout=15, what="handler running")
    [claimed] = _jobs(engine, "worker")
    t0 = time.monotonic()
    assert first.terminate(timeout=15) == 0, first.log
    assert time.monotonic() - t0 < 8
    assert "released 1 jobs" in first.log
    [job] = _jobs(engine, "worker")
    assert (job["status"], job["attempts"], job["lease_until"]) == ("ready", 0, None)  # attempt not counted
    assert job["fence"] == claimed["fence"]
    with engine.connect() as c:
        assert job["run_at"] <= c.execute(sa.text("SELECT now()")).scalar_one()

    # A second relay picks it up at once (no lease to wait out) and finishes it.
    t1 = time.monotonic()
    second = relays("--concurrency", "2")
    wait_for(lambda: _all(engine, "worker", "done", 1), timeout=10, what="job done by the second relay")
    assert time.monotonic() - t1 < 10
    [job] = _jobs(engine, "worker")
    assert job["attempts"] == 1 and job["fence"] > claimed["fence"]
    assert [r[4] for r in runs("end")] == [second.proc.pid]
    assert second.terminate(timeout=15) == 0


def _backends(engine: sa.Engine, db: str) -> dict[str, set[int]]:
    with engine.connect() as c:
        rows = c.execute(sa.text(
            "SELECT application_name, pid FROM pg_stat_activity"
            " WHERE datname = :db AND application_name IN ('outbox-relay', 'outbox-listener')"), {"db": db}).all()
    found: dict[str, set[int]] = {"outbox-relay": set(), "outbox-listener": set()}
    for name, pid in rows:
        found[name].add(pid)
    return found


@pytest.mark.slow
def test_relay_survives_lost_connections_and_listen_comes_back(engine, db_url, relays, runs):
    # A long poll interval: only NOTIFY can make new events run within a few seconds.
    relay = relays("--concurrency", "2", "--poll-interval", "30")
    db = db_url.database
    wait_for(lambda: _backends(engine, db)["outbox-listener"], timeout=10, what="listener connected")
    _publish(engine, "work", [{"n": 1}])
    wait_for(lambda: _all(engine, "worker", "done", 1), timeout=5, what="first event handled via NOTIFY")

    before = _backends(engine, db)
    assert before["outbox-relay"] and len(before["outbox-listener"]) == 1
    with engine.connect() as c:
        killed = c.execute(sa.text(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = :db AND application_name IN ('outbox-relay', 'outbox-listener')"), {"db": db}).scalar()
    assert killed == len(before["outbox-relay"]) + 1

    wait_for(lambda: (_backends(engine, db)["outbox-listener"] - before["outbox-listener"]), timeout=15,
             what="a new LISTEN connection")
    t0 = time.monotonic()
    _publish(engine, "work", [{"n": 2}, {"n": 3}])
    wait_for(lambda: _all(engine, "worker", "done", 3), timeout=5, what="events after the reconnect handled")
    assert time.monotonic() - t0 < 5
    assert relay.proc.poll() is None
    assert "LISTEN connection lost" in relay.log and "listening again" in relay.log
    assert relay.terminate(timeout=15) == 0, relay.log


def test_stopped_relay_leaves_no_thread_or_connection_behind(engine, db_url, settings):
    """``Relay.stop()`` returns once every thread that talks to the database is gone, so
    an application (or its tests) can drop or migrate the database right after."""
    from outbox import Outbox
    from outbox.relay.relay import Relay

    ob = Outbox()
    ob.subscriber("work", consumer="worker")(lambda job: None)
    relay = Relay(ob, settings())
    relay.start()
    wait_for(lambda: relay.listener.connected.is_set(), timeout=10, what="listener connected")
    wait_for(lambda: _backends(engine, db_url.database)["outbox-listener"], timeout=10, what="LISTEN backend")
    relay.stop()
    assert not relay.listener._thread.is_alive()
    assert relay.engine.pool.checkedout() == 0
    # Backends exit a moment after their client closed; a listener still connected would
    # stay for as long as it waits for notifications.
    wait_for(lambda: not any(_backends(engine, db_url.database).values()), timeout=0.5, interval=0.02,
             what="no relay backend left")


# ----------------------------------------------------------- attempts and crashes


def test_kill_9_charges_an_attempt_only_to_jobs_whose_handler_started(engine, relays, runs):
    """A relay SIGKILLed with two handlers running and ten claims in its prefetch buffer:
    the reaper charges the two that started and gives the ten their attempt back."""
    relay = relays("--concurrency", "2", "--prefetch", "10", "--claim-batch", "12", env={"APP_BLOCK": "1"})
    _publish(engine, "work", [{"block": 60} for _ in range(20)])
    wait_for(lambda: len(runs("start")) == 2 and _count(engine, "running") == 12, timeout=20,
             what="2 handlers running and 10 claims buffered")
    started = {r[0] for r in runs("start")}
    relay.kill()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET lease_until = now() - interval '1 second'"
                             " WHERE status = 'running'"))
        reaped = reap_expired(conn)
    assert (reaped.retried, reaped.unstarted, reaped.dead) == (2, 10, 0)
    jobs = {j["id"]: j for j in _jobs(engine, "worker")}
    charged = {i for i, j in jobs.items() if j["attempts"] == 1}
    assert charged == started
    assert all(j["status"] == "ready" for j in jobs.values())
    assert all(jobs[i]["last_error"].startswith("LeaseExpired") for i in started)
    assert all(j["attempts"] == 0 and j["last_error"] is None for i, j in jobs.items() if i not in started)


@pytest.mark.slow
def test_a_handler_that_kills_its_process_is_charged_each_start_and_ends_dead(engine, relays, runs):
    """The one job whose handler SIGKILLs its relay is charged at every start and ends dead
    after max_attempts (3); the jobs buffered behind it at each crash are never charged."""
    [bomb] = _publish(engine, "suicide", [{"n": 0}])
    _publish(engine, "work", [{"n": i} for i in range(10)])
    for _ in range(6):
        if _all(engine, "suicide", "dead", 1):
            break
        relay = relays("--concurrency", "1", "--prefetch", "5", "--claim-batch", "6", "--default-lease", "1.5",
                       wait=False)
        wait_for(lambda: relay.proc.poll() is not None or _all(engine, "suicide", "dead", 1), timeout=30,
                 what="the relay to die or the suicide job to be dead")
        relay.kill()
    wait_for(lambda: _all(engine, "suicide", "dead", 1), timeout=20, what="the suicide job dead")
    [dead] = _jobs(engine, "suicide")
    assert dead["attempts"] == 3 and dead["last_error"].startswith("LeaseExpired")
    assert sorted(r[1] for r in runs("start") if r[0] == dead["id"]) == [1, 2, 3]
    relay = relays("--concurrency", "2", "--default-lease", "1.5")
    wait_for(lambda: _all(engine, "worker", "done", 10), timeout=20, what="the work jobs done")
    assert [j["attempts"] for j in _jobs(engine, "worker")] == [1] * 10
    assert relay.terminate(timeout=15) == 0, relay.log


def test_a_finished_jobs_outcome_is_not_held_by_the_wake_up_cooldown(engine, relays, runs):
    """The wake-up cooldown batches claims, never outcomes: with a cooldown of 1 s, job A's
    handler returns at once and job B's SIGKILLs the relay 0.3 s after it started (both
    claimed in one round, which began the cooldown). A's outcome was written before the
    kill, so A is done and never runs again; held for the cooldown, it died with the
    process and A stayed running until its lease ran out, to be run again (issue 26, item 8)."""
    relay = relays("--concurrency", "2", "--wake-cooldown", "1")
    with Session(engine) as s, s.begin():  # one transaction: one routing round, one claim
        publish(s, "work", {"n": 1})
        publish(s, "late_bomb", {"after": 0.3})
    wait_for(lambda: relay.proc.poll() is not None, timeout=20, what="the late bomb to kill its relay")
    [a] = _jobs(engine, "worker")
    [b] = _jobs(engine, "late_bomb")
    # A's handler ran once and returned before the kill; B's started once.
    assert sorted((r[0], r[3]) for r in runs()) == sorted([(a["id"], "start"), (a["id"], "end"), (b["id"], "start")])
    assert (a["status"], a["attempts"]) == ("done", 1), a
    assert b["status"] == "running", b


def _count(engine: sa.Engine, status: str) -> int:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status = :s"), {"s": status}).scalar_one()
