"""The public surface is exactly these names; anything else is private and may change."""

import skiplock

PUBLIC = {
    "AsyncQueue",
    "ConfigError",
    "DatabaseUnavailable",
    "Fail",
    "Job",
    "LeaseLost",
    "PayloadError",
    "Periodic",
    "Queue",
    "Retry",
    "RetryPolicy",
    "SkiplockError",
    "Worker",
    "WorkerStats",
}


def test_all_is_pinned() -> None:
    assert set(skiplock.__all__) == PUBLIC


def test_public_names_come_from_private_modules() -> None:
    for name in skiplock.__all__:
        obj = getattr(skiplock, name)
        assert obj.__module__.startswith("skiplock._"), name


def test_errors_share_a_base() -> None:
    for name in ("ConfigError", "DatabaseUnavailable", "LeaseLost", "PayloadError"):
        assert issubclass(getattr(skiplock, name), skiplock.SkiplockError)
