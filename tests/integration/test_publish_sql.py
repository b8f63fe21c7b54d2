"""Publishing from SQL: ``outbox_publish`` and ``outbox_publish_many`` (migration 0010).

One truth with ``publish()``: the differential tests send the same inputs through
``publish()`` / ``publish_many()`` and through the SQL functions and expect the same event
(every column) or the same error (field and problem; SQLSTATE 22023 from SQL). Then what
only SQL callers meet: a trigger on a domain table that publishes on INSERT, psql, a
rolled-back transaction, the NOTIFY on commit, the ordering lock, dedup, and the caller's
search path."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import URL

from outbox import Job, Outbox, publish, publish_many
from outbox.db.event_rules import MAX_DEPTH, MAX_INT_DIGITS, WHITESPACE
from outbox.errors import InvalidEventError
from outbox.publish import make_event
from outbox.relay.relay import Relay
from outbox.testing import wait_for

from ..hypothesis_profiles import examples

COLUMNS = "topic, key, payload::text, headers::text, run_at, priority, dedup_key"


def test_whitespace_is_what_python_strips():
    assert WHITESPACE == "".join(c for c in map(chr, range(0x110000)) if c.isspace())


# ------------------------------------------------------------------ the two paths


def sql_json(value: Any) -> str | None:
    """The JSON text a SQL caller would send for ``value``: outbox's own encoding where it
    accepts the value (so floats are written as publish() writes them), else json's."""
    if value is None:
        return None
    try:
        return make_event("t", value, max_payload_bytes=1 << 30).payload
    except InvalidEventError:
        return json.dumps(value)


def _error(exc: InvalidEventError) -> tuple[str, str, str]:
    root = re.match(r"events\[\d+\](?:\.\w+)?|\w+", exc.field)
    assert root is not None
    return ("error", root.group(0), exc.problem)


def _sql_error(exc: psycopg.Error) -> tuple[str, str, str]:
    assert exc.sqlstate == "22023", (exc.sqlstate, str(exc))
    column = exc.diag.column_name
    message = exc.diag.message_primary or ""
    assert column is not None and message.startswith(f"{column}: "), (column, message)
    return ("error", column, message[len(column) + 2:])


def _rows(conn: sa.Connection, ids: list[int]) -> list[tuple[Any, ...]]:
    rows = {r[0]: r[1:] for r in conn.exec_driver_sql(
        f"SELECT id, {COLUMNS} FROM outbox_events WHERE id = ANY(%(ids)s)", {"ids": ids})}
    first: dict[int, int] = {}
    return [(first.setdefault(i, n), *rows[i]) for n, i in enumerate(ids)]  # same ids where deduplicated


# Both paths run in savepoints of one transaction (``conn``), rolled back: the same now(), so
# a delay gives the same run_at, and nothing stays.

def via_publish(conn: sa.Connection, call: dict[str, Any], limit: int) -> tuple[Any, ...]:
    with conn.begin_nested() as savepoint:
        try:
            event_id = publish(conn, max_payload_bytes=limit, **call)
        except InvalidEventError as exc:
            savepoint.rollback()
            return _error(exc)
        row = conn.exec_driver_sql(f"SELECT {COLUMNS} FROM outbox_events WHERE id = %(id)s", {"id": event_id}).one()
        savepoint.rollback()
    return ("event", *row)


def via_sql(conn: sa.Connection, call: dict[str, Any], limit: int) -> tuple[Any, ...]:
    args = dict(call)
    args["payload"] = sql_json(call["payload"]) or "null"
    args["headers"] = sql_json(call.get("headers"))
    named = ", ".join(f"{name} => %({name})s" for name in args if name not in ("topic", "payload"))
    with conn.begin_nested() as savepoint:
        conn.exec_driver_sql("SELECT set_config('outbox.max_payload_bytes', %(limit)s, true)", {"limit": str(limit)})
        try:
            event_id = conn.exec_driver_sql(
                f"SELECT outbox_publish(%(topic)s, CAST(%(payload)s AS jsonb){', ' if named else ''}{named})",
                args).scalar_one()
        except sa.exc.DBAPIError as exc:
            savepoint.rollback()
            return _sql_error(exc.orig)
        row = conn.exec_driver_sql(f"SELECT {COLUMNS} FROM outbox_events WHERE id = %(id)s", {"id": event_id}).one()
        savepoint.rollback()
    return ("event", *row)


