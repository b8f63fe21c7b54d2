"""failure hooks: the triggers that write due hook calls

Revision ID: 0014
Revises: 0013
Create Date: 2027-04-02 09:00:00.000000

Failure hooks (issue 32): the function ``outbox_hook_due`` and two row triggers on
``outbox_jobs`` calling it, ``outbox_jobs_dead_hook`` (a job went ``dead``, from any status)
and ``outbox_jobs_retry_hook`` (``running`` back to ``ready`` with ``attempts`` unchanged: a
failed attempt with attempts left). The function writes a row to ``outbox_hook_calls`` only
when a subscription of the job's consumer lists the hook in ``outbox_subscriptions.hooks``;
the relays call the hooks (:mod:`outbox.relay.hooks`). See :data:`outbox.db.tables.HOOK_DDL`.
``outbox_hook_calls`` (a table of 0013 nothing wrote before) gains ``event_id`` and
``max_attempts`` (the job's, when it failed: a retried job may be pruned before its hooks
run) and ``done`` (the hooks that already returned for the row).

Locks and costs. Rows already there are not touched and no hook call is written for jobs
that died before the upgrade. CREATE TRIGGER is a catalog change that waits for every open
transaction that changed a job and queues the relays' claims behind it; ``outbox_jobs`` is
locked ACCESS EXCLUSIVE first, as in migrations 0009 and 0013 (more than CREATE TRIGGER's
SHARE ROW EXCLUSIVE, so the wait is bounded behind any lock a live relay or a reader
holds, as the migration tests check), waited for at most ``LOCK_TIMEOUT`` per attempt and
retried (:func:`outbox.db.migrate.run_with_short_locks`), and held until the upgrade commits.
The downgrade drops the triggers under the same short, retried lock, the function and the
three columns; calls still due stay in ``outbox_hook_calls`` (a table of 0013).
"""
from alembic import op

from outbox.db.migrate import run_with_short_locks
from outbox.db.tables import HOOK_DDL, HOOK_DROP_DDL

revision = '0014'
down_revision = '0013'
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
    op.execute("ALTER TABLE outbox_hook_calls ADD COLUMN event_id bigint NOT NULL, ADD COLUMN max_attempts integer NOT NULL,"
               " ADD COLUMN done text[] NOT NULL DEFAULT '{}'::text[]")
    for statement in HOOK_DDL[:2]:  # the search path the function keeps, then the function: no lock on the table
        op.execute(statement)
    _lock_jobs()
    for statement in HOOK_DDL[2:]:
        op.execute(statement)


def downgrade() -> None:
    _lock_jobs()
    for statement in HOOK_DROP_DDL:
        op.execute(statement)
    op.execute("ALTER TABLE outbox_hook_calls DROP COLUMN done, DROP COLUMN max_attempts, DROP COLUMN event_id")
