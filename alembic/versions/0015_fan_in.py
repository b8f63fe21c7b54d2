"""fan-in: the trigger that publishes a fan-in's follow-up

Revision ID: 0015
Revises: 0014
Create Date: 2027-04-03 09:00:00.000000

Fan-in (issue 32): the function ``outbox_fan_in`` and two row triggers on ``outbox_jobs``
calling it, ``outbox_jobs_fan_in_done`` (a job of a listed consumer became ``done``) and
``outbox_jobs_fan_in_deleted`` (one was deleted before it was done: a completion's delete
branch under ``retention_done = 0`` counts as done, any other deletion settles the fan-in
for that event without a follow-up). When every listed job of an event is done, the function
records the fan-in in ``outbox_fanin_fired`` and publishes the follow-up with
``outbox_publish``, in the completion's transaction. See :mod:`outbox.db.fan_in`.

Locks and costs. Rows already there are not touched: a relay that declares fan-ins starts
only on a schema at this revision (or later), so no job was routed with ``fan_in`` true before.
CREATE TRIGGER is a catalog change that waits for every open transaction that changed a job
and queues the relays' claims behind it; ``outbox_jobs`` is locked ACCESS EXCLUSIVE first, as
in migrations 0009, 0013 and 0014, waited for at most ``LOCK_TIMEOUT`` per attempt and
retried (:func:`outbox.db.migrate.run_with_short_locks`), and held until the upgrade commits.
The function is created before the lock, so the lock is held only for the two triggers. The
downgrade drops the triggers under the same short, retried lock and then the function; the
fan-ins and their records stay (tables of 0013).
"""
from alembic import op

from outbox.db.fan_in import FAN_IN_DDL, FAN_IN_DROP_DDL
from outbox.db.migrate import run_with_short_locks

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

#: The tables whose locks this migration waits for (the migration tests hold them).
LOCKED_TABLES = ('outbox_jobs',)
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10


def _lock_jobs() -> None:
    """ACCESS EXCLUSIVE on ``outbox_jobs``, waited for in short, retried attempts; held until
    the migration commits, so creating the triggers waits no more."""
    run_with_short_locks(op.get_bind(), "LOCK TABLE outbox_jobs IN ACCESS EXCLUSIVE MODE", revision=revision,
                         lock_timeout=LOCK_TIMEOUT, retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def upgrade() -> None:
    for statement in FAN_IN_DDL[:2]:  # the search path the function keeps, then the function: no lock on the table
        op.execute(statement)
    _lock_jobs()
    for statement in FAN_IN_DDL[2:]:
        op.execute(statement)


def downgrade() -> None:
    _lock_jobs()
    for statement in FAN_IN_DROP_DDL:
        op.execute(statement)
