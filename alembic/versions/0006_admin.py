"""the relay registry's details, cancel requests of running jobs, cancelled jobs indexed

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20 09:00:00.000000

* ``outbox_relays`` gains what ``outbox-relay relays`` shows: ``version`` (of the outbox
  package the relay runs), ``consumers`` (the consumers it runs handlers for) and
  ``concurrency`` (its worker slots), written by the relay when it registers
  (``relay_seen``). NULL for rows written by an older relay.
* ``outbox_jobs`` gains ``cancel_requested``: set by ``outbox-relay cancel`` on a running
  job; the heartbeat returns it to the handler (``job.cancel_requested``) and the fenced
  statement that records the attempt's outcome records ``cancelled`` instead.
* ``ix_outbox_jobs_cancelled``: the cancelled jobs by age, so pruning (like done jobs) and
  ``status`` read only them.

Locks and costs. The columns are nullable or have a constant default (a catalog change).
The index is partial and starts empty (no job was cancelled before this release), but
building it reads the table once under a SHARE lock (writes wait meanwhile).
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('outbox_relays', sa.Column('version', sa.Text(), nullable=True))
    op.add_column('outbox_relays', sa.Column('consumers', postgresql.ARRAY(sa.Text()), nullable=True))
    op.add_column('outbox_relays', sa.Column('concurrency', sa.Integer(), nullable=True))
    op.add_column('outbox_jobs', sa.Column('cancel_requested', sa.Boolean(), server_default=sa.text('false'),
                                           nullable=False))
    op.create_index('ix_outbox_jobs_cancelled', 'outbox_jobs', ['finished_at'],
                    postgresql_where=sa.text("status = 'cancelled'"))


def downgrade() -> None:
    op.drop_index('ix_outbox_jobs_cancelled', table_name='outbox_jobs')
    op.drop_column('outbox_jobs', 'cancel_requested')
    op.drop_column('outbox_relays', 'concurrency')
    op.drop_column('outbox_relays', 'consumers')
    op.drop_column('outbox_relays', 'version')
