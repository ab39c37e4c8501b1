-- A queue keyed by state and queue name, neither with a default: the experiment has to
-- seed them from the claim's own conditions (state = 'queued', queue = $1).
CREATE TABLE jobs (
    id         bigserial PRIMARY KEY,
    queue      text NOT NULL,
    state      text NOT NULL,
    priority   int NOT NULL DEFAULT 0,
    claimed_by text,
    args       jsonb NOT NULL DEFAULT '[]'
);
