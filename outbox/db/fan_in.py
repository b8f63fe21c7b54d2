"""Fan-in in the database (migration 0013): the trigger that publishes a fan-in's follow-up in
the transaction of the completion that finishes the last listed job (:mod:`outbox.fan_in`
says what a fan-in is; :meth:`outbox.Outbox.after` declares one).

**Where it runs.** A row trigger on ``outbox_jobs``, so every way a job becomes done is
covered by one piece of code: the relay's batched completion (``job_complete_many``, its
delete branch under ``retention_done = 0`` included), a transactional handler's
``job_complete``, forwarders (they complete through ``job_complete_many``), and anything an
operator does in SQL. Two triggers call the function ``outbox_fan_in``:

* ``outbox_jobs_fan_in_done``: ``AFTER UPDATE OF status ... WHEN (NEW.fan_in AND NEW.status =
  'done' AND OLD.status IS DISTINCT FROM 'done')``;
* ``outbox_jobs_fan_in_deleted``: ``AFTER DELETE ... WHEN (OLD.fan_in AND OLD.status <>
  'done')``. A ``running`` job deleted is a completion's delete branch (nothing else deletes a
  running job: the pruners take done, cancelled and superseded jobs, ``purge`` leaves running
  ones), so it counts as done. Any other status deleted (a purged job, a cancelled or
  superseded one pruned) never finishes: the function records the fan-in as settled for that
  event without a follow-up (``follow_event_id`` NULL), so the job's absence is never mistaken
  for its completion afterwards.

The WHEN clauses are evaluated by the executor without calling the function, so claims,
heartbeats, failures and the completions of jobs no fan-in lists (``fan_in`` false: the router
copies ``outbox_subscriptions.fan_in``, which the relays write from their registry) pay nothing.
Pruning done jobs pays nothing either (``OLD.status = 'done'``).

**What it does**, for each fan-in of the event's topic listing the job's consumer (the rows of
``outbox_fanins``, written by the relays when they start):

1. take ``pg_advisory_xact_lock(<oid of outbox_fanin_fired>, <the event id's low 31 bits>)``,
   the event's fan-in lock, held until the transaction ends;
2. in a new statement, check that no job of the event of a listed consumer is anything but
   ``done`` and that no record of this (event, fan-in) exists. A job that is absent counts as
   done: every job of an event is routed in one transaction, and a listed job deleted before
   it was done left a record (above);
3. if so, insert the record into ``outbox_fanin_fired`` (primary key ``(event_id, name)``,
   ``ON CONFLICT DO NOTHING``), and only when it went in, publish the follow-up with
   ``outbox_publish`` (the SQL publishing function: the same rules and NOTIFY as
   ``publish()``) and store its id in the record's ``follow_event_id``.

**The race, and why the lock and the new statement decide it.** Two transactions finish the
last two listed jobs of an event at the same moment. Without the lock, each checks before the
other commits, sees the other's job still running, and neither fires. With it, the second
waits for the first to commit; under READ COMMITTED each statement of a VOLATILE function
takes a fresh snapshot, so its check, a statement after the wait, sees the first one's
completion and fires; the first saw the second's job unfinished (uncommitted) and did not.
Exactly one fires. Under REPEATABLE READ the check would read the transaction's old snapshot
and both could miss: the function refuses to run there (the relay's connections and the
handlers' transactions run READ COMMITTED). Under SERIALIZABLE the missed case is a
serialization failure, retried like any.

**No deadlock between batches.** A batch completing jobs of several events takes several
event locks, and row triggers fire in whatever order the rows were changed; two batches could
take two events' locks in opposite orders. ``job_complete_many`` therefore takes the locks of
every fan-in event it completed, sorted by lock key, before its triggers fire (its final
SELECT runs before the statement's AFTER triggers); the triggers then find them held. The
other paths complete one job per transaction (one lock).

**Once, across relays and crashes.** The record, the follow-up and the completion commit
together or not at all: a relay killed before the commit leaves the job running (reaped, run
again, completed: then it fires), one killed after leaves the record. A second completion of
the same event (an operator setting a job back to running and done, a redrive of a dead job
after the fan-in fired) finds the record. Replayed jobs (``outbox-relay replay``) are created
with ``fan_in`` false and never call the function. The record lives as long as its event: the
pruner deletes both together (``event_prune_many``).

**Rights.** The function runs with the privileges of the role that completes the job (the
relay's): ``INSERT`` on ``outbox_fanin_fired``, ``EXECUTE`` on ``outbox_publish`` and
``outbox_insert_event`` (``outbox-relay grants --relay`` gives both). It keeps the search path
it was created under (outbox's schema, then ``pg_temp``), like the publishing functions.
A follow-up ``outbox_publish`` refuses (a payload over ``outbox.max_payload_bytes``, headers
over their limit) fails the completion's statement with that error: the relay dead-letters the
job naming it (poison rows), and a redrive after the cause is fixed fires the fan-in.
"""

from __future__ import annotations

