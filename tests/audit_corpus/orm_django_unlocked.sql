-- expect: SL002
-- Django-style: a queryset slice, then .update() of the ids, without select_for_update().
SELECT "app_job"."id", "app_job"."status", "app_job"."payload"
FROM "app_job"
WHERE "app_job"."status" = %s
ORDER BY "app_job"."id" ASC
LIMIT 10;
UPDATE "app_job" SET "status" = %s, "worker" = %s, "locked_until" = %s
WHERE "app_job"."id" IN (%s, %s, %s);
