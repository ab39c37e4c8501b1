"""A handler for the metrics acceptance test: one of each outcome a worker can report."""

from __future__ import annotations

import os
import time

import psycopg
from psycopg import sql

from skiplock import Fail, Job, Retry


def work(job: Job) -> None:
    kind = job.payload.get("kind", "ok")
    if kind == "hang" and job.attempts == 1:
        time.sleep(3600)  # the worker holding it is SIGKILLed here
    elif kind == "fail":
        raise Fail("bad input")
    elif kind == "crash":
        raise RuntimeError("provider down")
    elif kind == "retry_once" and job.attempts == 1:
        raise Retry(0)
    elif kind == "stale" and job.attempts == 1:
        # What a sweep does to a worker paused past its lease: the job goes back to
        # pending and the token this attempt holds is dead.  The worker learns at its
        # next heartbeat, and its completion below is rejected (LeaseLost).  The job is
        # due again only after that, so attempt 2 does not run beside this one.
        with psycopg.connect(os.environ["SKIPLOCK_DSN"], autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "UPDATE {}.jobs SET status = 'pending', locked_until = NULL, "
                    "run_at = now() + interval '3 seconds' "
                    "WHERE id = %s AND lease_token = %s"
                ).format(sql.Identifier(os.environ["ACCEPT_SCHEMA"])),
                (job.id, job.lease_token),
            )
        # Outlast one heartbeat interval (lease / 3) so the heartbeat sees it too.
        time.sleep(float(job.payload["linger"]))