def via_publish_many(conn: sa.Connection, items: list[Any], limit: int) -> tuple[Any, ...]:
    with conn.begin_nested() as savepoint:
        try:
            ids = publish_many(conn, items, max_payload_bytes=limit)
        except InvalidEventError as exc:
            savepoint.rollback()
            return _error(exc)
        rows = _rows(conn, ids)
        savepoint.rollback()
    return ("events", rows)


def _sql_item(item: Any) -> str:
    """The JSON text of a batch element, payload and headers in :func:`sql_json`'s encoding."""
    def text(name: str, value: Any) -> str:
        if name in ("payload", "headers"):
            return sql_json(value) or "null"
        return json.dumps(value.isoformat() if isinstance(value, datetime) else value)

    if isinstance(item, (tuple, list)) and len(item) <= 4:
        return "[" + ", ".join(text(("topic", "payload", "key", "headers")[n], v) for n, v in enumerate(item)) + "]"
    if not isinstance(item, dict):
        return json.dumps(item)
    return "{" + ", ".join(f"{json.dumps(name)}: {text(name, value)}" for name, value in item.items()) + "}"


def via_sql_many(conn: sa.Connection, items: list[Any], limit: int) -> tuple[Any, ...]:
    document = "[" + ", ".join(_sql_item(item) for item in items) + "]"
    with conn.begin_nested() as savepoint:
        conn.exec_driver_sql("SELECT set_config('outbox.max_payload_bytes', %(limit)s, true)", {"limit": str(limit)})
        try:
            ids = conn.exec_driver_sql("SELECT outbox_publish_many(CAST(%(events)s AS jsonb))",
                                       {"events": document}).scalar_one()
        except sa.exc.DBAPIError as exc:
            savepoint.rollback()
            return _sql_error(exc.orig)
        rows = _rows(conn, ids)
        savepoint.rollback()
    return ("events", rows)


# ------------------------------------------------------------------ the inputs

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_spaces = st.text(st.sampled_from(WHITESPACE), max_size=3)
good_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                     max_size=12).filter(lambda name: not name.isspace())
names = st.one_of(good_names, good_names, good_names, good_names, _text, _spaces, st.builds(lambda n, c: c * n, st.sampled_from([255, 256, 1024, 1025]),
                                            st.sampled_from(["x", "é", "\u3000"])))
ints = st.one_of(st.integers(-10**6, 10**6), st.sampled_from([10**MAX_INT_DIGITS - 1, 10**MAX_INT_DIGITS,
                                                                -10**MAX_INT_DIGITS, 2**63]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([-0.0, 1e16, 1e-7, 5e-324]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, _text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(_text, inner, max_size=4)),
                           max_leaves=12)


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for n in range(depth):
        value = [value] if n % 2 else {"k": value}
    return value


deep = st.builds(_nested, st.integers(MAX_DEPTH - 1, MAX_DEPTH + 2), scalars)
payloads = st.one_of(json_values, deep)
good_headers = st.dictionaries(_text, json_values, max_size=3)
headers = st.one_of(st.none(), good_headers, good_headers, good_headers, st.lists(scalars, max_size=2), ints, _text,
                    st.booleans())
run_ats = st.one_of(st.none(), st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                                            timezones=st.just(UTC)))
delays = st.one_of(st.none(), st.floats(-10, 4e9), st.sampled_from([0, 5, float("nan"), float("inf"), 3155760000,
                                                                     3155760000.5]))
priorities = st.one_of(st.none(), st.integers(-1100, 1100), st.sampled_from([-1001, -1000, 1000, 1001]))
limits = st.sampled_from([8, 40, 200, 1 << 20])


