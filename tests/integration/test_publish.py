"""publish() and publish_many(): events are rows of the caller's transaction, with a
SQLAlchemy Session, an AsyncSession and a Core Connection. Committed means exactly one
event, rolled back (also inside a SAVEPOINT) means none; bad input is refused before
anything is written and the caller's transaction stays usable."""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import enum
import math
import sys
import types
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from sqlalchemy import event as sa_event
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox import InvalidEventError, publish, publish_many
from outbox.db.tables import EVENTS_CHANNEL
from outbox.publish import DEFAULT_MAX_PAYLOAD_BYTES, MAX_DEPTH
from tests.hypothesis_profiles import examples as example_count  # hypothesis' settings is `examples` here

from .helpers import running_relay

# --------------------------------------------------------------------------- helpers


def stored(engine: sa.Engine) -> list[dict[str, Any]]:
    """Every event row, in id order."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT id, topic, key, payload, headers, routed_at FROM outbox_events ORDER BY id").mappings()
        return [dict(r) for r in rows]


def topics(engine: sa.Engine) -> list[str]:
    return [row["topic"] for row in stored(engine)]


def nested(levels: int, leaf: Any = 1, kind: str = "list") -> Any:
    """A value nested ``levels`` deep, built without recursion."""
    value = leaf
    for _ in range(levels):
        value = [value] if kind == "list" else {"k": value}
    return value


def libpq_url(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class StatementCounter:
    """Counts statements sent through ``engine`` while installed."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.statements: list[tuple[str, bool]] = []

    def __call__(self, conn, cursor, statement, parameters, context, executemany) -> None:
        self.statements.append((statement, executemany))

    def __enter__(self) -> StatementCounter:
        sa_event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *exc) -> None:
        sa_event.remove(self.engine, "before_cursor_execute", self)


@pytest.fixture
def listener(db_url: URL) -> Iterator[psycopg.Connection]:
    """A psycopg connection LISTENing on ``outbox_events`` and on a probe channel."""
    conn = psycopg.connect(libpq_url(db_url), autocommit=True)
    conn.execute(f"LISTEN {EVENTS_CHANNEL}")
    conn.execute("LISTEN outbox_test_probe")
    yield conn
    conn.close()


def channels_until_probe(listener: psycopg.Connection, engine: sa.Engine) -> list[str]:
    """Send a probe NOTIFY in a transaction of its own and return the channels heard up to
    and including it. Notifications arrive in commit order, so anything committed before the
    probe shows up before it, and nothing uncommitted or rolled back shows up at all."""
    with engine.begin() as conn:
        conn.exec_driver_sql("NOTIFY outbox_test_probe")
    heard: list[str] = []
    for note in listener.notifies(timeout=10):
        heard.append(note.channel)
        if note.channel == "outbox_test_probe":
            return heard
    raise AssertionError(f"probe notification not received within 10 s (heard {heard})")


# ------------------------------------------------------------------ Session (ORM)


def test_session_commit_writes_exactly_one_event(engine):
    with Session(engine) as s, s.begin():
        event_id = publish(s, "order.placed", {"order_id": 4, "total": 25.5, "items": ["a", "b"]},
                           key="order:4", headers={"trace": "abc", "n": 1})
    assert isinstance(event_id, int)
    [row] = stored(engine)
    assert row == {"id": event_id, "topic": "order.placed", "key": "order:4",
                   "payload": {"order_id": 4, "total": 25.5, "items": ["a", "b"]},
                   "headers": {"trace": "abc", "n": 1}, "routed_at": None}


def test_session_defaults_key_none_headers_empty(engine):
    with Session(engine) as s, s.begin():
        publish(s, "t", None)
        publish(s, "t", [1, (2, 3)])
    rows = stored(engine)
    assert [(r["key"], r["headers"], r["payload"]) for r in rows] == [(None, {}, None), (None, {}, [1, [2, 3]])]


def test_session_rollback_writes_nothing(engine):
    with Session(engine) as s:
        with s.begin():
            publish(s, "order.placed", {"n": 1})
            assert topics(engine) == []  # not visible before commit
            s.rollback()
    assert stored(engine) == []


