"""A transactional handler that ends outbox's transaction itself (a raw COMMIT or ROLLBACK,
closing its session) is caught at the completion: the job is dead-lettered with
TransactionEndedError naming what happened, never marked done in a transaction of its own.
Before this check, a raw COMMIT let the completion run (and commit) apart from the writes,
and an AsyncSession closed inside the handler lost the writes while the job ended done."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.settings import OutboxSettings
from outbox.testing import drain

INSERT = sa.text("INSERT INTO effects (job_id) VALUES (:j)")


@pytest.fixture
def effects(engine):
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (job_id bigint)"))

    def count() -> int:
        with engine.connect() as c:
            return c.execute(sa.text("SELECT count(*) FROM effects")).scalar_one()

    return count


def _run(engine, ob: Outbox):
    with Session(engine) as s, s.begin():
        publish(s, "t", {})
    [result] = drain(engine, ob, settings=OutboxSettings(_env_file=None))
    with engine.connect() as c:
        job = c.execute(sa.text("SELECT status, attempts, last_error FROM outbox_jobs")).one()
    return result, job


def _sync_raw_commit(job: Job, session: Session) -> None:
    session.execute(INSERT, {"j": job.id})
    session.connection().exec_driver_sql("COMMIT")


def _sync_raw_rollback(job: Job, session: Session) -> None:
    session.execute(INSERT, {"j": job.id})
    session.connection().exec_driver_sql("ROLLBACK")
    session.execute(INSERT, {"j": job.id})


async def _async_raw_commit(job: Job, session: AsyncSession) -> None:
    await session.execute(INSERT, {"j": job.id})
    await session.execute(sa.text("COMMIT"))


async def _async_close(job: Job, session: AsyncSession) -> None:
    await session.execute(INSERT, {"j": job.id})
    await session.close()


@pytest.mark.parametrize(("handler", "escaped"), [
    (_sync_raw_commit, 1),    # committed by the handler itself: the database cannot take it back
    (_sync_raw_rollback, 0),  # the write after the ROLLBACK is in a new transaction, rolled back with it
    (_async_raw_commit, 1),
    (_async_close, 0),        # the close rolled the write back; before the check the job ended done
], ids=["sync-commit", "sync-rollback", "async-commit", "async-close"])
def test_a_handler_that_ends_its_transaction_is_dead_lettered_not_done(engine, effects, handler, escaped):
    ob = Outbox()
    ob.subscriber("t", consumer="c", transactional=True)(handler)
    result, job = _run(engine, ob)
    assert (result.outcome, job.status, job.attempts) == ("dead", "dead", 1)
    assert "TransactionEndedError" in job.last_error and "ended its transaction itself" in job.last_error
    assert effects() == escaped


def test_a_handler_that_keeps_its_transaction_still_completes(engine, effects):
    ob = Outbox()

    @ob.subscriber("t", consumer="c", transactional=True)
    def fine(job: Job, session: Session) -> None:
        session.execute(INSERT, {"j": job.id})

    result, job = _run(engine, ob)
    assert (result.outcome, job.status) == ("done", "done")
    assert effects() == 1
