"""Handler timeouts and snooze, run by a real relay (and drain) on real PostgreSQL.

A handler that runs past its subscriber's ``timeout`` has its attempt failed and counted
(an ``async def`` one is cancelled; a ``def`` one's thread cannot be stopped, so the
watchdog fails the attempt and the thread keeps its slot); one that always hangs ends
dead after ``max_attempts`` while the relay keeps serving other consumers. ``Snooze``
puts a job back without counting the attempt."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Job, Outbox, PermanentError, Snooze
from outbox.ops.cli import main
from outbox.testing import drain, wait_for

from .helpers import job_row, publish_events, running_relay

TIMEOUT = 20


def _jobs(engine: sa.Engine, consumer: str) -> list[dict]:
    with engine.connect() as c:
        ids = list(c.execute(sa.text("SELECT id FROM outbox_jobs WHERE consumer = :c ORDER BY id"),
                             {"c": consumer}).scalars())
    return [job_row(engine, i) for i in ids]


def _all_done(engine: sa.Engine, consumer: str, n: int) -> bool:
    rows = _jobs(engine, consumer)
    return len(rows) == n and all(r["status"] == "done" for r in rows)


def _serves_others(engine: sa.Engine) -> None:
    """Publish two events for the healthy consumer and wait until both are done."""
    publish_events(engine, "other", [{"n": 1}, {"n": 2}])
    wait_for(lambda: _all_done(engine, "healthy", 2), timeout=TIMEOUT, what="the healthy consumer served")


def _healthy(ob: Outbox) -> None:
    ob.subscriber("other", consumer="healthy")(lambda job: None)


def test_a_sync_handler_that_hangs_forever_ends_dead_and_the_relay_keeps_serving(engine, settings, caplog):
    caplog.set_level(logging.INFO)
    ob = Outbox()
    release = threading.Event()
    started: list[int] = []

    @ob.subscriber("t", consumer="hangs", timeout=0.3, max_attempts=3)
    def hangs(job: Job) -> None:
        started.append(job.attempt)
        release.wait()  # "forever": until the test ends

    _healthy(ob)
    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=4, prefetch=2), maintain=False) as relay:
        try:
            wait_for(lambda: _jobs(engine, "hangs") and _jobs(engine, "hangs")[0]["status"] == "dead",
                     timeout=TIMEOUT, what="the hanging job dead")
            [row] = _jobs(engine, "hangs")
            assert row["attempts"] == 3 and started == [1, 2, 3]
            assert "HandlerTimeoutError: handler timed out after 0.3 s" in row["last_error"]
            # Three hung threads hold three of the four slots; the fourth still serves others.
            assert relay.runner.claims.hung == 3
            assert relay.runner.stats["timed_out"] == 3
            _serves_others(engine)
            assert any("3 of 4 slots held by hung handlers" in r.getMessage() for r in caplog.records)
            release.set()  # the hung threads return at last: their results are dropped, slots freed
            wait_for(lambda: relay.runner.claims.hung == 0, timeout=TIMEOUT, what="the hung slots freed")
            assert job_row(engine, row["id"])["status"] == "dead"
            assert relay.runner.stats["stale"] == 0
        finally:
            release.set()


def test_a_relay_whose_slots_all_hang_claims_nothing_and_hands_its_buffer_back(engine, settings):
    ob = Outbox()
    release = threading.Event()

    @ob.subscriber("t", consumer="hangs", timeout=0.3, max_attempts=5)
    def hangs(job: Job) -> None:
        release.wait()

    publish_events(engine, "t", [{"n": 1}, {"n": 2}, {"n": 3}])
    with running_relay(ob, settings(concurrency=1, prefetch=5), maintain=False) as relay:
        try:
            wait_for(lambda: relay.runner.claims.hung == 1, timeout=TIMEOUT, what="the one slot hung")
            # Nothing it holds could run: every job is back in the table, none held by this relay.
            wait_for(lambda: relay.runner.in_flight() == 0 and all(r["status"] == "ready" for r in _jobs(engine, "hangs")),
                     timeout=TIMEOUT, what="the buffer handed back")
            assert sum(r["attempts"] for r in _jobs(engine, "hangs")) == 1  # only the hung attempt counted
            release.set()
            wait_for(lambda: _all_done(engine, "hangs", 3), timeout=TIMEOUT, what="claiming again once the slot is free")
            assert relay.runner.claims.hung == 0
        finally:
            release.set()


def test_an_async_handler_that_hangs_forever_is_cancelled_and_ends_dead(engine, settings):
    ob = Outbox()
    cancelled: list[int] = []

    @ob.subscriber("t", consumer="hangs", timeout=0.3, max_attempts=2)
    async def hangs(job: Job) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(job.attempt)
            raise

    _healthy(ob)
    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=2), maintain=False) as relay:
        wait_for(lambda: _jobs(engine, "hangs") and _jobs(engine, "hangs")[0]["status"] == "dead",
                 timeout=TIMEOUT, what="the hanging job dead")
        [row] = _jobs(engine, "hangs")
        assert row["attempts"] == 2 and cancelled == [1, 2]
        assert "HandlerTimeoutError: handler timed out after 0.3 s" in row["last_error"]
        assert relay.runner.claims.hung == 0  # cancelled: no slot kept
        _serves_others(engine)


def test_an_async_handler_that_blocks_its_event_loop_is_failed_naming_its_own_timeout(engine, settings):
    """An async handler that swallows its cancellation and blocks its event loop is caught
    by the watchdog's backstop, one second past the timeout; the error still gives the
    subscriber's timeout (it said 2 s for a timeout of 1 s: found by the adversarial test)."""
    ob = Outbox()
    release = threading.Event()

    @ob.subscriber("t", consumer="blocks", timeout=0.3, max_attempts=1)
    async def blocks(job: Job) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            release.wait(TIMEOUT)  # blocks the loop: cancellation cannot end it

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=2), maintain=False):
        try:
            wait_for(lambda: _jobs(engine, "blocks") and _jobs(engine, "blocks")[0]["status"] == "dead",
                     timeout=TIMEOUT, what="the blocking job dead")
            [row] = _jobs(engine, "blocks")
            assert "HandlerTimeoutError: handler timed out after 0.3 s" in row["last_error"], row["last_error"]
        finally:
            release.set()


