"""Scenario 11, the ceiling: the leanest SQL that does outbox's logical work, under pgbench.

Scenario 1 runs outbox's *own* claim and completion statements, so it says how much the
relay adds to them, not whether they are cheap. This scenario runs the leanest statements
that do the same logical work, on a schema of their own (``bench/pgbench/lean_schema.sql``,
in a database of its own, none of outbox's tables), on the same server as the other
scenarios of the invocation:

- ``events`` (identity id, topic, key, payload jsonb, created_at, routed_at) with a partial
  index on the unrouted ones; ``subscriptions`` (topic, consumer), three consumers on one
  topic as in scenario 2; ``jobs`` (identity id, event_id, consumer, status, run_at,
  attempts, fence, lease_until, finished_at) with UNIQUE (event_id, consumer), a partial
  index of ready jobs on (run_at, id) and one of running jobs on lease_until; one global
  fence sequence.
- Stages as pgbench scripts, prepared: publish (``lean_publish.sql``: 500 events per
  transaction, sent as one JSON array), route (``lean_route.sql``: lock up to 500 unrouted
  events FOR UPDATE SKIP LOCKED, one job per subscription, mark them routed, one statement),
  claim and complete (``lean_claim_complete.sql``: claim 50 due ready jobs FOR UPDATE SKIP
  LOCKED with a new fence and a 30 s lease, then complete them fenced, each statement its
  own transaction as in outbox's dispatcher).

Two figures. **Claim + complete alone**: 4 pgbench clients on a preloaded, vacuumed backlog
of ready jobs (topped up before each run and checked never to run dry); jobs/s is
pgbench's tps times the jobs done per script run, as in scenario 1. **The pipeline**, the
leanest-SQL pipeline limit: a fresh database, then three pgbench processes at once for
``lean_seconds``: one publishing client, one routing client, four claiming and completing
clients, on a backlog of ``BOUND`` ready jobs (vacuumed, analysed). The publisher reads the backlog before each batch (3 x events published - fences
handed out: two sequence reads) and waits 2 ms while it is at ``BOUND`` jobs; a router or a
worker that found nothing waits 1 ms. So every stage runs flat out as long as the stage
after it keeps up, the backlog stays bounded, and no client spins on empty queues: a steady
state whatever the stages' relative speeds on the machine. (One pgbench with the three
scripts by weight has no such state: the mix, not the pipeline, sets how often each runs, so
either the backlog grows or workers claim short batches; a try at weights 10 / 11 / 330
claimed 28 jobs per claim of 50.) The rate is the jobs finished per second on the database
clock between 20 % and 90 % of the run (warm-up and stop left out); the database backends'
CPU is read at both ends of that window. One more run without UNIQUE (event_id, consumer),
right after the first, says what outbox's exactly-once routing guard costs (throughput and
database CPU per job against that first run). Each repetition also runs the pipeline with a
completion that deletes the jobs (the same fence and status test) beside outbox's runs with
``retention_done = 0`` (scenario 2): its jobs are the fences drawn in the window, since no
``finished_at`` is left. Not in the pipeline: pruning, the
reaper, heartbeats, NOTIFY, retries and dead letters, flow control, ordering, outbox's
relay bookkeeping.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from .common import (
    BENCH,
    TOPIC,
    Databases,
    Size,
    backend_pids,
    backends_cpu,
    conninfo,
    find_binary,
    log,
    machine_busy,
    median,
    pgbench_command,
    pgbench_result,
    proc_cpu,
    run_pgbench,
)

SCRIPTS = BENCH / "pgbench"
CONSUMERS = ("c1", "c2", "c3")
PUBLISH_BATCH = 500
ROUTE_LIMIT = 500
CLAIM_LIMIT = 50
LEASE_SECONDS = 30
WORKERS = 4
BOUND = 20_000              # jobs made or to be made and not yet claimed, at most (the publisher's back-pressure)
WINDOW = (0.2, 0.9)         # the steady-state window, as shares of the run


def create_schema(conn: psycopg.Connection, unique: bool = True) -> None:
    """The lean schema and its three subscriptions; without ``unique``, no UNIQUE (event_id, consumer)."""
    conn.execute((SCRIPTS / "lean_schema.sql").read_text())
    conn.execute("INSERT INTO subscriptions (topic, consumer) SELECT %s, unnest(%s::text[])", (TOPIC, list(CONSUMERS)))
    if not unique:
        conn.execute("ALTER TABLE jobs DROP CONSTRAINT jobs_event_consumer")


#: The lean completion, and what replaces it when done jobs are deleted at completion (as
#: outbox does with ``retention_done = 0``): the same fence and status test.
LEAN_COMPLETE = """UPDATE jobs j
SET status = 'done',
    finished_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[])) AS a(id, fence)
