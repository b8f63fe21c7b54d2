"""The newest migration against a queue holding jobs, for whichever migration is newest
(``head_revision()`` and the revision before it, never a revision by name): its downgrade
works with jobs present and leaves them as they were, and its lock waits are bounded. A
transaction holding a lock on a table the migration alters (its ``LOCKED_TABLES``) makes the
upgrade wait at most ``LOCK_TIMEOUT`` per attempt and try again; a blocker that outlasts
every attempt makes it fail with PostgreSQL's lock timeout error, leaving the schema at the
previous revision and the jobs untouched; a blocker that commits in time lets it through; a
deadlock is retried like a lock timeout (for a migration that locks two tables, one after
the other). The live upgrade, with relays running, is tests/acceptance/test_migration_live.py.

The migration's ``ATTEMPTS``, ``LOCK_TIMEOUT``, ``RETRY_PAUSE`` and ``LOCKED_TABLES`` are
module constants of its script. alembic loads a script's module afresh for every ``ScriptDirectory``, so
:func:`tuned_head` patches them on one loaded ``ScriptDirectory`` and has
``ScriptDirectory.from_config`` return that one (``outbox.db.migrate.upgrade`` then runs the
patched module, through alembic's real ``command.upgrade``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from outbox import Job, Outbox, PermanentError, admin, publish
from outbox.db.engine import make_engine
from outbox.db.jobs import claim_jobs
from outbox.db.migrate import alembic_config, downgrade, head_revision, upgrade
from outbox.relay.router import register_subscriptions, route_all
from outbox.settings import OutboxSettings
from outbox.testing import drain, wait_for
from tests.integration.helpers import publish_events
from tests.integration.migration_helpers import (
    drift,
    head_script,
    job_rows,
    previous_revision,
    schema_revision,
    snapshot,
)

#: The statuses (and the running job with cancel_requested) :func:`queue` leaves a job in.
STATES = {"ready", "pending", "running", "running+cancel_requested", "done", "dead", "cancelled"}


def state(job: dict[str, Any]) -> str:
    return job["status"] + ("+cancel_requested" if job["cancel_requested"] else "")


def in_columns_of(rows: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``rows`` (of :func:`job_rows`) with only the columns the rows of ``before`` have: a job
    after an upgrade, in the columns it had before (columns the upgrade adds left out)."""
    columns = next(iter(before.values())).keys() if before else ()
    return {i: {column: row[column] for column in columns} for i, row in rows.items()}


@pytest.fixture
def queue(engine: sa.Engine) -> sa.Engine:
    """``engine``'s database at head holding jobs in every status, made with outbox's API:
    routed by the router, run by :func:`outbox.testing.drain` (done; dead by
    :class:`~outbox.PermanentError`), claimed by the relay's claim with a 10-minute lease
    (running), cancelled by ``admin.cancel`` (a ready job: cancelled; a running one:
    cancel_requested), and an ordered key's second job (pending)."""
    ob = Outbox()

    def poison(job: Job) -> None:
        raise PermanentError(f"event {job.event_id} cannot be handled")

    for consumer in ("done", "ready", "cancelled", "running", "asked_to_cancel"):
        ob.subscriber(f"q.{consumer}", consumer=consumer)(lambda job: None)
    ob.subscriber("q.dead", consumer="dead")(poison)
    ob.subscriber("q.ordered", consumer="ordered", ordered=True)(lambda job: None)
    register_subscriptions(engine, ob, OutboxSettings(_env_file=None))
    for consumer in ("done", "dead", "ready", "cancelled", "running", "asked_to_cancel"):
        publish_events(engine, f"q.{consumer}", [{"n": i} for i in range(3)])
    for i in range(2):
        with Session(engine) as s, s.begin():
            publish(s, "q.ordered", {"n": i}, key="account:1")
    route_all(engine)
    outcomes = {r.outcome for r in drain(engine, ob, consumers=["done", "dead"])}
    assert outcomes == {"done", "dead"}
    with engine.begin() as conn:
        assert len(claim_jobs(conn, {"running": 600.0, "asked_to_cancel": 600.0}, 100, "migration-test")) == 6
    assert len(admin.cancel(engine, consumer="cancelled").cancelled) == 3
    assert len(admin.cancel(engine, consumer="asked_to_cancel").requested) == 3
    assert {state(j) for j in job_rows(engine).values()} == STATES
    return engine