def test_session_exception_in_block_writes_nothing(engine):
    with pytest.raises(RuntimeError):
        with Session(engine) as s, s.begin():
            publish(s, "order.placed", {"n": 1})
            raise RuntimeError("domain failure after publish")
    assert stored(engine) == []


def test_session_savepoint_rollback_drops_only_its_events(engine):
    with Session(engine) as s, s.begin():
        publish(s, "outer.before", {})
        savepoint = s.begin_nested()
        publish(s, "inner", {})
        savepoint.rollback()
        with s.begin_nested():
            publish(s, "inner.released", {})
        publish(s, "outer.after", {})
    assert topics(engine) == ["outer.before", "inner.released", "outer.after"]


def test_session_released_savepoint_in_rolled_back_transaction_writes_nothing(engine):
    with Session(engine) as s:
        s.begin()
        with s.begin_nested():
            publish(s, "inner", {})
        s.rollback()
    assert stored(engine) == []


def test_session_event_commits_with_domain_rows(engine):
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY)")
    with Session(engine) as s, s.begin():
        s.execute(sa.text("INSERT INTO orders VALUES (1)"))
        publish(s, "order.placed", {"order_id": 1})
    with pytest.raises(sa.exc.IntegrityError):
        with Session(engine) as s, s.begin():
            publish(s, "order.placed", {"order_id": 1})
            s.execute(sa.text("INSERT INTO orders VALUES (1)"))  # duplicate: the whole transaction fails
    assert [r["payload"] for r in stored(engine)] == [{"order_id": 1}]


# ------------------------------------------------------------- Core Connection


def test_connection_commit_rollback_and_savepoint(engine):
    with engine.connect() as conn:
        with conn.begin():
            committed_id = publish(conn, "c.committed", {"x": 1}, key="k")
        trans = conn.begin()
        publish(conn, "c.rolled_back", {})
        trans.rollback()
        with conn.begin():
            publish(conn, "c.outer", {})
            savepoint = conn.begin_nested()
            publish(conn, "c.inner", {})
            savepoint.rollback()
            publish(conn, "c.outer.after", {})
    rows = stored(engine)
    assert [r["topic"] for r in rows] == ["c.committed", "c.outer", "c.outer.after"]
    assert (rows[0]["id"], rows[0]["key"], rows[0]["payload"]) == (committed_id, "k", {"x": 1})


def test_connection_publish_many(engine):
    with engine.begin() as conn:
        ids = publish_many(conn, [("a", {"n": 1}), ("b", {"n": 2}, "k2", {"h": "v"}),
                                  {"topic": "c", "payload": [3], "key": None}])
    rows = stored(engine)
    assert [r["id"] for r in rows] == ids
    assert [(r["topic"], r["key"], r["payload"], r["headers"]) for r in rows] == [
        ("a", None, {"n": 1}, {}), ("b", "k2", {"n": 2}, {"h": "v"}), ("c", None, [3], {})]


# ---------------------------------------------------------------- AsyncSession


@pytest.fixture
def async_engine(db_url: URL):
    engine = create_async_engine(db_url)
    yield engine
    asyncio.run(engine.dispose())


def test_async_session_commit_rollback_and_savepoint(engine, async_engine):
    async def scenario() -> int:
        async with AsyncSession(async_engine) as s:
            async with s.begin():
                committed_id = await publish(s, "a.committed", {"x": 1}, key="k", headers={"h": 1})
            await s.begin()
            await publish(s, "a.rolled_back", {})
            await s.rollback()
            async with s.begin():
                await publish(s, "a.outer", {})
                savepoint = await s.begin_nested()
                await publish(s, "a.inner", {})
                await savepoint.rollback()
                await publish(s, "a.outer.after", {})
        return committed_id

    committed_id = asyncio.run(scenario())
    rows = stored(engine)
    assert [r["topic"] for r in rows] == ["a.committed", "a.outer", "a.outer.after"]
    assert (rows[0]["id"], rows[0]["key"], rows[0]["payload"], rows[0]["headers"]) == (
        committed_id, "k", {"x": 1}, {"h": 1})


def test_async_connection_and_publish_many(engine, async_engine):
    async def scenario() -> tuple[int, list[int]]:
        async with async_engine.begin() as conn:
            one = await publish(conn, "ac.one", {"n": 0})
        async with AsyncSession(async_engine) as s, s.begin():
            many = await publish_many(s, [("as.many", {"n": n}) for n in range(1, 4)])
        return one, many

    one, many = asyncio.run(scenario())
    assert [r["id"] for r in stored(engine)] == [one, *many]
    assert [r["payload"]["n"] for r in stored(engine)] == [0, 1, 2, 3]


