"""The transactional handler's transaction (outbox/relay/transaction.py), on a real PostgreSQL:
READ COMMITTED whatever the database's default isolation, serialization failures and
deadlocks retried in place without counting an attempt, the idle-in-transaction limit set
per transaction, and connections waited for (not failed) under a role's connection limit."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.relay.relay import Relay
from outbox.testing import wait_for

from .helpers import publish_events, running_relay

TIMEOUT = 30


def _admin(url: URL) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


@pytest.fixture
def effects(engine):
    """A domain table the handlers write to, one row per job at most (``job_id`` unique)."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (job_id bigint PRIMARY KEY, fence bigint NOT NULL)"))

    def rows() -> dict[int, int]:
        with engine.connect() as c:
            return dict(c.execute(sa.text("SELECT job_id, fence FROM effects")).all())

    return rows


def _jobs(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT id, status, attempts, fence, last_error FROM outbox_jobs ORDER BY id")).all()


def _finished(engine: sa.Engine, n: int) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status IN ('done', 'dead')")).scalar() == n


def _write_effect(session: Session, job: Job) -> None:
    session.execute(sa.text("INSERT INTO effects (job_id, fence) VALUES (:j, :f)"), {"j": job.id, "f": job.fence})


def _run_one_job(engine: sa.Engine, relay: Relay) -> None:
    """Run ``relay`` until its one job is done or dead, then stop it."""
    relay.start()
    try:
        wait_for(lambda: _finished(engine, 1), timeout=TIMEOUT, what="the job finished")
    finally:
        relay.stop()


def _all_done_once(engine: sa.Engine, effects) -> None:
    jobs = _jobs(engine)
    assert [(j.status, j.attempts, j.last_error) for j in jobs] == [("done", 1, None)] * len(jobs), \
        [j for j in jobs if (j.status, j.attempts, j.last_error) != ("done", 1, None)][:5]
    assert effects() == {j.id: j.fence for j in jobs}


# ----------------------------------------------------------------------- isolation


@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_transactional_handlers_work_whatever_the_default_isolation(engine, db_url, settings, effects, level):
    """The heartbeat renews the job row while the handler's transaction is open: under the
    database's REPEATABLE READ or SERIALIZABLE default, the fenced completion failed with
    40001 on every attempt and every job ended dead. Outbox's transaction is READ COMMITTED."""
    admin = _admin(db_url)
    with admin.connect() as c:
        c.exec_driver_sql(f"ALTER DATABASE \"{db_url.database}\" SET default_transaction_isolation = '{level}'")
    admin.dispose()
    ob = Outbox()
    seen: list[str] = []

    @ob.subscriber("t", consumer="tx", transactional=True, lease=3, max_attempts=3)
    def handler(job: Job, session: Session) -> None:
        seen.append(session.execute(sa.text("SHOW transaction_isolation")).scalar())
        session.execute(sa.text("SELECT count(*) FROM effects")).scalar()
        job.wait_lease_lost(1.2)  # work outside the database: the heartbeat (every 1 s) renews the row meanwhile
        _write_effect(session, job)

    publish_events(engine, "t", [{"n": i} for i in range(8)])
    with running_relay(ob, settings(concurrency=8)) as relay:
        with relay.engine.connect() as conn:  # the database's default is in force for the relay's sessions
            assert conn.exec_driver_sql("SHOW default_transaction_isolation").scalar() == level
        wait_for(lambda: _finished(engine, 8), timeout=TIMEOUT, what="8 jobs finished")
    _all_done_once(engine, effects)
    assert set(seen) == {"read committed"}


def test_deadlock_in_a_transactional_handler_is_retried_in_place(engine, settings, effects, caplog):
    """A real deadlock (40P01) between the handler and another session, each locking two
    rows in opposite order, with the handler the one the server aborts: its transaction
    runs again in place and commits; the attempt is not counted (max_attempts=1: counted,
    the job would be dead)."""
    caplog.set_level(logging.INFO, logger="outbox")
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)"))
        c.execute(sa.text("INSERT INTO accounts VALUES (1, 100), (2, 100)"))
    ob = Outbox()
    runs: list[int] = []
    pids: list[int] = []
    locked_first = threading.Event()
    other_has_row_2 = threading.Event()

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=1)
    def transfer(job: Job, session: Session) -> None:
        runs.append(job.attempt)
        session.execute(sa.text("UPDATE accounts SET balance = balance - 10 WHERE id = 1"))
        if len(runs) == 1:
            pids.append(session.execute(sa.text("SELECT pg_backend_pid()")).scalar())
            locked_first.set()
            assert other_has_row_2.wait(TIMEOUT)
        session.execute(sa.text("UPDATE accounts SET balance = balance + 10 WHERE id = 2"))  # waits on the other
        _write_effect(session, job)

    def other_session() -> None:
        with engine.connect() as c:
            # A long deadlock_timeout here: the handler, waiting first, runs the deadlock
            # check first and is the one aborted (PostgreSQL docs, "deadlock_timeout").
            c.execute(sa.text("SET deadlock_timeout = '20s'"))
            assert locked_first.wait(TIMEOUT)
            c.execute(sa.text("UPDATE accounts SET balance = balance - 1 WHERE id = 2"))
            other_has_row_2.set()

            def handler_waits_on_a_lock() -> bool:
                with engine.connect() as probe:
                    return probe.execute(sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity"
                                                 " WHERE pid = :p"), {"p": pids[0]}).scalar() is True

            wait_for(handler_waits_on_a_lock, timeout=TIMEOUT, what="the handler waiting for row 2")
            c.execute(sa.text("UPDATE accounts SET balance = balance + 1 WHERE id = 1"))  # closes the cycle
            c.commit()

    publish_events(engine, "t", [{"n": 1}])
    other = threading.Thread(target=other_session, daemon=True)
    other.start()
    with running_relay(ob, settings(concurrency=1)):
        wait_for(lambda: _finished(engine, 1), timeout=TIMEOUT, what="the job finished")
        other.join(TIMEOUT)
    _all_done_once(engine, effects)
    assert runs == [1, 1]  # the same attempt, run twice
    with engine.connect() as c:
        assert dict(c.execute(sa.text("SELECT id, balance FROM accounts")).all()) == {1: 91, 2: 109}
    assert any("deadlock in its transaction" in r.getMessage() and "in place (1/3" in r.getMessage()
               for r in caplog.records)


