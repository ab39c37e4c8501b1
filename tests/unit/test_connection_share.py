"""The test suite's connection ledger (tests/connection_share.py), between real processes.

No server: the ledger's limit is given, and its file is keyed by a DSN nothing serves.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from multiprocessing.synchronize import Event

import pytest

from connection_share import Ledger

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def where() -> Iterator[str]:
    dsn = f"host=ledger-{uuid.uuid4().hex} port=1"
    yield dsn
    ledger = Ledger(dsn, limit=1)
    for path in (ledger.path, ledger.path.with_suffix(".lock")):
        path.unlink(missing_ok=True)


def _hold(dsn: str, limit: int, share: int, taken: Event, release: Event, patience: float) -> None:
    ledger = Ledger(dsn, limit=limit, patience=patience)
    ledger.take(share, wait=20)
    taken.set()
    release.wait(20)
    ledger.give_back()


def _start(dsn: str, limit: int, share: int, patience: float = 0.0) -> tuple[Event, Event, object]:
    taken, release = FORK.Event(), FORK.Event()
    proc = FORK.Process(target=_hold, args=(dsn, limit, share, taken, release, patience))
    proc.start()
    return taken, release, proc


def test_a_share_waits_until_the_server_can_spare_it_and_waiters_go_in_turn(
    where: str,
) -> None:
    wide_taken, wide_release, wide = _start(where, 20, 15)
    assert wide_taken.wait(10)
    # 10 does not fit beside 15 of 20: it waits ...
    mid_taken, mid_release, mid = _start(where, 20, 10)
    time.sleep(0.5)
    assert not mid_taken.is_set()
    # ... and 2, which would fit, waits behind it: a wide share is not starved.
    small_taken, small_release, small = _start(where, 20, 2)
    time.sleep(0.5)
    assert not small_taken.is_set()
    wide_release.set()
    assert mid_taken.wait(10) and small_taken.wait(10)
    for release in (mid_release, small_release):
        release.set()
    for proc in (wide, mid, small):
        proc.join(10)  # type: ignore[attr-defined]


def test_a_narrow_share_goes_first_only_while_the_wide_one_has_waited_briefly(
    where: str,
) -> None:
    wide_taken, wide_release, wide = _start(where, 20, 15)
    assert wide_taken.wait(10)
    mid_taken, mid_release, mid = _start(where, 20, 10, patience=1.0)
    # 2 fits beside 15 and goes before the waiting 10 ...
    small_taken, small_release, small = _start(where, 20, 2, patience=1.0)
    assert small_taken.wait(10) and not mid_taken.is_set()
    small_release.set()
    time.sleep(1.5)
    # ... but once 10 has waited its patience, 2 waits behind it.
    late_taken, late_release, late = _start(where, 20, 2, patience=1.0)
    time.sleep(0.5)
    assert not late_taken.is_set() and not mid_taken.is_set()
    wide_release.set()
    assert mid_taken.wait(10) and late_taken.wait(10)
    for release in (mid_release, late_release):
        release.set()
    for proc in (wide, mid, small, late):
        proc.join(10)  # type: ignore[attr-defined]


def test_a_share_larger_than_the_server_runs_alone(where: str) -> None:
    taken, release, proc = _start(where, 10, 70)
    assert taken.wait(10)
    with pytest.raises(TimeoutError, match="held by test processes"):
        Ledger(where, limit=10).take(1, wait=0.5)
    release.set()
    proc.join(10)  # type: ignore[attr-defined]
    Ledger(where, limit=10).take(10, wait=5)


def _die_holding(dsn: str) -> None:
    Ledger(dsn, limit=10).take(10, wait=5)
    os._exit(0)


def test_the_share_of_a_test_process_that_died_is_free_again(where: str) -> None:
    proc = FORK.Process(target=_die_holding, args=(where,))
    proc.start()
    proc.join(10)
    assert Ledger(where, limit=10).path.read_text().count(str(proc.pid)) == 1
    Ledger(where, limit=10).take(10, wait=5)


@pytest.mark.parametrize(
    "text",
    ['{"held": {}, "waiting": [123]}', "[1, 2]", '{"held": {"x": "y"}}', "not json"],
)
def test_a_ledger_file_of_another_shape_counts_as_empty(where: str, text: str) -> None:
    ledger = Ledger(where, limit=10)
    ledger.path.write_text(text)
    ledger.take(10, wait=1)
    ledger.give_back()
