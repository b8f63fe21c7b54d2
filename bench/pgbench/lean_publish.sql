-- Leanest-SQL pipeline, stage (a) publish (scenario 11, bench/ceiling.py): one transaction
-- inserts a batch of events (500, as the end-to-end scenario's publish_many), the batch sent
-- as one JSON array. Before each batch the publisher reads the backlog (jobs made or to be
-- made and not yet claimed: fan-out x events published - fences handed out, two sequence
-- reads) and waits 2 ms instead while it is at :bound, so the pipeline runs in a steady
-- state rather than piling up events the workers never reach.
-- Variables (-D): topic, payloads (a JSON array, one payload per event), fanout, bound.
-- Run with -M prepared.
SELECT :fanout * (SELECT last_value FROM events_id_seq) - (SELECT last_value FROM fence_seq) AS backlog
\gset
\if :backlog < :bound
INSERT INTO events (topic, payload)
SELECT :topic, p FROM jsonb_array_elements(CAST(:payloads AS jsonb)) AS p;
\else
\sleep 2 ms
\endif
