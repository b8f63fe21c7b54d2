"""The application of the steady-load fault tests (``--app tests.acceptance.steady_app:app``):
one lease-mode consumer, ``steady``, of topic ``steady.tick``, whose handler does nothing
by default. The relay's environment tunes it: ``STEADY_WORK_MS`` (milliseconds the handler
sleeps, as work, default 0) and ``STEADY_LEDGER=1`` (the handler notes each run that
finished in table ``steady_runs``: job id, fence, relay pid, database clock, on an
autocommit connection of its own, as its last step; a job that has a row there for one
fence and another for a higher one was run again after its handler had finished). Nothing
is read at import time.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import Job, Outbox
from outbox.db.engine import make_engine

TOPIC = "steady.tick"
CONSUMER = "steady"

metadata = sa.MetaData()
runs = sa.Table(
    "steady_runs", metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
)

_engine: Engine | None = None


def create_tables(engine: Engine) -> None:
    metadata.create_all(engine)


def _ledger() -> Engine:
    global _engine
    if _engine is None:
        _engine = make_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=8, application_name="test-app")
    return _engine


def tick(job: Job) -> None:
    time.sleep(float(os.environ.get("STEADY_WORK_MS", "0")) / 1000)
    if os.environ.get("STEADY_LEDGER") == "1":
        with _ledger().connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(runs.insert().values(job_id=job.id, fence=job.fence, pid=os.getpid()))


def app() -> Outbox:
    ob = Outbox()
    ob.subscriber(TOPIC, consumer=CONSUMER, max_attempts=100)(tick)
    return ob
