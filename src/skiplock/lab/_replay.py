"""The postmortem's two psql windows, scripted: replay any claim with two sessions, step by step.

Session A begins and claims; session B begins and claims while A is still open; if B is
seen blocked (``pg_blocking_pids``), A commits and B's claim is waited for; then both
commit.  For ``naive`` that shows the incident: B blocks, A commits, and B returns the
same jobs 1, 2, 3.  For ``skip-locked`` B takes 4, 5, 6 without waiting.  A strategy that
retries serialization failures retries here too, and the retry is on the timeline.

Some claims race only when the other claim commits while B's statement is already
running, yet never make B wait on A (an advisory lock re-taken after A's commit, say).
The "held" schedule shows those: a third session H row-locks one job, so B's claim is
held mid-statement, after its snapshot; A claims and commits meanwhile; then H lets go.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from ._steps import Event, Query, Session, StepDriver, StepHandle, StepTimeout
from ._strategies import (
    ClaimContext,
    ClaimStep,
    Strategy,
    custom_strategy,
    get_strategy,
    scratch_schema,
)

__all__ = ["SCHEDULES", "Timeline", "replay", "replay_prepared"]

# "A first": the postmortem's psql windows.  "B held": B is held mid-claim by H's row lock
# while A claims and commits.
SCHEDULES = ("A first", "B held")


@dataclass
class Timeline:
    """What a replay did: the events in order and the jobs each session ended up holding."""

    strategy: str
    jobs: int
    limit: int
    events: list[Event] = field(default_factory=list)
    holds: dict[str, list[int]] = field(default_factory=dict)
    begin: str = "BEGIN"
    schedule: str = "A first"
    # The claim writes nothing: a session holds its rows only until its transaction ends,
    # so B taking A's rows after A's COMMIT is no double claim.
    released_at_commit: bool = False

    @property
    def double_claimed(self) -> list[int]:
        """Jobs both sessions hold (at the same time, for a claim released at commit)."""
        a, b = (set(self.holds.get(s, [])) for s in ("A", "B"))
        if self.released_at_commit and not self._held_together():
            return []
        return sorted(a & b)

    def _span(self, session: str) -> tuple[int, int]:
        """From the event that handed ``session`` its rows to the end of its transaction."""
        got = [
            e.seq
            for e in self.events
            if e.session == session and e.status == "returned" and e.ids and not e.step.isupper()
        ]
        if not got:
            return (0, -1)
        ends = [
            e.seq
            for e in self.events
            if e.session == session and e.step in ("COMMIT", "ROLLBACK") and e.seq > got[-1]
        ]
        return (got[-1], ends[0] if ends else len(self.events) + 1)

    def _held_together(self) -> bool:
        (a0, a1), (b0, b1) = self._span("A"), self._span("B")
        return a0 < b1 and b0 < a1

    def blocked(self, session: str) -> bool:
        """Whether ``session`` was ever seen waiting on the other."""
        return any(e.session == session and e.status == "blocked" for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form: the events and the holdings."""
        return {
            "strategy": self.strategy,
            "jobs": self.jobs,
            "limit": self.limit,
            "begin": self.begin,
            "schedule": self.schedule,
            "released_at_commit": self.released_at_commit,
            "events": [asdict(e) for e in self.events],
            "holds": self.holds,
            "double_claimed": self.double_claimed,
            "blocked": {s: self.blocked(s) for s in ("A", "B")},
        }

    def format(self) -> str:
        """The timeline as plain text, one line per event and a verdict."""
        lines = [
            f"replay {self.strategy}: {self.jobs} pending jobs, each claim takes up to "
            f"{self.limit}, sessions A and B, each transaction opened with {self.begin}",
        ]
        if self.schedule == "B held":
            lines.append(
                "schedule: H row-locks one job, so B's claim is held mid-statement while A "
                "claims and commits; then H commits"
            )
        lines.append(f"{'#':>3}  {'session':<7}  {'step':<9}  {'outcome':<8}  ids / detail")
        for e in self.events:
            if e.status == "blocked":
                what = "waiting for " + ", ".join(e.blocked_by)
            elif e.status == "error":
                what = e.detail
            else:
                what = _ids(e.ids) if e.ids else ("" if e.step.isupper() else "(none)")
            line = f"{e.seq:>3}  {e.session:<7}  {e.step:<9}  {e.status:<8}  {what}"
            lines.append(line.rstrip())
        a, b = self.holds.get("A", []), self.holds.get("B", [])
        if self.double_claimed:
            verdict = f"DOUBLE CLAIM: both hold {_ids(self.double_claimed)}"
        elif set(a) & set(b):
            verdict = "not held at the same time: B got them once A's COMMIT released them"
        else:
            verdict = "disjoint: no job held twice"
        if not self.blocked("B"):
            waits = "no session waited"
        elif self.schedule == "B held":
            waits = "B waited for H"
        else:
            waits = "B waited for A"
        lines.append(f"A holds {_ids(a) or '-'}; B holds {_ids(b) or '-'}; {verdict}; {waits}")
        return "\n".join(lines)


