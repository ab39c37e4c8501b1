# expect: SL002, SL007
"""asyncpg: select pending ids, then mark them running by id, in one function."""


async def claim(conn, worker, n):
    rows = await conn.fetch("SELECT id FROM jobs WHERE status = 'pending' LIMIT $1", n)
    ids = [r["id"] for r in rows]
    await conn.execute(
        "UPDATE jobs SET status = 'running', worker = $1 WHERE id = ANY($2::bigint[])",
        worker,
        ids,
    )
    return ids
