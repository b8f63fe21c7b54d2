"""SQLAlchemy Core tables of outbox, on one :data:`metadata` with a naming convention.

Applications that keep their own alembic history may include :data:`metadata` in their
``target_metadata``; otherwise ``outbox-relay migrate`` creates the same schema from the
migrations shipped in the package (version table ``outbox_alembic_version``). A test
compares the two so they cannot drift.

Job states (``jobs.status``)::

    ready --claim--> running --complete--> done
      ^                 |  \\--fail, attempts left / lease expired / release--> ready
      |                 \\----fail, none left / PermanentError / lease expired, none left--> dead
      \\--------------------------------- redrive ------------------------------------ dead

    ready, pending --cancel--> cancelled
    running --cancel (cancel_requested)--> any outcome of that claim records cancelled

    ready, pending --a newer event of the key routed (coalescing)--> superseded
    running --a newer event of the key routed--> running, superseded_by set: an outcome
            that would make it ready again records superseded (done and dead stay)
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    event,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Connection

from outbox.db import event_rules
from outbox.db.fan_in import FAN_IN_DDL, FAN_IN_FUNCTION

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: alembic's version table of outbox's own migrations, beside the tables in outbox's schema.
VERSION_TABLE = "outbox_alembic_version"
#: The trigger function that sends the NOTIFY wake-ups (see ``NOTIFY_DDL``).
NOTIFY_FUNCTION = "outbox_notify"

#: Every claim takes ``nextval`` of this one sequence, so fences grow across all jobs:
#: a downstream row guarded by ``WHERE fence < $n`` is never overwritten by a worker that
#: claimed earlier than the last writer (seed article 000, "Fencing tokens").
fence_seq = Sequence("outbox_fence_seq", metadata=metadata, start=1)

#: ``pending``: an ordered job waiting for the earlier jobs of its key (migration 0005);
#: ``cancelled``: stopped by an operator; ``superseded``: a coalescing consumer's job a newer
#: event of its key replaced before it ran again (migration 0013). Only ``ready`` is claimable.
JOB_STATUSES = ("ready", "running", "done", "dead", "pending", "cancelled", "superseded")

events = Table(
    "outbox_events",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("topic", Text, nullable=False),
    Column("key", Text, nullable=True),
    Column("payload", JSONB, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("routed_at", DateTime(timezone=True), nullable=True),
    # Publish options (migration 0004), NULL when not given: claimable from (NULL: at once),
    # added to the subscription's priority (NULL: 0), unique with topic while retained.
    Column("run_at", DateTime(timezone=True), nullable=True),
    Column("priority", SmallInteger, nullable=True),
    Column("dedup_key", Text, nullable=True),
    PrimaryKeyConstraint("id"),
    CheckConstraint("topic <> ''", name="topic_not_empty"),
    # Every writer's headers are an object, as publish's are (migration 0008).
    CheckConstraint("jsonb_typeof(headers) = 'object'", name="headers_object"),
    # A run_at a relay can read, from every writer (migration 0011).
    CheckConstraint(event_rules.RUN_AT_CHECK, name="run_at_in_range"),
    Index("ix_outbox_events_unrouted", "id", postgresql_where=text("routed_at IS NULL")),
    Index("ix_outbox_events_routed_at", "routed_at", postgresql_where=text("routed_at IS NOT NULL")),
    # Only events with a dedup key enter it; publish's INSERT ... ON CONFLICT DO NOTHING arbiter.
    Index("ix_outbox_events_dedup", "topic", "dedup_key", unique=True, postgresql_where=text("dedup_key IS NOT NULL")),
    # Routing takes a keyed event only when no earlier event of its key is still unrouted
    # (migration 0005): found here, among the unrouted events only.
    Index("ix_outbox_events_unrouted_key", "key", "id", postgresql_where=text("routed_at IS NULL AND key IS NOT NULL")),
)

subscriptions = Table(
    "outbox_subscriptions",
    metadata,
    Column("topic", Text, nullable=False),
    Column("consumer", Text, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("lease_seconds", Double, nullable=False),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("transactional", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Ordered delivery per key (migration 0005): the router copies the event's key into
    # each job's ordering_key; on_dead says whether a dead job blocks its key or is skipped.
    Column("ordered", Boolean, nullable=False, server_default=text("false")),
    Column("on_dead", Text, nullable=False, server_default=text("'block'")),
    PrimaryKeyConstraint("topic", "consumer"),
    # Migration 0013: coalescing (only the newest ready job of a key runs), fan_in (listed by a
    # fan-in of this topic), hooks (the failure hooks declared: 'dead', 'retry').
    Column("coalescing", Boolean, nullable=False, server_default=text("false")),
    Column("fan_in", Boolean, nullable=False, server_default=text("false")),
    Column("hooks", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    CheckConstraint("on_dead IN ('block', 'skip')", name="on_dead_known"),
    CheckConstraint("max_attempts >= 1", name="max_attempts_positive"),
    CheckConstraint("lease_seconds > 0", name="lease_positive"),
)

jobs = Table(
    "outbox_jobs",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    # No foreign key to outbox_events (migration 0007 says why; the statements keep it).
    Column("event_id", BigInteger, nullable=False),
    Column("consumer", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'ready'")),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("run_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False),
    Column("lease_until", DateTime(timezone=True), nullable=True),
    Column("fence", BigInteger, nullable=False, server_default=text("0")),
    Column("locked_by", Text, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    # Migration 0005. ordering_key: the event's key when the consumer is ordered (NULL:
    # unordered, or a dead job that no longer holds its key back); snoozes: times the
    # handler put the job back with Snooze, which attempts do not count.
    Column("ordering_key", Text, nullable=True),
    Column("snoozes", Integer, nullable=False, server_default=text("0")),
    # Migration 0006: set by ``outbox-relay cancel`` on a running job; the heartbeat tells the
    # handler (``job.cancel_requested``) and the attempt's outcome records ``cancelled``.
    Column("cancel_requested", Boolean, nullable=False, server_default=text("false")),
    # Migration 0013 (issue 32). started_at: when the current or last attempt began (the
    # claim sets it); history: the earlier attempts that did not end done, a JSON array of
    # {attempt, started_at, ended_at, relay, outcome, error}, appended by the statement that
    # ends each; fan_in: the consumer is listed by a fan-in of the event's topic.
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("history", JSONB, nullable=True),
    Column("fan_in", Boolean, nullable=False, server_default=text("false")),
    # coalesce_key: the event's key, on the jobs of a coalescing consumer (NULL otherwise);
    # superseded_by: the id of the newer event of that key that superseded the job (NULL:
    # none), set on a running job too: its attempt then ends superseded rather than waiting again.
    Column("coalesce_key", Text, nullable=True),
    Column("superseded_by", BigInteger, nullable=True),
    PrimaryKeyConstraint("id"),
    UniqueConstraint("event_id", "consumer"),
    CheckConstraint("status IN ('ready', 'running', 'done', 'dead', 'pending', 'cancelled', 'superseded')",
                    name="status_known"),
    CheckConstraint("attempts >= 0 AND attempts <= max_attempts", name="attempts_in_range"),
    CheckConstraint("status <> 'running' OR lease_until IS NOT NULL", name="running_has_lease"),
    # Claiming reads only ready rows, in claim order; done rows never enter this index.
    Index("ix_outbox_jobs_ready", "priority", "run_at", "id", postgresql_where=text("status = 'ready'")),
    # The reaper reads only running rows by lease expiry.
    Index("ix_outbox_jobs_lease", "lease_until", postgresql_where=text("status = 'running'")),
    # Pruning reads done rows by age; dead letters are listed by consumer.
    Index("ix_outbox_jobs_finished", "finished_at", postgresql_where=text("status = 'done'")),
    Index("ix_outbox_jobs_dead", "consumer", "id", postgresql_where=text("status = 'dead'")),
    # Cancelled jobs by age (migration 0006): pruned like done ones, counted by ``status``.
    Index("ix_outbox_jobs_cancelled", "finished_at", postgresql_where=text("status = 'cancelled'")),
    # Superseded jobs by age (migration 0013): pruned like done ones.
    Index("ix_outbox_jobs_superseded", "finished_at", postgresql_where=text("status = 'superseded'")),
    # The live jobs of each (coalescing consumer, key), which a newer event of the key supersedes
    # (waiting ones) or marks (running ones): architecture notes, "Coalescing".
    Index("ix_outbox_jobs_coalesce", "consumer", "coalesce_key", "event_id",
          postgresql_where=text("coalesce_key IS NOT NULL AND status IN ('ready', 'pending', 'running')")),
    # The unfinished jobs of each (ordered consumer, key) in event order: the key's head,
    # the jobs waiting behind it, and a dead job blocking it. Done rows never enter it.
    Index("ix_outbox_jobs_ordering", "consumer", "ordering_key", "event_id",
          postgresql_where=text("ordering_key IS NOT NULL AND status <> 'done'")),
)

#: Flow control per consumer, enforced across all relays (migration 0005). The relays write
#: ``concurrency`` (most running jobs cluster-wide, NULL: no cap) and ``rate_limit`` (most
#: claims per second cluster-wide, NULL: none) from their registry at start; ``tokens`` and
#: ``refilled_at`` are the rate limit's bucket, on the database clock; ``paused_at`` is set by
#: ``outbox-relay pause`` and cleared by ``resume`` (NULL: not paused), never by a relay start.
consumers = Table(
    "outbox_consumers",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("concurrency", Integer, nullable=True),
    Column("rate_limit", Double, nullable=True),
    Column("tokens", Double, nullable=False, server_default=text("0")),
    Column("refilled_at", DateTime(timezone=True), nullable=True),
    Column("paused_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("consumer"),
    CheckConstraint("concurrency IS NULL OR concurrency >= 1", name="concurrency_positive"),
    CheckConstraint("rate_limit IS NULL OR rate_limit > 0", name="rate_limit_positive"),
)

#: Longest a live relay leaves its row of ``outbox_relays`` unwritten, seconds: its dispatchers
#: refresh ``last_seen_at`` at least this often, busy or idle. ``outbox-relay relays`` shows a
#: relay silent for three times this as gone; the pruner forgets its row after
#: :data:`outbox.db.retention.RELAY_GONE_AFTER`.
RELAY_SEEN_INTERVAL = 30.0

#: One row per running relay (the relay registry: ``outbox-relay relays``). ``buffered``: fences of the claims the relay holds whose
#: handler has not started (its prefetch buffer), rewritten by the dispatcher in the
#: statement that claims and before a buffered job is handed to a worker; the reaper gives
#: the attempt back to an expired claim listed here (migration 0003).
relays = Table(
    "outbox_relays",
    metadata,
    Column("id", Text, nullable=False),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("buffered", ARRAY(BigInteger), nullable=False, server_default=text("'{}'::bigint[]")),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("last_seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Migration 0006, for ``outbox-relay relays``: the outbox version the relay runs, the
    # consumers it has handlers for and its worker slots (NULL: written by an older relay).
    Column("version", Text, nullable=True),
    Column("consumers", ARRAY(Text), nullable=True),
    Column("concurrency", Integer, nullable=True),
    PrimaryKeyConstraint("id"),
)

#: One row per periodic schedule (``Outbox.periodic``; migration 0004), written by every relay
#: that declares it. ``next_slot``: the next slot to publish, advanced by a compare-and-set
#: (``schedule_advance``) in the transaction that publishes the slot's event, so each slot is
#: published once however many relays run; ``last_slot``: the last one published.
schedules = Table(
    "outbox_schedules",
    metadata,
    Column("name", Text, nullable=False),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("catch_up", Boolean, nullable=False, server_default=text("false")),
    Column("last_slot", DateTime(timezone=True), nullable=True),
    Column("next_slot", DateTime(timezone=True), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("name"),
)

#: The inbox's memory (migration 0012): one row per message an intake took in
#: (:mod:`outbox.intake`), under the intake's name (``source``) and the message's dedup
#: ``identity`` (the sender's ``Outbox-Idempotency-Key``, else the broker's message id, else
#: what the intake's ``identity=`` computes). A message whose (source, identity) is here is
#: acknowledged and dropped. ``event_id``: the event it became, written in the same
#: transaction as this row. A rejected message (not JSON, too large, no topic: a "poison"
#: message) has no event: ``problem`` says why and ``body`` keeps its first bytes
#: (``body_size`` all of them), with its ``subject`` and ``headers``, until an operator forgets
#: it; taken-in rows are pruned ``intake_retention`` seconds after ``taken_at``.
intake = Table(
    "outbox_intake",
    metadata,
    Column("source", Text, nullable=False),
    Column("identity", Text, nullable=False),
    Column("event_id", BigInteger, nullable=True),
    Column("taken_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("problem", Text, nullable=True),
    Column("subject", Text, nullable=True),
    Column("headers", JSONB, nullable=True),
    Column("body", LargeBinary, nullable=True),
    Column("body_size", BigInteger, nullable=True),
    PrimaryKeyConstraint("source", "identity"),
    CheckConstraint("(event_id IS NULL) <> (problem IS NULL)", name="taken_or_rejected"),
    # The pruner reads taken-in rows by age; rejected ones are listed by source.
    Index("ix_outbox_intake_taken_at", "taken_at", postgresql_where=text("problem IS NULL")),
    Index("ix_outbox_intake_rejected", "source", "taken_at", postgresql_where=text("problem IS NOT NULL")),
)

#: Failure-hook calls due (migration 0013, :mod:`outbox.relay.hooks`): one row per job that went
#: ``dead`` (or back to ``ready`` after a failure: ``retry``) whose consumer declares such a
#: hook. A relay running that consumer's hooks takes a due row (``due_at``), calls the hook and
#: deletes the row; a failed call is retried later (``calls``, ``last_error``) a bounded number
#: of times, so a hook runs at least once and never for ever.
hook_calls = Table(
    "outbox_hook_calls",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("job_id", BigInteger, nullable=False),
    Column("consumer", Text, nullable=False),
    Column("hook", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("error", Text, nullable=True),
    Column("calls", Integer, nullable=False, server_default=text("0")),
    Column("due_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("last_error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Migration 0013: the job's event and max_attempts when it failed (the job may be pruned
    # before a retry's hooks run); done: the hooks (by name) that already returned for this
    # row, so a failing hook is called again without repeating the others.
    Column("event_id", BigInteger, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("done", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    PrimaryKeyConstraint("id"),
    CheckConstraint("hook IN ('dead', 'retry')", name="hook_known"),
)

#: The declared fan-ins (migration 0013): when every consumer in ``consumers`` has finished
#: (done) its job of an event on ``topic``, an event on ``follow_topic`` is published once.
#: Written by the relays from their registry.
fanins = Table(
    "outbox_fanins",
    metadata,
    Column("name", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("consumers", ARRAY(Text), nullable=False),
    Column("follow_topic", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("name"),
)

#: Which fan-in fired for which event (migration 0013), written in the transaction of the
#: completion that finished the last listed job, with the follow-up event it published: its
#: primary key makes the follow-up once per (event, fan-in). ``follow_event_id`` NULL: settled
#: without a follow-up (a listed job was deleted before it was done: purged, or pruned once
#: cancelled; :mod:`outbox.db.fan_in`). Pruned with the events (by ``event_id``, the key's
#: first column).
fanin_fired = Table(
    "outbox_fanin_fired",
    metadata,
    Column("name", Text, nullable=False),
    Column("event_id", BigInteger, nullable=False),
    Column("follow_event_id", BigInteger, nullable=True),
    Column("fired_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("event_id", "name"),
)

#: NOTIFY channels. A statement-level trigger on each table sends one notification per
#: inserting statement; PostgreSQL delivers it only on commit and folds duplicates within a
#: transaction ("NOTIFY", PostgreSQL docs), so publishing costs no extra round trip. Tables
#: in a schema other than ``public`` notify on ``<schema>.<channel>`` (:func:`notify_channel`),
#: so a relay is woken only by its own schema's events and jobs.
EVENTS_CHANNEL = "outbox_events"
JOBS_CHANNEL = "outbox_jobs"


def notify_channel(channel: str, schema: str) -> str:
    """The name ``channel`` (``EVENTS_CHANNEL`` or ``JOBS_CHANNEL``) has for the tables of
    ``schema``: unchanged for ``public`` (as before schemas existed), else
    ``<schema>.<channel>``, as the trigger function computes it from ``TG_TABLE_SCHEMA``."""
    return channel if schema == "public" else f"{schema}.{channel}"


def relation_names() -> frozenset[str]:
    """Every name outbox creates in its schema: the tables and sequences of
    :data:`metadata`, the version table and the trigger function. Statements name these
    unqualified; :func:`outbox.db.queries.in_schema` qualifies exactly these."""
    sequences = {v.name for v in globals().values() if isinstance(v, Sequence) and v.metadata is metadata}
    return frozenset({*metadata.tables, *sequences, VERSION_TABLE, NOTIFY_FUNCTION, EVENTS_NOTIFY_FUNCTION,
                      HOOK_FUNCTION, FAN_IN_FUNCTION, *event_rules.FUNCTION_NAMES})


# The function resolves no relation by name (pg_notify is in pg_catalog, searched first), so
# it behaves the same whatever search_path the inserting session has.
NOTIFY_DDL = (
    f"""
    CREATE OR REPLACE FUNCTION {NOTIFY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify(CASE WHEN TG_TABLE_SCHEMA = 'public' THEN TG_ARGV[0]
                               ELSE TG_TABLE_SCHEMA || '.' || TG_ARGV[0] END, '');
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify('{EVENTS_CHANNEL}')
    """,
    f"""
    CREATE TRIGGER outbox_jobs_notify AFTER INSERT ON outbox_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify('{JOBS_CHANNEL}')
    """,
)
#: The events' trigger since migration 0009 (issue 28): the notification names the first
#: event id the inserting statement wrote (``from <id>``; a transition table holds its rows),
#: so a router that routes after the last id it saw (:class:`outbox.relay.router.RouteHint`)
#: goes back for an event whose transaction committed after higher ids were routed. Every
#: writer of events gets it, publish() and plain SQL alike. One notification per transaction,
#: as before: the first statement that wrote an event sends it (ids drawn later in the
#: transaction are higher) and sets the transaction-local ``outbox.events_notified``, which
#: the later statements read; a rolled-back savepoint takes back both the flag and the
#: notification.
EVENTS_NOTIFY_FUNCTION = "outbox_notify_events"
EVENTS_NOTIFY_DDL = (
    f"""
    CREATE OR REPLACE FUNCTION {EVENTS_NOTIFY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF current_setting('outbox.events_notified', true) IS DISTINCT FROM 'on' THEN
            PERFORM pg_notify(CASE WHEN TG_TABLE_SCHEMA = 'public' THEN TG_ARGV[0]
                                   ELSE TG_TABLE_SCHEMA || '.' || TG_ARGV[0] END,
                              coalesce('from ' || (SELECT min(id) FROM inserted), ''));
            IF EXISTS (SELECT 1 FROM inserted) THEN
                PERFORM set_config('outbox.events_notified', 'on', true);
            END IF;
        END IF;
        RETURN NULL;
    END $$
    """,
    "DROP TRIGGER IF EXISTS outbox_events_notify ON outbox_events",
    f"""
    CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION {EVENTS_NOTIFY_FUNCTION}('{EVENTS_CHANNEL}')
    """,
)
#: Back to the trigger of migration 0001 (the downgrade of 0009).
EVENTS_NOTIFY_DROP_DDL = (
    "DROP TRIGGER IF EXISTS outbox_events_notify ON outbox_events",
    f"""
    CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION {NOTIFY_FUNCTION}('{EVENTS_CHANNEL}')
    """,
    f"DROP FUNCTION IF EXISTS {EVENTS_NOTIFY_FUNCTION}()",
)
NOTIFY_DROP_DDL = (
    "DROP TRIGGER IF EXISTS outbox_jobs_notify ON outbox_jobs",
    "DROP TRIGGER IF EXISTS outbox_events_notify ON outbox_events",
    "DROP FUNCTION IF EXISTS outbox_notify()",
)

#: Failure hooks (migration 0013, issue 32): a row trigger on ``outbox_jobs`` writes a due
#: call to ``outbox_hook_calls`` when a job goes ``dead`` (from any status, by any statement)
#: or back to ``ready`` after a failed attempt (``running`` to ``ready`` with ``attempts``
#: unchanged: a failure with attempts left, or the reaper's expired lease of a started
#: attempt; a release, a snooze and the reaper's unstarted claim give the attempt back, so
#: ``attempts`` drops and they do not match), and only when a subscription of the job's
#: consumer declares that hook (``outbox_subscriptions.hooks``, written by the relays). The
#: WHEN clause is evaluated by the executor without calling the function, so claims,
#: heartbeats and completions pay nothing; the call commits or rolls back with the
#: statement that changed the job. The function keeps the search path it was created under
#: (outbox's schema, then ``pg_temp``), like the publish functions.
HOOK_FUNCTION = "outbox_hook_due"
HOOK_TRIGGERS = {"dead": "outbox_jobs_dead_hook", "retry": "outbox_jobs_retry_hook"}
HOOK_DDL = (
    "SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true)",
    f"""
    CREATE OR REPLACE FUNCTION {HOOK_FUNCTION}() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM outbox_subscriptions s
                   WHERE s.consumer = NEW.consumer AND TG_ARGV[0] = ANY (s.hooks)) THEN
            INSERT INTO outbox_hook_calls (job_id, event_id, consumer, hook, attempt, max_attempts, error)
            VALUES (NEW.id, NEW.event_id, NEW.consumer, TG_ARGV[0], NEW.attempts, NEW.max_attempts, NEW.last_error);
        END IF;
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER {HOOK_TRIGGERS["dead"]} AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW
    WHEN (NEW.status = 'dead' AND OLD.status IS DISTINCT FROM 'dead')
    EXECUTE FUNCTION {HOOK_FUNCTION}('dead')
    """,
    f"""
    CREATE TRIGGER {HOOK_TRIGGERS["retry"]} AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW
    WHEN (OLD.status = 'running' AND NEW.status = 'ready' AND NEW.attempts = OLD.attempts)
    EXECUTE FUNCTION {HOOK_FUNCTION}('retry')
    """,
)
#: The downgrade of 0013 (its first statements).
HOOK_DROP_DDL = (
    f"DROP TRIGGER IF EXISTS {HOOK_TRIGGERS['retry']} ON outbox_jobs",
    f"DROP TRIGGER IF EXISTS {HOOK_TRIGGERS['dead']} ON outbox_jobs",
    f"DROP FUNCTION IF EXISTS {HOOK_FUNCTION}()",
)


def _create_notify_triggers(target: MetaData, connection: Connection, **kw: Any) -> None:
    for statement in (*NOTIFY_DDL, *EVENTS_NOTIFY_DDL):
        connection.exec_driver_sql(statement)
    # The publish functions keep the search path they are created under (SET search_path FROM
    # CURRENT): the schema the tables were just created in, then pg_temp; put back afterwards.
    search_path = connection.exec_driver_sql("SELECT current_setting('search_path')").scalar_one()
    for statement in event_rules.PUBLISH_FUNCTIONS_DDL:  # the first sets the search path they keep
        connection.exec_driver_sql(statement.replace("%", "%%"))  # the driver reads % as a placeholder
    for statement in HOOK_DDL:  # the first sets the search path the function keeps
        connection.exec_driver_sql(statement)
    for statement in FAN_IN_DDL:  # likewise (fan-in, migration 0013: outbox.db.fan_in)
        connection.exec_driver_sql(statement.replace("%", "%%"))
    connection.exec_driver_sql("SELECT set_config('search_path', %(path)s, true)", {"path": search_path})


event.listen(metadata, "after_create", _create_notify_triggers)

#: Autovacuum storage parameters of the two queue tables (migration 0002 gives the
#: reasons): ``metadata.create_all`` sets them right after creating each table, so it makes
#: the same schema as ``outbox-relay migrate``.
STORAGE_PARAMETERS: dict[str, dict[str, float]] = {
    table: {
        "autovacuum_vacuum_threshold": 5000,
        "autovacuum_vacuum_scale_factor": 0.01,
        "autovacuum_analyze_threshold": 1000,
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_vacuum_cost_limit": 1000,
    }
    for table in ("outbox_events", "outbox_jobs")
}


def _set_storage_parameters(target: Table, connection: Connection, **kw: Any) -> None:
    parameters = ", ".join(f"{name} = {value}" for name, value in STORAGE_PARAMETERS[target.name].items())
    connection.exec_driver_sql(f"ALTER TABLE {target.name} SET ({parameters})")


for _table in (events, jobs):
    event.listen(_table, "after_create", _set_storage_parameters)

#: The alembic version table of outbox's own migrations, beside any application's
#: ``alembic_version``.
VERSION_TABLE = "outbox_alembic_version"


def table_names() -> frozenset[str]:
    """Names (without schema) of every table outbox creates: those on :data:`metadata` and
    :data:`VERSION_TABLE`."""
    return frozenset(table.name for table in metadata.tables.values()) | {VERSION_TABLE}


def include_object(object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """An alembic ``include_object`` hook (``context.configure(include_object=...)`` in an
    application's ``env.py``) that keeps outbox's own objects out of the application's
    ``alembic revision --autogenerate``: False for outbox's tables (:func:`table_names`,
    the version table included) and for the columns, indexes and constraints on them, and
    for outbox's fence sequence; True for everything else, so the application's own
    objects are compared as usual. Decides by name, whatever schema outbox's tables are in.

    Without it, autogenerate sees outbox's tables in the database but not in the
    application's ``target_metadata`` and proposes to drop them (outbox's migrations, run
    by ``outbox-relay migrate``, own them). To combine with a hook of your own:
    ``include_object=lambda *a: outbox.db.include_object(*a) and mine(*a)``.
    """
    if type_ == "table":
        return name not in table_names()
    if type_ == "sequence":
        return name != fence_seq.name
    table = getattr(object, "table", None)  # columns, indexes, constraints: decided by their table
    return not (isinstance(table, Table) and table.name in table_names())
