"""The chaos checker's workflow rules on synthetic histories: a child started before a
parent completed, a child stranded waiting, a child released twice or run twice
unexplained are each caught; a clean diamond, a re-run explained by a kill and a
cascade below a failed step are not."""

from __future__ import annotations

from typing import Any

from skiplock.chaos import check

Rec = dict[str, Any]

# A diamond: a -> b, a -> c, (b, c) -> d.
DIAMOND = ["a", "b", "c", "d"]
EDGES = [["a", "b"], ["a", "c"], ["b", "d"], ["c", "d"]]


def wf_enq(
    values: list[str] = DIAMOND,
    edges: list[list[str]] = EDGES,
    expects: dict[str, str] | None = None,
    ph: str = "ok",
) -> list[Rec]:
    out: list[Rec] = [
        {
            "t": 0.0,
            "ev": "enqueue",
            "ph": "invoke",
            "vs": values,
            "expect": "done",
            "expects": expects or {},
            "wf": "w0",
            "shape": "diamond",
            "edges": edges,
        }
    ]
    if ph != "invoke":
        out.append({"t": 0.01, "ev": "enqueue", "ph": ph, "vs": values})
    return out


def ev(t: float, event: str, v: str, tok: str, pid: int = 1, att: int = 1) -> Rec:
    return {
        "t": t,
        "ev": event,
        "v": v,
        "id": 1,
        "tok": tok,
        "att": att,
        "w": f"w{pid}",
        "pid": pid,
    }


def run(
    v: str, tok: str, t: float, pid: int = 1, att: int = 1, end: str = "completed"
) -> list[Rec]:
    recs = [ev(t, "claimed", v, tok, pid, att), ev(t + 0.01, "started", v, tok, pid, att)]
    if end:
        recs.append(ev(t + 0.02, end, v, tok, pid, att))
    return recs


def row(
    v: str,
    status: str = "done",
    tok: str = "a",
    finished: float | None = None,
    releases: list[float] | None = None,
    job_id: int = 1,
) -> Rec:
    out: Rec = {"id": job_id, "v": v, "status": status, "token": tok, "finished": finished}
    if releases is not None:
        out["releases"] = releases
    return out


def clean() -> tuple[list[Rec], list[Rec]]:
    """a at 1, b and c at 2, d at 3; each completion committed ~0.015 s after start."""
    recs = (
        wf_enq() + run("a", "ta", 1) + run("b", "tb", 2) + run("c", "tc", 2.1) + run("d", "td", 3)
    )
    rows = [
        row("a", tok="ta", finished=1.015),
        row("b", tok="tb", finished=2.015, releases=[1.016]),
        row("c", tok="tc", finished=2.115, releases=[1.016]),
        row("d", tok="td", finished=3.015, releases=[2.116]),
    ]
    return recs, rows


def test_a_clean_diamond_is_valid_and_counted() -> None:
    recs, rows = clean()
    res = check(recs, rows)
    assert res.valid, res.problems
    assert (res.workflows, res.workflow_shapes) == (1, {"diamond": 1})
    assert (res.workflow_steps, res.workflow_steps_done, res.workflow_step_runs) == (4, 4, 4)
    assert (res.workflow_children, res.workflow_releases) == (3, 3)
    assert not res.early_starts and not res.stranded_waiting and not res.release_mismatches
    assert not res.early_releases
    # d started at 3.01, 0.895 s after c's completion began: the tightest margin.
    assert res.workflow_min_start_margin is not None
    assert abs(res.workflow_min_start_margin - 0.895) < 1e-6


def test_a_child_started_before_its_parent_completed_is_caught() -> None:
    recs, rows = clean()
    # d started at 3.01, but c's completion committed only at 3.5 (its row says so).
    rows[2] = row("c", tok="tc", finished=3.5, releases=[1.016])
    res = check(recs, rows)
    assert not res.valid
    assert [(e["value"], e["parent"]) for e in res.early_starts] == [("d", "c")]
    assert "1 workflow step(s) started before a parent completed" in res.problems


def test_a_child_released_before_its_parent_completed_is_caught() -> None:
    recs, rows = clean()
    rows[3] = row("d", tok="td", finished=3.015, releases=[2.05])  # c finished at 2.115
    res = check(recs, rows)
    assert [(e["value"], e["parent"]) for e in res.early_releases] == [("d", "c")]
    assert "1 workflow step(s) released before a parent completed" in res.problems


def test_a_child_run_although_its_parent_never_completed_is_caught() -> None:
    recs = wf_enq(["a", "b"], [["a", "b"]]) + run("a", "ta", 1, end="") + run("b", "tb", 2)
    rows = [row("a", "running", tok="ta"), row("b", tok="tb", finished=2.015)]
    res = check(recs, rows)
    assert [(e["value"], e["parent_done"]) for e in res.early_starts] == [("b", None)]
    assert not res.valid


