"""Scenario 6, scale: do claim and route stay cheap when the tables are big?

Each measurement publishes ``scale_events`` unrouted events on a table just vacuumed and
analysed, routes them with ``route_batch`` (100 events per statement), analyses
``outbox_jobs`` again, then claims with ``claim_jobs`` (50 per statement) and completes each batch with ``complete_jobs`` until
none is left; every statement is timed on its own (the ``execute`` call, not the commit).
Reported: the median time per statement (median of ``runs`` repetitions).

Big vs empty: the same database is measured empty, then after ``scale_rows`` routed
events and ``scale_rows`` done jobs (over the same consumers) were added and vacuumed,
as autovacuum would leave them; the ratio big/empty and both ``EXPLAIN (ANALYZE,
BUFFERS)`` plans of the route and claim statements are kept. K = 1, 3, 10 consumers per
event: the same measurement on an empty database with K subscriptions.

Backlog: a burst of ``sweep_events`` events (3 jobs each) routed into a fresh database,
then claims of 8 and of 50 jobs timed before ``outbox_jobs`` was ever analysed (what a
relay meets after a burst, until autovacuum's analyze runs) and after ``ANALYZE``, with
both plans: the claim's cost must not grow with the number of ready jobs.

Redrive: ``scale_rows`` dead jobs, ANALYZE (the statistics now say nothing is ready),
then ``outbox.admin.redrive`` of a tenth of them, and claims of 50 timed at once,
with no ANALYZE between (issue 8, item 5: the claim's plan must not depend on how the
ready jobs got there).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg

from outbox.db import queries
from outbox.db.jobs import claim_jobs, complete_jobs
from outbox.relay.router import route_batch

from .common import TOPIC, Databases, Size, conninfo, engine, log, median, publish_events, sql_for_psycopg, subscribe

ROUTE_LIMIT = 100
CLAIM_LIMIT = 50


def vacuum(url: Any) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox_events")
        conn.execute("VACUUM ANALYZE outbox_jobs")


def explain(url: Any, consumers: int) -> dict[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS) of one route and one claim, both rolled back."""
    leases = {f"c{i}": 30.0 for i in range(1, consumers + 1)}
    plans = {}
    with psycopg.connect(conninfo(url)) as conn:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql_for_psycopg(queries.event_route_many),
                            {"limit": ROUTE_LIMIT, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0}).fetchall()
        plans["route"] = "\n".join(r[0] for r in rows)
        conn.rollback()
        with conn.transaction():
            conn.execute(sql_for_psycopg(queries.event_route_many),
                         {"limit": ROUTE_LIMIT, "skip": [], "only": None, "channel": "outbox_jobs", "after": 0})
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql_for_psycopg(queries.job_claim_many), {
            "consumers": list(leases), "leases": list(leases.values()), "limit": CLAIM_LIMIT,
            "worker": "explain"}).fetchall()
        plans["claim"] = "\n".join(r[0] for r in rows)
        conn.rollback()
    return plans


def measure(url: Any, consumers: int, events: int) -> dict[str, float]:
    """Median ms per route, claim and complete statement over one batch of ``events``."""
    leases = {f"c{i}": 30.0 for i in range(1, consumers + 1)}
    eng = engine(url)
    publish_events(eng, events)
    vacuum(url)
    route, claim, complete = [], [], []
    while True:
        with eng.begin() as conn:
            t = time.perf_counter()
            result = route_batch(conn, ROUTE_LIMIT)
            route.append(time.perf_counter() - t)
        if result.events < ROUTE_LIMIT:
            route.pop()  # the last, partial batch
            break
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("ANALYZE outbox_jobs")  # claims with current statistics (see backlog() for stale ones)
    while True:
        with eng.begin() as conn:
            t = time.perf_counter()
            jobs = claim_jobs(conn, leases, CLAIM_LIMIT, "bench")
            claim.append(time.perf_counter() - t)
        if not jobs:
            claim.pop()
            break
        with eng.begin() as conn:
            t = time.perf_counter()
            complete_jobs(conn, jobs)
            complete.append(time.perf_counter() - t)
    eng.dispose()
    return {"route_ms": median(route) * 1000, "claim_ms": median(claim) * 1000,
            "complete_ms": median(complete) * 1000, "route_samples": len(route), "claim_samples": len(claim)}


