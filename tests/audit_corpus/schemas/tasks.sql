CREATE TABLE tasks (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state     text NOT NULL,
    worker_id text,
    payload   jsonb
);
