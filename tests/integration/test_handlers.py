"""Handlers run by the relay: lost-lease detection in lease mode, transactional handlers
whose writes commit only with the fenced completion, and ``async def`` handlers."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import ConfigurationError, HandlerMisuseError, Job, LeaseLostError, Outbox
from outbox.relay.maintenance import reap_expired
from outbox.testing import wait_for

from .helpers import expire_lease, job_row, publish_events, running_relay

TIMEOUT = 15


@pytest.fixture
def effects(engine):
    """A domain table the handlers write to: one row per handler write."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (id bigserial PRIMARY KEY, job_id bigint, attempt int, fence bigint)"))

    def rows() -> list[tuple[int, int, int]]:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(sa.text("SELECT job_id, attempt, fence FROM effects ORDER BY id"))]

    return rows


def _write_effect(session: Session, job: Job) -> None:
    session.execute(sa.text("INSERT INTO effects (job_id, attempt, fence) VALUES (:j, :a, :f)"),
                    {"j": job.id, "a": job.attempt, "f": job.fence})


def _take_back(engine: sa.Engine, job_id: int) -> None:
    """Expire the job's lease and reap it in one transaction (a heartbeat cannot renew it
    in between)."""
    with engine.begin() as conn:
        expire_lease(conn, job_id)
        assert reap_expired(conn).retried == 1


def _only_job(engine: sa.Engine) -> dict:
    with engine.connect() as c:
        job_id = c.execute(sa.text("SELECT id FROM outbox_jobs")).scalar_one()
    return job_row(engine, job_id)


def _stale_dropped(caplog, job: Job) -> bool:
    """The job's late report was dropped: said by the round's summary (WARNING), or by the
    job's own line (DEBUG) when another line had named the job already."""
    return any(("stale report dropped" in r.getMessage() and f"fence {job.fence} " in r.getMessage())
               or r.getMessage().startswith(f"stale reports dropped for 1 job ({job.consumer} 1; id {job.id})")
               for r in caplog.records)


# ------------------------------------------------------------------- lease mode


def test_lost_lease_is_detected_and_the_late_result_dropped(engine, settings, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="outbox.relay")  # each job's own lines (summaries at WARNING)
    ob = Outbox()
    started: dict[int, Job] = {}
    go = {1: threading.Event(), 2: threading.Event()}
    check: list[BaseException | None] = []

    @ob.subscriber("t", consumer="slow", lease=1.5, max_attempts=3)
    def slow(job: Job) -> None:
        started[job.attempt] = job
        go[job.attempt].wait(TIMEOUT)
        if job.attempt == 1:
            try:
                job.check_lease()
                check.append(None)
            except LeaseLostError as exc:
                check.append(exc)

    publish_events(engine, "t", [{"n": 1}])
    # Two worker slots, so this same relay re-claims the job while attempt 1 still runs.
    with running_relay(ob, settings(concurrency=2), maintain=False) as relay:
        try:
            wait_for(lambda: 1 in started, timeout=TIMEOUT, what="attempt 1 running")
            first = started[1]
            _take_back(engine, first.id)
            wait_for(lambda: 2 in started, timeout=TIMEOUT, what="attempt 2 re-claimed")
            second = started[2]
            assert second.id == first.id and second.fence > first.fence
            wait_for(lambda: first.lease_lost, timeout=TIMEOUT, what="heartbeat noticing the lost lease")
            assert not second.lease_lost
            with pytest.raises(LeaseLostError):
                first.check_lease()

            before = _only_job(engine)
            assert (before["status"], before["fence"], before["attempts"]) == ("running", second.fence, 2)
            go[1].set()  # the paused worker wakes and reports
            wait_for(lambda: _stale_dropped(caplog, first), timeout=TIMEOUT, what="stale report dropped")
            after = _only_job(engine)
            assert {k: after[k] for k in ("status", "fence", "attempts", "finished_at", "last_error")} == \
                   {k: before[k] for k in ("status", "fence", "attempts", "finished_at", "last_error")}
            assert isinstance(check[0], LeaseLostError)
            # The old claim's report did not make the relay forget the new claim of the same
            # job: it is still counted in flight and its lease keeps being renewed.
            assert relay.runner.in_flight() == 1
            wait_for(lambda: _only_job(engine)["lease_until"] > after["lease_until"], timeout=TIMEOUT,
                     what="heartbeat renewing attempt 2's lease")
            assert not second.lease_lost

            go[2].set()
            wait_for(lambda: _only_job(engine)["status"] == "done", timeout=TIMEOUT, what="attempt 2 done")
            assert _only_job(engine)["fence"] == second.fence
            assert any("lease lost: job" in r.getMessage() for r in caplog.records)
            # One WARNING for the lost lease, naming the job; its late report adds none.
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warned == [f"lease lost on 1 job (slow 1; id {first.id}): the claims were taken back (this relay "
                              "paused, or cut off from its database, for longer than the lease); what their handlers "
                              "report will be dropped"], warned
        finally:
            for e in go.values():
                e.set()