#: The trigger function.
FAN_IN_FUNCTION = "outbox_fan_in"
#: The two row triggers on ``outbox_jobs`` that call it.
FAN_IN_TRIGGERS = ("outbox_jobs_fan_in_done", "outbox_jobs_fan_in_deleted")
#: Headers of a follow-up event naming its fan-in and the event it follows.
FAN_IN_HEADER = "fan_in"
FAN_IN_EVENT_HEADER = "fan_in_event_id"
#: The trace-context headers a follow-up takes from the event it follows (W3C trace
#: context and baggage, the OpenTelemetry propagator's keys; compared lowercased).
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
#: An event's fan-in lock: ``pg_advisory_xact_lock(FAN_IN_LOCK_CLASS, <FAN_IN_LOCK_KEY of its
#: id>)`` (``pg_locks``: ``classid`` the oid of ``outbox_fanin_fired``, ``objid`` the key,
#: ``objsubid`` 2). The same expressions in the function and in ``job_complete_many``.
FAN_IN_LOCK_CLASS = "CAST(CAST(CAST('outbox_fanin_fired' AS regclass) AS oid) AS int)"
FAN_IN_LOCK_KEY = "CAST({event_id} & 2147483647 AS int)"

_TRACE_KEYS = ", ".join(f"'{k}'" for k in TRACE_HEADERS)

#: CREATE statements (migration 0013 and ``metadata.create_all``). The first sets the search
#: path the function keeps (transaction-local); the function; then the triggers, which take
#: a lock on ``outbox_jobs``.
FAN_IN_DDL: tuple[str, ...] = (
    "SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true)",
    f"""
    CREATE OR REPLACE FUNCTION {FAN_IN_FUNCTION}() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
    DECLARE
        job_event_id bigint;
        job_consumer text;
        completed boolean;
        event record;
        fan record;
        follow_id bigint;
    BEGIN
        IF TG_OP = 'DELETE' THEN
            job_event_id := OLD.event_id;
            job_consumer := OLD.consumer;
            completed := OLD.status = 'running';  -- a completion's delete branch (retention_done = 0)
        ELSE
            job_event_id := NEW.event_id;
            job_consumer := NEW.consumer;
            completed := true;
        END IF;
        SELECT e.id, e.topic, e.key, e.payload, e.headers INTO event FROM outbox_events e WHERE e.id = job_event_id;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        FOR fan IN SELECT f.name, f.consumers, f.follow_topic FROM outbox_fanins f
                   WHERE f.topic = event.topic AND job_consumer = ANY (f.consumers)
                   ORDER BY f.name LOOP
            IF NOT completed THEN
                -- A listed job gone before it was done never will be: settled, no follow-up.
                INSERT INTO outbox_fanin_fired (event_id, name) VALUES (event.id, fan.name)
                ON CONFLICT (event_id, name) DO NOTHING;
                CONTINUE;
            END IF;
            IF current_setting('transaction_isolation') = 'repeatable read' THEN
                RAISE EXCEPTION USING ERRCODE = 'feature_not_supported',
                    MESSAGE = format('fan-in %s: a job of event %s completed under REPEATABLE READ, where the '
                                     'check for the last listed job cannot see a concurrent completion; complete '
                                     'jobs under READ COMMITTED (the default)', quote_literal(fan.name), event.id);
            END IF;
            PERFORM pg_advisory_xact_lock({FAN_IN_LOCK_CLASS}, {FAN_IN_LOCK_KEY.format(event_id="event.id")});
            -- A new statement: a fresh snapshot, taken after the lock (module notes, "The race").
            IF EXISTS (SELECT 1 FROM outbox_jobs j
                       WHERE j.event_id = event.id AND j.consumer = ANY (fan.consumers) AND j.status <> 'done')
               OR EXISTS (SELECT 1 FROM outbox_fanin_fired r WHERE r.event_id = event.id AND r.name = fan.name) THEN
                CONTINUE;
            END IF;
            INSERT INTO outbox_fanin_fired (event_id, name) VALUES (event.id, fan.name)
            ON CONFLICT (event_id, name) DO NOTHING;
            IF FOUND THEN
                follow_id := outbox_publish(
                    fan.follow_topic, event.payload, event.key,
                    coalesce((SELECT jsonb_object_agg(h.key, h.value) FROM jsonb_each(event.headers) h
                              WHERE lower(h.key) IN ({_TRACE_KEYS})), '{{}}')
                    || jsonb_build_object('{FAN_IN_HEADER}', fan.name, '{FAN_IN_EVENT_HEADER}', event.id));
                UPDATE outbox_fanin_fired SET follow_event_id = follow_id
                WHERE event_id = event.id AND name = fan.name;
            END IF;
        END LOOP;
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER {FAN_IN_TRIGGERS[0]} AFTER UPDATE OF status ON outbox_jobs FOR EACH ROW
    WHEN (NEW.fan_in AND NEW.status = 'done' AND OLD.status IS DISTINCT FROM 'done')
    EXECUTE FUNCTION {FAN_IN_FUNCTION}()
    """,
    f"""
    CREATE TRIGGER {FAN_IN_TRIGGERS[1]} AFTER DELETE ON outbox_jobs FOR EACH ROW
    WHEN (OLD.fan_in AND OLD.status <> 'done')
    EXECUTE FUNCTION {FAN_IN_FUNCTION}()
    """,
)

#: The downgrade of 0013 (its first statements): the triggers, then the function.
FAN_IN_DROP_DDL: tuple[str, ...] = (
    f"DROP TRIGGER IF EXISTS {FAN_IN_TRIGGERS[1]} ON outbox_jobs",
    f"DROP TRIGGER IF EXISTS {FAN_IN_TRIGGERS[0]} ON outbox_jobs",
    f"DROP FUNCTION IF EXISTS {FAN_IN_FUNCTION}()",
)