def repeated(url: Any, consumers: int, size: Size) -> dict[str, float]:
    runs = [measure(url, consumers, size.scale_events) for _ in range(size.runs)]
    return {k: median([r[k] for r in runs]) for k in runs[0]} | {"runs": runs}


def fill(url: Any, rows: int) -> float:
    """Add ``rows`` routed events and ``rows`` done jobs (c1..c3), then vacuum; seconds taken."""
    start = time.perf_counter()
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_events (topic, payload, created_at, routed_at)"
            " SELECT %s, jsonb_build_object('order_id', i), now() - interval '2 hours', now() - interval '2 hours'"
            " FROM generate_series(1, %s) i", (TOPIC, rows))
        conn.execute(
            "INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, fence,"
            " run_at, created_at, updated_at, finished_at)"
            " SELECT id, 'c' || (1 + id % 3), 'done', 1, 5, id, created_at, created_at, created_at, created_at"
            " FROM outbox_events WHERE created_at < now() - interval '1 hour'")
    vacuum(url)
    return time.perf_counter() - start


def backlog(dbs: Databases, size: Size) -> dict[str, Any]:
    """Claim time with a ready backlog, before and after the first ANALYZE of outbox_jobs."""
    from outbox.relay.router import route_all

    claim = sql_for_psycopg(queries.job_claim_many)
    out: dict[str, Any] = {"events": size.sweep_events, "ready_jobs": size.sweep_events * 3}
    with dbs.fresh() as url, psycopg.connect(conninfo(url), autocommit=True) as conn:
        subscribe(conn, 3)
        eng = engine(url)
        publish_events(eng, size.sweep_events)
        route_all(eng)
        eng.dispose()
        for state in ("unanalyzed", "analyzed"):
            for limit in (8, 50):
                params = {"consumers": ["c1", "c2", "c3"], "leases": [30.0] * 3, "limit": limit, "worker": "bench"}
                times = []
                for _ in range(7):
                    with conn.transaction(force_rollback=True):  # same backlog for every sample
                        t = time.perf_counter()
                        conn.execute(claim, params).fetchall()
                        times.append((time.perf_counter() - t) * 1000)
                out[f"claim{limit}_ms_{state}"] = median(times)
            with conn.transaction(force_rollback=True):
                plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim, params).fetchall()
            out[f"plan_{state}"] = "\n".join(r[0] for r in plan)
            conn.execute("ANALYZE outbox_jobs")
    return out


def redriven(dbs: Databases, size: Size) -> dict[str, Any]:
    """Claim time right after a redrive of a tenth of ``scale_rows`` dead jobs into a table
    analysed while they were all dead."""
    from outbox.admin import redrive

    claim = sql_for_psycopg(queries.job_claim_many)
    out: dict[str, Any] = {"dead": size.scale_rows, "redriven": size.scale_rows // 10}
    with dbs.fresh() as url, psycopg.connect(conninfo(url), autocommit=True) as conn:
        subscribe(conn, 1)
        conn.execute("INSERT INTO outbox_events (topic, payload, routed_at) SELECT %s, jsonb_build_object('n', i),"
                     " now() FROM generate_series(1, %s) i", (TOPIC, size.scale_rows))
        conn.execute("INSERT INTO outbox_jobs (event_id, consumer, status, attempts, max_attempts, finished_at)"
                     " SELECT id, 'c1', 'dead', 5, 5, now() FROM outbox_events")
        conn.execute("VACUUM ANALYZE outbox_jobs")
        eng = engine(url)
        with eng.begin() as sa_conn:
            ids = list(sa_conn.execute(queries.job_dead_list, {"consumer": "c1", "limit": out["redriven"]}).scalars())
            redrive(sa_conn, ids)
        eng.dispose()
        params = {"consumers": ["c1"], "leases": [30.0], "limit": CLAIM_LIMIT, "worker": "bench"}
        times = []
        for _ in range(7):
            with conn.transaction(force_rollback=True):  # the same ready jobs for every sample
                t = time.perf_counter()
                conn.execute(claim, params).fetchall()
                times.append((time.perf_counter() - t) * 1000)
        out["claim50_ms"] = median(times)
        with conn.transaction(force_rollback=True):
            out["plan"] = "\n".join(r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim, params))
    return out


