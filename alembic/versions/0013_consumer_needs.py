"""attempt history, superseded jobs, coalescing, fan-in and failure hooks: the shapes

Revision ID: 0013
Revises: 0012
Create Date: 2027-04-01 09:00:00.000000

What consumers need next (issue 32): new columns, a new status, new tables and the trigger
functions of failure hooks and fan-in.

* ``outbox_jobs.started_at``: when the current (or last) attempt began, set by the claim;
  ``outbox_jobs.history``: a JSON array of the job's earlier attempts that did not end
  ``done`` (start, end, relay, outcome, error), appended by the statement that ends each of
  them. A job done at its first attempt writes nothing here: its one attempt is the row
  itself (``started_at``, ``finished_at``, ``locked_by``).
* ``superseded``: a terminal status. A coalescing consumer's ready job ends so when a newer
  event of its key is routed to that consumer; pruned like done (``ix_outbox_jobs_superseded``).
* ``outbox_jobs.coalesce_key``: the event's key on the jobs of a coalescing consumer, and
  ``ix_outbox_jobs_coalesce``: their live (ready, pending, running) jobs by (consumer, key,
  event), which the router supersedes (a running one: marks) when it routes a newer event of
  the key; ``outbox_jobs.superseded_by``: the id of the newer event that superseded the job,
  set on a running job too, whose attempt then ends ``superseded`` if it would go back to
  waiting (architecture notes, "Coalescing").
* ``outbox_jobs.fan_in``: the job's consumer is listed by a fan-in of its topic (copied from
  ``outbox_subscriptions.fan_in`` when routed), so only such jobs' completions look for one.
* ``outbox_subscriptions.coalescing`` / ``fan_in`` / ``hooks`` (the failure hooks the consumer
  declares: ``dead``, ``retry``), written by the relays from their registry.
* Failure hooks: the function ``outbox_hook_due`` and two row triggers on ``outbox_jobs``,
  ``outbox_jobs_dead_hook`` (a job went ``dead``, from any status) and ``outbox_jobs_retry_hook``
  (``running`` back to ``ready`` with ``attempts`` unchanged: a failed attempt with attempts
  left), which write a due call to ``outbox_hook_calls`` only when a subscription of the job's
  consumer lists the hook in ``outbox_subscriptions.hooks`` (:data:`outbox.db.tables.HOOK_DDL`;
  the relays call the hooks, :mod:`outbox.relay.hooks`).
* Fan-in: the function ``outbox_fan_in`` and two row triggers on ``outbox_jobs``,
  ``outbox_jobs_fan_in_done`` and ``outbox_jobs_fan_in_deleted``: when every listed job of an
  event is done, it records the fan-in in ``outbox_fanin_fired`` and publishes the follow-up
  with ``outbox_publish``, in the completion's transaction (:mod:`outbox.db.fan_in`). Their
  WHEN clauses keep claims, heartbeats and other completions from calling the functions.
* ``outbox_hook_calls``: failure-hook calls due (at least once: deleted after the hook ran;
  ``event_id`` and ``max_attempts`` as when it failed, ``done`` the hooks that returned);
  ``outbox_fanins``: the declared fan-ins; ``outbox_fanin_fired``: which fan-in fired for
  which event (once), with the follow-up event it published.

Locks and costs. The columns are nullable or have a constant default (a catalog change),
made with the wider status CHECK in one ``ALTER TABLE outbox_jobs`` and one of
``outbox_subscriptions``, after both tables are locked ACCESS EXCLUSIVE in one statement
waited for in short, retried attempts (:func:`outbox.db.migrate.run_with_short_locks`),
held until the upgrade commits. The new
CHECK admits every status the old one did, so existing rows need no check: it is validated
here only when ``outbox_jobs`` is empty; otherwise ``ALTER TABLE outbox_jobs VALIDATE
CONSTRAINT ck_outbox_jobs_status_known`` in a transaction of its own validates it later
without blocking writes. The new partial indexes start empty but each reads the table once.
Creating the triggers needs no more than the locks held. No hook call is written for jobs
that died before the upgrade, and no job was routed with ``fan_in`` before it. The downgrade
drops the triggers and functions first, under the same short, retried locks.
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.db.fan_in import FAN_IN_DDL, FAN_IN_DROP_DDL
from outbox.db.migrate import run_with_short_locks
from outbox.db.tables import HOOK_DDL, HOOK_DROP_DDL

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

_STATUSES = "status IN ('ready', 'running', 'done', 'dead', 'pending', 'cancelled', 'superseded')"
_STATUSES_BEFORE = "status IN ('ready', 'running', 'done', 'dead', 'pending', 'cancelled')"
CHECK = 'ck_outbox_jobs_status_known'
#: The tables whose locks this migration waits for (the migration tests hold them).
LOCKED_TABLES = ('outbox_jobs', 'outbox_subscriptions')
LOCK_TIMEOUT = '2s'
RETRY_PAUSE = 1.0  # seconds
ATTEMPTS = 10


def _with_short_locks(statement: str) -> None:
    run_with_short_locks(op.get_bind(), statement, revision=revision, lock_timeout=LOCK_TIMEOUT,
                         retry_pause=RETRY_PAUSE, attempts=ATTEMPTS)


def _lock_tables() -> None:
    """Both tables at once, in one retried statement: a deadlock or a timeout while waiting
    for the second hands the first back too (a retry of the second alone would keep
    holding the first)."""
    _with_short_locks(f"LOCK TABLE {', '.join(LOCKED_TABLES)} IN ACCESS EXCLUSIVE MODE")


def upgrade() -> None:
    _lock_tables()
    op.execute(
        "ALTER TABLE outbox_jobs ADD COLUMN started_at timestamptz, ADD COLUMN history jsonb,"
        " ADD COLUMN fan_in boolean NOT NULL DEFAULT false, ADD COLUMN coalesce_key text, ADD COLUMN superseded_by bigint,"
        f" DROP CONSTRAINT {CHECK}, ADD CONSTRAINT {CHECK} CHECK ({_STATUSES}) NOT VALID")
    if not op.get_bind().execute(sa.text("SELECT EXISTS (SELECT 1 FROM outbox_jobs)")).scalar_one():
        op.execute(f"ALTER TABLE outbox_jobs VALIDATE CONSTRAINT {CHECK}")
    op.create_index('ix_outbox_jobs_superseded', 'outbox_jobs', ['finished_at'],
                    postgresql_where=sa.text("status = 'superseded'"))
    op.create_index('ix_outbox_jobs_coalesce', 'outbox_jobs', ['consumer', 'coalesce_key', 'event_id'],
                    postgresql_where=sa.text("coalesce_key IS NOT NULL AND status IN ('ready', 'pending', 'running')"))
    op.execute(
        "ALTER TABLE outbox_subscriptions ADD COLUMN coalescing boolean NOT NULL DEFAULT false,"
        " ADD COLUMN fan_in boolean NOT NULL DEFAULT false, ADD COLUMN hooks text[] NOT NULL DEFAULT '{}'::text[]")
    op.create_table(
        'outbox_hook_calls',
        sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column('job_id', sa.BigInteger(), nullable=False),
        sa.Column('consumer', sa.Text(), nullable=False),
        sa.Column('hook', sa.Text(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('calls', sa.Integer(), server_default=sa.text('0'), nullable=False),
        sa.Column('due_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('event_id', sa.BigInteger(), nullable=False),
        sa.Column('max_attempts', sa.Integer(), nullable=False),
        sa.Column('done', postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False),
        sa.CheckConstraint("hook IN ('dead', 'retry')", name=op.f('ck_outbox_hook_calls_hook_known')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_hook_calls')),
    )
    op.create_table(
        'outbox_fanins',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('topic', sa.Text(), nullable=False),
        sa.Column('consumers', postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column('follow_topic', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_outbox_fanins')),
    )
    op.create_table(
        'outbox_fanin_fired',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('event_id', sa.BigInteger(), nullable=False),
        sa.Column('follow_event_id', sa.BigInteger(), nullable=True),
        sa.Column('fired_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('event_id', 'name', name=op.f('pk_outbox_fanin_fired')),
    )
    # The trigger functions and their triggers (the tables are locked already); each DDL
    # tuple begins by setting the search path its function keeps.
    for statement in (*HOOK_DDL, *FAN_IN_DDL):
        op.execute(statement)


def downgrade() -> None:
    """Back to 0012. Refused while a job is ``superseded`` (the old CHECK would not hold):
    prune or purge them first. Pending hook calls, the fan-ins and their record, and every
    job's attempt history are dropped."""
    _lock_tables()
    for statement in (*FAN_IN_DROP_DDL, *HOOK_DROP_DDL):
        op.execute(statement)
    op.drop_table('outbox_fanin_fired')
    op.drop_table('outbox_fanins')
    op.drop_table('outbox_hook_calls')
    op.execute("ALTER TABLE outbox_subscriptions DROP COLUMN hooks, DROP COLUMN fan_in, DROP COLUMN coalescing")
    op.drop_index('ix_outbox_jobs_coalesce', table_name='outbox_jobs')
    op.drop_index('ix_outbox_jobs_superseded', table_name='outbox_jobs')
    op.execute(
        f"ALTER TABLE outbox_jobs DROP CONSTRAINT {CHECK}, ADD CONSTRAINT {CHECK} CHECK ({_STATUSES_BEFORE}),"
        " DROP COLUMN superseded_by, DROP COLUMN coalesce_key, DROP COLUMN fan_in, DROP COLUMN history, DROP COLUMN started_at")
