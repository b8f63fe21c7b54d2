"""Scenario 2, end-to-end fan-out: publish N events to 3 consumers and run one relay.

A relay (``outbox-relay run --app bench.apps:fanout`` as a subprocess, no-op handlers)
is started on a fresh database and waits; then the harness publishes N events with
``publish_many`` (500 per transaction) and waits until every event is routed and every
job is done. Jobs/s is ``3 N / (last finished_at - first event created_at)``, both read
from the database clock, so it spans first publish to last job done, routing included.

A short sweep over (concurrency, claim_batch, prefetch, dispatchers) on fewer events (one run each) picks the
best settings; then the best settings (N events) and the relay's defaults
(``default_events``) run ``runs`` times each, interleaved; so do the defaults and the best
settings with handlers that sleep 5 ms (handlers waiting on I/O: issue 33's second case).
The best settings also run with ``retention_done = 0`` per repetition: each completion
deletes its job instead of marking it done (the fastest setting, as graphile-worker and
PgQueuer do). Those runs leave no ``finished_at`` to read, so their end is the database
clock when the harness sees the drain (:func:`wait_deleted`: within 5 ms; the rate can only
come out lower than by ``finished_at``), and their jobs are the routed events times the
consumers less the rows left. The best settings also run a fourth time per repetition while the harness runs ``ANALYZE
outbox_jobs`` every 2 s: a burst of N events puts 3 N ready jobs into a table whose
statistics (none yet, or from a quiet time) say it holds almost none; until autovacuum's
analyze catches up, the planner may claim through a bitmap scan and sort of every ready
job, so each claim costs in proportion to the backlog (scenario 6 measures it). That run
shows what the relay does once the statistics are current, with nothing else changed.

Before each repetition a short pgbench run (scenario 1's claim + complete, batch 50, 4
clients) measures the own-statement limit on a fresh database, so "end to end /
own-statement limit" is also reported as the median of ratios of neighbouring runs
(``paired_limit``), which a busy machine disturbs less than a ratio of figures taken
minutes apart.

A run still going after ``e2e_cap`` seconds (half that in the sweep) is cut short and its
rate is the jobs done by then over the time taken; the report says how many were cut.
The relay's and the database backends' CPU seconds are recorded per job, so the report
can say where the time goes on a machine with two cores.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from .common import (
    Databases,
    RelayProcess,
    Size,
    backends_cpu,
    conninfo,
    engine,
    log,
    machine_busy,
    median,
    proc_cpu,
    proc_rss_mb,
    publish_events,
    wait_drained,
)

CONSUMERS = 3
ANALYZE_EVERY = 2.0
#: Seconds each handler sleeps in the runs with handlers that wait (issue 33: 5 ms).
HANDLER_SLEEP = 0.005
#: Seconds between the checks of a run whose completions delete the jobs (its end is read
#: when the drain is seen): the fence sequence while claims go on, then the last running jobs.
FENCES_POLL, LAST_JOBS_POLL = 0.05, 0.005
#: Jobs done: rows marked done, or (done jobs deleted at completion) the jobs the routed
#: events made, ``consumers`` each, less the rows left (ready, running, pending or dead).
DONE_COUNT = "(SELECT count(*) FROM outbox_jobs WHERE status = 'done')"
DELETED_COUNT = ("(SELECT count(*) * %(consumers)s FROM outbox_events WHERE routed_at IS NOT NULL)"
                 " - (SELECT count(*) FROM outbox_jobs)")


def one_run(dbs: Databases, events: int, settings: dict[str, Any], results: Path, tag: str,
            consumers: int = CONSUMERS, hooks: Any = None, cap: float = 1800.0,
            analyze_every: float | None = None, handler_sleep: float = 0.0) -> dict[str, Any]:
    """Publish ``events`` events with a relay running ``settings``; measure until drained,
    or for ``cap`` seconds (then the rate is the jobs done so far over the time taken).
    ``hooks`` (optional) has ``started(pid)`` and ``drained(pid)``, called around the load.
    ``analyze_every`` (seconds): the harness runs ``ANALYZE outbox_jobs`` that often while
    the run lasts, keeping the planner's statistics current (see the module notes).
    ``settings`` with ``retention_done`` 0 (done jobs deleted at completion) leave no
    ``finished_at`` to read: the end is when the drain is seen (module notes).
    ``handler_sleep`` (seconds): each handler sleeps that long (a handler waiting on I/O)
    instead of returning at once."""
    deleting = settings.get("retention_done") == 0
    with dbs.fresh() as url:
        relay = RelayProcess(url, results / "logs" / f"relay-{tag}.log", settings,
                             env={"BENCH_CONSUMERS": str(consumers),
                                  **({"BENCH_SLEEP": str(handler_sleep)} if handler_sleep else {})})
        try:
            relay.wait_ready(consumers)
            eng = engine(url)
            with psycopg.connect(conninfo(url), autocommit=True) as mon:
                if hooks:
                    hooks.started(relay.pid)
                cpu0, busy0 = proc_cpu(relay.pid), machine_busy()
                started = time.monotonic()
                analyzer = Analyzer(url, analyze_every) if analyze_every else None
                publish_seconds = publish_events(eng, events)
                left = max(1.0, cap - (time.monotonic() - started))
                drained = (wait_deleted(mon, events * consumers, left) if deleting else
                           wait_drained(mon, expected_jobs=events * consumers, raise_on_timeout=False, interval=0.5,
                                        timeout=left))
                cpu1, busy1 = proc_cpu(relay.pid), machine_busy()
                if analyzer:
                    analyzer.stop()
                if hooks:
                    hooks.drained(relay.pid)
                db_cpu = backends_cpu(mon, url.database)
                rss = proc_rss_mb(relay.pid)
                t0, t1, jobs = mon.execute(
                    "SELECT (SELECT min(created_at) FROM outbox_events),"
                    f" {'(SELECT max(finished_at) FROM outbox_jobs)' if drained and not deleting else 'clock_timestamp()'},"
                    f" {DELETED_COUNT if deleting else DONE_COUNT}", {"consumers": consumers}).fetchone()
            eng.dispose()
        finally:
            code = relay.stop()
    elapsed = (t1 - t0).total_seconds()
    relay_cpu = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
    busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    out = {
        "events": events, "jobs": jobs, "seconds": elapsed, "jobs_per_s": jobs / elapsed,
        "publish_seconds": publish_seconds, "settings": settings, "handler_sleep": handler_sleep,
        "relay_cpu_us_per_job": relay_cpu / jobs * 1e6 if relay_cpu is not None else None,
        "db_cpu_us_per_job": db_cpu / jobs * 1e6, "machine_busy": busy, "relay_rss_mb": rss,
        "relay_exit": code, "capped": not drained,
    }
    log(f"e2e {tag}: {out['jobs_per_s']:,.0f} jobs/s ({jobs} {'of ' + str(events * consumers) + ' ' if not drained else ''}"
        f"jobs in {elapsed:.1f}s{', CAPPED' if not drained else ''}; relay CPU"
        f" {out['relay_cpu_us_per_job'] or 0:.0f} us/job, db CPU {out['db_cpu_us_per_job']:.0f} us/job,"
        f" machine {busy:.0%} busy)")
    return out


def wait_deleted(conn: psycopg.Connection, jobs: int, timeout: float) -> bool:
    """Wait until ``jobs`` jobs were claimed and none is ready or running, for a run whose
    completions delete the jobs; False after ``timeout`` seconds. While claims go on it
    reads only the fence sequence (one fence per claim); then it looks for the last jobs
    every 5 ms, so the end is seen within that (each look is two probes of small partial
    indexes; looking that often from the start cost the relay up to a tenth of its rate)."""
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT last_value FROM outbox_fence_seq").fetchone()[0] < jobs:
        if time.monotonic() > deadline:
            return False
        time.sleep(FENCES_POLL)
    while conn.execute("SELECT EXISTS (SELECT 1 FROM outbox_jobs WHERE status = 'running')"
                       " OR EXISTS (SELECT 1 FROM outbox_jobs WHERE status = 'ready')").fetchone()[0]:
        if time.monotonic() > deadline:
            return False
        time.sleep(LAST_JOBS_POLL)
    return True


class Analyzer:
    """``ANALYZE outbox_jobs`` every ``every`` seconds on its own connection until stopped."""

    def __init__(self, url: Any, every: float) -> None:
        self.url, self.every = url, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with psycopg.connect(conninfo(self.url), autocommit=True) as conn:
            while not self.done.wait(self.every):
                conn.execute("ANALYZE outbox_jobs")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def label(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("jobs_per_s", "seconds", "relay_cpu_us_per_job", "db_cpu_us_per_job", "machine_busy")
    return {**{k: median([r[k] for r in runs if r[k] is not None]) for k in keys},
            "settings": runs[0]["settings"], "capped": sum(r["capped"] for r in runs), "runs": runs}


def run(dbs: Databases, size: Size, results: Path) -> dict[str, Any]:
    sweep = []
    for concurrency, claim_batch, prefetch, dispatchers in size.sweep:
        settings = {"concurrency": concurrency, "claim_batch": claim_batch, "prefetch": prefetch}
        if dispatchers != 1:
            settings["dispatchers"] = dispatchers
        tag = f"sweep-c{concurrency}-b{claim_batch}-p{prefetch}-d{dispatchers}"
        sweep.append(one_run(dbs, size.sweep_events, settings, results, tag,
                             cap=size.e2e_cap / 2))
    best_settings = max(sweep, key=lambda r: r["jobs_per_s"])["settings"]
    from .raw import probe

    default_runs, best_runs, analyzed_runs, deleting_runs, limits = [], [], [], [], []
    default_sleep_runs, best_sleep_runs = [], []
    for rep in range(size.runs):
        limits.append(probe(dbs, size))
        default_runs.append(one_run(dbs, size.default_events, {}, results, f"default-{rep}", cap=size.e2e_cap))
        # Issue 33: the defaults against the best settings with handlers that wait 5 ms (on I/O), in pairs.
        default_sleep_runs.append(one_run(dbs, size.default_events, {}, results, f"default-sleep-{rep}",
                                          cap=size.e2e_cap, handler_sleep=HANDLER_SLEEP))
        best_sleep_runs.append(one_run(dbs, size.default_events, best_settings, results, f"best-sleep-{rep}",
                                       cap=size.e2e_cap, handler_sleep=HANDLER_SLEEP))
        best_runs.append(one_run(dbs, size.events, best_settings, results, f"best-{rep}", cap=size.e2e_cap))
        analyzed_runs.append(one_run(dbs, size.events, best_settings, results, f"best-analyzed-{rep}",
                                     cap=size.e2e_cap, analyze_every=ANALYZE_EVERY))
        deleting_runs.append(one_run(dbs, size.events, best_settings | {"retention_done": 0}, results,
                                     f"best-deleting-{rep}", cap=size.e2e_cap))
    return {
        "events": size.events, "consumers": CONSUMERS,
        "sweep": [{"settings": r["settings"], "jobs_per_s": r["jobs_per_s"], "events": r["events"],
                   "relay_cpu_us_per_job": r["relay_cpu_us_per_job"], "capped": r["capped"],
                   "db_cpu_us_per_job": r["db_cpu_us_per_job"]} for r in sweep],
        "default": summary(default_runs),
        "best": summary(best_runs),
        "default_over_best": median([d["jobs_per_s"] / b["jobs_per_s"] for d, b in zip(default_runs, best_runs)]),
        "handler_sleep": HANDLER_SLEEP,
        "default_sleep": summary(default_sleep_runs),
        "best_sleep": summary(best_sleep_runs),
        "default_over_best_sleep": median([d["jobs_per_s"] / b["jobs_per_s"]
                                           for d, b in zip(default_sleep_runs, best_sleep_runs)]),
        "best_analyzed": summary(analyzed_runs) | {"analyze_every": ANALYZE_EVERY},
        "best_deleting": summary(deleting_runs),
        "paired_limit": {
            "jobs_per_s": median([l for l in limits if l]) if any(limits) else None, "runs": limits,
            "best_ratio": median([r["jobs_per_s"] / l for r, l in zip(best_runs, limits) if l]) if any(limits) else None,
            "best_analyzed_ratio": (median([r["jobs_per_s"] / l for r, l in zip(analyzed_runs, limits) if l])
                                    if any(limits) else None)},
    }
