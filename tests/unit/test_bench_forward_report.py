"""The forwarding scenario's place in the bench: ``--only forward`` is accepted, and its
figures become report rows that compare against issue 11's targets."""

from __future__ import annotations

from typing import Any

from bench.__main__ import parse
from bench.report import forward_rows


def broker(ratio: float, p50: float, p99: float, publish_async: bool) -> dict[str, Any]:
    raw = {"window": {"messages_per_s": 9000.0}, "serial": {"messages_per_s": 3000.0}}
    if publish_async:
        raw["publish_async"] = {"messages_per_s": 20000.0}
    run = {"relay_cpu_us_per_event": 200.0, "db_cpu_us_per_event": 90.0, "machine_busy": 0.9, "batch_mean": 240.0,
           "send_seconds": 6.0, "seconds": 6.5}
    return {"events": 20000, "settings": None, "forwarded_events_per_s": 3000.0, "defaults_events_per_s": 3000.0,
            "raw": raw, "raw_limit_mode": "publish_async" if publish_async else "window", "raw_limit": 20000.0,
            "sink_alone": {"messages_per_s": 4000.0, "batch": 500}, "ratio": ratio, "forwarded": [run],
            "latency": {"rate": 200.0, "events": 4000, "p50_ms": p50, "p99_ms": p99, "db_p50_ms": 6.0,
                        "db_p99_ms": 28.0}}


def test_forward_is_a_scenario() -> None:
    assert parse(["--only", "forward"]).scenarios == ["forward"]
    assert parse(["--only", "9"]).scenarios == ["forward"]


def test_forward_rows_judge_the_targets_and_name_skipped_brokers() -> None:
    rows = forward_rows({"raw_window": 500, "skipped": {"rabbitmq": "aio-pika is not installed"},
                         "jetstream": broker(0.11, 4.4, 19.0, publish_async=True)})
    by_measure = {measure: (result, target, met) for _, measure, result, target, met in rows}
    ratio = next(v for k, v in by_measure.items() if k.startswith("JetStream: forwarded / raw client limit"))
    assert ratio == ("11%", ">= 70 %", "**no**")
    latency = next(v for k, v in by_measure.items() if k.startswith("JetStream: commit -> message"))
    assert latency[0].startswith("4.4 / 19.0 ms") and latency[2] == "**yes**"
    raw = next(v for k, v in by_measure.items() if k.startswith("JetStream: raw client"))
    assert "publish_async: 20,000" in raw[0] and "window 500: 9,000" in raw[0]
    assert ("rabbitmq", "skipped: aio-pika is not installed") in [(m, r) for _, m, r, _, _ in rows]
    late = forward_rows({"raw_window": 500, "skipped": {}, "rabbitmq": broker(0.72, 23.2, 534.0, publish_async=False)})
    met = {m.split(":")[1].split(",")[0].strip(): ok for _, m, _, _, ok in late if ok}
    assert met == {"forwarded / raw client limit (window)": "**yes**", "commit -> message at a consumer": "**no**"}
