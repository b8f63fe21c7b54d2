"""Scenario 10, the cost of metrics: end-to-end fan-out with and without ``--metrics-port``.

The relay of scenario 2 (``bench.apps:fanout``, 3 no-op consumers) at the best settings of
the sweep (or ``concurrency 32, claim_batch 250, prefetch 250`` when scenario 2 did not run)
runs ``pairs`` interleaved pairs: one run without metrics, one with ``--metrics-port`` and
``--metrics-interval 1`` (the shortest: the database gauges read every second, five times
the default) while the harness scrapes ``/metrics`` every second (Prometheus' default is
every 15 s). The cost is the median over pairs of 1 - with / without, each pair run back to
back, so a machine whose load drifts (other work on it) disturbs the ratio less than the
figures themselves. The relay's CPU per job is reported for both.
"""

from __future__ import annotations

import http.client
import socket
import threading
from pathlib import Path
from typing import Any

from .common import Databases, Size, log, median
from .e2e import one_run

BEST = {"concurrency": 32, "claim_batch": 250, "prefetch": 250}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    """GET /metrics on ``port`` every ``every`` seconds while the run lasts (the hooks of
    :func:`bench.e2e.one_run`); counts the scrapes that succeeded."""

    def __init__(self, port: int, every: float = 1.0) -> None:
        self.port, self.every = port, every
        self.done = threading.Event()
        self.scrapes = 0
        self.bytes = 0
        self.thread: threading.Thread | None = None

    def started(self, pid: int) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def drained(self, pid: int) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(10)
        self._scrape()  # one at the end, so a short run has scraped at least once

    def _scrape(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            self.scrapes += 1
            self.bytes = len(body)
        except OSError:
            pass
        finally:
            conn.close()

    def _run(self) -> None:
        while not self.done.wait(self.every):
            self._scrape()


def run(dbs: Databases, size: Size, results: Path, best: dict[str, Any] | None = None,
        pairs: int | None = None) -> dict[str, Any]:
    settings = dict(best or BEST)
    without, with_, ratios = [], [], []
    for rep in range(pairs or max(3, size.runs)):
        off = one_run(dbs, size.metrics_events, settings, results, f"metrics-off-{rep}", cap=size.e2e_cap)
        port = free_port()
        scraper = Scraper(port)
        on = one_run(dbs, size.metrics_events, {**settings, "metrics_port": port, "metrics_interval": 1}, results,
                     f"metrics-on-{rep}", cap=size.e2e_cap, hooks=scraper)
        on["scrapes"], on["scrape_bytes"] = scraper.scrapes, scraper.bytes
        without.append(off)
        with_.append(on)
        ratios.append(1 - on["jobs_per_s"] / off["jobs_per_s"])
        log(f"metrics pair {rep}: {off['jobs_per_s']:,.0f} -> {on['jobs_per_s']:,.0f} jobs/s "
            f"({ratios[-1]:+.1%} cost), {scraper.scrapes} scrapes of {scraper.bytes} bytes")
    return {
        "settings": settings, "events": size.metrics_events,
        "without": [r["jobs_per_s"] for r in without], "with": [r["jobs_per_s"] for r in with_],
        "cost": median(ratios), "costs": ratios,
        "relay_cpu_us_per_job": {"without": median([r["relay_cpu_us_per_job"] or 0 for r in without]),
                                 "with": median([r["relay_cpu_us_per_job"] or 0 for r in with_])},
        "machine_busy": median([r["machine_busy"] for r in without + with_]),
    }
