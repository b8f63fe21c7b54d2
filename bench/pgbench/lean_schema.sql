-- The leanest-SQL pipeline's schema (scenario 11, bench/ceiling.py): outbox's logical data
-- and nothing else, in a database of its own. UNIQUE (event_id, consumer) is outbox's
-- exactly-once routing guard; the harness drops it for the one run that measures its cost.
CREATE SEQUENCE fence_seq;

CREATE TABLE events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    key text,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    routed_at timestamptz
);
CREATE INDEX events_unrouted ON events (id) WHERE routed_at IS NULL;

CREATE TABLE subscriptions (
    topic text NOT NULL,
    consumer text NOT NULL,
    PRIMARY KEY (topic, consumer)
);

CREATE TABLE jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id bigint NOT NULL,
    consumer text NOT NULL,
    status text NOT NULL DEFAULT 'ready',
    run_at timestamptz NOT NULL DEFAULT now(),
    attempts int NOT NULL DEFAULT 0,
    fence bigint,
    lease_until timestamptz,
    finished_at timestamptz,
    CONSTRAINT jobs_event_consumer UNIQUE (event_id, consumer)
);
CREATE INDEX jobs_ready ON jobs (run_at, id) WHERE status = 'ready';
CREATE INDEX jobs_running ON jobs (lease_until) WHERE status = 'running';