def publish_some(url: Any, events: int) -> None:
    eng = engine(url)
    publish_events(eng, events)
    eng.dispose()


def uses(plan: str, index: str) -> bool:
    return index in plan


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": size.scale_rows, "events_per_measurement": size.scale_events}
    with dbs.fresh() as url:
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            subscribe(conn, 3)
        empty = repeated(url, 3, size)
        publish_some(url, 200)
        empty_plans = explain(url, 3)
        log(f"scale empty: route {empty['route_ms']:.2f} ms/100 events, claim {empty['claim_ms']:.2f} ms/50 jobs")
        fill_seconds = fill(url, size.scale_rows)
        log(f"scale: filled {size.scale_rows:,} routed events and done jobs in {fill_seconds:.0f}s")
        big = repeated(url, 3, size)
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            sizes = dict(conn.execute(
                "SELECT relname, pg_size_pretty(pg_total_relation_size(oid)) FROM pg_class"
                " WHERE relname IN ('outbox_jobs', 'outbox_events')").fetchall())
        publish_some(url, 200)
        big_plans = explain(url, 3)
        log(f"scale 1M: route {big['route_ms']:.2f} ms/100 events, claim {big['claim_ms']:.2f} ms/50 jobs")
    for name, plans in (("empty", empty_plans), ("big", big_plans)):
        for stmt, text in plans.items():
            (results / f"plan-{stmt}-{name}.txt").write_text(text + "\n")
    out.update(
        empty=empty, big=big, fill_seconds=fill_seconds, table_sizes=sizes,
        claim_ratio=big["claim_ms"] / empty["claim_ms"], route_ratio=big["route_ms"] / empty["route_ms"],
        complete_ratio=big["complete_ms"] / empty["complete_ms"],
        plans={"empty": empty_plans, "big": big_plans},
        partial_index_used={
            "claim": uses(big_plans["claim"], "ix_outbox_jobs_ready"),
            "route": uses(big_plans["route"], "ix_outbox_events_unrouted")},
    )
    by_k = {}
    for k in (1, 3, 10):
        with dbs.fresh() as url:
            with psycopg.connect(conninfo(url), autocommit=True) as conn:
                subscribe(conn, k)
            m = repeated(url, k, size)
        m["route_us_per_job"] = m["route_ms"] * 1000 / (ROUTE_LIMIT * k)
        by_k[str(k)] = m
        log(f"scale K={k}: route {m['route_ms']:.2f} ms/100 events ({m['route_us_per_job']:.0f} us/job),"
            f" claim {m['claim_ms']:.2f} ms/50 jobs")
    out["by_consumers"] = by_k
    b = backlog(dbs, size)
    (results / "plan-claim-backlog-unanalyzed.txt").write_text(b["plan_unanalyzed"] + "\n")
    (results / "plan-claim-backlog-analyzed.txt").write_text(b["plan_analyzed"] + "\n")
    log(f"scale backlog of {b['ready_jobs']:,} ready jobs: claim 8 {b['claim8_ms_unanalyzed']:.2f} ms before the first"
        f" ANALYZE, {b['claim8_ms_analyzed']:.2f} ms after; claim 50 {b['claim50_ms_unanalyzed']:.2f} -> "
        f"{b['claim50_ms_analyzed']:.2f} ms")
    out["backlog"] = b
    r = redriven(dbs, size)
    (results / "plan-claim-redriven.txt").write_text(r["plan"] + "\n")
    log(f"scale redrive of {r['redriven']:,} of {r['dead']:,} dead jobs: claim 50 {r['claim50_ms']:.2f} ms")
    out["redriven"] = r
    return out
