"""an event's headers are a JSON object

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-10 09:00:00.000000

* ``outbox_events`` gains ``ck_outbox_events_headers_object``: ``jsonb_typeof(headers) =
  'object'``. publish() has always refused other headers; the CHECK holds every other writer
  to the same rule (the publisher role, which may insert ``headers``; the relay role; SQL),
  so a consumer always reads an object and a forwarder always has message headers to make
  (issue 26, item 6). It costs one type test of the value per inserted or updated event.

Rows already there. The CHECK is added ``NOT VALID``: PostgreSQL enforces it on every
insert and update from then on without reading the table. It enforces it on updates of old
rows too, and the router updates every unrouted event (``routed_at``): an unrouted event
whose headers are not an object would fail that update and stop routing. So the unrouted
events whose headers are not an object (read through ``ix_outbox_events_unrouted``: the
backlog, not the history) are rewritten, once the lock below is held so none can be added
meanwhile: JSON ``null`` becomes ``{}`` (what a job read it as), any other value
``{"invalid_headers": <the value>}``; a warning of ``outbox.migrate`` gives their number and
first ids. Routed events are never updated again and keep their headers.

Validation. When no routed event is retained (a new or an emptied queue, found by one probe
of ``ix_outbox_events_routed_at``), the CHECK is validated here: that reads only the
unrouted events just checked. Otherwise it stays ``NOT VALID`` (``pg_constraint.convalidated``
false), which changes nothing for new rows: validating here would read the whole retained
history while holding the ACCESS EXCLUSIVE lock below until the upgrade's one transaction
commits, stopping publish for the whole scan. ``ALTER TABLE outbox_events VALIDATE
CONSTRAINT ck_outbox_events_headers_object`` in a transaction of its own takes SHARE UPDATE
EXCLUSIVE instead (publishing and routing go on); it fails, naming the constraint, while a
routed event with other headers is retained (operations notes, "Roles").

Locks and costs. Adding the CHECK changes only the catalog but takes ACCESS EXCLUSIVE on
``outbox_events``, which waits for every open transaction that published an event (it holds
a lock on the table until it ends) and queues every publish behind it meanwhile: so it waits
at most ``LOCK_TIMEOUT`` per attempt and is retried, as in migration 0007
(:func:`outbox.db.migrate.run_with_short_locks`). The lock lasts until the upgrade commits:
the rewrite of the backlog's few bad rows and the probe (and, on a queue with no history,
the validation) are all that runs under it. The downgrade drops the CHECK under the same
short, retried lock; rewritten headers stay as they are.
"""
import logging

import sqlalchemy as sa
from alembic import op

from outbox.db.migrate import run_with_short_locks

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

CHECK = 'ck_outbox_events_headers_object'
#: The tables whose locks this migration waits for (the migration tests hold them).
LOCKED_TABLES = ('outbox_events',)
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10
#: Most ids of rewritten events the warning names.
IDS_SHOWN = 10

log = logging.getLogger("outbox.db.migrate")  # the logger of outbox.db.migrate, which runs it


def _with_short_locks(statement: str) -> None:
    run_with_short_locks(op.get_bind(), statement, revision=revision, lock_timeout=LOCK_TIMEOUT,
                         retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def upgrade() -> None:
    _with_short_locks(f"ALTER TABLE outbox_events ADD CONSTRAINT {CHECK} CHECK (jsonb_typeof(headers) = 'object')"
                      " NOT VALID")
    bind = op.get_bind()
    rewritten = sorted(bind.execute(sa.text(
        """
        UPDATE outbox_events
        SET headers = CASE WHEN jsonb_typeof(headers) = 'null' THEN '{}'::jsonb
                           ELSE jsonb_build_object('invalid_headers', headers) END
        WHERE routed_at IS NULL AND jsonb_typeof(headers) <> 'object'
        RETURNING id
        """)).scalars())
    if rewritten:
        log.warning("migration %s: %d unrouted events had headers that are not a JSON object; rewritten as "
                    "{} (JSON null) or {\"invalid_headers\": <the value>}: ids %s%s", revision, len(rewritten),
                    ", ".join(map(str, rewritten[:IDS_SHOWN])), " ..." if len(rewritten) > IDS_SHOWN else "")
    if not bind.execute(sa.text("SELECT EXISTS (SELECT 1 FROM outbox_events WHERE routed_at IS NOT NULL)")).scalar_one():
        op.execute(f"ALTER TABLE outbox_events VALIDATE CONSTRAINT {CHECK}")


def downgrade() -> None:
    _with_short_locks(f"ALTER TABLE outbox_events DROP CONSTRAINT IF EXISTS {CHECK}")
