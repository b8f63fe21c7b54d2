"""Every runtime statement of outbox, by name: noun first, batch forms end in ``_many``.

Rules every job-changing statement here keeps (architecture notes, "Statements"):

* Time comes from the database clock (``now()``), never from the worker; durations are
  passed in seconds and turned into intervals by ``make_interval``.
* A statement that changes a claimed job names the fence it holds and requires
  ``status = 'running'``; the caller reads which rows came back (``RETURNING``) and treats a
  missing row as a lost lease or a stale report. The reaper's check is the lease itself
  (``lease_until < now()``).
* Claiming, routing and reaping lock with ``SKIP LOCKED`` (claims ``FOR NO KEY UPDATE``,
  the others ``FOR UPDATE``), so any number of relays may run them at once without waiting
  on one another (seed article 000).
* Statements that lock several job rows by id (heartbeat, complete, fail, release) lock
  them in id order first, so two of them can never deadlock each other. Every statement
  that finishes a job locks it ``FOR UPDATE`` first, the one mode a router's ``FOR KEY
  SHARE`` on an ordered key's head waits for (``event_route_many``).
* A locking read (``FOR ... SHARE``/``UPDATE`` without ``SKIP LOCKED``) that finds its rows
  through another CTE finds them by ``j.id = ANY (ARRAY(SELECT id FROM ...))`` (an
  InitPlan, computed once) or a join with it, never ``j.id IN (SELECT id FROM ...)``. When a
  row it locks changed after the statement's snapshot, PostgreSQL re-checks the row's newest
  version against the query (READ COMMITTED's recheck, PostgreSQL docs 13.2.1); with
  statistics on a table of a few thousand jobs the planner made the ``IN`` a hash
  semi-join on the CTE, whose recheck dropped rows that still matched: the router's lock on
  the ordered keys' heads lost 49 of 50 heads a heartbeat was renewing, and made their next
  jobs ready while the heads ran (test_ordering.py; the acceptance test that terminates
  the relays' backends found it).

Arrays are bound as PostgreSQL arrays (``CAST(:ids AS bigint[])``), so a batch costs one
round trip whatever its size.

Schemas. The statements below name outbox's relations unqualified (``outbox_jobs``), so they
read as written and paste into psql. Runtime code never runs them as they are: it takes them
from :func:`in_schema`, which returns every statement with each outbox relation (the names
of :func:`outbox.db.tables.relation_names`: tables, sequences, the version table, the
trigger function) qualified as ``<schema>.<name>``, string literals included
(``nextval('tenant_a.outbox_fence_seq')``). The rewrite matches whole names only (not
``ix_outbox_jobs_ready``, not ``j.outbox_x``), is made once per schema and kept for the
life of the process, so each statement stays one object (SQLAlchemy's compiled cache and
the job runner's per-statement cache keep working) and the hot path pays nothing for it. A
statement that names no outbox relation is the same object in every schema. Statements
must not pre-bind values (``.bindparams(x=1)``): a qualified copy is rebuilt from the text.
"""

from __future__ import annotations

import functools
import hashlib
import re

from sqlalchemy import TextClause, text

from outbox.db import tables
from outbox.settings import check_schema_name, default_schema

# --------------------------------------------------------------------------- events

event_route_many: TextClause = text(
    """
    WITH locked AS (
        SELECT id, topic, key, run_at, priority
        FROM outbox_events
        WHERE routed_at IS NULL
          AND id > CAST(:after AS bigint)
          AND id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR id = ANY (CAST(:only AS bigint[])))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), batch AS (
        SELECT l.id, l.topic, l.key, l.run_at, l.priority
        FROM locked l
        WHERE l.key IS NULL
           OR NOT EXISTS (SELECT 1 FROM outbox_subscriptions s
                          WHERE s.topic = l.topic AND (s.ordered OR s.coalescing))
           OR NOT EXISTS (SELECT 1 FROM outbox_events p
                          WHERE p.key = l.key AND p.routed_at IS NULL AND p.id < l.id
                            AND p.id NOT IN (SELECT id FROM locked))
    ), wanted AS (
        SELECT b.id, s.consumer,
               CASE WHEN b.priority IS NULL THEN s.priority
                    ELSE CAST(greatest(-32768, least(32767, CAST(s.priority AS int) + b.priority)) AS smallint) END
                   AS priority,
               s.max_attempts, coalesce(b.run_at, now()) AS run_at,
               CASE WHEN s.ordered THEN b.key END AS ordering_key, s.fan_in,
               CASE WHEN s.coalescing THEN b.key END AS coalesce_key
        FROM batch b
        JOIN outbox_subscriptions s ON s.topic = b.topic
    ), newest AS (
        SELECT n.consumer, n.coalesce_key, n.id,
               coalesce(
                   (SELECT min(p.id) FROM outbox_events p
                    WHERE p.key = n.coalesce_key AND p.routed_at IS NULL AND p.id > n.id
                      AND p.id NOT IN (SELECT id FROM batch)
                      AND EXISTS (SELECT 1 FROM outbox_subscriptions s
                                  WHERE s.topic = p.topic AND s.consumer = n.consumer)),
                   (SELECT max(j.event_id) FROM outbox_jobs j
                    WHERE j.consumer = n.consumer AND j.coalesce_key = n.coalesce_key
                      AND j.status IN ('ready', 'pending', 'running') AND j.event_id > n.id)) AS overtaken_by
        FROM (SELECT consumer, coalesce_key, max(id) AS id FROM wanted
              WHERE coalesce_key IS NOT NULL GROUP BY consumer, coalesce_key) n
    ), older AS (
        SELECT j.id, n.id AS by
        FROM newest n
        JOIN outbox_jobs j ON j.consumer = n.consumer AND j.coalesce_key = n.coalesce_key
        WHERE n.overtaken_by IS NULL
          AND j.status IN ('ready', 'pending', 'running') AND j.event_id < n.id
    ), unfinished AS (
        SELECT k.consumer, k.ordering_key, h.id, h.place
        FROM (SELECT DISTINCT consumer, ordering_key FROM wanted WHERE ordering_key IS NOT NULL) k
        CROSS JOIN LATERAL (
            SELECT j.id, row_number() OVER (ORDER BY j.event_id) AS place
            FROM outbox_jobs j
            WHERE j.consumer = k.consumer AND j.ordering_key = k.ordering_key
              AND j.status <> 'done' AND j.status <> 'cancelled'
            ORDER BY j.event_id
            LIMIT 2
        ) h
    ), held AS MATERIALIZED (
        SELECT j.id, j.status
        FROM outbox_jobs j
        WHERE j.id = ANY (ARRAY(SELECT id FROM unfinished UNION ALL SELECT id FROM older))
        ORDER BY j.id
        FOR KEY SHARE
    ), heads AS (
        SELECT h.id
        FROM held h
        WHERE h.id IN (SELECT id FROM unfinished) AND h.status <> 'done' AND h.status <> 'cancelled'
    ), busy AS (
        SELECT u.consumer, u.ordering_key
        FROM unfinished u
        WHERE u.place = 2 OR (u.place = 1 AND u.id IN (SELECT id FROM heads))
    ), taken AS MATERIALIZED (
        SELECT j.id
        FROM outbox_jobs j
        WHERE j.id = ANY (ARRAY(SELECT id FROM older))
          AND (SELECT count(*) FROM held) >= 0
        ORDER BY j.id
        FOR NO KEY UPDATE
    ), replaced AS (
        UPDATE outbox_jobs j
        SET status = CASE WHEN j.status = 'running' THEN 'running' ELSE 'superseded' END,
            finished_at = CASE WHEN j.status = 'running' THEN j.finished_at ELSE now() END,
            ordering_key = CASE WHEN j.status = 'running' THEN j.ordering_key END,
            superseded_by = greatest(j.superseded_by, o.by),
            updated_at = now()
        FROM older o
        WHERE j.id = ANY (ARRAY(SELECT id FROM taken)) AND o.id = j.id
          AND j.status IN ('ready', 'pending', 'running')
        RETURNING j.id, j.consumer, j.coalesce_key, j.status
    ), inserted AS (
        INSERT INTO outbox_jobs (event_id, consumer, priority, max_attempts, run_at, ordering_key, fan_in,
                                 coalesce_key, superseded_by, finished_at, status)
        SELECT w.id, w.consumer, w.priority, w.max_attempts, w.run_at,
               CASE WHEN x.by IS NULL THEN w.ordering_key END, w.fan_in, w.coalesce_key, x.by,
               CASE WHEN x.by IS NOT NULL THEN now() END,
               CASE WHEN x.by IS NOT NULL THEN 'superseded'
                    WHEN w.ordering_key IS NULL THEN 'ready'
                    WHEN w.coalesce_key IS NOT NULL THEN
                        CASE WHEN EXISTS (SELECT 1 FROM replaced r
                                          WHERE r.consumer = w.consumer AND r.coalesce_key = w.coalesce_key
                                            AND r.status = 'running')
                                  OR EXISTS (SELECT 1 FROM unfinished u
                                             WHERE u.consumer = w.consumer AND u.ordering_key = w.ordering_key
                                               AND u.id NOT IN (SELECT id FROM older)
                                               AND (u.place = 2 OR u.id IN (SELECT id FROM heads)))
                             THEN 'pending' ELSE 'ready' END
                    WHEN EXISTS (SELECT 1 FROM busy b
                                 WHERE b.consumer = w.consumer AND b.ordering_key = w.ordering_key) THEN 'pending'
                    WHEN row_number() OVER (PARTITION BY w.consumer, w.ordering_key ORDER BY w.id) > 1
                        THEN 'pending'
                    ELSE 'ready' END
        FROM wanted w
        LEFT JOIN newest n ON n.consumer = w.consumer AND n.coalesce_key = w.coalesce_key
        CROSS JOIN LATERAL (SELECT CASE WHEN w.id < n.id THEN n.id ELSE n.overtaken_by END AS by) x
        ORDER BY w.id, w.consumer
        ON CONFLICT (event_id, consumer) DO NOTHING
        RETURNING consumer, status, priority, run_at
    ), first_ready AS (
        SELECT priority, run_at FROM inserted WHERE status = 'ready' ORDER BY priority, run_at LIMIT 1
    ), announced AS (
        SELECT pg_notify(:channel, concat('ready ', priority, ' ', extract(epoch FROM run_at))) FROM first_ready
    ), routed AS (
        UPDATE outbox_events e
        SET routed_at = now()
        WHERE e.id = ANY (ARRAY(SELECT id FROM batch))
        RETURNING e.id
    ), unmatched AS (
        SELECT b.topic, count(*) AS events
        FROM batch b
        WHERE NOT EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.topic = b.topic)
        GROUP BY b.topic
    ), superseded AS (
        SELECT c.consumer, count(*) AS jobs
        FROM (SELECT consumer FROM inserted WHERE status = 'superseded'
              UNION ALL SELECT consumer FROM replaced WHERE status = 'superseded') c
        GROUP BY c.consumer
    )
    SELECT
        (SELECT count(*) FROM routed) AS events,
        (SELECT count(*) FROM inserted) AS jobs,
        (SELECT CAST(coalesce(sum(events), 0) AS bigint) FROM unmatched) AS unsubscribed,
        (SELECT array_agg(topic ORDER BY topic) FROM unmatched) AS unsubscribed_topics,
        (SELECT array_agg(events ORDER BY topic) FROM unmatched) AS unsubscribed_counts,
        (SELECT count(*) FROM locked) - (SELECT count(*) FROM batch) AS held_back,
        (SELECT count(*) FROM busy) AS busy_keys,
        (SELECT priority FROM first_ready) AS first_priority,
        (SELECT run_at FROM first_ready) AS first_run_at,
        (SELECT count(*) FROM announced) AS announced,
        (SELECT max(id) FROM locked) AS scanned_to,
        (SELECT min(id) FROM locked WHERE id NOT IN (SELECT id FROM batch)) AS first_held,
        (SELECT array_agg(consumer ORDER BY consumer) FROM superseded) AS superseded_consumers,
        (SELECT array_agg(jobs ORDER BY consumer) FROM superseded) AS superseded_counts
    """
)
"""Route up to ``:limit`` unrouted events with ids above ``:after`` (0: from the first): one
job per matching subscription, events marked routed, in one statement (one transaction).
Rows locked by another router are skipped, so each (event, consumer) job is created exactly
once; ``routed_at IS NULL`` picks events. ``:after`` is only where the scan starts: ids
commit out of order, so the router goes back below it for an event announced later
(:class:`outbox.relay.router.RouteHint`), or to one its look-out found there. The
row also gives the highest id the batch locked (``scanned_to``) and the lowest it held
back (``first_held``), NULL when none, from which the router's next scan starts. Returns one row:
events routed, jobs created, events that matched no subscription (``unsubscribed``; their
topics and how many of each in ``unsubscribed_topics`` and ``unsubscribed_counts``, arrays
in topic order, NULL when none), events held back
(``held_back``), ordered keys found busy (``busy_keys``), the jobs made ``superseded`` per
consumer (``superseded_consumers``, ``superseded_counts``: arrays in consumer order, NULL
when none; coalescing below) and the claim-order key
(``first_priority``, ``first_run_at``) of the first job it made ready (NULL when none),
which it also sends to the relays listening on ``:channel`` (the schema's jobs channel:
``ready <priority> <epoch seconds>``, on commit), so a relay whose claims went past that key
claims from it next (:class:`outbox.relay.producer.ClaimHint`). Each job's ``run_at`` is
the event's (``publish(run_at=, delay=)``) or now, its priority the subscription's plus the
event's (``publish(priority=)``), clamped to ``smallint``. ``:skip`` (ids, usually
empty) are left out and ``:only`` (ids or NULL for all) limits the batch: the router's
poison handling (:mod:`outbox.db.poison`) routes by halves of ``event_route_candidates``.

Ordering (architecture notes, "Ordering"; :mod:`outbox.relay.ordering`): a keyed event of a topic
with an ordered subscription is routed only when no earlier event of its key is unrouted
outside this batch (read through ``ix_outbox_events_unrouted_key``); it is left unrouted,
and taken by a later round, while another router holds the earlier one. For a subscription with ``ordered`` the job
gets ``ordering_key`` = the event's key and is ``pending`` when its (consumer, key)
already has an unfinished job, or an earlier one in this batch, else ``ready``. The
key's first two unfinished jobs (its head and the next) are locked ``FOR KEY SHARE``
(``held``, giving ``heads``), so a completion of the head committing meanwhile is either seen (the lock
re-reads the newest version and drops a finished head) or waits for this commit, and then
its promotion sees the job inserted here. ``FOR KEY SHARE`` conflicts only with ``FOR
UPDATE``, which every statement that finishes a job takes first (completion, failure,
reaping, release, burying, the transactional completion, skip); claims lock with ``FOR NO
KEY UPDATE SKIP LOCKED`` and promotion with ``FOR NO KEY UPDATE``, which it does not block
and which never block it. With ``FOR SHARE`` here, a claim that had locked a ready head
while its completion part waited for a head this statement held deadlocked with it. A second unfinished job in the snapshot
(``place = 2``) keeps the key busy whatever became of the head, and its lock keeps it from
being promoted before this commits. The heads are locked in id order, like every statement that
locks job rows and waits (completion, heartbeat, failure, promotion), so none of them can
deadlock with this one; ``held`` is ``MATERIALIZED`` and read whole by ``taken``, which
the data-modifying ``replaced`` always runs, so its locks are always all taken.

Coalescing (architecture notes, "Coalescing"; a subscription with ``coalescing``): the job gets
``coalesce_key`` = the event's key, and of the jobs of one (consumer, key) only the newest
event's may wait. "Newer" is a higher event id. A keyed event of a topic with a coalescing
subscription is held back, as for ordering, while an earlier event of its key is unrouted
outside the batch. Then, per (consumer, key) of the batch (``newest``): its newest event is
*overtaken* when a later event of the key on one of the consumer's topics is unrouted
outside the batch (it will be routed after) or already has a live (ready, pending,
running) job; the batch's other events of the key, and the newest when overtaken, get their
job inserted ``superseded`` (``finished_at = now()``, ``superseded_by`` = the newer event,
no ``ordering_key``), so each (event, consumer) still has its one job. Otherwise the
key's older live jobs (``older``, read through ``ix_outbox_jobs_coalesce``) are replaced
(``replaced``): a ready or pending one ends ``superseded`` and leaves its ordered key; a
running one stays running with ``superseded_by`` set, and the statement that ends its
attempt records ``superseded`` instead of putting it back to ``ready`` (``job_fail_many``,
``job_reap_many``, ``job_release_many``, ``job_snooze_many``; done and dead stay). Together
these keep at most one waiting job per (consumer, key), the one of the highest event id,
across routers: of two routers routing events a < b of one key at once, the one with b held
it back if it saw a unrouted, so a committed after its snapshot, while b was already
committed: the one with a then sees b unrouted and makes a's job superseded.

Locks. ``held`` locks the ordered keys' first two unfinished jobs and the coalescing keys'
older live jobs together, in id order, ``FOR KEY SHARE`` (for the reasons below); then
``taken`` locks the older live jobs again ``FOR NO KEY UPDATE``, in id order, after every
``held`` lock is taken (its InitPlan reads ``held`` whole first). A statement that finishes
a job (``FOR UPDATE``) and holds one of them is waited for in ``held``, before this one
holds anything it could wait for; in ``taken`` only ``FOR NO KEY UPDATE`` holders are
waited for: a claim (the last statement of its transaction, which waits for nothing
more), a promotion or another router (both id-ordered). So none of them can deadlock with
this one. ``replaced`` updates what ``taken`` holds and reads each row's newest version: a
ready job a claim took meanwhile (the claim won the row lock; this statement waited for
its commit) is running, marked, never superseded; a job whose failure committed meanwhile
is ready again, and superseded. For an ordered coalescing consumer the new job is
``pending`` only when an older job of its key is still running (marked), or an unfinished
job of the key that is not coalescing (dead and blocking, or routed before the consumer
coalesced) keeps it busy as below; else ``ready``.

``routed`` marks the batch by primary key (``e.id = ANY (ARRAY(...))``, an InitPlan, as in
the claim) and needs no ``routed_at IS NULL``: ``locked`` holds each row ``FOR UPDATE`` and
re-checked the condition on its newest version. Joined to ``batch`` with the condition, a
planner without statistics on ``outbox_events`` (a new database, autovacuum off) read
every unrouted event through ``ix_outbox_events_unrouted`` for each batch: 20 ms of a
250 ms round with a backlog of 20,000 (performance notes, "Issue 14")."""