def mostly(good: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` nine times in ten: most calls then get past a field to the next one."""
    return st.integers(0, 9).flatmap(lambda n: good if n else other)


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    call: dict[str, Any] = {"topic": draw(mostly(good_names, st.one_of(names, st.none()))),
                            "payload": draw(payloads)}
    for name, strategy in (("key", mostly(st.one_of(st.none(), good_names), names)),
                           ("headers", mostly(st.one_of(st.none(), good_headers), headers)),
                           ("run_at", run_ats), ("delay", mostly(st.none(), delays)), ("priority", priorities),
                           ("dedup_key", mostly(st.one_of(st.none(), good_names), names))):
        value = draw(strategy)
        if value is not None:
            call[name] = value
    return call


@pytest.fixture
def raw(db_url: URL):
    with psycopg.connect(db_url.set(drivername="postgresql").render_as_string(hide_password=False)) as conn:
        yield conn


@pytest.fixture
def conn(engine: sa.Engine):
    """One transaction for a whole property test, rolled back at its end."""
    with engine.connect() as c, c.begin() as transaction:
        yield c
        transaction.rollback()


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(call=calls(), limit=limits)
def test_publish_and_outbox_publish_give_the_same_event_or_the_same_error(conn, call, limit):
    outcome = via_publish(conn, call, limit)
    event(f"{outcome[0]} {outcome[1] if outcome[0] == 'error' else ''}")
    assert outcome == via_sql(conn, call, limit)


_AT = datetime(2030, 1, 1, tzinfo=UTC)
#: Each rule at its edge, on both sides: the property tests may not draw them.
BOUNDARIES = [
    {"topic": "x" * 255}, {"topic": "x" * 256}, {"topic": "\u3000\x1c"}, {"topic": ""}, {"topic": None},
    {"key": "é" * 1024}, {"key": "é" * 1025}, {"key": " "},
    {"dedup_key": "d" * 255}, {"dedup_key": "d" * 256}, {"dedup_key": "\t"},
    {"priority": 1000}, {"priority": 1001}, {"priority": -1000}, {"priority": -1001},
    {"delay": 0}, {"delay": -1e-9}, {"delay": 3155760000}, {"delay": 3155760000.001}, {"delay": float("nan")},
    {"run_at": _AT}, {"run_at": _AT, "delay": 5},
    {"run_at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))},  # before year 1 in UTC
    {"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))},  # after 9999 in UTC
    {"payload": "x" * 38}, {"payload": "x" * 39},  # 40 bytes with the quotes: the limit below
    {"payload": [1e16, 1e-7, -0.0]}, {"payload": [1e16, 1e-7, -0.0, 1]},  # 38 and 40 bytes as jsonb prints them
    {"payload": 10**1000 - 1}, {"payload": -(10**1000)},
    {"payload": _nested(MAX_DEPTH, 1)}, {"payload": _nested(MAX_DEPTH + 1, 1)},
    {"headers": {"h": "x" * (65536 - 8)}}, {"headers": {"h": "x" * (65536 - 7)}}, {"headers": [1]}, {"headers": 5},
    {"headers": {"deep": _nested(MAX_DEPTH, 1)}}, {"headers": {"deep": _nested(MAX_DEPTH - 1, 1)}},
]


@pytest.mark.parametrize("change", BOUNDARIES, ids=lambda change: repr(change)[:60])
def test_both_paths_agree_at_every_edge(conn, change):
    call = {"topic": "t", "payload": {"n": 1}, **change}
    limit = 40 if "payload" in change else 1 << 20
    outcome = via_publish(conn, call, limit)
    assert outcome == via_sql(conn, call, limit)
    if not (isinstance(call.get("delay"), float) and math.isnan(call["delay"])):  # JSON has no NaN
        assert via_publish_many(conn, [call], limit) == via_sql_many(conn, [call], limit)


@st.composite
def items(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        size = draw(st.integers(2, 4))
        values = [draw(st.one_of(names, st.none())), draw(payloads), draw(st.one_of(st.none(), names)),
                  draw(headers)]
        return tuple(values[:size])
    item = draw(calls())
    if isinstance(item.get("delay"), float) and not math.isfinite(item["delay"]):
        item["delay"] = 3155760000.5  # JSON has no NaN nor infinity: out of range, as they are
    for name in ("key", "headers", "run_at", "delay", "priority", "dedup_key"):
        if name in item and draw(st.booleans()):
            item[name] = None  # given as null: the same as left out
    return item


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(batch=st.lists(items(), min_size=1, max_size=4), limit=limits)
def test_publish_many_and_outbox_publish_many_give_the_same_events_or_the_same_error(conn, batch, limit):
    outcome = via_publish_many(conn, batch, limit)
    event(f"{outcome[0]} {outcome[1].split('.')[-1] if outcome[0] == 'error' else ''}")
    assert outcome == via_sql_many(conn, batch, limit)


@pytest.mark.parametrize("item, field, problem", [
    ([1], "events[0]", "is a list of 1 items"),
    (5, "events[0]", "is a int"),
    ({"topic": "t", "payload": 1, "colour": 1}, "events[0]", "has unknown keys 'colour'"),
    ({"payload": 1}, "events[0]", "has no topic"),
    ({"topic": "t", "payload": 1, "run_at": 5}, "events[0].run_at", "must be a datetime, got int"),
    ({"topic": "t", "payload": 1, "delay": "5"}, "events[0].delay", "must be a number of seconds, got str"),
    ({"topic": "t", "payload": 1, "priority": 1.5}, "events[0].priority", "must be an int, got float"),
    ({"topic": "t", "payload": 1, "dedup_key": 5}, "events[0].dedup_key", "must be a str, got int"),
])
def test_batch_items_are_refused_as_publish_many_refuses_them(conn, item, field, problem):
    expected = via_publish_many(conn, [item], 1 << 20)
    assert expected[:2] == ("error", field) and expected[2].startswith(problem), expected
    assert via_sql_many(conn, [item], 1 << 20) == expected


@pytest.mark.parametrize("run_at, problem", [
    ("2030-01-01T00:00:00", "is a naive datetime"),
    ("soon+01", "is not an ISO 8601 date and time: 'soon+01'"),
])
def test_batch_times_only_sql_callers_can_write(conn, run_at, problem):
    """A batch's run_at is text: one without an offset is naive, one that is no time at all
    says so (publish_many gets datetimes and cannot meet the second)."""
    outcome = via_sql_many(conn, [{"topic": "t", "payload": 1, "run_at": run_at}], 1 << 20)
    assert outcome[:2] == ("error", "events[0].run_at") and outcome[2].startswith(problem), outcome


@pytest.mark.parametrize("call, field, problem", [
    ("SELECT outbox_publish('t', '1', run_at => 'infinity')", "run_at", "is out of range in UTC (years 1 to 9999)"),
    ("SELECT outbox_publish('t', '1', run_at => '-infinity')", "run_at", "is out of range in UTC"),
    ("SELECT outbox_publish('t', '1', run_at => '20000-01-01T00:00:00Z')", "run_at", "is out of range in UTC"),
    ("""SELECT outbox_publish_many('[{"topic": "t", "payload": 1, "run_at": "4713-01-01 BC+00"}]')""",
     "events[0].run_at", "is out of range in UTC"),
    ("""SELECT outbox_publish_many('[{"topic": "t", "payload": 1, "run_at": "2030-01-01T00:00:00+99"}]')""",
     "events[0].run_at", "is not an ISO 8601 date and time"),
])
def test_times_python_cannot_hold_are_refused(raw, call, field, problem):
    """A time outside Python's datetime (years 1 to 9999 in UTC) would be written, and then
    no relay could read its jobs: refused, as publish() refuses it."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        raw.execute(call)
    assert info.value.diag.column_name == field and problem in str(info.value), str(info.value)


def test_numbers_sql_callers_write_are_read_by_value(raw, engine):
    """JSON numbers in a batch are read by value: a delay below the smallest double is 0 (as
    a JSON parser reads it), not an error of another SQLSTATE."""
    (ids,) = raw.execute("""SELECT outbox_publish_many('[{"topic": "t.tiny", "payload": 1, "delay": 1e-400}]')""")\
        .fetchone()
    raw.commit()
    assert len(ids) == 1 and [e["payload"] for e in events_of(engine, "t.tiny")] == [1]


@pytest.mark.parametrize("setting", ["abc", "0", "-1", "99999999999"])
def test_a_bad_payload_limit_setting_is_named(raw, setting):
    raw.execute("SELECT set_config('outbox.max_payload_bytes', %s, false)", [setting])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="the setting outbox.max_payload_bytes must be a "
                                                                   "number of bytes in 1..999999999"):
        raw.execute("SELECT outbox_publish('t', '1')")


def test_a_batch_that_is_not_an_array_is_refused(raw):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="events: must be a JSON array of events, got "
                                                                    "object"):
        raw.execute("SELECT outbox_publish_many('{}')")


# ------------------------------------------------------------------ what SQL callers meet


def events_of(engine: sa.Engine, topic: str) -> list[dict[str, Any]]:
    with engine.connect() as c:
        return [dict(r) for r in c.exec_driver_sql(
            "SELECT id, key, payload, dedup_key FROM outbox_events WHERE topic = %(t)s ORDER BY id", {"t": topic})
            .mappings()]


def test_a_trigger_publishes_on_insert_and_a_relay_handles_it(engine, settings):
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY, total_cents int NOT NULL)")
        c.exec_driver_sql("""
            CREATE FUNCTION orders_placed() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM outbox_publish('order.placed', jsonb_build_object('order_id', NEW.id, 'total', NEW.total_cents),
                                       key => 'order:' || NEW.id);
                RETURN NULL;
            END $$""")
        c.exec_driver_sql("CREATE TRIGGER orders_publish AFTER INSERT ON orders FOR EACH ROW "
                          "EXECUTE FUNCTION orders_placed()")
    ob = Outbox()
    handled: list[tuple[str | None, Any]] = []

    @ob.subscriber("order.placed", consumer="ledger", ordered=True)
    def ledger(job: Job) -> None:
        handled.append((job.key, job.payload))

    relay = Relay(ob, settings())
    relay.start()
    try:
        with engine.begin() as c:
            c.exec_driver_sql("INSERT INTO orders VALUES (1, 2500), (2, 900)")
        with engine.begin() as c:
            c.exec_driver_sql("INSERT INTO orders VALUES (3, 100)")
            c.exec_driver_sql("SAVEPOINT s")
            c.exec_driver_sql("INSERT INTO orders VALUES (4, 100)")
            c.exec_driver_sql("ROLLBACK TO SAVEPOINT s")
        with engine.connect() as c:
            c.exec_driver_sql("INSERT INTO orders VALUES (5, 100)")
            c.rollback()
        wait_for(lambda: len(handled) == 3, timeout=20, what="the jobs of three committed orders")
    finally:
        relay.stop()
    assert handled == [("order:1", {"order_id": 1, "total": 2500}), ("order:2", {"order_id": 2, "total": 900}),
                       ("order:3", {"order_id": 3, "total": 100})]
    assert [e["key"] for e in events_of(engine, "order.placed")] == ["order:1", "order:2", "order:3"]


def test_a_rolled_back_transaction_publishes_nothing_and_a_committed_one_notifies(engine, raw, db_url):
    raw.execute("SELECT outbox_publish('t.rolled', '{}')")
    raw.rollback()
    assert events_of(engine, "t.rolled") == []
    url = db_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN outbox_events")
        event_id = raw.execute("SELECT outbox_publish('t.committed', '{\"n\": 1}')").fetchone()[0]
        assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # not before the commit
        raw.commit()
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.payload for n in notes] == [f"from {event_id}"]


def test_psql_publishes_and_reports_a_bad_event(engine, db_url):
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql is not installed on this machine")
    url = db_url.set(drivername="postgresql").render_as_string(hide_password=False)
    done = subprocess.run([psql, url, "-v", "ON_ERROR_STOP=1", "-Atc",
                           "SELECT outbox_publish('t.psql', '{\"from\": \"psql\"}', key => 'k', delay => 60)"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    (event,) = events_of(engine, "t.psql")
    assert done.stdout.strip() == str(event["id"]) and event["payload"] == {"from": "psql"}
    bad = subprocess.run([psql, url, "-v", "ON_ERROR_STOP=1", "-Atc", "SELECT outbox_publish('  ', '1')"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "topic: must not be empty" in bad.stderr, bad.stderr


def test_dedup_key_gives_the_event_holding_it(engine, raw):
    first = raw.execute("SELECT outbox_publish('t.dedup', '1', dedup_key => 'd')").fetchone()[0]
    raw.commit()
    again = raw.execute("SELECT outbox_publish('t.dedup', '2', dedup_key => 'd')").fetchone()[0]
    many = raw.execute("""SELECT outbox_publish_many('[{"topic": "t.dedup", "payload": 3, "dedup_key": "d"},
                                                       {"topic": "t.dedup", "payload": 4, "dedup_key": "e"},
                                                       {"topic": "t.dedup", "payload": 5, "dedup_key": "e"}]')""")\
        .fetchone()[0]
    raw.commit()
    assert again == first and many[0] == first and many[1] == many[2] != first
    assert [e["payload"] for e in events_of(engine, "t.dedup")] == [1, 4]


def test_a_keyed_event_of_an_ordered_topic_takes_the_publish_lock(engine, raw, db_url):
    """The second transaction publishing the same key waits for the first to end (the
    ordering lock), then draws its id: one key's ids commit in id order."""
    with engine.begin() as c:
        c.exec_driver_sql("INSERT INTO outbox_subscriptions (topic, consumer, max_attempts, lease_seconds, ordered) "
                          "VALUES ('t.ordered', 'c', 5, 30, true)")
    first = raw.execute("SELECT outbox_publish('t.ordered', '1', 'k')").fetchone()[0]
    url = db_url.set(drivername="postgresql").render_as_string(hide_password=False)
    second: list[int] = []

    def publish_second() -> None:
        with psycopg.connect(url) as other:
            second.append(other.execute("SELECT outbox_publish_many('[[\"t.ordered\", 2, \"k\"]]')").fetchone()[0][0])

    thread = threading.Thread(target=publish_second)
    thread.start()
    wait_for(lambda: _waiting_on_advisory_lock(engine), timeout=10, what="the second publish waiting for the key")
    assert second == []
    raw.commit()
    thread.join(timeout=10)
    assert second and second[0] > first


def _waiting_on_advisory_lock(engine: sa.Engine) -> bool:
    with engine.connect() as c:
        return bool(c.exec_driver_sql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                                      "AND classid = 'outbox_events'::regclass::oid").scalar())


def test_the_callers_search_path_does_not_matter(engine, raw):
    """The function finds outbox's tables in its own schema whatever the caller's search
    path (a caller in another schema names the function, not the tables)."""
    raw.execute("CREATE SCHEMA elsewhere")
    raw.execute("CREATE TABLE elsewhere.outbox_events (id bigint)")  # a decoy the function must not use
    raw.execute("SET search_path TO elsewhere")
    event_id = raw.execute("SELECT public.outbox_publish('t.path', '1', run_at => now() + interval '1 hour')")\
        .fetchone()[0]
    raw.commit()
    (event,) = events_of(engine, "t.path")
    assert event["id"] == event_id


def test_a_temporary_table_of_the_same_name_does_not_capture_events(engine, raw):
    """PostgreSQL searches pg_temp first unless the search path lists it: the functions list
    it last, so a caller's temporary outbox_events is not where their events go."""
    raw.execute("CREATE TEMP TABLE outbox_events (id bigserial, topic text, key text, payload jsonb, headers jsonb,"
                " run_at timestamptz, priority int, dedup_key text)")
    raw.execute("CREATE UNIQUE INDEX ON outbox_events (topic, dedup_key) WHERE dedup_key IS NOT NULL")
    raw.execute("CREATE TEMP TABLE outbox_subscriptions (topic text, ordered bool)")
    one = raw.execute("SELECT outbox_publish('t.temp', '1', dedup_key => 'd')").fetchone()[0]
    many = raw.execute("SELECT outbox_publish_many('[[\"t.temp\", 2]]')").fetchone()[0]
    assert raw.execute("SELECT count(*) FROM pg_temp.outbox_events").fetchone()[0] == 0
    raw.commit()
    assert [e["id"] for e in events_of(engine, "t.temp")] == [one, *many]


def test_publish_and_sql_agree_on_the_delay_clock(engine, raw):
    """``delay`` counts from the transaction's start by the database clock, in both paths."""
    with raw.transaction():
        now = raw.execute("SELECT now()").fetchone()[0]
        event_id = raw.execute("SELECT outbox_publish('t.delay', '1', delay => 90)").fetchone()[0]
        run_at = raw.execute("SELECT run_at FROM outbox_events WHERE id = %s", [event_id]).fetchone()[0]
    assert run_at - now == timedelta(seconds=90)
