"""Publish options on a real PostgreSQL: ``run_at`` / ``delay`` by the database clock,
``dedup_key`` (same transaction, later transactions, SAVEPOINT rollback, two concurrent
transactions, pruning, publish_many batches) and per-event ``priority`` on top of the
subscription's."""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from outbox import publish, publish_many
from outbox.db import queries
from outbox.db.retention import prune
from outbox.errors import InvalidEventError
from outbox.relay.router import route_all
from outbox.testing import wait_for

from .helpers import subscribe
from .test_publish import StatementCounter, async_engine  # noqa: F401 - a fixture

publish_module = sys.modules["outbox.publish"]  # outbox.publish the attribute is the function


def events(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT id, topic, payload, run_at, priority, dedup_key FROM outbox_events ORDER BY id")).mappings()]


def claimable(engine: sa.Engine, consumers: list[str]) -> tuple[datetime, list[int]]:
    """(database now, ids of the jobs a claim would take now), read in one statement."""
    with engine.connect() as c:
        now = c.execute(sa.text("SELECT now()")).scalar_one()
        ids = list(c.execute(queries.job_claim_candidates, {"consumers": consumers, "skip": [], "limit": 100}).scalars())
    return now, ids


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize("options, field, problem", [
    ({"run_at": datetime(2030, 1, 1)}, "run_at", "naive datetime"),
    ({"run_at": "2030-01-01T00:00:00Z"}, "run_at", "must be a datetime"),
    ({"run_at": datetime.now(UTC), "delay": 1}, "delay", "cannot be given with run_at"),
    ({"delay": -1}, "delay", "must be seconds in"),
    ({"delay": float("nan")}, "delay", "must be seconds in"),
    ({"delay": 10**400}, "delay", "must be seconds in"),  # no float holds it: was an OverflowError
    ({"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))}, "run_at", "out of range in UTC"),
    ({"run_at": datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=5)))}, "run_at", "out of range in UTC"),
    ({"delay": True}, "delay", "must be a number of seconds"),
    ({"delay": "5"}, "delay", "must be a number of seconds"),
    ({"dedup_key": ""}, "dedup_key", "must not be empty"),
    ({"dedup_key": "k" * 256}, "dedup_key", "the limit is 255"),
    ({"dedup_key": "a\x00b"}, "dedup_key", "NUL"),
    ({"dedup_key": 5}, "dedup_key", "must be a str"),
    ({"priority": 1001}, "priority", "-1000..1000"),
    ({"priority": -1001}, "priority", "-1000..1000"),
    ({"priority": 1.0}, "priority", "must be an int"),
    ({"priority": False}, "priority", "must be an int"),
])
def test_bad_options_are_refused_before_anything_is_written(engine, options, field, problem):
    with Session(engine) as s, s.begin():
        with StatementCounter(engine) as counter:
            with pytest.raises(InvalidEventError, match=problem) as info:
                publish(s, "t", {}, **options)
            assert info.value.field == field
            with pytest.raises(InvalidEventError) as info:
                publish_many(s, [("t", {}), {"topic": "t", "payload": {}, **options}])
            assert info.value.field == f"events[1].{field}"
        assert counter.statements == []
        publish(s, "after", {})  # the transaction is still usable
    assert [e["topic"] for e in events(engine)] == ["after"]


@pytest.mark.parametrize("item, problem", [
    (("t", {}, None, None, 3), "tuple of 5 items"),
    (("t",), "tuple of 1 items"),
    (["t", {}, "k", {}, "x"], "list of 5 items"),
    ({"topic": "t", "payload": {}, "run_at_": None}, "unknown keys 'run_at_'"),
    ({"topic": "t", "payload": {}, "delay": 1, "extra": 1}, "unknown keys 'extra'"),
    ({"topic": "t", "delay": 1}, "has no payload"),
    ("t", "is a str"),
    (None, "is a NoneType"),
])
def test_publish_many_refuses_items_it_does_not_understand(engine, item, problem):
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidEventError, match=problem) as info:
            publish_many(s, [("ok", {}), item])
    assert info.value.field == "events[1]"
    assert events(engine) == []


# ---------------------------------------------------------------------- run_at, delay