event_route_candidates: TextClause = text(
    """
    SELECT id FROM outbox_events
    WHERE routed_at IS NULL AND id <> ALL (CAST(:skip AS bigint[]))
    ORDER BY id
    LIMIT :limit
    """
)
"""Ids of up to ``:limit`` unrouted events in routing order, none locked: the batch
``event_route_many`` would take, for finding the event that makes it fail."""

event_first_unrouted_before: TextClause = text(
    """
    SELECT id FROM outbox_events
    WHERE routed_at IS NULL
      AND id <= CAST(:after AS bigint)
      AND id <> ALL (CAST(:skip AS bigint[]))
    ORDER BY id
    LIMIT 1
    """
)
"""The first unrouted event at or below ``:after`` (the router's hint: where its next round
starts), leaving out the quarantined ids ``:skip``; no row when there is none. Locks
nothing. The router's look-out runs it on a connection of its own
(:class:`outbox.relay.notify.Lookout`): it finds what no notification announced, whose
scan reads through the index entries of every event routed since the oldest snapshot
began, off the routing path."""

event_prune_many: TextClause = text(
    """
    WITH pruned AS (
        DELETE FROM outbox_events
        WHERE id IN (
            SELECT e.id
            FROM outbox_events e
            WHERE e.routed_at IS NOT NULL
              AND e.routed_at < now() - make_interval(secs => :older_than)
              AND NOT EXISTS (SELECT 1 FROM outbox_jobs j WHERE j.event_id = e.id)
              AND e.id <> ALL (CAST(:skip AS bigint[]))
              AND (CAST(:only AS bigint[]) IS NULL OR e.id = ANY (CAST(:only AS bigint[])))
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        RETURNING id
    ), fired AS (
        DELETE FROM outbox_fanin_fired r USING pruned p WHERE r.event_id = p.id
    )
    SELECT id FROM pruned
    """
)
"""Delete up to ``:limit`` events routed more than ``:older_than`` seconds ago that have no
job left (all done and pruned). Events with a live or dead job stay. ``:skip`` and
``:only`` as in ``event_route_many``; returns the ids deleted. The fan-in records of the
events go with them (``fired``: ``outbox_fanin_fired`` by its key's first column), so a
record lives exactly as long as its event, and a replay, which needs the event, always
finds it."""

event_prune_candidates: TextClause = text(
    """
    SELECT e.id
    FROM outbox_events e
    WHERE e.routed_at IS NOT NULL
      AND e.routed_at < now() - make_interval(secs => :older_than)
      AND NOT EXISTS (SELECT 1 FROM outbox_jobs j WHERE j.event_id = e.id)
      AND e.id <> ALL (CAST(:skip AS bigint[]))
    LIMIT :limit
    """
)
"""Ids of the events ``event_prune_many`` would delete, none locked."""

event_unrouted_count: TextClause = text("SELECT count(*) FROM outbox_events WHERE routed_at IS NULL")

# -------------------------------------------------------------------------- intake

intake_known_many: TextClause = text(
    """
    SELECT identity FROM outbox_intake
    WHERE source = :source AND identity = ANY (CAST(:identities AS text[]))
    """
)
"""Which of ``:identities`` intake ``:source`` has taken in (or rejected) before."""

intake_record_many: TextClause = text(
    """
    INSERT INTO outbox_intake AS i (source, identity, event_id, problem, subject, headers, body, body_size)
    SELECT :source, r.identity, r.event_id, r.problem, r.subject, r.headers, r.body, r.body_size
    FROM unnest(CAST(:identities AS text[]), CAST(:event_ids AS bigint[]), CAST(:problems AS text[]),
                CAST(:subjects AS text[]), CAST(:headers AS jsonb[]), CAST(:bodies AS bytea[]),
                CAST(:body_sizes AS bigint[]))
         AS r(identity, event_id, problem, subject, headers, body, body_size)
    ON CONFLICT (source, identity) DO NOTHING
    RETURNING i.identity
    """
)
"""Record what intake ``:source`` took in: per identity the event it became (``problem``,
``subject``, ``headers``, ``body`` NULL), or why it was rejected and what it was (event id
NULL). An identity recorded meanwhile by another transaction (the same message taken in by
two relays at once) is not returned: the caller rolls back and runs the batch again, and
then finds it known (``intake_known_many``). Waits for such a transaction to end first."""

