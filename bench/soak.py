"""Scenario 7, soak: a relay under steady load for a while, and under a long snapshot.

Steady (``soak_seconds`` at ``soak_rate`` events/s, 3 consumers, one event per domain
transaction): the relay runs with a short retention (``retention_done`` and
``retention_events`` = ``retention`` seconds, pruning every ``retention / 2``). Every
couple of seconds the harness samples the relay's RSS, the rows, dead tuples and size of
``outbox_jobs``, and the age of the oldest done job. Reported: RSS after warm-up vs at the
end, the largest row count and oldest done row of the second half against what the
retention allows, and whether the table stopped growing.

Snapshot (fresh database): a publisher keeps a backlog, so the relay runs flat out; jobs
done per window are counted before, while another session holds a REPEATABLE READ
snapshot open for ``snapshot_seconds`` (vacuum can then remove nothing), and for
``after_seconds`` after it closes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import publish_many

from .common import TOPIC, Databases, RelayProcess, Size, SteadyPublisher, conninfo, engine, log, median, proc_rss_mb

CONSUMERS = 3


def table_sample(conn: psycopg.Connection) -> dict[str, Any]:
    rows, dead, live, size, oldest = conn.execute(
        "SELECT (SELECT count(*) FROM outbox_jobs),"
        " (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_jobs'),"
        " (SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'outbox_jobs'),"
        " pg_total_relation_size('outbox_jobs'),"
        " (SELECT extract(epoch FROM now() - min(finished_at)) FROM outbox_jobs WHERE status = 'done')").fetchone()
    return {"rows": rows, "dead_tuples": dead, "live_tuples": live, "bytes": size,
            "oldest_done_s": float(oldest) if oldest is not None else None}


def steady(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    prune_every = max(1.0, size.retention / 2)
    settings = {"retention_done": size.retention, "retention_events": size.retention, "prune_interval": prune_every}
    sample_every = max(1.0, size.soak_seconds / 40)
    samples: list[dict[str, Any]] = []
    with dbs.fresh() as url:
        relay = RelayProcess(url, results / "logs" / "relay-soak.log", settings,
                             env={"BENCH_CONSUMERS": str(CONSUMERS)})
        try:
            relay.wait_ready(CONSUMERS)
            eng = sa.create_engine(url, pool_size=1)
            publisher = SteadyPublisher(eng, size.soak_rate)
            start = time.monotonic()
            publisher.start()
            with psycopg.connect(conninfo(url), autocommit=True) as mon:
                while time.monotonic() - start < size.soak_seconds:
                    time.sleep(sample_every)
                    mon.execute("SELECT pg_stat_force_next_flush()")
                    s = table_sample(mon)
                    s.update(t=time.monotonic() - start, rss_mb=proc_rss_mb(relay.pid))
                    samples.append(s)
                publisher.stop()
            eng.dispose()
        finally:
            relay.stop()
    warm = [s for s in samples if s["t"] >= min(size.soak_seconds * 0.1, 10.0)] or samples
    second_half = [s for s in samples if s["t"] >= size.soak_seconds / 2] or samples
    window = size.retention + prune_every + 2.0  # + the maintenance loop's wait (reap_interval, default 2 s)
    rate_jobs = size.soak_rate * CONSUMERS
    bound_rows = rate_jobs * (window + 2.0)  # jobs done within the window, + 2 s of slack
    rss_start, rss_end = warm[0]["rss_mb"], samples[-1]["rss_mb"]
    oldest = max((s["oldest_done_s"] or 0.0) for s in second_half)
    out = {
        "seconds": size.soak_seconds, "rate": size.soak_rate, "published": publisher.published, "settings": settings,
        "rss_start_mb": rss_start, "rss_end_mb": rss_end, "rss_growth": rss_end / rss_start - 1,
        "rows_max_second_half": max(s["rows"] for s in second_half), "rows_bound": bound_rows,
        "oldest_done_s_max": oldest, "retention_window_s": window,
        "dead_tuples_end": samples[-1]["dead_tuples"], "dead_tuples_max": max(s["dead_tuples"] or 0 for s in samples),
        "bytes_mid": second_half[0]["bytes"], "bytes_end": samples[-1]["bytes"],
        "bounded": max(s["rows"] for s in second_half) <= bound_rows and oldest <= window + 1.0,
        "samples": samples,
    }
    log(f"soak: RSS {rss_start:.1f} -> {rss_end:.1f} MB ({out['rss_growth']:+.1%}), jobs rows max"
        f" {out['rows_max_second_half']} (bound {bound_rows:.0f}), oldest done {oldest:.1f}s (window {window:.0f}s),"
        f" dead tuples {out['dead_tuples_end']}")
    return out


def snapshot(dbs: Databases, size: Size, results: Path, settings: dict[str, Any]) -> dict[str, Any]:
    window = max(1.0, min(5.0, size.snapshot_seconds / 6))
    retention = max(size.retention, 4 * window)
    settings = {**settings, "retention_done": retention, "retention_events": retention,
                "prune_interval": max(1.0, retention / 2)}
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    dead: dict[str, Any] = {}
    with dbs.fresh() as url:
        relay = RelayProcess(url, results / "logs" / "relay-snapshot.log", settings,
                             env={"BENCH_CONSUMERS": str(CONSUMERS)})
        try:
            relay.wait_ready(CONSUMERS)
            eng = engine(url)
            stop = threading.Event()

            def feeder() -> None:  # keep at least ~3,000 jobs' worth of backlog
                with psycopg.connect(conninfo(url), autocommit=True) as c:
                    while not stop.is_set():
                        ready, unrouted = c.execute(
                            "SELECT (SELECT count(*) FROM outbox_jobs WHERE status = 'ready'),"
                            " (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL)").fetchone()
                        if ready + unrouted * CONSUMERS < 3_000:
                            with eng.begin() as conn:
                                publish_many(conn, [(TOPIC, {"n": i}) for i in range(1_000)])
                        else:
                            time.sleep(0.05)

            thread = threading.Thread(target=feeder, daemon=True)
            thread.start()
            with psycopg.connect(conninfo(url), autocommit=True) as mon, psycopg.connect(conninfo(url)) as holder:
                def windows(phase: str, seconds: float) -> None:
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        t0 = time.monotonic()
                        time.sleep(window)
                        n = mon.execute("SELECT count(*) FROM outbox_jobs WHERE status = 'done'"
                                        " AND finished_at >= now() - make_interval(secs => %s)",
                                        (time.monotonic() - t0,)).fetchone()[0]
                        phases[phase].append(n / (time.monotonic() - t0))

                time.sleep(min(3.0, window))  # let the backlog build
                windows("before", max(2 * window, size.after_seconds / 2))
                holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM outbox_jobs").fetchone()  # the snapshot is taken here
                windows("during", size.snapshot_seconds)
                mon.execute("SELECT pg_stat_force_next_flush()")
                dead["end_of_hold"] = table_sample(mon)
                holder.commit()
                windows("after", size.after_seconds)
                dead["after"] = table_sample(mon)
            stop.set()
            thread.join()
            eng.dispose()
        finally:
            relay.stop()
    out = {"hold_seconds": size.snapshot_seconds, "after_seconds": size.after_seconds, "window_seconds": window,
           "settings": settings, "windows": phases, "tables": dead,
           **{f"{p}_jobs_per_s": median(v) for p, v in phases.items()},
           "during_last_jobs_per_s": phases["during"][-1] if phases["during"] else None}
    out["during_over_before"] = out["during_jobs_per_s"] / out["before_jobs_per_s"]
    out["after_over_before"] = out["after_jobs_per_s"] / out["before_jobs_per_s"]
    log(f"snapshot: {out['before_jobs_per_s']:,.0f} jobs/s before, {out['during_jobs_per_s']:,.0f} while held"
        f" (last window {out['during_last_jobs_per_s'] or 0:,.0f}), {out['after_jobs_per_s']:,.0f} after")
    return out


def run(dbs: Databases, size: Size, results: Path, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"steady": steady(dbs, size, results), "snapshot": snapshot(dbs, size, results, settings or {})}
