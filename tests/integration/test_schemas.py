"""Outbox in schemas of its own: two schemas side by side in one database, each migrated,
published into, routed, run, inspected and downgraded on its own; ``public`` untouched; the
URL's own ``options`` reach the server; NOTIFY channels per schema."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish, publish_many
from outbox.db import queries
from outbox.db.engine import make_engine
from outbox.db.migrate import downgrade, head_revision, upgrade
from outbox.errors import SchemaNotReadyError
from outbox.ops.cli import main
from outbox.relay.relay import Relay
from outbox.settings import OutboxSettings, default_schema
from outbox.testing import wait_for

A, B = "tenant_a", "tenant_b"
SYSTEM = "('pg_catalog', 'information_schema', 'pg_toast')"


@pytest.fixture(autouse=True)
def no_schema_in_the_environment(monkeypatch) -> Iterator[None]:
    """The process default is ``public``, which these tests never migrate: any statement
    that misses its schema fails loudly instead of passing by accident."""
    monkeypatch.delenv("OUTBOX_SCHEMA", raising=False)
    default_schema.cache_clear()
    yield
    default_schema.cache_clear()


@pytest.fixture
def two_schemas(empty_db_url: URL) -> Iterator[sa.Engine]:
    """An engine on a database whose outbox lives in tenant_a and tenant_b, not in public."""
    engine = make_engine(empty_db_url, pool_size=4)
    assert upgrade(engine, schema=A) == upgrade(engine, schema=B) == head_revision()
    yield engine
    engine.dispose()


def objects(engine: sa.Engine) -> dict[str, set[tuple[str, str]]]:
    """Relations (name, kind), functions and triggers in every non-system schema, by schema."""
    found: dict[str, set[tuple[str, str]]] = {}
    with engine.connect() as conn:
        for schema, name, kind in conn.execute(sa.text(f"""
                SELECT n.nspname, c.relname, c.relkind::text FROM pg_class c
                JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname NOT IN {SYSTEM}
                UNION ALL
                SELECT n.nspname, p.proname, 'function' FROM pg_proc p
                JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname NOT IN {SYSTEM}
                UNION ALL
                SELECT n.nspname, t.tgname, 'trigger' FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname NOT IN {SYSTEM} AND NOT t.tgisinternal""")):
            found.setdefault(schema, set()).add((name, kind))
    return found


def test_two_schemas_migrate_and_downgrade_independently_and_public_stays_empty(two_schemas):
    found = objects(two_schemas)
    assert set(found) == {A, B}, "nothing may be created outside the two schemas (public stays empty)"
    assert found[A] == found[B]
    names = {name for name, _ in found[A]}
    assert {"outbox_events", "outbox_jobs", "outbox_subscriptions", "outbox_relays", "outbox_fence_seq",
            "outbox_alembic_version", "outbox_notify", "outbox_events_notify", "outbox_jobs_notify",
            "ix_outbox_jobs_ready"} <= names
    with two_schemas.connect() as conn:
        for schema in (A, B):
            assert conn.execute(queries.in_schema(schema).schema_revision).scalar_one() == head_revision()
    assert upgrade(two_schemas, schema=A) == head_revision()  # again: nothing to do
    assert objects(two_schemas)[A] == found[A]

    downgrade(two_schemas, "base", schema=A)
    after = objects(two_schemas)
    assert after[A] == {("outbox_alembic_version", "r"), ("outbox_alembic_version_pkc", "i")}
    assert after[B] == found[B] and set(after) == {A, B}
    upgrade(two_schemas, schema=A)
    assert objects(two_schemas) == found


def test_two_schemas_migrate_at_once(two_schemas):
    """Each schema has a migration lock of its own: migrating tenant_b goes ahead while
    another transaction holds tenant_a's lock."""
    with two_schemas.connect() as holder:
        holder.execute(queries.schema_migrate_lock, {"key": queries.schema_migrate_lock_key(A)})
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(upgrade(two_schemas, schema=B)))
        thread.start()
        thread.join(timeout=30)
        assert done == [head_revision()], "migrating tenant_b waited for tenant_a's lock"
        holder.rollback()