intake_prune_many: TextClause = text(
    """
    DELETE FROM outbox_intake
    WHERE ctid IN (
        SELECT ctid FROM outbox_intake
        WHERE problem IS NULL AND taken_at < now() - make_interval(secs => :older_than)
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)
"""Forget up to ``:limit`` messages taken in more than ``:older_than`` seconds ago (a
redelivery after that is taken in again). Rejected ones stay until an operator forgets
them (``intake_forget_rejected``)."""

intake_rejected_list: TextClause = text(
    """
    SELECT source, identity, taken_at, problem, subject, headers, body, body_size
    FROM outbox_intake
    WHERE problem IS NOT NULL AND (CAST(:source AS text) IS NULL OR source = :source)
    ORDER BY taken_at DESC, source, identity
    LIMIT :limit
    """
)
"""The latest ``:limit`` rejected messages, of intake ``:source`` (NULL: of every intake)."""

intake_forget_rejected: TextClause = text(
    """
    DELETE FROM outbox_intake
    WHERE problem IS NOT NULL AND source = :source
      AND (CAST(:identities AS text[]) IS NULL OR identity = ANY (CAST(:identities AS text[])))
    RETURNING identity
    """
)
"""Forget rejected messages of intake ``:source``: those of ``:identities`` (NULL: all). A
message forgotten is taken in again if its broker delivers it again."""

intake_lock_try: TextClause = text(
    """
    SELECT pg_try_advisory_lock(CAST(CAST(CAST('outbox_intake' AS regclass) AS oid) AS int), hashtext(:source)),
           pg_backend_pid()
    """
)
"""Try to take the session lock of an ordered intake ``:source`` (one relay at a time takes
it in); returns whether it was taken and this session's pid (for ``intake_lock_held``)."""

intake_lock_held: TextClause = text(
    """
    SELECT EXISTS (
        SELECT 1 FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND pid = :pid
          AND classid = CAST(CAST(CAST(CAST('outbox_intake' AS regclass) AS oid) AS int) AS oid)
          AND objid = CAST(CAST(hashtext(:source) AS bigint) & 4294967295 AS oid) AND objsubid = 2)
    """
)
"""Whether session ``:pid`` still holds ordered intake ``:source``'s lock: checked in each
take-in transaction, so a relay whose lock session was lost commits nothing more."""

intake_backlog: TextClause = text(
    """
    SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox_events WHERE routed_at IS NULL LIMIT :limit) e)
         + (SELECT count(*) FROM (
                SELECT 1 FROM outbox_jobs j
                WHERE j.status = 'ready'
                  AND (CAST(:topics AS text[]) IS NULL
                       OR j.consumer IN (SELECT s.consumer FROM outbox_subscriptions s
                                         WHERE s.topic = ANY (CAST(:topics AS text[]))))
                LIMIT :limit) j)
    """
)
"""How much waits, counted up to ``:limit`` of each kind: unrouted events, and ready jobs of
the consumers of ``:topics`` (NULL: of every consumer). An intake takes nothing while it is
at its ``max_backlog``."""

# --------------------------------------------------------------------- subscriptions

subscription_upsert_many: TextClause = text(
    """
    INSERT INTO outbox_subscriptions AS s
        (topic, consumer, max_attempts, lease_seconds, priority, transactional, ordered, on_dead, coalescing, fan_in,
         hooks)
    SELECT u.topic, u.consumer, u.max_attempts, u.lease_seconds, u.priority, u.transactional, u.ordered, u.on_dead,
           u.coalescing, u.fan_in, string_to_array(u.hooks, ',')
    FROM unnest(
        CAST(:topics AS text[]), CAST(:consumers AS text[]), CAST(:max_attempts AS int[]),
        CAST(:leases AS float8[]), CAST(:priorities AS smallint[]), CAST(:transactional AS bool[]),
        CAST(:ordered AS bool[]), CAST(:on_dead AS text[]), CAST(:coalesce AS bool[]), CAST(:fan_in AS bool[]),
        CAST(:hooks AS text[]))
        AS u(topic, consumer, max_attempts, lease_seconds, priority, transactional, ordered, on_dead, coalescing,
             fan_in, hooks)
    ON CONFLICT (topic, consumer) DO UPDATE
    SET max_attempts = EXCLUDED.max_attempts,
        lease_seconds = EXCLUDED.lease_seconds,
        priority = EXCLUDED.priority,
        transactional = EXCLUDED.transactional,
        ordered = EXCLUDED.ordered,
        on_dead = EXCLUDED.on_dead,
        coalescing = EXCLUDED.coalescing,
        fan_in = EXCLUDED.fan_in,
        hooks = EXCLUDED.hooks,
        updated_at = now()
    WHERE (s.max_attempts, s.lease_seconds, s.priority, s.transactional, s.ordered, s.on_dead, s.coalescing, s.fan_in,
           s.hooks)
          IS DISTINCT FROM
          (EXCLUDED.max_attempts, EXCLUDED.lease_seconds, EXCLUDED.priority, EXCLUDED.transactional,
           EXCLUDED.ordered, EXCLUDED.on_dead, EXCLUDED.coalescing, EXCLUDED.fan_in, EXCLUDED.hooks)
    RETURNING s.topic, s.consumer, s.max_attempts, s.lease_seconds, s.priority, s.transactional,
              s.ordered, s.on_dead, s.coalescing, s.fan_in, s.hooks, (s.xmax <> 0) AS updated
    """
)
"""Write the registry's (topic, consumer) pairs and their options; unchanged rows are left
alone. Other relays' subscriptions are never removed. ``:hooks[i]`` is the comma-separated
list of failure hooks consumer ``:consumers[i]`` declares (``''``: none). Returns the rows
inserted or changed; ``updated`` is true for an existing subscription whose options changed
(a non-zero ``xmax`` marks the ON CONFLICT update)."""

consumer_upsert_many: TextClause = text(
    """
    INSERT INTO outbox_consumers AS c (consumer, concurrency, rate_limit)
    SELECT * FROM unnest(CAST(:consumers AS text[]), CAST(:concurrency AS int[]), CAST(:rate_limits AS float8[]))
    ON CONFLICT (consumer) DO UPDATE
    SET concurrency = EXCLUDED.concurrency,
        rate_limit = EXCLUDED.rate_limit,
        updated_at = now()
    WHERE (c.concurrency, c.rate_limit) IS DISTINCT FROM (EXCLUDED.concurrency, EXCLUDED.rate_limit)
    RETURNING c.consumer, c.concurrency, c.rate_limit, (c.xmax <> 0) AS updated
    """
)
"""Write the registry's flow-control options (concurrency cap, rate limit in claims per
second; NULL: none) to ``outbox_consumers``; the paused state and the rate limit's bucket
are left alone, so a relay start never resumes a paused consumer. Returns the rows
inserted or changed; ``updated`` as for ``subscription_upsert_many``."""

consumer_pause: TextClause = text(
    """
    WITH before AS (SELECT paused_at FROM outbox_consumers WHERE consumer = :consumer)
    INSERT INTO outbox_consumers AS c (consumer, paused_at)
    VALUES (:consumer, now())
    ON CONFLICT (consumer) DO UPDATE
    SET paused_at = coalesce(c.paused_at, now()), updated_at = now()
    RETURNING c.paused_at, (SELECT paused_at FROM before) AS was_paused_at, (c.xmax = 0) AS created
    """
)
"""Pause ``:consumer`` (``outbox-relay pause``): no claim by any relay takes its jobs once
this commits; routing goes on. Creates the consumer's row when no relay declared it yet
(no cap, no limit), so a consumer can be paused before it is deployed. Returns when it was
paused, when it had been paused before (NULL: it was not) and whether the row is new. A
claim in flight holding the row (``consumer_lock_limited_many``) makes this wait for it."""

consumer_resume: TextClause = text(
    """
    WITH before AS (SELECT consumer, paused_at FROM outbox_consumers WHERE consumer = :consumer FOR UPDATE)
    UPDATE outbox_consumers c
    SET paused_at = NULL, updated_at = now()
    FROM before b
    WHERE c.consumer = b.consumer
    RETURNING b.paused_at AS was_paused_at
    """
)
"""Resume ``:consumer`` (``outbox-relay resume``): claims take its jobs again. Returns when
it had been paused (NULL: it was not); no row when the consumer has no row at all."""

consumer_list: TextClause = text(
    """
    SELECT c.consumer, c.concurrency, c.rate_limit, c.paused_at,
           (SELECT count(*) FROM outbox_jobs j WHERE j.status = 'running' AND j.consumer = c.consumer) AS running
    FROM outbox_consumers c
    ORDER BY c.consumer
    """
)
"""Every consumer's flow control (cap, rate limit in claims per second, paused since) with its
running jobs, for ``outbox-relay status``."""

consumer_lock_limited_many: TextClause = text(
    """
    SELECT c.consumer, c.rate_limit,
           CASE WHEN c.rate_limit IS NULL THEN NULL
                WHEN c.refilled_at IS NULL THEN greatest(1, c.rate_limit)
                ELSE least(greatest(1, c.rate_limit), c.tokens + c.rate_limit
                           * greatest(0, extract(epoch FROM statement_timestamp() - c.refilled_at)))
           END AS tokens
    FROM outbox_consumers c
    WHERE c.consumer = ANY (CAST(:consumers AS text[]))
      AND c.paused_at IS NULL
      AND (c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)
    ORDER BY c.consumer
    FOR UPDATE
    """
)
"""The first statement of a limited claim's transaction: lock the rows of those of
``:consumers`` that have a cap or a rate limit and are not paused, in consumer order (two
relays never deadlock), waiting for a relay that holds them. Returns (consumer, rate
limit, tokens the bucket would hold now, NULL without a rate limit); the rows as locked are
their newest versions, so the pause check holds. ``job_claim_limited_many`` follows in the
same transaction (architecture notes, "Flow control", for why it is a second statement)."""

subscription_delete: TextClause = text(
    "DELETE FROM outbox_subscriptions WHERE consumer = :consumer RETURNING topic"
)
"""Remove a consumer's subscriptions (``outbox-relay unsubscribe``); its existing jobs stay."""

subscription_list: TextClause = text(
    "SELECT topic, consumer, max_attempts, lease_seconds, priority, transactional"
    " FROM outbox_subscriptions ORDER BY topic, consumer"
)

# ------------------------------------------------------------------------------ jobs
#
# Each statement below is written out whole. Where several share a piece, the piece is a CTE
# with one purpose, named alike in each and copied word for word (a unit test keeps the
# copies identical); its notes are here, once:
#
# * ``wanted`` (the claims): the consumers asked for and the lease of each, in seconds.
# * The main claims' pick (``picked`` of ``job_claim_many`` and ``job_claim_after_many``)
#   leaves out the consumers no main claim takes (flow control, architecture notes "Flow
#   control"): ``consumer NOT IN (SELECT c.consumer FROM outbox_consumers c WHERE ...)``,
#   paused ones and those with a concurrency cap or a rate limit, which the limited claim
#   (``job_claim_limited_many``) takes instead; ``job_claim_candidates`` has the same test.
#   ``NOT IN`` a subquery becomes a hashed SubPlan over a table of a few rows, built once per
#   statement and probed as a filter, which the planner rates at half the rows: the claim
#   keeps reading ``ix_outbox_jobs_ready`` in order. ``consumer <> ALL (ARRAY(SELECT ...))``
#   was rated at a thousandth of the rows, and with 13,000 ready jobs the planner then sorted
#   a sequential scan of the table instead. The picks lock ``FOR NO KEY UPDATE`` (not ``FOR
#   UPDATE``): the lock an UPDATE of non-key columns takes anyway; two claims still skip each
#   other's rows, but a router's ``FOR KEY SHARE`` on an ordered key's head neither blocks a
#   claim nor waits for one (``event_route_many`` says why).
# * The claim's ``UPDATE outbox_jobs j SET status = 'running' ...`` (the body of
#   ``job_claim_many``, the ``claimed`` CTE of the others, which also return ``j.priority,
#   j.run_at``): ``running``, ``attempts + 1``, a new fence, the lease. It finds its rows by
#   ``j.id = ANY (ARRAY(SELECT id FROM picked))`` and has no ``j.status = 'ready'``: the
#   array is computed once (an InitPlan), and with no ``status`` condition the only index
#   that serves ``j`` is the primary key, so the update costs one index probe per picked row
#   whatever the statistics say. Joined to ``picked`` with the status condition, a planner
#   that believed no job was ready (statistics taken before a redrive, a retry or a bulk
#   insert) chose a nested loop that scanned every ready job once per picked row: 1.7 s for
#   a claim of 50 with 100,000 ready. ``picked`` locks its rows, which re-checks ``status =
#   'ready'`` on the row's newest version, so the condition added nothing. The payload and
#   headers come back as the text PostgreSQL stores: the job decodes them on first use (the
#   same json.loads the driver's jsonb loader runs), so a forwarder can send the payload's
#   exact bytes and a handler that never reads them does not decode them.
# * ``locked`` (heartbeat, completion, failure, release, snooze): the running jobs given by
#   ``args`` (id, fence), locked in id order, with ``cancel_requested`` as the lock read it
#   (the row's newest version, which nobody changes while the lock is held). Found by
#   primary key, whatever the statistics: ``j.id = ANY (ARRAY(...))`` is an InitPlan probed
#   through ``pk_outbox_jobs``, and ``(j.status = 'running') IS TRUE`` (status is NOT NULL:
#   the same test) is a condition the planner cannot match to the partial index
#   ``ix_outbox_jobs_lease`` (``WHERE status = 'running'``). Written ``j.status =
#   'running'``, the generic plan of the prepared statement (psycopg prepares it after five
#   runs) took that index as small and read every running job for the lock step, then again
#   once per job for the UPDATE (loops = the batch): 17.6 ms for 50 completions with 300
#   jobs running, against 1-2 ms by primary key (performance notes, "Issue 14"; found by the
#   ceiling scenario's lean completion). The UPDATEs that follow it say ``(j.status =
#   'running') IS TRUE`` for the same reason.
# * ``kept``, ``deleted``, ``completed`` (``job_complete_many``, after ``args`` and ``locked``):
#   each job (id, fence) still running under that fence becomes ``done`` (``cancelled``
#   when an operator asked to cancel it while it ran), or with ``:keep_done`` false is
#   deleted instead (``retention_done = 0``: no done row is written, so none is pruned
#   later; a cancelled one is still kept). Both parts lock nothing new and touch disjoint
#   rows: ``locked`` holds every row first and read its ``cancel_requested``, which the two
#   parts split on. With ``:keep_done`` a parameter, a prepared generic plan turns the
#   delete into a one-time filter when done jobs are kept; when they are not, the update's
#   test falls on ``locked`` alone, so the update probes no row unless one was cancelled.
# * ``listed``: the fences of a claim's jobs that start later, so the relay's row lists them
#   as buffered (``marked``): every job of a forwarder in ``:forwarding`` (its attempt starts
#   when the forwarder hands its message to the broker, after the starter unlisted it: issue
#   26) and, of the other jobs in claim order, all but the first ``:start_now``, which go at
#   once to the worker slots the dispatcher reserved for them. A claim of at most
#   ``claim_batch`` rows: the window function sorts them in memory.
# * ``marked``: this relay's row (``:relay``; no row, no write) gains the ``listed`` fences.
# * ``history`` (attempt history; architecture notes, "Attempt history"): every statement that
#   ends a started attempt other than as ``done`` appends one entry to the JSON array, the
#   same expression in each: ``jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98
#   to last]') || jsonb_build_array(jsonb_build_object('attempt', j.attempts, 'started_at',
#   j.started_at, 'ended_at', now(), 'relay', j.locked_by, 'outcome', ..., 'error', ...))``:
#   the newest 99 entries and the new one, so at most :data:`HISTORY_KEPT`. A SET reads the
#   row as it was, so ``j.attempts`` is the attempt that ended (before a release or a snooze
#   gives it back). The outcome names the status the attempt left the job in: ``failed``,
#   ``timed out``, ``lease expired``, ``snoozed``, ``released`` (all back to ``ready``),
#   ``dead``, ``cancelled``. A claim its relay still lists as buffered never started: the
#   reaper and the release append nothing for it. A done attempt appends nothing (the row is
#   its record), so the claim's ``started_at = now()`` is all the done path pays.

#: Most entries ``outbox_jobs.history`` keeps, the newest: each statement that appends one
#: keeps the newest 99 (``'$[last - 98 to last]'``) and adds it (a unit test holds the two
#: together). A job may fail up to ``max_attempts`` times and snooze without end; 100 entries
#: of at most ``MAX_ERROR_CHARS`` of error each bound the JSON rewritten by each append.
HISTORY_KEPT = 100

job_claim_many: TextClause = text(
    """
    WITH wanted AS (
        SELECT *
        FROM unnest(CAST(:consumers AS text[]), CAST(:leases AS float8[])) AS w(consumer, lease_seconds)
    ), picked AS (
        SELECT id
        FROM outbox_jobs
        WHERE status = 'ready'
          AND run_at <= now()
          AND consumer = ANY (CAST(:consumers AS text[]))
          AND consumer NOT IN (
              SELECT c.consumer FROM outbox_consumers c
              WHERE c.paused_at IS NOT NULL OR c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)
        ORDER BY priority, run_at, id
        LIMIT :limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE outbox_jobs j
    SET status = 'running',
        attempts = j.attempts + 1,
        fence = nextval('outbox_fence_seq'),
        lease_until = now() + make_interval(secs => w.lease_seconds),
        locked_by = :worker,
        started_at = now(),
        updated_at = now()
    FROM wanted w, outbox_events e
    WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
      AND w.consumer = j.consumer
      AND e.id = j.event_id
    RETURNING j.id, j.event_id, j.consumer, j.attempts, j.max_attempts, j.fence, j.lease_until,
              e.topic, e.key, CAST(e.payload AS text) AS payload, CAST(e.headers AS text) AS headers,
              e.created_at AS event_created_at
    """
)
"""Claim up to ``:limit`` due ready jobs of ``:consumers`` (lease ``:leases[i]`` seconds for
``:consumers[i]``): ``running``, ``attempts + 1``, a new fence from ``outbox_fence_seq``,
``lease_until = now() + lease``, ``started_at = now()`` (when this attempt began; a
prefetched job's handler may start later: architecture notes, "Attempt history"). Returns
the job and its event. Consumers that are paused,
capped or rate-limited in ``outbox_consumers`` are left out (``job_claim_limited_many``
claims the last two; architecture notes, "Flow control"): a pause holds for every claim
whose snapshot is taken after it committed."""

job_heartbeat_many: TextClause = text(
    """
    WITH args AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[]), CAST(:leases AS float8[]))
            AS a(id, fence, lease_seconds)
    ), locked AS (
        SELECT j.id, j.cancel_requested
        FROM outbox_jobs j
        JOIN args a ON a.id = j.id AND a.fence = j.fence
        WHERE j.id = ANY (ARRAY(SELECT id FROM args))
          AND (j.status = 'running') IS TRUE
        ORDER BY j.id
        FOR UPDATE OF j
    )
    UPDATE outbox_jobs j
    SET lease_until = now() + make_interval(secs => a.lease_seconds),
        updated_at = now()
    FROM locked l, args a
    WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
    RETURNING j.id, j.fence, j.cancel_requested
    """
)
"""Renew the leases of many running jobs in one statement. A claim (id, fence) missing
from the result has lost its lease (reaped, re-claimed or released): its worker must stop.
``cancel_requested`` says an operator asked to cancel the job (``job_cancel_many``): the
handler is told through ``job.cancel_requested``."""

job_complete_many: TextClause = text(
    """
    WITH args AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[])) AS a(id, fence)
    ), locked AS (
        SELECT j.id, j.cancel_requested
        FROM outbox_jobs j
        JOIN args a ON a.id = j.id AND a.fence = j.fence
        WHERE j.id = ANY (ARRAY(SELECT id FROM args))
          AND (j.status = 'running') IS TRUE
        ORDER BY j.id
        FOR UPDATE OF j
    ), kept AS (
        UPDATE outbox_jobs j
        SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'done' END,
            lease_until = NULL, finished_at = now(), updated_at = now(),
            history = CASE WHEN NOT j.cancel_requested THEN j.history
                           ELSE jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                                || jsonb_build_array(jsonb_build_object(
                                    'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(),
                                    'relay', j.locked_by, 'outcome', 'cancelled', 'error', NULL)) END
        FROM locked l, args a
        WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
          AND (CAST(:keep_done AS boolean) OR l.cancel_requested)
        RETURNING j.id, j.event_id, j.fan_in
    ), deleted AS (
        DELETE FROM outbox_jobs j
        USING locked l, args a
        WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
          AND NOT CAST(:keep_done AS boolean) AND NOT l.cancel_requested
        RETURNING j.id, j.event_id, j.fan_in
    ), completed AS (
        SELECT id, event_id, fan_in FROM kept UNION ALL SELECT id, event_id, fan_in FROM deleted
    ), fan_in_locked AS MATERIALIZED (
        SELECT pg_advisory_xact_lock(CAST(CAST(CAST('outbox_fanin_fired' AS regclass) AS oid) AS int), f.lock_key)
        FROM (SELECT DISTINCT CAST(c.event_id & 2147483647 AS int) AS lock_key FROM completed c WHERE c.fan_in
              ORDER BY 1) f
    )
    SELECT id FROM completed
    WHERE (SELECT count(*) FROM fan_in_locked) >= 0
    """
)
"""Mark many jobs done, each only if it still holds the given fence and is running
(``cancelled`` instead when an operator asked to cancel it while it ran); with
``:keep_done`` false a done job is deleted instead of kept (``retention_done = 0``). Jobs
missing from the result were stale reports and changed nothing. A done job's attempt adds
nothing to ``history``: the row itself is its last attempt (``started_at``,
``finished_at``, ``locked_by``); a cancelled one's appends its entry (``cancelled``: the
notes on ``history`` before ``job_claim_many``).

``fan_in_locked``: the fan-in locks of the events of the listed jobs it completed
(``fan_in``), taken in key order, in a materialized CTE read as the final SELECT's one-time
filter: after the rows changed, before the statement's AFTER triggers fire, so the fan-in
trigger (:mod:`outbox.db.fan_in`) finds each event's lock held and two batches never take
two events' locks in opposite orders. No listed job, no lock: one sort of nothing."""

job_claim_after_many: TextClause = text(
    """
    WITH wanted AS (
        SELECT *
        FROM unnest(CAST(:consumers AS text[]), CAST(:leases AS float8[])) AS w(consumer, lease_seconds)
    ), picked AS (
        SELECT id
        FROM outbox_jobs
        WHERE status = 'ready'
          AND run_at <= now()
          AND consumer = ANY (CAST(:consumers AS text[]))
          AND consumer NOT IN (
              SELECT c.consumer FROM outbox_consumers c
              WHERE c.paused_at IS NOT NULL OR c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)
          AND (priority, run_at, id) > (CAST(:after_priority AS smallint), CAST(:after_run_at AS timestamptz),
                                        CAST(:after_id AS bigint))
          AND id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR id = ANY (CAST(:only AS bigint[])))
        ORDER BY priority, run_at, id
        LIMIT :limit
        FOR NO KEY UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE outbox_jobs j
        SET status = 'running',
            attempts = j.attempts + 1,
            fence = nextval('outbox_fence_seq'),
            lease_until = now() + make_interval(secs => w.lease_seconds),
            locked_by = :worker,
            started_at = now(),
            updated_at = now()
        FROM wanted w, outbox_events e
        WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
          AND w.consumer = j.consumer
          AND e.id = j.event_id
        RETURNING j.id, j.event_id, j.consumer, j.attempts, j.max_attempts, j.fence, j.lease_until,
                  e.topic, e.key, CAST(e.payload AS text) AS payload, CAST(e.headers AS text) AS headers,
                  e.created_at AS event_created_at, j.priority, j.run_at
    ), listed AS (
        SELECT x.fence
        FROM (SELECT c.fence, c.consumer = ANY (CAST(:forwarding AS text[])) AS forwarded,
                     row_number() OVER (PARTITION BY c.consumer = ANY (CAST(:forwarding AS text[]))
                                        ORDER BY c.priority, c.run_at, c.id) AS place
              FROM claimed c) x
        WHERE x.forwarded OR x.place > :start_now
    ), marked AS (
        UPDATE outbox_relays r
        SET buffered = r.buffered || ARRAY(SELECT fence FROM listed),
            last_seen_at = now()
        WHERE r.id = :relay
          AND EXISTS (SELECT 1 FROM listed)
        RETURNING 1
    )
    SELECT * FROM claimed
    """
)
"""The runner's claim: ``job_claim_many`` (same columns, plus ``priority`` and ``run_at``: with
``id``, the claim-order key) starting after the key ``(:after_priority, :after_run_at,
:after_id)`` (pass ``(-32768, '-infinity', 0)`` to start at the head), leaving out the ids in
``:skip`` (quarantined poison rows, usually none) and, unless ``:only`` is NULL, taking only
jobs whose id it lists (the poison handling's bisection; :mod:`outbox.db.poison`). A
runner that remembers the last key it claimed skips the index entries of the jobs claimed
before, which a long-held snapshot elsewhere keeps from being removed (performance notes).

It also updates this relay's row of ``outbox_relays`` (``:relay``; no row, no write): the
fences of the claimed jobs that start later join ``buffered`` (``listed``: every job of a
forwarder in ``:forwarding``, and of the others all but the first ``:start_now`` in claim
order, which go to idle workers); the starter takes jobs off it with ``relay_buffer_remove``
before it hands them over (to a worker, or to the forwarder, which sends at once). So the
list the reaper reads (``job_reap_many``) never holds a job whose handler may have started
or whose message may have been sent, and every buffered claim is listed from the moment it
exists. It is changed, never overwritten: a claim whose reply never reached the relay (the
connection broke after the commit) stays listed, so the reaper gives it its attempt back;
the relay's periodic ``relay_seen`` drops fences no longer running under it.

A runner with finished jobs sends ``job_complete_many`` first and this second, in one
transaction and, where the driver allows, one round trip (psycopg's pipeline mode; the
runner's ``complete_and_claim_after``). The completion has then taken every lock
it waits for before this statement locks a row, and this statement's snapshot sees the
completed jobs finished, so it never claims one of them. The claim skips locked rows, so it
never waits."""

job_claim_limited_many: TextClause = text(
    """
    WITH wanted AS (
        SELECT *
        FROM unnest(CAST(:consumers AS text[]), CAST(:leases AS float8[])) AS w(consumer, lease_seconds)
    ), refill AS (
        SELECT c.consumer, c.concurrency, c.rate_limit,
               CASE WHEN c.rate_limit IS NULL THEN NULL
                    WHEN c.refilled_at IS NULL THEN greatest(1, c.rate_limit)
                    ELSE least(greatest(1, c.rate_limit), c.tokens + c.rate_limit
                               * greatest(0, extract(epoch FROM statement_timestamp() - c.refilled_at)))
               END AS tokens
        FROM outbox_consumers c
        JOIN wanted w ON w.consumer = c.consumer
        WHERE c.paused_at IS NULL
    ), allowed AS (
        SELECT r.consumer, r.rate_limit, r.tokens,
               greatest(0, least(
                   coalesce(r.concurrency - (SELECT count(*) FROM outbox_jobs j
                                             WHERE j.status = 'running' AND j.consumer = r.consumer), :limit),
                   coalesce(floor(r.tokens), :limit),
                   :limit)) AS allowance
        FROM refill r
    ), picked AS (
        SELECT p.id
        FROM allowed a
        CROSS JOIN LATERAL (
            SELECT j.id, j.priority, j.run_at
            FROM outbox_jobs j
            WHERE j.status = 'ready' AND j.run_at <= now() AND j.consumer = a.consumer
            ORDER BY j.priority, j.run_at, j.id
            LIMIT a.allowance
            FOR NO KEY UPDATE SKIP LOCKED
        ) p
        ORDER BY p.priority, p.run_at, p.id
        LIMIT :limit
    ), claimed AS (
        UPDATE outbox_jobs j
        SET status = 'running',
            attempts = j.attempts + 1,
            fence = nextval('outbox_fence_seq'),
            lease_until = now() + make_interval(secs => w.lease_seconds),
            locked_by = :worker,
            started_at = now(),
            updated_at = now()
        FROM wanted w, outbox_events e
        WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
          AND w.consumer = j.consumer
          AND e.id = j.event_id
        RETURNING j.id, j.event_id, j.consumer, j.attempts, j.max_attempts, j.fence, j.lease_until,
                  e.topic, e.key, CAST(e.payload AS text) AS payload, CAST(e.headers AS text) AS headers,
                  e.created_at AS event_created_at, j.priority, j.run_at
    ), taken AS (
        UPDATE outbox_consumers c
        SET tokens = a.tokens - (SELECT count(*) FROM claimed x WHERE x.consumer = c.consumer),
            refilled_at = statement_timestamp()
        FROM allowed a
        WHERE c.consumer = a.consumer AND a.rate_limit IS NOT NULL
        RETURNING 1
    ), listed AS (
        SELECT x.fence
        FROM (SELECT c.fence, c.consumer = ANY (CAST(:forwarding AS text[])) AS forwarded,
                     row_number() OVER (PARTITION BY c.consumer = ANY (CAST(:forwarding AS text[]))
                                        ORDER BY c.priority, c.run_at, c.id) AS place
              FROM claimed c) x
        WHERE x.forwarded OR x.place > :start_now
    ), marked AS (
        UPDATE outbox_relays r
        SET buffered = r.buffered || ARRAY(SELECT fence FROM listed),
            last_seen_at = now()
        WHERE r.id = :relay
          AND EXISTS (SELECT 1 FROM listed)
        RETURNING 1
    )
    SELECT * FROM claimed
    """
)
"""The second statement of a limited claim's transaction, after ``consumer_lock_limited_many``
locked ``:consumers`` (lease ``:leases[i]`` seconds for ``:consumers[i]``): its snapshot is
taken after the lock, so it sees every claim committed by a relay that held the lock
before. Per consumer it refills the token bucket (rate r per second, capacity max(1, r),
by ``statement_timestamp()``; a new bucket starts full), computes the allowance =
min(concurrency - running jobs, floor(tokens), ``:limit``) (a missing cap or limit bounds
nothing), claims up to it in claim order (priority, run_at, id; ``FOR NO KEY UPDATE SKIP LOCKED``),
``:limit`` in all, exactly as ``job_claim_many`` sets a claim (running, attempts + 1, new
fence, lease), takes one token per claimed job and, like ``job_claim_after_many``, lists
the claims that start later (every forwarder's job in ``:forwarding``, the others after the
first ``:start_now`` in claim order) as buffered in relay ``:relay``'s row of ``outbox_relays``. Returns the claimed rows as ``job_claim_after_many`` does (columns
of ``job_claim_many`` plus ``priority``, ``run_at``)."""

job_complete: TextClause = text(
    """
    WITH handler AS (
        SELECT current_setting('outbox.handler_fence', true) IS NOT DISTINCT FROM CAST(:fence AS text)
            AS same_transaction
    ), locked AS (
        SELECT id, cancel_requested FROM outbox_jobs
        WHERE id = :id AND fence = :fence AND status = 'running' AND (SELECT same_transaction FROM handler)
        FOR UPDATE
    ), kept AS (
        UPDATE outbox_jobs
        SET status = 'done', lease_until = NULL, finished_at = now(), updated_at = now()
        WHERE id IN (SELECT id FROM locked WHERE CAST(:keep_done AS boolean) AND NOT cancel_requested)
          AND fence = :fence AND status = 'running'
        RETURNING id
    ), deleted AS (
        DELETE FROM outbox_jobs
        WHERE id IN (SELECT id FROM locked WHERE NOT CAST(:keep_done AS boolean) AND NOT cancel_requested)
          AND fence = :fence AND status = 'running'
        RETURNING id
    ), completed AS (
        SELECT id FROM kept UNION ALL SELECT id FROM deleted
    )
    SELECT (SELECT same_transaction FROM handler) AS same_transaction,
           (SELECT count(*) FROM completed) AS completed,
           coalesce((SELECT cancel_requested FROM locked), false) AS cancel_requested
    """
)
"""Mark one job done (``:keep_done`` false: delete it; ``job_complete_many`` says how) if
it still holds ``:fence``, inside a transactional handler's transaction: ``completed`` 0 (the claim is no longer this worker's) rolls the handler's
writes back. ``same_transaction`` says whether this is still the transaction the handler's
first statement (``job_transaction_limits_set_local``) began: that statement set
``outbox.handler_fence`` to the fence for the transaction only, so a handler that ended its
transaction itself (a raw ``COMMIT`` or ``ROLLBACK``, closing its session) is caught here,
before the completion could commit in a transaction of its own; then nothing is marked.

``cancel_requested`` true (and ``completed`` 0) says an operator asked to cancel the job
(``job_cancel_many``): nothing is marked, the caller rolls the handler's transaction back
and records the cancel in a transaction of its own (``job_cancel_claimed``), so a
``cancelled`` job never committed its handler's writes (architecture notes, "The handler's
transaction"). The row lock decides the race with the cancel: ``locked`` reads
``cancel_requested`` on the row's newest version once it holds the row, so a cancel that
committed first is seen (READ COMMITTED re-reads a row it waited for), and a cancel that
comes while this transaction holds the row waits for its commit and finds the job ``done``
(or gone), no longer ``running``."""

job_cancel_claimed: TextClause = text(
    """
    UPDATE outbox_jobs j
    SET status = 'cancelled', lease_until = NULL, finished_at = now(), updated_at = now(),
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(),
                      'relay', j.locked_by, 'outcome', 'cancelled', 'error', NULL))
    WHERE j.id = :id AND j.fence = :fence AND j.status = 'running' AND j.cancel_requested
    RETURNING j.id
    """
)
"""Record ``cancelled`` for one claimed job (fenced) an operator asked to cancel, whose
transactional handler's transaction was just rolled back because of it (``job_complete``
returned ``cancel_requested``): its own short transaction, after the rollback, so nothing of
the handler's is committed with it. Attempts and ``last_error`` stay as they are. No row:
the claim was lost meanwhile (reaped, which records ``cancelled`` itself)."""

job_fail_many: TextClause = text(
    """
    WITH args AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[]),
                             CAST(:delays AS float8[]), CAST(:permanent AS bool[]),
                             CAST(:errors AS text[]), CAST(:timed_out AS bool[]))
            AS a(id, fence, delay_seconds, permanent, error, timed_out)
    ), locked AS (
        SELECT j.id, j.cancel_requested
        FROM outbox_jobs j
        JOIN args a ON a.id = j.id AND a.fence = j.fence
        WHERE j.id = ANY (ARRAY(SELECT id FROM args))
          AND (j.status = 'running') IS TRUE
        ORDER BY j.id
        FOR UPDATE OF j
    )
    UPDATE outbox_jobs j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN a.permanent OR j.attempts >= j.max_attempts THEN 'dead'
                      WHEN j.superseded_by IS NOT NULL THEN 'superseded' ELSE 'ready' END,
        run_at = CASE WHEN j.cancel_requested OR a.permanent OR j.attempts >= j.max_attempts THEN j.run_at
                      ELSE now() + make_interval(secs => a.delay_seconds) END,
        finished_at = CASE WHEN j.cancel_requested OR a.permanent OR j.attempts >= j.max_attempts
                                OR j.superseded_by IS NOT NULL THEN now() END,
        ordering_key = CASE WHEN j.superseded_by IS NOT NULL
                                 AND NOT (j.cancel_requested OR a.permanent OR j.attempts >= j.max_attempts) THEN NULL
                            WHEN (a.permanent OR j.attempts >= j.max_attempts) AND j.ordering_key IS NOT NULL
                                 AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = j.consumer AND s.on_dead = 'skip')
                            THEN NULL ELSE j.ordering_key END,
        lease_until = NULL,
        last_error = a.error,
        updated_at = now(),
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(), 'relay', j.locked_by,
                      'outcome', CASE WHEN j.cancel_requested THEN 'cancelled'
                                      WHEN a.permanent OR j.attempts >= j.max_attempts THEN 'dead'
                                      WHEN a.timed_out THEN 'timed out' ELSE 'failed' END,
                      'error', a.error))
    FROM locked l, args a
    WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
    RETURNING j.id, j.status
    """
)
"""Record failed attempts: back to ``ready`` at ``now() + delay`` while attempts remain,
else (or when ``permanent``) ``dead``; ``cancelled`` instead of either when an operator asked
to cancel the job while it ran (``cancel_requested``, ``job_cancel_many``). Fenced; returns
(id, new status) of rows changed. A
job of an ordered consumer declared ``on_dead='skip'`` drops its ``ordering_key`` as it dies,
so it no longer holds its key back (``job_promote_many`` then lets the next one go); under
``'block'`` it keeps it (architecture notes, "Ordering"). Each appends its attempt to
``history`` with the error: ``failed``, or ``timed out`` when ``:timed_out`` says the
handler ran past its timeout, when it goes back to ``ready``; ``dead`` or ``cancelled``
when it ends so.

Coalescing (architecture notes, "Coalescing"): a job whose ``superseded_by`` the router set while it ran
(a newer event of its key was routed) ends ``superseded`` instead of going back to
``ready``, and leaves its ordered key (``ordering_key`` NULL), so the newer job's promotion
goes on; ``dead`` and ``cancelled`` stay as they are. The router sets the mark holding the
row, so this statement, which locks it first, either waits for the router's commit and
reads the mark, or commits first and the router supersedes the job it finds ready."""

job_release_many: TextClause = text(
    """
    WITH args AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[])) AS a(id, fence)
    ), locked AS (
        SELECT j.id, j.cancel_requested
        FROM outbox_jobs j
        JOIN args a ON a.id = j.id AND a.fence = j.fence
        WHERE j.id = ANY (ARRAY(SELECT id FROM args))
          AND (j.status = 'running') IS TRUE
        ORDER BY j.id
        FOR UPDATE OF j
    )
    UPDATE outbox_jobs j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN j.superseded_by IS NOT NULL THEN 'superseded' ELSE 'ready' END,
        finished_at = CASE WHEN j.cancel_requested OR j.superseded_by IS NOT NULL THEN now() END,
        ordering_key = CASE WHEN j.superseded_by IS NULL OR j.cancel_requested THEN j.ordering_key END,
        attempts = j.attempts - 1, lease_until = NULL, updated_at = now(),
        history = CASE WHEN EXISTS (SELECT 1 FROM outbox_relays r WHERE r.id = j.locked_by AND j.fence = ANY (r.buffered))
                       THEN j.history
                       ELSE jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                            || jsonb_build_array(jsonb_build_object(
                                'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(),
                                'relay', j.locked_by,
                                'outcome', CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'released' END,
                                'error', NULL)) END
    FROM locked l, args a
    WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
    RETURNING j.id
    """
)
"""Hand claimed jobs back at once (shutdown): ``ready``, and the attempt is not counted,
since the handler did not fail. ``run_at`` is kept (it is already due: the job was
claimed), so the job keeps its place at the head of the queue instead of waiting behind
every job that became due while it ran. A job an operator asked to cancel while it ran
(``cancel_requested``) is ``cancelled`` instead. Fenced. The attempt is appended to
``history`` (``released`` or ``cancelled``) unless its relay still lists the claim as
buffered (``outbox_relays.buffered``, as the reaper reads it): a claim handed back from the
prefetch buffer never started, and leaves no entry. A job marked ``superseded_by`` while it
ran (coalescing, as in ``job_fail_many``) ends ``superseded`` and leaves its ordered key."""

job_snooze_many: TextClause = text(
    """
    WITH args AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[]), CAST(:delays AS float8[]))
            AS a(id, fence, delay_seconds)
    ), locked AS (
        SELECT j.id, j.cancel_requested
        FROM outbox_jobs j
        JOIN args a ON a.id = j.id AND a.fence = j.fence
        WHERE j.id = ANY (ARRAY(SELECT id FROM args))
          AND (j.status = 'running') IS TRUE
        ORDER BY j.id
        FOR UPDATE OF j
    )
    UPDATE outbox_jobs j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN j.superseded_by IS NOT NULL THEN 'superseded' ELSE 'ready' END,
        finished_at = CASE WHEN j.cancel_requested OR j.superseded_by IS NOT NULL THEN now() END,
        ordering_key = CASE WHEN j.superseded_by IS NULL OR j.cancel_requested THEN j.ordering_key END,
        attempts = j.attempts - 1, snoozes = j.snoozes + 1,
        run_at = now() + make_interval(secs => a.delay_seconds), lease_until = NULL, updated_at = now(),
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(), 'relay', j.locked_by,
                      'outcome', CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'snoozed' END, 'error', NULL))
    FROM locked l, args a
    WHERE j.id = l.id AND a.id = j.id AND j.fence = a.fence AND (j.status = 'running') IS TRUE
    RETURNING j.id
    """
)
"""Snoozed jobs (the handler raised ``Snooze(seconds)``): back to ``ready`` at ``now() +
delay``, the attempt given back (``attempts - 1``) and ``snoozes + 1``; ``last_error``
kept; ``cancelled`` instead when an operator asked to cancel the job while it ran. Fenced;
returns the ids of rows changed. The attempt is appended to ``history`` (``snoozed`` or
``cancelled``, no error), under the number it had: the next claim runs that number again.
A job marked ``superseded_by`` while it ran (coalescing, as in ``job_fail_many``) ends
``superseded`` and leaves its ordered key."""

jobs_notify_head: TextClause = text("SELECT pg_notify(:channel, 'head')")
"""Tell every relay listening on ``:channel`` (the schema's jobs channel) that ready jobs
now sort before the key its dispatcher claims after (released or reaped jobs keep their
early ``run_at``), so each claims from the head of the queue next instead of after its
hint. A hint like the routing NOTIFY: for a relay that misses it, its look-out finds the
jobs within ``HEAD_SECONDS`` (:class:`outbox.relay.notify.Lookout`) anyway."""

job_first_ready_before: TextClause = text(
    """
    SELECT priority, run_at, id
    FROM outbox_jobs
    WHERE status = 'ready'
      AND run_at <= now()
      AND consumer = ANY (CAST(:consumers AS text[]))
      AND consumer NOT IN (
          SELECT c.consumer FROM outbox_consumers c
          WHERE c.paused_at IS NOT NULL OR c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)
      AND (priority, run_at, id) < (CAST(:before_priority AS smallint), CAST(:before_run_at AS timestamptz),
                                    CAST(:before_id AS bigint))
      AND id <> ALL (CAST(:skip AS bigint[]))
    ORDER BY priority, run_at, id
    LIMIT 1
    """
)
"""The claim-order key ``(priority, run_at, id)`` of the first due ready job of
``:consumers`` that the main claims take (not paused, capped or rate-limited), sorting
before ``(:before_priority, :before_run_at, :before_id)`` (the runner's claim hint) and
not among the quarantined ids ``:skip``; no row when there is none. Locks nothing. The
runner's look-out runs it on a connection of its own (:class:`outbox.relay.notify.Lookout`):
it finds what no notification announced, whose scan reads through the index entries of
every job claimed since the oldest snapshot began, off the claiming path."""

job_claim_candidates: TextClause = text(
    """
    SELECT id FROM outbox_jobs
    WHERE status = 'ready'
      AND run_at <= now()
      AND consumer = ANY (CAST(:consumers AS text[]))
      AND consumer NOT IN (
          SELECT c.consumer FROM outbox_consumers c
          WHERE c.paused_at IS NOT NULL OR c.concurrency IS NOT NULL OR c.rate_limit IS NOT NULL)
      AND id <> ALL (CAST(:skip AS bigint[]))
    ORDER BY priority, run_at, id
    LIMIT :limit
    """
)
"""Ids of up to ``:limit`` due ready jobs of ``:consumers`` in claim order, none locked:
what a claim would take, for finding the job that makes it fail (:mod:`outbox.db.poison`).
Like the main claim it leaves out paused, capped and rate-limited consumers."""

job_bury: TextClause = text(
    """
    WITH target AS (SELECT j.id FROM outbox_jobs j WHERE j.id = :id AND j.fence = :fence AND j.status = 'running' FOR UPDATE)
    UPDATE outbox_jobs j
    SET status = 'dead', lease_until = NULL, finished_at = now(), last_error = :error, updated_at = now(),
        ordering_key = CASE WHEN j.ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = j.consumer AND s.on_dead = 'skip') THEN NULL ELSE j.ordering_key END,
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(), 'relay', j.locked_by,
                      'outcome', 'dead', 'error', CAST(:error AS text)))
    WHERE j.id IN (SELECT id FROM target) AND j.id = :id AND j.fence = :fence AND j.status = 'running'
    """
)
"""Dead-letter one claimed job (fenced) whose own statement failed with a data error: a
poison row (:mod:`outbox.db.poison`); ``:error`` names the statement and the database error.
Its attempts stay as they are, so a redrive after the cause is fixed runs it afresh. The
ordering key is dropped under ``on_dead='skip'``, as in ``job_fail_many``. The attempt is
appended to ``history`` as ``dead`` with ``:error``."""

job_bury_ready: TextClause = text(
    """
    WITH target AS (SELECT j.id FROM outbox_jobs j WHERE j.id = :id AND j.status = 'ready' FOR UPDATE)
    UPDATE outbox_jobs j
    SET status = 'dead', finished_at = now(), last_error = :error, updated_at = now(),
        ordering_key = CASE WHEN j.ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = j.consumer AND s.on_dead = 'skip') THEN NULL ELSE j.ordering_key END,
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts + 1, 'started_at', NULL, 'ended_at', now(), 'relay', NULL,
                      'outcome', 'dead', 'error', CAST(:error AS text)))
    WHERE j.id IN (SELECT id FROM target) AND j.id = :id AND j.status = 'ready'
    """
)
"""Dead-letter one ready job whose claim fails with a data error (no claim, so no fence:
only a job still ``ready`` changes). The ordering key as in ``job_bury``. ``history`` gets a
``dead`` entry with ``:error`` and no start or relay: the attempt the claim would have
begun (``attempts + 1``, not counted) never started."""

job_bury_expired: TextClause = text(
    """
    WITH target AS (SELECT j.id FROM outbox_jobs j WHERE j.id = :id AND j.status = 'running' AND j.lease_until < now() FOR UPDATE)
    UPDATE outbox_jobs j
    SET status = 'dead', lease_until = NULL, finished_at = now(), last_error = :error, updated_at = now(),
        ordering_key = CASE WHEN j.ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = j.consumer AND s.on_dead = 'skip') THEN NULL ELSE j.ordering_key END,
        history = jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                  || jsonb_build_array(jsonb_build_object(
                      'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(), 'relay', j.locked_by,
                      'outcome', 'dead', 'error', CAST(:error AS text)))
    WHERE j.id IN (SELECT id FROM target) AND j.id = :id AND j.status = 'running' AND j.lease_until < now()
    """
)
"""Dead-letter one job whose lease expired and whose reaping fails with a data error; the
lease check is the reaper's own (a renewed lease means its worker still owns it). The
ordering key and ``history`` as in ``job_bury``."""

job_reap_many: TextClause = text(
    """
    WITH expired AS (
        SELECT j.id,
               EXISTS (SELECT 1 FROM outbox_relays r
                       WHERE r.id = j.locked_by AND j.fence = ANY (r.buffered)) AS unstarted,
               format('LeaseExpired: lease expired at %s on attempt %s of %s (worker %s, fence %s)',
                      j.lease_until, j.attempts, j.max_attempts, coalesce(j.locked_by, '?'), j.fence) AS note
        FROM outbox_jobs j
        WHERE j.status = 'running' AND j.lease_until < now()
          AND j.id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR j.id = ANY (CAST(:only AS bigint[])))
        ORDER BY j.lease_until
        LIMIT :limit
        FOR UPDATE OF j SKIP LOCKED
    )
    UPDATE outbox_jobs j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN NOT x.unstarted AND j.attempts >= j.max_attempts THEN 'dead'
                      WHEN j.superseded_by IS NOT NULL THEN 'superseded' ELSE 'ready' END,
        attempts = j.attempts - x.unstarted::int,
        finished_at = CASE WHEN j.cancel_requested OR (NOT x.unstarted AND j.attempts >= j.max_attempts)
                                OR j.superseded_by IS NOT NULL THEN now() END,
        ordering_key = CASE WHEN j.superseded_by IS NOT NULL AND NOT j.cancel_requested
                                 AND (x.unstarted OR j.attempts < j.max_attempts) THEN NULL
                            WHEN NOT x.unstarted AND j.attempts >= j.max_attempts AND j.ordering_key IS NOT NULL
                                 AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = j.consumer AND s.on_dead = 'skip')
                            THEN NULL ELSE j.ordering_key END,
        run_at = CASE WHEN x.unstarted THEN j.run_at ELSE now() END,
        lease_until = NULL,
        last_error = CASE WHEN x.unstarted THEN j.last_error ELSE x.note END,
        updated_at = now(),
        history = CASE WHEN x.unstarted THEN j.history
                       ELSE jsonb_path_query_array(coalesce(j.history, '[]'), '$[last - 98 to last]')
                            || jsonb_build_array(jsonb_build_object(
                                'attempt', j.attempts, 'started_at', j.started_at, 'ended_at', now(),
                                'relay', j.locked_by,
                                'outcome', CASE WHEN j.cancel_requested THEN 'cancelled'
                                                WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'lease expired' END,
                                'error', x.note)) END
    FROM expired x
    WHERE j.id = x.id AND j.status = 'running' AND j.lease_until < now()
    RETURNING j.id, j.consumer, j.status, j.attempts, j.fence, x.unstarted
    """
)
"""Take back up to ``:limit`` jobs whose lease expired: ``ready`` again, or ``dead`` when
the expired attempt was the last. Jobs another transaction holds are skipped (they are
being finished right now), so a reaper never overwrites a completion.

A claim whose fence its relay lists in ``outbox_relays.buffered`` never started its
handler (the relay died or stopped with it in its prefetch buffer): it gets its attempt
back (``attempts - 1``), keeps its ``run_at`` (its place at the head of the queue) and its
``last_error``, and is never dead-lettered by this; ``unstarted`` says so per row. Every
other expired claim is charged as before, so a handler that kills its process ends dead
after ``max_attempts`` starts. ``:skip`` and ``:only`` as in ``event_route_many``. A job
back to ``ready`` keeps its ordering key and so its place at the head of its key; one
dead-lettered drops it under ``on_dead='skip'``, as in ``job_fail_many`` (the reaper's
promotion sweep then lets the next one of its key go). A job an operator asked to cancel
while it ran (``cancel_requested``) ends ``cancelled`` instead. A started claim's attempt is
appended to ``history`` with the lease note as its error (``lease expired``, ``dead`` or
``cancelled``); an unstarted one was no attempt and appends nothing. A job marked
``superseded_by`` while it ran (coalescing, as in ``job_fail_many``) ends ``superseded``
instead of ``ready`` and leaves its ordered key (the sweep promotes the next)."""

job_reap_candidates: TextClause = text(
    """
    SELECT id FROM outbox_jobs
    WHERE status = 'running' AND lease_until < now() AND id <> ALL (CAST(:skip AS bigint[]))
    ORDER BY lease_until
    LIMIT :limit
    """
)
"""Ids of up to ``:limit`` jobs whose lease expired, in reaping order, none locked."""

job_prune_done_many: TextClause = text(
    """
    DELETE FROM outbox_jobs
    WHERE id IN (
        SELECT id FROM outbox_jobs
        WHERE status = 'done' AND finished_at < now() - make_interval(secs => :older_than)
          AND id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR id = ANY (CAST(:only AS bigint[])))
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id
    """
)
"""Delete up to ``:limit`` jobs done more than ``:older_than`` seconds ago; returns their
ids. ``:skip`` and ``:only`` as in ``event_route_many``."""

job_prune_cancelled_many: TextClause = text(
    """
    DELETE FROM outbox_jobs
    WHERE id IN (
        SELECT id FROM outbox_jobs
        WHERE status = 'cancelled' AND finished_at < now() - make_interval(secs => :older_than)
          AND id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR id = ANY (CAST(:only AS bigint[])))
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id
    """
)
"""``job_prune_done_many`` for cancelled jobs (read through ``ix_outbox_jobs_cancelled``):
kept as long as done ones, then deleted."""

job_prune_cancelled_candidates: TextClause = text(
    """
    SELECT id FROM outbox_jobs
    WHERE status = 'cancelled' AND finished_at < now() - make_interval(secs => :older_than)
      AND id <> ALL (CAST(:skip AS bigint[]))
    LIMIT :limit
    """
)
"""Ids of the jobs ``job_prune_cancelled_many`` would delete, none locked."""

job_prune_superseded_many: TextClause = text(
    """
    DELETE FROM outbox_jobs
    WHERE id IN (
        SELECT id FROM outbox_jobs
        WHERE status = 'superseded' AND finished_at < now() - make_interval(secs => :older_than)
          AND id <> ALL (CAST(:skip AS bigint[]))
          AND (CAST(:only AS bigint[]) IS NULL OR id = ANY (CAST(:only AS bigint[])))
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id
    """
)
"""``job_prune_done_many`` for superseded jobs (read through ``ix_outbox_jobs_superseded``):
kept as long as done ones, then deleted."""

job_prune_superseded_candidates: TextClause = text(
    """
    SELECT id FROM outbox_jobs
    WHERE status = 'superseded' AND finished_at < now() - make_interval(secs => :older_than)
      AND id <> ALL (CAST(:skip AS bigint[]))
    LIMIT :limit
    """
)
"""Ids of the jobs ``job_prune_superseded_many`` would delete, none locked."""

job_prune_candidates: TextClause = text(
    """
    SELECT id FROM outbox_jobs
    WHERE status = 'done' AND finished_at < now() - make_interval(secs => :older_than)
      AND id <> ALL (CAST(:skip AS bigint[]))
    LIMIT :limit
    """
)
"""Ids of the jobs ``job_prune_done_many`` would delete, none locked."""

job_dead_list: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.attempts, j.max_attempts, j.snoozes, j.finished_at, j.last_error
    FROM outbox_jobs j
    WHERE j.status = 'dead' AND (CAST(:consumer AS text) IS NULL OR j.consumer = :consumer)
    ORDER BY j.id
    LIMIT :limit
    """
)

job_redrive_many: TextClause = text(
    """
    UPDATE outbox_jobs
    SET status = 'ready', attempts = 0, run_at = now(), finished_at = NULL, updated_at = now()
    WHERE status = 'dead'
      AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY (CAST(:ids AS bigint[])))
      AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer)
    RETURNING id
    """
)
"""Put dead jobs back to ``ready`` with a fresh attempt budget: those in ``:ids`` and/or of
``:consumer`` (both: only those ids that are jobs of ``:consumer``); ``last_error`` is kept
until the next failure, ``history`` is kept (the next attempt is numbered 1 again). Only
``dead`` rows change."""

job_retry_now_many: TextClause = text(
    """
    UPDATE outbox_jobs
    SET run_at = now(), updated_at = now()
    WHERE consumer = ANY (CAST(:consumers AS text[]))
      AND status = 'ready' AND attempts > 0 AND run_at > now()
    RETURNING id
    """
)
"""Make the ready jobs of ``:consumers`` that wait out a retry's backoff (a failed or reaped
attempt: ``attempts > 0``) due now, for ``outbox.testing.drain`` with ``run_retries``.
Jobs never attempted (a delayed publish) keep their ``run_at``; attempts are not touched."""

job_scheduled_now_many: TextClause = text(
    """
    UPDATE outbox_jobs
    SET run_at = now(), updated_at = now()
    WHERE consumer = ANY (CAST(:consumers AS text[]))
      AND status = 'ready' AND attempts = 0 AND run_at > now()
    RETURNING id
    """
)
"""Make the ready jobs of ``:consumers`` that were never attempted and wait for a later
``run_at`` (a delayed publish, ``run_at=`` or ``delay=``) due now, for
``outbox.testing.drain`` with ``run_scheduled``; attempts are not touched."""

# -------------------------------------------------------------------------- ordering

job_promote_many: TextClause = text(
    """
    WITH keys AS (
        SELECT DISTINCT consumer, ordering_key
        FROM unnest(CAST(:consumers AS text[]), CAST(:keys AS text[])) AS k(consumer, ordering_key)
        WHERE ordering_key IS NOT NULL
        ORDER BY consumer, ordering_key
    ), heads AS (
        SELECT h.id, h.status
        FROM keys k
        CROSS JOIN LATERAL (
            SELECT j.id, j.status FROM outbox_jobs j
            WHERE j.consumer = k.consumer AND j.ordering_key = k.ordering_key
              AND j.status <> 'done' AND j.status <> 'cancelled'
            ORDER BY j.event_id
            LIMIT 1
        ) h
    ), locked AS (
        SELECT j.id
        FROM outbox_jobs j
        WHERE j.id = ANY (ARRAY(SELECT id FROM heads WHERE status = 'pending')) AND j.status = 'pending'
        ORDER BY j.id
        FOR NO KEY UPDATE
    )
    UPDATE outbox_jobs j
    SET status = 'ready', run_at = greatest(j.run_at, now()), updated_at = now()
    FROM locked l
    WHERE j.id = l.id AND j.status = 'pending'
    RETURNING j.id, j.consumer, j.ordering_key, j.priority, j.run_at
    """
)
"""Let the next job of each (``:consumers[i]``, ``:keys[i]``) go: where the key's first
unfinished job (lowest event id, not ``done`` or ``cancelled``; a dead job holding its key
counts) is ``pending``, it becomes ``ready``, due at ``greatest(run_at, now())``. Keys whose
head is ready, running or dead change nothing, so running it too often is harmless. The
heads are found in the statement's snapshot and only the pending ones locked (``FOR NO KEY
UPDATE``), in id order like every statement that locks job rows and waits; two promotions
of one key take turns and the second finds the head no longer pending. A pending head seen
in the snapshot is still the head: nothing earlier of its key can become unfinished again
(a redriven dead job was the head itself; the router only adds later events). Run as a statement of its own after the outcome that finished a key's job has
committed (:mod:`outbox.relay.ordering` says why). Returns (id, consumer, ordering_key, priority,
run_at) of the jobs promoted."""

job_ordering_heads_list: TextClause = text(
    """
    WITH RECURSIVE walk AS (
        (SELECT j.consumer, j.ordering_key, j.status
         FROM outbox_jobs j
         WHERE j.ordering_key IS NOT NULL AND j.status <> 'done'
           AND (j.consumer, j.ordering_key) > (CAST(:after_consumer AS text), CAST(:after_key AS text))
         ORDER BY j.consumer, j.ordering_key, j.event_id
         LIMIT 1)
        UNION ALL
        SELECT n.consumer, n.ordering_key, n.status
        FROM walk w
        CROSS JOIN LATERAL (
            SELECT j.consumer, j.ordering_key, j.status
            FROM outbox_jobs j
            WHERE j.ordering_key IS NOT NULL AND j.status <> 'done'
              AND (j.consumer, j.ordering_key) > (w.consumer, w.ordering_key)
            ORDER BY j.consumer, j.ordering_key, j.event_id
            LIMIT 1
        ) n
    )
    SELECT consumer, ordering_key, status FROM walk LIMIT :limit
    """
)
"""Up to ``:limit`` ordered keys after (``:after_consumer``, ``:after_key``) in (consumer,
key) order, each with the status of its first row in ``ix_outbox_jobs_ordering`` (its head,
or a cancelled job before it): a skip scan of the index, one probe per key, however many
jobs wait behind each. The promotion sweep reads it (no lock) and promotes the keys whose
head is ``pending`` with ``job_promote_many``, which re-checks under its lock."""

job_ordering_blocked_list: TextClause = text(
    """
    SELECT d.consumer, d.ordering_key AS key, d.id AS job_id, d.finished_at AS since,
           (SELECT count(*) FROM outbox_jobs p
            WHERE p.consumer = d.consumer AND p.ordering_key = d.ordering_key AND p.status = 'pending'
              AND p.status <> 'done') AS pending
    FROM outbox_jobs d
    WHERE d.ordering_key IS NOT NULL AND d.status = 'dead' AND d.status <> 'done'
      AND (CAST(:consumer AS text) IS NULL OR d.consumer = :consumer)
    ORDER BY d.finished_at, d.id
    LIMIT :limit
    """
)
"""The blocked keys (of ``:consumer``, or of all consumers when NULL), longest blocked
first: each dead job that still holds its ordering key (``on_dead='block'``) with its
consumer, key, id, since when (``finished_at``) and how many pending jobs wait behind it.
Read through ``ix_outbox_jobs_ordering``."""

job_ordering_release_many: TextClause = text(
    """
    UPDATE outbox_jobs
    SET ordering_key = NULL,
        status = CASE WHEN status = 'pending' THEN 'ready' ELSE status END,
        run_at = CASE WHEN status = 'pending' THEN greatest(run_at, now()) ELSE run_at END,
        updated_at = now()
    WHERE consumer = ANY (CAST(:consumers AS text[]))
      AND ordering_key IS NOT NULL AND status IN ('pending', 'ready', 'dead')
    RETURNING id, status
    """
)
"""A consumer declared unordered again: its jobs leave their keys (``ix_outbox_jobs_ordering``,
by consumer): ``pending`` ones become ``ready`` at once, a dead job no longer blocks its key.
Running jobs are left alone (no fence here); they finish as any unordered job. Returns
(id, new status) of the jobs changed."""

job_ordering_get: TextClause = text(
    "SELECT id, consumer, status, ordering_key FROM outbox_jobs WHERE id = :id"
)
"""One job's consumer, status and ordering key, to explain why ``job_ordering_skip`` refused it."""