def test_serialization_failures_that_persist_count_one_attempt_after_the_in_place_retries(engine, settings, effects):
    """A handler whose transaction always fails with 40001 runs 1 + 3 times per attempt,
    then the attempt counts as failed; after max_attempts the job is dead with the error."""
    ob = Outbox()
    runs: list[int] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=2)
    def handler(job: Job, session: Session) -> None:
        runs.append(job.attempt)
        _write_effect(session, job)
        session.execute(sa.text("DO $$ BEGIN RAISE EXCEPTION 'forced conflict' USING ERRCODE = 'serialization_failure';"
                                " END $$"))

    publish_events(engine, "t", [{"n": 1}])
    _run_one_job(engine, Relay(ob, settings(concurrency=1)))
    [job] = _jobs(engine)
    assert (job.status, job.attempts) == ("dead", 2)
    assert "forced conflict" in job.last_error
    assert runs == [1, 1, 1, 1, 2, 2, 2, 2]
    assert effects() == {}


def test_a_rerun_in_place_sees_the_input_the_first_run_saw(engine, settings, effects):
    """A handler that changes ``job.payload`` and ``job.headers`` and then meets a 40001:
    its rerun in place reads the stored payload and headers again, not what the failed run
    left in them (before, the rerun found the key popped, failed with KeyError and was
    charged an attempt; found by an adversarial run)."""
    ob = Outbox()
    seen: list[tuple[dict, dict]] = []

    @ob.subscriber("t", consumer="tx", transactional=True, max_attempts=1)
    def handler(job: Job, session: Session) -> None:
        seen.append((dict(job.payload), dict(job.headers)))
        job.payload.pop("n")
        job.headers["seen"] = True
        _write_effect(session, job)
        if len(seen) == 1:
            session.execute(sa.text("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure';"
                                    " END $$"))

    with engine.begin() as c:
        publish(c, "t", {"n": 1}, headers={"h": "v"})
    _run_one_job(engine, Relay(ob, settings(concurrency=1)))
    assert seen == [({"n": 1}, {"h": "v"})] * 2
    _all_done_once(engine, effects)


