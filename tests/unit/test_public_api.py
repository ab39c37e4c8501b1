"""The public surface is exactly these names; anything else is private and may change."""

import importlib

import pytest

import skiplock

PUBLIC = {
    "App",
    "AsyncQueue",
    "AsyncWorker",
    # one Worker per cluster, run as one (App(queues=...), docs/scaling.md)
    "ClusterWorkers",
    "ConfigError",
    "DatabaseUnavailable",
    "DuplicateJob",
    "Fail",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobInfo",
    "JobStateError",
    "LeaseLost",
    "PayloadError",
    "Periodic",
    "Queue",
    "QueueConfig",
    "Retry",
    "RetryPolicy",
    "RetryReport",
    "Signature",
    "SkiplockError",
    "SoftTimeLimitExceeded",
    "Task",
    "UnknownJob",
    "UnknownQueue",
    "Worker",
    "WorkerStats",
    # the canvas of tasks (docs/workflows.md)
    "Workflow",
    "chain",
    "chord",
    "group",
}


def test_all_is_pinned() -> None:
    assert set(skiplock.__all__) == PUBLIC


def test_public_names_come_from_private_modules() -> None:
    for name in skiplock.__all__:
        obj = getattr(skiplock, name)
        assert obj.__module__.startswith("skiplock._"), name


def test_errors_share_a_base() -> None:
    for name in (
        "ConfigError",
        "DatabaseUnavailable",
        "DuplicateJob",
        "LeaseLost",
        "PayloadError",
        "JobFailed",
        "JobCancelled",
        "JobStateError",
        "UnknownJob",
        "UnknownQueue",
    ):
        assert issubclass(getattr(skiplock, name), skiplock.SkiplockError)


# The tools' way in (see tests/unit/test_layering.py): small modules, each pinned too.
TOOL_MODULES = {
    "skiplock.connect": {
        "check_dsn",
        "embedded_data_dir",
        "embedded_dsn",
        "redact_dsn",
        "resolve_dsn",
        "server_dsn",
    },
    "skiplock.sqlfiles": {"Statements", "load_named", "parse_named", "statements"},
    "skiplock.schema": {"latest_migration", "schema_version", "validate_schema"},
    "skiplock.results": {"DEFAULT_MAX_RESULT_BYTES", "Encoded", "encode_result", "error_line"},
    "skiplock.cli": {"main"},
    "skiplock.cli.common": {
        "dsn_option",
        "echo_json",
        "json_option",
        "require_extra",
        "schema_option",
        "user_errors",
    },
}


@pytest.mark.parametrize("module", sorted(TOOL_MODULES))
def test_tool_modules_all_is_pinned(module: str) -> None:
    mod = importlib.import_module(module)
    assert set(mod.__all__) == TOOL_MODULES[module]
    for name in mod.__all__:
        assert hasattr(mod, name), name
