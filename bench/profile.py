"""``python -m bench --profile``: where the end-to-end relay spends its time, per job.

Two measurements of the scenario-2 workload (N events to 3 no-op consumers), each at the
relay's defaults and at the given best settings:

1. **Round trips.** The relay runs in this process (``outbox.relay.relay.Relay``) while every
   server round trip psycopg makes is counted, by thread (psycopg's ``execute``
   generator, one call per query sent and answered), and every statement SQLAlchemy
   sends is named after :mod:`outbox.db.queries` with the rows it returned. Publishing
   and watching happen on other connections and are not counted.
2. **CPU.** The relay runs as the usual subprocess while ``py-spy record`` (from the
   peers' venv) samples it; the samples are summed by thread and by the package of the
   innermost frame (self time), and by outbox function (inclusive time).

The relay's and the backends' CPU seconds per job come from scenario 2's own readings.
Writes ``profile.json``, the raw py-spy stacks and ``profile.md`` to the results folder.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import psycopg._cursor_base
import psycopg.generators
import sqlalchemy as sa

from outbox.db import jobs, queries
from outbox.relay.relay import Relay
from outbox.settings import OutboxSettings

from . import e2e
from .common import Databases, Size, conninfo, engine, log, publish_events, wait_drained
from .peers import VENV, ensure_venv

STATEMENTS = {" ".join(v.text.split()): k for k, v in vars(queries).items() if isinstance(v, sa.TextClause)}


class RoundTrips:
    """Counts psycopg round trips per thread name while installed."""

    def __init__(self) -> None:
        self.by_thread: collections.Counter[str] = collections.Counter()
        self.statements: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[str] = collections.Counter()
        self._originals = (psycopg.generators.execute, psycopg._cursor_base.execute)
        self._rows_of = jobs._rows
        self._rows_together_of = jobs._rows_together

    def install(self) -> None:
        original = self._originals[0]
        counter = self.by_thread

        def counted(pgconn: Any, *args: Any, **kwargs: Any) -> Any:
            counter[_thread_group(threading.current_thread().name)] += 1
            return (yield from original(pgconn, *args, **kwargs))

        psycopg.generators.execute = counted
        psycopg._cursor_base.execute = counted

        # The dispatcher runs the job statements on a bare psycopg connection, past
        # SQLAlchemy's events: name those where the runner sends them.
        rows_of = jobs._rows
        names = {id(v): k for k, v in vars(queries).items() if isinstance(v, sa.TextClause)}
        statements, rows = self.statements, self.rows

        def named(conn: Any, statement: Any, params: Any) -> Any:
            result = rows_of(conn, statement, params)
            if isinstance(conn, psycopg.Connection) and threading.current_thread().name.startswith("outbox-"):
                statements[names.get(id(statement), "?")] += 1
                rows[names.get(id(statement), "?")] += len(result)
            return result

        jobs._rows = named

        # The runner's round (completions, then the claim) is pipelined: one round trip that
        # psycopg.generators.execute does not see, for two statements.
        rows_together_of = jobs._rows_together

        def named_together(conn: Any, steps: Any) -> Any:
            results = rows_together_of(conn, steps)
            if isinstance(conn, psycopg.Connection) and threading.current_thread().name.startswith("outbox-"):
                if jobs.PIPELINE:
                    counter[_thread_group(threading.current_thread().name)] += 1
                for (statement, _, _), result in zip(steps, results, strict=True):
                    statements[names.get(id(statement), "?")] += 1
                    rows[names.get(id(statement), "?")] += len(result)
            return results

        jobs._rows_together = named_together

    def uninstall(self) -> None:
        psycopg.generators.execute, psycopg._cursor_base.execute = self._originals
        jobs._rows = self._rows_of
        jobs._rows_together = self._rows_together_of

    def watch(self, eng: sa.Engine) -> None:
        @sa.event.listens_for(eng, "after_cursor_execute")
        def after(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
            if not threading.current_thread().name.startswith("outbox-"):
                return
            text = re.sub(r"%\((\w+)\)s", r":\1", " ".join(statement.split()))
            name = STATEMENTS.get(text, text.split()[0].lower())
            self.statements[name] += 1
            self.rows[name] += max(0, cursor.rowcount)


def _thread_group(name: str) -> str:
    return re.sub(r"-\d+$", "", name) if name.startswith("outbox-") else "harness"


def round_trips(dbs: Databases, events: int, settings: dict[str, Any]) -> dict[str, Any]:
    from .apps import fanout

    counts = RoundTrips()
    with dbs.fresh() as url:
        relay = Relay(fanout(), OutboxSettings(database_url=conninfo(url), **settings), worker_id="profile")
        counts.watch(relay.engine)
        relay.start()
        time.sleep(0.5)
        counts.install()
        try:
            start = time.perf_counter()
            eng = engine(url)
            publish_events(eng, events)
            with psycopg.connect(conninfo(url), autocommit=True) as mon:
                wait_drained(mon, expected_jobs=events * 3, interval=0.05)
            elapsed = time.perf_counter() - start
            eng.dispose()
        finally:
            counts.uninstall()
            relay.stop()
    jobs = events * 3
    relay_trips = {k: v for k, v in counts.by_thread.items() if k != "harness"}
    return {
        "settings": settings, "jobs": jobs, "seconds": elapsed, "jobs_per_s": jobs / elapsed,
        "round_trips_per_job": sum(relay_trips.values()) / jobs,
        "round_trips_by_thread": dict(relay_trips),
        "statements": {k: {"calls": v, "rows": counts.rows[k], "rows_per_call": counts.rows[k] / v}
                       for k, v in counts.statements.items()},
    }


class Spy:
    """``py-spy record`` on the relay from ``started`` until ``drained``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc: subprocess.Popen | None = None

    def started(self, pid: int) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(VENV / "bin" / "py-spy"), "record", "--pid", str(pid), "--rate", str(RATE),
                                      "--gil", "--threads", "--format", "raw", "--output", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)

    def drained(self, pid: int) -> None:
        self.seconds = time.monotonic() - self.t0
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


