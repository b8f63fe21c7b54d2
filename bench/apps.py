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
    pause = float(os.environ.get("BENCH_SLEEP", "0"))
    ob = Outbox()
    samples: list[tuple[int, str, float]] = []
    for i in range(1, consumers + 1):
        if record:
            def handler(job, _note=samples.append, _now=time.time) -> None:
                _note((job.event_id, job.consumer, _now()))
        elif pause:
            def handler(job, _sleep=time.sleep, _pause=pause) -> None:
                _sleep(_pause)
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
    ``rabbitmq``: ``BENCH_FORWARD_URL``, ``BENCH_FORWARD_EXCHANGE``, ``BENCH_FORWARD_ROUTING_KEY``;
    ``kafka``: ``BENCH_FORWARD_URL``, the bootstrap server, and ``BENCH_FORWARD_TOPIC``),
    for the forwarding scenario. When ``BENCH_RECORD`` names a file, every batch the relay
    hands the sink is noted as ``(messages, seconds in send_many)`` and the list written
    there as JSON when the process exits."""
    from outbox import JetStream, Kafka, RabbitMQ

    kind, url = os.environ["BENCH_FORWARD"], os.environ["BENCH_FORWARD_URL"]
    record = os.environ.get("BENCH_RECORD")
    batches: list[tuple[int, float]] = []
    base: type[JetStream] | type[RabbitMQ] | type[Kafka] = {"jetstream": JetStream, "kafka": Kafka}.get(kind, RabbitMQ)

    class Recording(base):  # type: ignore[valid-type,misc]
        async def send_many(self, messages, timeout, answered=None):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            results = await super().send_many(messages, timeout, answered)
            batches.append((len(messages), time.perf_counter() - start))
            return results

    cls = Recording if record else base
    if kind == "jetstream":
        sink = cls(url, subject=os.environ["BENCH_FORWARD_SUBJECT"], stream=os.environ.get("BENCH_FORWARD_STREAM"))
    elif kind == "kafka":
        sink = cls(url, topic=os.environ["BENCH_FORWARD_TOPIC"])
    else:
        sink = cls(url, exchange=os.environ["BENCH_FORWARD_EXCHANGE"],
                   routing_key=os.environ.get("BENCH_FORWARD_ROUTING_KEY", "{topic}"))
    ob = Outbox()
    ob.forward(TOPIC, to=sink, consumer="fwd")
    if record:
        def dump() -> None:
            with open(record, "w") as f:
                json.dump(batches, f)
        atexit.register(dump)
    return ob


def intake() -> Outbox:
    """The intake ``bench_in`` of the broker ``BENCH_INTAKE`` names (``jetstream``:
    ``BENCH_INTAKE_URL``, ``BENCH_INTAKE_STREAM``, ``BENCH_INTAKE_DURABLE``; ``rabbitmq``:
    ``BENCH_INTAKE_URL``, ``BENCH_INTAKE_QUEUE``), for the intake scenario, topic from the
    sender's header. When ``BENCH_RECORD`` names a file, a no-op subscriber ``h`` of
    ``bench.event`` notes ``(the sender's event id, time.time())`` at each start and the list
    is written there as JSON when the process exits; without it no subscriber is declared."""
    from outbox import JetStreamSource, RabbitMQSource

    kind, url = os.environ["BENCH_INTAKE"], os.environ["BENCH_INTAKE_URL"]
    source = (JetStreamSource(url, stream=os.environ["BENCH_INTAKE_STREAM"], durable=os.environ["BENCH_INTAKE_DURABLE"])
              if kind == "jetstream" else RabbitMQSource(url, queue=os.environ["BENCH_INTAKE_QUEUE"]))
    ob = Outbox()
    ob.intake("bench_in", source=source, max_backlog=None, batch=int(os.environ.get("BENCH_INTAKE_BATCH", "500")))
    record = os.environ.get("BENCH_RECORD")
    if record:
        samples: list[tuple[str, float]] = []

        def started(job, _note=samples.append, _now=time.time) -> None:  # type: ignore[no-untyped-def]
            _note((job.headers["Outbox-Event-Id"], _now()))

        ob.subscriber(TOPIC, consumer="h")(started)

        def dump() -> None:
            with open(record, "w") as f:
                json.dump(samples, f)
        atexit.register(dump)
    return ob
