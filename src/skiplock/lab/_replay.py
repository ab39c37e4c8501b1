"""The postmortem's two psql windows, scripted: replay any claim with two sessions, step by step.

Session A begins and claims; session B begins and claims while A is still open; if B is
seen blocked (``pg_blocking_pids``), A commits and B's claim is waited for; then both
commit.  For ``naive`` that shows the incident: B blocks, A commits, and B returns the
same jobs 1, 2, 3.  For ``skip-locked`` B takes 4, 5, 6 without waiting.  A strategy that
retries serialization failures retries here too, and the retry is on the timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from ._steps import Event, Session, StepDriver, StepHandle
from ._strategies import (
    ClaimContext,
    ClaimStep,
    Strategy,
    custom_strategy,
    get_strategy,
    scratch_schema,
)

__all__ = ["Timeline", "replay"]


@dataclass
class Timeline:
    """What a replay did: the events in order and the jobs each session ended up holding."""

    strategy: str
    jobs: int
    limit: int
    events: list[Event] = field(default_factory=list)
    holds: dict[str, list[int]] = field(default_factory=dict)
    begin: str = "BEGIN"

    @property
    def double_claimed(self) -> list[int]:
        """Jobs both sessions hold."""
        a, b = (set(self.holds.get(s, [])) for s in ("A", "B"))
        return sorted(a & b)

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
            f"{'#':>3}  {'session':<7}  {'step':<9}  {'outcome':<8}  ids / detail",
        ]
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
        verdict = (
            f"DOUBLE CLAIM: both hold {_ids(self.double_claimed)}"
            if self.double_claimed
            else "disjoint: no job held twice"
        )
        waits = "B waited for A" if self.blocked("B") else "no session waited"
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
        return s.start(step.render(self.schema), step.params(self._ctx(s), ids), label=step.label)

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
        prefix = f"skiplock-lab:{name}"
        with StepDriver(dsn, timeout=timeout, application_name=prefix) as d:
            run = _Replayer(d, strategy, name, limit)
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
            events = list(d.events)
    holds = {"A": held_a, "B": held_b}
    return Timeline(strategy.name, jobs, limit, events, holds, strategy.begin_sql())


def _is_serialization(event: Event) -> bool:
    return event.status == "error" and event.sqlstate == pgerrors.SerializationFailure.sqlstate
