"""The application of the forwarding crash tests (``--app tests.acceptance.forward_app:app``):
one forwarder, consumer ``fwd`` of topic ``fa.order``, whose sink is a subclass of the real
one that can kill its own process right after the broker acknowledged a batch and before the
relay wrote any of that batch's completions: the crash window forwarding must survive.

Configured by the relay's environment, read when the relay calls :func:`app` (nothing is
read at import time):

* ``FA_SINK``: ``jetstream`` (with ``FA_STREAM``, the stream whose subjects are
  ``<FA_STREAM>.>``), ``rabbitmq`` (with ``FA_EXCHANGE``, a topic exchange) or ``kafka``
  (with ``FA_KAFKA_BOOTSTRAP`` and ``FA_KAFKA_TOPIC``, the one topic every record goes to);
* ``FA_KILL_AT``: the number of the batch (1, 2, ...) after whose acknowledgement the process
  SIGKILLs itself; unset, it never does. Only a batch the broker acknowledged at least one
  message of counts;
* ``FA_KILL_RECORD``: a file the idempotency keys of that last batch are written to (one a
  line, flushed to disk) just before the kill, so the test knows which messages the broker
  stored without their jobs completing;
* ``FA_TIMEOUT``: the forwarder's ``timeout``, seconds (default 10);
* ``FA_MAX_PENDING``: JetStream's ``max_pending`` (default the sink's).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

from outbox import JetStream, Kafka, Outbox, RabbitMQ
from outbox.sinks import Delivered, Message, SendResult

if TYPE_CHECKING:
    from outbox.sinks import Answered

TOPIC = "fa.order"
CONSUMER = "fwd"

_acknowledged_batches = 0


def _after_acks(messages: Sequence[Message], results: Sequence[SendResult]) -> None:
    """Count a batch the broker acknowledged; at batch ``FA_KILL_AT``, record it and die."""
    global _acknowledged_batches
    if not any(isinstance(r, Delivered) for r in results):
        return
    _acknowledged_batches += 1
    kill_at = os.environ.get("FA_KILL_AT")
    if not kill_at or _acknowledged_batches < int(kill_at):
        return
    record = os.environ.get("FA_KILL_RECORD")
    if record:
        with open(record, "w") as f:
            f.writelines(m.idempotency_key + "\n" for m, r in zip(messages, results) if isinstance(r, Delivered))
            f.flush()
            os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _passed_on(answered: Answered | None) -> Answered | None:
    """The relay's ``answered`` for the real sink: none while a kill is set up, so no
    completion of the batch the process dies after can have been posted before the kill."""
    return None if os.environ.get("FA_KILL_AT") else answered


class Crashing:
    """Mixed in before a real sink: the process may die between the broker's acknowledgements
    and the completions (:func:`_after_acks`)."""

    async def send_many(self, messages: Sequence[Message], timeout: float,
                        answered: Answered | None = None) -> list[SendResult]:
        real = super()
        passed = _passed_on(answered)
        results: list[SendResult] = await (real.send_many(messages, timeout) if passed is None  # type: ignore[misc]
                                           else real.send_many(messages, timeout, passed))  # type: ignore[misc]
        _after_acks(messages, results)
        return results


class CrashingJetStream(Crashing, JetStream):
    """JetStream, but the process may die between the PubAcks and the completions."""


class CrashingRabbitMQ(Crashing, RabbitMQ):
    """RabbitMQ, but the process may die between the publisher confirms and the completions."""


class CrashingKafka(Crashing, Kafka):
    """Kafka, but the process may die between the acknowledgements and the completions."""


def app() -> Outbox:
    """The registry: the forwarder ``fwd`` on the sink ``FA_SINK`` names."""
    ob = Outbox()
    kind = os.environ["FA_SINK"]
    if kind == "jetstream":
        stream = os.environ["FA_STREAM"]
        pending = {"max_pending": int(os.environ["FA_MAX_PENDING"])} if os.environ.get("FA_MAX_PENDING") else {}
        sink: JetStream | RabbitMQ | Kafka = CrashingJetStream(os.environ["FA_NATS_URL"], subject=stream + ".{topic}",
                                                       stream=stream, **pending)
    elif kind == "rabbitmq":
        sink = CrashingRabbitMQ(os.environ["FA_AMQP_URL"], exchange=os.environ["FA_EXCHANGE"])
    elif kind == "kafka":
        sink = CrashingKafka(os.environ["FA_KAFKA_BOOTSTRAP"], topic=os.environ["FA_KAFKA_TOPIC"])
    else:
        raise ValueError(f"FA_SINK must be jetstream, rabbitmq or kafka, got {kind!r}")
    ob.forward(TOPIC, to=sink, consumer=CONSUMER, max_attempts=5, timeout=float(os.environ.get("FA_TIMEOUT", "10")))
    return ob
