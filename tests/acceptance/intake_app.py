"""The application of the intake crash tests (``--app tests.acceptance.intake_app:app``): one
intake ``orders`` from a real broker and the counting transactional subscriber of
:mod:`tests.integration.intake_helpers` (one run per order in ``intake_effects``).

Configured by the relay's environment, read when the relay calls :func:`app`:

* ``IA_SOURCE``: ``jetstream`` (with ``IA_NATS_URL``, ``IA_STREAM``, ``IA_DURABLE`` and
  ``IA_ACK_WAIT`` seconds) or ``rabbitmq`` (with ``IA_AMQP_URL``, ``IA_QUEUE`` and
  ``IA_PREFETCH``); ``IA_BATCH``: the intake's batch;
* ``INTAKE_FAULT`` and ``INTAKE_FAULT_AT`` (n): where the process SIGKILLs itself, on the
  n-th call (1, 2, ...) of the step named; unset, it never does:

  - ``after_commit``: the source class's ``ack`` (``JetStreamSource.ack``,
    ``RabbitMQSource.ack``) is wrapped to die before acknowledging: the relay calls it only
    once the batch's transaction committed, so the process dies with the batch committed
    and the broker never told;
  - ``before_commit``: ``outbox.relay.intake.take_in`` (the name the intake loop calls,
    inside ``with engine.begin()``) is wrapped to run the real one and die before returning:
    the batch's statements ran, its transaction is open and dies with the connection;

* ``INTAKE_FAULT_RECORD``: a file the identities of the batch the process dies on are
  written to (one a line, flushed to disk) just before the kill.

These are the user's code loaded by ``--app``; nothing in the product is changed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from typing import Any

from outbox import Outbox
from outbox.db.engine import make_engine
from tests.integration.intake_helpers import counting_subscriber

INTAKE = "orders"

_calls = 0


def _nth_call(identities: Callable[[], Iterable[str]]) -> None:
    """Count a call of the faulted step; on call ``INTAKE_FAULT_AT``, record the batch and die."""
    global _calls
    _calls += 1
    if _calls < int(os.environ["INTAKE_FAULT_AT"]):
        return
    record = os.environ.get("INTAKE_FAULT_RECORD")
    if record:
        with open(record, "w") as f:
            f.writelines(i + "\n" for i in identities())
            f.flush()
            os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _die_before_ack(source_class: type) -> None:
    real = source_class.ack

    async def ack(self: Any, received: Any) -> None:
        _nth_call(lambda: [m.headers.get("Outbox-Idempotency-Key") or m.message_id for m in received])
        await real(self, received)

    source_class.ack = ack  # type: ignore[attr-defined]


def _die_before_commit() -> None:
    import outbox.relay.intake as loop  # noqa: PLC0415 (patched only when asked)

    real = loop.take_in

    def take_in(conn: Any, source: str, arrivals: Any, **kwargs: Any) -> Any:
        taken = real(conn, source, arrivals, **kwargs)
        _nth_call(lambda: [a.identity for a in arrivals])
        return taken

    loop.take_in = take_in  # type: ignore[assignment]


def app() -> Outbox:
    """The registry: intake ``orders`` from ``IA_SOURCE``, subscriber ``book``; the fault asked for."""
    kind = os.environ["IA_SOURCE"]
    if kind == "jetstream":
        from outbox.intake.jetstream import JetStreamSource  # noqa: PLC0415

        source: Any = JetStreamSource(os.environ["IA_NATS_URL"], stream=os.environ["IA_STREAM"],
                                      durable=os.environ["IA_DURABLE"], ack_wait=float(os.environ["IA_ACK_WAIT"]))
    elif kind == "rabbitmq":
        from outbox.intake.rabbitmq import RabbitMQSource  # noqa: PLC0415

        source = RabbitMQSource(os.environ["IA_AMQP_URL"], queue=os.environ["IA_QUEUE"],
                                prefetch=int(os.environ["IA_PREFETCH"]))
    else:
        raise ValueError(f"IA_SOURCE must be jetstream or rabbitmq, got {kind!r}")
    fault = os.environ.get("INTAKE_FAULT")
    if fault == "after_commit":
        _die_before_ack(type(source))
    elif fault == "before_commit":
        _die_before_commit()
    elif fault:
        raise ValueError(f"INTAKE_FAULT must be after_commit or before_commit, got {fault!r}")
    ob = Outbox()
    ob.intake(INTAKE, source=source, batch=int(os.environ["IA_BATCH"]))
    engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=1)
    try:
        counting_subscriber(ob, engine)  # creates intake_effects if missing
    finally:
        engine.dispose()
    return ob
