"""Least privilege: an owner migrates, `outbox-relay grants --apply` gives a relay role and
a publisher role what they need, and a relay and publish run end to end under those roles;
the publisher cannot read jobs or payloads, nor insert any column publish does not write
(an id of its choosing, ``routed_at``, ``created_at``); headers that are not a JSON object
are refused for every writer; the relay cannot change the schema, and the upkeep only the
owner may do (ANALYZE, VACUUM) is skipped with one warning."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import Job, Outbox, publish, publish_many
from outbox.db import queries
from outbox.db.engine import make_async_engine, make_engine
from outbox.db.migrate import upgrade
from outbox.ops.cli import main
from outbox.ops.grants import PUBLISHER_EVENT_INSERT_COLUMNS, grant_statements, render
from outbox.relay.relay import Relay
from outbox.relay.statistics import AnalyzeOutcome, StatisticsKeeper
from outbox.testing import wait_for

SCHEMA = "shop"
TIMEOUT = 20
#: Seconds the clean-up waits for an unreachable server (:func:`_drop_roles_after`).
CLEANUP_WAIT = 60
ROOT = Path(__file__).resolve().parents[2]
ROLES_PAGE = ROOT / "docs" / "schemas-and-roles.md"


@pytest.fixture
def roles(empty_db_url: URL) -> Iterator[dict[str, URL]]:
    """Three login roles of this test's own (owner, relay, publisher), the owner allowed to
    create schemas in the test's database; each role's URL. Dropped afterwards (with
    everything they own or were granted), after the database."""
    suffix = uuid.uuid4().hex[:10]
    names = {kind: f"outbox_{kind}_{suffix}" for kind in ("owner", "relay", "publisher")}
    admin = make_engine(empty_db_url.set(database="postgres"))
    try:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            if not c.execute(sa.text("SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user"))\
                    .scalar_one():
                pytest.skip("the test server's role may not create roles")
            for name in names.values():
                c.exec_driver_sql(f'CREATE ROLE "{name}" LOGIN')
            c.exec_driver_sql(f'GRANT CREATE ON DATABASE "{empty_db_url.database}" TO "{names["owner"]}"')
        yield {kind: empty_db_url.set(username=name) for kind, name in names.items()}
    finally:
        admin.dispose()
        _drop_roles_after(empty_db_url, list(names.values()))


def _drop_roles_after(db_url: URL, names: list[str]) -> None:
    """Drop the test's database first (the owner role owns its schema; the fixture's own
    teardown, which runs after this one, then finds it gone), then the roles: they hold
    nothing elsewhere but what DROP OWNED revokes (the database privilege went with it).
    Roles are cluster-wide and must not outlive the test: while the server cannot be reached
    (restarted by another test of a shared server) it is tried again, for up to
    ``CLEANUP_WAIT`` seconds."""
    admin = make_engine(db_url.set(database="postgres"))

    def dropped() -> bool:
        try:
            with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db_url.database}" WITH (FORCE)')
                for name in names:
                    if c.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": name}).first():
                        c.exec_driver_sql(f'DROP OWNED BY "{name}"')
                        c.exec_driver_sql(f'DROP ROLE "{name}"')
        except OperationalError:
            return False
        return True

    try:
        wait_for(dropped, timeout=CLEANUP_WAIT, interval=0.5, what=f"the test's database and roles {names} dropped")
    finally:
        admin.dispose()


def _url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _denied(engine: sa.Engine, statement: str) -> bool:
    """Whether ``statement`` fails for want of a privilege (nothing is changed either way)."""
    with engine.connect() as c:
        try:
            c.execute(sa.text(statement))
        except ProgrammingError as exc:
            return isinstance(exc.orig, psycopg.errors.InsufficientPrivilege)
        finally:
            c.rollback()
    return False


def test_grants_command_prints_quoted_statements(capsys):
    assert main(["grants", "--relay", "relay", "--publisher", 'app"; DROP TABLE x; --', "--schema", "shop"]) == 0
    out = capsys.readouterr().out
    assert 'REVOKE INSERT ON TABLE "shop"."outbox_events" FROM "app""; DROP TABLE x; --";' in out
    assert ('GRANT INSERT ("topic", "key", "payload", "headers", "run_at", "priority", "dedup_key") ON TABLE '
            '"shop"."outbox_events" TO "app""; DROP TABLE x; --";') in out
    assert 'GRANT USAGE ON SEQUENCE "shop"."outbox_fence_seq" TO "relay";' in out
    assert out.count(";\n") == len(grant_statements("relay", "app", "shop"))
    assert render(grant_statements(None, "p")).startswith('GRANT USAGE ON SCHEMA "public" TO "p";')
    for bad in (["--relay", "public"], ["--publisher", "pg_monitor"], ["--relay", "x" * 64], []):
        assert main(["grants", *bad]) == 2
    assert "outbox-relay: error:" in capsys.readouterr().err


def test_relay_and_publisher_roles_end_to_end(roles, settings, caplog):
    owner = make_engine(roles["owner"])
    upgrade(owner, schema=SCHEMA)
    names = {kind: url.username for kind, url in roles.items()}
    assert main(["grants", "--relay", names["relay"], "--publisher", names["publisher"], "--schema", SCHEMA,
                 "--apply", "--database-url", _url_text(roles["owner"])]) == 0
    with owner.begin() as c:  # autovacuum off for the queue: the relay would vacuum after each pruning round
        for table in ("outbox_jobs", "outbox_events"):
            c.exec_driver_sql(f"ALTER TABLE {SCHEMA}.{table} SET (autovacuum_enabled = false)")

    ob = Outbox()
    done: list[tuple[str, Any]] = []

    @ob.subscriber("order.placed", consumer="receipt")
    def receipt(job: Job) -> None:
        done.append(("receipt", job.payload))

    @ob.subscriber("order.placed", consumer="ledger", ordered=True)
    def ledger(job: Job) -> None:
        done.append(("ledger", job.payload))

    # A fan-in: its follow-up is published by the trigger, as the relay role (EXECUTE on outbox_publish).
    ob.after("order.placed", consumers=["receipt", "ledger"], publish="order.fulfilled")
    shipped: list[Any] = []
    ob.subscriber("order.fulfilled", consumer="ship")(lambda job: shipped.append(job.headers["fan_in_event_id"]))

    caplog.set_level(logging.INFO)
    relay = Relay(ob, settings(database_url=_url_text(roles["relay"]), schema_name=SCHEMA, prune_interval=0.2))
    # ANALYZE due after every routed job, asked again at once: the warning must still come once.
    relay.router.statistics = StatisticsKeeper(relay.engine, floor=0, retry_cap=0.0, schema=SCHEMA,
                                               upkeep=relay.maintenance.upkeep)
    relay.start()
    publisher = make_engine(roles["publisher"])
    try:
        with Session(publisher) as s, s.begin():
            first = publish(s, "order.placed", {"n": 1}, key="order:1", schema=SCHEMA)  # ordered: the key's lock
            assert publish(s, "order.placed", {"n": 2}, dedup_key="d", schema=SCHEMA) > first
        with Session(publisher) as s, s.begin():
            again = publish(s, "order.placed", {"n": 2}, dedup_key="d", schema=SCHEMA)  # held: looked up
            more = publish_many(s, [("order.placed", {"n": 3}, "order:1"),
                                    {"topic": "order.placed", "payload": {"n": 4}, "dedup_key": "d"}], schema=SCHEMA)
        assert more[1] == again
        wait_for(lambda: len(done) == 6, timeout=TIMEOUT, what="the jobs of three events, two consumers each")
        assert [p["n"] for c, p in done if c == "ledger"] == [1, 2, 3]
        wait_for(lambda: relay.router.statistics.denied >= 2 and relay.stats["vacuums_skipped"] >= 2,
                 timeout=TIMEOUT, what="ANALYZE and VACUUM each skipped twice")
        # The relay keeps working after the skips.
        with Session(publisher) as s, s.begin():
            publish(s, "order.placed", {"n": 5}, schema=SCHEMA)
        wait_for(lambda: len(done) == 8, timeout=TIMEOUT, what="a job after the skipped upkeep")
        # The SQL functions, with the publisher's EXECUTE and column grants only.
        with publisher.begin() as c:
            c.execute(sa.text(f"SELECT {SCHEMA}.outbox_publish('order.placed', CAST(:p AS jsonb), 'order:1', "
                              "dedup_key => 'sql')"), {"p": '{"n": 6}'})
            c.execute(sa.text(f"SELECT {SCHEMA}.outbox_publish_many(CAST(:e AS jsonb))"),
                      {"e": '[["order.placed", {"n": 7}, "order:1"], '
                            '{"topic": "order.placed", "payload": {"n": 8}, "dedup_key": "sql"}]'})
        wait_for(lambda: len(done) == 12, timeout=TIMEOUT, what="the jobs of two events published from SQL")
        assert [p["n"] for c, p in done if c == "ledger"][-2:] == [6, 7]
        wait_for(lambda: len(shipped) == 6, timeout=TIMEOUT, what="a follow-up per order")
    finally:
        relay.stop()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "may not ANALYZE or VACUUM" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert names["relay"] in warnings[0].getMessage()
    assert relay.stats["vacuums"] == 0 and relay.router.statistics.analyzed == 0

    # The relay role runs the inspecting commands too.
    relay_url = _url_text(roles["relay"])
    for command in (["status"], ["dead"], ["subscriptions"]):
        assert main([*command, "--schema", SCHEMA, "--database-url", relay_url]) == 0, command

    # The publisher: no jobs, no payloads, headers or keys, no changes to events.
    for statement in (f"SELECT count(*) FROM {SCHEMA}.outbox_jobs",
                      f"SELECT payload FROM {SCHEMA}.outbox_events",
                      f"SELECT headers FROM {SCHEMA}.outbox_events",
                      f"SELECT key FROM {SCHEMA}.outbox_events",
                      f"UPDATE {SCHEMA}.outbox_events SET routed_at = NULL",
                      f"DELETE FROM {SCHEMA}.outbox_events",
                      f"UPDATE {SCHEMA}.outbox_jobs SET status = 'ready'",
                      f"SELECT nextval('{SCHEMA}.outbox_fence_seq')",
                      f"SELECT consumer FROM {SCHEMA}.outbox_subscriptions"):
        assert _denied(publisher, statement), statement
    # The relay: no DDL.
    relay_engine = make_engine(roles["relay"])
    for statement in (f"SELECT {SCHEMA}.outbox_publish_many('[]')",  # the fan-in needs outbox_publish only
                      f"CREATE TABLE {SCHEMA}.intruder (id int)",
                      f"ALTER TABLE {SCHEMA}.outbox_jobs ADD COLUMN intruder int",
                      f"TRUNCATE {SCHEMA}.outbox_jobs"):
        assert _denied(relay_engine, statement), statement
    with relay_engine.connect() as c:  # DROP: "must be owner", the same SQLSTATE
        with pytest.raises(ProgrammingError) as raised:
            c.execute(sa.text(f"DROP TABLE {SCHEMA}.outbox_jobs"))
        assert isinstance(raised.value.orig, psycopg.errors.InsufficientPrivilege)
    for engine in (publisher, relay_engine, owner):
        engine.dispose()


def test_statistics_keeper_analyzes_as_owner(engine):
    """The check asks the database: the tables' owner (the migrating role) still analyses."""
    keeper = StatisticsKeeper(engine, floor=0)
    assert keeper.routed(1) is AnalyzeOutcome.ANALYZED
    assert keeper.upkeep.denied == 0


