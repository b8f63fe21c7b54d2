"""outbox: PostgreSQL as a transactional outbox, fan-out router and fenced job runner.

Public API::

    from outbox import Outbox, Job, publish, publish_many, fenced_write, PermanentError

    ob = Outbox()

    @ob.subscriber("order.placed", consumer="send_receipt", max_attempts=5)
    def send_receipt(job: Job) -> None: ...          # lease mode, outside any transaction

    @ob.subscriber("order.placed", consumer="create_invoice", transactional=True)
    def create_invoice(job: Job, session: Session) -> None: ...   # exactly-once effects

    with Session(engine) as s, s.begin():
        publish(s, "order.placed", {"order_id": 4}, key="order:4")

``outbox-relay --app myapp.jobs:ob`` runs the router, the workers and the reaper, and the
registry's intakes: ``ob.intake("orders", source=JetStreamSource(...))`` takes another
service's messages in as events, each once (:mod:`outbox.intake`).

Guarantees:

* Transactional publish: an event exists if and only if the transaction (or SAVEPOINT)
  that published it commits. Bad input raises ``InvalidEventError`` naming the field
  before anything is written.
* Exactly-once routing: each committed event becomes one job per consumer subscribed when
  it is routed, however many relays run; ids that commit out of order are handled.
* At-least-once delivery: a job runs until a worker reports it done, or it is
  dead-lettered after ``max_attempts`` (at once on ``PermanentError``). A crash, a kill or
  a pause past the lease runs it again, so lease-mode handlers must be idempotent and give
  ``job.idempotency_key`` (stable across retries) to external systems.
* Attempts count starts, not claims: a relay killed with jobs in its prefetch buffer costs
  those jobs no attempt; a job running in a process that dies is charged one.
* Fencing: every claim takes a new fence from one global sequence; every statement that
  changes a claimed job checks the fence and ``status = 'running'``, so a stale worker's
  heartbeat, completion, failure or release changes nothing (``job.lease_lost`` says so).
* Exactly-once effects inside PostgreSQL: a transactional handler's writes commit in the
  transaction of the fenced completion and roll back if another worker took the job over;
  ``fenced_write`` keeps a paused worker from overwriting a newer writer's row.
* One bad row never stalls the relay: a batch statement that fails for some rows runs
  again by halves, and only the rows that fail alone are dead-lettered.
* Time (leases, run_at, retention) comes from the database clock only.

Documentation: the design notes cited by name in docstrings ("architecture notes",
"forwarding notes", "performance notes", "reliability notes", with a section name) are the
documents ``architecture.md``, ``forwarding.md``, ``performance.md`` (the levers and the
measurements of each round are in its history page, which it links) and ``reliability.md``
that ship with the package, beside one page per topic (publishing, consumers, ordering,
flow control, schedules, operations, configuration, ...), in the folder :func:`docs_dir`
returns (``outbox/docs`` of an installed package).
"""

from outbox.errors import (
    ConfigurationError,
    DatabaseStatementError,
    DatabaseUnavailableError,
    ForwardingError,
    HandlerMisuseError,
    HandlerTimeoutError,
    InvalidEventError,
    LeaseLostError,
    OutboxError,
    PermanentError,
    SchemaNotReadyError,
    Snooze,
    StaleFenceError,
    TransactionEndedError,
    UndeliverableError,
)
from outbox.fencing import fenced_write
from outbox.hooks import JobFailure
from outbox.intake import Received, body_hash
from outbox.intake.jetstream import JetStreamSource
from outbox.intake.kafka import KafkaSource
from outbox.intake.rabbitmq import RabbitMQSource
from outbox.intake.webhooks import Webhook
from outbox.job import Job
from outbox.publish import publish, publish_many
from outbox.registry import Outbox, Subscriber
from outbox.resources import docs_dir
from outbox.retry import Backoff
from outbox.settings import OutboxSettings
from outbox.sinks import Sink
from outbox.sinks.jetstream import JetStream
from outbox.sinks.kafka import Kafka
from outbox.sinks.rabbitmq import RabbitMQ

__all__ = [
    "Backoff",
    "ConfigurationError",
    "DatabaseStatementError",
    "DatabaseUnavailableError",
    "ForwardingError",
    "HandlerMisuseError",
    "HandlerTimeoutError",
    "InvalidEventError",
    "JetStream",
    "JetStreamSource",
    "Job",
    "JobFailure",
    "Kafka",
    "KafkaSource",
    "LeaseLostError",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "PermanentError",
    "RabbitMQ",
    "RabbitMQSource",
    "Received",
    "SchemaNotReadyError",
    "Sink",
    "Snooze",
    "StaleFenceError",
    "TransactionEndedError",
    "Subscriber",
    "UndeliverableError",
    "Webhook",
    "body_hash",
    "docs_dir",
    "fenced_write",
    "publish",
    "publish_many",
]
