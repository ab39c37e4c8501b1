"""The two shortcuts on a claimed row's way to a Job: ``PayloadLoader`` gives what
``json.loads`` gives for any input (value or error), and ``_new_job`` builds the Job
``Job(*values)`` builds."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.types.json import set_json_loads

from skiplock import Job
from skiplock._job import _COLUMNS, PayloadLoader, _new_job

JSONB_OID = psycopg.adapters.types["jsonb"].oid

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _outcome(load: Any, data: bytes) -> tuple[str, Any]:
    try:
        value = load(data)
    except Exception as exc:  # the same error, type and message, is part of the contract
        return "error", (type(exc), str(exc))
    if isinstance(value, float) and math.isnan(value):
        return "nan", None
    return "value", value


def _same_as_json_loads(data: bytes) -> None:
    loader = PayloadLoader(JSONB_OID, None)
    assert _outcome(lambda b: loader.load(memoryview(b)), data) == _outcome(json.loads, data)
    assert _outcome(loader.load, data) == _outcome(json.loads, data)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([(", ", ": "), (",", ":")]), st.booleans())
def test_payload_loader_reads_what_json_loads_reads(
    value: Any, separators: tuple[str, str], ascii_only: bool
) -> None:
    # PostgreSQL's jsonb text ('{"a": 1}'), compact too, with or without \u escapes.
    text = json.dumps(value, separators=separators, ensure_ascii=ascii_only)
    _same_as_json_loads(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "data",
    [
        b' {"a": 1}',  # whitespace before: the fallback
        b'{"a": 1} ',  # and after
        b"[1, 2",  # an error: the same JSONDecodeError
        b'{"a": 1}x',  # extra data
        b"",
        b"\xff",  # not UTF-8: the same UnicodeDecodeError
        b'"\xed\xa0\x80"',  # a lone surrogate, as json.loads lets through
        b'"\\ud800"',
        "\ufeff{}".encode(),  # a BOM: json.loads reads it as utf-8-sig
        b"NaN",
        b"1e400",
        '{"é": ["ü", 1.5, null, true]}'.encode(),
    ],
)
def test_payload_loader_on_odd_input(data: bytes) -> None:
    _same_as_json_loads(data)


@pytest.fixture
def global_loads() -> Iterator[None]:
    try:
        yield
    finally:
        set_json_loads(json.loads)


def test_a_loads_set_globally_is_used(global_loads: None) -> None:
    seen: list[bytes] = []

    def loads(data: bytes) -> Any:
        seen.append(data)
        return {"by": "user"}

    set_json_loads(loads)
    assert PayloadLoader(JSONB_OID, None).load(memoryview(b'{"a": 1}')) == {"by": "user"}
    assert seen == [b'{"a": 1}']


def _values() -> tuple[Any, ...]:
    now = datetime.now(UTC)
    by_column: dict[str, Any] = {
        "id": 7,
        "queue": "q",
        "payload": {"n": 1},
        "status": "running",
        "priority": -2,
        "attempts": 1,
        "max_attempts": 5,
        "worker": "w",
        "lease_token": uuid.uuid4(),
        "locked_until": now + timedelta(seconds=30),
        "run_at": now - timedelta(seconds=1),
        "created_at": now - timedelta(seconds=2),
        "started_at": now,
        "finished_at": None,
        "last_error": "boom",
        "idempotency_key": "k",
        "result": [1],
        "store_result": False,
        "task": "t",
        "meta": {"m": 1},
    }
    return tuple(by_column[c] for c in _COLUMNS)


def test_new_job_builds_the_job_the_constructor_builds() -> None:
    values = _values()
    fast, slow = _new_job(values), Job(*values)
    assert fast == slow
    for f in fields(Job):
        if f.name != "_cancel":
            assert getattr(fast, f.name) is getattr(slow, f.name), f.name
    # Each Job has a cancel flag of its own, down as the constructor leaves it.
    assert not fast.cancelled and fast._cancel is not _new_job(values)._cancel
    fast.mark_cancelled()
    assert fast.cancelled and not slow.cancelled
    with pytest.raises(AttributeError):
        fast.status = "done"  # type: ignore[misc]  # still frozen


def test_new_job_wants_every_field() -> None:
    with pytest.raises(ValueError):
        _new_job(_values()[:-1])