def _ids(ids: list[int] | tuple[int, ...]) -> str:
    return ", ".join(map(str, ids))


def _resolve(claim: str | Strategy | sql.SQL | sql.Composed) -> Strategy:
    if isinstance(claim, Strategy):
        return claim
    if isinstance(claim, str) and claim.strip() and " " not in claim.strip():
        return get_strategy(claim.strip())
    return custom_strategy(claim)


class _Replayer:
    """One replay's state: the driver, the strategy, the scratch schema."""

    def __init__(self, d: StepDriver, strategy: Strategy, schema: str, limit: int) -> None:
        self.d, self.strategy, self.schema, self.limit = d, strategy, schema, limit

    def _ctx(self, session: Session) -> ClaimContext:
        return ClaimContext(worker=session.name, limit=self.limit)

    def _send(self, s: Session, step: ClaimStep, ids: list[int]) -> StepHandle:
        return s.start(
            step.render(self.schema),
            step.params(self._ctx(s), ids),
            label=step.label,
            id_column=step.id_column,
        )

    def claim(self, s: Session, *, on_block: Callable[[], None] | None = None) -> list[int] | None:
        """Run the claim steps on ``s``; None if a step failed (the transaction is dead)."""
        ids: list[int] = []
        for step in self.strategy.steps:
            h = self._send(s, step, ids)
            if self.d.settle(h) == "blocked" and on_block is not None:
                on_block()
                on_block = None
            res = h.outcome()
            if res.error is not None:
                return None
            ids = res.ids
        return ids

    def finish(self, s: Session, ids: list[int]) -> None:
        if ids:
            for step in self.strategy.finish:
                self._send(s, step, ids).result()
        s.run("COMMIT")


class _InFlight:
    """One session's claim, its steps sent one after another, polled rather than awaited.

    The held schedule has three sessions that may wait on each other in any order, so
    the script looks at each claim in turn instead of waiting on one.
    """

    def __init__(self, run: _Replayer, session: Session) -> None:
        self.run, self.session = run, session
        self.index = 0
        self.ids: list[int] = []
        self.failed = False
        self.handle = run._send(session, run.strategy.steps[0], [])

    def poll(self) -> str:
        """Say "blocked", "done" or "failed"; a finished step sends the next one."""
        while True:
            if self.run.d.settle(self.handle) == "blocked":
                return "blocked"
            res = self.handle.outcome()
            if res.error is not None:
                self.failed = True
                return "failed"
            self.ids = res.ids
            self.index += 1
            if self.index == len(self.run.strategy.steps):
                return "done"
            step = self.run.strategy.steps[self.index]
            self.handle = self.run._send(self.session, step, self.ids)

    def end(self) -> list[int]:
        """Commit a claim that got through (finish steps first), roll back a failed one."""
        if self.failed:
            self.session.run("ROLLBACK")
            return []
        self.run.finish(self.session, self.ids)
        return self.ids


def _held(run: _Replayer, hold: Query, timeout: float) -> dict[str, list[int]]:
    """The held schedule: H row-locks a job; B claims and is held; A claims and commits."""
    d, begin = run.d, run.strategy.begin_sql()
    h, a, b = d.session("H"), d.session("A"), d.session("B")
    h.run("BEGIN", label="BEGIN")
    h.run(hold, label="hold")
    b.run(begin, label="BEGIN")
    claims = {"B": _InFlight(run, b)}
    status = {"B": claims["B"].poll()}
    if status["B"] == "blocked":
        # B is held after its snapshot: A claims and, if nothing holds it up, commits.
        a.run(begin, label="BEGIN")
        claims["A"] = _InFlight(run, a)
        status["A"] = claims["A"].poll()
    holds: dict[str, list[int]] = {}
    for name in [n for n, st in status.items() if st != "blocked"]:
        holds[name] = claims.pop(name).end()
    h.run("COMMIT", label="COMMIT")
    deadline = time.monotonic() + timeout
    while claims:
        # Whoever got through commits, which may release the other; a deadlock between
        # them is broken by the server and shows as a failed claim.
        for name in list(claims):
            if claims[name].poll() != "blocked":
                holds[name] = claims.pop(name).end()
        if claims and time.monotonic() > deadline:
            raise StepTimeout(f"held replay: {', '.join(claims)} still blocked after {timeout}s")
    if "A" not in holds:
        # B was not held (it skipped the locked job, say): A claims after B, as usual.
        a.run(begin, label="BEGIN")
        claim = _InFlight(run, a)
        while claim.poll() == "blocked":
            if time.monotonic() > deadline:
                raise StepTimeout(f"held replay: A still blocked after {timeout}s")
        holds["A"] = claim.end()
    return {"A": holds.get("A", []), "B": holds.get("B", [])}


