"""Settings, payload encoding and SQL loading: no database needed."""

from __future__ import annotations

import pytest

from skiplock import ConfigError, PayloadError, RetryPolicy
from skiplock._config import check_dsn, redact_dsn, resolve_dsn, validate_queue, validate_schema
from skiplock._ops import encode_payload
from skiplock._sql import migrations, parse_named, statements


@pytest.mark.parametrize(
    ("dsn", "secret"),
    [
        ("postgresql://alice:s3cret@db.example:5432/app", "s3cret"),
        ("host=db user=alice password=s3cret dbname=app", "s3cret"),
        ("postgresql://alice:pa@ss@db/app", "pa@ss"),
        ("host=db password='two words'", "two words"),
    ],
)
def test_redact_never_shows_the_password(dsn: str, secret: str) -> None:
    shown = redact_dsn(dsn)
    assert secret not in shown
    assert "***" in shown


def test_resolve_dsn_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKIPLOCK_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert resolve_dsn(None) is None
    monkeypatch.setenv("DATABASE_URL", "postgresql:///from_database_url")
    assert resolve_dsn(None) == "postgresql:///from_database_url"
    monkeypatch.setenv("SKIPLOCK_DSN", "postgresql:///from_skiplock")
    assert resolve_dsn(None) == "postgresql:///from_skiplock"
    assert resolve_dsn("postgresql:///explicit") == "postgresql:///explicit"


def test_malformed_dsn_is_a_config_error_without_password() -> None:
    with pytest.raises(ConfigError) as err:
        check_dsn("host=db password=s3cret = = bogus")
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("name", ["x; DROP TABLE jobs", 'a"b', "", "1abc", "a" * 49, "sch ema"])
def test_hostile_schema_names_are_rejected(name: str) -> None:
    with pytest.raises(ConfigError):
        validate_schema(name)


@pytest.mark.parametrize("name", ["emails", "billing.v2", "tenant:42", "a/b@c-d"])
def test_queue_names_accepted(name: str) -> None:
    assert validate_queue(name) == name


@pytest.mark.parametrize("name", ["", " emails", "emails\n", "x'; --", "a" * 129, "\x00"])
def test_queue_names_rejected(name: str) -> None:
    with pytest.raises(ConfigError):
        validate_queue(name)


def test_payload_encoding() -> None:
    assert encode_payload({"invoice": 7}) == '{"invoice":7}'
    assert encode_payload("héllo") == '"héllo"'
    # A literal backslash-u0000 in text is six characters, not a NUL: allowed.
    assert encode_payload("\\u0000")
    for bad in ({1, 2}, object(), float("nan"), {"k": b"bytes"}):
        with pytest.raises(PayloadError):
            encode_payload(bad)
    with pytest.raises(PayloadError, match="NUL"):
        encode_payload({"s": "a\x00b"})
    with pytest.raises(PayloadError, match="over the limit"):
        encode_payload("x" * 100, max_bytes=50)


def test_retry_policy_grows_and_caps() -> None:
    p = RetryPolicy(base=1.0, factor=2.0, max_delay=10.0, jitter=0.0)
    assert [p.delay(n) for n in (1, 2, 3, 4, 5, 6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    jittered = RetryPolicy(base=10.0, jitter=0.5)
    delays = {jittered.delay(1) for _ in range(50)}
    assert len(delays) > 1
    assert all(5.0 <= d <= 15.0 for d in delays)


def test_named_statements_parse() -> None:
    parsed = parse_named("-- name: a\nSELECT 1;\n-- name: b\nSELECT 2;")
    assert parsed == {"a": "SELECT 1", "b": "SELECT 2"}
    with pytest.raises(ValueError, match="twice"):
        parse_named("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;")
    names = statements("skiplock").names()
    for needed in ("claim", "complete", "fail", "heartbeat", "release", "sweep", "enqueue_keyed"):
        assert needed in names


def test_fence_clause_is_on_every_write_to_a_claimed_job() -> None:
    """The correctness argument in one place: each fenced write names id, token, status."""
    from importlib import resources

    text = resources.files("skiplock").joinpath("sql", "queries.sql").read_text()
    blocks = parse_named(text)
    for name in ("complete", "fail", "heartbeat", "release"):
        body = blocks[name]
        assert "j.lease_token = f.token" in body, name
        assert "j.status = 'running'" in body, name
    claim = blocks["claim"]
    # The pick is the function claimable() (decision 0005): its SELECT, in the schema
    # as a fresh migrate leaves it, is the one that locks and skips.
    schema = resources.files("skiplock").joinpath("sql", "schema.sql").read_text()
    start = schema.index("FUNCTION {schema}.claimable(")
    pick = schema[start : schema.index("$$;", start)]
    assert "FOR UPDATE OF j SKIP LOCKED" in pick
    assert "claimable(" in claim
    assert "AS MATERIALIZED" in claim
    assert "AND j.status = 'pending'" in claim  # the re-check on the target row
    assert "gen_random_uuid()" in claim


def test_migrations_are_numbered() -> None:
    # Unique and increasing; a gap is allowed (numbers reserved by branches in flight).
    versions = [m.version for m in migrations()]
    assert versions == sorted(set(versions)) and versions[0] == 1
