"""Scenario 1, the own-statement limit: outbox's claim + fenced complete with no Python in the way.

It runs outbox's *own* statements, so it says how much the relay adds to them; how cheap
those statements are beside the leanest SQL that does the same work is scenario 11
(:mod:`bench.ceiling`). The report called this figure "the raw limit" before issue 14.

pgbench runs ``bench/pgbench/claim_complete.sql`` (the text of ``job_claim_many`` and
``job_complete_many`` from :mod:`outbox.db.queries`, prepared, each statement its own
transaction) with batch 1 and 50 and 1, 4, 8 clients for ``pgbench_seconds``; a minimal
psycopg loop (one connection, autocommit, prepared, batch 50) runs the same pair. Jobs/s
is pgbench's tps (connection set-up excluded) times the jobs that became ``done`` per
script run (the batch, unless the pool ran dry). The ready pool is
topped up and vacuumed before each run, and it is checked that it never ran dry.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from outbox.db import queries

from . import common
from .common import BENCH, Databases, Size, conninfo, find_binary, log, median, sql_for_psycopg

CLIENTS = (1, 4, 8)
BATCHES = (1, 50)
CONSUMERS = ["c1", "c2", "c3"]
LEASES = [30.0, 30.0, 30.0]


def pgbench_script() -> str:
    """The pgbench script with outbox's statements in place."""
    template = (BENCH / "pgbench" / "claim_complete.sql").read_text()
    return (template.replace("-- @job_claim_many", queries.job_claim_many.text.strip())
            .replace("-- @job_complete_many", queries.job_complete_many.text.strip()))


def top_up(conn: psycopg.Connection, ready: int) -> None:
    """Make sure at least ``ready`` ready jobs (over c1..c3, each with its routed event) exist."""
    have = conn.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'ready'").fetchone()[0]
    if have < ready:
        conn.execute(
            "WITH ev AS (INSERT INTO outbox_events (topic, payload, routed_at)"
            " SELECT 'bench.event', jsonb_build_object('n', i), now() FROM generate_series(1, %s) i"
            " RETURNING id)"
            " INSERT INTO outbox_jobs (event_id, consumer, max_attempts)"
            " SELECT id, 'c' || (1 + id %% 3), 5 FROM ev", (ready - have,))
    conn.execute("VACUUM ANALYZE outbox_jobs")
    conn.execute("VACUUM ANALYZE outbox_events")


def done_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'done'").fetchone()[0]


def run_pgbench(url: Any, script: Path, clients: int, batch: int, seconds: float) -> dict[str, float]:
    """One pgbench run: ``-T seconds``, or ``-t 20`` per client when ``seconds`` is 0 (smoke size)."""
    return common.run_pgbench(common.pgbench_command(
        url, [script], clients, seconds=seconds if seconds >= 1 else None, transactions=20,
        defines={"consumers": "{c1,c2,c3}", "leases": "{30,30,30}", "worker": "pgbench", "limit": batch,
                 "keep_done": "true"}))


def psycopg_loop(url: Any, seconds: float, batch: int = 50) -> dict[str, float]:
    """Claim ``batch`` and complete them, one connection, autocommit, prepared."""
    claim = sql_for_psycopg(queries.job_claim_many)
    complete = sql_for_psycopg(queries.job_complete_many)
    params = {"consumers": CONSUMERS, "leases": LEASES, "limit": batch, "worker": "loop"}
    jobs = rounds = 0
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < end:
            rows = conn.execute(claim, params, prepare=True).fetchall()
            if not rows:
                raise RuntimeError("psycopg loop ran out of ready jobs")
            ids = [r[0] for r in rows]
            fences = [r[5] for r in rows]
            conn.execute(complete, {"ids": ids, "fences": fences, "keep_done": True}, prepare=True).fetchall()
            jobs += len(rows)
            rounds += 1
        elapsed = time.perf_counter() - start
    return {"jobs_per_s": jobs / elapsed, "rounds": rounds, "seconds": elapsed}


