# expect: SL002
"""Class-level SQL constants read through self, used together by one method."""


class JobRepository:
    SELECT_PENDING_SQL = "SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 5"
    MARK_RUNNING_SQL = "UPDATE jobs SET status = 'running', worker = %s WHERE id = ANY(%s)"

    def claim(self, cur, me):
        cur.execute(self.SELECT_PENDING_SQL)
        ids = [row[0] for row in cur.fetchall()]
        cur.execute(self.MARK_RUNNING_SQL, (me, ids))
        return ids
