"""Poison rows (:mod:`outbox.db.poison`): one row that makes a batch statement fail with a data
error is confined to itself. A trigger of the test's raises for chosen jobs at a chosen
transition (claim, completion, failure, heartbeat, reaping, routing) or a foreign key
keeps an event from being pruned; every other job goes on and runs exactly once, and the
poison row is dead-lettered naming the database error, or quarantined where even that
write fails. Real PostgreSQL and real relays throughout."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Job, Outbox
from outbox.db.poison import Quarantine, is_data_error, isolate
from outbox.db.retention import prune
from outbox.relay.maintenance import reap_expired
from outbox.relay.relay import Relay
from outbox.relay.router import route_all, route_round
from outbox.testing import wait_for

from .helpers import publish_events, running_relay, subscribe

TIMEOUT = 20

#: Raises for a job listed in poison_rules when it makes the listed transition:
#: 'running', 'done', 'ready', 'dead' (the new status) or 'lease' (a running job's lease renewed).
TRIGGER = (
    "CREATE TABLE poison_rules (job_id bigint, event_id bigint, transition text)",
    """
CREATE FUNCTION poison_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF EXISTS (SELECT 1 FROM poison_rules WHERE event_id = NEW.event_id AND transition = 'route') THEN
            RAISE EXCEPTION 'poison: event % may not be routed', NEW.event_id;
        END IF;
    ELSIF EXISTS (SELECT 1 FROM poison_rules r WHERE r.job_id = NEW.id AND (
            (r.transition = NEW.status AND OLD.status IS DISTINCT FROM NEW.status)
         OR (r.transition = 'lease' AND OLD.status = 'running' AND NEW.status = 'running'
             AND NEW.lease_until IS DISTINCT FROM OLD.lease_until))) THEN
        RAISE EXCEPTION 'poison: job % may not become %', NEW.id, NEW.status;
    END IF;
    RETURN NEW;
