"""the inbox's table outbox_intake

Revision ID: 0012
Revises: 0011
Create Date: 2027-03-01 09:00:00.000000

Intake (issue 31): ``outbox_intake`` remembers each message taken in from a broker or a
webhook under (source, identity), with the event it became, or why it was rejected and its
first bytes (:data:`outbox.db.tables.intake`). A new table only: nothing existing is locked
or rewritten. The downgrade drops it, and with it the memory of what was taken in: a
message redelivered afterwards would be taken in again.
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_intake",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("identity", sa.Text(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("problem", sa.Text(), nullable=True),
        sa.Column("subject", sa.Text(), nullable=True),
        sa.Column("headers", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.Column("body_size", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("source", "identity", name="pk_outbox_intake"),
        sa.CheckConstraint("(event_id IS NULL) <> (problem IS NULL)", name="taken_or_rejected"),
    )
    op.create_index("ix_outbox_intake_taken_at", "outbox_intake", ["taken_at"],
                    postgresql_where=sa.text("problem IS NULL"))
    op.create_index("ix_outbox_intake_rejected", "outbox_intake", ["source", "taken_at"],
                    postgresql_where=sa.text("problem IS NOT NULL"))


def downgrade() -> None:
    op.drop_table("outbox_intake")
