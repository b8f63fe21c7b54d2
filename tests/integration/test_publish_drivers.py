"""publish() and publish_many() on every connection they take besides SQLAlchemy's psycopg
sessions: a psycopg ``Connection`` and ``AsyncConnection``, and SQLAlchemy's ``AsyncSession``
and ``AsyncConnection`` on the asyncpg dialect (``postgresql+asyncpg://``).

Each driver runs the same script of calls (every option, publish_many with and without
options, a dedup key held by an earlier event and one repeated in the call, bad events
refused with the transaction still usable), and what it returned and wrote must be what a
SQLAlchemy ``Session`` returns and writes for the same script, column for column. Then the
transaction semantics on each: a rolled-back SAVEPOINT and a rolled-back transaction write
nothing, and a database without outbox's tables raises ``SchemaNotReadyError``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox import SchemaNotReadyError, publish, publish_many
from outbox.errors import InvalidEventError

RUN_AT = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
#: What the script's events must agree on: every column publish writes (run_at relative to
#: the transaction's start where it came from a delay).
COLUMNS = ("topic, key, payload::text, headers::text, CASE WHEN run_at < '2031-01-01' THEN run_at - created_at "
           "END AS delayed_by, CASE WHEN run_at >= '2031-01-01' THEN run_at END AS run_at, priority, dedup_key")

#: (function, args, kwargs) of every call, in order.
SCRIPT: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
    (publish, ("d.plain", {"n": 1}), {}),
    (publish, ("d.keyed", {"n": 2, "f": [1.5, 1e16, 1e-7, -0.0, None, True, "é"]}), {"key": "k:1",
                                                                                    "headers": {"r": "r-1"}}),
    (publish, ("d.at", {"n": 3}), {"run_at": RUN_AT}),
    (publish, ("d.later", {"n": 4}), {"delay": 90.5, "priority": -7}),
    (publish, ("d.dedup", {"n": 5}), {"dedup_key": "once"}),
    (publish, ("d.dedup", {"n": 6}), {"dedup_key": "once"}),  # held: the first's id, nothing written
    (publish, (" ", {"n": 7}), {}),  # refused before anything is sent
    (publish_many, ([("m.a", {"n": 8}), ("m.b", {"n": 9}, "k:2", {"h": 1})],), {}),
    (publish_many, ([{"topic": "m.c", "payload": {"n": 10}, "dedup_key": "many"},
                     {"topic": "m.c", "payload": {"n": 11}, "dedup_key": "many"},
                     {"topic": "d.dedup", "payload": {"n": 12}, "dedup_key": "once"},
                     {"topic": "m.d", "payload": [], "delay": 5, "priority": 3, "key": "k:3"}],), {}),
    (publish_many, ([("m.e", {"n": 13}), {"topic": "m.e", "payload": {"bad": float("nan")}}],), {}),
    (publish, ("d.last", None), {"headers": {}}),
]


def shape(results: list[Any]) -> list[Any]:
    """The results, each id replaced by its rank among the ids returned (ids grow in the
    order events are written, so the ranks say which event each call got)."""
    ids = sorted({i for r in results if not isinstance(r, InvalidEventError) for i in (r if isinstance(r, list) else [r])})
    rank = {event_id: n for n, event_id in enumerate(ids)}
    out: list[Any] = []
    for result in results:
        if isinstance(result, InvalidEventError):
            out.append(("InvalidEventError", str(result)))
        elif isinstance(result, list):
            out.append([rank[i] for i in result])
        else:
            out.append(rank[result])
    return out


def run_sync(session: Any) -> list[Any]:
    results: list[Any] = []
    for function, args, kwargs in SCRIPT:
        try:
            results.append(function(session, *args, **kwargs))
        except InvalidEventError as exc:
            results.append(exc)
    return shape(results)


async def run_async(session: Any) -> list[Any]:
    results: list[Any] = []
    for function, args, kwargs in SCRIPT:
        try:
            results.append(await function(session, *args, **kwargs))
        except InvalidEventError as exc:
            results.append(exc)
    return shape(results)


def conninfo(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def stored(url: URL) -> list[tuple[Any, ...]]:
    with psycopg.connect(conninfo(url)) as c:
        return list(c.execute(f"SELECT {COLUMNS} FROM outbox_events ORDER BY id"))


def with_psycopg(url: URL) -> list[Any]:
    with psycopg.connect(conninfo(url)) as conn:
        results = run_sync(conn)
        conn.commit()
    return results


def with_psycopg_async(url: URL) -> list[Any]:
    async def scenario() -> list[Any]:
        async with await psycopg.AsyncConnection.connect(conninfo(url)) as conn:
            results = await run_async(conn)
            await conn.commit()
        return results

    return asyncio.run(scenario())


def with_asyncpg(url: URL, kind: str) -> list[Any]:
    async def scenario() -> list[Any]:
        engine = create_async_engine(url.set(drivername="postgresql+asyncpg"))
        try:
            if kind == "session":
                async with AsyncSession(engine) as s, s.begin():
                    return await run_async(s)
            async with engine.begin() as conn:
                return await run_async(conn)
        finally:
            await engine.dispose()

    return asyncio.run(scenario())


DRIVERS: dict[str, Callable[[URL], list[Any]]] = {
    "psycopg": with_psycopg,
    "psycopg-async": with_psycopg_async,
    "asyncpg-session": lambda url: with_asyncpg(url, "session"),
    "asyncpg-connection": lambda url: with_asyncpg(url, "connection"),
}


def needs(driver: str) -> None:
    if driver.startswith("asyncpg"):
        pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install -e '.[dev]' brings it)")


@pytest.fixture
def reference(template_copies) -> tuple[list[Any], list[tuple[Any, ...]]]:
    """What a SQLAlchemy Session returns and writes for the script, on a database of its own."""
    url = template_copies.take()
    try:
        engine = sa.create_engine(url)
        with Session(engine) as s, s.begin():
            results = run_sync(s)
        engine.dispose()
        return results, stored(url)
    finally:
        template_copies.give_back(url)


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_driver_writes_what_a_session_writes(driver, db_url, reference):
    needs(driver)
    results = DRIVERS[driver](db_url)
    assert results == reference[0]
    assert stored(db_url) == reference[1]
    assert [r[0] for r in reference[1]] == ["d.plain", "d.keyed", "d.at", "d.later", "d.dedup", "m.a", "m.b", "m.c",
                                            "m.d", "d.last"]
    assert reference[0][6][0] == reference[0][9][0] == "InvalidEventError"


@pytest.mark.parametrize("driver", ["psycopg", "psycopg-async"])
def test_psycopg_rollbacks_write_nothing(driver, db_url):
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(conninfo(db_url)) as conn:
            async with conn.transaction():
                await publish(conn, "kept", {"n": 1})
                with pytest.raises(ZeroDivisionError):
                    async with conn.transaction():
                        await publish(conn, "savepoint.rolled.back", {"n": 2})
                        raise ZeroDivisionError
            await publish_many(conn, [("transaction.rolled.back", {})])
            await conn.rollback()

    if driver == "psycopg":
        with psycopg.connect(conninfo(db_url)) as conn:
            with conn.transaction():
                publish(conn, "kept", {"n": 1})
                with pytest.raises(ZeroDivisionError), conn.transaction():
                    publish(conn, "savepoint.rolled.back", {"n": 2})
                    raise ZeroDivisionError
            publish_many(conn, [("transaction.rolled.back", {})])
            conn.rollback()
    else:
        asyncio.run(scenario())
    assert [r[0] for r in stored(db_url)] == ["kept"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_driver_says_when_the_tables_are_missing(driver, empty_db_url):
    needs(driver)
    with pytest.raises(SchemaNotReadyError, match="outbox-relay migrate"):
        DRIVERS[driver](empty_db_url)