END $$""",
    "CREATE TRIGGER poison BEFORE INSERT OR UPDATE ON outbox_jobs FOR EACH ROW EXECUTE FUNCTION poison_check()",
)


@pytest.fixture
def poison_db(engine):
    with engine.begin() as conn:
        for statement in TRIGGER:
            conn.execute(sa.text(statement))
    return engine


def _poison(engine: sa.Engine, transition: str, job_id: int | None = None, event_id: int | None = None) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO poison_rules VALUES (:j, :e, :t)"), {"j": job_id, "e": event_id, "t": transition})


def _jobs(engine: sa.Engine) -> dict[int, sa.Row]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.text(
            "SELECT id, event_id, consumer, status, attempts, fence, last_error FROM outbox_jobs ORDER BY id"))}


def _app(consumers: list[str], fail: set[int] = frozenset()) -> tuple[Outbox, Counter, threading.Lock]:
    """Lease-mode subscribers on ``t`` counting their runs per job id; a job whose event's
    ``n`` is in ``fail`` raises."""
    ob = Outbox()
    runs: Counter = Counter()
    lock = threading.Lock()
    for consumer in consumers:
        @ob.subscriber("t", consumer=consumer, max_attempts=3)
        def handler(job: Job) -> None:
            with lock:
                runs[job.id] += 1
            if job.payload["n"] in fail:
                raise RuntimeError(f"handler of {job.id} fails")
    return ob, runs, lock


def _routed(engine: sa.Engine, consumers: dict[str, int]) -> dict[str, list[int]]:
    """Subscribe the consumers to ``t``, publish and route as many events as the largest
    count, and leave each consumer that many ready jobs (the rest are marked done); returns
    the ready job ids per consumer, in id order."""
    subscribe(engine, "t", list(consumers))
    publish_events(engine, "t", [{"n": i} for i in range(max(consumers.values()))])
    route_all(engine)
    by_consumer: dict[str, list[int]] = {c: [] for c in consumers}
    for job in _jobs(engine).values():
        by_consumer[job.consumer].append(job.id)
    with engine.begin() as conn:
        for consumer, n in consumers.items():
            conn.execute(sa.text("UPDATE outbox_jobs SET status = 'done', finished_at = now() WHERE id = ANY(:ids)"),
                         {"ids": by_consumer[consumer][n:]})
            by_consumer[consumer] = by_consumer[consumer][:n]
    return by_consumer


def _run_until(engine, relay: Relay, condition, what: str) -> None:
    relay.start()
    try:
        wait_for(condition, timeout=TIMEOUT, what=what)
    finally:
        relay.stop()


# --------------------------------------------------------------------------- unit


def test_isolate_finds_the_failing_items_and_runs_the_rest_once():
    runs: list[tuple[int, ...]] = []

    def run(part):
        if 7 in part or 12 in part:
            raise psycopg.errors.RaiseException("poison")
        runs.append(tuple(part))
        return set(part)

    results, poisoned = isolate(list(range(20)), run)
    assert sorted(i for part in results for i in part) == [i for i in range(20) if i not in (7, 12)]
    assert [item for item, _ in poisoned] == [7, 12]
    done = [i for part in runs for i in part]
    assert len(done) == len(set(done)) == 18  # nothing ran twice


def test_isolate_raises_errors_that_are_not_about_the_data():
    def run(part):
        raise psycopg.errors.AdminShutdown("server going away")

    with pytest.raises(psycopg.errors.AdminShutdown):
        isolate([1, 2, 3], run)

    def empty(part):
        raise psycopg.errors.RaiseException("not about a row")

    with pytest.raises(psycopg.errors.RaiseException):  # no rows to blame: the statement itself fails
        isolate([], empty)
    assert is_data_error(psycopg.errors.CheckViolation("x")) and not is_data_error(psycopg.errors.DeadlockDetected("x"))


# ------------------------------------------------------------------ the dispatcher


def test_a_job_whose_claim_fails_is_dead_lettered_and_the_others_run(poison_db, settings):
    """Issue scenario: consumers c (20 jobs) and d (10); c's head job raises inside the claim.
    Before: every claim failed and nothing ran again (0/29). Now: that job is dead with the
    trigger's error, never run; the 29 others run exactly once."""
    engine = poison_db
    jobs = _routed(engine, {"c": 20, "d": 10})
    head = jobs["c"][0]
    _poison(engine, "running", job_id=head)
    ob, runs, _ = _app(["c", "d"])
    others = set(jobs["c"][1:] + jobs["d"])
    _run_until(engine, Relay(ob, settings(concurrency=2, listen=False)),
               lambda: all(_jobs(engine)[i].status == "done" for i in others) and _jobs(engine)[head].status == "dead",
               "every other job done and the poison job dead")
    row = _jobs(engine)[head]
    assert row.attempts == 0 and "poison: job" in row.last_error and "RaiseException" in row.last_error
    assert runs[head] == 0 and all(runs[i] == 1 for i in others)


def test_a_job_whose_completion_fails_is_dead_lettered_and_nothing_runs_twice(poison_db, settings):
    """The trigger raises when one job becomes done. Before: every batch's completions
    failed together and were dropped after three tries, and the other jobs ran again
    (72-86 runs for 19 jobs). Now: that job is dead naming the error; every job ran once."""
    engine = poison_db
    jobs = _routed(engine, {"c": 20})
    bad = jobs["c"][5]
    _poison(engine, "done", job_id=bad)
    ob, runs, _ = _app(["c"])
    _run_until(engine, Relay(ob, settings(concurrency=4, listen=False)),
               lambda: {r.status for i, r in _jobs(engine).items() if i in jobs["c"] and i != bad} == {"done"}
               and _jobs(engine)[bad].status == "dead", "the others done and the poison job dead")
    row = _jobs(engine)[bad]
    assert row.last_error.startswith("Completing failed for this job: RaiseException [P0001]: poison: job")
    assert all(runs[i] == 1 for i in jobs["c"]), runs


def test_a_failed_attempt_that_cannot_be_recorded_is_dead_lettered(poison_db, settings):
    """A handler fails, and the trigger refuses that job's way back to ready: the fail
    statement's error is confined to it (dead, naming the error); the others are done."""
    engine = poison_db
    jobs = _routed(engine, {"c": 8})
    bad = jobs["c"][2]
    _poison(engine, "ready", job_id=bad)
    ob, runs, _ = _app(["c"], fail={2})
    _run_until(engine, Relay(ob, settings(concurrency=2, listen=False)),
               lambda: _jobs(engine)[bad].status == "dead"
               and all(_jobs(engine)[i].status == "done" for i in jobs["c"] if i != bad),
               "the others done and the poison job dead")
    assert "Recording a failed attempt failed for this job" in _jobs(engine)[bad].last_error
    assert runs[bad] == 1 and all(runs[i] == 1 for i in jobs["c"])