def test_async_session_bad_input_leaves_transaction_usable(engine, async_engine):
    async def scenario() -> None:
        async with AsyncSession(async_engine) as s, s.begin():
            await publish(s, "before", {})
            with pytest.raises(InvalidEventError, match="payload"):
                await publish(s, "bad", {"x": "\x00"})
            with pytest.raises(InvalidEventError, match=r"events\[1\]\.topic"):
                await publish_many(s, [("ok", {}), ("", {})])
            await publish(s, "after", {})

    asyncio.run(scenario())
    assert topics(engine) == ["before", "after"]


# --------------------------------------------------------------- publish_many


def test_publish_many_thousand_events_is_one_statement(engine):
    events = [{"topic": f"bulk.{n % 3}", "payload": {"n": n}, "key": f"k{n}", "headers": {"i": n}}
              for n in range(1000)]
    with Session(engine) as s, s.begin():
        s.execute(sa.text("SELECT 1"))  # check the connection out first
        with StatementCounter(engine) as counter:
            ids = publish_many(s, events)
    assert len(counter.statements) == 1, counter.statements
    statement, executemany = counter.statements[0]
    assert "INSERT INTO public.outbox_events" in statement and not executemany
    assert len(ids) == 1000 and len(set(ids)) == 1000 and ids == sorted(ids)
    rows = stored(engine)
    assert [r["id"] for r in rows] == ids
    assert [(r["topic"], r["key"], r["payload"], r["headers"]) for r in rows] == [
        (e["topic"], e["key"], e["payload"], e["headers"]) for e in events]


def test_publish_is_one_statement_per_event(engine):
    with Session(engine) as s, s.begin():
        s.execute(sa.text("SELECT 1"))
        with StatementCounter(engine) as counter:
            publish(s, "t", {"n": 1})
    assert len(counter.statements) == 1


def test_publish_many_one_bad_event_writes_none(engine):
    events = [("t", {"n": n}) for n in range(500)]
    events[317] = ("t", {"n": {1, 2}})
    with Session(engine) as s, s.begin():
        publish(s, "before", {})
        with StatementCounter(engine) as counter:
            with pytest.raises(InvalidEventError, match=r"events\[317\]\.payload\['n'\]: set is not JSON-serialisable"):
                publish_many(s, events)
        assert counter.statements == []
        publish(s, "after", {})
    assert topics(engine) == ["before", "after"]


@pytest.mark.parametrize("bad, field", [
    ({"topic": "t"}, "events[0]"),
    ({"payload": {}}, "events[0]"),
    ({"topic": "t", "payload": {}, "extra": 1}, "events[0]"),
])
def test_publish_many_malformed_item(engine, bad, field):
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidEventError) as info:
            publish_many(s, [bad])
    assert info.value.field == field
    assert stored(engine) == []


SAME_AS_PUBLISH = [
    ("order.placed", {"order_id": 4, "total": 25.5, "items": ["a", ("b", None)]}, "order:4", {"trace": "abc"}),
    ('q"uote\\back\tslash', {"s": 'q"\\\u2028\u2029\x01\x1f\x7f', "": ""}, 'k"\\', {"h": [1, {"x": None}]}),
    ("ünïcödé 🙂", "ÆØÅ 🙂", "ключ", None),
    ("big", {"int": 10**999, "neg": -(10**999), "tiny": 5e-324, "max": 1.7976931348623157e308, "neg0": -0.0}, None, None),
    ("scalars", None, None, {}),
    ("scalars", True, "k", None),
    ("scalars", 0, "k", None),
    ("scalars", "", "k", None),
    ("scalars", [], "k", None),
    ("literal.escape", {"a": "\\u0000", "b": "\\\\u0000"}, None, None),
    ("deep", nested(MAX_DEPTH, kind="dict"), None, None),
]


