"""Health endpoints of a worker: ``GET /livez`` and ``GET /readyz`` for an orchestrator.

Liveness answers one question: is this process wedged, so that restarting it helps?
Each of the worker's loops (the claim loop, each writer, the heartbeat, the liveness
mark; the event loop itself in an AsyncWorker) marks the *step* it is in (a claim
round, a batch of writes, a beat) and not its waits.  An idle worker has no step in
progress however long it waits, so it is live; a loop stuck inside a call (a statement
blocked on a lock, a connection that stopped answering, a deadlock) shows a step that
began long ago, and past ``stall`` seconds /livez answers 503 naming it.  A database
that refuses connections is not a wedge: the calls fail at once, the loops turn and
retry, and restarting every worker would not bring the server back.  That is what
readiness says.

Readiness runs a small check on a connection of its own, when a probe asks and the
last answer is older than a second (so probes cannot load the server): the server
answers, takes writes (not a standby), and the schema has every migration this code
knows.  A check that does not come back within ``CHECK_TIMEOUT`` answers 503 at once,
so a probe never waits on a stalled connection.  A stopping worker is not ready.

The server is the stdlib's ThreadingHTTPServer on a daemon thread, started by the
worker's ``run()`` and closed before it returns.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from ._base import QueueSettings
from ._errors import ConfigError, one_line
from ._lane import Lane
from ._migrate import applied_versions
from ._sql import migrations

__all__ = ["DEFAULT_HOST", "DEFAULT_STALL", "HealthServer", "Steps", "serve_http"]

logger = logging.getLogger("skiplock.worker")

# Loopback unless told otherwise, like --metrics-addr: in a container the kubelet probes
# the pod's IP, so a Deployment says --health-host 0.0.0.0 (docs/deploy.md); on a host
# nothing is exposed that was not asked for.
DEFAULT_HOST = "127.0.0.1"
# Seconds a step may take before the worker counts as wedged.  A step that cannot reach
# the server returns within a few connect timeouts (10 s each, two retries), so this
# stays above what an outage or a failover makes a step take.
DEFAULT_STALL = 60.0
# Seconds a readiness probe waits for the database check, and how old an answer it
# takes from an earlier probe.
CHECK_TIMEOUT = 2.0
CHECK_MAX_AGE = 1.0

Answer = tuple[bool, dict[str, Any]]


class Steps:
    """When each of a worker's loops began the step it is in; None while it waits.

    The keys are fixed when it is made: the health thread reads the dict while the
    loops write its values, and a dict whose size never changes can be read so.
    """

    def __init__(self, loops: Sequence[str]) -> None:
        self._began: dict[str, float | None] = dict.fromkeys(loops)

    def begin(self, loop: str) -> None:
        self._began[loop] = time.monotonic()

    def end(self, loop: str) -> None:
        self._began[loop] = None

    @contextmanager
    def step(self, loop: str) -> Iterator[None]:
        self._began[loop] = time.monotonic()
        try:
            yield
        finally:
            self._began[loop] = None

    def stuck(self, now: float, bound: float) -> dict[str, float]:
        """The loops whose step began more than ``bound`` seconds before ``now``: its age."""
        return {
            loop: now - began
            for loop, began in list(self._began.items())
            if began is not None and now - began > bound
        }


def schema_problem(schema: str, applied: set[int]) -> str | None:
    """Why a schema with these migrations ``applied`` is too old for this code, or None.

    A newer schema is fine: during a rolling deploy the new release has migrated and
    the old workers go on serving until they are replaced.
    """
    known = [m.version for m in migrations()]
    missing = sorted(set(known) - applied)
    if not missing:
        return None
    if not applied:
        return f"schema {schema!r} has no skiplock tables: run skiplock migrate"
    shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
    return (
        f"schema {schema!r} lacks migration(s) {shown} (this skiplock needs {known[-1]}): "
        "run skiplock migrate"
    )


class _Readiness:
    """The database check, on a thread and a connection of its own, run when asked."""

    def __init__(self, settings: QueueSettings, name: str) -> None:
        self.schema = settings.schema
        self._lane = Lane(settings, f"worker {name} health", cap=1.0)
        self._cond = threading.Condition()
        self._result: tuple[float, Answer] | None = None  # (when the check began, answer)
        self._wanted = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"skiplock-{name}-health-check", daemon=True
        )
        self._thread.start()

    def answer(self) -> Answer:
        asked = time.monotonic()
        with self._cond:
            if self._result is not None and asked - self._result[0] <= CHECK_MAX_AGE:
                return self._result[1]
            self._wanted = True
            self._cond.notify_all()
            fresh = self._cond.wait_for(
                lambda: self._closed or (self._result is not None and self._result[0] >= asked),
                timeout=CHECK_TIMEOUT,
            )
            if not fresh or self._result is None:
                return False, {"reason": f"the database did not answer within {CHECK_TIMEOUT:g}s"}
            return self._result[1]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                self._wanted = False
            began = time.monotonic()
            answer = self._check()
            with self._cond:
                self._result = (began, answer)
                self._cond.notify_all()

    def _check(self) -> Answer:
        try:
            with self._lane.connection() as conn:
                row = conn.execute(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
                ).fetchone()
                applied = applied_versions(conn, self.schema)
        except psycopg.OperationalError as exc:
            return False, {"reason": f"database unreachable: {one_line(exc)}"}
        except psycopg.Error as exc:
            return False, {"reason": f"database check failed: {one_line(exc)}"}
        if row is not None and (row[0] or row[1] == "on"):
            reason = "the server is read-only (a standby): workers need the primary"
            return False, {"reason": reason}
        problem = schema_problem(self.schema, applied)
        if problem is not None:
            return False, {"reason": problem}
        return True, {"schema": self.schema, "version": max(applied)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=CHECK_TIMEOUT + 1.0)
        if self._thread.is_alive():
            # Stuck in a call on a stalled connection, holding the lane: the daemon
            # thread ends with the process, or when the call fails.
            logger.warning("health check still waiting on the database at stop; left behind")
            return
        self._lane.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 5.0  # a client that sends nothing does not hold a thread for long

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        status, doc = self.server.answer(path)
        data = (json.dumps(doc) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("health: " + format, *args)


class _Server(ThreadingHTTPServer):
    answer: Callable[[str], tuple[int, dict[str, Any]]]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A prober that gave up before the answer (a broken pipe): its business, not a
        # traceback on stderr.
        logger.debug("health: request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve_http(
    answer: Callable[[str], tuple[int, dict[str, Any]]],
    *,
    host: str,
    port: int,
    sock: socket.socket | None,
    name: str,
) -> tuple[_Server, threading.Thread]:
    """``answer(path) -> (status, JSON document)`` served on a daemon thread, on
    ``host:port`` or on ``sock``, a socket already listening (``--processes``)."""
    cls = _Server6 if ":" in host else _Server
    try:
        if sock is None:
            server = cls((host, port), _Handler)
        else:
            server = cls(sock.getsockname()[:2], _Handler, bind_and_activate=False)
            server.socket.close()
            server.socket = sock
            server.server_address = sock.getsockname()
    except OSError as exc:
        raise ConfigError(f"cannot serve health on {host}:{port}: {exc.strerror}") from None
    server.answer = answer
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name=name, daemon=True
    )
    thread.start()
    return server, thread


class HealthServer:
    """/livez and /readyz of one worker (see the module's docstring)."""

    def __init__(
        self,
        *,
        name: str,
        settings: QueueSettings,
        stuck: Callable[[float], dict[str, float]],
        stopping: Callable[[], bool],
        host: str,
        port: int,
        stall: float,
        sock: socket.socket | None = None,
    ) -> None:
        self.name = name
        self.stall = stall
        self._stuck = stuck
        self._stopping = stopping
        self._ready = _Readiness(settings, name)
        try:
            self._server, self._thread = serve_http(
                self.answer, host=host, port=port, sock=sock, name=f"skiplock-{name}-health"
            )
        except BaseException:
            self._ready.close()
            raise
        self.host = host
        self.port = int(self._server.server_address[1])
        logger.info("worker %s: health at http://%s:%d/livez and /readyz", name, host, self.port)

    def liveness(self) -> Answer:
        stuck = self._stuck(time.monotonic())
        doc: dict[str, Any] = {"live": not stuck, "worker": self.name}
        if stuck:
            doc["reason"] = (
                ", ".join(f"{loop} stuck for {age:.1f}s" for loop, age in sorted(stuck.items()))
                + f" (more than {self.stall:g}s in one step)"
            )
            doc["stuck"] = {loop: round(age, 3) for loop, age in stuck.items()}
        return not stuck, doc

    def readiness(self) -> Answer:
        if self._stopping():
            return False, {"ready": False, "worker": self.name, "reason": "stopping"}
        ready, doc = self._ready.answer()
        return ready, {"ready": ready, "worker": self.name, **doc}

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/livez":
            ok, doc = self.liveness()
        elif path == "/readyz":
            ok, doc = self.readiness()
        else:
            return 404, {"error": f"no {path}: GET /livez or /readyz"}
        return (200 if ok else 503), doc

    def close(self) -> None:
        """Stop serving and end both threads (called as the worker's run() returns)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._ready.close()