def test_a_job_that_can_be_neither_claimed_nor_dead_lettered_is_quarantined(poison_db, settings, caplog):
    caplog.set_level(logging.INFO)
    engine = poison_db
    jobs = _routed(engine, {"c": 6})
    head = jobs["c"][0]
    _poison(engine, "running", job_id=head)
    _poison(engine, "dead", job_id=head)
    ob, runs, _ = _app(["c"])
    relay = Relay(ob, settings(concurrency=2, listen=False))
    _run_until(engine, relay, lambda: all(_jobs(engine)[i].status == "done" for i in jobs["c"][1:]),
               "every other job done")
    assert _jobs(engine)[head].status == "ready" and runs[head] == 0  # untouched, nothing lost
    assert len(relay.runner.producer.quarantine) == 1
    assert sum("quarantined" in r.message for r in caplog.records) == 1


def test_a_heartbeat_that_fails_for_one_job_dead_letters_it_and_renews_the_rest(poison_db, settings):
    engine = poison_db
    jobs = _routed(engine, {"c": 3})
    bad = jobs["c"][1]
    _poison(engine, "lease", job_id=bad)
    gate = threading.Event()
    ob = Outbox()
    seen: list[Job] = []

    @ob.subscriber("t", consumer="c", lease=0.6)
    def handler(job: Job) -> None:
        seen.append(job)
        gate.wait(TIMEOUT)

    with running_relay(ob, settings(concurrency=3, listen=False, reap_interval=0.1)):
        try:
            wait_for(lambda: _jobs(engine)[bad].status == "dead", timeout=TIMEOUT, what="the poison job dead")
            wait_for(lambda: len(seen) == 3, timeout=TIMEOUT, what="three handlers running")
            lost = {j.id for j in seen if j.lease_lost}
            assert lost == {bad}  # the other two kept their leases through the heartbeats
            assert "Renewing the lease failed for this job" in _jobs(engine)[bad].last_error
        finally:
            gate.set()
    assert {i: _jobs(engine)[i].status for i in jobs["c"] if i != bad} == {i: "done" for i in jobs["c"] if i != bad}


# ------------------------------------------------------------ reaper, router, pruner


def test_the_reaper_dead_letters_a_job_it_cannot_take_back_and_reaps_the_rest(poison_db):
    engine = poison_db
    jobs = _routed(engine, {"c": 5})
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'running', attempts = 1, fence = id,"
                             " lease_until = now() - interval '1 second' WHERE id = ANY(:ids)"), {"ids": jobs["c"]})
    bad = jobs["c"][3]
    _poison(engine, "ready", job_id=bad)
    quarantine = Quarantine("job")
    with engine.begin() as conn:
        result = reap_expired(conn, quarantine=quarantine)
    assert result.retried == 4
    rows = _jobs(engine)
    assert rows[bad].status == "dead" and "Reaping failed for this job" in rows[bad].last_error
    assert all(rows[i].status == "ready" for i in jobs["c"] if i != bad)

    # Where even dead-lettering fails, the job is quarantined and left running, unchanged.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'running', lease_until = now() - interval '1 second',"
                             " finished_at = NULL WHERE id = :id"), {"id": bad})
    _poison(engine, "dead", job_id=bad)
    with engine.begin() as conn:
        assert reap_expired(conn, quarantine=quarantine).retried == 0
    assert _jobs(engine)[bad].status == "running" and quarantine.ids() == [bad]
    with engine.begin() as conn:  # skipped by later rounds: no statement fails again
        assert reap_expired(conn, quarantine=quarantine).retried == 0


def test_the_router_quarantines_an_event_it_cannot_route_and_routes_the_others(poison_db):
    engine = poison_db
    subscribe(engine, "t", ["c", "d"])
    ids = publish_events(engine, "t", [{"n": i} for i in range(10)])
    _poison(engine, "route", event_id=ids[4])
    quarantine = Quarantine("event")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        result = route_round(conn, 500, quarantine)
        assert result.jobs == 18
        assert route_round(conn, 500, quarantine).events == 0  # the poison event is skipped now
    assert quarantine.ids() == [ids[4]]
    with engine.connect() as conn:
        unrouted = conn.execute(sa.text("SELECT id FROM outbox_events WHERE routed_at IS NULL")).scalars().all()
    assert unrouted == [ids[4]]  # kept, unrouted: nothing lost


