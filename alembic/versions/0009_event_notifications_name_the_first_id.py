"""an event's notification names the first id its statement wrote

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-20 09:00:00.000000

* ``outbox_events_notify`` becomes a statement-level trigger with a transition table
  (``REFERENCING NEW TABLE AS inserted``) calling the new function ``outbox_notify_events``,
  which sends ``from <the lowest id the statement inserted>`` on the events channel instead of
  an empty payload (issue 28). The router routes after the last id it routed, so a long
  snapshot elsewhere does not make every round read the index entries of all the events
  routed since it began; an event whose transaction commits after higher ids were routed is
  announced by this notification, and the router goes back for it
  (:class:`outbox.relay.router.RouteHint`). Relays of an older version read any payload on
  that channel as a plain wake-up, so old and new relays can run side by side during a rolling
  upgrade. ``outbox_notify`` stays, for the jobs' trigger.

Rows already there are not touched. Locks and costs: replacing the trigger takes ACCESS
EXCLUSIVE on ``outbox_events`` for a catalog change only, but waits for every open transaction
that published meanwhile and queues publishing behind it, so it waits at most
``LOCK_TIMEOUT`` per attempt and is retried, as in migrations 0007 and 0008
(:func:`outbox.db.migrate.run_with_short_locks`). The downgrade puts back the trigger of 0001
under the same short, retried lock and drops the function.
"""
from alembic import op

from outbox.db.migrate import run_with_short_locks
from outbox.db.tables import EVENTS_NOTIFY_DDL, EVENTS_NOTIFY_DROP_DDL

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

#: The tables whose locks this migration waits for (the migration tests hold them).
LOCKED_TABLES = ('outbox_events',)
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10


def _lock_events() -> None:
    """ACCESS EXCLUSIVE on ``outbox_events`` (what DROP TRIGGER takes), waited for in short,
    retried attempts; held until the migration commits, so the trigger's replacement waits no more."""
    run_with_short_locks(op.get_bind(), "LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE", revision=revision,
                         lock_timeout=LOCK_TIMEOUT, retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def upgrade() -> None:
    op.execute(EVENTS_NOTIFY_DDL[0])  # the function: no lock on the table
    _lock_events()
    for statement in EVENTS_NOTIFY_DDL[1:]:
        op.execute(statement)


def downgrade() -> None:
    _lock_events()
    for statement in EVENTS_NOTIFY_DROP_DDL:
        op.execute(statement)