job_ordering_skip: TextClause = text(
    """
    WITH target AS (
        SELECT id, consumer, ordering_key FROM outbox_jobs
        WHERE id = :id AND status = 'dead' AND ordering_key IS NOT NULL
        FOR UPDATE
    )
    UPDATE outbox_jobs j
    SET ordering_key = NULL, updated_at = now()
    FROM target t
    WHERE j.id = t.id
    RETURNING j.id, t.consumer, t.ordering_key
    """
)
"""Let a blocked key go on (``outbox-relay skip``): dead job ``:id`` drops its ordering key,
so it no longer blocks; it stays dead (a later redrive runs it unordered). Returns
(id, consumer, the key it held); no row when ``:id`` is not a dead job holding a key. The
caller commits, then promotes the key with ``job_promote_many``."""

job_count_by_status: TextClause = text(
    "SELECT consumer, status, count(*) AS n FROM outbox_jobs GROUP BY consumer, status ORDER BY consumer, status"
)

job_transaction_limits_set_local: TextClause = text(
    "SELECT set_config('idle_in_transaction_session_timeout', :idle_timeout, true),"
    " set_config('outbox.handler_fence', CAST(:fence AS text), true)"
)
"""The first statement of a transactional handler's transaction: until it ends, the server
ends the session (SQLSTATE 25P03) when the transaction sits idle for longer than
``:idle_timeout`` (milliseconds, as text), so a worker paused or hung inside it cannot hold
its row locks past its job's lease; and ``outbox.handler_fence`` holds the job's fence, which
``job_complete`` reads to know the handler did not end the transaction itself. ``set_config(..., true)`` is ``SET LOCAL`` with a bound
parameter: it lasts until the transaction ends, so it never leaks to the next user of a
pooled connection and works through a pooler in transaction mode, where startup options
and session-level ``SET`` do not (PostgreSQL docs, "Configuration Settings Functions" and
"idle_in_transaction_session_timeout"; PgBouncer docs, "Features")."""