def test_grants_maintain(db_url, capsys):
    """``--maintain`` grants MAINTAIN (PostgreSQL 17+); an older server refuses it clearly,
    before granting anything."""
    assert main(["grants", "--relay", "r", "--maintain"]) == 0
    assert 'GRANT MAINTAIN ON TABLE "public"."outbox_jobs", "public"."outbox_events" TO "r";' in capsys.readouterr().out
    engine = make_engine(db_url)
    with engine.connect() as c:
        version = c.execute(sa.text("SELECT current_setting('server_version_num')::int")).scalar_one()
        role = c.execute(sa.text("SELECT current_user")).scalar_one()
    engine.dispose()
    if version >= 170000:
        pytest.skip("PostgreSQL 17 or later grants MAINTAIN; the refusal is for older servers")
    assert main(["grants", "--relay", role, "--maintain", "--apply", "--database-url", _url_text(db_url)]) == 2
    assert "the MAINTAIN privilege needs PostgreSQL 17 or later" in capsys.readouterr().err


def test_grants_apply_refuses_a_missing_role(db_url, capsys):
    assert main(["grants", "--relay", f"nobody_{uuid.uuid4().hex[:8]}", "--apply",
                 "--database-url", _url_text(db_url)]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err


def test_grants_apply_refuses_a_schema_without_outbox_tables(db_url, capsys):
    """A misspelt --schema is refused by name, in one line, before anything is granted."""
    engine = make_engine(db_url)
    with engine.connect() as c:
        role = c.execute(sa.text("SELECT current_user")).scalar_one()
    engine.dispose()
    schema = f"nosuch_{uuid.uuid4().hex[:8]}"
    assert main(["grants", "--relay", role, "--apply", "--schema", schema, "--database-url", _url_text(db_url)]) == 2
    err = capsys.readouterr().err
    assert f"schema '{schema}' holds no outbox tables" in err and "Traceback" not in err, err


def _refused(engine: sa.Engine, statement: str) -> psycopg.Error | None:
    """The database's error for ``statement`` (None when it succeeded); rolled back either way."""
    with engine.connect() as c:
        try:
            c.execute(sa.text(statement))
        except (ProgrammingError, IntegrityError) as exc:
            assert isinstance(exc.orig, psycopg.Error)
            return exc.orig
        finally:
            c.rollback()
    return None


def test_publisher_insert_columns_are_those_publish_writes():
    """The columns ``grants`` lets the publisher insert are exactly those named by the
    INSERTs of every statement publish() and publish_many() run (found in publish.py's
    source): a statement that writes one more column fails here, not in an application."""
    source = inspect.getsource(sys.modules[publish.__module__])
    names = set(re.findall(r"statements\.(event_insert\w*)", source))
    assert names == {"event_insert", "event_insert_many", "event_insert_options", "event_insert_options_many"}
    written: set[str] = set()
    for name in names:
        found = re.findall(r"INSERT INTO outbox_events \(([^)]*)\)", getattr(queries, name).text)
        assert len(found) == 1, name
        written |= {column.strip() for column in found[0].split(",")}
    assert written == set(PUBLISHER_EVENT_INSERT_COLUMNS)
    assert {"id", "routed_at", "created_at"}.isdisjoint(PUBLISHER_EVENT_INSERT_COLUMNS)


def test_publisher_inserts_only_the_columns_publish_writes(roles):
    """Issue 26 item 6 (a). With INSERT on the whole table (what ``grants`` gave before) the
    publisher could insert an id of its choosing past the identity (``OVERRIDING SYSTEM
    VALUE``: every other publish then fails on the primary key), a preset ``routed_at`` (the
    event is never routed) or ``created_at``. ``grants --apply`` run again takes that grant
    back and grants INSERT on publish's columns only: those inserts are refused for want of
    a privilege, a raw insert of publish's own columns still works, headers that are not a
    JSON object are refused by the CHECK, and every publish option works through the role:
    key (ordered: the publish lock), headers, run_at, delay, priority, dedup_key (written and
    held), publish_many without and with options, and an async publish."""
    owner = make_engine(roles["owner"])
    upgrade(owner, schema=SCHEMA)
    publisher_name = roles["publisher"].username
    events = f"{SCHEMA}.outbox_events"
    with owner.begin() as c:
        c.exec_driver_sql(f'GRANT INSERT ON TABLE {events} TO "{publisher_name}"')
        c.exec_driver_sql(f"INSERT INTO {SCHEMA}.outbox_subscriptions (topic, consumer, max_attempts, lease_seconds,"
                          " ordered) VALUES ('t.ordered', 'c', 5, 30, true)")
    assert main(["grants", "--publisher", publisher_name, "--schema", SCHEMA, "--apply",
                 "--database-url", _url_text(roles["owner"])]) == 0
    publisher = make_engine(roles["publisher"])
    try:
        outbox_columns = (
            f"INSERT INTO {events} (id, topic, payload) OVERRIDING SYSTEM VALUE VALUES (1000000, 't', '{{}}')",
            f"INSERT INTO {events} (topic, payload, routed_at) VALUES ('t', '{{}}', now())",
            f"INSERT INTO {events} (topic, payload, created_at) VALUES ('t', '{{}}', now() - interval '1 day')")
        allowed = [(statement, error) for statement in outbox_columns
                   if not isinstance(error := _refused(publisher, statement), psycopg.errors.InsufficientPrivilege)]
        assert allowed == []
        assert _refused(publisher, f"INSERT INTO {events} (topic, payload, headers) VALUES ('t', '{{}}', '{{}}')") is None
        for headers in ("[]", '"x"', "null"):
            error = _refused(publisher, f"INSERT INTO {events} (topic, payload, headers) VALUES ('t', '{{}}', '{headers}')")
            assert isinstance(error, psycopg.errors.CheckViolation), (headers, error)
            assert error.diag.constraint_name == "ck_outbox_events_headers_object"

        run_at = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
        with Session(publisher) as s, s.begin():
            ids = {
                "plain": publish(s, "t.plain", {"n": 1}, schema=SCHEMA),
                "keyed": publish(s, "t.ordered", {"n": 2}, key="k", headers={"h": "v"}, schema=SCHEMA),
                "run_at": publish(s, "t.plain", {"n": 3}, run_at=run_at, priority=-5, schema=SCHEMA),
                "delay": publish(s, "t.ordered", {"n": 4}, key="k", delay=60, dedup_key="d1", schema=SCHEMA),
            }
            many = publish_many(s, [("t.plain", {"n": 5}), ("t.ordered", {"n": 6}, "k", {"h": "w"})], schema=SCHEMA)
            many_options = publish_many(s, [
                {"topic": "t.plain", "payload": {"n": 7}, "run_at": run_at, "priority": 7, "dedup_key": "d2"},
                {"topic": "t.ordered", "payload": {"n": 8}, "key": "k", "headers": {"h": "x"}, "delay": 30},
                {"topic": "t.ordered", "payload": {"n": 4}, "dedup_key": "d1"}], schema=SCHEMA)
        assert many_options[2] == ids["delay"]
        with Session(publisher) as s, s.begin():
            assert publish(s, "t.ordered", {"n": 4}, dedup_key="d1", schema=SCHEMA) == ids["delay"]  # held

        async def publish_async() -> int:
            engine = make_async_engine(roles["publisher"])
            try:
                async with AsyncSession(engine) as s, s.begin():
                    return await publish(s, "t.ordered", {"n": 9}, key="k", run_at=run_at, priority=1,
                                         dedup_key="d3", schema=SCHEMA)
            finally:
                await engine.dispose()

        ids["async"] = asyncio.run(publish_async())
    finally:
        publisher.dispose()

    with owner.connect() as c:
        rows = {r.id: r for r in c.execute(sa.text(
            f"SELECT id, topic, key, payload, headers, run_at, priority, dedup_key, routed_at,"
            f" extract(epoch FROM run_at - created_at) AS run_in FROM {events} WHERE topic LIKE 't.%'"))}
    owner.dispose()
    written = [ids["plain"], ids["keyed"], ids["run_at"], ids["delay"], *many, *many_options[:2], ids["async"]]
    assert sorted(rows) == sorted(written)
    assert [rows[i].payload["n"] for i in written] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert all(r.routed_at is None for r in rows.values())
    keyed = rows[ids["keyed"]]
    assert (keyed.key, keyed.headers["h"], keyed.run_at, keyed.priority) == ("k", "v", None, None)
    assert (rows[ids["run_at"]].run_at, rows[ids["run_at"]].priority) == (run_at, -5)
    assert (rows[ids["delay"]].dedup_key, rows[ids["delay"]].key) == ("d1", "k")
    assert 59 <= rows[ids["delay"]].run_in <= 61
    assert (rows[many[1]].key, rows[many[1]].headers["h"]) == ("k", "w")
    assert (rows[many_options[0]].run_at, rows[many_options[0]].priority, rows[many_options[0]].dedup_key) == \
        (run_at, 7, "d2")
    assert rows[many_options[1]].headers["h"] == "x" and 29 <= rows[many_options[1]].run_in <= 31
    assert (rows[ids["async"]].run_at, rows[ids["async"]].priority, rows[ids["async"]].dedup_key) == (run_at, 1, "d3")


@pytest.mark.parametrize("headers", ["[]", "[{}]", '"text"', "null", "1", "true"])
def test_headers_that_are_not_a_json_object_are_refused_for_every_writer(engine, headers):
    """publish() only ever writes an object; the CHECK holds any other writer (the relay
    role, SQL, the superuser here) to the same rule, so a consumer always reads an object."""
    statement = "INSERT INTO outbox_events (topic, payload, headers) VALUES ('t', '{}', CAST(:headers AS jsonb))"
    with engine.connect() as c:
        with pytest.raises(IntegrityError) as refused:
            c.execute(sa.text(statement), {"headers": headers})
        assert isinstance(refused.value.orig, psycopg.errors.CheckViolation)
        assert refused.value.orig.diag.constraint_name == "ck_outbox_events_headers_object"
        c.rollback()
        for accepted in ("{}", '{"a": [1, {"b": null}]}'):
            c.execute(sa.text(statement), {"headers": accepted})
        c.commit()


def _roles_example() -> tuple[str, list[str]]:
    """The Roles section of docs/schemas-and-roles.md as written: its first SQL block (the
    superuser's) and the commands of its shell block (continued lines joined, comments left
    out)."""
    text = ROLES_PAGE.read_text(encoding="utf-8")
    section = text[text.index("\n## Roles\n"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    sql = re.search(r"```sql\n(.*?)```", section, re.S)
    shell = re.search(r"```bash\n(.*?)```", section, re.S)
    assert sql and shell, "the Roles section has an SQL block and a shell block"
    commands = [line.strip() for line in shell[1].replace("\\\n", " ").splitlines()
                if line.strip() and not line.strip().startswith("#")]
    return sql[1], commands


@pytest.mark.parametrize("where", ["public", "own schema"])
def test_the_roles_example_runs_as_written(empty_db_url, tmp_path, where):
    """Issue 26 item 6 (b): the Roles example of docs/schemas-and-roles.md (docs/operations.md before), run as written on a
    fresh database of its own (PostgreSQL 15 and later: ``GRANT CREATE ON DATABASE`` alone
    left ``migrate`` with "permission denied for schema public"), with role names made
    unique: the superuser's SQL, then every command of the shell block (migrate as the owner,
    grants printed, grants applied, the relay as the relay role) in a shell; an event the
    application's role publishes is run by that relay, which then stops on SIGTERM with exit
    status 0. ``own schema`` takes the block's alternative (``CREATE SCHEMA ... AUTHORIZATION``
    instead of the GRANT, ``OUTBOX_SCHEMA`` for every command and the application)."""
    sql, commands = _roles_example()
    suffix = uuid.uuid4().hex[:10]
    names = {doc: f"{doc}_{suffix}" for doc in ("outbox_owner", "outbox_relay", "app")}
    database = empty_db_url.database
    assert database is not None
    host = f"{empty_db_url.host or ''}{f':{empty_db_url.port}' if empty_db_url.port else ''}"
    query = "&".join(f"{k}={v}" for k, v in empty_db_url.query.items())
    schema = "public"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    environ.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), environ.get("PATH", "")]),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])))
    if where == "own schema":
        alternative = re.search(r"^-- (CREATE SCHEMA (\w+) AUTHORIZATION outbox_owner;)", sql, re.M)
        assert alternative, "the SQL block names the alternative of a schema of outbox's own"
        sql = sql.replace("GRANT CREATE ON SCHEMA public TO outbox_owner;", alternative[1])
        schema = environ["OUTBOX_SCHEMA"] = alternative[2]

    def localised(text: str) -> str:
        text = text.replace("@db/shop", f"@{host}/{database}{'?' + query if query else ''}")
        text = text.replace("myapp.jobs:ob", "tests.integration.roles_app:ob")
        return re.sub(r"(?<![\w.-])(outbox_owner|outbox_relay|app|shop)(?![\w.-])",
                      lambda m: names.get(m[1], database), text)

    def url(role: str) -> URL:
        return empty_db_url.set(username=names[role])

    admin = make_engine(empty_db_url)
    relay: subprocess.Popen[bytes] | None = None
    try:
        with admin.connect() as c:
            if not c.execute(sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")).scalar_one():
                pytest.skip("the example's SQL runs as a superuser; the test server's role is not one")
        with psycopg.connect(empty_db_url.set(drivername="postgresql").render_as_string(hide_password=False),
                             autocommit=True) as conn:
            conn.execute(localised(sql).encode())
        assert [c.split()[0] for c in commands] == ["OUTBOX_DATABASE_URL=postgresql://outbox_owner@db/shop",
                                                   "outbox-relay", "OUTBOX_DATABASE_URL=postgresql://outbox_owner@db/shop",
                                                   "OUTBOX_DATABASE_URL=postgresql://outbox_relay@db/shop"]
        assert "--app myapp.jobs:ob" in commands[-1] and "--apply" in commands[2]
        *steps, run = map(localised, commands)
        outputs = []
        for step in steps:
            done = subprocess.run(["bash", "-c", step], env=environ, cwd=ROOT, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, (step, done.stdout, done.stderr)
            outputs.append(done.stdout)
        assert f'TO "{names["app"]}";' in outputs[1] and "GRANT INSERT (" in outputs[1]
        log = tmp_path / "relay.log"
        with open(log, "wb") as out:
            relay = subprocess.Popen(["bash", "-c", run], env=environ, cwd=ROOT, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: "relay started" in log.read_text(errors="replace") or relay.poll() is not None,
                 timeout=60, what="the relay to start")
        assert relay.poll() is None, log.read_text(errors="replace")
        app = make_engine(url("app"))
        try:
            with Session(app) as s, s.begin():
                event = publish(s, "order.placed", {"n": 1}, schema=schema)
        finally:
            app.dispose()

        def status() -> str | None:
            with admin.connect() as c:
                return c.execute(sa.text(f"SELECT status FROM {schema}.outbox_jobs WHERE event_id = :id"),
                                 {"id": event}).scalar()

        wait_for(lambda: status() == "done", timeout=TIMEOUT, what="the relay to run the published event's job")
        os.killpg(relay.pid, signal.SIGTERM)
        assert relay.wait(timeout=60) == 0, log.read_text(errors="replace")
    finally:
        if relay is not None and relay.poll() is None:
            os.killpg(relay.pid, signal.SIGKILL)
            relay.wait()
        admin.dispose()
        _drop_roles_after(empty_db_url, list(names.values()))
