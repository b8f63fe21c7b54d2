"""jobs without the foreign key to their event

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-27 09:00:00.000000

* ``outbox_jobs.event_id`` loses its foreign key to ``outbox_events`` (``ON DELETE
  CASCADE``). The key checked every job the router inserts with a query of its own
  (``SELECT ... FOR KEY SHARE`` on the event, once per job, after the statement): a fifth to
  a quarter of the routing statement's time in issue 14's profile (performance notes,
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
tries again, up to ``ATTEMPTS`` times (each retry logged as a warning of ``outbox.db.migrate``);
then the migration fails with PostgreSQL's lock timeout error and changes nothing (run it
again when the queue is quieter). A deadlock is retried the same way: holding
``outbox_jobs``, the drop waits for ``outbox_events``, and a transaction that holds a lock on
the events and then wants the jobs (a transactional handler that published an event, then
completes its job; a statement reading both) closes the cycle;
when PostgreSQL picks the migration to abort (40P01), the savepoint gives both back, that
transaction goes on, and the drop is tried again. The session's own ``lock_timeout`` is back
for whatever runs after the drop in the same transaction. Jobs ready, running or finished
during the upgrade are untouched: no row is rewritten (the acceptance test of the live
upgrade runs this migration under relays and publishers at work; the integration tests of the
newest migration bound its waits).

Locks taken in a savepoint are kept by the enclosing transaction once it is released, so the
exclusive locks last until the whole migration commits: a moment for this one, longer when
later migrations run in the same upgrade.
"""
from alembic import op

from outbox.db.migrate import run_with_short_locks

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

FOREIGN_KEY = 'fk_outbox_jobs_event_id_outbox_events'
#: The tables whose locks this migration waits for, in order (the migration tests hold them).
LOCKED_TABLES = ('outbox_jobs', 'outbox_events')
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10


def _with_short_locks(statement: str) -> None:
    """Run ``statement`` with short, retried lock waits, as the module notes say
    (:func:`outbox.db.migrate.run_with_short_locks`, with this module's constants)."""
    run_with_short_locks(op.get_bind(), statement, revision=revision, lock_timeout=LOCK_TIMEOUT,
                         retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def upgrade() -> None:
    _with_short_locks(f'ALTER TABLE outbox_jobs DROP CONSTRAINT IF EXISTS {FOREIGN_KEY}')


def downgrade() -> None:
    # NOT VALID first: the exclusive locks are taken with the short, retried waits before any
    # scan. The validation then reads every job in the same transaction, still holding them
    # (see the module notes: a savepoint's locks last until commit), so the queue waits for
    # that scan; a job whose event is gone makes it fail, naming the key, and changes nothing.
    _with_short_locks(f'ALTER TABLE outbox_jobs ADD CONSTRAINT {FOREIGN_KEY} FOREIGN KEY (event_id)'
                      ' REFERENCES outbox_events (id) ON DELETE CASCADE NOT VALID')
    op.execute(f'ALTER TABLE outbox_jobs VALIDATE CONSTRAINT {FOREIGN_KEY}')
