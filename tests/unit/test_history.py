"""The chaos checker on synthetic histories: it must catch what it claims to catch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skiplock.chaos import HistoryWriter, check, load_history

Rec = dict[str, Any]


def enq(t: float, v: str, ph: str = "ok", expect: str = "done") -> list[Rec]:
    out: list[Rec] = [{"t": t, "ev": "enqueue", "ph": "invoke", "vs": [v], "expect": expect}]
    if ph != "invoke":
        out.append({"t": t + 0.01, "ev": "enqueue", "ph": ph, "vs": [v]})
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
    """One attempt: claimed, started, then its end event (or none)."""
    recs = [ev(t, "claimed", v, tok, pid, att), ev(t + 0.01, "started", v, tok, pid, att)]
    if end:
        recs.append(ev(t + 0.02, end, v, tok, pid, att))
    return recs


def row(v: str, status: str = "done", tok: str = "a", error: str | None = None) -> Rec:
    return {"id": 1, "v": v, "status": status, "token": tok, "last_error": error}


def fault(t: float, kind: str, pid: int | None = None) -> Rec:
    return {"t": t, "ev": "fault", "f": kind, "pid": pid}


def test_a_clean_history_is_valid() -> None:
    res = check(enq(0, "x") + run("x", "a", 1), [row("x")])
    assert res.valid, res.problems
    assert (res.attempted, res.acknowledged, res.completed, res.executions) == (1, 1, 1, 1)
    assert not res.lost and not res.unexpected and not res.duplicated_executions


def test_acknowledged_job_never_completed_is_lost() -> None:
    res = check(enq(0, "x") + enq(0, "y") + run("x", "a", 1), [row("x"), row("y", "pending")])
    assert not res.valid
    assert [lost["value"] for lost in res.lost] == ["y"]
    assert res.lost[0]["status"] == "pending"


def test_a_job_that_ended_failed_when_it_should_have_completed_is_lost() -> None:
    recs = enq(0, "x") + run("x", "a", 1, end="failed")
    res = check(recs, [row("x", "failed", error="boom")])
    assert not res.valid and res.lost[0]["last_error"] == "boom"


def test_a_job_meant_to_fail_that_failed_is_not_lost() -> None:
    recs = enq(0, "x", expect="failed") + run("x", "a", 1, end="failed")
    res = check(recs, [row("x", "failed")])
    assert res.valid and res.failed_as_expected == 1 and not res.lost


def test_completion_of_a_value_never_enqueued_is_unexpected() -> None:
    res = check(enq(0, "x") + run("x", "a", 1) + run("ghost", "g", 2), [row("x")])
    assert not res.valid and res.unexpected == ["ghost"]


def test_a_row_nobody_enqueued_is_unexpected_even_unrun() -> None:
    res = check(enq(0, "x") + run("x", "a", 1), [row("x"), row("ghost", "pending", "z")])
    assert res.unexpected == ["ghost"]


def test_a_definitely_failed_enqueue_that_shows_up_is_unexpected() -> None:
    res = check(enq(0, "x", ph="fail") + run("x", "a", 1), [row("x")])
    assert res.unexpected == ["x"] and not res.valid


def test_unknown_enqueue_that_completed_is_recovered_and_one_that_did_not_is_not_lost() -> None:
    recs = enq(0, "u1", ph="info") + enq(0, "u2", ph="info") + run("u1", "a", 1)
    res = check(recs, [row("u1")])
    assert res.valid, res.problems
    assert res.recovered == ["u1"] and res.unknown == 2 and not res.lost
    assert res.completed == 1


def test_two_completions_under_two_tokens_are_a_duplicated_completion() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=1) + run("x", "b", 2, pid=2, att=2)
    recs.append(fault(1.5, "kill", 1))
    res = check(recs, [row("x", tok="b")])
    assert not res.valid
    assert len(res.duplicated_completions) == 1
    assert {f["token"] for f in res.duplicated_completions[0]["finishes"]} == {"a", "b"}


def test_one_completion_reported_twice_is_not_duplicated() -> None:
    recs = enq(0, "x") + run("x", "a", 1) + [ev(1.5, "completed", "x", "a")]
    res = check(recs, [row("x")])
    assert res.valid and not res.duplicated_completions


def test_rerun_after_the_holder_was_killed_is_an_allowed_duplicate() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(1.5, "kill", 7)]
    recs += run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert res.valid, res.problems
    [dup] = res.duplicated_executions
    assert (dup.cause, dup.prev_pid, dup.allowed) == ("killed", 7, True)
    assert res.causes() == {"killed": 1}


def test_rerun_with_no_fault_to_explain_it_is_invalid() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert not res.valid
    assert [d.cause for d in res.duplicated_executions] == ["none"]


def test_rerun_after_a_restart_is_named_but_not_allowed_by_default() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(2, "restart")]
    recs += run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert [d.cause for d in res.duplicated_executions] == ["restart"] and not res.valid
    relaxed = check(recs, [row("x", tok="b")], allowed_causes=frozenset({"restart"}))
    assert relaxed.valid


def test_a_timed_out_attempt_an_outage_kept_from_its_write_reran_as_allowed() -> None:
    """Issue 38's 600-second run: the handler timed out while `maxconn` cut the worker's
    connections, the hand-back never committed, the lease ran out, the job ran again."""
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="timed_out") + [fault(1.5, "maxconn")]
    recs += run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert res.valid, res.problems
    assert res.causes() == {"unwritten": 1}


def test_a_write_refused_after_an_outage_let_the_lease_run_out_is_an_allowed_rerun() -> None:
    """The 600-second run's maxconn cases: the worker's completion reached the server
    only after its lease had run out (its connections cut), and was refused."""
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(1.5, "maxconn")]
    recs += [*run("x", "b", 4, pid=8, att=2), ev(4.5, "lease_lost", "x", "a", pid=7)]
    res = check(recs, [row("x", tok="b")])
    assert res.valid, res.problems
    assert res.causes() == {"unwritten": 1}


def test_a_refused_write_with_no_outage_to_explain_it_is_still_invalid() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="")
    recs += [*run("x", "b", 4, pid=8, att=2), ev(4.5, "lease_lost", "x", "a", pid=7)]
    res = check(recs, [row("x", tok="b")])
    assert not res.valid
    assert res.causes() == {"none": 1}


def test_a_timed_out_attempt_rerun_with_no_outage_is_still_invalid() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="timed_out")
    recs += run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert not res.valid
    assert res.causes() == {"none": 1}


def test_a_running_attempt_cut_off_by_an_outage_is_named_for_the_outage() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(1.5, "maxconn")]
    recs += run("x", "b", 4, pid=8, att=2)
    res = check(recs, [row("x", tok="b")])
    assert res.causes() == {"maxconn": 1} and not res.valid


def test_paused_holder_rejected_late_counts_lease_lost_and_the_rerun_is_allowed() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(1.2, "pause", 7)]
    recs += run("x", "b", 4, pid=8, att=2)
    recs += [fault(5, "resume", 7), ev(5.1, "lease_lost", "x", "a", 7)]
    res = check(recs, [row("x", tok="b")])
    assert res.valid, res.problems
    assert res.lease_lost_rejections == 1 and res.pauses == 1
    assert [d.cause for d in res.duplicated_executions] == ["paused"]


def test_a_retry_after_a_handed_back_attempt_is_not_a_duplicate() -> None:
    recs = enq(0, "x") + run("x", "a", 1, end="retried") + run("x", "b", 2, att=2)
    res = check(recs, [row("x", tok="b")])
    assert res.valid and not res.duplicated_executions and res.retries == 1


def test_completion_lost_with_its_process_is_found_in_the_final_read() -> None:
    recs = enq(0, "x") + run("x", "a", 1, pid=7, end="") + [fault(1.5, "kill", 7)]
    res = check(recs, [row("x", "done", tok="a")])
    assert res.valid and res.completed == 1 and res.unlogged_completions == 1


def test_a_rejected_write_that_in_fact_committed_is_a_violation() -> None:
    recs = enq(0, "x") + run("x", "a", 1, end="lease_lost")
    res = check(recs, [row("x", "done", tok="a")])
    assert not res.valid and res.lease_lost_violations == [{"value": "x", "token": "a"}]


def test_recovery_time_runs_from_the_kill_to_the_next_start() -> None:
    recs = enq(0, "x") + run("x", "a", 9, pid=7, end="") + [fault(10, "kill", 7)]
    recs += run("x", "b", 12.49, pid=8, att=2)  # started at 12.5
    recs += enq(0, "y") + run("y", "c", 5, pid=7)  # finished before the kill: not held
    res = check(recs, [row("x", tok="b"), row("y", tok="c")])
    assert res.kills == 1 and res.recovery_seconds == [2.5]


def test_throughput_is_counted_per_phase() -> None:
    phases = [
        {"t": t, "ev": "phase", "name": n} for t, n in ((0, "before"), (10, "after"), (20, "end"))
    ]
    recs = phases[:]
    for i in range(30):
        recs += enq(0, f"v{i}") + run(f"v{i}", f"t{i}", 1 + i * 0.5)
    res = check(recs, [row(f"v{i}", tok=f"t{i}") for i in range(30)])
    assert res.throughput == {"before": 1.8, "after": 1.2}


def test_history_files_are_read_back_and_a_torn_line_is_counted(tmp_path: Path) -> None:
    w = HistoryWriter(tmp_path / "a.jsonl")
    w.write({"ev": "enqueue", "ph": "invoke", "vs": ["x"]})
    w.write({"ev": "enqueue", "ph": "ok", "vs": ["x"]})
    w.close()
    (tmp_path / "b.jsonl").write_text(json.dumps({"t": 0, "ev": "phase"}) + "\n" + '{"t": 1, "ev"')
    records, torn = load_history(tmp_path)
    assert torn == 1 and len(records) == 3
    assert check(records, [], torn_lines=torn).lost[0]["value"] == "x"


def crash(t: float, down: float = 0.3) -> Rec:
    return {"t": t, "ev": "fault", "f": "crash", "how": "immediate", "down": down}


def completion_taken_back() -> list[Rec]:
    # "a" completed (acknowledged), the server crashed, the completion was gone, the
    # job was swept and "b" ran it again; the database holds "b".
    return enq(0, "x") + run("x", "a", 1) + [crash(1.5)] + run("x", "b", 5, pid=2, att=1)


def test_a_completion_a_crash_took_back_under_async_commit_is_a_rerun() -> None:
    res = check(completion_taken_back(), [row("x", tok="b")], crash_loses_commits=True)
    assert res.valid, res.problems
    assert not res.duplicated_completions
    assert len(res.completions_lost_in_crash) == 1 and res.reexecuted_after_crash == 1
    assert res.crashes == 1 and res.causes() == {"crash": 1}


def test_under_sync_commit_the_same_history_is_a_double_completion() -> None:
    res = check(completion_taken_back(), [row("x", tok="b")], crash_loses_commits=False)
    assert not res.valid and len(res.duplicated_completions) == 1
    assert not res.completions_lost_in_crash


def test_two_completions_with_no_crash_between_are_doubled_even_under_async_commit() -> None:
    recs = enq(0, "x") + run("x", "a", 1) + run("x", "b", 5, pid=2) + [crash(8.0)]
    res = check(recs, [row("x", tok="b")], crash_loses_commits=True)
    assert not res.valid and len(res.duplicated_completions) == 1


def test_a_completion_the_database_still_holds_was_not_taken_back() -> None:
    # The row keeps "a": the later finish "b" is the one that cannot be explained.
    res = check(completion_taken_back(), [row("x", tok="a")], crash_loses_commits=True)
    assert not res.valid and len(res.duplicated_completions) == 1
