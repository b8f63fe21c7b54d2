"""Scenario 4, publish cost, through SQLAlchemy Core connections as an application uses them.

(a) A domain transaction inserting one row into ``bench_orders``, without and with one
``publish()`` of an event about it; blocks of 50 transactions alternate between the two
so drift in the machine's load hits both alike. Reported: transactions/s of each and the
overhead ``time_with / time_without - 1``.

(b) 1,000 events in one transaction, with ``publish_many`` (one statement) and with
``publish`` called 1,000 times; events/s (commit included) and their ratio.

To say where the cost is, two more variants of (a) run in the same blocks: the same
``publish()`` with the NOTIFY trigger disabled, and a bare ``INSERT INTO outbox_events``
of the same row (no validation, no encoding by outbox); and for (b), validating and
encoding 1,000 events without sending them (``make_event``).

The other ways to publish (issue 30), in the same blocks: (a) with the SQL function
``outbox_publish`` instead of ``publish()`` (its validation runs in the database), and
with ``publish()`` on the psycopg connection under the SQLAlchemy one (the same
transaction), and with a pydantic model as the payload (the typed path: dumped and
validated again); (b) with ``outbox_publish_many`` of the same 1,000 events, and
``publish_many`` of 1,000 models.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel

from outbox import publish, publish_many
from outbox.publish import make_event

from .common import TOPIC, Databases, Size, log, median

ORDERS = sa.table("bench_orders", sa.column("id"), sa.column("customer"), sa.column("total_cents"))
INSERT = sa.text("INSERT INTO bench_orders (customer, total_cents) VALUES (:customer, :total) RETURNING id")
BLOCK = 50


BARE = sa.text("INSERT INTO outbox_events (topic, key, payload, headers) VALUES (:topic, :key,"
               " CAST(:payload AS jsonb), CAST('{}' AS jsonb)) RETURNING id")


class OrderPlaced(BaseModel):
    """The typed path's payload: the same two fields as the dict."""

    order_id: int
    total_cents: int


#: The bare multi-row INSERT of 1,000 events (issue 33's baseline for publish_many): one
#: statement, the payloads encoded with json.dumps, no validation.
BARE_MANY = sa.text("INSERT INTO outbox_events (topic, key, payload, headers) SELECT t, k, CAST(p AS jsonb),"
                    " CAST('{}' AS jsonb) FROM unnest(CAST(:topics AS text[]), CAST(:keys AS text[]),"
                    " CAST(:payloads AS text[])) AS e(t, k, p)")
SQL_FUNCTION = sa.text("SELECT outbox_publish(:topic, CAST(:payload AS jsonb), :key)")
SQL_FUNCTION_MANY = sa.text("SELECT outbox_publish_many(CAST(:events AS jsonb))")


def domain_txns(eng: sa.Engine, n: int, with_publish: bool, bare: bool = False, way: str = "publish") -> float:
    """``way``: how the event is published when ``with_publish``: ``publish`` (on the
    SQLAlchemy connection), ``psycopg`` (publish() on its psycopg connection) or ``sql``
    (the SQL function; the payload JSON written by the caller)."""
    start = time.perf_counter()
    for i in range(n):
        with eng.begin() as conn:
            order_id = conn.execute(INSERT, {"customer": "dave", "total": 2500 + i}).scalar_one()
            if with_publish and way == "sql":
                conn.execute(SQL_FUNCTION, {"topic": "order.placed", "key": f"order:{order_id}",
                                            "payload": f'{{"order_id":{order_id},"total_cents":{2500 + i}}}'}
                             ).scalar_one()
            elif with_publish and way == "typed":
                publish(conn, "order.placed", OrderPlaced(order_id=order_id, total_cents=2500 + i),
                        key=f"order:{order_id}")
            elif with_publish and way == "psycopg":
                publish(conn.connection.driver_connection, "order.placed",
                        {"order_id": order_id, "total_cents": 2500 + i}, key=f"order:{order_id}")
            elif bare:
                conn.execute(BARE, {"topic": "order.placed", "key": f"order:{order_id}",
                                    "payload": f'{{"order_id":{order_id},"total_cents":{2500 + i}}}'}).scalar_one()
            elif with_publish:
                publish(conn, "order.placed", {"order_id": order_id, "total_cents": 2500 + i}, key=f"order:{order_id}")
    return time.perf_counter() - start


def notify_trigger(eng: sa.Engine, enabled: bool) -> None:
    with eng.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE outbox_events {'ENABLE' if enabled else 'DISABLE'} TRIGGER outbox_events_notify")


