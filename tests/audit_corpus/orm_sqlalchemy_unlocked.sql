-- expect: SL001
-- SQLAlchemy-style output: quoted names, :name parameters, no with_for_update().
UPDATE "jobs" SET "status"=:status, "worker"=:worker, "locked_until"=:locked_until
WHERE "jobs"."id" IN (SELECT "jobs"."id"
FROM "jobs"
WHERE "jobs"."status" = :status_1 ORDER BY "jobs"."id"
 LIMIT :param_1) RETURNING "jobs"."id", "jobs"."payload"
