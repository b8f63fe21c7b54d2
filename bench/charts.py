"""Draw the charts of a results JSON: ``python bench/charts.py RESULTS.json OUT_DIR``.

Runs wherever matplotlib is installed (the harness uses its own interpreter when it can
import matplotlib, else the peers' venv). Writes ``throughput.png`` (jobs/s against
concurrency: pgbench at batch 1 and 50 against clients, outbox end to end against relay
concurrency, the peers and the psycopg loop as levels) and ``latency.png`` (histogram of
commit-to-handler-start, LISTEN on and polling only). Imports nothing from outbox.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def throughput(data: dict, out: Path) -> bool:
    raw, e2e, peers = data.get("raw"), data.get("e2e"), data.get("peers")
    if not (raw or e2e):
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    if raw:
        for batch, style in ((50, "o-"), (1, "s--")) if raw["pgbench"] else ():
            points = sorted((int(k.split("_c")[1]), v["jobs_per_s"]) for k, v in raw["pgbench"].items()
                            if k.startswith(f"b{batch}_"))
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"pgbench claim+complete, batch {batch}")
        ax.axhline(raw["psycopg_loop"]["jobs_per_s"], color="grey", ls=":", label="psycopg loop, batch 50, 1 conn")
    if e2e:
        points = sorted((s["settings"]["concurrency"], s["jobs_per_s"]) for s in e2e["sweep"])
        ax.plot([p[0] for p in points], [p[1] for p in points], "D-", color="tab:green",
                label="outbox end to end (relay concurrency; sweep)")
        ax.plot([8], [e2e["default"]["jobs_per_s"]], "*", ms=12, color="tab:red", label="outbox end to end, defaults")
        c = e2e["best"]["settings"].get("concurrency", 8)
        ax.plot([c], [e2e["best"]["jobs_per_s"]], "v", ms=9, color="tab:olive",
                label=f"outbox, best settings, {e2e['events']:,} events")
        if "best_analyzed" in e2e:
            ax.plot([c], [e2e["best_analyzed"]["jobs_per_s"]], "^", ms=9, color="tab:cyan",
                    label="same, statistics kept current")
    if peers:
        ax.axhline(peers["pgqueuer"]["jobs_per_s"], color="tab:purple", ls="-.",
                   label=f"PgQueuer drain ({peers['pgqueuer']['driver']}, batch {peers['pgqueuer']['batch']})")
        ax.axhline(peers["procrastinate"]["jobs_per_s"], color="tab:brown", ls="-.", label="procrastinate, concurrency 8")
        if "awa" in peers:
            a = peers["awa"]
            ax.axhline(a["jobs_per_s"], color="tab:pink", ls="-.",
                       label=f"awa-pg drain ({a['workers']} workers, claim batch {a['claim_batch']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (pgbench clients / relay worker threads)")
    ax.set_ylabel("jobs/s (log)")
    ax.set_title(f"Throughput, no-op jobs ({data['size']} size, median of {data['runs']} runs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / "throughput.png")
    plt.close(fig)
    return True


def latency(data: dict, out: Path) -> bool:
    lat = data.get("latency")
    if not lat:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=100)
    values = lat["listen"]["latencies_ms"] + lat["poll"]["latencies_ms"]
    lo, hi = max(0.1, min(values)), max(values)
    bins = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    for key, label in (("listen", "LISTEN/NOTIFY on"), ("poll", "polling only (poll_interval 1 s)")):
        m = lat[key]
        ax.hist([max(lo, v) for v in m["latencies_ms"]], bins=bins, alpha=0.6,
                label=f"{label}: p50 {m['p50_ms']:.1f} / p95 {m['p95_ms']:.1f} / p99 {m['p99_ms']:.1f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("commit to handler start, ms (log)")
    ax.set_ylabel("jobs")
    ax.set_title(f"Latency at {lat['rate']:.0f} events/s x {lat['consumers']} consumers for {lat['seconds']:.0f} s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency.png")
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    drawn = [name for name, fn in (("throughput.png", throughput), ("latency.png", latency)) if fn(data, out)]
    print(" ".join(drawn))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
