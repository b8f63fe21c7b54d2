"""The demo application: orders, invoices, a sent-email ledger, CRM contacts, and three
consumers of ``order.placed`` (seed article 002, "The migration" and "One event, many
consumers"), and forwarders of it to NATS JetStream and to Kafka when the demo runs with them.
Relays run it as ``outbox-relay run --app outbox.demo.app:ob`` (three consumers) or
``--app outbox.demo.app:with_forwarder`` (four or five).

Consumers and the guarantee each one shows:

* ``send_receipt`` (lease mode, 5 attempts): "sends" the receipt by writing the sent-email
  ledger keyed by ``job.idempotency_key``. Delivery is at-least-once: a worker paused or
  killed after sending but before its completion was recorded sends again on the next
  attempt, and the ledger absorbs it (``deliveries`` goes up, one receipt stays). It does
  not call ``job.check_lease()`` on purpose, as a mailer cannot take an email back. A
  deterministic share of attempts (``OUTBOX_DEMO_FAIL_SHARE``, by hash of job id and
  attempt, never the last attempt) raise a transient error and are retried.
* ``create_invoice`` (transactional): reads the order total and writes the invoice with
  :func:`outbox.fenced_write` at ``job.fence``, in the transaction that completes the job.
  A share of runs (``OUTBOX_DEMO_SLOW_SHARE``) wait ``OUTBOX_DEMO_SLOW_MS`` inside that
  transaction before writing, so a paused relay is likely to hold one; when it wakes after
  another worker re-claimed the job and wrote the invoice, its write is refused and
  recorded in ``demo_stale_writes`` (on a separate autocommit connection, since its own
  transaction rolls back).
* ``sync_crm`` (lease mode, 3 attempts): upserts the customer's CRM contact, idempotently
  (``last_order_id = GREATEST(...)``). Customer ``mallory`` (``OUTBOX_DEMO_FAILING_CUSTOMER``)
  is always refused, so those jobs end dead after 3 attempts with the CRM's message as
  ``last_error``.

* ``forward_to_nats`` (a forwarder, only when ``outbox-relay demo`` found a NATS server):
  sends each ``order.placed`` to the run's JetStream stream (``OUTBOX_DEMO_NATS_STREAM``,
  subject ``<stream>.order.placed``, ``Nats-Msg-Id`` = the job's idempotency key). A job is
  done once JetStream acknowledged it; a re-send after a kill or a pause is dropped by the
  stream's duplicate window, so it holds one message per committed order. It is declared
  only by :func:`with_forwarder`, so ``ob`` and this module import without nats-py.
* ``forward_to_kafka`` (a forwarder, only when ``outbox-relay demo`` could start its
  Kafka-protocol test broker, :mod:`outbox.demo.kafka`): sends each ``order.placed`` to the
  run's topic (``OUTBOX_DEMO_KAFKA_TOPIC``, keyed by the event's key). Kafka's idempotent
  producer drops re-sends within one relay's session only, so after a kill or a pause a
  record may be stored twice (same ``Outbox-Event-Id``): the topic holds every committed
  order at least once.

Every handler start is written to ``demo_handler_runs`` (autocommit, database clock), so
the demo can measure commit-to-handler latency and count attempts. Handlers take
``OUTBOX_DEMO_WORK_MS`` milliseconds on average, so pauses and kills hit jobs in flight.

Settings (:class:`DemoSettings`, ``OUTBOX_DEMO_*``) and the side engine are built on first
use, never at import time.
"""

from __future__ import annotations

import os
import random
import threading
import zlib
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Engine,
    Identity,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from outbox import JetStream, Job, Kafka, Outbox, fenced_write
from outbox.db.engine import make_engine
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

TOPIC = "order.placed"
#: The consumer name of the demo's forwarder to NATS JetStream.
FORWARDER = "forward_to_nats"
#: The consumer name of the demo's forwarder to Kafka.
KAFKA_FORWARDER = "forward_to_kafka"

# ------------------------------------------------------------------------ tables

demo_metadata = MetaData()

