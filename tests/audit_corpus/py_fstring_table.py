# expect: SL001, SL005
"""f-strings: table names interpolated (placeholders), and dynamic SQL that cannot be
audited is skipped, not reported as an error."""


class Queue:
    def __init__(self, table: str) -> None:
        self.table = table

    def claim(self, cur, n):
        cur.execute(
            f"UPDATE {self.table} SET status = 'running' "  # noqa: S608
            f"WHERE id IN (SELECT id FROM {self.table} WHERE status = 'pending' "
            f"ORDER BY id LIMIT %s) RETURNING id",
            (n,),
        )
        return cur.fetchall()

    def search(self, cur, where, order):
        cur.execute(f"SELECT * FROM {self.table} WHERE {where} {order}")  # noqa: S608
        return cur.fetchall()
