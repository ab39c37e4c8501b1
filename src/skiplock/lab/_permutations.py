"""Isolation-tester style permutations on the step driver: named steps run in a given order.

PostgreSQL's ``src/test/isolation`` specs name each session's steps and list the orders
to try; a step that blocks is carried along, and after every step the blocked ones get
the chance to finish, so the output says which step was waiting after which.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._steps import Params, Query, StepDriver, StepError, StepHandle, StepResult

__all__ = ["Permutation", "SpecStep", "run_permutation"]


@dataclass(frozen=True)
class SpecStep:
    """A named step of a spec: which session runs which statement."""

    name: str
    session: str
    query: Query
    params: Params = None


@dataclass
class Permutation:
    """What one permutation did.

    ``results`` maps each step to its result; ``blocked`` lists the steps seen blocked
    when sent; ``waiting_after[step]`` lists the steps still blocked once ``step`` (and
    whatever it released) had settled, like the tester's ``<waiting ...>`` marks.
    """

    order: tuple[str, ...]
    results: dict[str, StepResult] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)
    waiting_after: dict[str, list[str]] = field(default_factory=dict)

    def ids(self, step: str) -> list[int]:
        return self.results[step].ids


def run_permutation(
    driver: StepDriver,
    steps: Iterable[SpecStep],
    order: Sequence[str],
    *,
    timeout: float | None = None,
) -> Permutation:
    """Run the named ``steps`` in ``order``, as PostgreSQL's isolation tester does.

    A step that blocks is left running and the next step is sent; after every step, the
    blocked ones are given the chance to finish (each settles again: done, or still
    blocked).  Sessions are opened on first use.

    Parameters
    ----------
    driver
        The step driver whose sessions run the steps.
    steps
        The spec's steps, by name.
    order
        One permutation: step names, each session's steps in its own order.
    timeout
        Per step: seconds to finish or block.

    Returns
    -------
    Permutation
        ``results`` by step name (database errors are results, not exceptions).

    Raises
    ------
    StepError
        A step was sent to a session whose previous step is still blocked, or steps were
        still blocked when the permutation ended.
    """
    by_name = {s.name: s for s in steps}
    out = Permutation(tuple(order))
    waiting: list[tuple[str, StepHandle]] = []
    for name in order:
        spec = by_name[name]
        session = driver.session(spec.session)
        handle = session.start(spec.query, spec.params, label=name)
        if driver.settle(handle, timeout) == "blocked":
            out.blocked.append(name)
            waiting.append((name, handle))
        else:
            out.results[name] = handle.outcome(timeout)
        still: list[tuple[str, StepHandle]] = []
        for wname, wh in waiting:
            if wh is handle:
                still.append((wname, wh))
            elif driver.settle(wh, timeout) == "done":
                out.results[wname] = wh.outcome(timeout)
            else:
                still.append((wname, wh))
        waiting = still
        out.waiting_after[name] = [w for w, _ in waiting]
    if waiting:
        raise StepError(f"steps still blocked at the end: {', '.join(n for n, _ in waiting)}")
    return out
