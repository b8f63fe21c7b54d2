"""Schema and migrations: `outbox-relay migrate` creates exactly what ``outbox.db.tables``
declares, keeps its own version table beside an application's, is idempotent and
reversible; ``metadata.create_all`` gives the same schema."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from outbox.db import queries
from outbox.db.engine import make_engine
from outbox.db.migrate import downgrade, head_revision, upgrade
from outbox.db.tables import EVENTS_CHANNEL, JOBS_CHANNEL, metadata
from outbox.ops.cli import main
from outbox.relay.router import route_all
from outbox.testing import temporary_database, wait_for
from tests.integration.migration_helpers import drift, snapshot

#: outbox's own alembic version table (alembic/env.py, a script, not importable).
VERSION_TABLE = "outbox_alembic_version"

#: What migrations 0012 and 0013 add, which a database at an earlier revision lacks.
LATER_TABLES = {"outbox_intake", "outbox_hook_calls", "outbox_fanins", "outbox_fanin_fired"}
LATER_COLUMNS = {("outbox_jobs", "started_at"), ("outbox_jobs", "history"), ("outbox_jobs", "fan_in"), ("outbox_jobs", "coalesce_key"),
                 ("outbox_jobs", "superseded_by"),
                 ("outbox_subscriptions", "coalescing"), ("outbox_subscriptions", "fan_in"),
                 ("outbox_subscriptions", "hooks")}
LATER_INDEXES = {"ix_outbox_jobs_superseded", "ix_outbox_jobs_coalesce"}


def drift_before_intake(engine: sa.Engine) -> list[object]:
    """:func:`drift` of a database migrated to a revision before 0012, less what 0012 and
    0013 add (``outbox_intake`` with its indexes; the tables, columns and index of issue 32)."""
    def later(d: Any) -> bool:
        if d[0] == "add_table":
            return d[1].name in LATER_TABLES
        if d[0] == "add_index":
            return d[1].table.name in LATER_TABLES or d[1].name in LATER_INDEXES
        if d[0] == "add_column":
            return (d[2], d[3].name) in LATER_COLUMNS
        return False
    return [d for d in drift(engine) if not later(d)]


def route_at_head(engine: sa.Engine, revision: str) -> Any:
    """Route what a database at ``revision`` holds with today's statements: upgraded to head
    (as a relay of this release needs), routed, and back to ``revision``."""
    upgrade(engine, "head")
    routed = route_all(engine)
    downgrade(engine, revision)
    return routed


#: The partial indexes of the design (docs/architecture.md, "Tables"), as PostgreSQL prints them.
PARTIAL_INDEXES = {
    "ix_outbox_events_unrouted": "ON public.outbox_events USING btree (id) WHERE (routed_at IS NULL)",
    "ix_outbox_events_routed_at": "ON public.outbox_events USING btree (routed_at) WHERE (routed_at IS NOT NULL)",
    "ix_outbox_jobs_ready": "ON public.outbox_jobs USING btree (priority, run_at, id) WHERE (status = 'ready'::text)",
    "ix_outbox_jobs_lease": "ON public.outbox_jobs USING btree (lease_until) WHERE (status = 'running'::text)",
    "ix_outbox_jobs_finished": "ON public.outbox_jobs USING btree (finished_at) WHERE (status = 'done'::text)",
    "ix_outbox_jobs_dead": "ON public.outbox_jobs USING btree (consumer, id) WHERE (status = 'dead'::text)",
    "ix_outbox_jobs_cancelled": "ON public.outbox_jobs USING btree (finished_at) WHERE (status = 'cancelled'::text)",
    "ix_outbox_jobs_superseded": "ON public.outbox_jobs USING btree (finished_at) WHERE (status = 'superseded'::text)",
    "ix_outbox_jobs_coalesce": "ON public.outbox_jobs USING btree (consumer, coalesce_key, event_id)"
                               " WHERE ((coalesce_key IS NOT NULL) AND (status = ANY (ARRAY['ready'::text, 'pending'::text, 'running'::text])))",
    "ix_outbox_jobs_ordering": "ON public.outbox_jobs USING btree (consumer, ordering_key, event_id)"
                               " WHERE ((ordering_key IS NOT NULL) AND (status <> 'done'::text))",
    "ix_outbox_events_unrouted_key": "ON public.outbox_events USING btree (key, id)"
                                     " WHERE ((routed_at IS NULL) AND (key IS NOT NULL))",
    "ix_outbox_intake_taken_at": "ON public.outbox_intake USING btree (taken_at) WHERE (problem IS NULL)",
    "ix_outbox_intake_rejected": "ON public.outbox_intake USING btree (source, taken_at) WHERE (problem IS NOT NULL)",
}

OUTBOX_TABLES = {"outbox_events", "outbox_subscriptions", "outbox_jobs", "outbox_relays", "outbox_schedules", "outbox_intake",
                 "outbox_consumers", "outbox_hook_calls", "outbox_fanins", "outbox_fanin_fired"}

#: Autovacuum storage parameters of migration 0002, as ``pg_class.reloptions`` lists them.
QUEUE_TABLE_OPTIONS = sorted([
    "autovacuum_vacuum_threshold=5000",
    "autovacuum_vacuum_scale_factor=0.01",
    "autovacuum_analyze_threshold=1000",
    "autovacuum_analyze_scale_factor=0.02",
    "autovacuum_vacuum_cost_limit=1000",
])
STORAGE_PARAMETERS = {"outbox_events": QUEUE_TABLE_OPTIONS, "outbox_jobs": QUEUE_TABLE_OPTIONS}


@pytest.fixture
def empty_engine(empty_db_url: URL) -> Iterator[sa.Engine]:
    engine = make_engine(empty_db_url)
    yield engine
    engine.dispose()


def cli_migrate(url: URL, capsys) -> str:
    status = main(["migrate", "--database-url", url.render_as_string(hide_password=False)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "Traceback" not in err
    return out


def without_version_table(snap: dict[str, object]) -> dict[str, object]:
    def keep(row: tuple) -> bool:
        return not any(isinstance(v, str) and VERSION_TABLE in v for v in row)

    return {name: [r for r in rows if keep(r)] for name, rows in snap.items()}


def storage_parameters(engine: sa.Engine) -> dict[str, list[str]]:
    """``pg_class.reloptions`` of every table in schema ``public`` that has any, sorted."""
    with engine.connect() as conn:
        return {name: sorted(options) for name, options in conn.exec_driver_sql(
            "SELECT relname, reloptions FROM pg_class"
            " WHERE relnamespace = 'public'::regnamespace AND relkind = 'r' AND reloptions IS NOT NULL")}


def table_oids(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.exec_driver_sql(
            "SELECT relname, oid::int FROM pg_class WHERE relnamespace = 'public'::regnamespace").all())


def test_migrate_on_empty_database_creates_the_schema(empty_db_url, empty_engine, capsys):
    out = cli_migrate(empty_db_url, capsys)
    head = head_revision()
    assert out.strip() == f"outbox schema public at revision {head}"
    snap = snapshot(empty_engine)
    assert {t for (t,) in snap["tables"]} == OUTBOX_TABLES | {VERSION_TABLE}
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars().all() == [head]
    assert drift(empty_engine) == []


def test_migrated_schema_has_sequence_triggers_and_partial_indexes(db_url, engine):
    snap = snapshot(engine)
    assert ("outbox_fence_seq", "bigint", 1, 1, False) in snap["sequences"]
    triggers = dict(snap["triggers"])
    assert set(triggers) == {"outbox_events_notify", "outbox_jobs_notify", "outbox_jobs_dead_hook",
                             "outbox_jobs_retry_hook", "outbox_jobs_fan_in_done", "outbox_jobs_fan_in_deleted"}
    assert triggers["outbox_events_notify"] == (
        "CREATE TRIGGER outbox_events_notify AFTER INSERT ON public.outbox_events REFERENCING NEW TABLE AS inserted "
        f"FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_events('{EVENTS_CHANNEL}')")
    assert triggers["outbox_jobs_notify"] == (
        "CREATE TRIGGER outbox_jobs_notify AFTER INSERT ON public.outbox_jobs "
        f"FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify('{JOBS_CHANNEL}')")
    # Failure hooks (migration 0013): row triggers whose WHEN keeps claims, heartbeats and
    # completions from calling the function.
    assert triggers["outbox_jobs_dead_hook"] == (
        "CREATE TRIGGER outbox_jobs_dead_hook AFTER UPDATE OF status ON public.outbox_jobs FOR EACH ROW "
        "WHEN (((new.status = 'dead'::text) AND (old.status IS DISTINCT FROM 'dead'::text))) "
        "EXECUTE FUNCTION outbox_hook_due('dead')")
    assert triggers["outbox_jobs_retry_hook"] == (
        "CREATE TRIGGER outbox_jobs_retry_hook AFTER UPDATE OF status ON public.outbox_jobs FOR EACH ROW "
        "WHEN (((old.status = 'running'::text) AND (new.status = 'ready'::text) AND (new.attempts = old.attempts))) "
        "EXECUTE FUNCTION outbox_hook_due('retry')")
    # Fan-in (migration 0013): only a listed job's completion, or its deletion before done,
    # calls the function.
    assert triggers["outbox_jobs_fan_in_done"] == (
        "CREATE TRIGGER outbox_jobs_fan_in_done AFTER UPDATE OF status ON public.outbox_jobs FOR EACH ROW "
        "WHEN ((new.fan_in AND (new.status = 'done'::text) AND (old.status IS DISTINCT FROM 'done'::text))) "
        "EXECUTE FUNCTION outbox_fan_in()")
    assert triggers["outbox_jobs_fan_in_deleted"] == (
        "CREATE TRIGGER outbox_jobs_fan_in_deleted AFTER DELETE ON public.outbox_jobs FOR EACH ROW "
        "WHEN ((old.fan_in AND (old.status <> 'done'::text))) EXECUTE FUNCTION outbox_fan_in()")
    indexes = dict(snap["indexes"])
    for name, definition in PARTIAL_INDEXES.items():
        assert indexes.get(name) == f"CREATE INDEX {name} {definition}"
    # Every non-unique index outbox creates is partial, so none grows with done rows.
    assert {n for n, d in indexes.items() if "UNIQUE" not in d} == set(PARTIAL_INDEXES)
    # fences come from the one sequence, in order
    with engine.begin() as conn:
        first, second = (conn.exec_driver_sql("SELECT nextval('outbox_fence_seq')").scalar() for _ in range(2))
    assert second == first + 1


def test_queue_tables_carry_their_autovacuum_storage_parameters(db_url, engine):
    assert storage_parameters(engine) == STORAGE_PARAMETERS


def test_downgrade_of_0002_resets_the_storage_parameters(empty_db_url, empty_engine, capsys):
    cli_migrate(empty_db_url, capsys)
    downgrade(empty_engine, "0001")
    assert storage_parameters(empty_engine) == {}  # back to the server's defaults
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars().all() == ["0001"]
    cli_migrate(empty_db_url, capsys)
    assert storage_parameters(empty_engine) == STORAGE_PARAMETERS


def test_no_drift_between_migrations_and_metadata(db_url, engine):
    assert drift(engine) == []


def test_drift_check_sees_a_difference(db_url, engine):
    # The comparison itself works: an extra column and a dropped index are both reported.
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_jobs ADD COLUMN extra int")
        conn.exec_driver_sql("DROP INDEX ix_outbox_jobs_lease")
    kinds = {diff[0] for diff in drift(engine)}
    assert {"remove_column", "add_index"} <= kinds


def test_migrate_again_is_a_no_op(empty_db_url, empty_engine, capsys):
    cli_migrate(empty_db_url, capsys)
    before, oids = snapshot(empty_engine), table_oids(empty_engine)
    with empty_engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{\"kept\": true}')")
    out = cli_migrate(empty_db_url, capsys)
    assert out.strip() == f"outbox schema public at revision {head_revision()}"
    assert snapshot(empty_engine) == before
    assert table_oids(empty_engine) == oids  # nothing dropped and recreated
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT payload FROM outbox_events").scalars().all() == [{"kept": True}]


def test_application_alembic_version_table_is_untouched(empty_db_url, empty_engine, capsys):
    with empty_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_rev_42')")
        conn.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY)")
    cli_migrate(empty_db_url, capsys)
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all() == ["app_rev_42"]
        assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars().all() == [head_revision()]
    downgrade(empty_engine, "base")
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all() == ["app_rev_42"]
        assert conn.exec_driver_sql("SELECT count(*) FROM orders").scalar() == 0


def test_downgrade_to_base_removes_everything(empty_db_url, empty_engine, capsys):
    pristine = snapshot(empty_engine)
    cli_migrate(empty_db_url, capsys)
    downgrade(empty_engine, "base")
    after = snapshot(empty_engine)
    # alembic keeps its (now empty) version table; nothing else of outbox remains.
    assert without_version_table(after) == pristine
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {VERSION_TABLE}").scalar() == 0
    # and it can be migrated up again
    cli_migrate(empty_db_url, capsys)
    assert drift(empty_engine) == []


def test_create_all_gives_the_same_schema_as_the_migrations(server, db_url, engine, empty_engine):
    metadata.create_all(empty_engine)
    assert drift(empty_engine) == []
    assert snapshot(empty_engine) == without_version_table(snapshot(engine))


def _run_ats(engine: sa.Engine, ids: list[int]) -> list[str | None]:
    with engine.connect() as conn:
        found = dict(conn.execute(sa.text("SELECT id, CAST(run_at AT TIME ZONE 'UTC' AS text) FROM outbox_events"
                                          " WHERE id = ANY (:ids)"), {"ids": ids}).all())
    return [found[i] for i in ids]


def _insert_run_ats(engine: sa.Engine, run_ats: list[str], *, routed: bool = False) -> list[int]:
    with engine.begin() as conn:
        return [conn.execute(sa.text(
            "INSERT INTO outbox_events (topic, payload, run_at, routed_at)"
            " VALUES ('t', '{}', CAST(:run_at AS timestamptz), CASE WHEN :routed THEN now() END) RETURNING id"),
            {"run_at": r, "routed": routed}).scalar_one() for r in run_ats]


def test_0011_keeps_run_at_readable_and_rewrites_the_backlogs(empty_engine, caplog):
    """Before 0011 a plain INSERT could write a run_at no relay can load (psycopg refuses
    years before 1 and after 9999), and routing and claims then failed for every consumer.
    0011's CHECK refuses it from every writer; the backlog's such events are rewritten (before
    year 1: NULL, due at once; after 9999: the end of 9999) with a warning and then route;
    with routed history the CHECK stays NOT VALID, as 0008's."""
    caplog.set_level(logging.WARNING, logger="outbox.db.migrate")
    upgrade(empty_engine, "0010")
    backlog = _insert_run_ats(empty_engine, ["-infinity", "0002-01-01 00:00:00+00 BC", "infinity",
                                             "2030-01-01 00:00:00+00"])
    upgrade(empty_engine, "0011")
    assert _run_ats(empty_engine, backlog) == [None, None, "9999-12-31 23:59:59.999999", "2030-01-01 00:00:00"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "outbox.db.migrate"]
    assert len(warnings) == 1 and "3 unrouted events" in warnings[0], warnings
    with empty_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT convalidated FROM pg_constraint"
                                    " WHERE conname = 'ck_outbox_events_run_at_in_range'").scalar_one()
    assert route_at_head(empty_engine, "0011").events == 4
    for bad in ("-infinity", "infinity", "10000-01-01 00:00:00+00", "0001-12-31 23:00:00+00 BC"):
        with pytest.raises(sa.exc.IntegrityError) as refused:
            _insert_run_ats(empty_engine, [bad])
        assert isinstance(refused.value.orig, psycopg.errors.CheckViolation), bad
    assert drift_before_intake(empty_engine) == []

    downgrade(empty_engine, "0010")
    history = _insert_run_ats(empty_engine, ["-infinity"], routed=True)
    upgrade(empty_engine, "0011")
    assert _run_ats(empty_engine, history) == ["-infinity"]  # routed: never read again, kept
    with empty_engine.connect() as conn:
        assert not conn.exec_driver_sql("SELECT convalidated FROM pg_constraint"
                                        " WHERE conname = 'ck_outbox_events_run_at_in_range'").scalar_one()


