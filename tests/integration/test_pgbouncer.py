"""Behind PgBouncer in transaction mode (README, "Connection poolers"), against a real
PgBouncer each test starts (tests/integration/pgbouncer.py): the relay with
``pooler='transaction'`` runs lease-mode and transactional jobs, the idle-in-transaction
limit still ends a handler that idles past its lease, an application's ``publish()`` works
with prepared statements off; and what fails without those settings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish
from outbox.db.engine import make_engine
from outbox.errors import OutboxError
from outbox.relay.relay import Relay
from outbox.testing import wait_for

from . import pgbouncer as bouncer_process
from .helpers import publish_events, running_relay

TIMEOUT = 60


@pytest.fixture
def bouncer(server: tuple[URL, bool], db_url: URL) -> Callable[..., Any]:
    """Start a PgBouncer (transaction mode) in front of this test's database; skipped, with
    the reason, where none can run."""
    reason = bouncer_process.unavailable(server[0])
    if reason:
        pytest.skip(reason)

    def start(**options):
        return bouncer_process.pgbouncer(db_url, **options)

    return start


@pytest.fixture
def through(bouncer) -> Iterator[URL]:
    """This test's database through a PgBouncer with 4 server connections."""
    with bouncer(pool_size=4) as url:
        yield url


def _text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _finished(engine: sa.Engine, n: int) -> bool:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM outbox_jobs WHERE status IN ('done', 'dead')")).scalar() == n


@pytest.mark.parametrize("listen", ["polling only", "LISTEN over a direct URL"])
def test_relay_through_pgbouncer_runs_lease_mode_and_transactional_jobs(engine, db_url, through, settings, caplog,
                                                                         listen):
    """300 events, a lease-mode and a transactional consumer, 8 workers sharing PgBouncer's
    4 server connections: every job done on its first attempt, each transactional effect
    written once. Before, the relay could not even start: PgBouncer refused the startup
    option carrying idle_in_transaction_session_timeout."""
    caplog.set_level(logging.INFO, logger="outbox")
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (job_id bigint PRIMARY KEY, fence bigint NOT NULL)"))
    ob = Outbox()
    ran: list[int] = []

    @ob.subscriber("t", consumer="lease_mode")
    def lease_mode(job: Job) -> None:
        ran.append(job.id)

    @ob.subscriber("t", consumer="tx", transactional=True)
    def tx(job: Job, session: Session) -> None:
        session.execute(sa.text("SELECT count(*) FROM effects")).scalar()
        session.execute(sa.text("INSERT INTO effects (job_id, fence) VALUES (:j, :f)"), {"j": job.id, "f": job.fence})

    extra = {"listen_url": _text(db_url)} if listen.startswith("LISTEN") else {}
    with running_relay(ob, settings(database_url=_text(through), pooler="transaction", concurrency=8, **extra)) as relay:
        publish_events(engine, "t", [{"n": i} for i in range(300)])
        wait_for(lambda: _finished(engine, 600), timeout=TIMEOUT, what="600 jobs finished")
    with engine.connect() as c:
        jobs = c.execute(sa.text("SELECT id, consumer, status, attempts, fence, last_error FROM outbox_jobs")).all()
        effects = dict(c.execute(sa.text("SELECT job_id, fence FROM effects")).all())
    assert {(j.status, j.attempts, j.last_error) for j in jobs} == {("done", 1, None)}
    assert effects == {j.id: j.fence for j in jobs if j.consumer == "tx"}
    assert sorted(ran) == sorted(j.id for j in jobs if j.consumer == "lease_mode")
    started = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("relay started"))
    assert "pooler transaction" in started
    if extra:
        assert f"LISTEN on {db_url.set(drivername='postgresql').render_as_string()}" in started
        assert relay.listener is not None
    else:
        assert "polling only" in started and relay.listener is None


def test_idle_in_transaction_limit_ends_a_handler_through_pgbouncer(engine, through, settings):
    """The limit is SET LOCAL in the handler's transaction, so it holds through PgBouncer
    (which forwards the server's 25P03): the idle attempts count, the job ends dead, nothing
    is committed."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (job_id bigint PRIMARY KEY, fence bigint NOT NULL)"))
    ob = Outbox()
    runs: list[int] = []

    @ob.subscriber("t", consumer="tx", transactional=True, lease=1, max_attempts=2)
    def handler(job: Job, session: Session) -> None:
        runs.append(job.attempt)
        session.execute(sa.text("INSERT INTO effects (job_id, fence) VALUES (:j, :f)"), {"j": job.id, "f": job.fence})
        job.wait_lease_lost(1.8)  # idle inside the transaction past its lease

    publish_events(engine, "t", [{"n": 1}])
    with running_relay(ob, settings(database_url=_text(through), pooler="transaction", concurrency=1, default_lease=1)):
        wait_for(lambda: _finished(engine, 1), timeout=TIMEOUT, what="the job finished")
    with engine.connect() as c:
        job = c.execute(sa.text("SELECT status, attempts, last_error FROM outbox_jobs")).one()
        assert c.execute(sa.text("SELECT count(*) FROM effects")).scalar() == 0
    assert (job.status, job.attempts, runs) == ("dead", 2, [1, 2])
    assert "idle-in-transaction timeout" in job.last_error


def _publish_alternating(engine: sa.Engine, calls: int) -> int:
    """Publish ``calls`` events, alternating between two of ``engine``'s connections (as
    two requests of an application would), each in its own transaction; returns how many
    committed."""
    done = 0
    with engine.connect() as a, engine.connect() as b:
        for n in range(calls):
            conn = (a, b)[n % 2]
            with conn.begin():
                publish(conn, "app.event", {"n": n}, key=f"k{n}")
            done += 1
    return done


def test_application_publish_through_pgbouncer_needs_prepared_statements_off(bouncer):
    """Two application connections share PgBouncer's one server connection: with psycopg's
    automatic prepared statements (the default) the second client's statement collides
    with the first's on the server after a few calls; with ``prepare_threshold=None`` (the
    README's engine for publish) or outbox's ``make_engine(prepared_statements=False)``,
    60 calls commit."""
    with bouncer(pool_size=1) as url:
        plain = sa.create_engine(url)
        with pytest.raises(sa.exc.DBAPIError) as failed:
            _publish_alternating(plain, 60)
        plain.dispose()
        assert isinstance(failed.value.orig, (psycopg.errors.DuplicatePreparedStatement,
                                              psycopg.errors.InvalidSqlStatementName)), failed.value.orig

        documented = sa.create_engine(url, connect_args={"prepare_threshold": None})
        before = _events(documented)  # what the plain engine committed before its failure
        assert before < 20
        assert _publish_alternating(documented, 60) == 60
        documented.dispose()
        ours = make_engine(url, prepared_statements=False)
        assert _publish_alternating(ours, 60) == 60
        assert _events(ours) == before + 120
        ours.dispose()


def _events(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM outbox_events WHERE topic = 'app.event'")).scalar()


def test_pgbouncer_refuses_startup_options_named_in_the_url(through, settings):
    """PgBouncer refuses the ``options`` startup parameter (its ``ignore_startup_parameters``
    aside): the relay sends none of its own, but one in the URL is still passed on, and the
    refusal is reported in one line naming it."""
    url = through.update_query_dict({"options": "-c statement_timeout=5000"})
    relay = Relay(Outbox(), settings(database_url=_text(url), pooler="transaction"))
    with pytest.raises(OutboxError, match="unsupported startup parameter: options"):
        relay.start()
    relay.engine.dispose()
