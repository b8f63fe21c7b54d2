"""Scenario 5, latency: commit-to-handler-start at a steady rate, LISTEN/NOTIFY on and off.

A relay (subprocess, ``BENCH_RECORD`` set, so each handler notes ``time.time()`` as it
starts) serves 3 consumers. The harness publishes one event per domain transaction
(``publish()`` through a SQLAlchemy connection) at ``latency_rate`` events/s for
``latency_seconds``, on a fixed schedule shared by ``PUBLISHERS`` threads (each on its own
connection takes every ``PUBLISHERS``-th slot: one connection commits at most about
1,000-1,300 one-row transactions a second here, so one alone fell behind the issue's
1,000 events/s beside a busy relay), and notes ``time.time()`` right after each commit
returns. The report gives the rate achieved. Latency of a job = its handler start - its event's commit (same machine,
same clock). The run is cut into three equal windows by commit time; each percentile
reported is the median over the windows (each window is one "run"), the pooled values
are kept in the JSON. With LISTEN off the relay relies on ``poll_interval`` (default 1 s).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import publish

from .common import TOPIC, Databases, RelayProcess, Size, conninfo, log, median, percentile, wait_drained

CONSUMERS = 3
WINDOWS = 3
PUBLISHERS = 4


def one_mode(dbs: Databases, size: Size, results: Path, listen: bool) -> dict[str, Any]:
    tag = "listen" if listen else "poll"
    record = results / "logs" / f"latency-{tag}.json"
    with dbs.fresh() as url:
        relay = RelayProcess(url, results / "logs" / f"relay-latency-{tag}.log", listen=listen,
                             env={"BENCH_CONSUMERS": str(CONSUMERS), "BENCH_RECORD": str(record)})
        try:
            relay.wait_ready(CONSUMERS)
            eng = sa.create_engine(url, pool_size=PUBLISHERS)
            n = int(size.latency_rate * size.latency_seconds)
            commits, achieved = publish_on_schedule(eng, n, size.latency_rate)
            eng.dispose()
            with psycopg.connect(conninfo(url), autocommit=True) as mon:
                wait_drained(mon, expected_jobs=n * CONSUMERS)
        finally:
            relay.stop()
    samples = json.loads(record.read_text())
    latencies = sorted((commits[e], (t - commits[e]) * 1000) for e, _c, t in samples if e in commits)
    ms = [l for _, l in latencies]
    per_window = []
    chunk = len(latencies) // WINDOWS
    for w in range(WINDOWS):
        part = [l for _, l in latencies[w * chunk:(w + 1) * chunk]]
        per_window.append({q: percentile(part, q) for q in (50, 95, 99)})
    out = {
        "listen": listen, "events": n, "jobs": len(ms), "rate": achieved,
        "p50_ms": median([w[50] for w in per_window]), "p95_ms": median([w[95] for w in per_window]),
        "p99_ms": median([w[99] for w in per_window]), "max_ms": max(ms),
        "pooled": {f"p{q}_ms": percentile(ms, q) for q in (50, 95, 99)},
        "windows": per_window, "latencies_ms": [round(x, 3) for x in ms],
    }
    log(f"latency {tag}: p50 {out['p50_ms']:.1f} ms, p95 {out['p95_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms"
        f" ({len(ms)} jobs at {achieved:.0f} events/s)")
    return out


def publish_on_schedule(eng: sa.Engine, n: int, rate: float) -> tuple[dict[int, float], float]:
    """Publish ``n`` events, event ``i`` due at ``i / rate`` seconds, from :data:`PUBLISHERS`
    threads (thread ``k`` takes the slots ``i % PUBLISHERS == k``), one transaction each.
    Returns ``{event id: time.time() after its commit}`` and the rate achieved (events/s)."""
    commits: dict[int, float] = {}
    start = time.perf_counter()

    def publisher(k: int) -> None:
        for i in range(k, n, PUBLISHERS):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with eng.begin() as conn:
                event_id = publish(conn, TOPIC, {"n": i})
            commits[event_id] = time.time()

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(PUBLISHERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return commits, n / (time.perf_counter() - start)


def pgqueuer(dbs: Databases, size: Size) -> dict[str, Any] | None:
    """PgQueuer's own LISTEN-driven latency in the same shape (``bench/peer_pgqueuer_latency.py``
    in the peers' venv, on a fresh database of its own): one enqueue of a job per consumer
    per transaction at ``latency_rate`` for ``latency_seconds``, PgQueuer at its defaults.
    None with ``--no-peers``, or when the peers' venv cannot be made (logged)."""
    if not size.peers:
        return None
    from .peers import ensure_venv, peer

    try:
        ensure_venv()
        with dbs.fresh(migrated=False) as url:
            out = peer("peer_pgqueuer_latency.py", url, "--rate", str(size.latency_rate),
                       "--seconds", str(size.latency_seconds), "--consumers", str(CONSUMERS))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log(f"latency pgqueuer skipped: {exc}")
        return None
    log(f"latency pgqueuer: p50 {out['p50_ms']:.1f} ms, p95 {out['p95_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms"
        f" ({out['seen']} jobs at {out['rate_achieved']:.0f} enqueues/s)")
    return out


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    return {"rate": size.latency_rate, "seconds": size.latency_seconds, "consumers": CONSUMERS,
            "listen": one_mode(dbs, size, results, True), "poll": one_mode(dbs, size, results, False),
            "pgqueuer": pgqueuer(dbs, size)}
