"""outbox: PostgreSQL as a transactional outbox, fan-out router and fenced job runner.

Public API::

    from outbox import Outbox, Job, publish, publish_many, fenced_write, PermanentError

See ``docs/architecture.md`` for the guarantees.
"""

from .errors import (
    ConfigurationError,
    DatabaseStatementError,
    DatabaseUnavailableError,
    InvalidEventError,
    LeaseLostError,
    OutboxError,
    PermanentError,
    SchemaNotReadyError,
    StaleFenceError,
)
from .fencing import fenced_write
from .job import Job
from .publish import publish, publish_many
from .registry import Outbox, Subscriber
from .settings import OutboxSettings

__all__ = [
    "ConfigurationError",
    "DatabaseStatementError",
    "DatabaseUnavailableError",
    "InvalidEventError",
    "Job",
    "LeaseLostError",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "PermanentError",
    "SchemaNotReadyError",
    "StaleFenceError",
    "Subscriber",
    "fenced_write",
    "publish",
    "publish_many",
]
