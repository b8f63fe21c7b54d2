"""The peers' rows of the bench report (scenario 3): awa-pg's drain, its sweep and the ratio
outbox end to end / awa-pg best drain judged against issue 14's target (>= 2.5x), beside
PgQueuer's (>= 2x with current statistics, issue 33); results written before awa-pg joined the peers still report."""

from __future__ import annotations

from typing import Any

from bench.report import rows


def results(awa: bool) -> dict[str, Any]:
    peers: dict[str, Any] = {
        "versions": {"pgqueuer": "1.6.0", "procrastinate": "3.10.0", "awa-pg": "0.6.9"}, "jobs": 150_000,
        "pgqueuer": {"jobs_per_s": 4_000.0, "driver": "apg", "batch": 200, "dequeue": 5},
        "procrastinate": {"jobs_per_s": 250.0, "capped": True, "cap_seconds": 10.0},
    }
    if awa:
        sweep = [{"workers": w, "claim_batch": b, "jobs": 18_000, "jobs_per_s": r, "capped": False}
                 for w, b, r in ((64, 64, 900.0), (256, 512, 3_000.0))]
        peers["awa"] = {"jobs_per_s": 3_000.0, "jobs_per_s_with_enqueue": 2_700.0, "workers": 256,
                        "claim_batch": 512, "pool": 20, "capped": False, "cap_seconds": 300.0, "sweep": sweep}
    best = {"jobs_per_s": 9_000.0, "settings": {"concurrency": 32}, "relay_cpu_us_per_job": 30.0,
            "db_cpu_us_per_job": 100.0, "machine_busy": 0.9, "runs": [{}]}
    e2e = {"events": 50_000, "default": {"jobs_per_s": 5_000.0, "runs": [{"events": 6_000}]}, "best": best,
           "sweep": [{"settings": {"concurrency": 32}, "jobs_per_s": 9_000.0, "events": 6_000}]}
    return {"peers": peers, "e2e": e2e, "sizes": {"e2e_cap": 40.0}}


def by_measure(data: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {measure: (result, target, met) for _, measure, result, target, met in rows(data)}


def test_awa_rows_report_both_clocks_the_sweep_and_the_target() -> None:
    found = by_measure(results(awa=True))
    drain = next(v for k, v in found.items() if k.startswith("awa-pg 0.6.9 drain, 150,000 jobs"))
    assert drain[0] == "3,000 jobs/s (2,700 with the enqueue inside the clock)"
    sweep = next(v for k, v in found.items() if k.startswith("awa-pg sweep"))
    assert sweep[0] == "64/64: 900 / 256/512: 3,000"
    assert found["outbox end to end (best) / awa-pg best drain"] == ("3.00x", ">= 2.5x", "**yes**")
    assert found["outbox end to end (best) / PgQueuer best"] == ("2.25x", ">= 2x with current statistics (issue 33)",
                                                                 "**yes**")


def test_results_without_awa_still_report() -> None:
    found = by_measure(results(awa=False))
    assert not any("awa" in k for k in found)
    assert found["outbox end to end (best) / PgQueuer best"][1] == ">= 2x with current statistics (issue 33)"
