-- A pgmq-style queue table in its own schema: the experiment runs it in a scratch database.
CREATE SCHEMA pgmq;
CREATE TABLE pgmq.q_tasks (
    msg_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    read_ct     int NOT NULL DEFAULT 0,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    vt          timestamptz NOT NULL DEFAULT now(),
    message     jsonb
);
