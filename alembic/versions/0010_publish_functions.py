"""the SQL functions outbox_publish and outbox_publish_many

Revision ID: 0010
Revises: 0009
Create Date: 2027-02-01 09:00:00.000000

Publishing from SQL (issue 30): ``outbox_publish(topic, payload, key, headers, run_at, delay,
priority, dedup_key) RETURNS bigint`` and ``outbox_publish_many(events jsonb) RETURNS
bigint[]``, with the helpers they share, all rendered from :mod:`outbox.db.event_rules`
(the rules ``publish()`` checks in Python). Functions only: no table is locked or rewritten,
so the migration takes no lock that publishing or the relays wait for. Each function keeps
the search path of this migration (outbox's schema). The downgrade drops them.
"""
from alembic import op

from outbox.db.event_rules import PUBLISH_FUNCTIONS_DDL, PUBLISH_FUNCTIONS_DROP_DDL

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in PUBLISH_FUNCTIONS_DDL:
        op.execute(statement)


def downgrade() -> None:
    for statement in PUBLISH_FUNCTIONS_DROP_DDL:
        op.execute(statement)
