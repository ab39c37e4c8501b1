-- delayed_job's table, as its Active Record migration creates it.
CREATE TABLE delayed_jobs (
    id         bigserial PRIMARY KEY,
    priority   integer NOT NULL DEFAULT 0,
    attempts   integer NOT NULL DEFAULT 0,
    handler    text NOT NULL,
    last_error text,
    run_at     timestamp NOT NULL,  -- every enqueue sets it
    locked_at  timestamp,
    failed_at  timestamp,
    locked_by  varchar,
    queue      varchar,
    created_at timestamp,
    updated_at timestamp
);
