"""The adaptive prefetch: deep for short jobs, none for slow ones, bounded either way.

How deep is a trade: a prefetched job waits behind running ones while it holds a lease
another worker could use, but short jobs claimed and completed a few at a time pay a
round trip each.  The depth is what the handlers finish in one claim round trip, capped
at the larger of 2 x concurrency and ``PREFETCH_BATCH``.
"""

from __future__ import annotations

import pytest

from skiplock._handlers import RunTime
from skiplock._workerbase import WorkerBase

RTT = 0.002  # a claim round trip of 2 ms


class Sizing:
    """Just what adaptive_prefetch reads of a worker (building one connects)."""

    PREFETCH_BATCH = WorkerBase.PREFETCH_BATCH

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency

    def adaptive_prefetch(self, fixed: int | None, mean_runtime: float, claim_rtt: float) -> int:
        return WorkerBase.adaptive_prefetch(self, fixed, mean_runtime, claim_rtt)  # type: ignore[arg-type]


def worker(concurrency: int) -> Sizing:
    return Sizing(concurrency)


@pytest.mark.parametrize(("concurrency", "cap"), [(1, 256), (8, 256), (32, 256), (256, 512)])
def test_short_jobs_prefetch_up_to_the_batch_or_twice_the_concurrency(
    concurrency: int, cap: int
) -> None:
    w = worker(concurrency)
    assert w.adaptive_prefetch(None, mean_runtime=1e-6, claim_rtt=RTT) == cap
    assert cap == max(2 * concurrency, WorkerBase.PREFETCH_BATCH)


def test_the_depth_is_what_handlers_finish_in_one_claim_round_trip() -> None:
    w = worker(8)
    # 8 handlers each finishing a job every 0.5 ms run 32 jobs in 2 ms.
    assert w.adaptive_prefetch(None, mean_runtime=0.0005, claim_rtt=RTT) == 32
    # Jobs slower than a round trip get none: a prefetched job would only wait.
    assert w.adaptive_prefetch(None, mean_runtime=1.0, claim_rtt=RTT) == 0


def test_a_fixed_prefetch_is_kept() -> None:
    w = worker(8)
    assert w.adaptive_prefetch(3, mean_runtime=1e-6, claim_rtt=RTT) == 3
    assert w.adaptive_prefetch(500, mean_runtime=10.0, claim_rtt=RTT) == 500


def test_before_any_job_ends_nothing_is_prefetched() -> None:
    # The prior says slow: a slow first job never waits behind another.
    assert worker(8).adaptive_prefetch(None, RunTime().value, claim_rtt=RTT) == 0


def test_the_first_job_replaces_the_prior() -> None:
    """A worker that starts on a backlog of short jobs prefetches deep after its first
    job, not after ~200 of them (5 % a job from a 1 s prior)."""
    rt = RunTime()
    rt.add(0.00002)
    assert rt.value == pytest.approx(0.00002)
    assert worker(8).adaptive_prefetch(None, rt.value, claim_rtt=RTT) == 256
    # A slow first job after all: still none.
    slow = RunTime()
    slow.add(2.0)
    assert worker(8).adaptive_prefetch(None, slow.value, claim_rtt=RTT) == 0


def test_the_first_jobs_are_averaged_then_each_new_one_weighs_five_percent() -> None:
    rt = RunTime()
    times = [0.001 * (i + 1) for i in range(20)]
    for t in times:
        rt.add(t)
    assert rt.value == pytest.approx(sum(times) / len(times))
    before = rt.value
    rt.add(1.0)
    assert rt.value == pytest.approx(before + RunTime.WEIGHT * (1.0 - before))
