-- One "jobs" shape for the corpus files that claim from jobs: every column any of them
-- reads or sets, plus the queues table that the join-shaped claims need.
CREATE TABLE queues (
    name   text PRIMARY KEY,
    paused boolean NOT NULL DEFAULT false
);

CREATE TABLE jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text NOT NULL DEFAULT 'default',
    status           text NOT NULL DEFAULT 'pending',
    priority         int NOT NULL DEFAULT 0,
    payload          jsonb NOT NULL DEFAULT '{}',
    worker           text,
    attempts         int NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    locked_until     timestamptz,
    lease_expires_at timestamptz,
    heartbeat_at     timestamptz,
    finished_at      timestamptz,
    last_error       text,
    lease_token      uuid
);
