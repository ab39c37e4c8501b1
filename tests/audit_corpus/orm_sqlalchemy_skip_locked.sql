-- expect: none
-- SQLAlchemy-style output with with_for_update(skip_locked=True), psycopg %(name)s params.
UPDATE "jobs" SET "status"=%(status)s, "worker"=%(worker)s, "locked_until"=%(locked_until)s
WHERE "jobs"."id" IN (SELECT "jobs"."id"
FROM "jobs"
WHERE "jobs"."status" = %(status_1)s ORDER BY "jobs"."id"
 LIMIT %(param_1)s FOR UPDATE SKIP LOCKED) AND "jobs"."status" = %(status_1)s
RETURNING "jobs"."id", "jobs"."payload"
