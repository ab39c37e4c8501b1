"""The claim chain: what a worker claims, how much, from where, and for which chain.

Both workers claim with the same arguments and the same sizes (``_claim_round``,
``_claim_args``): in the claim loop when a chain has room, and in a writer's fused
transaction for the slots a completion frees (``_fused_round``).  A *chain* is one
claim-and-write path (``Chain``); the prefetch sizes how far each claims ahead of its
handlers (``adaptive_prefetch``; docs/decisions/0013-adaptive-prefetch.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from ._base import MakeOp, QueueBase
from ._cursor import ClaimCursor
from ._errors import ConfigError
from ._job import Job
from ._ops import ClaimPosition
from ._wcore import WorkerCore

__all__ = ["Chain", "ClaimArgs", "ClaimRound", "WorkerClaims", "split"]


class ClaimArgs(TypedDict):
    """A worker's claim, as the keyword arguments of ``claim`` and ``_claim_op``."""

    worker: str
    queue: str
    limit: int
    lease: float
    start: ClaimPosition | None
    tasks: Sequence[str] | None


@dataclass(frozen=True, slots=True)
class ClaimRound:
    """One claim statement a worker sends: of which queue, how many jobs at most, when
    it was sent (monotonic) and where in claim order it starts (``ClaimCursor``)."""

    queue: str
    limit: int
    began: float
    start: ClaimPosition | None
    cursor: ClaimCursor  # whose position it started from, and moves on landing


class Chain:
    """One claim-and-write path of a worker: its claim cursor, its share of the handlers
    and of a fixed prefetch, and how many jobs it holds (claimed by it, not yet written
    back).  Each worker adds the writer's side: a queue of outcomes and a claim lock.

    A job is written by the chain that claimed it, so each chain's fused transaction
    completes its own batch and claims the slots that batch frees, and the chains never
    wait for each other.  A chain is sized as a worker of its share would be (its own
    adaptive prefetch): half-sized batches cost the server more per job
    (docs/architecture.md, "Two chains in one Worker").
    """

    def __init__(self, index: int, share: int, fixed_prefetch: int | None, cursor: ClaimCursor):
        self.index = index
        self.share = share  # handlers this chain's jobs are counted against
        self.fixed_prefetch = fixed_prefetch
        self.cursor = cursor
        self.held = 0  # changed only with the jobs it counts (the worker's lock, or loop)
        self.more = False  # its last claim came back full: more work may wait