def registry(schema: str, seen: list[tuple[Any, ...]], lock: threading.Lock) -> Outbox:
    """Two consumers of ``order.placed``, named the same in both schemas; each run records
    the schema it belongs to, the payload and (transactional) the session's search_path."""
    ob = Outbox()

    @ob.subscriber("order.placed", consumer="receipt")
    def receipt(job: Job) -> None:
        with lock:
            seen.append((schema, "receipt", job.payload["schema"], job.payload["n"]))

    @ob.subscriber("order.placed", consumer="invoice", transactional=True)
    def invoice(job: Job, session: Session) -> None:
        path = session.execute(sa.text("SHOW search_path")).scalar_one()
        with lock:
            seen.append((schema, "invoice", job.payload["schema"], job.payload["n"], path))

    return ob


def done_jobs(engine: sa.Engine, schema: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT count(*) FROM {schema}.outbox_jobs WHERE status = 'done'")).scalar_one()


def test_two_relays_side_by_side(two_schemas, empty_db_url, capsys):
    """A relay per schema, in one process and one database: each routes and runs only its own
    schema's events, with consumers of the same names; the URL's search_path option reaches
    the transactional handlers' sessions; the CLI reports each schema on its own."""
    seen: list[tuple[Any, ...]] = []
    lock = threading.Lock()
    url = empty_db_url.render_as_string(hide_password=False)
    base = dict(poll_interval=0.2, reap_interval=0.2, shutdown_grace=2.0, backoff_base=0.05, backoff_cap=0.2)
    relays = {
        A: Relay(registry(A, seen, lock), OutboxSettings(
            _env_file=None, schema_name=A, **base,  # the embedded server's URL has a query (host=) already
            database_url=empty_db_url.update_query_dict({"options": "-csearch_path=app_a"}).render_as_string(
                hide_password=False))),
        B: Relay(registry(B, seen, lock), OutboxSettings(_env_file=None, database_url=url, schema_name=B, **base)),
    }
    for relay in relays.values():
        relay.start()
    try:
        with Session(two_schemas) as s, s.begin():
            for n in range(5):
                publish(s, "order.placed", {"schema": A, "n": n}, schema=A)
            publish_many(s, [("order.placed", {"schema": B, "n": n}) for n in range(3)], schema=B)
        wait_for(lambda: done_jobs(two_schemas, A) == 10 and done_jobs(two_schemas, B) == 6, what="16 done jobs")
        with two_schemas.connect() as conn:
            for schema, relay in relays.items():
                ids = conn.execute(sa.text(f"SELECT id FROM {schema}.outbox_relays")).scalars().all()
                assert ids == [relay.worker_id]
    finally:
        for relay in relays.values():
            relay.stop()
    assert sorted(r[:4] for r in seen) == sorted(
        [(A, c, A, n) for c in ("receipt", "invoice") for n in range(5)]
        + [(B, c, B, n) for c in ("receipt", "invoice") for n in range(3)])
    paths = {r[0]: r[4] for r in seen if r[1] == "invoice"}
    assert paths[A] == "app_a", "the URL's options must reach the server unchanged"
    assert paths[B] == '"$user", public'
    for schema, relay in relays.items():
        assert relay.stats["events_routed"] == (5 if schema == A else 3)

    assert main(["status", "--schema", A, "--database-url", url]) == 0
    status_a = capsys.readouterr().out
    assert main(["status", "--database-url", url, "--schema", B]) == 0
    status_b = capsys.readouterr().out
    # consumer, ready, running, pending, dead, cancelled, done
    assert [line.split()[:7] for line in status_a.splitlines()[2:]] == [
        ["invoice", "0", "0", "0", "0", "0", "5"], ["receipt", "0", "0", "0", "0", "0", "5"]]
    assert [line.split()[:7] for line in status_b.splitlines()[2:]] == [
        ["invoice", "0", "0", "0", "0", "0", "3"], ["receipt", "0", "0", "0", "0", "0", "3"]]
    assert main(["subscriptions", "--schema", B, "--database-url", url]) == 0
    assert "invoice" in capsys.readouterr().out
    assert main(["unsubscribe", "receipt", "--schema", B, "--database-url", url]) == 0
    capsys.readouterr()
    with two_schemas.connect() as conn:
        assert conn.execute(sa.text(f"SELECT consumer FROM {A}.outbox_subscriptions ORDER BY 1")).scalars().all() \
            == ["invoice", "receipt"]
        assert conn.execute(sa.text(f"SELECT consumer FROM {B}.outbox_subscriptions")).scalars().all() == ["invoice"]


def test_dead_letters_and_redrive_per_schema(two_schemas, empty_db_url, capsys):
    url = empty_db_url.render_as_string(hide_password=False)
    with two_schemas.begin() as conn:
        for schema in (A, B):
            conn.execute(sa.text(f"INSERT INTO {schema}.outbox_events (topic, payload) VALUES ('t', '{{}}')"))
            conn.execute(sa.text(f"""INSERT INTO {schema}.outbox_jobs (event_id, consumer, status, max_attempts,
                                     last_error) SELECT id, 'c_{schema}', 'dead', 1, 'Boom: {schema}'
                                     FROM {schema}.outbox_events"""))
    assert main(["dead", "--schema", A, "--database-url", url]) == 0
    out = capsys.readouterr().out
    assert "c_tenant_a" in out and "Boom: tenant_a" in out and "tenant_b" not in out
    assert main(["redrive", "--all", "--schema", B, "--database-url", url]) == 0
    assert "redriven 1 job" in capsys.readouterr().out
    with two_schemas.connect() as conn:
        assert conn.execute(sa.text(f"SELECT status FROM {A}.outbox_jobs")).scalar_one() == "dead"
        assert conn.execute(sa.text(f"SELECT status FROM {B}.outbox_jobs")).scalar_one() == "ready"


def test_notify_channel_per_schema(two_schemas, empty_db_url):
    """A publish into tenant_a notifies ``tenant_a.outbox_events`` only: relays of tenant_b
    (and of public) are not woken."""
    conninfo = empty_db_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as listener:
        for channel in ("outbox_events", "tenant_a.outbox_events", "tenant_b.outbox_events"):
            listener.execute(f'LISTEN "{channel}"')
        with Session(two_schemas) as s, s.begin():
            publish(s, "t", {}, schema=A)
        got = [n.channel for n in listener.notifies(timeout=2, stop_after=1)]
        assert got == ["tenant_a.outbox_events"]
        assert [n.channel for n in listener.notifies(timeout=0.3)] == []


def test_url_options_reach_the_server(empty_db_url):
    """make_engine sends the URL's own ``options`` unchanged and adds none of its own."""
    engine = make_engine(empty_db_url.update_query_dict({"options": "-csearch_path=x -cstatement_timeout=1234"}))
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW search_path")).scalar_one() == "x"
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "1234ms"
    finally:
        engine.dispose()


def test_a_missing_schema_is_named(two_schemas, empty_db_url, capsys):
    url = empty_db_url.render_as_string(hide_password=False)
    with Session(two_schemas) as s, s.begin():
        with pytest.raises(SchemaNotReadyError, match=r"tenant_c\.outbox_events does not exist; "
                                                      r"run `outbox-relay migrate --schema tenant_c`"):
            publish(s, "t", {}, schema="tenant_c")
    relay = Relay(Outbox(), OutboxSettings(_env_file=None, database_url=url, schema_name="tenant_c"))
    with pytest.raises(SchemaNotReadyError, match="missing in schema tenant_c; run `outbox-relay migrate --schema"):
        relay.start()
    relay.engine.dispose()
    assert main(["status", "--schema", "tenant_c", "--database-url", url]) == 2
    assert "outbox tables are missing in schema tenant_c" in capsys.readouterr().err
    assert main(["status", "--database-url", url]) == 2  # public was never migrated either
    assert "missing in schema public; run `outbox-relay migrate`" in capsys.readouterr().err
    assert main(["status", "--schema", "Bad", "--database-url", url]) == 2
    assert "schema (OUTBOX_SCHEMA or --schema)" in capsys.readouterr().err
    assert main(["migrate", "--schema", "tenant_c", "--database-url", url]) == 0
    assert capsys.readouterr().out == f"outbox schema tenant_c at revision {head_revision()}\n"
    assert set(objects(two_schemas)) == {A, B, "tenant_c"}


@pytest.fixture
def schema_owner(server, empty_db_url) -> Iterator[str]:
    """The URL of a new login role that owns schema ``owned`` in the test's database and has
    no CREATE privilege on the database (PostgreSQL grants PUBLIC none). Dropped afterwards."""
    role = f"outbox_owner_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server[0], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
    db = sa.create_engine(empty_db_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with db.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA owned AUTHORIZATION {role}")
    try:
        yield empty_db_url.set(username=role).render_as_string(hide_password=False)
    finally:
        with db.connect() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role} CASCADE")
        db.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
        admin.dispose()


def test_migrate_into_an_existing_schema_needs_no_database_privilege(schema_owner, capsys):
    """A role that owns its schema, without CREATE on the database, migrates into it (and
    again: nothing to do); creating a missing schema is refused with one line."""
    for _ in range(2):
        assert main(["migrate", "--schema", "owned", "--database-url", schema_owner]) == 0
        assert capsys.readouterr().out == f"outbox schema owned at revision {head_revision()}\n"
    assert main(["status", "--schema", "owned", "--database-url", schema_owner]) == 0
    capsys.readouterr()
    assert main(["migrate", "--schema", "elsewhere", "--database-url", schema_owner]) == 2
    assert "InsufficientPrivilege: permission denied for database" in capsys.readouterr().err


def test_drain_runs_one_schema(two_schemas):
    """outbox.testing.drain works on the schema its settings name, sync and async
    transactional handlers included, and leaves the other schema alone."""
    from outbox.testing import drain

    ob = Outbox()
    ran: list[int] = []

    @ob.subscriber("t", consumer="sync_tx", transactional=True)
    def sync_tx(job: Job, session: Session) -> None:
        ran.append(job.payload["n"])

    @ob.subscriber("t", consumer="async_tx", transactional=True)
    async def async_tx(job: Job, session: Any) -> None:
        ran.append(job.payload["n"])

    with Session(two_schemas) as s, s.begin():
        publish_many(s, [("t", {"n": n}) for n in range(2)], schema=A)
        publish(s, "t", {"n": 9}, schema=B)
    results = drain(two_schemas, ob, settings=OutboxSettings(_env_file=None, schema_name=A))
    assert sorted((r.consumer, r.outcome) for r in results) == [("async_tx", "done")] * 2 + [("sync_tx", "done")] * 2
    assert sorted(ran) == [0, 0, 1, 1]
    assert done_jobs(two_schemas, A) == 4
    with two_schemas.connect() as conn:
        assert conn.execute(sa.text(f"SELECT count(*) FROM {B}.outbox_jobs")).scalar_one() == 0
        assert conn.execute(sa.text(f"SELECT count(*) FROM {B}.outbox_events WHERE routed_at IS NULL")).scalar_one() == 1


def test_a_fan_in_fires_in_its_own_schema(two_schemas):
    """The fan-in trigger of each schema reads and writes that schema's tables only (its
    function keeps the search path it was created under): the same fan-in in both schemas
    publishes each follow-up in the schema of its event, through that schema's publish
    function, whatever the session's search path."""
    from outbox.testing import drain

    ob = Outbox()
    for consumer in ("receipt", "invoice"):
        ob.subscriber("order.placed", consumer=consumer)(lambda job: None)
    ob.after("order.placed", consumers=["receipt", "invoice"], publish="order.fulfilled")
    with Session(two_schemas) as s, s.begin():
        placed = {A: publish_many(s, [("order.placed", {"n": n}, f"order:{n}") for n in range(2)], schema=A),
                  B: [publish(s, "order.placed", {"n": 9}, key="order:9", schema=B)]}
    for schema in (A, B):
        drain(two_schemas, ob, settings=OutboxSettings(_env_file=None, schema_name=schema))
    with two_schemas.connect() as conn:
        for schema in (A, B):
            follows = conn.execute(sa.text(f"SELECT key, headers FROM {schema}.outbox_events "
                                           "WHERE topic = 'order.fulfilled' ORDER BY id")).all()
            assert sorted(f.headers["fan_in_event_id"] for f in follows) == placed[schema]
            fired = conn.execute(sa.text(f"SELECT count(*) FROM {schema}.outbox_fanin_fired")).scalar_one()
            assert fired == len(placed[schema])
