-- expect: SL001, SL005
-- Django-style: Job.objects.filter(id__in=pending[:10]).update(...) - the ORM writes the
-- postmortem's bug itself, with its U0 alias in the subquery.
UPDATE "app_job" SET "status" = %s, "worker" = %s
WHERE "app_job"."id" IN (
    SELECT U0."id" FROM "app_job" U0
    WHERE U0."status" = %s
    ORDER BY U0."id" ASC
    LIMIT 10
)
