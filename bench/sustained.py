"""Scenario 12, sustained: a steady rate for minutes on a server configured like production,
with a REPEATABLE READ snapshot held for the middle third (issue 28).

A server of its own (``initdb`` + ``pg_ctl`` on a Unix socket in a temporary folder, settings
at PostgreSQL's defaults: autovacuum on, 128 MB of shared buffers), so the shared server's
settings and other users do not colour it. One relay at its default settings, three no-op
consumers; a publisher commits ``sustained_rate`` one-event transactions per second for
``sustained_seconds``; between a third and two thirds of the run another session holds a
REPEATABLE READ snapshot (what ``pg_dump``, a long report or a replica with
``hot_standby_feedback`` does), so vacuum can remove no row version made after it began.

Per window (``sustained_window`` seconds): jobs finished per second, commit -> finished p50
and p99 of the jobs whose event was committed in the window, the ready backlog and unrouted
events at the window's end, table and index sizes, dead tuples. Reported: throughput while
the snapshot was held over the offered rate and over throughput before it, and p99 while
held over p99 before (issue 28's targets: >= 0.95 of the offered rate, p99 <= 2x); and per
phase (before, while held, after) the statements that took the most server time
(pg_stat_statements: calls, mean ms, buffers per call), to see where the time goes.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import URL, make_url

from .common import Databases, RelayProcess, Size, SteadyPublisher, conninfo, engine, find_binary, log

CONSUMERS = 3


@contextlib.contextmanager
def own_server(log_copy: Path | None = None) -> Iterator[URL]:
    """A PostgreSQL server of this scenario's own, at the server's default settings
    (autovacuum on; every autovacuum and checkpoint logged), listening on a Unix socket in a
    temporary folder; stopped and deleted afterwards, its log first copied to ``log_copy``
    when given. Run as root, the server runs as the ``postgres`` account (``runuser``).
    Raises RuntimeError when ``initdb`` / ``pg_ctl`` cannot be found."""
    initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        raise RuntimeError("initdb / pg_ctl not found (install the PostgreSQL server packages)")
    folder = Path(tempfile.mkdtemp(prefix="outbox-bench-sustained-"))
    data = folder / "data"
    as_owner: list[str] = []
    try:
        if os.geteuid() == 0:  # initdb refuses root: the server runs as the postgres account
            owner = pwd.getpwnam("postgres")
            os.chown(folder, owner.pw_uid, owner.pw_gid)
            as_owner = ["runuser", "-u", "postgres", "--"]
        subprocess.run([*as_owner, initdb, "-D", str(data), "-U", "postgres", "--auth", "trust", "--no-sync"],
                       check=True, capture_output=True)
        with socket.socket() as s:  # a port no other server uses (the socket file's name carries it)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options = (f"-p {port} -k {folder} -c listen_addresses='' -c max_connections=100"
                   " -c shared_preload_libraries=pg_stat_statements -c log_autovacuum_min_duration=0"
                   " -c log_checkpoints=on")
        subprocess.run([*as_owner, pg_ctl, "-D", str(data), "-o", options, "-l", str(folder / "server.log"),
                        "-w", "start"], check=True, capture_output=True)
        yield make_url(f"postgresql+psycopg://postgres@/postgres?host={folder}&port={port}")
    finally:  # also after a failed initdb or start: no folder or server is left behind
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_owner, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True)
        if log_copy is not None and (folder / "server.log").exists():
            log_copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / "server.log", log_copy)
        shutil.rmtree(folder, ignore_errors=True)


def sample(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Backlog, sizes and dead tuples of the outbox tables now."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(
        "SELECT (SELECT count(*) FROM outbox_jobs WHERE status = 'ready'),"
        " (SELECT count(*) FROM outbox_events WHERE routed_at IS NULL),"
        " pg_table_size('outbox_jobs'), pg_indexes_size('outbox_jobs'),"
        " pg_table_size('outbox_events'), pg_indexes_size('outbox_events'),"
        " (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_jobs'),"
        " (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_events'),"
        " (SELECT autovacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox_jobs')").fetchone()
    keys = ("ready", "unrouted", "jobs_table_bytes", "jobs_index_bytes", "events_table_bytes", "events_index_bytes",
            "jobs_dead_tuples", "events_dead_tuples", "jobs_autovacuums")
    return dict(zip(keys, row, strict=True))


def statements(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """The statements that took the most server time since the last reset (pg_stat_statements),
    then reset: the start of the text, calls, mean ms and shared buffers per call."""
    rows = conn.execute(
        "SELECT regexp_replace(left(query, 400), '\\s+', ' ', 'g'), calls, total_exec_time,"
        " (shared_blks_hit + shared_blks_read)::float8 / greatest(calls, 1)"
        " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " ORDER BY total_exec_time DESC LIMIT 8").fetchall()
    conn.execute("SELECT pg_stat_statements_reset()")
    return [{"query": q[:160], "calls": calls, "total_ms": total, "mean_ms": total / max(calls, 1),
             "buffers_per_call": buffers} for q, calls, total, buffers in rows]


def windows(conn: psycopg.Connection[Any], start: Any, first: int, n: int, window: float) -> list[dict[str, Any]]:
    """Windows ``first`` .. ``first + n - 1`` of ``window`` seconds from database time
    ``start``: jobs finished per second, and p50 / p99 commit -> finished (seconds) of the
    jobs whose event was committed in it (jobs unfinished now count as finished now)."""
    rows = conn.execute(
        """
        WITH j AS (
            SELECT extract(epoch FROM e.created_at - %(start)s) AS committed,
                   extract(epoch FROM coalesce(j.finished_at, now()) - %(start)s) AS finished,
                   extract(epoch FROM coalesce(j.finished_at, now()) - e.created_at) AS latency
            FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id
            WHERE e.created_at >= %(start)s + make_interval(secs => %(first)s * %(window)s - 60)
        ), w AS (SELECT generate_series(%(first)s, %(first)s + %(n)s - 1) AS i)
        SELECT w.i,
               (SELECT count(*) FROM j WHERE j.finished >= w.i * %(window)s AND j.finished < (w.i + 1) * %(window)s),
               (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY latency) FROM j
                 WHERE j.committed >= w.i * %(window)s AND j.committed < (w.i + 1) * %(window)s),
               (SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY latency) FROM j
                 WHERE j.committed >= w.i * %(window)s AND j.committed < (w.i + 1) * %(window)s)
        FROM w ORDER BY w.i
        """, {"start": start, "first": first, "n": n, "window": window}).fetchall()
    return [{"window": i, "jobs_per_s": done / window, "p50_ms": (p50 or 0) * 1000, "p99_ms": (p99 or 0) * 1000}
            for i, done, p50, p99 in rows]


def percentiles(conn: psycopg.Connection[Any], start: Any, spans: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Commit -> finished p50 / p99 / max (ms) and count of the jobs whose event was committed
    in each span (seconds from database time ``start``), by name: every job of the span, not
    the worst of its windows."""
    out = {}
    for name, (t0, t1) in spans.items():
        count, p50, p99, worst = conn.execute(
            """
            SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY latency),
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY latency), max(latency)
            FROM (SELECT extract(epoch FROM coalesce(j.finished_at, now()) - e.created_at) AS latency
                  FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id
                  WHERE e.created_at >= %(start)s + make_interval(secs => %(t0)s)
                    AND e.created_at < %(start)s + make_interval(secs => %(t1)s)) j
            """, {"start": start, "t0": t0, "t1": t1}).fetchone()
        out[name] = {"jobs": count, "p50_ms": (p50 or 0) * 1000, "p99_ms": (p99 or 0) * 1000,
                     "max_ms": (worst or 0) * 1000}
    return out


