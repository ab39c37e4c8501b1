-- skiplock schema, version 5: one row per enqueued tick of a periodic schedule.
--
-- The primary key on (name, scheduled_at) is what makes a tick enqueue exactly once
-- however many schedulers run: each one inserts the tick and its job in one statement
-- (periodic.sql, `periodic_enqueue`), and a second insert of the same tick conflicts
-- and inserts no job.  No leader, no lock held between statements.  max(scheduled_at)
-- per name is where a restarted scheduler resumes its catch-up.  job_id is a record,
-- not a foreign key: retention may delete the job and the tick must stay.

CREATE TABLE {schema}.periodic_ticks (
    name         text        NOT NULL,
    scheduled_at timestamptz NOT NULL,
    job_id       bigint      NOT NULL,
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, scheduled_at)
);