# ---------------------------------------------------------------------------- relays

relay_seen: TextClause = text(
    """
    INSERT INTO outbox_relays AS r (id, host, pid, buffered, version, consumers, concurrency)
    VALUES (:relay, :host, :pid, CAST(:buffer AS bigint[]), CAST(:version AS text), CAST(:consumers AS text[]),
            CAST(:concurrency AS int))
    ON CONFLICT (id) DO UPDATE
    SET last_seen_at = now(),
        version = coalesce(EXCLUDED.version, r.version),
        consumers = coalesce(EXCLUDED.consumers, r.consumers),
        concurrency = coalesce(EXCLUDED.concurrency, r.concurrency),
        buffered = ARRAY(
            SELECT f FROM unnest(r.buffered) AS f
            WHERE f = ANY (CAST(:buffer AS bigint[]))
               OR f IN (SELECT j.fence FROM outbox_jobs j WHERE j.status = 'running' AND j.locked_by = r.id))
    """
)
"""Insert this relay's row of ``outbox_relays`` with its buffer (``:buffer``: the fences it
holds unstarted), or mark it seen: the dispatcher runs it on each new connection and every
``RELAY_SEEN_INTERVAL`` seconds. ``:version``, ``:consumers`` and ``:concurrency`` (the
registry ``outbox-relay relays`` lists; NULL keeps what the row holds) describe the relay. Listed fences that are neither in its buffer nor still
running under it (finished, released, or reaped since: a claim whose reply was lost) are
dropped, so the list stays the size of the buffer. The running jobs are read through
``ix_outbox_jobs_lease``."""