def test_delay_counts_on_the_database_clock_with_the_session_in_another_time_zone(engine):
    subscribe(engine, "later", ["c"])
    with engine.begin() as conn:
        conn.exec_driver_sql("SET TIME ZONE 'Pacific/Kiritimati'")  # UTC+14, this session only
        published_at = conn.execute(sa.text("SELECT now()")).scalar_one()
        publish(conn, "later", {"n": 1}, delay=2)
        publish(conn, "later", {"n": 2})  # no option: claimable at once
        conn.exec_driver_sql("SET TIME ZONE 'UTC'")
    route_all(engine)
    with engine.connect() as c:
        delayed, plain = c.execute(sa.text("SELECT id FROM outbox_jobs ORDER BY event_id")).scalars()
        run_at = c.execute(sa.text("SELECT run_at FROM outbox_jobs WHERE id = :id"), {"id": delayed}).scalar_one()
    assert run_at == published_at + timedelta(seconds=2)  # the same instant, whatever the session's zone

    seen_before = []

    def due() -> bool:
        now, ids = claimable(engine, ["c"])
        assert plain in ids
        if now < published_at + timedelta(seconds=2):
            assert delayed not in ids, f"claimable at {now}, before {run_at}"
            seen_before.append(now)
            return False
        return delayed in ids

    wait_for(due, timeout=15, interval=0.1, what="the delayed job to become claimable")
    assert seen_before  # it was polled (and not claimable) before its time


def test_run_at_is_an_instant_whatever_the_zones(engine):
    subscribe(engine, "at", ["c"])
    with engine.begin() as conn:
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
    at = (now + timedelta(seconds=2)).astimezone(ZoneInfo("America/New_York"))
    with engine.begin() as conn:
        conn.exec_driver_sql("SET TIME ZONE 'Asia/Tokyo'")
        publish(conn, "at", {}, run_at=at)
        publish(conn, "at", {}, run_at=now - timedelta(days=1))  # in the past: due at once
        conn.exec_driver_sql("SET TIME ZONE 'UTC'")
    route_all(engine)
    with engine.connect() as c:
        future, past = c.execute(sa.text("SELECT id FROM outbox_jobs ORDER BY event_id")).scalars()
        assert c.execute(sa.text("SELECT run_at FROM outbox_jobs WHERE id = :id"), {"id": future}).scalar_one() == at
    assert claimable(engine, ["c"])[1] == [past]
    wait_for(lambda: future in claimable(engine, ["c"])[1], timeout=15, what="the job at run_at")
    assert [e["run_at"] for e in events(engine)] == [at, now - timedelta(days=1)]


def test_publish_many_options_per_event(engine):
    subscribe(engine, "m", ["c"], priority=3)
    at = datetime.now(UTC) + timedelta(hours=1)
    with Session(engine) as s, s.begin():
        ids = publish_many(s, [("m", {"n": 0}), {"topic": "m", "payload": {"n": 1}, "run_at": at, "priority": -3},
                               {"topic": "m", "payload": {"n": 2}, "delay": 3600.5},
                               {"topic": "m", "payload": {"n": 3}, "run_at": None, "dedup_key": None}])
    assert ids == sorted(ids) and len(ids) == 4
    stored = events(engine)
    assert [e["payload"]["n"] for e in stored] == [0, 1, 2, 3]
    assert stored[1]["run_at"] == at and stored[1]["priority"] == -3
    assert stored[2]["run_at"] is not None and stored[3]["run_at"] is None and stored[0]["priority"] is None
    route_all(engine)
    with engine.connect() as c:
        jobs = c.execute(sa.text("SELECT e.payload->>'n' AS n, j.priority, j.run_at > now() AS later"
                                 " FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id ORDER BY e.id")).all()
    assert [tuple(j) for j in jobs] == [("0", 3, False), ("1", 0, True), ("2", 3, True), ("3", 3, False)]


# ------------------------------------------------------------------------- priority


