"""Property tests (hypothesis) on the I/O-free edges: payloads, names, DSNs, enqueue
options and the audit's SQL input.  Bad input must end in skiplock's own one-line
error, never another exception, and a password must never be echoed.

Each test counts its cases in ``CASES`` (printed by the last test);
``pytest --hypothesis-show-statistics`` prints hypothesis's own figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from skiplock import ConfigError, PayloadError, Queue, SkiplockError
from skiplock._config import check_dsn, redact_dsn, validate_queue, validate_schema
from skiplock._ops import encode_payload
from skiplock._sql import channel_name
from skiplock.audit import audit_python, audit_sql, render

CASES: Counter[str] = Counter()

# Every character, lone surrogates and NUL included: what a caller could pass.
ANY_CHAR = st.characters(codec=None, categories=None)
ANY_TEXT = st.text(alphabet=ANY_CHAR, max_size=60)
# 300 cases a test in CI (about 5 s for the module); SKIPLOCK_HYPOTHESIS=deep for 5000.
_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=_QUIET)
settings.register_profile("deep", max_examples=5000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("SKIPLOCK_HYPOTHESIS", "ci"))

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(ANY_TEXT, inner, max_size=5),
    max_leaves=20,
)
NOT_JSON = (
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not math.isfinite(x))
    | st.binary(max_size=5)
    | st.sets(st.integers(), min_size=1, max_size=3)
    | st.builds(object)
    | st.complex_numbers(allow_nan=False)
)


def _contains_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_contains_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_nul(k) or _contains_nul(v) for k, v in value.items())
    return False


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


# -- payloads --------------------------------------------------------------------------


@given(JSON, st.integers(min_value=1, max_value=400))
def test_a_json_payload_round_trips_or_is_refused_with_payload_error(
    payload: Any, limit: int
) -> None:
    CASES["payload json"] += 1
    try:
        text = encode_payload(payload, limit)
    except PayloadError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert not _contains_nul(payload) and not _has_surrogate(payload)
    assert len(text.encode("utf-8")) <= limit
    assert json.loads(text) == payload


@given(st.lists(NOT_JSON, min_size=1, max_size=3) | NOT_JSON)
def test_what_json_cannot_hold_is_refused_with_payload_error(payload: Any) -> None:
    CASES["payload not json"] += 1
    with pytest.raises(PayloadError):
        encode_payload(payload)


def test_a_payload_nested_too_deep_for_json_is_refused_with_payload_error() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested"):
        encode_payload(deep)


# -- queue and schema names ------------------------------------------------------------

NAMEISH = ANY_TEXT | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:/@ -]{0,130}", fullmatch=True)


@given(NAMEISH | st.integers() | st.none() | st.binary(max_size=4))
def test_queue_names_are_accepted_as_documented_or_refused_with_config_error(name: Any) -> None:
    CASES["queue name"] += 1
    try:
        assert validate_queue(name) == name
    except ConfigError as exc:
        assert repr(name)[:20] in str(exc) and "\n" not in str(exc)
        return
    assert isinstance(name, str) and 1 <= len(name) <= 128
    assert all(c.isascii() and (c.isalnum() or c in "_.:/@-") for c in name)


@given(NAMEISH | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,50}", fullmatch=True) | st.integers())
def test_schema_names_are_safe_identifiers_or_refused_with_config_error(name: Any) -> None:
    CASES["schema name"] += 1
    try:
        validate_schema(name)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(name, str) and name.isascii()
    # The LISTEN channel derived from it fits PostgreSQL's 63-byte identifiers.
    assert len(channel_name(name).encode()) <= 63


# -- DSNs ------------------------------------------------------------------------------

# A password long and odd enough that finding it in the output can only be a leak.
PASSWORD = st.text(alphabet=ANY_CHAR, min_size=6, max_size=30).filter(
    lambda p: p.strip() == p and "\x00" not in p
)
WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8)


@st.composite
def dsn_with_password(draw: st.DrawFn) -> tuple[str, str]:
    pw = draw(PASSWORD)
    user, host, db = draw(WORD), draw(WORD), draw(WORD)
    form = draw(st.sampled_from(["url", "url-encoded", "kv", "kv-quoted", "kv-mangled"]))
    if form == "url":
        dsn = f"postgresql://{user}:{pw}@{host}:5432/{db}"
    elif form == "url-encoded":
        from urllib.parse import quote

        enc = quote(pw, safe="", errors="surrogatepass")
        dsn = f"postgresql://{user}:{enc}@{host}/{db}?sslmode=disable"
    elif form == "kv":
        dsn = f"host={host} user={user} password={pw} dbname={db}"
    elif form == "kv-quoted":
        quoted = pw.replace("\\", "\\\\").replace("'", "\\'")
        dsn = f"host={host} password='{quoted}' dbname={db}"
    else:
        dsn = f"host={host} password = {pw} {draw(ANY_TEXT)}"
    return dsn, pw


def _leaks(text: str, pw: str, dsn: str) -> bool:
    # Only a leak if the password is not also spelled out elsewhere in the DSN.
    return pw in text and pw not in dsn.replace(pw, "", 1)


@given(dsn_with_password())
# Found by hypothesis in CI: libpq splits at "\r", so the DSN does not parse, and the
# fallback's mask stopped there and left the password's tail in sight.
@example(("host=0 user=0 password=*\r0000 dbname=0", "*\r0000"))
def test_no_dsn_shown_or_refused_ever_carries_its_password(case: tuple[str, str]) -> None:
    CASES["dsn password"] += 1
    dsn, pw = case
    assert not _leaks(redact_dsn(dsn), pw, dsn)
    try:
        check_dsn(dsn)
    except ConfigError as exc:
        assert not _leaks(str(exc), pw, dsn)
        assert exc.__cause__ is None and "\n" not in str(exc)


@given(ANY_TEXT | st.from_regex(r"(postgres(ql)?://)?[^ ]{0,30}", fullmatch=True))
def test_check_and_redact_take_any_text_without_crashing(dsn: str) -> None:
    CASES["dsn any text"] += 1
    assert isinstance(redact_dsn(dsn), str)
    with contextlib.suppress(ConfigError):
        assert check_dsn(dsn) == dsn


# -- enqueue options -------------------------------------------------------------------

ANYTHING = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.booleans()
    | st.none()
    | ANY_TEXT
    | st.datetimes(timezones=st.just(UTC))
    | st.datetimes()
)


@pytest.fixture(scope="module")
def offline_queue() -> Queue:
    # Never opened: option checks happen before any I/O, so no server is needed.
    return Queue("postgresql://nobody@127.0.0.1:1/none", open=False)


@given(
    payload=JSON | NOT_JSON,
    queue=NAMEISH,
    priority=ANYTHING,
    run_at=ANYTHING,
    max_attempts=ANYTHING,
    key=st.none() | ANYTHING,
    many=st.booleans(),
)
def test_enqueue_options_are_checked_before_io_with_a_clear_error(
    offline_queue: Queue,
    payload: Any,
    queue: Any,
    priority: Any,
    run_at: Any,
    max_attempts: Any,
    key: Any,
    many: bool,
) -> None:
    CASES["enqueue options"] += 1
    try:
        if many:
            make = offline_queue._enqueue_many_op(
                [payload], queue, priority, run_at, max_attempts, [key]
            )
        else:
            make = offline_queue._enqueue_op(payload, queue, priority, run_at, max_attempts, key)
    except (SkiplockError, ValueError) as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert callable(make)
    # Accepted: each option is what the database can store.
    assert type(max_attempts) is int and 1 <= max_attempts <= 2**31 - 1
    assert type(priority) is int and -(2**31) <= priority <= 2**31 - 1
    assert run_at is None or isinstance(run_at, datetime)
    assert key is None or (isinstance(key, str) and key and "\x00" not in key)


# -- the audit's input -----------------------------------------------------------------

SQL_TOKENS = st.sampled_from(
    [
        "SELECT", "UPDATE", "DELETE", "INSERT INTO", "WITH", "jobs", "j", "id", "status",
        "FROM", "WHERE", "SET", "RETURNING", "*", "=", "'pending'", "'", '"', "$1", "$$",
        "$tag$", "(", ")", ",", ";", "--", "/*", "*/", "\n", "FOR UPDATE", "SKIP LOCKED",
        "NOWAIT", "LIMIT 1", "ORDER BY", "IN", "AND", "OR", "BEGIN", "COMMIT", ":name",
        "%s", "%(x)s", "\\", "E'\\''", "U&'", "DO", "LANGUAGE", "plpgsql", "\x00", "é",
    ]
)  # fmt: skip
SQLISH = st.lists(SQL_TOKENS | ANY_TEXT, max_size=40).map(" ".join) | ANY_TEXT


@given(SQLISH)
def test_the_audit_never_crashes_on_any_sql_text(text: str) -> None:
    CASES["audit sql"] += 1
    result = audit_sql(text)
    render(result, "text")
    render(result, "json")
    render(result, "sarif")


@given(
    SQLISH.map(lambda s: f"cur.execute({s!r})\nq = '''{s}'''\n")
    | st.text(alphabet=ANY_CHAR, max_size=200)
)
def test_the_audit_never_crashes_on_any_python_text(text: str) -> None:
    CASES["audit python"] += 1
    render(audit_python(text), "text")


@given(SQLISH)
def test_the_claim_reader_takes_any_file_or_says_why(text: str) -> None:
    from skiplock.audit._claim import parse_claim

    CASES["audit claim file"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "claim.sql"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            parse_claim(path)
        except SkiplockError as exc:
            assert str(exc)


def test_what_the_properties_found_stays_fixed(offline_queue: Queue) -> None:
    # Each of these raised something other than skiplock's error, or leaked, before.
    with pytest.raises(PayloadError, match="surrogate"):
        encode_payload({"\ud800": None})
    for dsn in ("postgres://%80", "\ud800"):
        assert isinstance(redact_dsn(dsn), str)
        with pytest.raises(ConfigError):
            check_dsn(dsn)
    assert "0000?/" not in redact_dsn("postgresql://0:0000?/@0:5432/0")
    for bad in ({"priority": None}, {"priority": float("inf")}, {"max_attempts": True}):
        with pytest.raises(ValueError, match="must be an integer"):
            offline_queue.enqueue({}, **bad)
    with pytest.raises(ValueError, match="run_at"):
        offline_queue.enqueue({}, run_at="tomorrow")  # type: ignore[arg-type]
    assert audit_python('cur.execute("SELECT 1")\nq = "\ud800"\n').problems


def test_zz_report_case_counts(capsys: pytest.CaptureFixture[str]) -> None:
    # Runs last in this module (pytest keeps file order): the cases each test ran.
    with capsys.disabled():
        total = sum(CASES.values())
        print(f"\nhypothesis cases: {total} " + json.dumps(dict(sorted(CASES.items()))))