RATE = 250  # py-spy samples per second


def _package(frame: str) -> str:
    match = re.search(r"\((.*):\d+\)$", frame)
    path = match.group(1) if match else ""
    for name, needle in (("outbox", "outbox/"), ("sqlalchemy", "sqlalchemy/"), ("psycopg", "psycopg"),
                         ("bench handler", "bench/"), ("logging", "logging/"), ("pydantic", "pydantic")):
        if needle in path:
            return name
    if path.endswith(("threading.py", "queue.py")):
        return "threading+queue"
    return "other (stdlib)"


def summarise_stacks(path: Path, seconds: float) -> dict[str, Any]:
    """Shares of the GIL-holding samples by thread, by the package of the innermost frame
    (self time) and by outbox function (inclusive time); ``gil_busy`` is the share of the
    run in which some relay thread held the GIL (Python was running)."""
    by_thread: collections.Counter[str] = collections.Counter()
    self_pkg: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    self_func: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        total += count
        match = re.search(r": (\S+)$", frames[0])
        by_thread[_thread_group(match.group(1)) if match else frames[0]] += count
        leaf = frames[-1]
        pkg = _package(leaf)
        self_pkg[pkg] += count
        self_func[f"{re.sub(r' [(].*$', '', leaf)} [{pkg}]"] += count
        seen = set()
        for frame in frames:
            name = frame.split(" (", 1)[0].rsplit(".", 1)[-1]
            if _package(frame) == "outbox" and name not in seen:
                inclusive[name] += count
                seen.add(name)
    share = lambda c: {k: round(v / max(1, total), 3) for k, v in c.most_common(15)}  # noqa: E731
    return {"samples": total, "seconds": seconds, "gil_busy": total / max(1.0, RATE * seconds),
            "threads": share(by_thread), "self_by_package": share(self_pkg), "inclusive_outbox": share(inclusive),
            "top_self": share(self_func)}


def run(dbs: Databases, size: Size, results: Path, best: dict[str, Any]) -> dict[str, Any]:
    ensure_venv()
    out: dict[str, Any] = {}
    for tag, settings in (("default", {}), ("best", best)):
        trips = round_trips(dbs, size.sweep_events, settings)
        log(f"profile {tag}: {trips['round_trips_per_job']:.2f} round trips per job "
            f"({trips['jobs_per_s']:,.0f} jobs/s in process); by thread {trips['round_trips_by_thread']}")
        stacks = results / f"pyspy-{tag}.txt"
        spy = Spy(stacks)
        run_ = e2e.one_run(dbs, size.sweep_events, settings, results, f"profile-{tag}", hooks=spy)
        cpu = (summarise_stacks(stacks, spy.seconds) if stacks.exists()
               else {"error": spy.proc.stderr.read().decode()[-500:] if spy.proc else "py-spy did not start"})
        log(f"profile {tag}: py-spy {json.dumps(cpu)[:600]}")
        out[tag] = {"round_trips": trips, "cpu": cpu, "e2e": {k: run_[k] for k in (
            "jobs_per_s", "relay_cpu_us_per_job", "db_cpu_us_per_job", "machine_busy")}}
    (results / "profile.json").write_text(json.dumps(out, indent=2, default=str))
    return out
