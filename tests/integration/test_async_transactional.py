"""``async def`` transactional handlers, run by the relay: their writes commit with the
job's fenced completion on an ``AsyncSession``, roll back when the fence went stale (another
worker took the job), roll back and retry when they raise; they may not commit themselves,
and a serialization failure is retried in place like a sync handler's."""

from __future__ import annotations

import asyncio
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from outbox import ConfigurationError, HandlerMisuseError, Job, Outbox
from outbox.relay.maintenance import reap_expired
from outbox.testing import wait_for

from .helpers import expire_lease, job_row, publish_events, running_relay

TIMEOUT = 20


@pytest.fixture
def effects(engine):
    """A domain table the handlers write to: one row per handler write."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (id bigserial PRIMARY KEY, job_id bigint, attempt int, fence bigint)"))

    def rows() -> list[tuple[int, int, int]]:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(sa.text("SELECT job_id, attempt, fence FROM effects ORDER BY id"))]

    return rows


async def _write_effect(session: AsyncSession, job: Job) -> None:
    await session.execute(sa.text("INSERT INTO effects (job_id, attempt, fence) VALUES (:j, :a, :f)"),
                          {"j": job.id, "a": job.attempt, "f": job.fence})


def _statuses(engine: sa.Engine) -> list[str]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT status FROM outbox_jobs ORDER BY id")).scalars())


def _only_job(engine: sa.Engine) -> dict:
    with engine.connect() as c:
        job_id = c.execute(sa.text("SELECT id FROM outbox_jobs")).scalar_one()
    return job_row(engine, job_id)


def test_async_transactional_writes_commit_with_the_completion(engine, settings, effects):
    ob = Outbox()
    sessions: list[object] = []

    @ob.subscriber("t", consumer="tx", transactional=True)
    async def handler(job: Job, session: AsyncSession) -> None:
        sessions.append(type(session))
        isolation = (await session.execute(sa.text("SHOW transaction_isolation"))).scalar_one()
        assert isolation == "read committed"
        await _write_effect(session, job)
        await asyncio.sleep(0)  # a real suspension point inside the transaction

    publish_events(engine, "t", [{"n": i} for i in range(10)])
    with running_relay(ob, settings(concurrency=3)):
        wait_for(lambda: _statuses(engine) == ["done"] * 10, timeout=TIMEOUT, what="10 done")
    with engine.connect() as c:
        jobs = dict(c.execute(sa.text("SELECT id, fence FROM outbox_jobs")).all())
    assert sorted(effects()) == sorted((i, 1, f) for i, f in jobs.items())
    assert set(sessions) == {AsyncSession}


def test_async_transactional_writes_roll_back_when_the_fence_no_longer_matches(engine, settings, effects, caplog):
    ob = Outbox()
    started: dict[int, Job] = {}
    go = threading.Event()

    @ob.subscriber("t", consumer="tx", transactional=True, lease=30, max_attempts=3)
    async def handler(job: Job, session: AsyncSession) -> None:
        started[job.attempt] = job
        await _write_effect(session, job)  # written before the pause: must still roll back
        if job.attempt == 1:
            await asyncio.to_thread(go.wait, TIMEOUT)  # paused past its lease

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=2), maintain=False):
        try:
            wait_for(lambda: 1 in started, timeout=TIMEOUT, what="attempt 1 running")
            first = started[1]
            with engine.begin() as conn:  # another worker's reaper takes the job back
                expire_lease(conn, first.id)
                assert reap_expired(conn).retried == 1
            # The job is re-claimed (attempt 2, higher fence) and done while attempt 1 still waits.
            wait_for(lambda: _only_job(engine)["status"] == "done", timeout=TIMEOUT, what="attempt 2 done")
            go.set()
            wait_for(lambda: any(r.getMessage().startswith(f"stale reports dropped for 1 job (tx 1; id {first.id})")
                                 for r in caplog.records), timeout=TIMEOUT, what="stale completion dropped")
        finally:
            go.set()
    row = _only_job(engine)
    assert row["status"] == "done" and row["attempts"] == 2 and row["fence"] == started[2].fence > first.fence
    assert effects() == [(first.id, 2, started[2].fence)]  # attempt 1's write never became visible


def test_async_transactional_handler_that_raises_rolls_back_and_retries(engine, settings, effects):
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=3)
    async def handler(job: Job, session: AsyncSession) -> None:
        await _write_effect(session, job)
        await session.flush()
        if job.attempt == 1:
            raise RuntimeError("downstream said no")

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: _statuses(engine) == ["done"], timeout=TIMEOUT, what="done")
    row = _only_job(engine)
    assert row["attempts"] == 2
    assert row["last_error"].startswith("RuntimeError: downstream said no")
    assert [(a, f) for _, a, f in effects()] == [(2, row["fence"])]


def test_async_transactional_handler_may_not_commit(engine, settings, effects):
    ob = Outbox()
    raised: list[BaseException] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=5)
    async def handler(job: Job, session: AsyncSession) -> None:
        await _write_effect(session, job)
        try:
            await session.commit()
        except BaseException as exc:
            raised.append(exc)
            raise

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: _statuses(engine) == ["dead"], timeout=TIMEOUT, what="dead")
    assert len(raised) == 1 and isinstance(raised[0], HandlerMisuseError)  # a ConfigurationError too
    assert isinstance(raised[0], ConfigurationError)
    assert "must not commit" in _only_job(engine)["last_error"]
    assert _only_job(engine)["attempts"] == 1  # dead at once: a misuse is not retried
    assert effects() == []


def test_async_transactional_serialization_failure_is_retried_in_place(engine, settings, effects):
    """40001 raised by the handler's own statement: the transaction runs again in place,
    same claim, same attempt; the first run's write is rolled back."""
    ob = Outbox()
    runs: list[int] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=1)
    async def handler(job: Job, session: AsyncSession) -> None:
        runs.append(job.fence)
        await _write_effect(session, job)
        if len(runs) == 1:
            await session.execute(sa.text(
                "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$"))

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()) as relay:
        wait_for(lambda: _statuses(engine) == ["done"], timeout=TIMEOUT, what="done")
    row = _only_job(engine)
    assert row["attempts"] == 1 and runs == [row["fence"]] * 2 and relay.runner.stats["retried_in_place"] == 1
    assert [(a, f) for _, a, f in effects()] == [(1, row["fence"])]


def test_sync_and_async_transactional_handlers_side_by_side(engine, settings, effects):
    """One worker thread runs both kinds in turn: its sync pool connection and its own
    async engine."""
    ob = Outbox()

    @ob.subscriber("t", consumer="sync_tx", transactional=True)
    def sync_handler(job: Job, session) -> None:
        session.execute(sa.text("INSERT INTO effects (job_id, attempt, fence) VALUES (:j, :a, :f)"),
                        {"j": job.id, "a": job.attempt, "f": job.fence})

    @ob.subscriber("t", consumer="async_tx", transactional=True)
    async def async_handler(job: Job, session: AsyncSession) -> None:
        await _write_effect(session, job)

    publish_events(engine, "t", [{"n": i} for i in range(5)])
    with running_relay(ob, settings(concurrency=1)):
        wait_for(lambda: _statuses(engine) == ["done"] * 10, timeout=TIMEOUT, what="10 done")
    with engine.connect() as c:
        jobs = dict(c.execute(sa.text("SELECT id, fence FROM outbox_jobs")).all())
    assert sorted(effects()) == sorted((i, 1, f) for i, f in jobs.items())
