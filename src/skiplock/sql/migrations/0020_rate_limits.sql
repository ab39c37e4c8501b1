-- skiplock schema, version 20: a per-task (or per-key) rate limit (issue 39, item 3).
-- `@app.task(rate_limit="10/m")` starts at most 10 jobs of the task a minute, spaced 6 s
-- apart; `rate_limit_key=...` (a template over the arguments) gives each key its own rate.
--
-- Schedule, don't gate.  The queue-wide limit (`skiplock limit`, queue_config) gates the
-- claim: when a queue is at its rate nothing of it is claimed, so other tasks of the
-- queue and a delayed job that has come due wait behind the limited ones.  Here the
-- limit is applied once, when the job is inserted: it takes the next free slot of its
-- key and its run_at becomes the later of its own run_at and that slot.  The claim is
-- not changed at all (it already passes over jobs whose run_at is in the future), so
-- nothing else in the queue is ever behind a rate-limited job, and a job without a
-- rate limit pays only the WHEN clause of the trigger below.
--
-- The slot: rate_limits holds, per key, next_at, the earliest time the key's next job
-- may start (a theoretical arrival time, as GCRA keeps it, with a bucket of one: no
-- burst, the same as Celery's rate_limit).  A job takes slot = greatest(now(), next_at)
-- and moves next_at to slot + rate_every, in one upsert of the key's row, whose lock is
-- held until the enqueue's transaction ends: two producers of one key take turns and
-- get distinct slots, and a rolled-back enqueue gives its slot back with its row.  A
-- batch (one COPY) takes consecutive slots, one row after another, in one statement.
--
-- What the limit does not count, so that it stays one row and one upsert per job:
--   * a retry: it keeps its backoff run_at and takes no new slot, so a burst of
--     failures retried at once can start faster than the rate;
--   * a job enqueued with a run_at later than its slot still moves next_at only one
--     interval on from now, so it may start close to another job's slot;
--   * a cancelled or deleted job does not give its slot back: the limit is conservative.
--
-- rate_key and rate_every are inputs of the insert only: the trigger consumes them (sets
-- them to NULL), so that a row moved between generations (a DELETE and an INSERT, see
-- upkeep) does not take a second slot, and the functions that move rows need no change.

ALTER TABLE {schema}.jobs ADD COLUMN rate_key text, ADD COLUMN rate_every float8;

CREATE TABLE {schema}.rate_limits (
    key     text        PRIMARY KEY,
    next_at timestamptz NOT NULL
);

-- SECURITY DEFINER: it runs from a producer's insert, whose role may not write
-- rate_limits directly.
CREATE FUNCTION {schema}.rate_slot() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    every interval;
    slot  timestamptz;
BEGIN
    IF NEW.rate_key IS NULL OR NEW.rate_key = '' OR NOT NEW.rate_every > 0
       OR NEW.rate_every = 'Infinity'::float8 THEN
        RAISE EXCEPTION 'job % has rate_every % but no rate key, or a rate_every that is not a positive number of seconds',
            NEW.id, NEW.rate_every;
    END IF;
    every := make_interval(secs => NEW.rate_every);
    INSERT INTO {schema}.rate_limits AS r (key, next_at)
    VALUES (NEW.rate_key, now() + every)
    ON CONFLICT (key) DO UPDATE
    SET next_at = greatest(r.next_at, now()) + every
    RETURNING r.next_at - every INTO slot;
    NEW.run_at := greatest(NEW.run_at, slot);
    NEW.rate_key := NULL;
    NEW.rate_every := NULL;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_rate_slot
    BEFORE INSERT ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.rate_every IS NOT NULL)
    EXECUTE FUNCTION {schema}.rate_slot();

-- Grants: a producer writes the two new columns; the roles that had INSERT on jobs'
-- columns get them (see roles.sql for new roles).
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee
        FROM pg_attribute AS att, aclexplode(att.attacl) AS a
        WHERE att.attrelid = format('%I.jobs', {schema_name})::regclass
          AND att.attname = 'payload' AND a.privilege_type = 'INSERT' AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT INSERT (rate_key, rate_every) ON %I.jobs TO %I',
                       {schema_name}, pg_get_userbyid(r.grantee));
    END LOOP;
END
$mig$;