def test_event_priority_adds_to_the_subscriptions_and_orders_claims(engine):
    subscribe(engine, "p", ["low", "high"], priority=0)
    subscribe(engine, "q", ["edge"], priority=32767)
    with Session(engine) as s, s.begin():
        first = publish(s, "p", {"n": "first"})
        urgent = publish(s, "p", {"n": "urgent"}, priority=-5)
        publish(s, "q", {}, priority=1000)  # 32767 + 1000: clamped, not an overflow
    route_all(engine)
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT event_id, consumer, priority FROM outbox_jobs ORDER BY id")).all()
    assert {(r.event_id, r.consumer): r.priority for r in rows} == {
        (first, "low"): 0, (first, "high"): 0, (urgent, "low"): -5, (urgent, "high"): -5,
        (urgent + 1, "edge"): 32767}
    _, order = claimable(engine, ["low"])
    with engine.connect() as c:
        events_in_claim_order = [c.execute(sa.text("SELECT event_id FROM outbox_jobs WHERE id = :id"),
                                           {"id": i}).scalar_one() for i in order]
    assert events_in_claim_order == [urgent, first]  # lower first, though published later


# ------------------------------------------------------------------------ dedup_key


def test_dedup_key_returns_the_first_event_and_writes_nothing(engine):
    with Session(engine) as s, s.begin():
        first = publish(s, "d", {"n": 1}, dedup_key="order:4")
        with StatementCounter(engine) as counter:
            again = publish(s, "d", {"n": 2}, dedup_key="order:4")
        other_topic = publish(s, "d2", {"n": 3}, dedup_key="order:4")  # keys are per topic
    assert again == first and other_topic != first
    assert len(counter.statements) == 2  # the insert that wrote nothing, the lookup
    with Session(engine) as s, s.begin():  # a later transaction, the first one committed
        assert publish(s, "d", {"n": 4}, dedup_key="order:4") == first
        assert publish(s, "d", {"n": 5}, dedup_key="order:5") != first
    assert [(e["topic"], e["payload"], e["dedup_key"]) for e in events(engine)] == [
        ("d", {"n": 1}, "order:4"), ("d2", {"n": 3}, "order:4"), ("d", {"n": 5}, "order:5")]


def test_dedup_key_after_a_savepoint_rollback_writes_a_new_event(engine):
    with Session(engine) as s, s.begin():
        nested = s.begin_nested()
        rolled_back = publish(s, "d", {"n": 1}, dedup_key="k")
        nested.rollback()
        kept = publish(s, "d", {"n": 2}, dedup_key="k")
        assert publish(s, "d", {"n": 3}, dedup_key="k") == kept
    assert kept != rolled_back
    assert [(e["id"], e["payload"]) for e in events(engine)] == [(kept, {"n": 2})]


def test_dedup_within_and_across_publish_many_batches(engine, monkeypatch):
    with Session(engine) as s, s.begin():
        existing = publish(s, "d", {"n": "existing"}, dedup_key="old")
    monkeypatch.setattr(publish_module, "MANY_BATCH_CHARS", 120)  # several statements
    items: list[Any] = [
        {"topic": "d", "payload": {"n": 0}, "dedup_key": "a"},
        ("d", {"n": 1}),
        {"topic": "d", "payload": {"n": 2}, "dedup_key": "a"},    # same as 0
        {"topic": "d", "payload": {"n": 3}, "dedup_key": "old"},  # a retained event's
        {"topic": "e", "payload": {"n": 4}, "dedup_key": "a"},    # another topic
        {"topic": "d", "payload": {"n": 5}, "dedup_key": "b"},
        {"topic": "d", "payload": {"n": 6}},
        {"topic": "d", "payload": {"n": 7}, "dedup_key": "b"},    # same as 5
    ]
    with Session(engine) as s, s.begin():
        ids = publish_many(s, items)
    assert ids[2] == ids[0] and ids[3] == existing and ids[7] == ids[5]
    assert len(set(ids)) == 6
    stored = {e["id"]: e["payload"]["n"] for e in events(engine)}
    assert stored == {existing: "existing", ids[0]: 0, ids[1]: 1, ids[4]: 4, ids[5]: 5, ids[6]: 6}
    with Session(engine) as s, s.begin():  # all again: nothing new, the same ids
        before = len(events(engine))
        again = publish_many(s, [i for i in items if isinstance(i, dict) and "dedup_key" in i])
    assert again == [ids[0], ids[0], existing, ids[4], ids[5], ids[5]]
    assert len(events(engine)) == before


