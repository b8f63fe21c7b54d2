"""jobs without the foreign key to their event

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-27 09:00:00.000000

* ``outbox_jobs.event_id`` loses its foreign key to ``outbox_events`` (``ON DELETE
  CASCADE``). The key checked every job the router inserts with a query of its own
  (``SELECT ... FOR KEY SHARE`` on the event, once per job, after the statement): a fifth to
  a quarter of the routing statement's time in issue 14's profile (docs/performance.md,
  "Issue 14"). What it guarded is kept by the statements themselves: the router inserts a
  job only for an event it holds ``FOR UPDATE``; a replay locks its events ``FOR KEY SHARE``
  before inserting, which the pruner's ``FOR UPDATE SKIP LOCKED`` skips, and an event the
  pruner holds is waited for and then passed over (it is gone); the pruner deletes an event
  only when no job of it is left, so the cascade had nothing to delete. UNIQUE (event_id,
  consumer) stays: one job per (event, consumer).

Locks and costs. Dropping a constraint changes only the catalog, but it takes ACCESS
EXCLUSIVE locks on both tables, which wait for every transaction using them (a claim, a
transactional handler holding its job) and, while waiting, queue every new statement on
them behind the migration. So the drop waits at most ``LOCK_TIMEOUT`` for its locks, in a
savepoint, and on a timeout gives them back, lets the queue move for ``RETRY_PAUSE`` and
tries again, up to ``ATTEMPTS`` times; then the migration fails with PostgreSQL's lock
timeout error and changes nothing (run it again when the queue is quieter). Jobs ready,
running or finished during the upgrade are untouched: no row is rewritten.
"""
import time

import sqlalchemy as sa
from alembic import op
from sqlalchemy.exc import OperationalError

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

FOREIGN_KEY = 'fk_outbox_jobs_event_id_outbox_events'
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10


def _with_short_locks(statement: str) -> None:
    """Run ``statement`` in a savepoint with a transaction-local ``lock_timeout``; retry on
    a lock timeout (SQLSTATE 55P03) as the module notes say."""
    bind = op.get_bind()
    for attempt in range(1, ATTEMPTS + 1):
        savepoint = bind.begin_nested()
        try:
            bind.execute(sa.text("SELECT set_config('lock_timeout', :timeout, true)"), {"timeout": LOCK_TIMEOUT})
            bind.execute(sa.text(statement))
        except OperationalError as exc:
            savepoint.rollback()
            if getattr(exc.orig, "sqlstate", None) != '55P03' or attempt == ATTEMPTS:
                raise
            time.sleep(RETRY_PAUSE)
        else:
            savepoint.commit()
            break
    bind.execute(sa.text("SELECT set_config('lock_timeout', '0', true)"))


def upgrade() -> None:
    _with_short_locks(f'ALTER TABLE outbox_jobs DROP CONSTRAINT IF EXISTS {FOREIGN_KEY}')


def downgrade() -> None:
    # NOT VALID first (no scan under the exclusive lock), then validated under a lock that
    # lets writes go on; a job whose event is gone makes the validation fail, naming it.
    _with_short_locks(f'ALTER TABLE outbox_jobs ADD CONSTRAINT {FOREIGN_KEY} FOREIGN KEY (event_id)'
                      ' REFERENCES outbox_events (id) ON DELETE CASCADE NOT VALID')
    op.execute(f'ALTER TABLE outbox_jobs VALIDATE CONSTRAINT {FOREIGN_KEY}')