def test_publish_many_stores_what_publish_stores(engine):
    """Each event, written by publish and by publish_many, is the same row (topic, key,
    payload and headers), whatever characters and numbers it holds."""
    events = [*SAME_AS_PUBLISH, (Color.RED, {"c": Color.RED, "s": Size.L}, Color.RED, types.MappingProxyType({"m": 1}))]
    with Session(engine) as s, s.begin():
        single = [publish(s, *event) for event in events]
        many = publish_many(s, events)
        many_dicts = publish_many(s, [dict(zip(("topic", "payload", "key", "headers"), e)) for e in events])
    rows = {r["id"]: (r["topic"], r["key"], r["payload"], r["headers"]) for r in stored(engine)}
    assert len(rows) == 3 * len(events)
    assert [rows[i] for i in many] == [rows[i] for i in single] == [rows[i] for i in many_dicts]
    assert rows[single[0]] == ("order.placed", "order:4",
                               {"order_id": 4, "total": 25.5, "items": ["a", ["b", None]]}, {"trace": "abc"})
    assert rows[single[3]][2]["int"] == 10**999
    assert rows[single[9]][2] == {"a": "\\u0000", "b": "\\\\u0000"}
    assert rows[single[-1]] == ("red", "red", {"c": "red", "s": 3}, {"m": 1})


def test_publish_many_past_the_batch_size_is_several_statements_of_one_transaction(engine, listener, monkeypatch):
    publish_module = sys.modules["outbox.publish"]
    monkeypatch.setattr(publish_module, "MANY_BATCH_CHARS", 200)
    events = [("bulk", {"n": n, "pad": "x" * (n % 7) * 20}, f"k{n}") for n in range(60)]
    with Session(engine) as s, s.begin():
        s.execute(sa.text("SELECT 1"))
        with StatementCounter(engine) as counter:
            ids = publish_many(s, events)
        assert len(counter.statements) > 5, counter.statements
        savepoint = s.begin_nested()
        publish_many(s, events)
        savepoint.rollback()  # every statement of it undone
        assert channels_until_probe(listener, engine) == ["outbox_test_probe"]  # nothing before commit
    assert channels_until_probe(listener, engine) == [EVENTS_CHANNEL, "outbox_test_probe"]
    rows = stored(engine)
    assert ids == sorted(ids) == [r["id"] for r in rows]
    assert [(r["topic"], r["payload"], r["key"]) for r in rows] == [(t, p, k) for t, p, k in events]


def test_publish_many_past_the_batch_size_async(engine, async_engine, monkeypatch):
    monkeypatch.setattr(sys.modules["outbox.publish"], "MANY_BATCH_CHARS", 100)

    async def scenario() -> list[int]:
        async with AsyncSession(async_engine) as s, s.begin():
            return await publish_many(s, [("as.bulk", {"n": n}) for n in range(40)])

    ids = asyncio.run(scenario())
    rows = stored(engine)
    assert ids == [r["id"] for r in rows] and [r["payload"]["n"] for r in rows] == list(range(40))


def test_publish_many_empty_is_no_statement(engine):
    with Session(engine) as s, s.begin():
        s.execute(sa.text("SELECT 1"))
        with StatementCounter(engine) as counter:
            assert publish_many(s, []) == []
    assert counter.statements == []


# ---------------------------------------------------------------------- NOTIFY


def test_notify_arrives_only_after_commit(engine, listener):
    with Session(engine) as s, s.begin():
        publish(s, "order.placed", {"n": 1})
        publish_many(s, [("order.placed", {"n": n}) for n in range(2, 50)])
        # still uncommitted: a probe committed now overtakes it, and nothing else is heard
        assert channels_until_probe(listener, engine) == ["outbox_test_probe"]
    # committed: one notification (statement-level trigger, folded per transaction)
    assert channels_until_probe(listener, engine) == [EVENTS_CHANNEL, "outbox_test_probe"]


def test_no_notify_after_rollback(engine, listener):
    with Session(engine) as s:
        with s.begin():
            publish(s, "order.placed", {"n": 1})
            s.rollback()
    with engine.connect() as conn:
        with conn.begin():
            savepoint = conn.begin_nested()
            publish(conn, "order.placed", {"n": 2})
            savepoint.rollback()
    assert channels_until_probe(listener, engine) == ["outbox_test_probe"]
    assert stored(engine) == []


# ------------------------------------------------------------------- bad input


class Color(str, enum.Enum):
    RED = "red"