WHERE"""
LEAN_DELETE = """DELETE FROM jobs j
USING unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[])) AS a(id, fence)
WHERE"""


def work_script(deleting: bool) -> Path:
    """The claim + complete script: ``lean_claim_complete.sql``, or (``deleting``) a copy
    in a temporary directory whose completion deletes the jobs instead."""
    script = SCRIPTS / "lean_claim_complete.sql"
    if not deleting:
        return script
    text = script.read_text()
    if LEAN_COMPLETE not in text:
        raise RuntimeError(f"{script.name} no longer holds the completion the deleting variant replaces")
    copy = Path(tempfile.mkdtemp(prefix="outbox-bench-")) / "lean_claim_delete.sql"
    copy.write_text(text.replace(LEAN_COMPLETE, LEAN_DELETE))
    return copy


def work_defines() -> dict[str, Any]:
    return {"consumers": "{" + ",".join(CONSUMERS) + "}", "claim_limit": CLAIM_LIMIT, "lease": LEASE_SECONDS,
            "after_run_at": "-infinity", "after_id": 0}


def ready_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM jobs WHERE status = 'ready'").fetchone()[0]


def done_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()[0]


def top_up(conn: psycopg.Connection, ready: int) -> None:
    """At least ``ready`` ready jobs, each with its routed event (one event per three jobs),
    then VACUUM ANALYZE of both tables."""
    have = ready_count(conn)
    if have < ready:
        conn.execute(
            "WITH ev AS (INSERT INTO events (topic, payload, routed_at)"
            " SELECT %s, jsonb_build_object('n', i), now() FROM generate_series(1, %s) i RETURNING id, topic)"
            " INSERT INTO jobs (event_id, consumer) SELECT ev.id, s.consumer FROM ev JOIN subscriptions s USING (topic)",
            (TOPIC, -(-(ready - have) // len(CONSUMERS))))
    conn.execute("VACUUM ANALYZE jobs")
    conn.execute("VACUUM ANALYZE events")


def claim_complete(dbs: Databases, size: Size) -> dict[str, Any]:
    """Figure 1: the lean claim + complete alone, ``WORKERS`` clients, on a ready backlog."""
    script = SCRIPTS / "lean_claim_complete.sql"
    runs: list[dict[str, Any]] = []
    with dbs.fresh(migrated=False) as url, psycopg.connect(conninfo(url), autocommit=True) as conn:
        create_schema(conn)
        for _rep in range(size.runs):
            seen = max((r["jobs_per_s"] for r in runs), default=0.0)
            need = int(1.6 * seen * size.lean_seconds) if seen else size.lean_pool
            top_up(conn, max(need, 2_000))
            before = done_count(conn)
            out: dict[str, Any] = dict(run_pgbench(pgbench_command(url, [script], WORKERS, seconds=size.lean_seconds,
                                                                   defines=work_defines())))
            jobs = done_count(conn) - before
            drained = ready_count(conn) < WORKERS * CLAIM_LIMIT
            out.update(jobs=jobs, jobs_per_s=out["tps"] * jobs / max(1, out["transactions"]), drained=drained)
            runs.append(out)
            log(f"ceiling claim + complete, {WORKERS} clients: {out['jobs_per_s']:,.0f} jobs/s"
                f"{' POOL DRAINED' if drained else ''}")
    return {"jobs_per_s": median([r["jobs_per_s"] for r in runs]), "clients": WORKERS, "batch": CLAIM_LIMIT,
            "drained": any(r["drained"] for r in runs), "runs": runs}


def pipeline(dbs: Databases, size: Size, tag: str, unique: bool = True, deleting: bool = False) -> dict[str, Any]:
    """Figure 2: publish, route and claim + complete at once on a fresh database; completed
    jobs/s in the steady-state window (see the module notes). ``deleting``: the completion
    deletes the jobs (no ``finished_at`` is left, so the window's jobs are the fences the
    claims drew in it: each claimed job is completed by the same client's next statement)."""
    seconds = size.lean_seconds
    payloads = json.dumps([{"n": i} for i in range(PUBLISH_BATCH)], separators=(",", ":"))
    stages = {
        "publish": (SCRIPTS / "lean_publish.sql", 1,
                    {"topic": TOPIC, "payloads": payloads, "fanout": len(CONSUMERS), "bound": BOUND}),
        "route": (SCRIPTS / "lean_route.sql", 1, {"route_limit": ROUTE_LIMIT}),
        "work": (work_script(deleting), WORKERS, work_defines()),
    }
    with dbs.fresh(migrated=False) as url, psycopg.connect(conninfo(url), autocommit=True) as mon:
        create_schema(mon, unique=unique)
        top_up(mon, BOUND)  # start at the bound, in the steady state, rather than fill the backlog in the window
        t0 = mon.execute("SELECT clock_timestamp()").fetchone()[0]
        started = time.monotonic()
        procs = {name: subprocess.Popen(pgbench_command(url, [script], clients, seconds=seconds, defines=defines),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, (script, clients, defines) in stages.items()}
        marks = []
        for share in WINDOW:  # CPU of the backends and the pgbench clients at both ends of the window
            time.sleep(max(0.0, started + share * seconds - time.monotonic()))
            clients = sum(c for c in (proc_cpu(p.pid) for p in procs.values()) if c is not None)
            marks.append((backends_cpu(mon, url.database), clients, machine_busy(), len(backend_pids(mon, url.database)),
                          mon.execute("SELECT last_value FROM fence_seq").fetchone()[0]))
        outs = {name: p.communicate() for name, p in procs.items()}
        stages_out = {name: pgbench_result(procs[name].returncode, *outs[name]) for name in stages}
        deadline = time.monotonic() + 5.0  # the backends write their statistics as they exit
        while backend_pids(mon, url.database) and time.monotonic() < deadline:
            time.sleep(0.05)
        plans = {r[0]: r[1] for r in mon.execute(
            "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes"
            " UNION ALL SELECT relname || ' (seq scans)', seq_scan FROM pg_stat_user_tables")}
        w0, w1 = (t0.timestamp() + s * seconds for s in WINDOW)
        mid = (w0 + w1) / 2
        first, second, published, jobs, routed, ready, unrouted, running = mon.execute(
            "SELECT (SELECT count(*) FROM jobs WHERE finished_at >= to_timestamp(%(w0)s) AND finished_at < to_timestamp(%(m)s)),"
            " (SELECT count(*) FROM jobs WHERE finished_at >= to_timestamp(%(m)s) AND finished_at < to_timestamp(%(w1)s)),"
            " (SELECT count(*) FROM events WHERE created_at >= to_timestamp(%(w0)s) AND created_at < to_timestamp(%(w1)s)),"
            " (SELECT count(*) FROM jobs), (SELECT count(*) FROM events WHERE routed_at IS NOT NULL),"
            " (SELECT count(*) FROM jobs WHERE status = 'ready'), (SELECT count(*) FROM events WHERE routed_at IS NULL),"
            " (SELECT count(*) FROM jobs WHERE status = 'running')",
            {"w0": w0, "m": mid, "w1": w1}).fetchone()
    if deleting:
        first = second = (marks[1][4] - marks[0][4]) / 2  # fences drawn in the window, each a job completed
    elif jobs != len(CONSUMERS) * routed:
        raise RuntimeError(f"lean pipeline {tag}: {jobs} jobs for {routed} routed events (expected {len(CONSUMERS)} each)")
    window = w1 - w0
    done = first + second
    (db0, cl0, busy0, _, _), (db1, cl1, busy1, backends, _) = marks
    out = {
        "jobs_per_s": done / window, "first_half_jobs_per_s": first / (window / 2),
        "second_half_jobs_per_s": second / (window / 2), "published_events_per_s": published / window,
        "window_seconds": window, "unique": unique, "deleting": deleting, "backends": backends,
        "db_cpu_us_per_job": (db1 - db0) / max(1, done) * 1e6, "clients_cpu_us_per_job": (cl1 - cl0) / max(1, done) * 1e6,
        "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
        "end": {"ready": ready, "unrouted": unrouted, "running": running, "jobs": jobs},
        "stages": {name: {k: r[k] for k in ("tps", "transactions", "latency_ms", "failed")} for name, r in stages_out.items()},
        "index_scans": plans,
    }
    if plans.get("jobs_running"):
        log(f"ceiling pipeline {tag}: jobs_running was scanned {plans['jobs_running']} times (a plan changed?)")
    log(f"ceiling pipeline {tag}: {out['jobs_per_s']:,.0f} jobs/s (halves {out['first_half_jobs_per_s']:,.0f} /"
        f" {out['second_half_jobs_per_s']:,.0f}; {out['published_events_per_s']:,.0f} events/s published;"
        f" db CPU {out['db_cpu_us_per_job']:.0f} us/job, pgbench {out['clients_cpu_us_per_job']:.0f} us/job,"
        f" machine {out['machine_busy']:.0%} busy; left {ready} ready, {unrouted} unrouted)")
    return out


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    if find_binary("pgbench") is None:
        raise RuntimeError("the ceiling needs pgbench (install the PostgreSQL client tools)")
    alone = claim_complete(dbs, size)
    runs, deleting, without = [], [], None
    for rep in range(size.runs):
        runs.append(pipeline(dbs, size, f"run {rep}"))
        deleting.append(pipeline(dbs, size, f"deleting, run {rep}", deleting=True))
        if rep == 0:  # beside the first run, not minutes after the last
            without = pipeline(dbs, size, "without UNIQUE (event_id, consumer)", unique=False)
    keys = ("jobs_per_s", "published_events_per_s", "db_cpu_us_per_job", "clients_cpu_us_per_job", "machine_busy")
    summary = {k: median([r[k] for r in runs]) for k in keys}
    return {
        "claim_complete": alone,
        "pipeline": {**summary, "seconds": size.lean_seconds, "workers": WORKERS, "bound": BOUND,
                     "publish_batch": PUBLISH_BATCH, "route_limit": ROUTE_LIMIT, "claim_limit": CLAIM_LIMIT,
                     "runs": runs},
        "pipeline_without_unique": without,
        "pipeline_deleting": {**{k: median([r[k] for r in deleting]) for k in keys}, "runs": deleting},
        # against the run right beside it: on a shared machine a lone run pairs better than a median
        "unique_cost": 1 - runs[0]["jobs_per_s"] / without["jobs_per_s"] if without else None,
        "limit_jobs_per_s": summary["jobs_per_s"],
    }
