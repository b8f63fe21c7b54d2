-- Leanest-SQL pipeline, stages (c) claim and (d) complete (scenario 11, bench/ceiling.py),
-- each its own transaction as in outbox's dispatcher.
--
-- The claim takes up to :claim_limit due ready jobs of :consumers in (run_at, id) order,
-- skipping locked ones, and sets them running with attempts + 1, a new fence from the one
-- global sequence and a lease of :lease seconds; it returns each job with its event's
-- payload (aggregated only to carry ids and fences into pgbench variables). It starts past
-- the key (:after_run_at, :after_id) of the last job this client claimed, as outbox's
-- dispatcher does, so it does not walk the index entries of every job claimed since the last
-- VACUUM; a claim that comes back short sets the key back to the head (nothing in this
-- pipeline sorts before the key otherwise: one router, no retries).
--
-- The completion is fenced: a job is done only if it still holds that fence and is running.
-- "(status = 'running') IS TRUE" (status is NOT NULL: the same test) keeps the planner from
-- answering it through jobs_running, the partial index of running jobs, which it takes for
-- small: that plan reads every running job (and, until VACUUM, entries of finished ones) and
-- cost the pipeline about 30 % more database CPU per job (docs/performance.md, "The
-- ceiling"); the primary key answers it in 50 probes.
--
-- A worker that claimed nothing waits 1 ms before it looks again.
-- Variables (-D): consumers (a text array), claim_limit, lease (seconds), after_run_at
-- (-infinity), after_id (0). Run with -M prepared.
WITH picked AS (
    SELECT id
    FROM jobs
    WHERE status = 'ready'
      AND run_at <= now()
      AND consumer = ANY (CAST(:consumers AS text[]))
      AND (run_at, id) > (CAST(:after_run_at AS timestamptz), CAST(:after_id AS bigint))
    ORDER BY run_at, id
    LIMIT :claim_limit
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE jobs j
    SET status = 'running',
        attempts = j.attempts + 1,
        fence = nextval('fence_seq'),
        lease_until = now() + make_interval(secs => :lease)
    WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.fence, j.run_at, j.consumer, j.attempts, j.event_id,
              (SELECT e.payload FROM events e WHERE e.id = j.event_id) AS payload
)
SELECT count(*) AS claimed,
       coalesce(array_agg(id), '{}') AS ids,
       coalesce(array_agg(fence), '{}') AS fences,
       jsonb_agg(payload) AS claimed_payloads,
       CASE WHEN count(*) < :claim_limit THEN '-infinity'
            ELSE (array_agg(run_at ORDER BY run_at DESC, id DESC))[1] END AS after_run_at,
       CASE WHEN count(*) < :claim_limit THEN 0
            ELSE (array_agg(id ORDER BY run_at DESC, id DESC))[1] END AS after_id
FROM claimed
\gset
\if :claimed = 0
\sleep 1 ms
\else
UPDATE jobs j
SET status = 'done',
    finished_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:fences AS bigint[])) AS a(id, fence)
WHERE j.id = a.id
  AND j.fence = a.fence
  AND (j.status = 'running') IS TRUE;
\endif
