"""`skiplock worker --processes N`: N worker processes under one command.

A worker process runs its Python on one core at a time (the GIL), so on a machine with
more cores one process leaves them idle while short jobs queue up.  The supervisor
starts N copies of the worker command, each a process of its own, and does nothing
else: it claims nothing and holds no lease, so correctness stays with each worker.

Signals.  Each child runs in a session of its own, so a Ctrl-C at the terminal reaches
the supervisor only, which passes every SIGTERM or SIGINT it gets on to each child once:
the first stops them gracefully, a second makes them exit at once, exactly as for one
worker.  (Under systemd, use ``KillMode=mixed``: the default sends the signal to every
process of the unit, and each child would get it twice, the second time from us.)

A child that exits while no signal came is started again after a pause that doubles
from 1 s up to 30 s while it keeps dying within a minute; its jobs come back by its
session's end (``sweep_dead``) or its leases, as for any dead worker.  A child that
exits 2 (bad options, found only once it ran) stops them all: starting it again would
fail the same way.

Health (``--health-port``).  A probe reaches one port of a container, so the supervisor
serves /livez and /readyz there and answers for all its children: it makes a listening
socket on 127.0.0.1 per slot, kept across restarts, and each child serves its own health
on its slot's socket (passed as a file descriptor, so no port can be taken meanwhile).
/livez is 503 when a running child's is (wedged), or a child has not answered for
longer than ``--health-stall`` since it started; a child being started again counts as
live (the supervisor is doing what a restart would).  /readyz is 503 unless every child
is running and ready.  The body lists each child's answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from .._health import CHECK_TIMEOUT, serve_http

__all__ = ["supervise"]

logger = logging.getLogger("skiplock.worker")

# A child reads its options as JSON on stdin, runs one worker, exits with its code.
_CHILD = "from skiplock.cli._worker import child_main; child_main()"
_BACKOFF_FIRST, _BACKOFF_CAP, _STABLE_AFTER = 1.0, 30.0, 60.0


@dataclass
class _Slot:
    """One of the N places a child runs in, and its history of starts."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    backoff: float = _BACKOFF_FIRST
    restart_at: float | None = None
    codes: list[int] = field(default_factory=list)
    health: socket.socket | None = None  # where its child serves /livez and /readyz


def _name(base: str | None, slot: _Slot) -> str | None:
    """A child's worker name: unique per start, so that a restarted child does not take
    the liveness mark of the one that died before its jobs were recovered."""
    if base is None:
        return None  # the worker's own default, host-pid, is unique per process
    return f"{base}-{slot.index}" if slot.starts == 1 else f"{base}-{slot.index}.{slot.starts}"


