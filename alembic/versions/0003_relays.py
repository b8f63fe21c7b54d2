"""outbox_relays: the relays that hold claims, and which of their claims have not started

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00.000000

A claim counts an attempt (``attempts + 1``), so a relay killed while it held claims in its
prefetch buffer used to charge an attempt to jobs whose handler never ran, and repeated
crashes dead-lettered them. Each relay now keeps one row here: ``buffered`` holds the
fences of the claims it holds whose handler has not started. The relay rewrites it in the
same statement that claims (so a claim and its place in the buffer commit together) and
before it hands a buffered job to a worker (so a started handler is never listed). The
reaper gives the attempt back to an expired claim whose fence its relay still lists
(``job_reap_many``): a crash never charges a job that did not start, and a handler that
kills its process is charged each time it starts, so it still ends dead after
``max_attempts`` instead of looping. One row per relay, rewritten once per dispatcher
round, never per job (architecture notes, "Attempts and crashes").
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'outbox_relays',
        sa.Column('id', sa.Text(), nullable=False),
        sa.Column('host', sa.Text(), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=False),
        sa.Column('buffered', postgresql.ARRAY(sa.BigInteger()), server_default=sa.text("'{}'::bigint[]"),
                  nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('last_seen_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_relays')),
    )


def downgrade() -> None:
    op.drop_table('outbox_relays')
