-- Leanest-SQL pipeline, stage (b) route (scenario 11, bench/ceiling.py): one statement (one
-- transaction) locks up to :route_limit unrouted events, skipping those another router
-- holds, inserts one ready job per subscription of the event's topic and marks the events
-- routed. A router that found nothing waits 1 ms before it looks again.
-- Variables (-D): route_limit. Run with -M prepared.
WITH locked AS (
    SELECT id, topic
    FROM events
    WHERE routed_at IS NULL
    ORDER BY id
    LIMIT :route_limit
    FOR UPDATE SKIP LOCKED
), made AS (
    INSERT INTO jobs (event_id, consumer, status, run_at, attempts)
    SELECT l.id, s.consumer, 'ready', now(), 0
    FROM locked l
    JOIN subscriptions s ON s.topic = l.topic
), routed AS (
    UPDATE events e
    SET routed_at = now()
    WHERE e.id = ANY (ARRAY(SELECT id FROM locked))
    RETURNING 1
)
SELECT count(*) AS routed FROM routed
\gset
\if :routed = 0
\sleep 1 ms
\endif
