-- The postmortem's queue table, verbatim from its minimal reproduction, plus the columns
-- and index its fix added.  Used by the experiment's tests and the closing note's run.
CREATE TABLE jobs (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status     text NOT NULL DEFAULT 'pending',
    payload    jsonb NOT NULL,
    worker     text,
    started_at timestamptz
);

ALTER TABLE jobs ADD COLUMN locked_until timestamptz;
ALTER TABLE jobs ADD COLUMN attempts int NOT NULL DEFAULT 0;
CREATE INDEX jobs_claimable_idx ON jobs (id) WHERE status = 'pending';
