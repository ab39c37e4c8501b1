# expect: SL006
"""A failure path that is fenced by the job id only."""

MARK_FAILED_SQL = "UPDATE jobs SET status = 'failed', last_error = %s WHERE id = %s"


def fail(cur, job_id, error):
    cur.execute(MARK_FAILED_SQL, (error, job_id))
