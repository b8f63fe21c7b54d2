"""ordered delivery per key, flow control per consumer, snooze counts

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-11 09:00:00.000000

* ``outbox_subscriptions`` gains ``ordered`` and ``on_dead`` (``block`` | ``skip``), written
  by the relays from their registry (architecture notes, "Ordering").
* ``outbox_jobs`` gains ``ordering_key`` (the event's key, for an ordered consumer) and
  ``snoozes``; two statuses join the CHECK: ``pending`` (an ordered job waiting for the
  earlier jobs of its key) and ``cancelled`` (stopped by an operator). The partial index
  ``ix_outbox_jobs_ordering`` holds the unfinished jobs of ordered keys only.
* ``outbox_events`` gains ``ix_outbox_events_unrouted_key``: the unrouted keyed events, so
  routing can keep one key's events in order.
* ``outbox_consumers``: per consumer, the concurrency cap, the rate limit and its token
  bucket, and the paused state (architecture notes, "Flow control").

Locks and costs. The new columns are nullable or have a constant default, which only
changes the catalog. The status CHECK is replaced by one added ``NOT VALID`` and then
validated, which scans the table under a SHARE UPDATE EXCLUSIVE lock (writes go on)
instead of an ACCESS EXCLUSIVE one. The two indexes are built inside the migration's
transaction (a SHARE lock: writes to the table wait while it is read); both are partial and
start empty (no job has an ordering key yet; unrouted events are few), but building them
still reads the table once.
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_STATUSES_BEFORE = "status IN ('ready', 'running', 'done', 'dead')"
_STATUSES = "status IN ('ready', 'running', 'done', 'dead', 'pending', 'cancelled')"


def upgrade() -> None:
    op.add_column('outbox_subscriptions',
                  sa.Column('ordered', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.add_column('outbox_subscriptions',
                  sa.Column('on_dead', sa.Text(), server_default=sa.text("'block'"), nullable=False))
    op.create_check_constraint(op.f('ck_outbox_subscriptions_on_dead_known'), 'outbox_subscriptions',
                               "on_dead IN ('block', 'skip')")

    op.add_column('outbox_jobs', sa.Column('ordering_key', sa.Text(), nullable=True))
    op.add_column('outbox_jobs', sa.Column('snoozes', sa.Integer(), server_default=sa.text('0'), nullable=False))
    op.drop_constraint(op.f('ck_outbox_jobs_status_known'), 'outbox_jobs', type_='check')
    op.execute(f"ALTER TABLE outbox_jobs ADD CONSTRAINT ck_outbox_jobs_status_known CHECK ({_STATUSES}) NOT VALID")
    op.execute("ALTER TABLE outbox_jobs VALIDATE CONSTRAINT ck_outbox_jobs_status_known")
    op.create_index('ix_outbox_jobs_ordering', 'outbox_jobs', ['consumer', 'ordering_key', 'event_id'],
                    postgresql_where=sa.text("ordering_key IS NOT NULL AND status <> 'done'"))

    op.create_index('ix_outbox_events_unrouted_key', 'outbox_events', ['key', 'id'],
                    postgresql_where=sa.text('routed_at IS NULL AND key IS NOT NULL'))

    op.create_table(
        'outbox_consumers',
        sa.Column('consumer', sa.Text(), nullable=False),
        sa.Column('concurrency', sa.Integer(), nullable=True),
        sa.Column('rate_limit', sa.Double(), nullable=True),
        sa.Column('tokens', sa.Double(), server_default=sa.text('0'), nullable=False),
        sa.Column('refilled_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('paused_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint('concurrency IS NULL OR concurrency >= 1', name=op.f('ck_outbox_consumers_concurrency_positive')),
        sa.CheckConstraint('rate_limit IS NULL OR rate_limit > 0', name=op.f('ck_outbox_consumers_rate_limit_positive')),
        sa.PrimaryKeyConstraint('consumer', name=op.f('pk_outbox_consumers')),
    )


def downgrade() -> None:
    """Back to 0004. Refused while a job is ``pending`` or ``cancelled`` (the old CHECK
    would not hold): finish or redrive them first."""
    op.drop_table('outbox_consumers')
    op.drop_index('ix_outbox_events_unrouted_key', table_name='outbox_events')
    op.drop_index('ix_outbox_jobs_ordering', table_name='outbox_jobs')
    op.drop_constraint(op.f('ck_outbox_jobs_status_known'), 'outbox_jobs', type_='check')
    op.create_check_constraint(op.f('ck_outbox_jobs_status_known'), 'outbox_jobs', _STATUSES_BEFORE)
    op.drop_column('outbox_jobs', 'snoozes')
    op.drop_column('outbox_jobs', 'ordering_key')
    op.drop_constraint(op.f('ck_outbox_subscriptions_on_dead_known'), 'outbox_subscriptions', type_='check')
    op.drop_column('outbox_subscriptions', 'on_dead')
    op.drop_column('outbox_subscriptions', 'ordered')
