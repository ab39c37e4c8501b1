"""Where a worker's next claim of a queue starts, and how far back its next sweep looks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._job import Job
from ._ops import ClaimPosition

__all__ = ["ClaimCursor", "SweepCursor"]


@dataclass
class _Head:
    """A queue's last claim from the head, and when the next one is due."""

    began: float
    due: float  # by the factor rule
    latest: float  # by the cap, whatever the claims left
    claims_left: int  # claims from the position still to come before ``due`` counts


class ClaimCursor:
    """A worker's position in each queue's claim order (priority, run_at, id).

    The claim index holds an entry for every row version that was pending.  Once a job
    is claimed its entry is dead, but it is only skipped cheaply after nothing can see
    the old version any more: while a transaction holds back xmin, or until a vacuum
    after a long history, every claim that scans from the head visits the heap for each
    of them.  Starting just past our last claim keeps a claim's cost to the batch.

    A job that sorts before the position (a higher priority, a lease swept back, an
    enqueue whose transaction committed after later ones were claimed) is not seen by
    such a claim, so a claim from the head runs again after ``factor`` times its own
    duration, at least ``floor`` and at most ``cap`` seconds later.  On a clean table,
    where it costs what any claim costs, that is every 50 ms.

    A *costly* claim from the head (more than ``costly`` times the recent claims from
    the position, and more than ``costly_min`` seconds, about a clean table's p99) also
    waits for ``rare`` claims from the position, still at most ``cap`` seconds.  The
    ``factor`` rule alone keeps those claims to 1/``factor`` of the claim loop's time,
    but not to few of its claims: under a held xmin, a 60 ms claim from the head every
    1.2 s was one claim in about 60 (the worker made ~52 claims a second at 1,000
    jobs/s), and it set the claim p99 (54-64 ms in the worst 30 s, against 8 ms fresh).
    One in ``rare`` keeps them out of the p99.  The price is paid by a job behind the
    position while the head is costly: it waits longer for its claim, up to ``cap``, as
    before; except a lease this worker's own sweep gave back (:meth:`rewind`).

    A worker of several chains gives each its own cursor (its own head claims, timed by
    its own claims) but one ``positions``, shared: where the worker's latest claim from
    a position ended.  Apart, a chain whose claims found the queue dry (the other chain
    had just taken what was there) kept a position from long ago, and each of its claims
    walked every entry claimed since: under a held xmin, one claim from the loop in ten
    started 6,000 to 38,000 ids behind the newest, and the claims read 1,500-2,000 dead
    index entries each on average (``bench/run held-claims``; 8 on a fresh table).  What
    lies between a chain's own position and the shared one was claimed by the other
    chain, or skipped by it as another claimer's, exactly what a chain's own claims
    skip: the head claims find what is left.
    """

    def __init__(
        self,
        *,
        floor: float = 0.05,
        cap: float = 10.0,
        factor: float = 20.0,
        costly: float = 4.0,
        costly_min: float = 0.01,
        rare: int = 200,
        positions: dict[str, ClaimPosition] | None = None,
    ) -> None:
        self.floor = floor
        self.cap = cap
        self.factor = factor
        self.costly = costly
        self.costly_min = costly_min
        self.rare = rare
        self._position: dict[str, ClaimPosition] = {} if positions is None else positions
        self._head: dict[str, _Head] = {}
        self._typical: dict[str, float] = {}
        self._rewound = float("-inf")

    def start(self, queue: str, now: float) -> ClaimPosition | None:
        """Where the next claim of ``queue`` starts; None: from the head."""
        head = self._head.get(queue)
        if (
            head is None
            or now >= head.latest
            or self._rewound >= head.began
            or (now >= head.due and head.claims_left <= 0)
        ):
            return None
        return self._position.get(queue)

    def claimed(
        self,
        queue: str,
        start: ClaimPosition | None,
        jobs: Sequence[Job],
        seconds: float,
        now: float,
    ) -> None:
        """Record a claim that started at ``start`` and took ``seconds``."""
        if start is None:
            typical = self._typical.get(queue)
            costly = (
                typical is not None
                and seconds > self.costly * typical
                and seconds > self.costly_min
            )
            self._head[queue] = _Head(
                began=now - seconds,
                due=now + min(self.cap, max(self.floor, self.factor * seconds)),
                latest=now + self.cap,
                claims_left=self.rare if costly else 0,
            )
        else:
            # A moving average of the claims from the position: what "costly" compares to.
            typical = self._typical.get(queue, seconds)
            self._typical[queue] = typical + 0.1 * (seconds - typical)
            if (head := self._head.get(queue)) is not None:
                head.claims_left -= 1
        if jobs:
            # Where this claim stopped, even behind the old position (a claim from the
            # head that found jobs there): the next one continues from it.  A claim from
            # a position never moves it back: another chain's may have moved it past.
            last = max((j.priority, j.run_at, j.id) for j in jobs)
            now_at = self._position.get(queue)
            if start is None or now_at is None or last > now_at:
                self._position[queue] = last

    @property
    def positions(self) -> dict[str, ClaimPosition]:
        """Each queue's position, to share with another chain's cursor."""
        return self._position

    def rewind(self, now: float) -> None:
        """Claim every queue from the head next, unless that claim began after ``now``: a
        sweep that ended at ``now`` gave leases back, and a swept job keeps its place in
        the order, behind the position.  (A time, not a flag cleared by the next claim:
        a claim from the head that was already running may not have seen them.)"""
        self._rewound = now


class SweepCursor:
    """How far back a worker's next sweep looks for leases that ran out.

    The leases index keeps an entry for every lease a running row ever had.  While a
    transaction holds back xmin none of them can be marked dead, so a sweep that scans
    every lease in the past visits the heap once for each job finished since the hold
    began: 99 ms and 20,761 buffers a sweep after minutes of it, growing for as long as
    the hold lasts.  A lease that ran out before this worker's previous sweep started was
    that sweep's to return (it saw every committed lease up to then, SKIP LOCKED aside), so
    the next one looks back only to ``margin`` seconds before it: its cost follows the
    sweep interval, not the hold.

    Two cases escape that window, and a sweep from the start, every ``full_every``
    seconds (or ``factor`` times its own duration, if longer), returns them: a lease
    written by a transaction that committed after that sweep's snapshot yet ran out
    before it (a claim or heartbeat slower than the lease, less ``margin``), and a row
    the previous sweep skipped because a heartbeat held it and then rolled back.
    """

    def __init__(self, *, margin: float = 2.0, full_every: float = 30.0, factor: float = 20.0):
        self.margin = margin
        self.full_every = full_every
        self.factor = factor
        self._last_start: float | None = None
        self._next_full = 0.0

    def window(self, now: float) -> float | None:
        """Seconds the sweep starting at ``now`` looks back; None: all the way."""
        if self._last_start is None or now >= self._next_full:
            return None
        return now - self._last_start + self.margin

    def swept(self, window: float | None, start: float, seconds: float) -> None:
        """Record a sweep that succeeded (a failed one moves nothing: the next looks back
        to the last that did)."""
        self._last_start = start
        if window is None:
            self._next_full = start + seconds + max(self.full_every, self.factor * seconds)
