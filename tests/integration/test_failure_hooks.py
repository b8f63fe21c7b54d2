"""Failure hooks (``on_dead``, ``on_retry``) on a real PostgreSQL: the triggers of migration
0013 write a due call for exactly the changes that call a hook, whichever statement makes
them (the relay's own statements, run here one by one), and only for consumers declaring
the hook; a running relay calls each hook once with the job and its error, for a death by
failure, PermanentError, dead_on, the reaper and an operator's SQL; a retry calls on_retry;
a hook that raises is called again, then given up, and never changes its job; a hook that
hangs past ``hook_timeout`` counts as failed; async hooks run; a relay in a non-public
schema calls its own. A relay killed during a call: tests/acceptance/test_hook_faults.py."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Backoff, JobFailure, Outbox, PermanentError, Snooze
from outbox.db.jobs import claim_jobs, fail_jobs, relay_seen, release_jobs, snooze_jobs
from outbox.relay import hooks as hook_runner
from outbox.relay.maintenance import reap_expired
from outbox.relay.outcomes import Failure, Snoozed
from outbox.relay.router import register_subscriptions, route_all
from outbox.settings import OutboxSettings
from outbox.testing import wait_for
from tests.integration.helpers import expire_lease, publish_events, running_relay

TIMEOUT = 20


def hook_rows(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT job_id, event_id, consumer, hook, attempt, max_attempts, error, calls, done, last_error "
            "FROM outbox_hook_calls ORDER BY id")).mappings()]


def status(engine: sa.Engine, job_id: int) -> str:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT status FROM outbox_jobs WHERE id = :id"), {"id": job_id}).scalar_one()


class Recorder:
    """A hook recording each JobFailure it is given (thread-safe)."""

    def __init__(self, fail_first: int = 0, exc: BaseException | None = None) -> None:
        self.calls: list[JobFailure] = []
        self.fail_first = fail_first
        self.exc = exc or RuntimeError("chat service down")
        self._lock = threading.Lock()

    def __call__(self, failure: JobFailure) -> None:
        with self._lock:
            self.calls.append(failure)
            n = len(self.calls)
        if n <= self.fail_first:
            raise self.exc


# ----------------------------------------------------------------------- the triggers


def test_the_triggers_write_a_call_for_deaths_and_failed_attempts_only(engine):
    """Every statement that moves a job running -> ready or to dead, run as the relay runs it:
    a failure with attempts left and a started claim reaped are retries; a release, a snooze
    and an unstarted claim reaped give the attempt back and call nothing; a failure on the
    last attempt, a PermanentError, a reaped last attempt and an operator's SQL are deaths;
    a redrive and a cancel call nothing; a consumer without hooks gets no row."""
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=2)(lambda job: None)
    ob.subscriber("t", consumer="quiet", max_attempts=1)(lambda job: None)
    ob.on_dead("c")(lambda failure: None)
    ob.on_retry("c")(lambda failure: None)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    publish_events(engine, "t", [{"n": i} for i in range(8)])
    route_all(engine)
    leases = {"c": 30.0}

    def claim(consumer: str = "c", job_id: int | None = None) -> Any:
        with engine.begin() as conn:
            if job_id is not None:  # first in claim order
                conn.execute(sa.text("UPDATE outbox_jobs SET run_at = '2000-01-01' WHERE id = :id"), {"id": job_id})
            [job] = claim_jobs(conn, {consumer: 30.0}, 1, "test:1:a")
        assert job_id is None or job.id == job_id
        return job

    def fail(job: Any, permanent: bool = False) -> None:
        with engine.begin() as conn:
            assert fail_jobs(conn, [(job, Failure(delay=0.0, permanent=permanent, error=f"boom {job.id}"))])

    job = claim()
    with engine.begin() as conn:
        assert release_jobs(conn, [job]) == {job.id}
    job = claim()
    with engine.begin() as conn:
        assert snooze_jobs(conn, [(job, Snoozed(0.0))]) == {job.id}
    assert hook_rows(engine) == []  # released, snoozed: the attempt given back, no hook

    job = claim()
    fail(job)  # attempt 1 of 2: back to ready, a retry
    [retry] = hook_rows(engine)
    assert {k: retry[k] for k in ("job_id", "event_id", "consumer", "hook", "attempt", "max_attempts", "error",
                                  "calls", "done")} == {
        "job_id": job.id, "event_id": job.event_id, "consumer": "c", "hook": "retry", "attempt": 1,
        "max_attempts": 2, "error": f"boom {job.id}", "calls": 0, "done": []}
    job = claim(job_id=job.id)
    assert job.attempt == 2
    fail(job)  # the last attempt: dead
    assert [(r["job_id"], r["hook"], r["attempt"]) for r in hook_rows(engine)[1:]] == [(job.id, "dead", 2)]
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_hook_calls"))

    job = claim()
    fail(job, permanent=True)
    assert [(r["job_id"], r["hook"], r["attempt"]) for r in hook_rows(engine)] == [(job.id, "dead", 1)]
    with engine.begin() as conn:  # a redrive: dead -> ready calls nothing
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'ready', attempts = 0, finished_at = NULL "
                             "WHERE id = :id"), {"id": job.id})
        conn.execute(sa.text("DELETE FROM outbox_hook_calls"))

    # the reaper: an unstarted claim (listed as buffered by its relay) gets its attempt back
    # and calls nothing; a started one is a retry, or a death on its last attempt
    unstarted = claim()
    with engine.begin() as conn:
        relay_seen(conn, "test:1:a", [unstarted.fence])
        expire_lease(conn, unstarted.id)
    with engine.begin() as conn:
        reaped = reap_expired(conn)
    assert (reaped.unstarted, hook_rows(engine)) == (1, [])
    with engine.begin() as conn:
        relay_seen(conn, "test:1:a", [])
    started = claim(job_id=unstarted.id)
    assert started.attempt == 1
    with engine.begin() as conn:
        expire_lease(conn, started.id)
    with engine.begin() as conn:
        assert reap_expired(conn).retried == 1
    again = claim(job_id=started.id)
    assert again.attempt == 2
    with engine.begin() as conn:
        expire_lease(conn, again.id)
    with engine.begin() as conn:
        assert reap_expired(conn).dead == 1
    rows = hook_rows(engine)
    assert [(r["job_id"], r["hook"], r["attempt"]) for r in rows] == [(started.id, "retry", 1), (started.id, "dead", 2)]
    assert rows[1]["error"].startswith("LeaseExpired: lease expired")
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_hook_calls"))

    # any path to dead: an operator's SQL on a ready job (what a poison burial does)
    with engine.begin() as conn:
        ready = conn.execute(sa.text("SELECT id FROM outbox_jobs WHERE consumer = 'c' AND status = 'ready' "
                                     "ORDER BY id LIMIT 1")).scalar_one()
        conn.execute(sa.text("UPDATE outbox_jobs SET status = 'dead', last_error = 'buried', finished_at = now() "
                             "WHERE id = :id"), {"id": ready})
        conn.execute(sa.text("UPDATE outbox_jobs SET last_error = 'again' WHERE id = :id"), {"id": ready})
    assert [(r["job_id"], r["hook"], r["error"]) for r in hook_rows(engine)] == [(ready, "dead", "buried")]

    # a consumer without hooks: its deaths write nothing
    quiet = claim("quiet")
    fail(quiet)
    assert status(engine, quiet.id) == "dead"
    assert len(hook_rows(engine)) == 1
    del leases


def test_a_consumer_declaring_only_on_dead_gets_no_retry_rows(engine):
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=3)(lambda job: None)
    ob.on_dead("c")(lambda failure: None)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    publish_events(engine, "t", [{}])
    route_all(engine)
    with engine.begin() as conn:
        [job] = claim_jobs(conn, {"c": 30.0}, 1, "test:1:a")
        fail_jobs(conn, [(job, Failure(delay=0.0, permanent=False, error="x"))])
    assert hook_rows(engine) == []


# ------------------------------------------------------------------ a relay calls them


def test_a_dead_job_calls_on_dead_once_with_the_job_and_its_error(engine, settings):
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="receipts", max_attempts=1)
    def receipts(job) -> None:
        raise RuntimeError(f"mail server refused order {job.payload['order']}")

    @ob.subscriber("order.placed", consumer="poison", max_attempts=5)
    def poison(job) -> None:
        raise PermanentError("cannot be handled")

    @ob.subscriber("order.placed", consumer="strict", max_attempts=5, dead_on=KeyError)
    def strict(job) -> None:
        raise KeyError("missing")

    @ob.subscriber("order.placed", consumer="fine")
    def fine(job) -> None:
        return None

    everywhere, receipts_only = Recorder(), Recorder()
    ob.on_dead()(everywhere)
    ob.on_dead("receipts")(receipts_only)
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT outbox_publish('order.placed', '{\"order\": 4}'::jsonb, 'order:4', "
                             "'{\"traceparent\": \"x\"}'::jsonb)"))
    with running_relay(ob, settings()) as relay:
        wait_for(lambda: len(everywhere.calls) == 3 and receipts_only.calls and not hook_rows(engine),
                 timeout=TIMEOUT, what="the dead hooks")
        assert relay.hooks is not None
    assert sorted(f.consumer for f in everywhere.calls) == ["poison", "receipts", "strict"]
    [failure] = receipts_only.calls
    with engine.connect() as c:
        job_id, event_id = c.execute(sa.text("SELECT id, event_id FROM outbox_jobs WHERE consumer = 'receipts'")).one()
    assert (failure.hook, failure.job_id, failure.event_id, failure.consumer, failure.topic, failure.key,
            failure.payload, failure.headers, failure.attempt, failure.max_attempts, failure.call) == (
        "dead", job_id, event_id, "receipts", "order.placed", "order:4", {"order": 4}, {"traceparent": "x"}, 1, 1, 1)
    assert failure.error.startswith("RuntimeError: mail server refused order 4")
    by_consumer = {f.consumer: f for f in everywhere.calls}
    assert by_consumer["poison"].error.startswith("PermanentError: cannot be handled")
    assert by_consumer["strict"].error.startswith("dead at once: KeyError is in dead_on (KeyError)")
    assert relay.stats["hook_calls_ok"] == 4
    assert all(status(engine, f.job_id) == "dead" for f in everywhere.calls)


def test_a_reaped_last_attempt_calls_on_dead(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: None)
    dead = Recorder()
    ob.on_dead("c")(dead)
    register_subscriptions(engine, ob, settings())
    publish_events(engine, "t", [{}])
    route_all(engine)
    with engine.begin() as conn:  # a relay that died holding it: claimed, its lease run out
        [job] = claim_jobs(conn, {"c": 30.0}, 1, "ghost:1:a")
        expire_lease(conn, job.id)
    with running_relay(ob, settings()):
        wait_for(lambda: dead.calls, timeout=TIMEOUT, what="the dead hook of the reaped job")
    [failure] = dead.calls
    assert (failure.job_id, failure.attempt, failure.hook) == (job.id, 1, "dead")
    assert failure.error.startswith("LeaseExpired: lease expired")


def test_a_failed_attempt_calls_on_retry_and_a_snooze_does_not(engine, settings):
    ob = Outbox()

    @ob.subscriber("t", consumer="flaky", max_attempts=3, backoff=Backoff(base=0.05, cap=0.05))
    def flaky(job) -> None:
        if job.attempt == 1:
            raise ConnectionError("reset by peer")

    snoozed: list[int] = []

    @ob.subscriber("t", consumer="sleepy", max_attempts=3)
    def sleepy(job) -> None:
        if not snoozed:
            snoozed.append(job.id)
            raise Snooze(0.05)

    retried, dead = Recorder(), Recorder()
    ob.on_retry()(retried)
    ob.on_dead()(dead)
    publish_events(engine, "t", [{}])
    with running_relay(ob, settings()):
        wait_for(lambda: retried.calls and not hook_rows(engine), timeout=TIMEOUT, what="the retry hook")
        with engine.connect() as c:
            wait_for(lambda: c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status = 'done'")).scalar() == 2,
                     timeout=TIMEOUT, what="both jobs done")
    [failure] = retried.calls
    assert (failure.consumer, failure.hook, failure.attempt, failure.max_attempts) == ("flaky", "retry", 1, 3)
    assert failure.error.startswith("ConnectionError: reset by peer")
    assert dead.calls == [] and snoozed


def test_a_hook_that_raises_is_called_again_then_given_up_and_the_job_stays_dead(engine, settings, monkeypatch,
                                                                                    caplog):
    monkeypatch.setattr(hook_runner, "RETRY_BASE", 0.05)
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    broken, flaky_then_fine, fine = Recorder(fail_first=100), Recorder(fail_first=1), Recorder()
    ob.on_dead("c")(broken)
    ob.on_dead("c")(flaky_then_fine)
    ob.on_dead("c")(fine)
    [event] = publish_events(engine, "t", [{}])
    with caplog.at_level(logging.WARNING, logger="outbox.relay.hooks"), \
            running_relay(ob, settings(metrics_port=0)) as relay:
        wait_for(lambda: len(broken.calls) == hook_runner.MAX_CALLS and not hook_rows(engine), timeout=TIMEOUT,
                 what="the broken hook given up")
    assert [f.call for f in broken.calls] == [1, 2, 3, 4, 5]
    # each hook is called until it returned once: the others are not repeated for the broken one
    assert [f.call for f in flaky_then_fine.calls] == [1, 2]
    assert [f.call for f in fine.calls] == [1]
    with engine.connect() as c:
        job = c.execute(sa.text("SELECT id, status, attempts FROM outbox_jobs WHERE event_id = :e"), {"e": event}).one()
    assert (job.status, job.attempts) == ("dead", 1)
    assert relay.stats["hook_calls_failed"] == 5 + 1 and relay.stats["hook_calls_ok"] == 2
    assert relay.stats["hook_calls_gave_up"] == 1
    gave_up = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "outbox.relay.hooks"]
    assert len(gave_up) == 1 and f"given up for job {job.id} after 5 calls" in gave_up[0].getMessage()
    assert "RuntimeError: chat service down" in gave_up[0].getMessage()
    assert relay.metrics is not None
    assert [relay.metrics.hook_calls("c", "dead", r) for r in ("ok", "failed", "gave_up")] == [2, 6, 1]


def test_a_hook_past_hook_timeout_counts_as_failed_and_is_called_again(engine, settings, monkeypatch):
    monkeypatch.setattr(hook_runner, "RETRY_BASE", 0.05)
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    release = threading.Event()
    calls: list[int] = []

    def hangs_once(failure: JobFailure) -> None:
        calls.append(failure.call)
        if failure.call == 1:
            release.wait(30)

    ob.on_dead("c")(hangs_once)
    publish_events(engine, "t", [{}])
    try:
        with running_relay(ob, settings(hook_timeout=0.3)) as relay:
            wait_for(lambda: calls == [1, 2] and not hook_rows(engine), timeout=TIMEOUT, what="the second call")
    finally:
        release.set()
    assert relay.stats["hook_calls_failed"] == 1 and relay.stats["hook_calls_ok"] == 1


def test_hooks_that_hang_hold_a_bounded_number_of_threads(engine, settings, monkeypatch, caplog):
    """A wave of dead jobs whose hook never returns (an alerting service that never answers):
    once MAX_HUNG hook threads run past hook_timeout, the runner leases no new call (logged
    once), so the relay holds MAX_HUNG threads plus at most one round's, not one per call.
    The calls wait, leased and due again, and are made once the threads end."""
    monkeypatch.setattr(hook_runner, "MAX_HUNG", 4)
    monkeypatch.setattr(hook_runner, "RETRY_BASE", 0.05)
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    release = threading.Event()
    started: list[int] = []

    def hangs(failure: JobFailure) -> None:
        started.append(failure.job_id)
        release.wait(60)

    ob.on_dead("c")(hangs)
    publish_events(engine, "t", [{} for _ in range(40)])
    caplog.set_level(logging.WARNING, logger="outbox.relay.hooks")
    try:
        with running_relay(ob, settings(hook_timeout=0.2)) as relay:
            wait_for(lambda: any("no new hook call" in r.getMessage() for r in caplog.records), timeout=TIMEOUT,
                     what="the runner to stop leasing")
            time.sleep(1.5)  # rounds go on meanwhile: each finds no room
            hung = [t for t in threading.enumerate() if t.name.startswith("outbox-hook-")]
            assert 4 <= len(hung) <= 4 + hook_runner.BATCH, len(hung)
            assert len(started) == len(hung)
            release.set()
            wait_for(lambda: not hook_rows(engine), timeout=TIMEOUT * 3, what="every call made once the threads ended")
    finally:
        release.set()
    assert len({*started}) == 40
    assert relay.stats["hook_calls_gave_up"] == 0
    assert len([r for r in caplog.records if "no new hook call" in r.getMessage()]) >= 1


def test_async_hooks_run(engine, settings):
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    seen: list[JobFailure] = []

    @ob.on_dead("c")
    async def alert(failure: JobFailure) -> None:
        import asyncio
        await asyncio.sleep(0.01)
        seen.append(failure)

    publish_events(engine, "t", [{}])
    with running_relay(ob, settings()):
        wait_for(lambda: seen and not hook_rows(engine), timeout=TIMEOUT, what="the async hook")
    assert seen[0].hook == "dead"


def test_calls_of_a_hook_no_registry_declares_are_left_and_logged_at_start(engine, settings, caplog):
    with_hook = Outbox()
    with_hook.subscriber("t", consumer="c", max_attempts=1)(lambda job: None)
    with_hook.on_dead("c")(lambda failure: None)
    register_subscriptions(engine, with_hook, settings())
    publish_events(engine, "t", [{}])
    route_all(engine)
    with engine.begin() as conn:
        [job] = claim_jobs(conn, {"c": 30.0}, 1, "test:1:a")
        fail_jobs(conn, [(job, Failure(delay=0.0, permanent=True, error="x"))])
    without = Outbox()
    without.subscriber("t", consumer="c", max_attempts=1)(lambda job: None)
    with caplog.at_level(logging.WARNING, logger="outbox.relay.hooks"), running_relay(without, settings()) as relay:
        assert relay.hooks is None
    assert len(hook_rows(engine)) == 1
    assert any("1 failure hook calls (on_dead of c" in r.getMessage() and "DELETE FROM outbox_hook_calls" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("schema", ["tenant_hooks"])
def test_a_relay_in_a_schema_of_its_own_calls_its_hooks(engine, settings, schema):
    from outbox.db.migrate import upgrade

    upgrade(engine, schema=schema)
    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=1)(lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    dead = Recorder()
    ob.on_dead("c")(dead)
    from sqlalchemy.orm import Session

    from outbox import publish
    with Session(engine) as s, s.begin():
        publish(s, "t", {"in": schema}, schema=schema)
    with running_relay(ob, settings(schema_name=schema)):
        wait_for(lambda: dead.calls, timeout=TIMEOUT, what="the hook in the schema")
    assert dead.calls[0].payload == {"in": schema}
    with engine.connect() as c:
        assert c.execute(sa.text(f"SELECT count(*) FROM {schema}.outbox_hook_calls")).scalar() == 0
        assert c.execute(sa.text("SELECT count(*) FROM public.outbox_jobs")).scalar() == 0


def test_run_hooks_makes_the_calls_drain_left_due(engine, settings):
    from outbox.testing import drain, run_hooks

    ob = Outbox()
    ob.subscriber("t", consumer="c", max_attempts=2, backoff=Backoff(base=60, cap=60))(
        lambda job: (_ for _ in ()).throw(RuntimeError("boom")))
    dead, retried = Recorder(), Recorder()
    ob.on_dead("c")(dead)
    ob.on_retry("c")(retried)
    publish_events(engine, "t", [{}])
    drain(engine, ob, settings=settings(), run_retries=True)
    assert run_hooks(engine, ob, settings=settings()) == 2
    assert [(f.hook, f.attempt) for f in retried.calls + dead.calls] == [("retry", 1), ("dead", 2)]
    assert hook_rows(engine) == [] and run_hooks(engine, ob, settings=settings()) == 0