class Size(enum.IntEnum):
    L = 3


BAD_INPUT = [
    # not JSON-serialisable
    pytest.param(dict(payload={1, 2}), "payload", "set is not JSON-serialisable", id="set"),
    pytest.param(dict(payload=b"bytes"), "payload", "bytes is not JSON-serialisable", id="bytes"),
    pytest.param(dict(payload={"o": object()}), "payload['o']", "object is not JSON-serialisable", id="object"),
    pytest.param(dict(payload={"at": dt.datetime(2024, 1, 1)}), "payload['at']", "datetime", id="datetime"),
    pytest.param(dict(payload={"d": decimal.Decimal("1.5")}), "payload['d']", "Decimal", id="decimal"),
    pytest.param(dict(payload={"u": uuid.uuid4()}), "payload['u']", "UUID", id="uuid"),
    pytest.param(dict(payload={1: "a"}), "payload", "key of type int", id="int-key"),
    pytest.param(dict(payload={("a",): 1}), "payload", "key of type tuple", id="tuple-key"),
    pytest.param(dict(payload={"x": math.nan}), "payload['x']", "nan is not a JSON number", id="nan"),
    pytest.param(dict(payload=[math.inf]), "payload[0]", "inf is not a JSON number", id="inf"),
    pytest.param(dict(headers={"h": -math.inf}), "headers['h']", "-inf is not a JSON number", id="header-inf"),
    pytest.param(dict(headers={"h": {1, 2}}), "headers['h']", "set", id="header-set"),
    pytest.param(dict(headers=["not", "a", "mapping"]), "headers", "must be a mapping", id="headers-list"),
    pytest.param(dict(payload=lambda: None), "payload", "function is not JSON-serialisable", id="function"),
    # NUL anywhere
    pytest.param(dict(topic="a\x00b"), "topic", "NUL", id="nul-topic"),
    pytest.param(dict(key="k\x00"), "key", "NUL", id="nul-key"),
    pytest.param(dict(payload="\x00"), "payload", "NUL", id="nul-payload-string"),
    pytest.param(dict(payload={"a": ["ok", "x\x00y"]}), "payload['a'][1]", "NUL", id="nul-payload-value"),
    pytest.param(dict(payload={"a\x00": 1}), "payload key 'a\\x00'", "NUL", id="nul-payload-key"),
    pytest.param(dict(headers={"h": "\x00"}), "headers['h']", "NUL", id="nul-header-value"),
    pytest.param(dict(headers={"\x00": "v"}), "headers key", "NUL", id="nul-header-key"),
    # unpaired surrogates
    pytest.param(dict(topic="t\ud800"), "topic", "unpaired surrogate", id="surrogate-topic"),
    pytest.param(dict(key="\udfff"), "key", "unpaired surrogate", id="surrogate-key"),
    pytest.param(dict(payload={"s": "\ud83d"}), "payload['s']", "unpaired surrogate", id="surrogate-payload"),
    pytest.param(dict(payload={"\udc00": 1}), "payload key", "unpaired surrogate", id="surrogate-payload-key"),
    pytest.param(dict(headers={"h": "\ud800"}), "headers['h']", "unpaired surrogate", id="surrogate-header"),
    # size
    pytest.param(dict(payload={"x": "a" * 200}, max_payload_bytes=100), "payload",
                 "is 208 bytes encoded, the limit is 100 bytes", id="over-limit"),
    pytest.param(dict(payload="é" * 60, max_payload_bytes=100), "payload",
                 "is 122 bytes encoded, the limit is 100 bytes", id="over-limit-multibyte"),
    pytest.param(dict(payload="x" * DEFAULT_MAX_PAYLOAD_BYTES), "payload",
                 f"the limit is {DEFAULT_MAX_PAYLOAD_BYTES} bytes", id="over-default-limit"),
    pytest.param(dict(headers={"h": "x" * 70_000}), "headers", "the limit is 65536 bytes", id="headers-over-limit"),
    # names
    pytest.param(dict(topic=""), "topic", "must not be empty", id="empty-topic"),
    pytest.param(dict(topic=" \t\n"), "topic", "must not be empty", id="blank-topic"),
    pytest.param(dict(topic="t" * 256), "topic", "256 characters long, the limit is 255", id="long-topic"),
    pytest.param(dict(topic=None), "topic", "is required", id="none-topic"),
    pytest.param(dict(topic=b"t"), "topic", "must be a str, got bytes", id="bytes-topic"),
    pytest.param(dict(key=""), "key", "must not be empty", id="empty-key"),
    pytest.param(dict(key="k" * 1025), "key", "1025 characters long, the limit is 1024", id="long-key"),
    pytest.param(dict(key=4), "key", "must be a str, got int", id="int-key-arg"),
    # nesting
    pytest.param(dict(payload=nested(10_000)), "payload", f"nests deeper than {MAX_DEPTH} levels", id="deep-list"),
    pytest.param(dict(payload=nested(10_000, kind="dict")), "payload", f"nests deeper than {MAX_DEPTH}",
                 id="deep-dict"),
    pytest.param(dict(headers=nested(10_000, kind="dict")), "headers", f"nests deeper than {MAX_DEPTH}",
                 id="deep-headers"),
    pytest.param(dict(payload=nested(MAX_DEPTH + 1)), "payload", "nests deeper", id="one-too-deep"),
]