orders = Table(
    "demo_orders",
    demo_metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("customer", Text, nullable=False),
    Column("total_cents", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

invoices = Table(
    "demo_invoices",
    demo_metadata,
    Column("order_id", BigInteger, primary_key=True, autoincrement=False),
    Column("total_cents", Integer, nullable=False),
    # Written only through outbox.fenced_write: the fence of the claim that wrote the row.
    Column("fence", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
)

sent_emails = Table(
    "demo_sent_emails",
    demo_metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("order_id", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("worker_pid", Integer, nullable=False),
    Column("sent_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # 1 for the first send; every redelivery absorbed by the idempotency key adds one.
    Column("deliveries", Integer, nullable=False, server_default=text("1")),
    Column("last_delivered_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
)

crm_contacts = Table(
    "demo_crm_contacts",
    demo_metadata,
    Column("customer", Text, primary_key=True),
    Column("last_order_id", BigInteger, nullable=False),
    Column("synced_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("syncs", Integer, nullable=False, server_default=text("1")),
)

handler_runs = Table(
    "demo_handler_runs",
    demo_metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("consumer", Text, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("event_id", BigInteger, nullable=False),
    Column("order_id", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("worker_pid", Integer, nullable=False),
    Column("slow", Boolean, nullable=False, server_default=text("false")),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("event_created_at", DateTime(timezone=True), nullable=True),
)

stale_writes = Table(
    "demo_stale_writes",
    demo_metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("consumer", Text, nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("order_id", BigInteger, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("stored_fence", BigInteger, nullable=True),
    Column("worker_pid", Integer, nullable=False),
    Column("rejected_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
)


# ---------------------------------------------------------------------- settings


class DemoSettings(BaseSettings):
    """How the demo's handlers behave; environment variables ``OUTBOX_DEMO_<FIELD>``.
    ``outbox-relay demo`` sets them for the relays it starts."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_DEMO_", extra="ignore")

    work_ms: float = Field(default=10.0, ge=0, le=60_000,
                           description="Mean time a handler works, milliseconds (uniform 0.5x..1.5x). Default 10.")
    fail_share: float = Field(default=0.1, ge=0, le=1,
                              description="Share of send_receipt attempts that fail transiently. Default 0.1.")
    slow_share: float = Field(default=0.1, ge=0, le=1,
                              description="Share of create_invoice runs that wait inside their transaction. Default 0.1.")
    slow_ms: float = Field(default=250.0, ge=0, le=600_000,
                           description="How long a slow create_invoice run waits, milliseconds. Default 250.")
    failing_customer: str = Field(default="mallory", description="Customer the CRM always refuses. Default mallory.")
    nats_url: str = Field(default="nats://127.0.0.1:4222",
                          description="NATS server the demo forwards order.placed to. Default nats://127.0.0.1:4222.")
    nats_stream: str | None = Field(default=None,
                                    description="The run's JetStream stream, set by outbox-relay demo for its relays; "
                                                "None (default): no forwarder.")
    kafka_bootstrap: str | None = Field(default=None,
                                        description="The run's Kafka broker (host:port), set by outbox-relay demo for its "
                                                    "relays; None (default): no Kafka forwarder.")
    kafka_topic: str | None = Field(default=None,
                                    description="The run's Kafka topic, set by outbox-relay demo with kafka_bootstrap.")


class MailerUnavailable(Exception):
    """The (simulated) mail server asked us to try again later."""


class CrmRejected(Exception):
    """The (simulated) CRM refused the contact; retrying never helps."""


_lock = threading.Lock()
_state: dict[str, Any] = {}


def demo_settings() -> DemoSettings:
    """The handlers' settings, read from the environment on first use."""
    with _lock:
        if "settings" not in _state:
            _state["settings"] = DemoSettings()
        settings: DemoSettings = _state["settings"]
        return settings


def side_engine() -> Engine:
    """An autocommit engine on ``OUTBOX_DATABASE_URL`` for writes that must survive the
    handler's own transaction (ledger, handler runs, stale-write records). Raises
    :class:`~outbox.errors.ConfigurationError` when no database is configured."""
    with _lock:
        if "engine" not in _state:
            url = OutboxSettings().url()
            if url is None:
                raise ConfigurationError("the demo app needs OUTBOX_DATABASE_URL")
            engine = make_engine(url, pool_size=4, application_name="outbox-demo-app")
            _state["engine"] = engine.execution_options(isolation_level="AUTOCOMMIT")
        side: Engine = _state["engine"]
        return side


def _record_start(job: Job, slow: bool = False) -> None:
    with side_engine().connect() as conn:
        conn.execute(handler_runs.insert().values(
            consumer=job.consumer, job_id=job.id, event_id=job.event_id, order_id=job.payload["order_id"],
            attempt=job.attempt, fence=job.fence, worker_pid=os.getpid(), slow=slow,
            event_created_at=job.event_created_at))


def _work(job: Job, extra_ms: float = 0.0) -> None:
    """Pretend to work for about ``work_ms`` (+ ``extra_ms``) milliseconds; wakes early if
    the lease is lost."""
    mean = demo_settings().work_ms
    job.wait_lease_lost((random.uniform(0.5 * mean, 1.5 * mean) + extra_ms) / 1000.0)


def _share(job: Job, salt: str, share: float) -> bool:
    """Deterministic coin: True for about ``share`` of (job, attempt) pairs."""
    return zlib.crc32(f"{salt}:{job.id}:{job.attempt}".encode()) % 10_000 < share * 10_000


# --------------------------------------------------------------------- consumers

def send_receipt(job: Job) -> None:
    """Send the receipt once per idempotency key; transient mailer errors are retried."""
    _record_start(job)
    _work(job)
    if job.attempt < job.max_attempts and _share(job, "mailer", demo_settings().fail_share):
        raise MailerUnavailable(f"451 4.3.0 mail server busy, try again later (order {job.payload['order_id']})")
    insert = pg_insert(sent_emails).values(
        idempotency_key=job.idempotency_key, order_id=job.payload["order_id"], attempt=job.attempt,
        worker_pid=os.getpid())
    statement = insert.on_conflict_do_update(
        index_elements=[sent_emails.c.idempotency_key],
        set_={"deliveries": sent_emails.c.deliveries + 1, "last_delivered_at": text("clock_timestamp()")},
    )
    with side_engine().connect() as conn:
        conn.execute(statement)


def create_invoice(job: Job, session: Session) -> None:
    """Write the order's invoice exactly once, guarded by the job's fence."""
    settings = demo_settings()
    order_id = job.payload["order_id"]
    slow = _share(job, "slow", settings.slow_share)
    _record_start(job, slow)
    total = session.execute(select(orders.c.total_cents).where(orders.c.id == order_id)).scalar_one()
    _work(job, settings.slow_ms if slow else 0.0)  # inside the open transaction
    if not fenced_write(session, invoices, key={"order_id": order_id}, values={"total_cents": total},
                        fence=job.fence):
        stored = session.execute(select(invoices.c.fence).where(invoices.c.order_id == order_id)).scalar()
        with side_engine().connect() as conn:
            conn.execute(stale_writes.insert().values(
                consumer=job.consumer, job_id=job.id, order_id=order_id, fence=job.fence,
                stored_fence=stored, worker_pid=os.getpid()))
        # Returning is enough: the fenced completion that follows matches no row (a newer
        # claim owns the job), so this transaction rolls back and the report is dropped.


def sync_crm(job: Job) -> None:
    """Upsert the customer's CRM contact; the failing customer is always refused."""
    _record_start(job)
    _work(job)
    customer = job.payload["customer"]
    if customer == demo_settings().failing_customer:
        raise CrmRejected(f"CRM 422: contact {customer!r} is flagged for fraud review, sync refused")
    insert = pg_insert(crm_contacts).values(customer=customer, last_order_id=job.payload["order_id"])
    statement = insert.on_conflict_do_update(
        index_elements=[crm_contacts.c.customer],
        set_={
            "last_order_id": func.greatest(crm_contacts.c.last_order_id, insert.excluded.last_order_id),
            "synced_at": text("clock_timestamp()"),
            "syncs": crm_contacts.c.syncs + 1,
        },
    )
    with side_engine().connect() as conn:
        conn.execute(statement)


# ---------------------------------------------------------------------- registries


def build_registry(forward_to: JetStream | None = None, kafka: Kafka | None = None) -> Outbox:
    """A registry of the three handlers above, plus the forwarder ``forward_to_nats`` of
    ``order.placed`` to ``forward_to`` and ``forward_to_kafka`` to ``kafka``, each when given."""
    registry = Outbox()
    registry.subscriber(TOPIC, consumer="send_receipt", max_attempts=5)(send_receipt)
    registry.subscriber(TOPIC, consumer="create_invoice", transactional=True)(create_invoice)
    registry.subscriber(TOPIC, consumer="sync_crm", max_attempts=3)(sync_crm)
    if forward_to is not None:
        registry.forward(TOPIC, to=forward_to, consumer=FORWARDER)
    if kafka is not None:
        registry.forward(TOPIC, to=kafka, consumer=KAFKA_FORWARDER)
    return registry


#: The demo's three consumers; imports and runs without NATS.
ob = build_registry()


def with_forwarder() -> Outbox:
    """The registry relays run when the demo forwards (``--app
    outbox.demo.app:with_forwarder``): :data:`ob`'s consumers plus ``forward_to_nats``, to
    ``OUTBOX_DEMO_NATS_URL``, subject ``<stream>.{topic}`` of stream
    ``OUTBOX_DEMO_NATS_STREAM``, when that is set, and ``forward_to_kafka``, to topic
    ``OUTBOX_DEMO_KAFKA_TOPIC`` on ``OUTBOX_DEMO_KAFKA_BOOTSTRAP``, when those are. Raises
    :class:`~outbox.errors.ConfigurationError` when neither is set, or when the client
    library of one that is is not installed."""
    settings = demo_settings()
    if not settings.nats_stream and not (settings.kafka_bootstrap and settings.kafka_topic):
        raise ConfigurationError("with_forwarder needs OUTBOX_DEMO_NATS_STREAM or OUTBOX_DEMO_KAFKA_BOOTSTRAP and "
                                 "OUTBOX_DEMO_KAFKA_TOPIC (outbox-relay demo sets them)")
    stream = (JetStream(settings.nats_url, subject=f"{settings.nats_stream}.{{topic}}", stream=settings.nats_stream)
              if settings.nats_stream else None)
    kafka = (Kafka(settings.kafka_bootstrap, topic=settings.kafka_topic)
             if settings.kafka_bootstrap and settings.kafka_topic else None)
    return build_registry(stream, kafka)
