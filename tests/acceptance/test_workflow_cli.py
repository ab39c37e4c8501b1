"""`skiplock workflow ID`: a workflow's steps and their states, from a real CLI process."""

from __future__ import annotations

import json

from skiplock import App, Fail, chain

from .test_cli import cli


def test_workflow_shows_each_step_and_its_state(dsn: str, schema: str) -> None:
    app = App(dsn, schema=schema, max_size=2)

    @app.task(name="calc.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="calc.boom", max_attempts=1)
    def boom(x: int) -> int:
        raise Fail(f"cannot take {x}")

    app.migrate()
    wf = chain(add.s(1, 2), boom.s(), add.s(1)).defer()
    worker = app.worker(concurrency=2, poll_interval=0.05)
    thread = worker.start()
    try:
        app.wait(wf, timeout=30)
    except Exception as exc:  # the failure is what the CLI shows below
        assert "step calc.boom" in str(exc)
    finally:
        worker.stop()
        thread.join(30)
    app.close()
    first, second, third = wf.jobs
    out = cli("workflow", str(wf.id), "--dsn", dsn, "--schema", schema)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"workflow {wf.id}: 3 steps (1 cancelled, 1 done, 1 failed)"
    assert f"job {first}" in lines[1] and "calc.add" in lines[1] and " done " in lines[1]
    assert "calc.boom" in lines[2] and " failed " in lines[2] and "cannot take 3" in lines[2]
    assert f"cancelled: parent job {second} failed" in lines[3]
    assert lines[4] == f"output: job {third}"
    as_json = json.loads(
        cli("workflow", str(wf.id), "--dsn", dsn, "--schema", schema, "--json").stdout
    )
    assert [s["status"] for s in as_json["steps"]] == ["done", "failed", "cancelled"]
    missing = cli("workflow", "987654", "--dsn", dsn, "--schema", schema)
    not_one = cli("workflow", str(second), "--dsn", dsn, "--schema", schema)
    assert not_one.returncode == 2 and f"no workflow with id {second}" in not_one.stderr
    assert missing.returncode == 2 and missing.stderr.strip().endswith(
        "no workflow with id 987654 (a workflow's id is its first job's)"
    )