def test_without_a_row_time_the_logged_completion_is_the_parent_time() -> None:
    recs = wf_enq(["a", "b"], [["a", "b"]]) + run("a", "ta", 2) + run("b", "tb", 1)
    res = check(recs, [row("a", tok="ta"), row("b", tok="tb")])
    assert [e["value"] for e in res.early_starts] == ["b"]


def test_a_child_stranded_waiting_after_its_parents_finished_is_caught() -> None:
    recs, rows = clean()
    recs = [r for r in recs if r.get("v") != "d"]
    rows[3] = row("d", "waiting", tok="None", releases=[])
    res = check(recs, rows)
    assert not res.valid
    assert [s["value"] for s in res.stranded_waiting] == ["d"]
    assert any("stranded waiting" in p for p in res.problems)
    # Its parents completed, so it owed one release: that is reported too.
    assert [m["value"] for m in res.release_mismatches] == ["d"]


def test_a_child_waiting_on_an_unfinished_parent_is_not_stranded() -> None:
    recs = wf_enq(["a", "b"], [["a", "b"]]) + run("a", "ta", 1, end="")
    rows = [row("a", "pending", tok="ta"), row("b", "waiting", tok="None", releases=[])]
    res = check(recs, rows)
    assert not res.stranded_waiting and not res.release_mismatches
    assert len(res.lost) == 2  # the drain left them behind: reported as lost, not stranded


def test_a_child_released_twice_is_caught() -> None:
    recs, rows = clean()
    rows[3] = row("d", tok="td", finished=3.015, releases=[2.116, 2.2])
    res = check(recs, rows)
    assert not res.valid
    assert [(m["value"], m["releases"]) for m in res.release_mismatches] == [("d", 2)]
    assert "1 workflow step(s) released other than once" in res.problems


def test_a_child_run_twice_without_a_fault_is_caught() -> None:
    recs, rows = clean()
    # A second attempt of d started while the first had not handed it back, and no kill,
    # pause or outage explains it: a second release would look like this.
    recs += run("d", "td2", 3.5, pid=2, att=2, end="")
    res = check(recs, rows)
    assert not res.valid
    assert res.workflow_reruns_unexplained == 1 and res.workflow_step_runs == 5
    assert any("duplicated execution" in p for p in res.problems)


def test_a_child_rerun_after_its_holder_was_killed_is_explained() -> None:
    recs, rows = clean()
    recs = [r for r in recs if r.get("v") != "d"]
    recs += run("d", "td0", 3, pid=1, end="")
    recs.append({"t": 3.2, "ev": "fault", "f": "kill", "pid": 1})
    recs += run("d", "td", 6, pid=2, att=2)
    rows[3] = row("d", tok="td", finished=6.015, releases=[2.116])
    res = check(recs, rows)
    assert res.valid, res.problems
    assert (res.workflow_reruns_explained, res.workflow_reruns_unexplained) == (1, 0)


def test_steps_below_a_failed_step_end_cancelled_as_expected() -> None:
    expects = {"a": "failed", "b": "cancelled", "c": "cancelled"}
    recs = wf_enq(["a", "b", "c"], [["a", "b"], ["b", "c"]], expects=expects)
    recs += run("a", "ta", 1, end="failed")
    rows = [
        row("a", "failed", tok="ta", finished=1.015),
        row("b", "cancelled", tok="None", releases=[]),
        row("c", "cancelled", tok="None", releases=[]),
    ]
    res = check(recs, rows)
    assert res.valid, res.problems
    assert (res.failed_as_expected, res.cancelled_as_expected) == (1, 2)
    # A release below a failed parent, or a cancelled step that ran, is caught.
    rows[1] = row("b", "cancelled", tok="None", releases=[1.02])
    res = check(recs + run("c", "tc", 2, end=""), rows)
    assert [m["value"] for m in res.release_mismatches] == ["b"]
    assert [e["value"] for e in res.early_starts] == ["c"]
    assert not res.valid


def test_a_workflow_that_never_committed_is_not_held_to_anything() -> None:
    res = check(wf_enq(ph="info"), [])
    assert res.valid, res.problems
    assert res.workflows == 0 and res.unknown == 4


def test_a_start_a_crash_took_back_is_not_early_with_asynchronous_commit() -> None:
    """With asynchronous commit a crash can take back a parent's completion and, later
    in the WAL, its child's release and claim: the child's start is then before the
    parent's final completion without any bug."""
    recs = wf_enq(["a", "b"], [["a", "b"]]) + run("a", "ta0", 1) + run("b", "tb0", 1.1, end="")
    recs.append({"t": 1.2, "ev": "fault", "f": "crash", "down": 0.5})
    recs += run("a", "ta", 3) + run("b", "tb", 4)
    rows = [row("a", tok="ta", finished=3.015), row("b", tok="tb", finished=4.015)]
    lossy = check(recs, rows, crash_loses_commits=True)
    assert not lossy.early_starts and lossy.workflow_starts_taken_back == 1
    # A durable commit cannot be taken back: the same history is an early start.
    assert [e["value"] for e in check(recs, rows).early_starts] == ["b"]
