"""initial schema: events, subscriptions, jobs, the fence sequence, NOTIFY triggers

Revision ID: 0001
Revises:
Create Date: 2026-11-29 10:07:28.499136
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.db.tables import NOTIFY_DDL, NOTIFY_DROP_DDL

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.schema.CreateSequence(sa.Sequence('outbox_fence_seq', start=1)))
    op.create_table('outbox_events',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('topic', sa.Text(), nullable=False),
    sa.Column('key', sa.Text(), nullable=True),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('headers', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('routed_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("topic <> ''", name=op.f('ck_outbox_events_topic_not_empty')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_events'))
    )
    op.create_index('ix_outbox_events_routed_at', 'outbox_events', ['routed_at'], unique=False, postgresql_where=sa.text('routed_at IS NOT NULL'))
    op.create_index('ix_outbox_events_unrouted', 'outbox_events', ['id'], unique=False, postgresql_where=sa.text('routed_at IS NULL'))
    op.create_table('outbox_subscriptions',
    sa.Column('topic', sa.Text(), nullable=False),
    sa.Column('consumer', sa.Text(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_seconds', sa.Double(), nullable=False),
    sa.Column('priority', sa.SmallInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('transactional', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('lease_seconds > 0', name=op.f('ck_outbox_subscriptions_lease_positive')),
    sa.CheckConstraint('max_attempts >= 1', name=op.f('ck_outbox_subscriptions_max_attempts_positive')),
    sa.PrimaryKeyConstraint('topic', 'consumer', name=op.f('pk_outbox_subscriptions'))
    )
    op.create_table('outbox_jobs',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('event_id', sa.BigInteger(), nullable=False),
    sa.Column('consumer', sa.Text(), nullable=False),
    sa.Column('status', sa.Text(), server_default=sa.text("'ready'"), nullable=False),
    sa.Column('priority', sa.SmallInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('run_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('fence', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('locked_by', sa.Text(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status <> 'running' OR lease_until IS NOT NULL", name=op.f('ck_outbox_jobs_running_has_lease')),
    sa.CheckConstraint("status IN ('ready', 'running', 'done', 'dead')", name=op.f('ck_outbox_jobs_status_known')),
    sa.CheckConstraint('attempts >= 0 AND attempts <= max_attempts', name=op.f('ck_outbox_jobs_attempts_in_range')),
    sa.ForeignKeyConstraint(['event_id'], ['outbox_events.id'], name=op.f('fk_outbox_jobs_event_id_outbox_events'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_jobs')),
    sa.UniqueConstraint('event_id', 'consumer', name=op.f('uq_outbox_jobs_event_id_consumer'))
    )
    op.create_index('ix_outbox_jobs_dead', 'outbox_jobs', ['consumer', 'id'], unique=False, postgresql_where=sa.text("status = 'dead'"))
    op.create_index('ix_outbox_jobs_finished', 'outbox_jobs', ['finished_at'], unique=False, postgresql_where=sa.text("status = 'done'"))
    op.create_index('ix_outbox_jobs_lease', 'outbox_jobs', ['lease_until'], unique=False, postgresql_where=sa.text("status = 'running'"))
    op.create_index('ix_outbox_jobs_ready', 'outbox_jobs', ['priority', 'run_at', 'id'], unique=False, postgresql_where=sa.text("status = 'ready'"))
    for statement in NOTIFY_DDL:
        op.execute(statement)


def downgrade() -> None:
    for statement in NOTIFY_DROP_DDL:
        op.execute(statement)
    op.drop_index('ix_outbox_jobs_ready', table_name='outbox_jobs', postgresql_where=sa.text("status = 'ready'"))
    op.drop_index('ix_outbox_jobs_lease', table_name='outbox_jobs', postgresql_where=sa.text("status = 'running'"))
    op.drop_index('ix_outbox_jobs_finished', table_name='outbox_jobs', postgresql_where=sa.text("status = 'done'"))
    op.drop_index('ix_outbox_jobs_dead', table_name='outbox_jobs', postgresql_where=sa.text("status = 'dead'"))
    op.drop_table('outbox_jobs')
    op.drop_table('outbox_subscriptions')
    op.drop_index('ix_outbox_events_unrouted', table_name='outbox_events', postgresql_where=sa.text('routed_at IS NULL'))
    op.drop_index('ix_outbox_events_routed_at', table_name='outbox_events', postgresql_where=sa.text('routed_at IS NOT NULL'))
    op.drop_table('outbox_events')
    op.execute(sa.schema.DropSequence(sa.Sequence('outbox_fence_seq')))