@pytest.fixture
def previous_queue(queue: sa.Engine) -> sa.Engine:
    """:func:`queue` migrated down to the revision before head."""
    downgrade(queue, previous_revision())
    assert schema_revision(queue) == [previous_revision()]
    return queue


@pytest.fixture
def tuned_head(monkeypatch: pytest.MonkeyPatch) -> Callable[..., ModuleType]:
    """``tune(ATTEMPTS=..., LOCK_TIMEOUT=..., RETRY_PAUSE=...)``: the newest migration's
    module with those constants, the one every migration of this test runs (module notes);
    ``tune().LOCKED_TABLES`` are the tables whose locks it waits for."""
    scripts = ScriptDirectory.from_config(alembic_config())
    module = head_script(scripts).module
    if not all(hasattr(module, name) for name in ("ATTEMPTS", "LOCK_TIMEOUT", "RETRY_PAUSE", "LOCKED_TABLES")):
        pytest.skip(f"the newest migration ({head_revision()}) takes no retried short locks "
                    "(no ATTEMPTS / LOCK_TIMEOUT / RETRY_PAUSE / LOCKED_TABLES): no lock wait to bound")
    monkeypatch.setattr(ScriptDirectory, "from_config", classmethod(lambda cls, config: scripts))

    def tune(**constants: Any) -> ModuleType:
        for name, value in constants.items():
            assert hasattr(module, name), name
            monkeypatch.setattr(module, name, value)
        return module

    return tune


