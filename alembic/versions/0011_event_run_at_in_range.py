"""an event's run_at is a time Python can hold

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-02 09:00:00.000000

* ``outbox_events`` gains ``ck_outbox_events_run_at_in_range``: ``run_at`` NULL or in years 1
  to 9999 in UTC (:data:`outbox.db.event_rules.RUN_AT_CHECK`). ``publish()`` has always refused
  other times (Python's ``datetime`` cannot hold them) and the SQL functions refuse them since
  0010; a plain INSERT could still write ``'-infinity'`` or a year BC, and then every relay's
  router and claims failed on loading that value (psycopg refuses it), for every consumer,
  round after round (found by an adversarial run, issue 30). The CHECK holds every writer.

Rows already there. Added ``NOT VALID``, as in migration 0008: enforced on every insert and
update from then on without reading the table. The router updates every unrouted event, so
the unrouted events out of range (read through ``ix_outbox_events_unrouted``: the backlog) are
rewritten once the lock below is held: a time before year 1 becomes NULL (due at once, as it
was), a time from year 10000 on (``'infinity'`` included) ``9999-12-31 23:59:59.999999+00``;
a warning of ``outbox.migrate`` gives their number and first ids. Jobs routed from such events
before this migration are not looked for (that would read the whole jobs table under the
lock): ``UPDATE outbox_jobs SET run_at = now() WHERE run_at < '0001-01-01 00:00:00+00'`` and
the like repairs them (operations notes). When no routed event is retained the CHECK is
validated here; otherwise it stays NOT VALID, and ``ALTER TABLE outbox_events VALIDATE
CONSTRAINT ck_outbox_events_run_at_in_range`` in a transaction of its own validates it later.

Locks and costs: ACCESS EXCLUSIVE on ``outbox_events`` for a catalog change, waited for in
short, retried attempts (:func:`outbox.db.migrate.run_with_short_locks`), held until the
upgrade commits; one range test per inserted or updated event. The downgrade drops the CHECK
under the same short, retried lock; rewritten times stay as they are.
"""
import logging

import sqlalchemy as sa
from alembic import op

from outbox.db.event_rules import RUN_AT_CHECK, RUN_AT_FIRST
from outbox.db.migrate import run_with_short_locks

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

CHECK = 'ck_outbox_events_run_at_in_range'
#: The tables whose locks this migration waits for (the migration tests hold them).
LOCKED_TABLES = ('outbox_events',)
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10
#: Most ids of rewritten events the warning names.
IDS_SHOWN = 10
#: The latest time a rewritten event keeps (the end of year 9999 in UTC).
LAST = "9999-12-31 23:59:59.999999+00"

log = logging.getLogger("outbox.db.migrate")  # the logger of outbox.db.migrate, which runs it


def _with_short_locks(statement: str) -> None:
    run_with_short_locks(op.get_bind(), statement, revision=revision, lock_timeout=LOCK_TIMEOUT,
                         retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def upgrade() -> None:
    _with_short_locks(f"ALTER TABLE outbox_events ADD CONSTRAINT {CHECK} CHECK ({RUN_AT_CHECK}) NOT VALID")
    bind = op.get_bind()
    rewritten = sorted(bind.execute(sa.text(
        f"""
        UPDATE outbox_events
        SET run_at = CASE WHEN run_at < '{RUN_AT_FIRST}' THEN NULL ELSE CAST('{LAST}' AS timestamptz) END
        WHERE routed_at IS NULL AND NOT ({RUN_AT_CHECK})
        RETURNING id
        """)).scalars())
    if rewritten:
        log.warning("migration %s: %d unrouted events had a run_at outside years 1 to 9999 in UTC, which no relay "
                    "can read; rewritten as NULL (before year 1) or the end of year 9999: ids %s%s", revision,
                    len(rewritten), ", ".join(map(str, rewritten[:IDS_SHOWN])),
                    " ..." if len(rewritten) > IDS_SHOWN else "")
    if not bind.execute(sa.text("SELECT EXISTS (SELECT 1 FROM outbox_events WHERE routed_at IS NOT NULL)")).scalar_one():
        op.execute(f"ALTER TABLE outbox_events VALIDATE CONSTRAINT {CHECK}")


def downgrade() -> None:
    _with_short_locks(f"ALTER TABLE outbox_events DROP CONSTRAINT IF EXISTS {CHECK}")