relay_buffer_remove: TextClause = text(
    """
    UPDATE outbox_relays r
    SET buffered = ARRAY(SELECT f FROM unnest(r.buffered) AS f WHERE f <> ALL (CAST(:removed AS bigint[])))
    FROM (SELECT set_config('synchronous_commit', 'off', true)) AS asynchronous(commit)
    WHERE r.id = :relay
    """
)
"""Unlist buffered claims (``:removed``, fences) from this relay's row: the relay's starter
runs it before it hands those jobs to workers, so a job whose handler may have started is
never listed (the reaper would give it its attempt back). One small statement for every
job handed over at once.

It commits asynchronously: ``set_config(..., true)`` turns ``synchronous_commit`` off for
this statement's own transaction, and the setting in effect at commit is the one that
counts (PostgreSQL docs, "synchronous_commit"). The commit is visible at once and survives
the relay's crash; only a crash of PostgreSQL itself within ``wal_writer_delay`` (200 ms by
default) can lose it, and then a job that did start is merely given its attempt back once.
It touches no sequence, so no fence can be handed out twice (the reason claims and
completions keep synchronous commits); the wait for the WAL flush it saves is most of the
round trip a worker waits before a buffered job."""

relay_delete: TextClause = text("DELETE FROM outbox_relays WHERE id = :relay")
"""Remove this relay's row at a clean stop, once every claim it held is finished or released."""

relay_prune_many: TextClause = text(
    """
    DELETE FROM outbox_relays r
    WHERE r.last_seen_at < now() - make_interval(secs => :older_than)
      AND NOT EXISTS (SELECT 1 FROM outbox_jobs j WHERE j.status = 'running' AND j.locked_by = r.id)
    """
)
"""Forget relays not seen for ``:older_than`` seconds that hold no running job (they were
killed): their buffer no longer matters once none of their claims can be reaped."""

# ------------------------------------------------------------------------ statistics

job_table_reltuples: TextClause = text(
    "SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = CAST('outbox_jobs' AS regclass)"
)
"""Rows in ``outbox_jobs`` as of its last ANALYZE or VACUUM (``pg_class.reltuples``, an
estimate); 0 when the table has never been analysed or vacuumed, which PostgreSQL 14 and
later mark with -1 (PostgreSQL docs, "pg_class")."""

event_table_analysed: TextClause = text(
    "SELECT reltuples >= 0 FROM pg_class WHERE oid = CAST('outbox_events' AS regclass)"
)
"""Whether ``outbox_events`` has been analysed or vacuumed at least once (``reltuples`` is -1
until then: PostgreSQL docs, "pg_class")."""

event_table_analyze: TextClause = text("ANALYZE outbox_events")
"""Refresh the planner's statistics of ``outbox_events``; locks as ``job_table_analyze``."""

lock_timeout_get: TextClause = text("SELECT current_setting('lock_timeout')")
"""The session's ``lock_timeout`` as text with its unit (``'0'``: wait for ever)."""

lock_timeout_set_local: TextClause = text("SELECT set_config('lock_timeout', :timeout, true)")
"""Until the end of the current transaction, give up waiting for a lock after ``:timeout``
(text with a unit, e.g. ``'100ms'``) with SQLSTATE 55P03 (``lock_not_available``). Being
transaction-local, it never outlives the transaction on a pooled connection."""

job_table_analyze: TextClause = text("ANALYZE outbox_jobs")
"""Refresh the planner's statistics of ``outbox_jobs`` (and ``reltuples``) from a sample of
at most 300 x ``default_statistics_target`` rows. Takes a SHARE UPDATE EXCLUSIVE lock,
which blocks neither reads nor writes of jobs but conflicts with (auto)vacuum, another
ANALYZE of the table and schema changes ("Explicit Locking", "ANALYZE", PostgreSQL docs).
Only the table's owner (or a superuser) may analyse it; for anyone else PostgreSQL skips
the table with a warning, not an error."""

autovacuum_enabled: TextClause = text(
    """
    SELECT current_setting('autovacuum') = 'on'
       AND coalesce((SELECT option_value::bool FROM pg_options_to_table(c.reloptions)
                     WHERE option_name = 'autovacuum_enabled'), true)
    FROM pg_class c WHERE c.oid = CAST('outbox_jobs' AS regclass)
    """
)
"""True when autovacuum will visit ``outbox_jobs``: on for the server and not turned off for
the table (PostgreSQL docs, "The Autovacuum Daemon" and "Storage Parameters")."""

job_tables_maintainable: TextClause = text(
    """
    SELECT pg_has_role(c.relowner, 'USAGE')
        OR pg_has_role((SELECT d.datdba FROM pg_database d WHERE d.datname = current_database()), 'USAGE')
        OR CASE WHEN current_setting('server_version_num')::int >= 170000
                THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
    FROM pg_class c WHERE c.oid = CAST('outbox_jobs' AS regclass)
    """
)
"""True when the current role may ``ANALYZE`` and ``VACUUM`` ``outbox_jobs`` (and
``outbox_events``, which ``outbox-relay migrate`` creates with the same owner): it is, or
has the privileges of, the table's owner or the database's owner (a superuser has every
role's), or, on PostgreSQL 17 and later, it holds the ``MAINTAIN`` privilege on the table
(PostgreSQL docs, "VACUUM", "ANALYZE", "Privileges"). For anyone else both commands skip the
table with a warning, not an error. ``MAINTAIN`` is an unknown privilege before 17, so the
CASE asks for it only there."""

current_role_name: TextClause = text("SELECT current_user")
"""The role the session's privileges are checked as."""

job_tables_vacuum: TextClause = text("VACUUM (SKIP_LOCKED) outbox_jobs, outbox_events")
"""Reclaim the dead rows that every job leaves (an insert, two updates and a delete) and
that pruning leaves in both tables, so the queue's table stays the size of its live
rows. ``SKIP_LOCKED`` (PostgreSQL 12+) skips a table another vacuum or ANALYZE is
working on instead of waiting. Cannot run inside a transaction block: autocommit only."""

# --------------------------------------------------------------------------- metrics

metrics_gatherer_lock_try: TextClause = text(
    "SELECT pg_try_advisory_lock(CAST(CAST(CAST('outbox_jobs' AS regclass) AS oid) AS int), 1)"
)
"""Become the relay that reads the database gauges for Prometheus (:mod:`outbox.telemetry.metrics`):
take the session-level advisory lock (the jobs table's oid, 1) if no other session holds
it; returns whether it did. Held until the session ends, so one relay per schema gathers
at a time and another takes over once its connection is gone. ``pg_locks`` shows it as
``locktype = 'advisory'``, ``classid`` = ``'outbox_jobs'::regclass``, ``objid = 1``,
``objsubid = 2``."""

metrics_statement_timeout_set_local: TextClause = text("SELECT set_config('statement_timeout', :timeout, true)")
"""Bound each statement of the current transaction (``SET LOCAL statement_timeout``,
``:timeout`` as text such as ``'2000ms'``): a gauge reading that would take longer is
cancelled and skipped instead of loading the database."""

job_ready_gauges: TextClause = text(
    """
    SELECT consumer, count(*) AS jobs,
           coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now())), 0) AS oldest_seconds
    FROM outbox_jobs
    WHERE status = 'ready'
    GROUP BY consumer
    """
)
"""Per consumer with ready jobs: how many are ready (due or waiting out a backoff) and the
age of its oldest due one, seconds by the database clock (``now() - run_at``; 0 when none
is due): the consumer's lag. Reads ``ix_outbox_jobs_ready`` (ready rows only, however
many done rows the table holds), cost proportional to the ready backlog."""

job_running_counts: TextClause = text(
    """
    SELECT consumer, count(*) AS jobs
    FROM outbox_jobs
    WHERE status = 'running'
    GROUP BY consumer
    """
)
"""Running jobs per consumer (claimed, lease held). Reads ``ix_outbox_jobs_lease``
(running rows only)."""

job_dead_counts: TextClause = text(
    """
    SELECT consumer, count(*) AS jobs
    FROM outbox_jobs
    WHERE status = 'dead'
    GROUP BY consumer
    """
)
"""Dead jobs per consumer. Reads ``ix_outbox_jobs_dead`` (consumer, id; dead rows only),
as an index-only scan where the visibility map allows: cost proportional to the dead
letters kept."""

event_unrouted_gauges: TextClause = text(
    """
    SELECT count(*) AS events,
           coalesce(extract(epoch FROM now() - (SELECT e.created_at FROM outbox_events e
                                                WHERE e.routed_at IS NULL ORDER BY e.id LIMIT 1)), 0)
               AS oldest_seconds
    FROM outbox_events
    WHERE routed_at IS NULL
    """
)
"""Unrouted events and the age of the oldest (the lowest id), seconds by the database
clock (0 when none). Reads ``ix_outbox_events_unrouted`` (unrouted rows only)."""

# ----------------------------------------------------------------------------- roles

server_version_number: TextClause = text("SELECT current_setting('server_version_num')::int")
"""The server's version as a number: 150020 for 15.20, 170000 for 17.0."""

role_names_existing: TextClause = text("SELECT rolname FROM pg_roles WHERE rolname = ANY(CAST(:names AS text[]))")
"""Which of the role names ``:names`` exist (``outbox-relay grants --apply`` checks before granting)."""

relation_exists: TextClause = text(
    "SELECT to_regclass(format('%I.%I', CAST(:schema AS text), CAST(:name AS text))) IS NOT NULL"
)
"""Whether relation ``:name`` exists in schema ``:schema`` (``outbox-relay grants --apply``
checks for ``outbox_jobs`` before granting, so a misspelt schema is refused by name)."""

# ---------------------------------------------------------------------------- schema

schema_revision: TextClause = text("SELECT version_num FROM outbox_alembic_version")

#: Key of the advisory lock that serialises migrations of schema ``public``: the first 8
#: bytes of SHA-256(b"outbox.migrate") read as a signed big-endian 64-bit integer. ``pg_locks``
#: shows it held as ``locktype = 'advisory'``, ``classid = 268231917``, ``objid = 895327184``,
#: ``objsubid = 1``. Other schemas have keys of their own (:func:`schema_migrate_lock_key`). An
#: application must not use these keys for locks of its own.
SCHEMA_MIGRATE_LOCK_KEY = 1152047312153713616