def test_the_pruner_keeps_an_event_it_cannot_delete_and_prunes_the_others(poison_db):
    engine = poison_db
    subscribe(engine, "t", ["c"])
    ids = publish_events(engine, "t", [{"n": i} for i in range(6)])
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_events SET routed_at = now() - interval '1 hour'"))
        conn.execute(sa.text("CREATE TABLE audit (event_id bigint REFERENCES outbox_events (id))"))
        conn.execute(sa.text("INSERT INTO audit VALUES (:id)"), {"id": ids[2]})
    quarantine = Quarantine("row")
    with engine.begin() as conn:
        assert prune(conn, 60, 60, quarantine=quarantine) == (0, 5)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM outbox_events")).scalars().all() == [ids[2]]
    assert quarantine.ids() == [ids[2]]


# ------------------------------------------------ errors that come and go, or never go


def test_a_row_that_fails_only_sometimes_is_tried_again_not_dead_lettered(poison_db, settings):
    """The trigger refuses job X's completion the first three times it is asked (the batch
    statement, then X alone twice), then lets it through: X is tried alone up to three
    times, so it ends done, having run once, instead of being dead-lettered for an error
    that went away (adversary: a trigger failing at random dead-lettered 6 of 400 jobs
    whose handler had succeeded)."""
    engine = poison_db
    [job] = _routed(engine, {"c": 1})["c"]
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE SEQUENCE flaky"))
        conn.execute(sa.text("""
            CREATE FUNCTION flaky_check() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.status = 'done' AND nextval('flaky') <= 3 THEN
                    RAISE EXCEPTION 'flaky: not now (job %)', NEW.id;
                END IF;
                RETURN NEW;
            END $$"""))
        conn.execute(sa.text("CREATE TRIGGER flaky BEFORE UPDATE ON outbox_jobs FOR EACH ROW EXECUTE FUNCTION flaky_check()"))
    ob, runs, _ = _app(["c"])
    _run_until(engine, Relay(ob, settings(concurrency=1, prefetch=0, listen=False)),
               lambda: _jobs(engine)[job].status in ("done", "dead"), "the job finished")
    assert _jobs(engine)[job].status == "done" and runs[job] == 1


def test_a_claim_that_fails_for_every_job_pauses_claiming_and_buries_nothing(poison_db, settings, caplog):
    """A trigger that refuses every claim is not a poison row: no job is dead-lettered
    (adversary: 400 of 400 were), claiming pauses with backoff and says so once, and once
    the trigger is gone every job runs."""
    caplog.set_level(logging.INFO)
    engine = poison_db
    jobs = _routed(engine, {"c": 20})["c"]
    for job_id in jobs:
        _poison(engine, "running", job_id=job_id)
    ob, runs, _ = _app(["c"])
    with running_relay(ob, settings(concurrency=2, listen=False, reconnect_max=0.5)):
        wait_for(lambda: any("claiming paused" in r.message for r in caplog.records), timeout=TIMEOUT,
                 what="the pause to be logged")
        assert {r.status for r in _jobs(engine).values() if r.id in jobs} == {"ready"}
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM poison_rules"))
        wait_for(lambda: all(_jobs(engine)[i].status == "done" for i in jobs), timeout=TIMEOUT, what="every job done")
    assert sum("claiming paused" in r.message for r in caplog.records) == 1
    assert all(runs[i] == 1 for i in jobs) and all(_jobs(engine)[i].last_error is None for i in jobs)


def test_routing_that_fails_for_every_event_quarantines_none(poison_db):
    """A trigger that refuses every job insert: the router backs off instead of
    quarantining every event one by one (adversary: 11,500 ERROR lines in 90 s)."""
    from outbox.db.poison import SystemicError

    engine = poison_db
    subscribe(engine, "t", ["c"])
    ids = publish_events(engine, "t", [{"n": i} for i in range(20)])
    for event_id in ids:
        _poison(engine, "route", event_id=event_id)
    quarantine = Quarantine("event")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(SystemicError):
            route_round(conn, 500, quarantine)
    assert len(quarantine) == 0
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM poison_rules"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert route_round(conn, 500, quarantine).jobs == 20