def thousand(eng: sa.Engine, txns: int, many: bool, sql: bool = False, typed: bool = False,
             bare: bool = False) -> float:
    start = time.perf_counter()
    for t in range(txns):
        with eng.begin() as conn:
            if bare:
                conn.execute(BARE_MANY, {"topics": [TOPIC] * 1000, "keys": [f"order:{i}" for i in range(1000)],
                                         "payloads": [json.dumps({"order_id": t * 1000 + i}) for i in range(1000)]})
            elif typed:
                publish_many(conn, [(TOPIC, OrderPlaced(order_id=t * 1000 + i, total_cents=i), f"order:{i}")
                                    for i in range(1000)])
            elif sql:
                document = ",".join(f'["{TOPIC}",{{"order_id":{t * 1000 + i}}},"order:{i}"]' for i in range(1000))
                conn.execute(SQL_FUNCTION_MANY, {"events": f"[{document}]"}).scalar_one()
            elif many:
                publish_many(conn, [(TOPIC, {"order_id": t * 1000 + i}, f"order:{i}") for i in range(1000)])
            else:
                for i in range(1000):
                    publish(conn, TOPIC, {"order_id": t * 1000 + i}, key=f"order:{i}")
    return time.perf_counter() - start


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    runs: list[dict[str, float]] = []
    with dbs.fresh() as url:
        eng = sa.create_engine(url, pool_size=1)  # an application's plain engine (no pre-ping)
        with eng.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE bench_orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                                 " customer text NOT NULL, total_cents int NOT NULL)")
        domain_txns(eng, 100, True)  # warm up: connection, prepared statements, caches
        thousand(eng, 1, True)
        thousand(eng, 1, False)
        thousand(eng, 1, False, sql=True)
        domain_txns(eng, 100, True, way="sql")
        domain_txns(eng, 100, True, way="psycopg")
        domain_txns(eng, 100, True, way="typed")
        thousand(eng, 1, True, typed=True)
        thousand(eng, 1, False, bare=True)
        for _rep in range(size.runs):
            plain = with_ = quiet = bare = sql = raw = typed = 0.0
            for _block in range(max(1, size.publish_txns // BLOCK)):
                plain += domain_txns(eng, BLOCK, False)
                with_ += domain_txns(eng, BLOCK, True)
                bare += domain_txns(eng, BLOCK, True, bare=True)
                sql += domain_txns(eng, BLOCK, True, way="sql")
                raw += domain_txns(eng, BLOCK, True, way="psycopg")
                typed += domain_txns(eng, BLOCK, True, way="typed")
                notify_trigger(eng, False)
                quiet += domain_txns(eng, BLOCK, True)
                notify_trigger(eng, True)
            n = max(1, size.publish_txns // BLOCK) * BLOCK
            many = loop = sql_many = typed_many = bare_many = 0.0
            for _ in range(size.publish_many_txns):
                bare_many += thousand(eng, 1, False, bare=True)
                many += thousand(eng, 1, True)
                loop += thousand(eng, 1, False)
                sql_many += thousand(eng, 1, False, sql=True)
                typed_many += thousand(eng, 1, True, typed=True)
            k = size.publish_many_txns * 1000
            t = time.perf_counter()
            for j in range(size.publish_many_txns):
                [make_event(TOPIC, {"order_id": j * 1000 + i}, f"order:{i}") for i in range(1000)]
            encode = time.perf_counter() - t
            r = {"txn_per_s_without": n / plain, "txn_per_s_with": n / with_, "overhead": with_ / plain - 1,
                 "overhead_without_notify": quiet / plain - 1, "overhead_bare_insert": bare / plain - 1,
                 "overhead_sql_function": sql / plain - 1, "overhead_psycopg": raw / plain - 1,
                 "sql_function_over_publish": sql / with_, "sql_many_events_per_s": k / sql_many,
                 "sql_many_over_publish_many": sql_many / many, "overhead_typed": typed / plain - 1,
                 "typed_over_publish": typed / with_, "typed_many_events_per_s": k / typed_many,
                 "typed_many_over_publish_many": typed_many / many,
                 "publish_many_events_per_s": k / many, "publish_loop_events_per_s": k / loop,
                 "many_over_loop": loop / many, "encode_events_per_s": k / encode,
                 "encode_share_of_publish_many": encode / many,
                 "bare_many_events_per_s": k / bare_many, "publish_many_over_bare_many": bare_many / many,
                 "publish_over_bare": with_ / bare}
            runs.append(r)
            log(f"publish: {r['txn_per_s_without']:,.0f} txn/s without, {r['txn_per_s_with']:,.0f} with"
                f" (+{r['overhead']:.0%}); 1,000 per txn: publish_many {r['publish_many_events_per_s']:,.0f}"
                f" events/s, publish loop {r['publish_loop_events_per_s']:,.0f} events/s; SQL function"
                f" +{r['overhead_sql_function']:.0%}, psycopg +{r['overhead_psycopg']:.0%},"
                f" outbox_publish_many {r['sql_many_events_per_s']:,.0f} events/s; typed +{r['overhead_typed']:.0%},"
                f" publish_many of models {r['typed_many_events_per_s']:,.0f} events/s")
        eng.dispose()
    return {key: median([r[key] for r in runs]) for key in runs[0]} | {"runs": runs}
