"""Chaos: a proxy between the queue and Postgres drops, resets and stalls connections."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from psycopg import sql

from skiplock import DatabaseUnavailable, LeaseLost, Queue, Worker
from skiplock.chaos import ChaosProxy, proxied_dsn, upstream_of

pytestmark = pytest.mark.chaos


def test_pool_serves_a_waiting_caller_soon_after_the_server_answers_again(
    dsn: str, queue: Queue
) -> None:
    """A brief outage must not park callers until their pool timeout (10 s here).

    The proxy resets every connection and refuses new ones for a second: the pool's
    reconnection attempts fail meanwhile.  The caller waiting for a connection must be
    served once connections succeed again, not when its own timeout runs out.
    """
    job_id = queue.enqueue({"n": 1})
    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, connect_timeout=10)
        try:
            assert q.get(job_id) is not None
            proxy.refuse(1.0)
            assert proxy.reset() >= 1
            t0 = time.monotonic()
            assert q.get(job_id) is not None
            waited = time.monotonic() - t0
        finally:
            q.close()
    assert waited < 5.0, f"caller waited {waited:.1f}s for a connection after a 1s outage"


def test_queue_retry_of_a_committed_completion_is_lease_lost_by_contract(
    dsn: str, queue: Queue
) -> None:
    """The server commits a completion, the reply is lost and the call's retries run out.

    Completing again is LeaseLost at the Queue level (the job no longer runs under that
    token: a second completion is rejected).  The proxy makes this real: what the
    worker's writer must do with it is the next test.
    """
    from dataclasses import replace

    job_id = queue.enqueue({"n": 1})
    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, open=False)
        # No retry inside the call: the unknown outcome reaches the caller.
        one_try = Queue.from_settings(replace(q.settings, op_retries=0), max_size=1)
        try:
            [job] = one_try.claim(worker="w1", lease=30)
            assert job.id == job_id
            assert proxy.swallow() >= 1
            errors: list[BaseException] = []

            def complete() -> None:
                try:
                    one_try.complete(job)
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=complete)
            t.start()
            _wait(lambda: _status(queue, job_id) == "done", "the completion to commit")
            proxy.reset()
            t.join(10)
            assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable), errors
            _wait(lambda: proxy.connections >= 1, "the pool to reconnect")
            with pytest.raises(LeaseLost):
                one_try.complete(job)
        finally:
            one_try.close()


def test_an_enqueue_without_a_key_whose_reply_is_lost_is_retried_once(
    dsn: str, queue: Queue
) -> None:
    """The insert commits, its reply is lost, the connection breaks: the retry must find
    the row under the id it reserved and return it, not insert it again nor say "may or
    may not have committed".  (enqueue_many's reservation is a round trip of its own,
    which a swallowing proxy would stall: test_queue.py drives its retry directly.)"""
    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, max_size=1)
        try:
            q.enqueue({"warm": 1})  # the next id is reserved now: no round trip of its own
            before = _count(queue)
            n = 1
            out: list[Any] = []

            def send() -> None:
                try:
                    payloads = [{"lost": i} for i in range(n)]
                    out.append([q.enqueue(payloads[0])])
                except BaseException as exc:
                    out.append(exc)

            assert proxy.swallow() >= 1
            t = threading.Thread(target=send)
            t.start()
            _wait(lambda: _count(queue) == before + n, "the insert to commit unseen")
            proxy.reset()
            t.join(20)
            [ids] = out
            assert isinstance(ids, list), ids
            assert _count(queue) == before + n  # not sent twice
            for i, job_id in enumerate(ids):
                job = queue.get(job_id)
                assert job is not None and job.payload == {"lost": i}
        finally:
            q.close()


def _count(q: Queue) -> int:
    with q.connection() as c:
        row = c.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(q.schema))
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("fuse_claims", [False, True])
def test_worker_does_not_report_a_committed_completion_as_lease_lost(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, fuse_claims: bool
) -> None:
    """The writer's batch committed but the call failed (retries ran out, as above).

    The writer keeps the batch and writes it again.  The job is done under its own
    token: the worker must count it completed and emit ``completed``, not
    ``lease_lost`` ("the write changed nothing", which is false here).  With
    ``fuse_claims`` the batch is written by ``_complete_and_claim``, else by
    ``complete_many``: the one the mode uses is the one that fails.
    """
    import skiplock._worker as worker_mod

    class CommitThenFail(Queue):
        failed_once: str | None = None

        def _fail_once(self, what: str) -> None:
            if CommitThenFail.failed_once is None:
                CommitThenFail.failed_once = what
                raise DatabaseUnavailable("complete: cannot reach PostgreSQL (retries ran out)")

        def complete_many(self, jobs: Any, **kwargs: Any) -> Any:
            res = super().complete_many(jobs, **kwargs)
            self._fail_once("complete_many")
            return res

        def _complete_and_claim(self, items: Any, claim: Any, **kwargs: Any) -> Any:
            res = super()._complete_and_claim(items, claim, **kwargs)
            self._fail_once("_complete_and_claim")
            return res

    monkeypatch.setattr(worker_mod, "Queue", CommitThenFail)
    events: list[tuple[str, int]] = []
    job_id = queue.enqueue({"n": 1})
    w = Worker(
        queue,
        lambda job: None,
        concurrency=1,
        lease=30,
        listen=False,
        poll_interval=0.05,
        on_event=lambda ev, job: events.append((ev, job.id)),
        fuse_claims=fuse_claims,
    )
    t = w.start()
    try:
        _wait(lambda: CommitThenFail.failed_once is not None, "the first write")
        _wait(lambda: len(events) >= 3, "the worker to settle the job")
    finally:
        w.stop()
        t.join(30)
    assert CommitThenFail.failed_once == ("_complete_and_claim" if fuse_claims else "complete_many")
    assert _status(queue, job_id) == "done"
    assert events == [("claimed", job_id), ("started", job_id), ("completed", job_id)]
    assert w.stats.completed == 1 and w.stats.lease_lost == 0


def _status(q: Queue, job_id: int) -> str | None:
    job = q.get(job_id)
    return job.status if job else None


def _wait(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_resets_drops_and_stalls_through_the_proxy_lose_nothing(dsn: str) -> None:
    from .chaos_util import assert_sound, short_run

    report = short_run(dsn, "proxy", fault_interval=0.5, min_faults=5)
    j = assert_sound(report)
    assert j["faults_injected"]["proxy"] >= 5
    # Stalls are shorter than the lease and resets are retried at once: no job re-runs.
    # A worker whose every connection was reset is alive only if its mark is back within
    # the liveness grace (1 s): CI once saw a job run again when the liveness thread
    # waited out its interval after each failed step (test_liveness: the mark is now
    # back in tens of milliseconds after a reset).
    assert j["duplicated_executions"] == 0, j["duplicated_execution_causes"]