def _circular() -> dict:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


BAD_INPUT.append(pytest.param(dict(payload=_circular()), "payload", "nests deeper", id="circular"))


@pytest.mark.parametrize("kwargs, field, problem", BAD_INPUT)
def test_bad_input_is_refused_and_transaction_stays_usable(engine, kwargs, field, problem):
    call = {"topic": "bad.event", "payload": {}, **kwargs}
    with Session(engine) as s, s.begin():
        publish(s, "before", {"n": 1})
        with StatementCounter(engine) as counter:
            with pytest.raises(InvalidEventError) as info:
                publish(s, **call)
            with pytest.raises(InvalidEventError) as info_many:
                publish_many(s, [{k: v for k, v in call.items() if k != "max_payload_bytes"}],
                             **({"max_payload_bytes": call["max_payload_bytes"]} if "max_payload_bytes" in call else {}))
        assert counter.statements == []  # refused before anything was sent
        publish(s, "after", {"n": 2})
    message = str(info.value)
    assert message.startswith(field), message
    assert problem in message, message
    assert info.value.field.startswith(field.split("[")[0].split(" ")[0])
    assert str(info_many.value) == f"events[0].{message}"
    assert len(message) < 64 * 48 + 100  # the path names at most 64 levels of 40-character keys
    assert topics(engine) == ["before", "after"]


def test_bad_input_on_core_connection_leaves_transaction_usable(engine):
    with engine.connect() as conn:
        with conn.begin():
            publish(conn, "before", {})
            with pytest.raises(InvalidEventError, match="payload: bytes"):
                publish(conn, "bad", b"x")
            with pytest.raises(InvalidEventError, match="topic: must not be empty"):
                publish(conn, "", {})
            publish(conn, "after", {})
    assert topics(engine) == ["before", "after"]


def test_limits_are_inclusive(engine):
    exactly_100 = "x" * 98  # encoded with its quotes: 100 bytes
    with Session(engine) as s, s.begin():
        publish(s, "t" * 255, exactly_100, key="k" * 1024, max_payload_bytes=100)
        publish(s, "deep", nested(MAX_DEPTH))
        publish(s, "deep.dict", nested(MAX_DEPTH, kind="dict"))
    rows = stored(engine)
    assert rows[0]["payload"] == exactly_100 and rows[0]["topic"] == "t" * 255
    assert rows[1]["payload"] == nested(MAX_DEPTH)
    assert rows[2]["payload"] == nested(MAX_DEPTH, kind="dict")


def test_json_values_round_trip(engine):
    payload = {
        "int": 2**62, "neg": -1, "float": 0.1, "true": True, "false": False, "null": None,
        "tuple": (1, "two"), "unicode": "ünïcödé 🙂 \u2028", "empty": {}, "list": [],
        "enum_str": Color.RED, "enum_int": Size.L, "mapping": types.MappingProxyType({"a": 1}),
        "quotes": "'\"\\", "control": "\t\n\r\x01",
    }
    with Session(engine) as s, s.begin():
        publish(s, "t", payload, headers={"traceparent": "00-abc-01", "nested": {"x": [1]}})
    [row] = stored(engine)
    assert row["payload"] == {**payload, "tuple": [1, "two"], "enum_str": "red", "enum_int": 3, "mapping": {"a": 1}}
    assert type(row["payload"]["enum_int"]) is int
    assert row["headers"] == {"traceparent": "00-abc-01", "nested": {"x": [1]}}