@pytest.fixture
def retries(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The retry warnings the migration logged so far (``outbox.db.migrate``)."""
    caplog.set_level(logging.WARNING, logger="outbox.db.migrate")
    return lambda: [r.getMessage() for r in list(caplog.records)
                    if r.name == "outbox.db.migrate" and "trying again" in r.getMessage()]


@pytest.fixture
def blocker(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection of its own for the transaction that holds locks; rolled back at the end."""
    with engine.connect() as conn:
        yield conn
        conn.rollback()


#: Per table, a row a live queue holds in an open transaction, and a write that holds one: a
#: transactional handler holds its job ``FOR UPDATE``; a relay registering holds its subscriptions; the router holds the events it routes
#: ``FOR UPDATE``, and an application's transaction holds the event it published until it ends.
ROW_LOCKS = {
    "outbox_jobs": "SELECT id FROM outbox_jobs WHERE status = 'running' ORDER BY id LIMIT 1 FOR UPDATE",
    "outbox_events": "SELECT id FROM outbox_events ORDER BY id LIMIT 1 FOR UPDATE",
    # a relay registering its subscriptions (ON CONFLICT DO UPDATE) holds the rows it changes
    "outbox_subscriptions": "SELECT consumer FROM outbox_subscriptions ORDER BY topic, consumer LIMIT 1 FOR UPDATE",
}
ROW_WRITES = {
    "outbox_jobs": "UPDATE outbox_jobs SET locked_by = 'blocker' WHERE id = (SELECT min(id) FROM outbox_jobs"
                   " WHERE status = 'running') RETURNING id",
    "outbox_events": "INSERT INTO outbox_events (topic, payload) VALUES ('blocker', '{}') RETURNING id",
}


def hold(conn: sa.Connection, how: str, table: str) -> None:
    """Take a lock on ``table`` in ``conn``'s transaction, as a live queue does: a row
    (:data:`ROW_LOCKS`), or a plain read (``ACCESS SHARE``, any SELECT)."""
    if how == "row":
        conn.exec_driver_sql(ROW_LOCKS[table]).one()
    else:
        conn.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS SHARE MODE")


def upgrade_in_thread(engine: sa.Engine) -> tuple[threading.Thread, list[object]]:
    """``upgrade(engine)`` on a thread of its own; the list gets its result or its exception."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(upgrade(engine))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, name="upgrade")
    thread.start()
    return thread, outcome


# ----------------------------------------------------------------------------- downgrade


def test_downgrade_to_the_previous_revision_keeps_every_job(queue, empty_db_url):
    """Head -> the previous revision with jobs in every status: the schema is exactly the
    previous revision's (a database migrated only that far; for 0007 the foreign key is back
    and validated), no job row changed in the columns the previous revision has (a column
    head adds goes with its values); upgrading again gives head, no drift, the same rows."""
    before = job_rows(queue)
    downgrade(queue, previous_revision())
    assert schema_revision(queue) == [previous_revision()]
    kept = job_rows(queue)
    assert kept == {i: {column: before[i][column] for column in row} for i, row in kept.items()}
    assert kept.keys() == before.keys()
    fresh = make_engine(empty_db_url)
    try:
        upgrade(fresh, previous_revision())
        assert snapshot(queue) == snapshot(fresh)
    finally:
        fresh.dispose()
    assert upgrade(queue) == head_revision()
    assert {i: {column: row[column] for column in kept[i]} for i, row in job_rows(queue).items()} == kept
    assert drift(queue) == []


# ---------------------------------------------------------------------- bounded lock waits


@pytest.mark.parametrize("how", ["row", "access share"])
def test_upgrade_behind_a_lock_holder_retries_then_fails_with_a_lock_timeout(
        previous_queue, blocker, tuned_head, retries, how):
    """A blocker that outlasts every attempt: each attempt waits ``LOCK_TIMEOUT``, gives the
    lock back and tries again after ``RETRY_PAUSE`` (ATTEMPTS - 1 retries logged), then the
    upgrade fails with PostgreSQL's lock timeout (55P03) and has changed nothing: schema and
    version at the previous revision, every job as it was. Once the blocker is gone it goes
    through."""
    module = tuned_head(ATTEMPTS=3, LOCK_TIMEOUT="100ms", RETRY_PAUSE=0.1)
    schema, jobs = snapshot(previous_queue), job_rows(previous_queue)
    hold(blocker, how, module.LOCKED_TABLES[0])
    with pytest.raises(OperationalError) as failed:
        upgrade(previous_queue)
    assert isinstance(failed.value.orig, psycopg.errors.LockNotAvailable), failed.value
    assert len(retries()) == 2, retries()
    assert all("lock timeout on attempt" in message for message in retries())
    assert schema_revision(previous_queue) == [previous_revision()]
    assert snapshot(previous_queue) == schema
    assert in_columns_of(job_rows(previous_queue), jobs) == jobs
    blocker.rollback()
    assert upgrade(previous_queue) == head_revision()
    assert in_columns_of(job_rows(previous_queue), jobs) == jobs
    assert drift(previous_queue) == []


def test_upgrade_goes_through_once_the_blocker_commits(previous_queue, blocker, tuned_head, retries):
    """A blocker that commits while the upgrade is retrying: the upgrade's next attempt gets
    its locks and it ends at head, the jobs untouched (the blocker's own write kept)."""
    table = tuned_head(ATTEMPTS=100, LOCK_TIMEOUT="100ms", RETRY_PAUSE=0.1).LOCKED_TABLES[0]
    jobs = job_rows(previous_queue)
    held = blocker.exec_driver_sql(ROW_WRITES[table]).scalar_one()
    thread, outcome = upgrade_in_thread(previous_queue)
    try:
        wait_for(lambda: retries() or outcome, timeout=30, what="the upgrade to retry")
        assert outcome == [], outcome
        assert schema_revision(previous_queue) == [previous_revision()]
        blocker.commit()
    finally:
        thread.join(timeout=60)
    assert outcome == [head_revision()]
    assert 1 <= len(retries()) < 100
    if table == "outbox_jobs":
        jobs[held]["locked_by"] = "blocker"
    assert in_columns_of(job_rows(previous_queue), jobs) == jobs
    with previous_queue.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {table} WHERE id = {held}").scalar_one() == 1
    assert drift(previous_queue) == []


def waiting_for_lock(engine: sa.Engine, table: str, mode: str) -> bool:
    """True when some session waits for ``mode`` on ``table``."""
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = CAST(:table AS regclass) AND mode = :mode"),
            {"table": table, "mode": mode}).scalar_one() > 0


