# expect: none
"""SQLAlchemy text() with :name parameters: a correct claim and a fenced completion."""

from sqlalchemy import text

CLAIM = text(
    """
    WITH picked AS (
        SELECT id FROM jobs
        WHERE status = 'pending' AND queue = :queue
        ORDER BY priority, id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE jobs AS j
    SET status = 'running', worker = :worker, locked_until = now() + interval '5 minutes'
    FROM picked
    WHERE j.id = picked.id
    RETURNING j.id, j.payload
    """
)


def finish(session, job_id, worker):
    session.execute(
        text("UPDATE jobs SET status = 'done' WHERE id = :id AND worker = :worker"),
        {"id": job_id, "worker": worker},
    )
