"""`skiplock worker` with no options builds the same Worker as `Worker(q, handler)` does.

Issue 14: the command's `--prefetch` defaulted to 0 where the library adapts it (up to
2 x concurrency), and the deployed worker drained no-op jobs at half the library's rate.
A timing test would be flaky on a shared machine; comparing the defaults is not.
"""

from __future__ import annotations

import inspect

from skiplock import Worker
from skiplock.cli._worker import worker as worker_command

# Options the command maps onto Worker() under the same name.
SAME_NAME = {
    "concurrency",
    "prefetch",
    "heartbeat_interval",
    "job_timeout",
    "name",
    "poll_interval",
    "sweep_interval",
    "shutdown_grace",
    "retention",
    "fuse_claims",
    "pool",
    "soft_timeout",
    "max_tasks_per_child",
    "max_memory_per_child",
}


def _cli_defaults() -> dict[str, object]:
    """The arguments the command's function receives for a bare command line."""
    ctx = worker_command.make_context("worker", ["--handler", "mod:fn"])
    return dict(ctx.params)


def _library_defaults() -> dict[str, object]:
    sig = inspect.signature(Worker.__init__)
    return {
        name: p.default
        for name, p in sig.parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_worker_command_defaults_are_the_library_defaults() -> None:
    cli, lib = _cli_defaults(), _library_defaults()
    shared = SAME_NAME & cli.keys() & lib.keys()
    # A rename on either side must not make this test silently check less.
    assert shared == SAME_NAME, sorted(SAME_NAME - shared)
    differing = {k: (cli[k], lib[k]) for k in sorted(shared) if cli[k] != lib[k]}
    assert differing == {}, f"CLI default vs Worker() default: {differing}"
    assert cli["no_listen"] is (not lib["listen"])
    # No --lease: the command passes none, so Worker's default (or an app's longest
    # task lease) applies; no --queue: "default" for --handler, an app's own queues.
    assert cli["lease"] is None and "lease" in lib
    assert cli["queues"] == ()