def test_upgrade_retries_when_it_is_the_victim_of_a_deadlock(previous_queue, db_url: URL, blocker, tuned_head,
                                                               retries):
    """A migration that locks two tables (0007's drop holds ``outbox_jobs``, then waits for
    ``outbox_events``): a transaction holding a row of the second (as the router holds
    events) that then reads the first closes the cycle. PostgreSQL aborts the migration's
    statement (40P01; made the victim here by giving it the shorter ``deadlock_timeout``):
    the savepoint hands both locks back, the other transaction goes on and commits, and the
    retry goes through. Before, the deadlock failed the whole upgrade (only 55P03 was
    retried). A migration that locks one table takes part in no such cycle: skipped."""
    module = tuned_head(ATTEMPTS=10, LOCK_TIMEOUT="30s", RETRY_PAUSE=0.2)
    if len(module.LOCKED_TABLES) < 2:
        pytest.skip(f"the newest migration ({head_revision()}) locks one table ({module.LOCKED_TABLES[0]}): "
                    "no lock-order cycle to break")
    first, second = module.LOCKED_TABLES[:2]
    jobs = job_rows(previous_queue)
    with previous_queue.begin() as conn:  # the migration's sessions look for the deadlock first
        conn.exec_driver_sql(f'ALTER DATABASE "{db_url.database}" SET deadlock_timeout = \'3s\'')
    previous_queue.dispose()
    blocker.exec_driver_sql("SET deadlock_timeout = '60s'")
    hold(blocker, "row", second)
    thread, outcome = upgrade_in_thread(previous_queue)
    try:
        wait_for(lambda: waiting_for_lock(previous_queue, second, "AccessExclusiveLock") or outcome,
                 timeout=30, what=f"the upgrade to wait for {second}")
        assert outcome == [], outcome
        # Waits for the upgrade's lock on the first table until the deadlock is found and broken.
        blocker.exec_driver_sql(f"SELECT count(*) FROM {first}").scalar_one()
        blocker.commit()
    finally:
        thread.join(timeout=60)
    assert outcome == [head_revision()], outcome
    assert [m for m in retries() if "deadlock on attempt 1 of 10" in m], retries()
    assert in_columns_of(job_rows(previous_queue), jobs) == jobs
    assert drift(previous_queue) == []


def test_upgrade_leaves_the_sessions_lock_timeout_as_it_found_it(previous_queue, tuned_head):
    """Whatever runs after the migration's retried statement in the same transaction (later
    migrations) waits as the session was configured to, not with the retry's timeout nor
    without any (the migration used to end by setting ``lock_timeout`` to 0)."""
    tuned_head()
    with previous_queue.connect() as conn:
        conn.exec_driver_sql("SET lock_timeout = '7s'")
        conn.commit()
        with conn.begin():
            command.upgrade(alembic_config(conn), head_revision())
            assert conn.exec_driver_sql("SELECT current_setting('lock_timeout')").scalar_one() == "7s"
    assert schema_revision(previous_queue) == [head_revision()]