def schema_migrate_lock_key(schema: str) -> int:
    """The migration lock's key for ``schema``: :data:`SCHEMA_MIGRATE_LOCK_KEY` for
    ``public`` (so releases from before schemas existed still take turns with this one),
    else the first 8 bytes of SHA-256(b"outbox.migrate:" + schema) as a signed big-endian
    64-bit integer: two schemas migrate independently, each serialised with itself."""
    if schema == "public":
        return SCHEMA_MIGRATE_LOCK_KEY
    digest = hashlib.sha256(b"outbox.migrate:" + schema.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


schema_migrate_lock_try: TextClause = text("SELECT pg_try_advisory_xact_lock(:key)")
"""Take the migration lock ``:key`` (:func:`schema_migrate_lock_key`) for the rest of the
transaction (released by its commit or rollback) if no other transaction holds it; returns
whether it did. The first statement of every upgrade and downgrade, so two ``outbox-relay
migrate`` of one schema run at once take turns: the second finds the schema at head and
does nothing."""

schema_migrate_lock: TextClause = text("SELECT pg_advisory_xact_lock(:key)")
"""Take the migration lock ``:key`` for the rest of the transaction, waiting while another
transaction holds it (after ``schema_migrate_lock_try`` found it taken)."""

schema_exists: TextClause = text("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = :schema)")
"""Whether schema ``:schema`` exists. Migrations ask before ``Statements.schema_create``:
``CREATE SCHEMA IF NOT EXISTS`` needs the CREATE privilege on the database even when the
schema exists (PostgreSQL checks the privilege first), which a role that owns only its
schema lacks."""

schema_search_path_set_local: TextClause = text("SELECT set_config('search_path', :schema, true)")
"""Until the end of the current transaction, resolve unqualified names in ``:schema`` only
(``SET LOCAL search_path``; ``pg_catalog`` is searched first anyway): the migrations run
under it, so their unqualified DDL creates everything in outbox's schema."""

# -------------------------------------------------------------------------- publish

event_insert: TextClause = text(
    """
    WITH key_lock AS MATERIALIZED (
        SELECT pg_advisory_xact_lock(CAST(CAST(CAST('outbox_events' AS regclass) AS oid) AS int),
                                     hashtext(CAST(:key AS text)))
        WHERE CAST(:key AS text) IS NOT NULL
          AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.topic = CAST(:topic AS text) AND s.ordered)
    )
    INSERT INTO outbox_events (topic, key, payload, headers)
    SELECT CAST(:topic AS text), CAST(:key AS text), CAST(:payload AS jsonb), CAST(:headers AS jsonb)
    WHERE (SELECT count(*) FROM key_lock) >= 0
    RETURNING id
    """
)
"""Write one event (payload and headers as JSON text, validated by ``publish``).

A keyed event of a topic with an ordered subscription (``outbox_subscriptions.ordered``,
written by the relays at start) first takes the key's publish lock (``key_lock``): a
transaction-scoped
advisory lock on (the events table's oid, ``hashtext(key)``), so ``pg_locks`` shows it as
``locktype = 'advisory'``, ``classid`` = ``'outbox_events'::regclass``, ``objsubid = 2``.
The lock is taken before the row, and so its id, is made: the ``WHERE`` reads the
materialized CTE as a one-time filter, evaluated before the first row reaches the
``INSERT``, which draws the identity. A second transaction publishing the same key waits
for this one to end and only then draws its id, so one key's ids commit in id order
(architecture notes, "Ordering"). Unkeyed events, and events of topics no ordered
consumer subscribes to, take no lock (one look-up of the subscriptions' primary key)."""

event_insert_many: TextClause = text(
    """
    WITH key_lock AS MATERIALIZED (
        SELECT pg_advisory_xact_lock(CAST(CAST(CAST('outbox_events' AS regclass) AS oid) AS int), k.h)
        FROM (SELECT DISTINCT hashtext(e ->> 1) AS h
              FROM jsonb_array_elements(CAST(:events AS jsonb)) AS keyed(e)
              WHERE e ->> 1 IS NOT NULL
                AND e ->> 0 IN (SELECT s.topic FROM outbox_subscriptions s WHERE s.ordered)
              ORDER BY 1) k
    )
    INSERT INTO outbox_events (topic, key, payload, headers)
    SELECT e ->> 0, e ->> 1, e -> 2, e -> 3
    FROM jsonb_array_elements(CAST(:events AS jsonb)) WITH ORDINALITY AS batch(e, position)
    WHERE (SELECT count(*) FROM key_lock) >= 0
    ORDER BY position
    RETURNING id
    """
)
"""Write many events in one statement. ``:events`` is one JSON array of ``[topic, key,
payload, headers]`` arrays (key ``null`` for none), validated by ``publish_many``; ids are
drawn in array order. One JSON text rather than four array parameters: quoting every
element into a text array and parsing it back cost more than the insert itself. The
distinct keys' publish locks (as ``event_insert``) are taken first, in ascending order of
their hash, so two such statements never deadlock each other."""

event_insert_options: TextClause = text(
    """
    WITH key_lock AS MATERIALIZED (
        SELECT pg_advisory_xact_lock(CAST(CAST(CAST('outbox_events' AS regclass) AS oid) AS int),
                                     hashtext(CAST(:key AS text)))
        WHERE CAST(:key AS text) IS NOT NULL
          AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.topic = CAST(:topic AS text) AND s.ordered)
    )
    INSERT INTO outbox_events (topic, key, payload, headers, run_at, priority, dedup_key)
    SELECT CAST(:topic AS text), CAST(:key AS text), CAST(:payload AS jsonb), CAST(:headers AS jsonb),
           coalesce(CAST(:run_at AS timestamptz), now() + make_interval(secs => CAST(:delay AS float8))),
           CAST(:priority AS smallint), CAST(:dedup_key AS text)
    WHERE (SELECT count(*) FROM key_lock) >= 0
    ON CONFLICT (topic, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
    RETURNING id
    """
)
"""Write one event with publish options (each may be NULL): claimable from ``:run_at``, or
``:delay`` seconds after ``now()`` (the transaction's start, by the database clock), or at
once; ``:priority`` added to each subscription's; ``:dedup_key``. Returns no row when a
retained event of the same topic already has ``:dedup_key`` (``ix_outbox_events_dedup``);
then ``event_dedup_lookup_many`` finds it. Under READ COMMITTED a conflicting insert that
has not committed yet makes this wait for it: its commit means no row here, its rollback
means this row is written. A keyed event takes its publish lock first (as ``event_insert``)."""

event_insert_options_many: TextClause = text(
    """
    WITH key_lock AS MATERIALIZED (
        SELECT pg_advisory_xact_lock(CAST(CAST(CAST('outbox_events' AS regclass) AS oid) AS int), k.h)
        FROM (SELECT DISTINCT hashtext(e ->> 1) AS h
              FROM jsonb_array_elements(CAST(:events AS jsonb)) AS keyed(e)
              WHERE e ->> 1 IS NOT NULL
                AND e ->> 0 IN (SELECT s.topic FROM outbox_subscriptions s WHERE s.ordered)
              ORDER BY 1) k
    )
    INSERT INTO outbox_events (topic, key, payload, headers, run_at, priority, dedup_key)
    SELECT e ->> 0, e ->> 1, e -> 2, e -> 3,
           coalesce(CAST(e ->> 4 AS timestamptz), now() + make_interval(secs => CAST(e ->> 5 AS float8))),
           CAST(e ->> 6 AS smallint), e ->> 7
    FROM jsonb_array_elements(CAST(:events AS jsonb)) WITH ORDINALITY AS batch(e, position)
    WHERE (SELECT count(*) FROM key_lock) >= 0
    ORDER BY position
    ON CONFLICT (topic, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
    RETURNING id, topic, dedup_key
    """
)
"""``event_insert_many`` with publish options: ``:events`` is a JSON array of ``[topic, key,
payload, headers]`` or ``[topic, key, payload, headers, run_at, delay, priority, dedup_key]``
arrays (``run_at`` ISO 8601 text with an offset; absent or ``null`` for none), as
``event_insert_options`` takes them one by one. Events whose (topic, dedup_key) a retained
event already has are skipped; returns (id, topic, dedup_key) of the rows written, ids drawn
in array order. The keys' publish locks are taken first, as in ``event_insert_many``."""

event_dedup_lookup_many: TextClause = text(
    """
    SELECT e.topic, e.dedup_key, e.id
    FROM outbox_events e
    JOIN unnest(CAST(:topics AS text[]), CAST(:dedup_keys AS text[])) AS k(topic, dedup_key)
      ON e.topic = k.topic AND e.dedup_key = k.dedup_key
    WHERE e.dedup_key IS NOT NULL
    """
)
"""(topic, dedup_key, id) of the retained events holding any of the pairs
(``:topics[i]``, ``:dedup_keys[i]``), read through ``ix_outbox_events_dedup``."""

# ------------------------------------------------------------------------- schedules

schedule_upsert_many: TextClause = text(
    """
    INSERT INTO outbox_schedules AS s (name, cron, timezone, topic, catch_up, next_slot)
    SELECT * FROM unnest(
        CAST(:names AS text[]), CAST(:crons AS text[]), CAST(:timezones AS text[]), CAST(:topics AS text[]),
        CAST(:catch_ups AS bool[]), CAST(:next_slots AS timestamptz[]))
    ON CONFLICT (name) DO UPDATE
    SET cron = EXCLUDED.cron,
        timezone = EXCLUDED.timezone,
        topic = EXCLUDED.topic,
        catch_up = EXCLUDED.catch_up,
        next_slot = CASE WHEN (s.cron, s.timezone) IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone)
                         THEN EXCLUDED.next_slot ELSE s.next_slot END,
        updated_at = now()
    WHERE (s.cron, s.timezone, s.topic, s.catch_up)
          IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone, EXCLUDED.topic, EXCLUDED.catch_up)
    RETURNING s.name, s.cron, s.timezone, s.topic, s.catch_up, s.next_slot, (s.xmax <> 0) AS updated
    """
)
"""Write a registry's schedules. A new schedule starts at ``:next_slots[i]`` (its first slot
after now); an existing one keeps its ``next_slot`` unless its cron expression or time zone
changed (then it restarts at ``:next_slots[i]``, slots of the old expression are not
caught up). Returns the rows inserted or changed (``updated``: an existing one)."""

database_now: TextClause = text("SELECT now()")
"""The database clock: the start of the current transaction (``now()``)."""

schedule_due_list: TextClause = text(
    """
    SELECT name, cron, timezone, next_slot, now() AS now
    FROM outbox_schedules
    WHERE name = ANY (CAST(:names AS text[]))
    ORDER BY next_slot
    """
)
"""``next_slot`` (and the definition, ``cron`` and ``timezone``, the row holds) of each of
``:names`` with the database clock (``now``) beside it: the scheduler's whole view of time."""

schedule_advance: TextClause = text(
    """
    UPDATE outbox_schedules
    SET last_slot = CAST(:last_slot AS timestamptz), next_slot = CAST(:next_slot AS timestamptz), updated_at = now()
    WHERE name = :name AND next_slot = CAST(:expected AS timestamptz) AND CAST(:last_slot AS timestamptz) <= now()
      AND cron = :cron AND timezone = :timezone
    """
)
"""Compare-and-set of one schedule's slots: move ``next_slot`` from ``:expected`` to
``:next_slot`` and record ``:last_slot`` (the last slot published now, due by the database
clock), only while the row still has this relay's definition (``:cron``, ``:timezone``: a
relay of another deploy, whose slots are computed from another expression, never advances
it). One row means this transaction owns the slots from ``:expected`` to ``:last_slot``
and publishes their events before it commits; zero rows means another relay did (its
update locked the row first; this one re-read it after that commit and no longer
matched). The caller checks the row count."""

schedule_list: TextClause = text(
    "SELECT name, cron, timezone, topic, catch_up, last_slot, next_slot FROM outbox_schedules ORDER BY name"
)

# --------------------------------------------------------------------------- fan-ins
# The fan-ins of the registries (``Outbox.after``), which the fan-in trigger reads
# (:mod:`outbox.db.fan_in`); written by every relay when it starts.

fanin_upsert_many: TextClause = text(
    """
    INSERT INTO outbox_fanins AS f (name, topic, consumers, follow_topic)
    SELECT d.name, d.topic, d.consumers, d.follow_topic
    FROM jsonb_to_recordset(CAST(:fan_ins AS jsonb)) AS d(name text, topic text, consumers text[], follow_topic text)
    ON CONFLICT (name) DO UPDATE
    SET topic = EXCLUDED.topic, consumers = EXCLUDED.consumers, follow_topic = EXCLUDED.follow_topic,
        updated_at = now()
    WHERE (f.topic, f.consumers, f.follow_topic) IS DISTINCT FROM
          (EXCLUDED.topic, EXCLUDED.consumers, EXCLUDED.follow_topic)
    RETURNING f.name, f.topic, f.consumers, f.follow_topic, (f.xmax <> 0) AS updated
    """
)
"""Write a registry's fan-ins, ``:fan_ins`` a JSON array of ``{"name", "topic", "consumers":
[...], "follow_topic"}``; unchanged rows are left alone. Returns the rows inserted or
changed; ``updated`` as for ``subscription_upsert_many``."""

fanin_delete_undeclared: TextClause = text(
    """
    DELETE FROM outbox_fanins f
    WHERE f.consumers <@ CAST(:consumers AS text[])
      AND f.name <> ALL (CAST(:names AS text[]))
    RETURNING f.name, f.topic, f.consumers, f.follow_topic
    """
)
"""Forget the fan-ins a registry no longer declares: those every one of whose listed
consumers is one of the registry's ``:consumers`` (a fan-in lists consumers of the registry
that declares it, so these were this registry's) and whose name is not in ``:names``. A
fan-in of another registry's consumers stays. Jobs routed while it was declared keep
``fan_in`` and, finding no fan-in, fire nothing. Returns the rows deleted."""


# ----------------------------------------------------------------------------- admin
# The statements of ``outbox.admin`` (the operator's commands: status, relays, cancel,
# retry, replay, purge). Each reads through a partial index or a bounded range; none
# counts the done jobs unless asked to (``job_done_count_by_consumer``).

consumer_status_list: TextClause = text(
    """
    WITH ready AS (
        SELECT consumer, count(*) AS n, min(run_at) FILTER (WHERE run_at <= now()) AS oldest_due
        FROM outbox_jobs WHERE status = 'ready' GROUP BY consumer
    ), running AS (
        SELECT consumer, count(*) AS n FROM outbox_jobs WHERE status = 'running' GROUP BY consumer
    ), dead AS (
        SELECT consumer, count(*) AS n, count(*) FILTER (WHERE ordering_key IS NOT NULL) AS blocked
        FROM outbox_jobs WHERE status = 'dead' GROUP BY consumer
    ), pending AS (
        SELECT consumer, count(*) AS n FROM outbox_jobs
        WHERE status = 'pending' AND ordering_key IS NOT NULL GROUP BY consumer
    ), cancelled AS (
        SELECT consumer, count(*) AS n FROM outbox_jobs WHERE status = 'cancelled' GROUP BY consumer
    ), names AS (
        SELECT consumer FROM ready UNION SELECT consumer FROM running UNION SELECT consumer FROM dead
        UNION SELECT consumer FROM pending UNION SELECT consumer FROM cancelled
        UNION SELECT consumer FROM outbox_subscriptions UNION SELECT consumer FROM outbox_consumers
    )
    SELECT n.consumer,
           coalesce(r.n, 0) AS ready, coalesce(ru.n, 0) AS running, coalesce(d.n, 0) AS dead,
           coalesce(p.n, 0) AS pending, coalesce(x.n, 0) AS cancelled, coalesce(d.blocked, 0) AS blocked_keys,
           extract(epoch FROM now() - r.oldest_due) AS lag_seconds,
           c.paused_at,
           EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = n.consumer) AS subscribed
    FROM names n
    LEFT JOIN ready r ON r.consumer = n.consumer
    LEFT JOIN running ru ON ru.consumer = n.consumer
    LEFT JOIN dead d ON d.consumer = n.consumer
    LEFT JOIN pending p ON p.consumer = n.consumer
    LEFT JOIN cancelled x ON x.consumer = n.consumer
    LEFT JOIN outbox_consumers c ON c.consumer = n.consumer
    ORDER BY n.consumer
    """
)
"""Per consumer (every consumer with a subscription, a flow-control row or an unfinished,
dead or cancelled job): exact counts of its ready, running, dead, pending and cancelled jobs,
each read through that status's partial index (``ix_outbox_jobs_ready``, ``_lease``,
``_dead``, ``_ordering``, ``_cancelled``), so millions of done rows cost nothing; its blocked
keys (dead jobs still holding an ordering key); ``lag_seconds``, how long its oldest due
ready job has waited to be claimed (``now() - run_at``, database clock; NULL: none due);
when it was paused (NULL: not) and whether it still has a subscription."""

job_done_count_by_consumer: TextClause = text(
    "SELECT consumer, count(*) AS n FROM outbox_jobs WHERE status = 'done' GROUP BY consumer"
)
"""Exact done jobs per consumer: reads every done row (a scan of the table), so ``status``
runs it only when asked (``--exact``) or when the table is small."""

job_superseded_count_by_consumer: TextClause = text(
    "SELECT consumer, count(*) AS n FROM outbox_jobs WHERE status = 'superseded' GROUP BY consumer"
)
"""Exact superseded jobs per consumer (coalescing consumers': as many as their done jobs, or
more), counted with the done ones: only when asked (``--exact``) or when the table is small."""

event_unrouted_stats: TextClause = text(
    """
    SELECT count(*) AS n, extract(epoch FROM now() - min(created_at)) AS oldest_seconds
    FROM outbox_events WHERE routed_at IS NULL
    """
)
"""Unrouted events and the age of the oldest, seconds (NULL: none), read through
``ix_outbox_events_unrouted``."""

event_unsubscribed_by_topic_list: TextClause = text(
    """
    WITH latest AS (
        SELECT id, topic, created_at FROM outbox_events
        WHERE routed_at IS NOT NULL
        ORDER BY id DESC
        LIMIT :limit
    )
    SELECT l.topic, count(*) AS n, min(l.created_at) AS oldest, max(l.created_at) AS newest,
           (SELECT count(*) FROM latest) AS scanned
    FROM latest l
    WHERE NOT EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.topic = l.topic)
    GROUP BY l.topic
    ORDER BY count(*) DESC, l.topic
    """
)
"""Retained routed events whose topic has no subscription now, per topic (count, oldest,
newest), among the ``:limit`` most recent events (NULL: all retained ones; a backward scan
of the primary key). ``scanned`` is how many events were looked at."""

event_recent_routed_count: TextClause = text(
    """
    SELECT count(*) FROM (
        SELECT 1 FROM outbox_events WHERE routed_at IS NOT NULL ORDER BY id DESC LIMIT :limit
    ) latest
    """
)
"""How many routed events ``event_unsubscribed_by_topic_list`` looks at with ``:limit``."""

event_retained_bounds: TextClause = text(
    """
    SELECT (SELECT id FROM outbox_events ORDER BY id LIMIT 1) AS first_id,
           (SELECT created_at FROM outbox_events ORDER BY id LIMIT 1) AS first_created_at,
           (SELECT id FROM outbox_events ORDER BY id DESC LIMIT 1) AS last_id,
           now() AS now
    """
)
"""The lowest and highest retained event ids, the creation time of the lowest, and the
database clock: replay's check that the events it is asked for were not pruned."""

subscription_topics_of: TextClause = text(
    "SELECT topic, ordered FROM outbox_subscriptions WHERE consumer = :consumer ORDER BY topic"
)
"""The topics ``:consumer`` subscribes to, and whether each subscription is ordered."""

job_replay_many: TextClause = text(
    """
    WITH picked AS (
        SELECT e.id, e.topic, e.priority, e.run_at
        FROM outbox_events e
        WHERE e.id > :after AND e.id <= :last
          AND e.routed_at IS NOT NULL
          AND e.topic = ANY (CAST(:topics AS text[]))
          AND (CAST(:since AS timestamptz) IS NULL OR e.created_at >= CAST(:since AS timestamptz))
          AND (CAST(:until AS timestamptz) IS NULL OR e.created_at < CAST(:until AS timestamptz))
        ORDER BY e.id
        LIMIT :limit
        FOR KEY SHARE
    ), inserted AS (
        INSERT INTO outbox_jobs (event_id, consumer, priority, max_attempts, run_at, status)
        SELECT p.id, s.consumer,
               CASE WHEN p.priority IS NULL THEN s.priority
                    ELSE CAST(greatest(-32768, least(32767, CAST(s.priority AS int) + p.priority)) AS smallint) END,
               s.max_attempts, greatest(coalesce(p.run_at, now()), now()), 'ready'
        FROM picked p
        JOIN outbox_subscriptions s ON s.topic = p.topic AND s.consumer = :consumer
        ORDER BY p.id
        ON CONFLICT (event_id, consumer) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT max(id) FROM picked) AS last_id, (SELECT count(*) FROM picked) AS scanned,
           (SELECT count(*) FROM inserted) AS created
    """
)
"""One batch of a replay (``outbox-relay replay``): of the routed events with id above
``:after`` and at most ``:last``, on ``:topics``, created in [``:since``, ``:until``) (NULL:
unbounded), the first ``:limit`` by id each get a ``ready`` job of ``:consumer`` unless it
already has one (``ON CONFLICT (event_id, consumer) DO NOTHING``: two replays at once, or a
replay and the router, create each job once; the second waits for the first's commit).
Priority, attempts budget and ``run_at`` as the router sets them. The events are locked
``FOR KEY SHARE``, so an event the pruner is deleting right now is waited for and then
passed over (it is gone), and the pruner (``FOR UPDATE SKIP LOCKED``) passes over an event
a replay holds: no job is ever left without its event (jobs have no foreign key to their
event since migration 0007; these locks keep what it guarded). Returns the highest id looked at
(the next batch's ``:after``; NULL: none left), how many were looked at and how many jobs
were created."""

job_cancel_many: TextClause = text(
    """
    WITH target AS (
        SELECT id FROM outbox_jobs
        WHERE (CASE WHEN CAST(:ids AS bigint[]) IS NULL THEN consumer = :consumer
                    ELSE id = ANY (CAST(:ids AS bigint[]))
                         AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer) END)
          AND status = ANY (CAST(:statuses AS text[]))
          AND NOT cancel_requested
        ORDER BY id
        LIMIT :limit
        FOR UPDATE
    )
    UPDATE outbox_jobs j
    SET status = CASE WHEN j.status = 'running' THEN 'running' ELSE 'cancelled' END,
        cancel_requested = (j.status = 'running'),
        finished_at = CASE WHEN j.status = 'running' THEN j.finished_at ELSE now() END,
        updated_at = now()
    FROM target t
    WHERE j.id = t.id AND j.status = ANY (CAST(:statuses AS text[])) AND NOT j.cancel_requested
    RETURNING j.id, j.consumer, j.status, j.fence, j.ordering_key
    """
)
"""Cancel up to ``:limit`` jobs: those in ``:ids`` (with ``:consumer`` too: only those of
``:consumer``), or (``:ids`` NULL) of ``:consumer``, whose
status is one of ``:statuses`` (of ``ready``, ``pending``, ``running``). A ready or pending
job becomes ``cancelled`` (terminal, pruned like a done job; an ordered job no longer holds
its key). A running job stays running with ``cancel_requested``: its handler sees it at the
next heartbeat and the fenced statement that records its attempt (completion, failure,
snooze, release, the reaper) records ``cancelled``, so no claim is overwritten here. The
rows are locked in id order ``FOR UPDATE`` (like every statement that finishes a job) and
re-checked on their newest version, so a ready job claimed meanwhile is only cancelled when
``running`` is among ``:statuses``. Returns (id, consumer, new status, fence, ordering key)
of the jobs changed; the caller promotes the keys of the cancelled ordered jobs after the
commit (``job_promote_many``)."""

job_retry_due_many: TextClause = text(
    """
    UPDATE outbox_jobs
    SET run_at = now(), updated_at = now()
    WHERE status = 'ready' AND run_at > now()
      AND (CASE WHEN CAST(:ids AS bigint[]) IS NULL THEN consumer = :consumer AND attempts > 0
                ELSE id = ANY (CAST(:ids AS bigint[]))
                     AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer) END)
    RETURNING id
    """
)
"""``outbox-relay retry``: make ready jobs that are not due yet due now: those in ``:ids``
(waiting out a retry's backoff or a delayed publish; with ``:consumer`` too, only those of
``:consumer``), or (``:ids`` NULL) every job of
``:consumer`` waiting out a retry's backoff (``attempts > 0``; its delayed publishes keep
their ``run_at``). Attempts are not touched. Not-yet-due jobs are never claimed, so no
claim holds these rows. Returns the ids changed."""

job_consumer_get: TextClause = text("SELECT consumer FROM outbox_jobs WHERE id = :id")
"""The consumer job ``:id`` belongs to (no row: no such job, or pruned)."""

job_status_many: TextClause = text("SELECT id, status FROM outbox_jobs WHERE id = ANY (CAST(:ids AS bigint[]))")
"""The status of each job of ``:ids`` that exists (no row: no such job, or pruned)."""

job_purge_many: TextClause = text(
    """
    DELETE FROM outbox_jobs
    WHERE id IN (
        SELECT id FROM outbox_jobs
        WHERE consumer = :consumer AND status <> 'running'
          AND NOT EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = :consumer)
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id
    """
)
"""``outbox-relay purge``: delete up to ``:limit`` jobs of ``:consumer``, a consumer with no
subscription left (re-checked by every batch: a relay that subscribes it again stops the
purge), except running ones (a relay still runs them; they finish, and a later purge takes
them). Returns the ids deleted."""

job_running_count_of: TextClause = text(
    "SELECT count(*) FROM outbox_jobs WHERE status = 'running' AND consumer = :consumer"
)
"""Running jobs of ``:consumer`` (``ix_outbox_jobs_lease``)."""

relay_list: TextClause = text(
    """
    SELECT r.id, r.host, r.pid, r.version, r.consumers, r.concurrency, r.started_at, r.last_seen_at,
           extract(epoch FROM now() - r.last_seen_at) AS silent_seconds,
           cardinality(r.buffered) AS buffered,
           (SELECT count(*) FROM outbox_jobs j WHERE j.status = 'running' AND j.locked_by = r.id) AS running
    FROM outbox_relays r
    ORDER BY r.started_at, r.id
    """
)
"""The relay registry: every row of ``outbox_relays`` with how long since it was last seen
(seconds, database clock), its buffered claims and the jobs running under it."""

# ------------------------------------------------------------------------ job listing
# ``outbox-relay jobs`` (:func:`outbox.admin.list_jobs`): jobs by any of consumer, status,
# event key, event id and age, in keyset pages of ascending id.

job_list: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested, e.topic, e.key
    FROM outbox_jobs j
    LEFT JOIN outbox_events e ON e.id = j.event_id
    WHERE j.id > :after
      AND (CAST(:consumer AS text) IS NULL OR j.consumer = :consumer)
      AND (CAST(:statuses AS text[]) IS NULL OR j.status = ANY (CAST(:statuses AS text[])))
      AND (CAST(:key AS text) IS NULL OR e.key = :key)
      AND (CAST(:event_id AS bigint) IS NULL OR j.event_id = :event_id)
      AND (CAST(:older_than AS double precision) IS NULL
           OR j.created_at < now() - make_interval(secs => :older_than))
      AND (CAST(:newer_than AS double precision) IS NULL
           OR j.created_at >= now() - make_interval(secs => :newer_than))
    ORDER BY j.id
    LIMIT :limit
    """
)
"""Up to ``:limit`` jobs with ids above ``:after``, in id order, with their event's topic and
key (NULL when the event is gone), narrowed by each filter that is not NULL: ``:consumer``,
``:statuses`` (any of them), the event's ``:key``, ``:event_id``, and the job's age by its
``created_at`` (when routing made it; database clock): more than ``:older_than`` seconds, at
most ``:newer_than`` seconds. A keyset page: the next one starts above the last id shown, so
jobs created meanwhile land on later pages and none repeats (no OFFSET, nothing counted).
Cost: a walk of the primary key from ``:after`` that stops at ``:limit`` matches (by event:
``uq_outbox_jobs_event_id_consumer``); a filter that matches few of many jobs (a rare
key: events have no index on their key) reads more rows for a page."""

job_get: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested, e.topic, e.key, j.started_at, j.superseded_by, j.history
    FROM outbox_jobs j
    LEFT JOIN outbox_events e ON e.id = j.event_id
    WHERE j.id = :id
    """
)
"""Job ``:id`` as ``job_list`` shows it, with when its current or last attempt began
(``started_at``), the newer event of its key that superseded it, or marked it while it ran
(``superseded_by``, coalescing consumers only) and its attempt history (``history``, NULL
when none was written); no row: no such job, or pruned (``outbox-relay jobs show``)."""