def _start(slot: _Slot, params: dict[str, Any]) -> None:
    slot.starts += 1
    options = {**params, "name": _name(params["name"], slot)}
    fds: tuple[int, ...] = ()
    if slot.health is not None:
        fds = (slot.health.fileno(),)
        options.update(health_port=0, health_host="127.0.0.1", health_fd=fds[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        start_new_session=True,  # our signals only, passed on once
        pass_fds=fds,
    )
    assert proc.stdin is not None
    # On stdin, not in argv or the environment: the DSN may hold a password.  A child
    # that died at once is reaped (and started again) like any other that exits.
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(json.dumps(options).encode())
        proc.stdin.close()
    slot.proc, slot.started_at, slot.restart_at = proc, time.monotonic(), None


def supervise(processes: int, params: dict[str, Any]) -> int:
    """Run ``processes`` workers with ``params`` until a signal; returns the exit code:
    the most serious of the children's (2 bad options, 3 work abandoned, 128 + signal
    after a second signal, 1 for any other failure), else 0."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    slots = [_Slot(i + 1) for i in range(processes)]
    health = None
    if params.get("health_port") is not None:
        # Before anything starts: a port in use is exit 2, with no child to stop.
        health = _Health(slots, params["health_stall"])
        health.serve(params["health_host"], params["health_port"])
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    passed_on = 0
    try:
        for slot in slots:
            _start(slot, params)
        logger.info("supervising %d worker processes", processes)
        while True:
            while passed_on < len(received):
                signum = received[passed_on]
                passed_on += 1
                if passed_on == 1:
                    logger.info(
                        "%s: stopping %d worker processes (signal again to exit at once)",
                        signal.Signals(signum).name,
                        processes,
                    )
                for slot in slots:
                    if slot.proc is not None and slot.proc.poll() is None:
                        slot.proc.send_signal(signum)
            if _step(slots, params, stopping=bool(received)):
                break
            if health is not None:
                health.turned = time.monotonic()
            time.sleep(0.05)
    finally:
        if health is not None:
            health.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        for slot in slots:
            if slot.proc is not None:
                if slot.proc.poll() is None:
                    slot.proc.kill()  # only if we ourselves failed: no child outlives us
                slot.codes.append(slot.proc.wait())
    return _exit_code(slots, received)


def _step(slots: list[_Slot], params: dict[str, Any], stopping: bool) -> bool:
    """Reap exited children and start again those due; True when all are done."""
    now = time.monotonic()
    for slot in slots:
        proc = slot.proc
        if proc is None or proc.poll() is None:
            continue
        slot.codes.append(proc.returncode)
        slot.proc = None
        if stopping:
            continue
        if proc.returncode == 2:
            logger.error(
                "worker process %d exited 2 (bad options); stopping the others", slot.index
            )
            for other in slots:
                if other.proc is not None and other.proc.poll() is None:
                    other.proc.send_signal(signal.SIGTERM)
            continue
        lived = now - slot.started_at
        if lived >= _STABLE_AFTER:
            slot.backoff = _BACKOFF_FIRST
        slot.restart_at = now + slot.backoff
        logger.warning(
            "worker process %d (pid %d) exited with %s after %.1fs; starting it again in %.1fs",
            slot.index,
            proc.pid,
            proc.returncode,
            lived,
            slot.backoff,
        )
        slot.backoff = min(slot.backoff * 2, _BACKOFF_CAP)
    bad_options = any(2 in slot.codes for slot in slots)
    if stopping or bad_options:
        return all(slot.proc is None for slot in slots)
    for slot in slots:
        if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
            _start(slot, params)
    return False


def _exit_code(slots: list[_Slot], received: list[int]) -> int:
    # The last code of each slot is how it ended; earlier ones were started again.
    if any(2 in slot.codes for slot in slots):
        return 2
    if len(received) >= 2:
        return 128 + received[-1]
    # A child still starting when the signal came was ended by it (before it could
    # take the signal itself): it held nothing, so that is a clean stop.
    final = [0 if -c in received else c for c in (s.codes[-1] for s in slots if s.codes)]
    if 3 in final:
        return 3
    if any(code != 0 for code in final):
        return 1
    return 0


class _Health:
    """The supervisor's /livez and /readyz: its children's answers, put together."""

    def __init__(self, slots: list[_Slot], stall: float) -> None:
        self.slots = slots
        self.stall = stall
        self.turned = time.monotonic()  # the supervisor's loop, each pass
        for slot in slots:
            slot.health = socket.create_server(("127.0.0.1", 0))
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def serve(self, host: str, port: int) -> None:
        try:
            self._server, self._thread = serve_http(
                self.answer, host=host, port=port, sock=None, name="skiplock-supervisor-health"
            )
        except BaseException:
            self.close()
            raise
        bound = self._server.server_address[1]
        logger.info("supervisor: health at http://%s:%d/livez and /readyz", host, bound)

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path not in ("/livez", "/readyz"):
            return 404, {"error": f"no {path}: GET /livez or /readyz"}
        key = "live" if path == "/livez" else "ready"
        with ThreadPoolExecutor(max_workers=len(self.slots)) as pool:
            children = list(pool.map(lambda slot: self._child(slot, path), self.slots))
        reasons = [
            f"process {c['process']}: {c.get('reason', 'not ' + key)}"
            for c in children
            if not c[key]
        ]
        if key == "live" and time.monotonic() - self.turned > self.stall:
            reasons.append(f"supervisor loop stuck for {time.monotonic() - self.turned:.1f}s")
        doc: dict[str, Any] = {key: not reasons, "processes": children}
        if reasons:
            doc["reason"] = "; ".join(reasons)
        return (503 if reasons else 200), doc

    def _child(self, slot: _Slot, path: str) -> dict[str, Any]:
        proc, started, sock = slot.proc, slot.started_at, slot.health
        out: dict[str, Any] = {"process": slot.index}
        if proc is None or proc.poll() is not None or sock is None:
            # Being started again: live (we are doing what a restart would), not ready.
            return {**out, "live": True, "ready": False, "reason": "being started again"}
        out["pid"] = proc.pid
        port = sock.getsockname()[1]
        try:
            url = f"http://127.0.0.1:{port}{path}"
            with urllib.request.urlopen(url, timeout=CHECK_TIMEOUT + 1.0) as resp:
                return {**out, **json.loads(resp.read())}
        except urllib.error.HTTPError as exc:
            with contextlib.suppress(ValueError):
                return {**out, **json.loads(exc.read())}
            problem = f"answered {exc.code}"
        except (OSError, ValueError) as exc:
            problem = f"did not answer ({exc})"
        if time.monotonic() - started < self.stall:
            return {**out, "live": True, "ready": False, "reason": "starting"}
        return {**out, "live": False, "ready": False, "reason": problem}

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for slot in self.slots:
            if slot.health is not None:
                slot.health.close()
                slot.health = None
