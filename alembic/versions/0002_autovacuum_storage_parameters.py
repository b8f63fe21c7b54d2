"""autovacuum storage parameters on outbox_jobs and outbox_events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 09:00:00.000000

Why (performance notes, findings 1 and 7). The autovacuum daemon vacuums a table once
its dead rows exceed ``autovacuum_vacuum_threshold + autovacuum_vacuum_scale_factor *
reltuples``, and analyses it once its rows inserted, updated or deleted since the last
ANALYZE exceed ``autovacuum_analyze_threshold + autovacuum_analyze_scale_factor *
reltuples`` (PostgreSQL docs, "Routine Vacuuming", "The Autovacuum Daemon"; the server-wide
defaults are in "Server Configuration", "Automatic Vacuuming": 50 + 20 % and 50 + 10 %).
Both tables here are queues, for which those proportional defaults fit badly:

* **outbox_jobs** churns: each job is inserted, updated twice (claim, completion: neither
  is a HOT update, since ``status`` is in the partial indexes' predicates) and deleted by
  the pruner, so it leaves about three dead row versions, whatever the table's size. At
  600 jobs/s that was ~100,000 dead rows a minute, and the table doubled in size before
  autovacuum came. Dead rows accrue per job, not per row kept, so the trigger is mostly a
  fixed count: 5,000 dead rows plus 1 % of the table (the 1 % keeps a table that holds a
  day of done jobs, ``retention_done``, from being vacuumed on every pass for a handful of
  dead rows). Vacuum is cheap on such a table: pages untouched since the last vacuum are
  skipped through the visibility map.
* **outbox_jobs** also needs fresh planner statistics: a burst of ready jobs into a table
  whose statistics say it holds none (never analysed, or analysed while quiet) makes the
  claim sort every ready job instead of reading ``ix_outbox_jobs_ready`` in order (7.1 ms
  instead of 0.9 ms per claim with 18,000 ready). The relay analyses the table itself
  after routing many jobs (:class:`outbox.relay.statistics.StatisticsKeeper`); this is the safety
  net for jobs routed otherwise and for drift: analyse after 1,000 changed rows plus 2 %
  of the table. ANALYZE reads a bounded sample (30,000 rows at the default statistics
  target), so frequent analyses stay cheap.
* **outbox_events** gets one dead row version per event when the router marks it routed
  (``routed_at`` is in both partial indexes' predicates: no HOT update) and keeps events
  for ``retention_events`` (7 days by default): with 20 % of a week's events as the
  trigger, the heap would roughly double before a vacuum. Same settings as the jobs; the
  analyze settings also keep the route statement off a sort of every unrouted event after
  a burst of publishing into a table analysed while quiet.
* ``autovacuum_vacuum_cost_limit`` 1,000 on both (5x the default ``vacuum_cost_limit``
  of 200, at the default 2 ms cost delay), so a vacuum of a busy queue finishes sooner
  instead of sleeping most of the time. A table with its own cost limit is left out of
  the balancing of the limit across autovacuum workers ("The Autovacuum Daemon"), so this
  adds at most one such worker's I/O on top of the others.

How often autovacuum looks at all is ``autovacuum_naptime`` (server-wide, 1 minute by
default), which no table setting changes: hence the relay's own ANALYZE after bursts.

``ALTER TABLE ... SET (...)`` of these parameters takes a SHARE UPDATE EXCLUSIVE lock, which
does not block routing, claiming or publishing; it waits only for a running (auto)vacuum
or ANALYZE of the table. The downgrade resets the parameters to the server's defaults.
``outbox.db.tables`` sets the same parameters when the schema is made by
``metadata.create_all`` (a test compares the two).
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

#: Storage parameters per table, as of this revision (later revisions change them with a
#: migration of their own, never by editing this one).
STORAGE_PARAMETERS = {
    'outbox_jobs': {
        'autovacuum_vacuum_threshold': 5000,
        'autovacuum_vacuum_scale_factor': 0.01,
        'autovacuum_analyze_threshold': 1000,
        'autovacuum_analyze_scale_factor': 0.02,
        'autovacuum_vacuum_cost_limit': 1000,
    },
    'outbox_events': {
        'autovacuum_vacuum_threshold': 5000,
        'autovacuum_vacuum_scale_factor': 0.01,
        'autovacuum_analyze_threshold': 1000,
        'autovacuum_analyze_scale_factor': 0.02,
        'autovacuum_vacuum_cost_limit': 1000,
    },
}


def upgrade() -> None:
    # DDL takes no bound parameters; the values are the literal constants above.
    for table, parameters in STORAGE_PARAMETERS.items():
        settings = ', '.join(f'{name} = {value}' for name, value in parameters.items())
        op.execute(sa.text(f'ALTER TABLE {table} SET ({settings})'))


def downgrade() -> None:
    for table, parameters in STORAGE_PARAMETERS.items():
        op.execute(sa.text(f'ALTER TABLE {table} RESET ({", ".join(parameters)})'))