# ------------------------------------------------------------- concurrent migrations


def start_migrate(url: URL) -> subprocess.Popen[str]:
    """``python -m outbox.ops.cli migrate`` on ``url`` as a process of its own (no OUTBOX_* variable
    from this environment)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.Popen([sys.executable, "-m", "outbox.ops.cli", "migrate", "--database-url",
                             url.render_as_string(hide_password=False)],
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("round_", range(5))
def test_concurrent_migrate_processes_take_turns(server, round_):
    """Every replica of a deployment runs ``outbox-relay migrate`` at start-up: four of them
    started together on an empty database all exit 0 with the schema at head. Before the
    migration lock, two of them created the version table at once and one died with a
    UniqueViolation traceback (about one round in two)."""
    with temporary_database(server[0]) as url:
        processes = [start_migrate(url) for _ in range(4)]
        results = [(p.wait(timeout=120), *p.communicate()) for p in processes]
        head = head_revision()
        for status, out, err in results:  # stderr holds alembic's INFO lines, nothing else
            assert (status, out) == (0, f"outbox schema public at revision {head}\n"), (status, out, err)
            assert "Traceback" not in err and "error" not in err.lower(), err
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars().all() == [head]
            assert drift(engine) == []
        finally:
            engine.dispose()


def waiting_for_the_migration_lock(engine: sa.Engine) -> bool:
    """True when some session waits for the advisory lock of ``queries.SCHEMA_MIGRATE_LOCK_KEY``."""
    key = queries.SCHEMA_MIGRATE_LOCK_KEY
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = :high AND objid = :low AND objsubid = 1"),
            {"high": (key >> 32) & 0xFFFFFFFF, "low": key & 0xFFFFFFFF}).scalar_one() > 0


@pytest.mark.parametrize("operation", ["upgrade", "downgrade"])
def test_migration_waits_for_the_migration_lock(empty_engine, operation):
    """``upgrade`` and ``downgrade`` take the migration lock first and change nothing while
    another transaction holds it; once it is released they run to the end."""
    if operation == "downgrade":
        upgrade(empty_engine)
    before = snapshot(empty_engine)
    outcome: list[object] = []

    def migrate() -> None:
        try:
            outcome.append(upgrade(empty_engine) if operation == "upgrade" else downgrade(empty_engine, "base"))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome.append(exc)

    with empty_engine.connect() as holder:
        holder.execute(queries.schema_migrate_lock, {"key": queries.SCHEMA_MIGRATE_LOCK_KEY})
        thread = threading.Thread(target=migrate)
        thread.start()
        wait_for(lambda: waiting_for_the_migration_lock(empty_engine) or outcome, what="the migration to wait")
        assert outcome == [], f"{operation} ran while another transaction held the migration lock: {outcome}"
        assert snapshot(empty_engine) == before
        holder.rollback()  # releases the lock
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert outcome == [head_revision() if operation == "upgrade" else None]
    tables = {t for (t,) in snapshot(empty_engine)["tables"]}
    assert tables == (OUTBOX_TABLES | {VERSION_TABLE} if operation == "upgrade" else {VERSION_TABLE})


def test_migration_lock_key_is_the_documented_one():
    """The key operators look for in ``pg_locks`` is derived from a name, as documented."""
    import hashlib

    derived = int.from_bytes(hashlib.sha256(b"outbox.migrate").digest()[:8], "big", signed=True)
    assert queries.SCHEMA_MIGRATE_LOCK_KEY == derived == 1152047312153713616
    assert ((derived >> 32) & 0xFFFFFFFF, derived & 0xFFFFFFFF) == (268231917, 895327184)  # classid, objid


def _headers_check_validated(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return conn.exec_driver_sql("SELECT convalidated FROM pg_constraint"
                                    " WHERE conname = 'ck_outbox_events_headers_object'").scalar_one()


def _insert_events(engine: sa.Engine, headers: list[str], *, routed: bool = False) -> list[int]:
    with engine.begin() as conn:
        return [conn.execute(sa.text(
            "INSERT INTO outbox_events (topic, payload, headers, routed_at)"
            " VALUES ('t', '{}', CAST(:headers AS jsonb), CASE WHEN :routed THEN now() END) RETURNING id"),
            {"headers": h, "routed": routed}).scalar_one() for h in headers]


def _headers(engine: sa.Engine, ids: list[int]) -> list[object]:
    with engine.connect() as conn:
        found = dict(conn.execute(sa.text("SELECT id, headers FROM outbox_events WHERE id = ANY (:ids)"),
                                  {"ids": ids}).all())
    return [found[i] for i in ids]


def test_0008_rewrites_the_backlogs_bad_headers_and_validates_only_without_history(empty_engine, caplog):
    """Migration 0008 adds the headers CHECK NOT VALID, so it reads no history under its
    exclusive lock. Unrouted events whose headers are not an object (which only a writer
    other than publish could make) would fail the router's update of ``routed_at`` under
    the CHECK and stop routing: they are rewritten (null -> {}, any other value kept under
    ``invalid_headers``), with a warning naming them, and then route. With no routed event
    retained the CHECK is validated at once; with history it stays NOT VALID, routed events
    keep their headers, and VALIDATE (the operator's, in a transaction of its own) fails
    until the last such event is gone."""
    caplog.set_level(logging.WARNING, logger="outbox.db.migrate")
    upgrade(empty_engine, "0007")
    backlog = _insert_events(empty_engine, ["null", "[1, 2]", '"x"', '{"a": 1}'])
    upgrade(empty_engine, "0008")
    assert _headers(empty_engine, backlog) == [{}, {"invalid_headers": [1, 2]}, {"invalid_headers": "x"}, {"a": 1}]
    warnings = [r.getMessage() for r in caplog.records if r.name == "outbox.db.migrate"]
    assert len(warnings) == 1 and "3 unrouted events" in warnings[0], warnings
    assert ", ".join(map(str, backlog[:3])) in warnings[0]
    assert _headers_check_validated(empty_engine)
    assert route_at_head(empty_engine, "0008").events == 4

    downgrade(empty_engine, "0007")
    history = _insert_events(empty_engine, ['"old"'], routed=True)
    backlog = _insert_events(empty_engine, ["[3]"])
    upgrade(empty_engine, "0008")
    assert _headers(empty_engine, history + backlog) == ["old", {"invalid_headers": [3]}]
    assert not _headers_check_validated(empty_engine)
    assert route_at_head(empty_engine, "0008").events == 1
    assert drift_before_intake(empty_engine) == []
    validate = "ALTER TABLE outbox_events VALIDATE CONSTRAINT ck_outbox_events_headers_object"
    with empty_engine.connect() as conn:
        with pytest.raises(sa.exc.IntegrityError) as failed:
            conn.exec_driver_sql(validate)
        assert isinstance(failed.value.orig, psycopg.errors.CheckViolation)
    with empty_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_events WHERE id = ANY (:ids)"), {"ids": history})
        conn.exec_driver_sql(validate)
    assert _headers_check_validated(empty_engine)