def slowest_seconds(conn: psycopg.Connection[Any], start: Any, t0: float, t1: float) -> list[dict[str, Any]]:
    """The five seconds between ``t0`` and ``t1`` (from database time ``start``) whose jobs
    waited longest (p99 of the jobs committed in that second): where a window's p99 came from,
    to set beside the server's log of checkpoints and autovacuums."""
    rows = conn.execute(
        """
        SELECT floor(extract(epoch FROM e.created_at - %(start)s)) AS second, count(*),
               percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM coalesce(j.finished_at, now())
                                                                   - e.created_at)) AS p99
        FROM outbox_jobs j JOIN outbox_events e ON e.id = j.event_id
        WHERE e.created_at >= %(start)s + make_interval(secs => %(t0)s)
          AND e.created_at < %(start)s + make_interval(secs => %(t1)s)
        GROUP BY 1 ORDER BY 3 DESC LIMIT 5
        """, {"start": start, "t0": t0, "t1": t1}).fetchall()
    return [{"second": int(sec), "jobs": n, "p99_ms": p99 * 1000} for sec, n, p99 in rows]


def measure(size: Size, results: Path, seconds: float, window: float, hold: tuple[float, float] | None,
            relay_settings: dict[str, Any], tag: str) -> dict[str, Any]:
    """``seconds`` of ``size.sustained_rate`` one-event transactions on a server of its own,
    against one relay at its defaults but ``relay_settings`` (CLI flags), a REPEATABLE READ
    snapshot held from ``hold[0]`` to ``hold[1]`` seconds (None: never). Returns the per-window
    figures (``windows``, with the samples of :func:`sample` merged in), the statements per
    phase (``before`` / ``during`` / ``after`` the snapshot, or the whole run as ``run``) and
    the rate offered. With a retention in ``relay_settings`` the pruner deletes finished jobs
    while the run goes on, so each window is measured two windows after it ended, before its
    jobs can be pruned; else all at the end, so no measuring query runs during the load."""
    rate = size.sustained_rate
    samples: list[dict[str, Any]] = []
    per_window: list[dict[str, Any]] = []
    pruning = "retention_done" in relay_settings
    extra: dict[str, Any] = {}
    with own_server(results / "logs" / f"server-{tag}.log") as server, Databases(server) as own, \
            own.fresh() as url:
        relay = RelayProcess(url, results / "logs" / f"relay-{tag}.log", relay_settings,
                             env={"BENCH_CONSUMERS": str(CONSUMERS)})
        try:
            relay.wait_ready(CONSUMERS)
            eng = engine(url, pool_size=1)
            publisher = SteadyPublisher(eng, rate)
            with psycopg.connect(conninfo(url), autocommit=True) as mon, psycopg.connect(conninfo(url)) as holder:
                mon.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                mon.execute("SELECT pg_stat_statements_reset()")
                phases: dict[str, list[dict[str, Any]]] = {}
                start_db = mon.execute("SELECT now()").fetchone()[0]
                start = time.monotonic()
                publisher.start()
                held = False
                next_sample = start + window
                while (now := time.monotonic()) < start + seconds:
                    if hold is not None and not held and now - start >= hold[0]:
                        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        holder.execute("SELECT count(*) FROM outbox_events").fetchone()  # the snapshot begins here
                        held = True
                        phases["before"] = statements(mon)
                        log(f"{tag}: snapshot held from {now - start:.0f} s")
                    elif (hold is not None and held and now - start >= hold[1]
                          and holder.info.transaction_status != 0):
                        holder.rollback()
                        phases["during"] = statements(mon)
                        log(f"{tag}: snapshot released at {now - start:.0f} s")
                    if now >= next_sample:
                        s = sample(mon)
                        s["t"] = now - start
                        samples.append(s)
                        ended = len(samples) - 1  # the window that just ended
                        if pruning and ended >= 2:
                            per_window += windows(mon, start_db, ended - 2, 1, window)
                        log(f"{tag}: {s['t']:.0f} s ready {s['ready']:,} unrouted {s['unrouted']:,}"
                            f" jobs dead tuples {s['jobs_dead_tuples']:,}, table + indexes"
                            f" {(s['jobs_table_bytes'] + s['jobs_index_bytes']) / 1e6:,.0f} MB")
                        next_sample += window
                    time.sleep(0.2)
                publisher.stop()
                phases["after" if hold is not None else "run"] = statements(mon)
                offered = publisher.published * CONSUMERS / seconds
                per_window += windows(mon, start_db, len(per_window), int(seconds // window) - len(per_window),
                                      window)
                if hold is not None:  # no pruning: every job is still there
                    extra["phases"] = percentiles(mon, start_db, {
                        "before": (window, hold[0]), "during": hold, "after": (hold[1], seconds)})
                    worst = max(per_window, key=lambda w: w["p99_ms"])
                    extra["slowest_seconds"] = slowest_seconds(mon, start_db, worst["window"] * window,
                                                               (worst["window"] + 1) * window)
                    extra["start"] = str(start_db)
            eng.dispose()
        finally:
            relay.stop()
    for w, s in zip(per_window, samples, strict=False):
        w.update(s)
    for phase, top in phases.items():
        for st in top[:5]:
            log(f"{tag}: {phase}: {st['calls']:,} calls, {st['mean_ms']:.2f} ms, {st['buffers_per_call']:,.0f}"
                f" buffers per call: {st['query'][:90]}")
    for second in extra.get("slowest_seconds", []):
        log(f"{tag}: slow second {second['second']} s: {second['jobs']} jobs, p99 {second['p99_ms']:.0f} ms")
    return {"seconds": seconds, "rate_events": rate, "offered_jobs_per_s": offered, "window_seconds": window,
            "windows": per_window, "statements": phases, "samples": len(samples), **extra}


def mean(ws: list[dict[str, Any]], key: str) -> float:
    return sum(w[key] for w in ws) / len(ws) if ws else float("nan")


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    """The scenario on a server of its own (``dbs`` is the shared server's, unused: the
    template is migrated again on the own server): the snapshot held for the middle third."""
    seconds, window = size.sustained_seconds, size.sustained_window
    hold_from, hold_to = seconds / 3, 2 * seconds / 3
    out = measure(size, results, seconds, window, (hold_from, hold_to), {}, "sustained")
    per_window, offered = out["windows"], out["offered_jobs_per_s"]
    first = int(hold_from // window)
    last = int(hold_to // window)
    before = per_window[1:first] or per_window[:first]  # the first window warms up
    during = per_window[first:last]
    after = per_window[last:]
    out |= {
        "hold": [hold_from, hold_to],
        "before_jobs_per_s": mean(before, "jobs_per_s"), "during_jobs_per_s": mean(during, "jobs_per_s"),
        "after_jobs_per_s": mean(after, "jobs_per_s"),
        "before_p99_ms": max((w["p99_ms"] for w in before), default=float("nan")),
        "during_p99_ms": max((w["p99_ms"] for w in during), default=float("nan")),
        "before_p50_ms": mean(before, "p50_ms"), "during_p50_ms": mean(during, "p50_ms"),
        "ready_max_during": max((w.get("ready", 0) for w in during), default=0),
        "jobs_dead_tuples_max": max((w.get("jobs_dead_tuples", 0) for w in per_window), default=0),
    }
    out["during_over_offered"] = out["during_jobs_per_s"] / offered if offered else float("nan")
    out["during_over_before"] = out["during_jobs_per_s"] / out["before_jobs_per_s"]
    out["p99_during_over_before"] = out["during_p99_ms"] / out["before_p99_ms"]
    ph = out["phases"]
    out["phase_p99_during_over_before"] = ph["during"]["p99_ms"] / ph["before"]["p99_ms"]
    log(f"sustained: every job of each phase: p50 / p99 / max before {ph['before']['p50_ms']:.0f} /"
        f" {ph['before']['p99_ms']:.0f} / {ph['before']['max_ms']:.0f} ms, while held {ph['during']['p50_ms']:.0f} /"
        f" {ph['during']['p99_ms']:.0f} / {ph['during']['max_ms']:.0f} ms ({out['phase_p99_during_over_before']:.1f}x),"
        f" after {ph['after']['p50_ms']:.0f} / {ph['after']['p99_ms']:.0f} / {ph['after']['max_ms']:.0f} ms")
    log(f"sustained: offered {offered:,.0f} jobs/s; finished {out['before_jobs_per_s']:,.0f} before,"
        f" {out['during_jobs_per_s']:,.0f} while held ({out['during_over_offered']:.2f}x offered),"
        f" {out['after_jobs_per_s']:,.0f} after; p99 {out['before_p99_ms']:.0f} -> {out['during_p99_ms']:.0f} ms"
        f" ({out['p99_during_over_before']:.1f}x); ready backlog max {out['ready_max_during']:,}")
    return out


def drift(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    """The same load with no snapshot for ``drift_seconds`` (issue 28: 30 minutes), done jobs
    and events kept ``drift_retention`` seconds so the pruner runs within the run (every
    ``drift_retention`` / 5 s): does p99 drift up between the first and the last
    ``drift_span`` seconds (target: within 20 %), and do the tables stop growing once the
    retention is reached (their size at the retention's end and at the run's end)?"""
    seconds, window, retention = size.drift_seconds, size.sustained_window, size.drift_retention
    settings = {"retention_done": retention, "retention_events": retention, "prune_interval": retention / 5}
    out = measure(size, results, seconds, window, None, settings, "drift")
    per_window = out["windows"]
    span = max(1, int(size.drift_span // window))
    first = per_window[1:1 + span]  # the first window warms up
    last = per_window[-span:]
    sized = [w for w in per_window if "jobs_table_bytes" in w]

    def total(w: dict[str, Any]) -> float:
        return (w["jobs_table_bytes"] + w["jobs_index_bytes"] + w["events_table_bytes"] + w["events_index_bytes"]) / 1e6

    settled = [w for w in sized if (w["window"] + 1) * window >= 2 * retention]  # pruned at least once by then
    out |= {
        "retention": retention, "span_seconds": span * window,
        "first_p99_ms": mean(first, "p99_ms"), "last_p99_ms": mean(last, "p99_ms"),
        "first_jobs_per_s": mean(first, "jobs_per_s"), "last_jobs_per_s": mean(last, "jobs_per_s"),
        "mb_settled": total(settled[0]) if settled else float("nan"),
        "mb_end": total(sized[-1]) if sized else float("nan"),
        "mb_max": max((total(w) for w in sized), default=float("nan")),
    }
    out["p99_last_over_first"] = out["last_p99_ms"] / out["first_p99_ms"]
    log(f"drift: offered {out['offered_jobs_per_s']:,.0f} jobs/s; p99 first {span * window:.0f} s"
        f" {out['first_p99_ms']:.0f} ms, last {out['last_p99_ms']:.0f} ms ({out['p99_last_over_first']:.2f}x);"
        f" tables + indexes {out['mb_settled']:,.0f} MB at {2 * retention:.0f} s, {out['mb_end']:,.0f} MB at the end"
        f" (max {out['mb_max']:,.0f})")
    return out
