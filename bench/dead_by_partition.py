"""Dead tuples of each table of a schema, every 15 s, while a Worker serves a steady flow
under a held xmin.

``python bench/dead_by_partition.py [SECONDS] [RATE]`` (default 600 s, 1,000 jobs/s)

The storage bench (``skiplock_bench.storage``) samples the sum over the partitions of
``jobs`` every 30 s; this names the table each dead tuple is in, so that a rise can be
told from the rotation's saw (a generation's dead versions grow until its truncation,
then go at once) and from a small table that nothing truncates.  The Worker is
``held_claims.py``'s child (a ``Worker`` of 8, its defaults) in a process of its own; a
REPEATABLE READ transaction holds back xmin from the start.  The DSN is
$SKIPLOCK_BENCH_DSN or the local server; the schema is dropped at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from skiplock_bench.common import DEFAULT_DSN  # bench/ is on the path

DSN = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
HERE = Path(__file__).resolve().parent


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 600.0
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 1000.0
    from skiplock import Queue

    schema = "dead_" + uuid.uuid4().hex[:8]
    q = Queue(DSN, schema=schema, max_size=1)
    q.migrate()
    out = f"/tmp/{schema}-claims.json"
    proc = subprocess.Popen([sys.executable, str(HERE / "held_claims.py"), "--child", schema, out])
    admin = psycopg.connect(DSN, autocommit=True)
    holder = psycopg.connect(DSN)
    sent = 0
    try:
        time.sleep(3.0)  # the worker's start
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")  # takes the snapshot
        t0 = time.monotonic()
        due_sample = 15.0
        while (now := time.monotonic() - t0) < seconds:
            due = int(now * rate) - sent
            if due > 0:
                q.enqueue_many([{}] * due)
                sent += due
            if now >= due_sample:
                rows = admin.execute(
                    "SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                    "WHERE schemaname = %s AND n_dead_tup > 0 ORDER BY relname",
                    (schema,),
                ).fetchall()
                dead = {str(r[0]): int(r[1]) for r in rows}
                jobs = sum(v for k, v in dead.items() if k.startswith("jobs_"))
                print(f"t={int(now):4d}s jobs partitions {jobs:7,d}  {dead}", flush=True)
                due_sample += 15.0
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        holder.rollback()
        holder.close()
        q.close()
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        admin.close()
        Path(out).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