@pytest.mark.parametrize("target", ["engine", "none", "pool_proxy", "string"])
def test_wrong_session_type_raises_type_error(engine, target):
    """Anything but a SQLAlchemy session or connection or a psycopg connection (those:
    test_publish_drivers.py), such as the pool's proxy of a psycopg connection."""
    raw = engine.raw_connection()
    try:
        session = {"engine": engine, "none": None, "pool_proxy": raw, "string": "postgresql://"}[target]
        with pytest.raises(TypeError, match="Session, AsyncSession, Connection or AsyncConnection"):
            publish(session, "t", {})
        with pytest.raises(TypeError, match="Session"):
            publish_many(session, [("t", {})])
    finally:
        raw.close()
    assert stored(engine) == []


# ------------------------------------------------------------- bound parameters

HOSTILE = [
    "'; DROP TABLE outbox_events; --",
    'Robert"); DROP TABLE students;--',
    "a'b\"c`d",
    ":topic",
    "%s %(topic)s {topic} $1 ?",
    "\\x00 \\' \\\\",
    "semi;colon;",
    "/* comment */ SELECT 1",
    "🙂 ünïcödé ÆØÅ",
]


def test_hostile_names_are_stored_verbatim(engine):
    with Session(engine) as s, s.begin():
        single = [publish(s, t, {t: t}, key=t, headers={t: t}) for t in HOSTILE]
        many = publish_many(s, [(t, {t: [t]}, t, {"h": t}) for t in HOSTILE])
    rows = stored(engine)
    assert [r["id"] for r in rows] == single + many
    assert [(r["topic"], r["key"], r["payload"], r["headers"]) for r in rows] == (
        [(t, t, {t: t}, {t: t}) for t in HOSTILE] + [(t, t, {t: [t]}, {"h": t}) for t in HOSTILE])
    with engine.connect() as conn:  # and the table is still there, with exactly these rows
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_events WHERE topic = :t"),
                            {"t": HOSTILE[0]}).scalar() == 2


def test_publish_without_migrations_says_run_migrate(empty_db_url):
    """Publishing into a database that was never migrated names the fix, not a raw SQL error."""
    from outbox import SchemaNotReadyError
    from outbox.db.engine import make_engine

    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            with pytest.raises(SchemaNotReadyError, match="outbox-relay migrate"):
                publish(conn, "order.placed", {"order_id": 1})
    finally:
        engine.dispose()


def test_huge_integer_is_refused_with_its_path(engine):
    with engine.connect() as conn:
        with pytest.raises(InvalidEventError, match=r"payload\['a'\].*1000 digits"):
            publish(conn, "t", {"a": 10**5000})
        publish(conn, "t", {"a": 10**999})  # the largest size accepted still works


@pytest.mark.parametrize("value", [10**1000 - 1, -(10**1000 - 1), 2**3321, 10**1000, -(10**1000)],
                         ids=["1000-nines", "minus-1000-nines", "2**3321", "10**1000", "minus-10**1000"])
def test_the_integer_limit_is_exactly_1000_digits(engine, value):
    """Up to 1,000 digits are accepted and come back exactly; 1,001 are refused (both
    encoding paths: publish and publish_many). Before, 1,000 nines were refused."""
    with engine.connect() as conn:
        if len(str(abs(value))) > 1000:
            with pytest.raises(InvalidEventError, match="1000 digits"):
                publish(conn, "t", {"a": value})
            with pytest.raises(InvalidEventError, match="1000 digits"):
                publish_many(conn, [("t", {"a": value})])
            return
        event_id = publish(conn, "t", {"a": value})
        [many_id] = publish_many(conn, [("t", {"a": [value]})])
        stored = dict(conn.execute(sa.text("SELECT id, payload FROM outbox_events WHERE id IN (:a, :b)"),
                                   {"a": event_id, "b": many_id}).all())
    assert stored == {event_id: {"a": value}, many_id: {"a": [value]}}