def probe(dbs: Databases, size: Size, clients: int = 4, batch: int = 50) -> float | None:
    """A short pgbench run (batch 50, 4 clients) on a fresh database: the own-statement limit measured
    right beside another run, so the two can be paired into one ratio. None without pgbench."""
    if find_binary("pgbench") is None:
        return None
    script = Path(tempfile.mkdtemp(prefix="outbox-bench-")) / "claim_complete.sql"
    script.write_text(pgbench_script())
    seconds = max(size.pgbench_seconds, 0)
    with dbs.fresh() as url, psycopg.connect(conninfo(url), autocommit=True) as conn:
        top_up(conn, max(clients * 20 * batch + 100, int(size.pgbench_pool * (0.4 if seconds else 1))))
        before = done_count(conn)
        out = run_pgbench(url, script, clients, batch, seconds)
        jobs = done_count(conn) - before
    return out["tps"] * jobs / max(1, out["transactions"])


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    script = Path(tempfile.mkdtemp(prefix="outbox-bench-")) / "claim_complete.sql"
    script.write_text(pgbench_script())
    (results / "claim_complete.sql").write_text(script.read_text())
    samples: dict[str, list[dict[str, float]]] = {}
    rate_seen: dict[str, float] = {}
    have_pgbench = find_binary("pgbench") is not None
    if not have_pgbench:
        log("raw: pgbench not found (install the PostgreSQL client tools); only the psycopg loop runs")
    with dbs.fresh() as url, psycopg.connect(conninfo(url), autocommit=True) as conn:
        for _rep in range(size.runs if have_pgbench else 0):
            for batch in BATCHES:
                for clients in CLIENTS:
                    key = f"b{batch}_c{clients}"
                    guess = size.pgbench_pool if batch > 1 else size.pgbench_pool // 5
                    need = (int(max(2_000, 1.6 * rate_seen[key] * size.pgbench_seconds)) if key in rate_seen else guess)
                    need = max(need, clients * 20 * batch + 100)  # the -t size of a smoke run
                    top_up(conn, need)
                    before = done_count(conn)
                    out = run_pgbench(url, script, clients, batch, size.pgbench_seconds)
                    jobs = done_count(conn) - before
                    left = conn.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'ready'").fetchone()[0]
                    # tps excludes connection set-up; each transaction is one claim + complete
                    out.update(jobs=jobs, jobs_per_s=out["tps"] * jobs / max(1, out["transactions"]), drained=left == 0)
                    rate_seen[key] = max(rate_seen.get(key, 0.0), out["jobs_per_s"])
                    samples.setdefault(key, []).append(out)
                    log(f"raw pgbench batch {batch:>2} clients {clients}: {out['jobs_per_s']:,.0f} jobs/s"
                        f" ({out['tps']:,.0f} tps){' POOL DRAINED' if left == 0 else ''}")
        loops = []
        for _ in range(size.runs):
            top_up(conn, int(max(5_000, 1.6 * max([l["jobs_per_s"] for l in loops] or [20_000]) * size.loop_seconds)))
            loops.append(psycopg_loop(url, size.loop_seconds))
            log(f"raw psycopg loop batch 50: {loops[-1]['jobs_per_s']:,.0f} jobs/s")
    pgbench = {key: {"jobs_per_s": median([s["jobs_per_s"] for s in runs]),
                     "tps": median([s["tps"] for s in runs]),
                     "latency_ms": median([s["latency_ms"] for s in runs]),
                     "drained": any(s["drained"] for s in runs), "runs": runs}
               for key, runs in samples.items()}
    loop = median([l["jobs_per_s"] for l in loops])
    best50 = max(((v["jobs_per_s"], k) for k, v in pgbench.items() if k.startswith("b50_")),
                 default=(loop, "psycopg loop (no pgbench)"))
    return {"pgbench": pgbench, "psycopg_loop": {"jobs_per_s": loop, "runs": loops},
            "limit_jobs_per_s": best50[0], "limit_config": best50[1]}
