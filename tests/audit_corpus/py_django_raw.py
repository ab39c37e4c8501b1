# expect: none
"""Django raw(): select_for_update-style SQL with SKIP LOCKED, then an ORM update."""


def take(Job, worker):
    jobs = list(
        Job.objects.raw(
            'SELECT "app_job"."id" FROM "app_job" WHERE "app_job"."status" = %s '
            'ORDER BY "app_job"."id" LIMIT 5 FOR UPDATE SKIP LOCKED',
            ["pending"],
        )
    )
    Job.objects.filter(id__in=[j.id for j in jobs]).update(status="running", worker=worker)
    return jobs
