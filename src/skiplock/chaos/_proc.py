"""A chaos worker process: a plain skiplock Worker (or AsyncWorker) whose every event
goes to a history.

Run as ``python -m skiplock.chaos._proc '<json config>'``.  It is a separate process,
not a thread, so that the fault injector can SIGKILL and SIGSTOP it like a real worker
host.  The handler's behaviour is chosen per job by the payload's ``k``: ``ok`` (sleep
``ms`` and return), ``hang`` (outlive the job timeout), ``raise`` (always), ``flaky``
(raise on the first two attempts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from skiplock import AsyncWorker, DatabaseUnavailable, Job, Queue, RetryPolicy, Worker

from ._history import HistoryWriter

__all__ = ["ahandle", "handle", "main", "worker_name"]

logger = logging.getLogger("skiplock.chaos")

# A hung handler's thread is abandoned at the job timeout; it still has to end some
# time, or a long run would pile up sleeping threads.
_HANG_FACTOR = 3.0
_hang_seconds = 5.0


def worker_name(run_id: str, slot: int, pid: int) -> str:
    """The worker's name, also its ``application_name`` suffix and its jobs' ``worker``."""
    return f"chaos-{run_id}-{slot}-{pid}"


def handle(job: Job) -> None:
    payload: dict[str, Any] = job.payload if isinstance(job.payload, dict) else {}
    kind = payload.get("k", "ok")
    if kind == "hang":
        threading.Event().wait(_hang_seconds)
        return
    if kind == "raise":
        raise RuntimeError("chaos: this handler always raises")
    if kind == "flaky" and job.attempts < 3:
        raise ConnectionError(f"chaos: flaky handler fails attempt {job.attempts}")
    ms = float(payload.get("ms", 0.0))
    if ms > 0:
        time.sleep(ms / 1000.0)


async def ahandle(job: Job) -> None:
    """``handle`` for the AsyncWorker, in a thread of the loop: a hung one is cancelled
    at the job timeout and its thread abandoned, as Worker abandons a handler thread."""
    await asyncio.to_thread(handle, job)


def main(argv: list[str] | None = None) -> int:
    global _hang_seconds
    args = sys.argv[1:] if argv is None else argv
    cfg: dict[str, Any] = json.loads(args[0])
    pid = os.getpid()
    name = worker_name(cfg["run_id"], int(cfg["slot"]), pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    job_timeout = cfg.get("job_timeout")
    if job_timeout:
        _hang_seconds = float(job_timeout) * _HANG_FACTOR
    history = HistoryWriter(Path(cfg["history_dir"]) / f"worker-{pid}.jsonl")
    history.write({"ev": "proc", "what": "start", "pid": pid, "w": name})
    # Fast retries: the run is short and a retry storm is part of what it tests.
    queue = Queue(
        cfg["dsn"],
        schema=cfg["schema"],
        open=False,
        retry_policy=RetryPolicy(base=0.05, factor=2.0, max_delay=1.0, jitter=0.2),
    )
    stop = threading.Event()
    current: list[Worker | AsyncWorker] = []

    # The handler only writes to a pipe; a thread stops the worker.  Setting an Event in
    # the handler itself can deadlock: the main thread (the claim loop) may be holding
    # that Event's lock when the signal lands (the core's stop_on_signals, likewise).
    read_fd, write_fd = os.pipe()

    def on_signal(signum: int, _frame: object) -> None:
        os.write(write_fd, b"s")

    def on_first_signal() -> None:
        os.read(read_fd, 1)
        stop.set()
        for w in current:
            w.stop()

    threading.Thread(target=on_first_signal, name="chaos-signals", daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_event(event: str, job: Job) -> None:
        history.job_event(event, job, worker=name)

    # What the run chose; the rest are the Worker's own defaults.
    chosen: dict[str, Any] = {}
    if cfg.get("synchronous_commit") is not None:
        chosen["synchronous_commit"] = bool(cfg["synchronous_commit"])
    if cfg.get("fuse_claims") is not None:
        chosen["fuse_claims"] = bool(cfg["fuse_claims"])
    failures = 0
    options: dict[str, Any] = {
        "concurrency": int(cfg.get("concurrency", 4)),
        "lease": float(cfg.get("lease", 2.0)),
        "name": name,
        "poll_interval": 0.25,
        "sweep_interval": float(cfg.get("sweep_interval", 0.5)),
        "job_timeout": job_timeout,
        "shutdown_grace": 2.0,
        "on_event": on_event,
        **chosen,
    }
    while not stop.is_set():
        worker: Worker | AsyncWorker
        if cfg.get("async_workers"):
            worker = AsyncWorker(queue, ahandle, **options)
        else:
            worker = Worker(queue, handle, **options)
        current[:] = [worker]
        if stop.is_set():
            worker.stop()  # the signal came between the loop's test and this line
        try:
            if isinstance(worker, AsyncWorker):
                stats = asyncio.run(worker.run())
                # Its pool reconnects on its own; it keeps no count of them.
                reconnects = 0
            else:
                stats = worker.run()
                reconnects = worker.reconnects
            history.write(
                {
                    "ev": "proc",
                    "what": "stats",
                    "pid": pid,
                    "stats": stats.snapshot(),
                    "reconnects": reconnects,
                }
            )
            break
        except DatabaseUnavailable as exc:
            # Started while the server was down (a restart, a full server): wait and
            # start again; the run counts this, it is not a crash.
            failures += 1
            history.write({"ev": "proc", "what": "start-retry", "pid": pid, "error": str(exc)})
            stop.wait(min(0.1 * 2**failures, 2.0))
    history.write({"ev": "proc", "what": "exit", "pid": pid, "w": name})
    history.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