def test_dedup_events_are_pruned_and_then_the_key_is_free(engine):
    subscribe(engine, "d", ["c"])
    with Session(engine) as s, s.begin():
        first = publish(s, "d", {}, dedup_key="k")
    route_all(engine)  # routed like any event: one job
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_jobs SET status = 'done', finished_at = now() - interval '1 hour'")
    with engine.begin() as conn:
        assert prune(conn, 60, 0) == (1, 1)  # its done job, then the event: nothing special
    with Session(engine) as s, s.begin():
        second = publish(s, "d", {}, dedup_key="k")
    assert second != first and [e["id"] for e in events(engine)] == [second]


def wait_until_blocked(engine: sa.Engine, pid: int) -> None:
    def blocked() -> bool:
        with engine.connect() as c:
            return c.execute(sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                             {"pid": pid}).scalar() is True

    wait_for(blocked, timeout=15, what=f"backend {pid} to wait on a lock")


@pytest.mark.parametrize("first_commits", [True, False])
def test_dedup_two_concurrent_transactions_write_one_event(engine, first_commits):
    """The second transaction waits on the first's uncommitted insert of the key: it gets
    the first's id when the first commits, writes its own when the first rolls back."""
    result: dict[str, Any] = {}
    pid_known = threading.Event()

    def second() -> None:
        with engine.connect() as b:
            with b.begin():
                result["pid"] = b.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                pid_known.set()
                result["id"] = publish(b, "d", {"from": "second"}, dedup_key="k")

    with engine.connect() as a:
        a.begin()
        first = publish(a, "d", {"from": "first"}, dedup_key="k")
        thread = threading.Thread(target=second)
        thread.start()
        assert pid_known.wait(15)
        wait_until_blocked(engine, result["pid"])
        assert thread.is_alive() and "id" not in result  # blocked until the first ends
        if first_commits:
            a.commit()
        else:
            a.rollback()
        thread.join(15)
    assert not thread.is_alive()
    stored = events(engine)
    assert len(stored) == 1
    if first_commits:
        assert result["id"] == first and stored[0]["payload"] == {"from": "first"}
    else:
        assert result["id"] != first and stored == [{**stored[0], "id": result["id"], "payload": {"from": "second"}}]


def test_dedup_under_repeatable_read_raises_a_serialization_failure(engine):
    """A REPEATABLE READ (or SERIALIZABLE) transaction whose snapshot predates the commit of
    the event holding its key cannot see that event: PostgreSQL refuses the insert with a
    serialization failure (40001) rather than return an id the snapshot does not contain."""
    result: dict[str, Any] = {}
    pid_known = threading.Event()

    def second() -> None:
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as b:
            with b.begin():
                result["pid"] = b.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()  # takes the snapshot
                pid_known.set()
                try:
                    result["id"] = publish(b, "d", {"from": "second"}, dedup_key="k")
                except OperationalError as exc:
                    result["error"] = exc

    with engine.connect() as a:
        a.begin()
        publish(a, "d", {"from": "first"}, dedup_key="k")
        thread = threading.Thread(target=second)
        thread.start()
        assert pid_known.wait(15)
        wait_until_blocked(engine, result["pid"])
        a.commit()
        thread.join(15)
    assert "id" not in result
    assert isinstance(result["error"].orig, psycopg.errors.SerializationFailure)
    assert [e["payload"] for e in events(engine)] == [{"from": "first"}]


def test_async_publish_with_options(engine, async_engine):  # noqa: F811 - the fixture imported above
    import asyncio

    from sqlalchemy.ext.asyncio import AsyncSession

    async def go() -> tuple[int, int, list[int]]:
        async with AsyncSession(async_engine) as s, s.begin():
            first = await publish(s, "as", {}, dedup_key="k", priority=2)
            again = await publish(s, "as", {}, dedup_key="k")
            many = await publish_many(s, [{"topic": "as", "payload": {}, "dedup_key": "k"},
                                          {"topic": "as", "payload": {}, "delay": 1}])
        return first, again, many

    first, again, many = asyncio.run(go())
    assert again == first and many[0] == first and many[1] > first
    assert len(events(engine)) == 2
