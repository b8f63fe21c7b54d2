"""The registry benchmark relays run: ``outbox-relay --app bench.apps:fanout``.

``fanout()`` declares ``BENCH_CONSUMERS`` (default 3) lease-mode consumers ``c1..cK`` of
the topic ``bench.event`` with no-op handlers, ordered per key when ``BENCH_ORDERED=1``. When ``BENCH_RECORD`` names a file, each
handler notes ``(event_id, consumer, time.time())`` at its start and the list is written
there as JSON when the process exits (the relay exits normally on SIGTERM), for the
latency scenario.
"""

from __future__ import annotations

import atexit
import json
import os
import time

from outbox import Outbox

from .common import TOPIC


def fanout() -> Outbox:
    consumers = int(os.environ.get("BENCH_CONSUMERS", "3"))
    record = os.environ.get("BENCH_RECORD")
    ordered = os.environ.get("BENCH_ORDERED") == "1"
    ob = Outbox()
    samples: list[tuple[int, str, float]] = []
    for i in range(1, consumers + 1):
        if record:
            def handler(job, _note=samples.append, _now=time.time) -> None:
                _note((job.event_id, job.consumer, _now()))
        else:
            def handler(job) -> None:
                return None
        ob.subscriber(TOPIC, consumer=f"c{i}", ordered=ordered)(handler)
    if record:
        def dump() -> None:
            with open(record, "w") as f:
                json.dump(samples, f)
        atexit.register(dump)
    return ob