def test_transaction_limits_are_set_in_the_handlers_transaction_only(engine, settings):
    """The idle-in-transaction limit (the job's lease) is SET LOCAL in the handler's
    transaction, not a startup option of every relay connection, so it works through a
    pooler; the isolation is READ COMMITTED there too. A URL's own ``options`` are kept."""
    ob = Outbox()
    seen: dict[str, str] = {}

    @ob.subscriber("t", consumer="tx", transactional=True, lease=2.5)
    def handler(job: Job, session: Session) -> None:
        for name in ("idle_in_transaction_session_timeout", "transaction_isolation", "search_path"):
            seen[name] = session.execute(sa.text(f"SHOW {name}")).scalar()

    base = settings()
    url = sa.engine.make_url(base.url()).update_query_dict({"options": "-csearch_path=app,public"})
    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(database_url=url.render_as_string(hide_password=False))) as relay:
        wait_for(lambda: _finished(engine, 1), timeout=TIMEOUT, what="the job finished")
        with relay.engine.connect() as conn:  # outside a handler's transaction: the server's defaults
            assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "0"
            assert conn.exec_driver_sql("SHOW search_path").scalar() == "app,public"
    assert seen == {"idle_in_transaction_session_timeout": "2500ms", "transaction_isolation": "read committed",
                    "search_path": "app,public"}


def test_transactional_handler_idle_past_its_own_lease_has_its_session_ended(engine, settings, effects):
    """The server ends a handler's transaction that sits idle longer than its job's lease
    (heartbeats go on, so the lease itself holds), even when another consumer of the relay
    has a longer lease (the limit used to be the relay's longest lease, for every
    connection): counted as a failed attempt, nothing committed."""
    ob = Outbox()
    runs: list[int] = []
    ob.subscriber("other", consumer="long", lease=10)(lambda job: None)

    @ob.subscriber("t", consumer="tx", transactional=True, lease=1, max_attempts=2)
    def handler(job: Job, session: Session) -> None:
        runs.append(job.attempt)
        _write_effect(session, job)
        job.wait_lease_lost(1.8)  # idle inside the transaction past its lease

    publish_events(engine, "t", [{"n": 1}])
    _run_one_job(engine, Relay(ob, settings(concurrency=1, default_lease=1)))
    [job] = _jobs(engine)
    assert (job.status, job.attempts, runs) == ("dead", 2, [1, 2])
    assert "idle-in-transaction timeout" in job.last_error
    assert effects() == {}


# ------------------------------------------------------------- connection pressure