def replay(
    dsn: str,
    claim: str | Strategy | sql.SQL | sql.Composed = "skip-locked",
    *,
    jobs: int = 10,
    limit: int = 3,
    schema: str | None = None,
    timeout: float = 10.0,
) -> Timeline:
    """Replay two concurrent claims step by step and return the timeline.

    The script: A ``BEGIN``, A claims; B ``BEGIN``, B claims.  If a step of B's claim is
    seen blocked, A commits there (running ``finish`` first for a hold-lock strategy) and
    B's step is waited for.  A serialization failure is rolled back and, when the
    strategy retries, B begins and claims again.  Finally whoever is open commits.

    Parameters
    ----------
    dsn
        The server.  A scratch skiplock schema is created, seeded and dropped.
    claim
        A strategy name (see ``STRATEGIES``), a :class:`Strategy`, or a raw claim
        statement (``str`` template or ``psycopg.sql`` composable) as accepted by
        :func:`custom_strategy`: it may say ``{schema}.jobs`` and use ``%(worker)s``,
        ``%(limit)s``, ``%(queue)s``, ``%(lease)s``; ids come from its ``id`` column.
    jobs
        Pending jobs seeded, ids 1..jobs.
    limit
        Jobs per claim (the ``LIMIT``).
    schema
        Scratch schema name; default a random ``skiplock_lab_*``.
    timeout
        Seconds any one step may take to finish or block.

    Returns
    -------
    Timeline
        ``events`` in observed order; ``holds`` maps each session to the jobs its
        committed claim returned.
    """
    strategy = _resolve(claim)
    with scratch_schema(dsn, jobs, schema=schema) as name:
        return replay_prepared(
            dsn,
            strategy,
            schema=name,
            jobs=jobs,
            limit=limit,
            timeout=timeout,
            application_name=f"skiplock-lab:{name}",
        )


def replay_prepared(
    dsn: str,
    strategy: Strategy,
    *,
    schema: str,
    jobs: int,
    limit: int = 3,
    timeout: float = 10.0,
    application_name: str = "skiplock-lab",
    hold: Query | None = None,
    released_at_commit: bool = False,
) -> Timeline:
    """Replay ``strategy`` on a schema the caller created and seeded; nothing is dropped.

    This is :func:`replay` without the scratch skiplock schema, for a table the caller
    owns (``skiplock audit`` runs a user's own DDL and claim this way).

    Parameters
    ----------
    dsn
        The server, as the sessions connect to it (a ``search_path`` in its options
        applies to every session).
    strategy
        The claim; each step is rendered with ``schema``.
    schema
        Passed to the steps' ``render``.
    jobs
        Pending rows the caller seeded (shown in the timeline's header).
    limit
        The claim context's ``limit``.
    timeout
        Seconds any one step may take to finish or block.
    application_name
        Prefix of the sessions' ``application_name``.
    hold
        Run the "B held" schedule instead: session H opens a transaction and runs this
        statement (a row lock on the first job, say); B claims and is held by it; A
        claims and commits; H commits; B's claim is waited for.  Without it: "A first".
    released_at_commit
        The claim writes nothing (a plain ``SELECT ... FOR UPDATE``): its rows are held
        only while its transaction is open (see :attr:`Timeline.released_at_commit`).

    Returns
    -------
    Timeline
    """
    with StepDriver(dsn, timeout=timeout, application_name=application_name) as d:
        run = _Replayer(d, strategy, schema, limit)
        if hold is not None:
            holds, schedule = _held(run, hold, timeout), "B held"
        else:
            holds, schedule = _a_then_b(d, run, strategy), "A first"
        events = list(d.events)
    return Timeline(
        strategy.name,
        jobs,
        limit,
        events,
        holds,
        strategy.begin_sql(),
        schedule,
        released_at_commit,
    )


def _a_then_b(d: StepDriver, run: _Replayer, strategy: Strategy) -> dict[str, list[int]]:
    """A begins and claims; B claims; if B is blocked, A commits; B returns."""
    a, b = d.session("A"), d.session("B")
    a.run(strategy.begin_sql(), label="BEGIN")
    held_a = run.claim(a) or []
    a_open = True

    def commit_a() -> None:
        nonlocal a_open
        run.finish(a, held_a)
        a_open = False

    held_b: list[int] = []
    attempts = 0
    while True:
        attempts += 1
        b.run(strategy.begin_sql(), label="BEGIN")
        got = run.claim(b, on_block=commit_a if a_open else None)
        if got is not None:
            held_b = got
            break
        failed = d.events[-1]  # the failed step, recorded before the ROLLBACK
        b.run("ROLLBACK")
        retryable = strategy.retry_serialization and _is_serialization(failed)
        if not retryable or attempts > 3:
            break
    if a_open:
        commit_a()
    if held_b or b.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        run.finish(b, held_b)
    return {"A": held_a, "B": held_b}


def _is_serialization(event: Event) -> bool:
    return event.status == "error" and event.sqlstate == pgerrors.SerializationFailure.sqlstate