def test_async_lease_mode_handler(engine, settings):
    ob = Outbox()
    seen: list[tuple[int, str]] = []

    @ob.subscriber("t", consumer="async")
    async def handler(job: Job) -> None:
        await asyncio.sleep(0.01)
        seen.append((job.payload["n"], job.idempotency_key))

    ids = publish_events(engine, "t", [{"n": i} for i in range(5)])
    with running_relay(ob, settings(concurrency=2)):
        wait_for(lambda: len(seen) == 5, timeout=TIMEOUT, what="5 async runs")
        wait_for(lambda: _statuses(engine) == ["done"] * 5, timeout=TIMEOUT, what="5 done")
    assert sorted(seen) == [(i, f"async:{ids[i]}") for i in range(5)]


def _statuses(engine: sa.Engine) -> list[str]:
    with engine.connect() as c:
        return list(c.execute(sa.text("SELECT status FROM outbox_jobs ORDER BY id")).scalars())


# -------------------------------------------------------------- transactional mode


def test_transactional_writes_commit_with_the_completion(engine, settings, effects):
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", transactional=True)
    def handler(job: Job, session: Session) -> None:
        _write_effect(session, job)

    publish_events(engine, "t", [{"n": i} for i in range(10)])
    with running_relay(ob, settings(concurrency=3)):
        wait_for(lambda: _statuses(engine) == ["done"] * 10, timeout=TIMEOUT, what="10 done")
    with engine.connect() as c:
        jobs = dict(c.execute(sa.text("SELECT id, fence FROM outbox_jobs")).all())
    assert sorted(effects()) == sorted((i, 1, f) for i, f in jobs.items())


def test_transactional_writes_roll_back_when_the_fence_no_longer_matches(engine, settings, effects, caplog):
    ob = Outbox()
    started: dict[int, Job] = {}
    go = threading.Event()

    @ob.subscriber("t", consumer="tx", transactional=True, lease=30, max_attempts=3)
    def handler(job: Job, session: Session) -> None:
        started[job.attempt] = job
        if job.attempt == 1:
            go.wait(TIMEOUT)  # paused past its lease
        _write_effect(session, job)

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(concurrency=1), maintain=False):
        try:
            wait_for(lambda: 1 in started, timeout=TIMEOUT, what="attempt 1 running")
            first = started[1]
            _take_back(engine, first.id)
            go.set()
            wait_for(lambda: _stale_dropped(caplog, first), timeout=TIMEOUT, what="stale completion dropped")
            # Attempt 1's write never became visible; the re-claimed attempt 2 writes once.
            wait_for(lambda: _only_job(engine)["status"] == "done", timeout=TIMEOUT, what="attempt 2 done")
        finally:
            go.set()
    row = _only_job(engine)
    assert row["attempts"] == 2 and row["fence"] == started[2].fence > first.fence
    assert effects() == [(first.id, 2, started[2].fence)]


def test_transactional_handler_that_raises_rolls_back_and_retries(engine, settings, effects):
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=3)
    def handler(job: Job, session: Session) -> None:
        _write_effect(session, job)
        session.flush()
        if job.attempt == 1:
            raise RuntimeError("downstream said no")

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: _statuses(engine) == ["done"], timeout=TIMEOUT, what="done")
    row = _only_job(engine)
    assert row["attempts"] == 2
    assert row["last_error"].startswith("RuntimeError: downstream said no")
    assert [(a, f) for _, a, f in effects()] == [(2, row["fence"])]


def test_transactional_handler_may_not_commit(engine, settings, effects):
    ob = Outbox()
    raised: list[BaseException] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=5)
    def handler(job: Job, session: Session) -> None:
        _write_effect(session, job)
        try:
            session.commit()
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


def test_transactional_job_whose_connection_breaks_is_released_not_failed(engine, settings, effects):
    """A broken connection (server restart, pg_terminate_backend) is not the handler's
    failure: the job goes back to ready with the attempt uncounted, is never dead-lettered
    for it, and no write of the broken attempt survives."""
    ob = Outbox()
    runs: list[int] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=1)
    def handler(job: Job, session: Session) -> None:
        runs.append(job.attempt)
        _write_effect(session, job)
        if len(runs) == 1:  # the first run loses its connection mid-transaction
            session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings()):
        wait_for(lambda: _statuses(engine) == ["done"], timeout=TIMEOUT, what="done despite the broken connection")
    row = _only_job(engine)
    # max_attempts=1: had the broken run counted as a failure, the job would be dead.
    assert row["attempts"] == 1 and len(runs) == 2
    assert [(a, f) for _, a, f in effects()] == [(1, row["fence"])]
