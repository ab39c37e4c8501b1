"""The exit code of `skiplock worker --processes N` from its children's (no processes)."""

from __future__ import annotations

import signal

import pytest

from skiplock.cli._supervise import _exit_code, _name, _Slot

TERM, INT = int(signal.SIGTERM), int(signal.SIGINT)


def slots(*histories: list[int]) -> list[_Slot]:
    return [_Slot(i + 1, codes=list(h)) for i, h in enumerate(histories)]


@pytest.mark.parametrize(
    ("histories", "received", "expected"),
    [
        (([0], [0]), [TERM], 0),
        # Started again after a crash, then stopped cleanly: the last code counts.
        (([1, 0], [0]), [TERM], 0),
        (([0], [3]), [TERM], 3),  # handlers cut off at the end of the grace
        (([0], [1]), [TERM], 1),
        # Ended by the signal we passed on while it was still starting: a clean stop.
        (([0], [-TERM]), [TERM], 0),
        (([0], [-signal.SIGKILL]), [TERM], 1),
        (([143], [143]), [TERM, TERM], 128 + TERM),  # the second signal: at once
        (([0], [2]), [], 2),  # a child's bad options stop them all
        (([2, 0], [3]), [TERM], 2),
    ],
)
def test_exit_code(histories: tuple[list[int], ...], received: list[int], expected: int) -> None:
    assert _exit_code(slots(*histories), received) == expected


def test_names_are_unique_per_start() -> None:
    slot = _Slot(2, starts=1)
    assert _name("w", slot) == "w-2"
    slot.starts = 3
    assert _name("w", slot) == "w-2.3"
    assert _name(None, slot) is None  # the worker's default, host-pid, is unique already