@pytest.fixture
def limited_role(db_url: URL) -> Iterator[URL]:
    """A non-superuser role (CONNECTION LIMIT applies to it; superusers are exempt:
    PostgreSQL docs, "CREATE ROLE") allowed 10 connections, with what a relay needs on this
    test's database; returns the database's URL as that role. Roles are cluster-wide: the
    name is unique, and the role is dropped afterwards, also when the test fails."""
    role = f"outbox_limited_{uuid.uuid4().hex[:10]}"
    admin = _admin(db_url)
    with admin.connect() as c:
        c.exec_driver_sql(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 10")
    try:
        with admin.connect() as c:
            c.exec_driver_sql("CREATE TABLE effects (job_id bigint PRIMARY KEY, fence bigint NOT NULL)")
            c.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
            c.exec_driver_sql(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        yield db_url.set(username=role, password=None)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            c.exec_driver_sql(f"DROP OWNED BY {role}")
            c.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


def test_transactional_jobs_wait_for_a_connection_under_a_role_connection_limit(engine, limited_role, settings,
                                                                                  caplog):
    """16 workers, a role allowed 10 connections: a worker refused a connection ("too many
    connections for role") waits for one while its job stays held; no job records a failed
    attempt for it, none ends dead. The refusal is logged once per episode, and its end once."""
    caplog.set_level(logging.INFO, logger="outbox")
    ob = Outbox()

    @ob.subscriber("t", consumer="tx", transactional=True)
    def handler(job: Job, session: Session) -> None:
        session.execute(sa.text("SELECT pg_sleep(0.005)"))
        _write_effect(session, job)

    n = 300
    publish_events(engine, "t", [{"n": i} for i in range(n)])
    with running_relay(ob, settings(database_url=limited_role.render_as_string(hide_password=False), concurrency=16)):
        wait_for(lambda: _finished(engine, n), timeout=120, interval=0.2, what=f"{n} jobs finished")
    with engine.connect() as c:
        effects = dict(c.execute(sa.text("SELECT job_id, fence FROM effects")).all())
    _all_done_once(engine, lambda: effects)
    assert any("at most 49 connections (pool 24 + overflow 24 + 1 LISTEN)" in r.getMessage() for r in caplog.records)
    lines = [r.getMessage() for r in caplog.records if r.name == "outbox.relay.transaction"]
    episodes = [m for m in lines if "cannot get a database connection" in m]
    assert episodes and all("too many connections" in m for m in episodes), lines
    # Each episode: one warning, then one line when it ends, never two warnings in a row.
    marks = ["start" if "cannot get" in m else "end" for m in lines if "cannot get" in m or "again" in m]
    assert marks == ["start", "end"] * len(episodes), marks
    assert len(episodes) < 20, len(episodes)


# ------------------------------------------------------------ done jobs not kept


def test_a_relay_with_retention_done_zero_deletes_each_job_as_it_completes(engine, settings, effects):
    """``retention_done = 0``: every completion path deletes the job it completes (the
    combined claim-and-complete round, a transactional handler's completion, sync and
    async): each job ran once, each transactional job's write committed with its
    completion, and no job row is left, while a failing job still retries and ends dead.
    (Two relays' worth of work through one relay with two dispatchers.)"""
    ob = Outbox()
    ran: list[int] = []
    lock = threading.Lock()

    @ob.subscriber("t", consumer="lease")
    def lease_handler(job: Job) -> None:
        with lock:
            ran.append(job.id)

    @ob.subscriber("t", consumer="async_lease")
    async def async_handler(job: Job) -> None:
        with lock:
            ran.append(job.id)

    @ob.subscriber("t", consumer="tx", transactional=True)
    def tx_handler(job: Job, session: Session) -> None:
        _write_effect(session, job)

    @ob.subscriber("t", consumer="failing", max_attempts=2)
    def failing(job: Job) -> None:
        raise RuntimeError("always")

    publish_events(engine, "t", [{"n": i} for i in range(200)])
    relay = Relay(ob, settings(retention_done=0, concurrency=4, dispatchers=2, prefetch=20))
    assert not relay.settings.keep_done

    def left() -> list[tuple[str, str]]:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(sa.text("SELECT consumer, status FROM outbox_jobs GROUP BY 1, 2"))]

    relay.start()
    try:
        wait_for(lambda: left() == [("failing", "dead")], timeout=60, what="every job deleted but the dead ones")
    finally:
        relay.stop()
    assert relay.stats["pruned_jobs"] == 0  # deleted by their completions, none left done for the pruner
    assert len(ran) == len(set(ran)) == 400  # lease and async_lease: each job once
    assert len(effects()) == 200  # one committed write per transactional job
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*), min(attempts) FROM outbox_jobs")).one() == (200, 2)