# ------------------------------------------------------------------------- dashboard


# ``job_page_<status>``: one keyset page of the dashboard's consumer page per status, each
# written out with its status as a literal, so the planner sees the literal and reads the
# status's partial index, whatever plan cache a connection keeps (the six differ in that
# literal only; a unit test checks it).

job_page_ready: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'ready' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""Up to ``:limit`` ready jobs of ``:consumer`` with ids below ``:before``, newest first: one
keyset page of the dashboard's consumer page (the next page starts below the last id shown;
no OFFSET, no count); ``job_page_<status>`` is the same page of the jobs in another status.
Dead ones are read through
``ix_outbox_jobs_dead`` (consumer, id), ready, running, pending and cancelled ones through
their status's partial index (small: unfinished jobs only); done ones by a backward scan
of the primary key, which stops after ``:limit`` matches."""

job_page_running: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'running' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for running jobs."""

job_page_pending: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'pending' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for pending jobs."""

job_page_dead: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'dead' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for dead jobs."""

job_page_done: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'done' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for done jobs."""

job_page_cancelled: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'cancelled' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for cancelled jobs."""

job_page_superseded: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested
    FROM outbox_jobs j
    WHERE j.status = 'superseded' AND j.consumer = :consumer AND j.id < :before
    ORDER BY j.id DESC
    LIMIT :limit
    """
)
"""``job_page_ready`` for superseded jobs (a coalescing consumer's, as many as its done ones:
read as done ones are, by a backward scan of the primary key)."""

job_done_per_minute_list: TextClause = text(
    """
    SELECT consumer, CAST(floor(extract(epoch FROM now() - finished_at) / 60) AS int) AS minutes_ago,
           count(*) AS n
    FROM outbox_jobs
    WHERE status = 'done' AND finished_at > now() - make_interval(mins => :minutes)
    GROUP BY 1, 2
    """
)
"""Jobs done per consumer and minute over the last ``:minutes`` minutes (``minutes_ago``: 0
is the current minute, database clock), read through ``ix_outbox_jobs_finished``: the cost
follows the jobs finished in that window, never the done jobs kept before it."""

event_get: TextClause = text(
    """
    SELECT e.id, e.topic, e.key, e.payload, e.headers, e.created_at, e.routed_at, e.run_at, e.priority,
           e.dedup_key
    FROM outbox_events e
    WHERE e.id = :id
    """
)
"""One event by id (no row: never published, or pruned)."""

event_list_by_key: TextClause = text(
    """
    SELECT l.id, l.topic, l.key, l.payload, l.headers, l.created_at, l.routed_at, l.run_at, l.priority,
           l.dedup_key
    FROM (SELECT e.* FROM outbox_events e ORDER BY e.id DESC LIMIT :scan) l
    WHERE l.key = :key
    ORDER BY l.id DESC
    LIMIT :limit
    """
)
"""Up to ``:limit`` events of key ``:key``, newest first, among the ``:scan`` most recent
retained events (a backward scan of the primary key: events have no index on their key, so
the cost stays bounded by ``:scan`` however many are kept)."""

job_list_of_event: TextClause = text(
    """
    SELECT j.id, j.event_id, j.consumer, j.status, j.priority, j.run_at, j.attempts, j.max_attempts,
           j.lease_until, j.fence, j.locked_by, j.last_error, j.created_at, j.updated_at, j.finished_at,
           j.ordering_key, j.snoozes, j.cancel_requested, j.started_at, j.history
    FROM outbox_jobs j
    WHERE j.event_id = :event_id
    ORDER BY j.consumer
    """
)
"""Every job of event ``:event_id``, one per consumer it was routed to
(``uq_outbox_jobs_event_id_consumer``), with its attempt history (``started_at``,
``history``)."""

subscription_consumers_of: TextClause = text(
    "SELECT consumer FROM outbox_subscriptions WHERE topic = :topic ORDER BY consumer"
)
"""The consumers subscribed to ``:topic`` now."""

# ------------------------------------------------------------------------ hook calls
# Failure hooks (outbox.hooks): the trigger of migration 0013 writes a due call when a job
# goes dead or back to ready after a failure; a relay declaring the hook leases it, calls
# the hooks and deletes it. ``calls`` is the lease's fence: each lease adds one, and the
# statements that end a call check it, so a relay whose lease ran out (another relay took
# the call over) changes nothing.

hook_call_lease_many: TextClause = text(
    """
    WITH declared AS (
        SELECT * FROM unnest(CAST(:consumers AS text[]), CAST(:hooks AS text[])) AS d(consumer, hook)
    ), due AS (
        SELECT h.id, h.event_id
        FROM outbox_hook_calls h
        JOIN declared d ON d.consumer = h.consumer AND d.hook = h.hook
        WHERE h.due_at <= now()
        ORDER BY h.id
        LIMIT :limit
        FOR UPDATE OF h SKIP LOCKED
    )
    UPDATE outbox_hook_calls h
    SET calls = h.calls + 1, due_at = now() + make_interval(secs => :lease)
    FROM due LEFT JOIN outbox_events e ON e.id = due.event_id
    WHERE h.id = due.id
    RETURNING h.id, h.job_id, h.event_id, h.consumer, h.hook, h.attempt, h.max_attempts, h.error, h.calls,
              h.done, h.created_at, e.topic, e.key, e.payload, e.headers
    """
)
"""Lease up to ``:limit`` due hook calls (``due_at <= now()``) of the (consumer, hook) pairs
``:consumers`` / ``:hooks`` (this relay's), oldest first, skipping those another relay
holds: ``calls + 1`` (the new lease's fence) and due again after ``:lease`` seconds, so a
relay that dies during the call leaves it to another once the lease runs out. Returns each
call with its event's topic, key, payload and headers (NULL when the event is gone)."""

hook_call_delete_many: TextClause = text(
    """
    DELETE FROM outbox_hook_calls h
    USING unnest(CAST(:ids AS bigint[]), CAST(:calls AS integer[])) AS a(id, calls)
    WHERE h.id = a.id AND h.calls = a.calls
    RETURNING h.id
    """
)
"""Delete hook calls that ended (every hook returned, or given up), each only while its
``calls`` is the caller's lease (``:ids`` / ``:calls``, pairwise). Returns the ids deleted:
one missing was taken over by another relay after the lease ran out."""

hook_call_fail: TextClause = text(
    """
    UPDATE outbox_hook_calls
    SET done = CAST(:done AS text[]), last_error = :error, due_at = now() + make_interval(secs => :delay)
    WHERE id = :id AND calls = :calls
    """
)
"""A hook call of which some hook failed: due again after ``:delay`` seconds, ``done`` the
hooks that have returned so far (not called again), ``last_error`` the failure. Only while
``calls`` is the caller's lease (``:calls``); the caller reads the row count."""

hook_call_counts: TextClause = text(
    """
    SELECT h.consumer, h.hook, count(*) AS calls, min(h.created_at) AS oldest,
           EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.consumer = h.consumer AND h.hook = ANY (s.hooks))
               AS declared
    FROM outbox_hook_calls h
    GROUP BY h.consumer, h.hook
    ORDER BY h.consumer, h.hook
    """
)
"""Hook calls waiting, by (consumer, hook), with the oldest's creation and whether a
subscription of the consumer declares the hook now (when none does, no relay calls them)."""

# --------------------------------------------------------------------------- schemas

def statements() -> dict[str, TextClause]:
    """Every statement of this module by name, as written (unqualified): the texts
    :class:`Statements` qualifies, wherever in the module they are defined."""
    return {name: value for name, value in globals().items()
            if isinstance(value, TextClause) and not name.startswith("_")}


def relation_pattern() -> re.Pattern[str]:
    """Matches an outbox relation's name (:func:`outbox.db.tables.relation_names`) standing
    alone: not part of a longer name (``ix_outbox_jobs_ready``), not after a ``.``
    (``j.outbox_x``, an already qualified name) and not quoted."""
    names = "|".join(sorted(map(re.escape, tables.relation_names()), key=len, reverse=True))
    return re.compile(rf'(?<![\w$."])({names})(?![\w$"])')


class Statements:
    """Every statement of :mod:`outbox.db.queries`, under the same names, with outbox's
    relations in schema :attr:`schema` (see the module notes); made by :func:`in_schema`.
    Besides: ``schema_create``, ``CREATE SCHEMA IF NOT EXISTS <schema>`` (DDL takes no
    parameters; the name is validated).

    The registry is typed: each statement is declared below, so a misspelt name is an
    error for mypy (``"Statements" has no attribute ...``), not an ``AttributeError`` at
    run time. A new statement is defined at module level in its section and declared here
    in the same section; a unit test fails while the two lists differ."""

    schema: str
    schema_create: TextClause

    # events
    event_route_many: TextClause
    event_route_candidates: TextClause
    event_first_unrouted_before: TextClause
    event_prune_many: TextClause
    event_prune_candidates: TextClause
    event_unrouted_count: TextClause

    # intake
    intake_known_many: TextClause
    intake_record_many: TextClause
    intake_prune_many: TextClause
    intake_rejected_list: TextClause
    intake_forget_rejected: TextClause
    intake_backlog: TextClause
    intake_lock_try: TextClause
    intake_lock_held: TextClause

    # subscriptions
    subscription_upsert_many: TextClause
    consumer_upsert_many: TextClause
    consumer_pause: TextClause
    consumer_resume: TextClause
    consumer_list: TextClause
    consumer_lock_limited_many: TextClause
    subscription_delete: TextClause
    subscription_list: TextClause

    # jobs
    job_claim_many: TextClause
    job_heartbeat_many: TextClause
    job_complete_many: TextClause
    job_claim_after_many: TextClause
    job_claim_limited_many: TextClause
    job_complete: TextClause
    job_cancel_claimed: TextClause
    job_fail_many: TextClause
    job_release_many: TextClause
    job_snooze_many: TextClause
    jobs_notify_head: TextClause
    job_first_ready_before: TextClause
    job_claim_candidates: TextClause
    job_bury: TextClause
    job_bury_ready: TextClause
    job_bury_expired: TextClause
    job_reap_many: TextClause
    job_reap_candidates: TextClause
    job_prune_done_many: TextClause
    job_prune_cancelled_many: TextClause
    job_prune_cancelled_candidates: TextClause
    job_prune_superseded_many: TextClause
    job_prune_superseded_candidates: TextClause
    job_prune_candidates: TextClause
    job_dead_list: TextClause
    job_redrive_many: TextClause
    job_retry_now_many: TextClause
    job_scheduled_now_many: TextClause

    # ordering
    job_promote_many: TextClause
    job_ordering_heads_list: TextClause
    job_ordering_blocked_list: TextClause
    job_ordering_release_many: TextClause
    job_ordering_get: TextClause
    job_ordering_skip: TextClause
    job_count_by_status: TextClause
    job_transaction_limits_set_local: TextClause

    # relays
    relay_seen: TextClause
    relay_buffer_remove: TextClause
    relay_delete: TextClause
    relay_prune_many: TextClause

    # statistics
    job_table_reltuples: TextClause
    event_table_analysed: TextClause
    event_table_analyze: TextClause
    lock_timeout_get: TextClause
    lock_timeout_set_local: TextClause
    job_table_analyze: TextClause
    autovacuum_enabled: TextClause
    job_tables_maintainable: TextClause
    current_role_name: TextClause
    job_tables_vacuum: TextClause

    # metrics
    metrics_gatherer_lock_try: TextClause
    metrics_statement_timeout_set_local: TextClause
    job_ready_gauges: TextClause
    job_running_counts: TextClause
    job_dead_counts: TextClause
    event_unrouted_gauges: TextClause

    # roles
    server_version_number: TextClause
    role_names_existing: TextClause
    relation_exists: TextClause

    # schema
    schema_revision: TextClause
    schema_migrate_lock_try: TextClause
    schema_migrate_lock: TextClause
    schema_exists: TextClause
    schema_search_path_set_local: TextClause

    # publish
    event_insert: TextClause
    event_insert_many: TextClause
    event_insert_options: TextClause
    event_insert_options_many: TextClause
    event_dedup_lookup_many: TextClause

    # schedules
    schedule_upsert_many: TextClause
    database_now: TextClause
    schedule_due_list: TextClause
    schedule_advance: TextClause
    schedule_list: TextClause

    # fan-ins
    fanin_upsert_many: TextClause
    fanin_delete_undeclared: TextClause

    # admin
    consumer_status_list: TextClause
    job_done_count_by_consumer: TextClause
    job_superseded_count_by_consumer: TextClause
    event_unrouted_stats: TextClause
    event_unsubscribed_by_topic_list: TextClause
    event_recent_routed_count: TextClause
    event_retained_bounds: TextClause
    subscription_topics_of: TextClause
    job_replay_many: TextClause
    job_cancel_many: TextClause
    job_retry_due_many: TextClause
    job_consumer_get: TextClause
    job_status_many: TextClause
    job_purge_many: TextClause
    job_running_count_of: TextClause
    relay_list: TextClause

    # job listing
    job_list: TextClause
    job_get: TextClause

    # dashboard
    job_page_ready: TextClause
    job_page_running: TextClause
    job_page_pending: TextClause
    job_page_dead: TextClause
    job_page_done: TextClause
    job_page_cancelled: TextClause
    job_page_superseded: TextClause
    job_done_per_minute_list: TextClause
    event_get: TextClause
    event_list_by_key: TextClause
    job_list_of_event: TextClause
    subscription_consumers_of: TextClause

    # hook calls
    hook_call_lease_many: TextClause
    hook_call_delete_many: TextClause
    hook_call_fail: TextClause
    hook_call_counts: TextClause

    def __init__(self, schema: str) -> None:
        self.schema = check_schema_name(schema)
        pattern = relation_pattern()
        for name, statement in statements().items():
            qualified = pattern.sub(rf"{schema}.\1", statement.text)
            setattr(self, name, statement if qualified == statement.text else text(qualified))
        self.schema_create = text(f"CREATE SCHEMA IF NOT EXISTS {schema}")

    def __repr__(self) -> str:
        return f"Statements(schema={self.schema!r})"


def in_schema(schema: str | None = None) -> Statements:
    """The statements of outbox's tables in ``schema`` (None: the process default,
    :func:`outbox.settings.default_schema`, i.e. ``OUTBOX_SCHEMA`` or ``public``). Made once
    per schema and kept: calling this on every use costs two dictionary look-ups. Raises
    :class:`~outbox.errors.ConfigurationError` for an invalid schema name."""
    return _statements(default_schema() if schema is None else schema)


@functools.cache
def _statements(schema: str) -> Statements:
    return Statements(schema)