# --------------------------------------------------------------------------- numbers
# jsonb keeps numbers as numeric; psycopg reads one back as a float when it has a decimal
# point, as an int otherwise (publish's module notes). These run the numbers through a real
# jsonb and the loader the relay reads Job.payload and Job.headers with.


def typed(value: Any) -> Any:
    """``value`` with every number paired with its type, so == compares types too."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [typed(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (type(value).__name__, value)
    return value


NUMBERS = {
    "floats": [1e16, -1e16, 1e308, 5e-324, 1.5e300, 0.1, -2.5e-300, 1e-7, float(2**53 + 1),
               1.7976931348623157e308, 123456789012345678.0, 2.0],
    "ints": [2**63, -(2**63) - 1, 10**30, 0, 10**999],
    "zeros": [0.0, -0.0],
}


@examples(max_examples=example_count(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.fixed_dictionaries({
    "f": st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=12),
    "big": st.lists(st.floats(min_value=1e15, allow_infinity=False), max_size=4),
    "tiny": st.lists(st.floats(min_value=-1e-290, max_value=1e-290, allow_subnormal=True), max_size=4),
    "i": st.lists(st.one_of(st.integers(), st.integers(min_value=-(10**40), max_value=10**40)), max_size=6),
}), headers=st.dictionaries(st.sampled_from("abcde"), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
   many=st.booleans())
def test_numbers_keep_type_and_value_through_jsonb(engine, payload, headers, many):
    """Any finite float comes back a float of equal value, any int an int, in payload and
    headers, through publish and publish_many."""
    with engine.connect() as conn, conn.begin() as transaction:
        if many:
            [event_id] = publish_many(conn, [{"topic": "t", "payload": payload, "headers": headers}])
        else:
            event_id = publish(conn, "t", payload, headers=headers)
        row = conn.exec_driver_sql("SELECT payload, headers FROM outbox_events WHERE id = %(id)s",
                                   {"id": event_id}).one()
        transaction.rollback()
    assert typed(row.payload) == typed(payload)
    assert typed(row.headers) == typed(headers)


def test_numbers_reach_the_handler_with_their_type_and_value(engine, settings):
    """Floats of every magnitude, ints past 64 bits and both zeros, published with publish
    and publish_many, in payload and headers, as a relay's handler receives them; -0.0
    arrives as 0.0 (a float, equal under ==, positive)."""
    from outbox import Outbox
    from outbox.testing import wait_for

    received: list[tuple[Any, Any]] = []
    ob = Outbox()

    @ob.subscriber("numbers", consumer="numbers")
    def handler(job):
        received.append((job.payload, job.headers))

    with Session(engine) as s, s.begin():
        publish(s, "numbers", NUMBERS, headers={"h": NUMBERS["floats"]})
        publish_many(s, [("numbers", NUMBERS, None, {"h": NUMBERS["floats"]})])
    with running_relay(ob, settings(concurrency=1), maintain=False):
        wait_for(lambda: len(received) == 2, timeout=15, what="both events handled")
    for payload, headers in received:
        assert typed(payload) == typed(NUMBERS)
        assert typed(headers) == typed({"h": NUMBERS["floats"]})
        assert [math.copysign(1, z) for z in payload["zeros"]] == [1, 1]  # numeric has no -0
        assert payload["floats"][0] == 1e16 and type(payload["floats"][0]) is float


def test_the_notification_names_the_first_id_the_transaction_kept(engine, listener):
    """The events' trigger (migration 0009) sends one notification per transaction naming the
    first event id it wrote (the router goes back for it: issue 28). A savepoint rolled back
    takes its notification and its flag with it, so the next publish names its own id."""
    with Session(engine) as s, s.begin():
        with s.begin_nested() as savepoint:
            publish(s, "t", {"n": 0})
            savepoint.rollback()
        kept = publish(s, "t", {"n": 1})
        later = publish_many(s, [("t", {"n": 2}), ("t", {"n": 3})])
    assert later[0] > kept
    with engine.begin() as conn:
        conn.exec_driver_sql("NOTIFY outbox_test_probe")
    heard = []
    for note in listener.notifies(timeout=10):
        heard.append((note.channel, note.payload))
        if note.channel == "outbox_test_probe":
            break
    assert heard == [(EVENTS_CHANNEL, f"from {kept}"), ("outbox_test_probe", "")]