def split(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` as evenly as integers allow."""
    return total // parts + (1 if index < total % parts else 0)


class WorkerClaims(WorkerCore):
    """Claim sizes and arguments, the rotation of the queues, and the chains."""

    _rotation: int
    _cursor: ClaimCursor
    _cursors: list[ClaimCursor]
    _claim_rtt: float  # a moving average of one claim's round trip

    def _init_claims(self) -> None:
        self._more = False
        self._rotation = 0
        # Each claim starts past the last one (see ClaimCursor: a held xmin or a long
        # unvacuumed history would otherwise cost every claim a visit per dead entry).
        self._cursor = ClaimCursor()
        self._cursors = [self._cursor]  # and each further chain's (_chain_shares)
        self._claim_rtt = 0.002

    def _queue_order(self) -> list[str]:
        """This round's order of the queues: it rotates, so no queue starves another."""
        n = len(self.queues)
        order = [self.queues[(self._rotation + i) % n] for i in range(n)]
        self._rotation = (self._rotation + 1) % n
        return order

    def _claim_round(self, name: str, limit: int, cursor: ClaimCursor | None = None) -> ClaimRound:
        """A claim of up to ``limit`` jobs of queue ``name``, about to be sent, from
        ``cursor``'s position (a chain's own, in a Worker of several; else the worker's)."""
        began = time.monotonic()
        cursor = self._cursor if cursor is None else cursor
        return ClaimRound(name, limit, began, cursor.start(name, began), cursor)

    def _claim_args(self, claim: ClaimRound) -> ClaimArgs:
        """The statement's arguments: the same for the claim loop's claims and the
        writer's fused ones."""
        return ClaimArgs(
            worker=self.name,
            queue=claim.queue,
            limit=claim.limit,
            lease=self.lease,
            start=claim.start,
            tasks=self.tasks,
        )

    def _claim_landed(self, claim: ClaimRound, jobs: Sequence[Job]) -> float:
        """Move the claim cursor past what ``claim`` returned; returns its round trip."""
        rtt = time.monotonic() - claim.began
        claim.cursor.claimed(claim.queue, claim.start, jobs, rtt, claim.began + rtt)
        return rtt

    def _fused_round(
        self, q: QueueBase, free: int, cursor: ClaimCursor | None = None
    ) -> tuple[ClaimRound, MakeOp] | None:
        """The claim a completion batch carries with ``fuse_claims``, for ``free`` slots
        (counting those the batch frees); None if the worker is full: complete alone.

        The claim is the claim loop's own statement, for the first queue of this
        round's order, so the rotation goes on across both kinds of claim.
        """
        if free <= 0:
            return None
        claim = self._claim_round(self._queue_order()[0], free, cursor)
        return claim, q._claim_op(own_transaction=True, **self._claim_args(claim))

    def _claimed(self, name: str, jobs: Sequence[Job], rtt: float) -> None:
        """Count and report one claim statement's answer (before the jobs start)."""
        self._measure("claim_seconds", rtt, name)
        if jobs:
            self.stats.add(claimed=len(jobs))
            for job in jobs:
                self._emit("claimed", job)

    def _rewind(self, now: float) -> None:
        """Send every claim cursor back to the head: swept jobs keep their place."""
        for cursor in self._cursors:
            cursor.rewind(now)

    def _chain_shares(
        self, chains: int | None, prefetch: int | None
    ) -> list[tuple[int, int | None, ClaimCursor]]:
        """Each chain's share of the handlers, of a fixed ``prefetch`` and its cursor
        (the first chain's is the worker's own); ``chains`` None: the default."""
        if chains is None:
            chains = 2 if self.fuse_claims and self.concurrency >= 4 else 1
        if not 1 <= chains <= self.concurrency:
            raise ConfigError(
                f"chains must be 1 to concurrency ({self.concurrency}), not {chains!r}"
            )
        shared = self._cursor.positions
        self._cursors = [self._cursor] + [ClaimCursor(positions=shared) for _ in range(chains - 1)]
        return [
            (
                split(self.concurrency, chains, i),
                None if prefetch is None else split(prefetch, chains, i),
                self._cursors[i],
            )
            for i in range(chains)
        ]

    def _chain_list(self) -> Sequence[Chain]:
        raise NotImplementedError

    @property
    def chains(self) -> int:
        """Claim-and-write paths this worker runs (see the workers' ``chains``)."""
        return len(self._chain_list())

    def _mean_runtime_now(self) -> float:
        """The handlers' moving average run time, which sizes the adaptive prefetch."""
        raise NotImplementedError

    def _prefetch_of(self, chain: Chain) -> int:
        return self.adaptive_prefetch(
            chain.fixed_prefetch, self._mean_runtime_now(), self._claim_rtt, chain.share
        )

    @property
    def prefetch(self) -> int:
        """Jobs claimed beyond ``concurrency`` right now, all chains together (see
        adaptive_prefetch)."""
        return sum(self._prefetch_of(chain) for chain in self._chain_list())

    @property
    def capacity(self) -> int:
        """Jobs this worker holds at most: running, prefetched, or awaiting their write."""
        return self.concurrency + self.prefetch

    def _free(self, chain: Chain) -> int:
        """Jobs ``chain`` may claim now: its share and prefetch, less what it holds."""
        return chain.share + self._prefetch_of(chain) - chain.held

    def _refill(self, chain: Chain) -> int:
        # Once a claim came back full (more work waiting), refill in batches of at
        # least half the chain: one claim per finished job would be a round trip per job.
        return max(1, (chain.share + self._prefetch_of(chain)) // 2)

    def _refill_due(self, chain: Chain) -> bool:
        """More work is known to wait for ``chain`` and a refill batch fits."""
        return chain.more and self._free(chain) >= self._refill(chain)

    def _claim_due(self, chain: Chain) -> int:
        """Jobs the claim loop should claim for ``chain`` now (0: none)."""
        free = self._free(chain)
        return free if free > 0 and (not chain.more or free >= self._refill(chain)) else 0

    def _set_more(self, chain: Chain, more: bool) -> None:
        chain.more = more
        self._more = any(c.more for c in self._chain_list())

    # Adaptive prefetch never goes past the larger of 2 x concurrency and this: a batch
    # of short jobs is claimed and completed for about the cost of one job.  Measured:
    # 20,000 no-op jobs at concurrency 8 drained 1.4x faster with 64 than with 16; once
    # migration 0012 stopped the claim from planning at every call, 40,000 drained
    # 1.3x faster with 256 than with 64 (bench/results/2026-12-05-pick-plan-kept.md),
    # and no faster with 512.  At concurrency 8 only jobs shorter
    # than a 32nd of a claim's round trip go that deep (see adaptive_prefetch).
    PREFETCH_BATCH = 256

    def adaptive_prefetch(
        self,
        fixed: int | None,
        mean_runtime: float,
        claim_rtt: float,
        concurrency: int | None = None,
    ) -> int:
        """Jobs to claim beyond ``concurrency``: ``fixed`` if given, else about as many
        as the handlers finish during one claim round trip, up to the larger of
        2 x concurrency and PREFETCH_BATCH.

        Prefetch keeps handlers fed while the next claim is in flight, and lets short
        jobs be claimed and completed in batches, but a prefetched job waits behind
        running ones (holding a lease another worker could have used): zero for slow
        jobs, deep for no-op ones.  Since the depth is what the handlers finish in one
        claim round trip, a prefetched job waits about that long, however deep.

        ``concurrency``: the handlers this prefetch feeds (one chain's share in a
        Worker of several chains), by default all of them.
        """
        if fixed is not None:
            return fixed
        share = self.concurrency if concurrency is None else concurrency
        wanted = share * claim_rtt / max(mean_runtime, 1e-6)
        return min(max(2 * share, self.PREFETCH_BATCH), int(wanted))