@pytest.fixture
def effects(engine):
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (id bigserial PRIMARY KEY, job_id bigint, attempt int)"))

    def count() -> int:
        with engine.connect() as c:
            return c.execute(sa.text("SELECT count(*) FROM effects")).scalar_one()

    return count


def test_a_hung_transactional_handler_is_failed_and_its_writes_never_commit(engine, settings, effects):
    ob = Outbox()
    release = threading.Event()

    @ob.subscriber("t", consumer="hangs", transactional=True, timeout=0.3, max_attempts=2)
    def hangs(job: Job, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id, attempt) VALUES (:j, :a)"),
                        {"j": job.id, "a": job.attempt})
        release.wait()

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=3), maintain=False) as relay:
        try:
            wait_for(lambda: _jobs(engine, "hangs") and _jobs(engine, "hangs")[0]["status"] == "dead",
                     timeout=TIMEOUT, what="the hanging job dead")
            assert _jobs(engine, "hangs")[0]["attempts"] == 2
            release.set()  # the handlers return: their transactions roll back instead of completing
            wait_for(lambda: relay.runner.claims.hung == 0, timeout=TIMEOUT, what="the hung slots freed")
            assert effects() == 0
            assert _jobs(engine, "hangs")[0]["status"] == "dead"
        finally:
            release.set()


# ------------------------------------------------------------------- snooze


