"""A worker's SIGTERM handler stops it even when the signal lands while the main thread
holds a lock that stopping takes.

Python runs a signal handler in the main thread between two bytecodes.  The handler
used to call ``stop()`` itself, which sets threading Events; a SIGTERM arriving while
the claim loop was inside its wake Event (waiting or clearing it, the Event's lock
held) deadlocked the process: the worker logged "finishing running jobs" and never
exited (seen once in CI).  Each case runs in a child process, so a hang fails the test
by its timeout instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import logging, os, signal, threading, time
    from skiplock._wshutdown import stop_on_signals

    logging.basicConfig(level=logging.INFO)
    stopped = threading.Event()
    stop_on_signals(stopped.set, grace=1.0)
    with stopped._cond:  # what Event.wait and Event.clear hold in the claim loop
        os.kill(os.getpid(), signal.SIG{name})
        time.sleep(0.2)  # the handler runs here, in this thread, the lock held
    print("stopped" if stopped.wait(5) else "not stopped", flush=True)
    """
)


@pytest.mark.parametrize("name", ["TERM", "INT"])
def test_a_signal_that_lands_while_the_main_thread_holds_the_lock_still_stops(
    name: str,
) -> None:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD.format(name=name)],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung in its signal handler")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stopped"
    assert f"SIG{name}: finishing running jobs (up to 1s)" in proc.stderr


def test_a_second_signal_exits_at_once() -> None:
    child = textwrap.dedent(
        """
        import os, signal, threading, time
        from skiplock._wshutdown import stop_on_signals

        stop_on_signals(lambda: None, grace=1.0)  # a stop that leaves it running
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=20, check=False
    )
    assert proc.returncode == 128 + 15, proc.stderr
