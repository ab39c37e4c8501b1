"""No database: the exception line of a job's error, Retry's cause, a naive run_at, --since."""

from __future__ import annotations

import traceback
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from skiplock import App, ConfigError, Queue, Retry
from skiplock._control import error_line
from skiplock._handlers import retry_reason
from skiplock.cli._jobs import parse_since


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def _bad() -> None:
    raise ValueError("bad\nsecond line of the message")


def _chained() -> None:
    try:
        _bad()
    except ValueError as exc:
        raise KeyError("missing") from exc


def _group() -> None:
    raise ExceptionGroup("two went wrong", [ValueError("a"), TypeError("b")])


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (None, None),
        ("  \n", None),
        (_text(_raised(_bad)), "ValueError: bad"),
        (_text(_raised(_chained)), "KeyError: 'missing'"),
        (_text(_raised(_group)), "ExceptionGroup: two went wrong (2 sub-exceptions)"),
        # Trimmed to its tail (_handlers.MAX_ERROR_CHARS): the exception line is there.
        ("..." + _text(_raised(_bad))[-120:], "ValueError: bad"),
        (
            "lease expired on worker w1 during attempt 1 of 5",
            "lease expired on worker w1 during attempt 1 of 5",
        ),
        (
            "retry requested: ValueError: boom\nTraceback (most recent call last):\n"
            '  File "x.py", line 1, in f\nValueError: boom',
            "retry requested: ValueError: boom",
        ),
    ],
)
def test_error_line_is_the_exception_not_a_file_line(error: str | None, line: str | None) -> None:
    assert error_line(error) == line
    if line is not None:
        assert not line.startswith("File ")


def test_a_retry_keeps_its_cause_and_reason() -> None:
    def from_cause() -> None:
        try:
            raise ValueError("boom")
        except ValueError as exc:
            raise Retry(5) from exc

    def in_except() -> None:
        try:
            raise ValueError("boom")
        except ValueError:
            raise Retry(5, reason="provider down")  # noqa: B904 (the context is the cause)

    def from_none() -> None:
        try:
            raise ValueError("boom")
        except ValueError:
            raise Retry(5) from None

    text = retry_reason(_raised(from_cause))  # type: ignore[arg-type]
    assert text.splitlines()[0] == "retry requested: ValueError: boom"
    assert "Traceback (most recent call last)" in text and error_line(text) == text.splitlines()[0]
    assert retry_reason(_raised(in_except)).startswith(  # type: ignore[arg-type]
        "provider down: ValueError: boom\n"
    )
    assert retry_reason(_raised(from_none)) == "retry requested by handler"  # type: ignore[arg-type]
    assert retry_reason(Retry(1, reason="later")) == "later"


@pytest.fixture(scope="module")
def offline() -> Queue:
    return Queue("postgresql://nobody@127.0.0.1:1/none", open=False)


NAIVE = datetime(2030, 1, 31, 9, 0)


def test_a_naive_run_at_is_refused_in_one_line_before_any_io(offline: Queue) -> None:
    for call in (
        lambda: offline.enqueue({}, run_at=NAIVE),
        lambda: offline.enqueue_many([{}], run_at=NAIVE),
    ):
        with pytest.raises(ValueError, match=r"^run_at 2030-01-31T09:00:00 has no timezone") as e:
            call()
        assert "\n" not in str(e.value)
    app = App("postgresql://nobody@127.0.0.1:1/none")

    @app.task()
    def send(n: int) -> None: ...

    with pytest.raises(ValueError, match=r"send\.configure\(\): run_at .* has no timezone"):
        send.configure(run_at=NAIVE)
    # An aware time is taken as it is, in any zone.
    at = NAIVE.replace(tzinfo=UTC)
    assert send.configure(run_at=at).run_at == at


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("90", timedelta(seconds=90)),
        ("90s", timedelta(seconds=90)),
        ("30m", timedelta(minutes=30)),
        ("1.5h", timedelta(minutes=90)),
        ("2d", timedelta(days=2)),
        ("1w", timedelta(weeks=1)),
        ("2030-01-31T09:00:00Z", datetime(2030, 1, 31, 9, tzinfo=UTC)),
    ],
)
def test_since_takes_a_duration_or_an_aware_time(text: str, expect: Any) -> None:
    assert parse_since(text) == expect


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2030-01-31T09:00:00", "has no timezone"),
        ("yesterday", "neither a duration"),
        ("5 minutes", "neither a duration"),
    ],
)
def test_since_refuses_the_rest_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_since(text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("retry",), "give job IDs or --failed"),
        (("retry", "1", "--failed"), "give job IDs or --failed"),
        (("retry", "1", "--task", "x"), "--queue, --task and --since go with --failed"),
        (("retry", "--failed", "--since", "yesterday"), "neither a duration"),
        (("jobs", "--since", "2030-01-31T09:00:00"), "has no timezone"),
        (("jobs", "--status", "lost"), "Invalid value for '--status'"),
    ],
)
def test_bad_cli_arguments_are_one_line_and_exit_2_before_any_connection(
    args: tuple[str, ...], message: str
) -> None:
    from click.testing import CliRunner

    from skiplock.cli import main

    dsn = {"SKIPLOCK_DSN": "postgresql://nobody@127.0.0.1:1/none"}  # never reached
    out = CliRunner().invoke(main, list(args), env=dsn)
    assert out.exit_code == 2, out.output
    assert message in out.output
    assert "cannot reach" not in out.output
