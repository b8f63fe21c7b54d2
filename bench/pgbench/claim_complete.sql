-- Raw limit (scenario 1): one claim and one fenced completion per script run, each its
-- own transaction, exactly as the relay's dispatcher and completer do. The two statements
-- are outbox's own: the harness puts the text of job_claim_many and job_complete_many
-- from outbox/db/queries.py in place of the @ lines below (bench/raw.py, pgbench_script).
-- The claim is wrapped only to carry its ids and fences into pgbench variables.
-- Variables (-D): consumers, leases, worker, limit (the batch: 1 or 50), keep_done (true:
-- done rows stay, as with the default retention). Run with -M prepared.
WITH claimed AS (
-- @job_claim_many
)
SELECT coalesce(array_agg(id), '{}') AS ids, coalesce(array_agg(fence), '{}') AS fences
FROM claimed
\gset
-- @job_complete_many
;