def test_snooze_puts_the_job_back_without_counting_the_attempt(engine, settings):
    ob = Outbox()
    runs: list[tuple[int, int]] = []

    @ob.subscriber("t", consumer="snoozes", max_attempts=1)
    def snoozes(job: Job) -> None:
        runs.append((job.attempt, len(runs)))
        if len(runs) <= 2:
            raise Snooze(0.1)

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=1), maintain=False) as relay:
        wait_for(lambda: _all_done(engine, "snoozes", 1), timeout=TIMEOUT, what="the snoozed job done")
    [row] = _jobs(engine, "snoozes")
    # max_attempts=1: had a snooze counted, the job would have died on its first snooze.
    assert (row["attempts"], row["snoozes"], row["last_error"]) == (1, 2, None)
    assert [a for a, _ in runs] == [1, 1, 1]
    assert relay.runner.stats["snoozed"] == 2


def test_a_transactional_snooze_rolls_the_handlers_writes_back(engine, settings, effects):
    ob = Outbox()

    @ob.subscriber("t", consumer="snoozes", transactional=True, max_attempts=1)
    def snoozes(job: Job, session: Session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id, attempt) VALUES (:j, :a)"),
                        {"j": job.id, "a": job.attempt})
        raise Snooze(3600)

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=1), maintain=False):
        wait_for(lambda: [r["snoozes"] for r in _jobs(engine, "snoozes")] == [1], timeout=TIMEOUT,
                 what="the job snoozed")
    [row] = _jobs(engine, "snoozes")
    assert (row["status"], row["attempts"], effects()) == ("ready", 0, 0)
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT run_at > now() + interval '3000 seconds' FROM outbox_jobs")).scalar_one()


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), 31 * 86400, "5", None, True])
def test_snooze_refuses_bad_seconds(seconds):
    with pytest.raises(ConfigurationError, match="Snooze: seconds must be a finite number"):
        Snooze(seconds)


def test_drain_handles_snooze_and_async_timeouts(engine, settings):
    ob = Outbox()
    seen: list[str] = []

    @ob.subscriber("t", consumer="snoozes", max_attempts=1)
    def snoozes(job: Job) -> None:
        seen.append("snoozes")
        if seen.count("snoozes") == 1:
            raise Snooze(0)

    @ob.subscriber("t", consumer="hangs", timeout=0.2, max_attempts=2)
    async def hangs(job: Job) -> None:
        await asyncio.sleep(3600)

    publish_events(engine, "t", [{"n": 1}])
    results = drain(engine, ob, settings=settings(), run_retries=True)
    by_consumer = {c: [r.outcome for r in results if r.consumer == c] for c in ("snoozes", "hangs")}
    assert by_consumer == {"snoozes": ["snoozed", "done"], "hangs": ["retried", "dead"]}
    assert "handler timed out after 0.2 s" in [r for r in results if r.consumer == "hangs"][-1].error
    assert _jobs(engine, "snoozes")[0]["snoozes"] == 1


def test_the_dead_letter_listing_shows_snoozes(engine, settings, db_url, capsys, monkeypatch):
    ob = Outbox()

    @ob.subscriber("t", consumer="gives_up", max_attempts=3)
    def gives_up(job: Job) -> None:
        with engine.connect() as c:
            snoozed = c.execute(sa.text("SELECT snoozes FROM outbox_jobs WHERE id = :id"), {"id": job.id}).scalar_one()
        if snoozed < 2:
            raise Snooze(0)
        raise PermanentError("gave up")

    publish_events(engine, "t", [{"n": 1}])
    results = drain(engine, ob, settings=settings(), run_retries=True)
    assert [r.outcome for r in results] == ["snoozed", "snoozed", "dead"]
    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    assert main(["dead", "--database-url", db_url.render_as_string(hide_password=False)]) == 0
    out = capsys.readouterr().out
    assert "gives_up attempts 1/3 snoozes 2: PermanentError: gave up" in out
