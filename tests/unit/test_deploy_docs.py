"""Every snippet of docs/deploy.md, parsed and checked against the real command line.

Each fenced block is parsed by its language: YAML (the Kubernetes manifests), ini (the
systemd unit, by systemd's key=value rules), dotenv (its EnvironmentFile) and sh (the
commands).  Every `skiplock` command line in them goes through click's own parser for
that command, so a misspelt or removed flag, or a bad value, fails here; the probes
must name the paths and the port the worker serves, and the grace periods must leave
room for ``--grace``.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from skiplock._health import CHECK_TIMEOUT
from skiplock.cli import main

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "deploy.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)

# The directives the unit may use, per section: a misspelt one would be ignored by
# systemd with a warning nobody reads.
SYSTEMD = {
    "Unit": {"Description", "Documentation", "Wants", "Requires", "After", "Before"},
    "Service": {
        "Type",
        "User",
        "Group",
        "WorkingDirectory",
        "Environment",
        "EnvironmentFile",
        "ExecStartPre",
        "ExecStart",
        "KillMode",
        "KillSignal",
        "TimeoutStopSec",
        "Restart",
        "RestartSec",
        "NoNewPrivileges",
        "PrivateTmp",
        "ProtectSystem",
        "ProtectHome",
        "ReadWritePaths",
    },
    "Install": {"WantedBy"},
}


def blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(DOC.read_text()) if tag == lang]


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """``skiplock SUBCOMMAND ...`` through click's parser: (subcommand, its params)."""
    assert argv[0].rsplit("/", 1)[-1] == "skiplock", argv
    ctx = click.Context(main)
    command = main.get_command(ctx, argv[1])
    assert command is not None, f"no command skiplock {argv[1]}"
    try:
        params = command.make_context(argv[1], list(argv[2:])).params
    except click.UsageError as exc:  # BadParameter and NoSuchOption are both
        pytest.fail(f"{shlex.join(argv)}: {exc.format_message()}")
    return argv[1], params


def test_every_block_has_a_language_this_test_checks() -> None:
    tags = [tag for tag, _ in FENCE.findall(DOC.read_text())]
    assert tags and set(tags) <= {"yaml", "ini", "dotenv", "sh"}, tags


def _containers(manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = manifest["spec"]["template"]["spec"]
    return spec["containers"], spec.get("initContainers", [])


def _probe_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [named] = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(named)


def _check_worker_container(container: dict[str, Any], grace_period: int) -> dict[str, Any]:
    _, params = parse([*container["command"], *container["args"]])
    port = params["health_port"]
    assert port is not None and params["health_host"] == "0.0.0.0"  # the kubelet: pod IP
    probes = {
        "startupProbe": "/livez",
        "livenessProbe": "/livez",
        "readinessProbe": "/readyz",
    }
    for probe, path in probes.items():
        got = container[probe]["httpGet"]
        assert got["path"] == path and _probe_port(container, got["port"]) == port, probe
    for probe in ("livenessProbe", "readinessProbe"):
        # The readiness check may take CHECK_TIMEOUT, a supervisor's round a second more.
        assert container[probe]["timeoutSeconds"] > CHECK_TIMEOUT + 1.0
    assert grace_period > params["shutdown_grace"] + 5  # room for the last writes
    assert container.get("envFrom") or container.get("env"), "no SKIPLOCK_DSN"
    return params


def test_the_deployment_probes_what_the_worker_serves() -> None:
    docs = [doc for body in blocks("yaml") for doc in yaml.safe_load_all(body)]
    [deployment] = [d for d in docs if d.get("kind") == "Deployment"]
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    template = deployment["spec"]["template"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= template["metadata"]["labels"].items()
    grace_period = template["spec"]["terminationGracePeriodSeconds"]
    containers, init = _containers(deployment)
    [worker] = containers
    params = _check_worker_container(worker, grace_period)
    assert params["do_migrate"] is False  # the init container migrates, once
    assert [parse(c["command"] + c.get("args", []))[0] for c in init] == ["migrate"]
    # The --processes variant: the same container with other args.
    fragments = [d for d in docs if "kind" not in d]
    assert fragments, "no --processes fragment"
    for fragment in fragments:
        variant = {**worker, **fragment}
        got = _check_worker_container(variant, grace_period)
        assert got["processes"] > 1
        assert int(fragment["resources"]["requests"]["cpu"]) == got["processes"]


def test_the_systemd_unit_runs_real_options_and_outlasts_the_grace() -> None:
    [body] = blocks("ini")
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    unit.read_string(body)
    assert set(unit.sections()) == set(SYSTEMD)
    for section in unit.sections():
        unknown = set(unit[section]) - SYSTEMD[section]
        assert not unknown, f"[{section}] {unknown}"
    service = unit["Service"]
    assert service["Type"] in {"simple", "exec", "notify"}
    command, params = parse(shlex.split(service["ExecStart"]))
    assert command == "worker"
    assert parse(shlex.split(service["ExecStartPre"]))[0] == "migrate"
    assert params["do_migrate"] is False
    if params["processes"] > 1:
        assert service["KillMode"] == "mixed"  # else every child gets each signal twice
    assert service["KillSignal"] == "SIGTERM"
    assert float(service["TimeoutStopSec"]) > params["shutdown_grace"] + 5
    assert params["health_port"] is not None
    env_file = service["EnvironmentFile"]
    assert f"`{env_file}`" in DOC.read_text()  # the dotenv block below is that file


def documented_variables() -> set[str]:
    table = DOC.read_text().split("## Environment variables", 1)[1]
    return set(re.findall(r"^\| `([A-Z_]+)`", table, re.M))


def test_the_environment_file_sets_documented_variables_and_a_dsn_without_password() -> None:
    [body] = blocks("dotenv")
    env = {}
    for line in body.splitlines():
        if line.strip() and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
            env[key] = value
    for key in env:
        assert key in documented_variables() or key.startswith("PG"), key
    dsn = conninfo_to_dict(env["SKIPLOCK_DSN"])
    assert dsn["dbname"] == "billing" and "password" not in dsn


def test_the_variables_table_matches_what_the_code_reads() -> None:
    read: set[str] = set()
    for path in (ROOT / "src" / "skiplock").rglob("*.py"):
        read |= set(
            re.findall(r'environ(?:\.get\(|\[)"((?:SKIPLOCK|DATABASE)_[A-Z_]+)"', path.read_text())
        )
    read.discard("SKIPLOCK_TEST_DSN")  # the test suite's, not a deployment's
    assert read, "found no variable read"
    assert read <= documented_variables(), read - documented_variables()
    for name in documented_variables():
        assert name.startswith("PG") or name in read, f"{name} is documented but never read"


def test_the_commands_are_real() -> None:
    [body] = blocks("sh")
    ports: set[int] = set()
    for line in body.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "skiplock":
            _, params = parse(argv)
            ports.add(params["health_port"])
        else:
            assert argv[:2] == ["curl", "-s"], line
            m = re.fullmatch(r"localhost:(\d+)(/livez|/readyz)", argv[2])
            assert m and int(m.group(1)) in ports, line
