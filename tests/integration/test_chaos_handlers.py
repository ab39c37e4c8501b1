"""Chaos: handlers that hang, always raise, or raise on some attempts."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_bad_handlers_end_failed_and_do_not_block_the_others(dsn: str) -> None:
    mix = {"hang": 0.05, "raise": 0.05, "flaky": 0.1}
    report = short_run(dsn, "handlers", mix=mix, job_timeout=0.5)
    # Lost would include any good or flaky job that did not end done, and any hanging
    # or raising job that did not end failed.
    j = assert_sound(report)
    assert j["failed_as_expected"] >= 2
    assert j["events"].get("timed_out", 0) >= 1  # the per-job timeout fired
    assert j["retries"] >= 1
    # Throughput kept pace with the producers while bad jobs failed and retried.
    assert j["throughput"]["during"] >= 0.8 * 60.0, j["throughput"]
