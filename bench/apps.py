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


def forwarding() -> Outbox:
    """One forwarder, ``fwd``, of ``bench.event`` to the broker ``BENCH_FORWARD`` names
    (``jetstream``: ``BENCH_FORWARD_URL``, ``BENCH_FORWARD_SUBJECT``, ``BENCH_FORWARD_STREAM``;
    ``rabbitmq``: ``BENCH_FORWARD_URL``, ``BENCH_FORWARD_EXCHANGE``, ``BENCH_FORWARD_ROUTING_KEY``),
    for the forwarding scenario."""
    from outbox import JetStream, RabbitMQ

    kind, url = os.environ["BENCH_FORWARD"], os.environ["BENCH_FORWARD_URL"]
    ob = Outbox()
    if kind == "jetstream":
        sink: JetStream | RabbitMQ = JetStream(url, subject=os.environ["BENCH_FORWARD_SUBJECT"],
                                               stream=os.environ.get("BENCH_FORWARD_STREAM"))
    else:
        sink = RabbitMQ(url, exchange=os.environ["BENCH_FORWARD_EXCHANGE"],
                        routing_key=os.environ.get("BENCH_FORWARD_ROUTING_KEY", "{topic}"))
    ob.forward(TOPIC, to=sink, consumer="fwd")
    return ob
