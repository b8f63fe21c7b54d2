"""``python -m bench``: run outbox's benchmark suite (issue 4) and report.

    python -m bench                    # default size (< 15 min), peers included
    python -m bench --quick --no-peers # smoke test (< 2 min), what CI runs
    python -m bench --full             # the issue's full soak (10 min) and snapshot (2 min)
    python -m bench --only e2e --only peers
    python -m bench --only profile     # where the relay's time goes (py-spy, round trips)
    python -m bench --only ordered     # ordered delivery per key against unordered (issue 10)
    python -m bench --only forward     # forwarding to JetStream / RabbitMQ against their raw clients (issue 11)
    python -m bench --only intake      # taking messages in from JetStream / RabbitMQ against their raw consumers (issue 31)
    python -m bench --only ceiling     # the leanest SQL doing outbox's work: claim + complete, whole pipeline (issue 14)
    python -m bench --only sustained   # a steady rate on a server of its own, a snapshot held for the middle third (issue 28)
    python -m bench --only drift       # the same rate for 30 minutes, no snapshot, 5-minute retention: p99 drift, table sizes

Prints the markdown table on stdout (progress on stderr) and writes ``results.json``,
``results.md``, ``throughput.png`` and ``latency.png`` (plus logs, plans and a
timestamped copy of the JSON) to ``bench/results/``. The server is
``BENCH_DATABASE_URL``, else ``OUTBOX_DATABASE_URL``, else postgres@127.0.0.1:5432; the
user needs CREATEDB. Exit status 1 if a scenario failed (the others still run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .common import BENCH, ROOT, SIZES, Databases, is_server_restart, log, server_facts, server_url, wait_for_server

SCENARIOS = ("raw", "e2e", "peers", "publish", "latency", "scale", "soak", "ordered", "forward", "metrics", "ceiling",
             "sustained", "intake")
#: Run only when named (``--only``): they take long and answer one question each.
ON_REQUEST = ("profile", "drift")
ALIASES = {str(i + 1): name for i, name in enumerate(SCENARIOS)} | {name: name for name in ON_REQUEST}
# The order they run in: the ceiling right after scenario 1, so the two limits are measured
# side by side and just before the end-to-end runs they are compared with.
RUN_ORDER = ("raw", "ceiling", *SCENARIOS[1:-3], "intake", "sustained", "drift", "profile")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size",
                      help="smoke-test size: the whole suite in under 2 minutes, numbers not meaningful")
    size.add_argument("--full", action="store_const", const="full", dest="size",
                      help="the issue's full size: 10 min soak, 2 min snapshot (about 30 minutes)")
    parser.add_argument("--only", action="append", metavar="SCENARIO",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}, 1-{len(SCENARIOS)},"
                             f" or (only when named) {', '.join(ON_REQUEST)}")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip PgQueuer, procrastinate and awa-pg (no peers' venv is created)")
    parser.add_argument("--profile", action="store_true", help="also profile the end-to-end relay")
    parser.add_argument("--runs", type=int, help="repetitions behind each median (default 3)")
    parser.add_argument("--results", type=Path, default=BENCH / "results", help="output folder (default bench/results)")
    args = parser.parse_args(argv)
    args.size = args.size or "default"
    chosen = []
    for item in args.only or SCENARIOS:
        for name in item.split(","):
            name = ALIASES.get(name.strip(), name.strip())
            if name not in SCENARIOS and name not in ON_REQUEST:
                parser.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}, 1-{len(SCENARIOS)},"
                             f" {' or '.join(ON_REQUEST)}")
            chosen.append(name)
    if args.profile and "profile" not in chosen:
        chosen.append("profile")
    if args.no_peers:
        chosen = [c for c in chosen if c != "peers"]
    args.scenarios = [s for s in RUN_ORDER if s in chosen]
    return args


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "outbox"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + (" (outbox/ modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def draw(results: Path, no_peers: bool) -> list[str]:
    """Draw the charts with an interpreter that has matplotlib; names of the files drawn."""
    from .peers import venv_python

    candidates = [Path(sys.executable)]
    if venv_python().exists():
        candidates.append(venv_python())
    for python in candidates:
        has = subprocess.run([str(python), "-c", "import matplotlib"], capture_output=True).returncode == 0
        if has:
            out = subprocess.run([str(python), str(BENCH / "charts.py"), str(results / "results.json"), str(results)],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                return out.stdout.split()
            log(f"charts failed: {out.stderr[-800:]}")
            return []
    log("charts skipped: no matplotlib here" + (" (run without --no-peers once, or pip install matplotlib)"
                                                if no_peers else ""))
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    size = SIZES[args.size]
    if args.runs:
        size = dataclasses.replace(size, runs=args.runs)
    if args.no_peers:
        size = dataclasses.replace(size, peers=False)
    results: Path = args.results
    (results / "logs").mkdir(parents=True, exist_ok=True)
    server = server_url()
    started = time.monotonic()
    data: dict[str, Any] = {
        "size": size.name, "runs": size.runs, "scenarios": args.scenarios,
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(), "facts": server_facts(server), "sizes": dataclasses.asdict(size),
        "timings": {}, "errors": {},
    }
    log(f"size {size.name}, scenarios {', '.join(args.scenarios)}; results in {results}")
    from . import (
        ceiling,
        e2e,
        forward,
        intake,
        latency,
        metrics_cost,
        ordered,
        peers,
        profile,
        publish_cost,
        raw,
        scale,
        soak,
        sustained,
    )

    modules = {"raw": raw, "ceiling": ceiling, "e2e": e2e, "peers": peers, "publish": publish_cost, "latency": latency,
               "scale": scale, "soak": soak, "ordered": ordered, "forward": forward, "metrics": metrics_cost,
               "sustained": sustained, "intake": intake}
    with Databases(server) as dbs:
        for name in args.scenarios:
            t0 = time.monotonic()
            log(f"scenario {name}")
            for attempt in (1, 2):
                try:
                    if name == "profile":
                        best = (data.get("e2e", {}).get("best", {}).get("settings")
                                or {"concurrency": 64, "claim_batch": 128})
                        data["profile"] = profile.run(dbs, size, results, best)
                    elif name == "drift":
                        data["drift"] = sustained.drift(dbs, size, results)
                    else:
                        data[name] = modules[name].run(dbs, size, results)
                    break
                except Exception as exc:  # noqa: BLE001 - report it, run the rest
                    traceback.print_exc()
                    if attempt == 1 and is_server_restart(exc) and wait_for_server(server):
                        log(f"scenario {name}: the server restarted under it (another user?); running it again")
                        data.setdefault("restarts", []).append(name)
                        continue
                    data["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            data["timings"][name] = time.monotonic() - t0
    data["total_seconds"] = time.monotonic() - started
    data["load_after"] = os.getloadavg()
    from .report import markdown

    (results / "results.json").write_text(json.dumps(data, indent=1, default=str))
    data["charts"] = draw(results, args.no_peers)
    table = markdown(data)
    if data["charts"]:
        table += "\nCharts: " + ", ".join(str(results / c) for c in data["charts"]) + "\n"
    (results / "results.json").write_text(json.dumps(data, indent=1, default=str))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (results / f"results-{size.name}-{stamp}.json").write_text(json.dumps(data, indent=1, default=str))
    (results / "results.md").write_text(table)
    print(table)
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
