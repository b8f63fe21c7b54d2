"""publish options on outbox_events (run_at, priority, dedup_key) and outbox_schedules

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10 09:00:00.000000

``outbox_events`` gains three nullable columns, NULL for every existing row and for every
event published without options, so old rows and old code paths are untouched. An event
without options stores no value for them, only their bits in the row's null bitmap: with
ten columns the bitmap takes two bytes instead of one, which moves the row header from 24
to 32 bytes after alignment (8 bytes a row; "Database Page Layout", PostgreSQL docs):

* ``run_at``: when the jobs routed from the event become claimable (NULL: at once); the
  router copies it to each job's ``run_at``;
* ``priority``: added to the subscription's priority in each job (NULL: 0);
* ``dedup_key``: with ``topic``, unique among retained events, through the partial unique
  index ``ix_outbox_events_dedup`` (only rows with a key enter it, so it costs events
  without one nothing). ``publish`` inserts with ``ON CONFLICT DO NOTHING`` on it.

Adding nullable columns without a default only changes the catalog; building the index
reads the table once under a SHARE lock (writes to outbox_events wait for it; the table is
kept small by retention). No CHECK constraints: publish validates, and a CHECK added here
would scan the table under an ACCESS EXCLUSIVE lock.

``outbox_schedules``: one row per periodic schedule (``Outbox.periodic``), written by
every relay that declares it; ``next_slot`` is the slot the schedulers wait for, advanced
with a compare-and-set so each slot is published once (architecture notes, "Schedules").
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('outbox_events', sa.Column('run_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('outbox_events', sa.Column('priority', sa.SmallInteger(), nullable=True))
    op.add_column('outbox_events', sa.Column('dedup_key', sa.Text(), nullable=True))
    op.create_index('ix_outbox_events_dedup', 'outbox_events', ['topic', 'dedup_key'], unique=True,
                    postgresql_where=sa.text('dedup_key IS NOT NULL'))
    op.create_table(
        'outbox_schedules',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('cron', sa.Text(), nullable=False),
        sa.Column('timezone', sa.Text(), nullable=False),
        sa.Column('topic', sa.Text(), nullable=False),
        sa.Column('catch_up', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.Column('last_slot', sa.DateTime(timezone=True), nullable=True),
        sa.Column('next_slot', sa.DateTime(timezone=True), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_outbox_schedules')),
    )


def downgrade() -> None:
    op.drop_table('outbox_schedules')
    op.drop_index('ix_outbox_events_dedup', table_name='outbox_events')
    op.drop_column('outbox_events', 'dedup_key')
    op.drop_column('outbox_events', 'priority')
    op.drop_column('outbox_events', 'run_at')
