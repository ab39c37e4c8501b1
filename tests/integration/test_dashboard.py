"""The dashboard app through Starlette's TestClient, on a real migrated queue."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("starlette", reason="the dashboard extra (starlette) is not installed")
pytest.importorskip("jinja2", reason="the dashboard extra (jinja2) is not installed")

from starlette.testclient import TestClient

from skiplock import Job, Queue
from skiplock.dashboard import create_app, parse_auth

TOKEN_RE = re.compile(r'<meta name="csrf-token" content="([0-9a-f]+)">')


@pytest.fixture
def client(queue: Queue) -> Iterator[TestClient]:
    with TestClient(create_app(queue), follow_redirects=True) as c:
        yield c


def token(client: TestClient, path: str = "/") -> str:
    """The CSRF token a page hands this client (and, with it, the cookie it pairs with)."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = TOKEN_RE.search(page.text)
    assert found, f"no CSRF token on {path}"
    return found.group(1)


def flash(page: str) -> str:
    found = re.search(r'<div id="flash" class="flash flash-(\w+)"[^>]*>([^<]*)</div>', page)
    assert found, "no flash message on the page"
    return f"{found.group(1)}: {html.unescape(found.group(2))}"


def failed_job(queue: Queue, name: str = "emails") -> Job:
    job_id = queue.enqueue({"to": "a@example.com"}, queue=name)
    [job] = queue.claim(worker="w-test", queue=name)
    assert job.id == job_id
    trace = 'Traceback (most recent call last):\n  File "h.py", line 3\nRuntimeError: <smtp> down'
    assert queue.fail(job, trace, retry=False) == "failed"
    return job


# -- pages ----------------------------------------------------------------------------------


def test_overview_shows_counts_oldest_pending_pause_and_limits(
    queue: Queue, client: TestClient
) -> None:
    queue.enqueue_many([{"n": i} for i in range(3)], queue="emails")
    failed_job(queue, "reports")
    queue.configure_queue("reports", concurrency_limit=2, rate_limit=5.0)
    queue.pause("reports")
    body = client.get("/").text
    emails = re.search(r'<tr data-queue="emails".*?</tr>', body, re.S)
    reports = re.search(r'<tr data-queue="reports" data-paused="true".*?</tr>', body, re.S)
    assert emails and reports
    assert re.search(r'data-count="pending"><a [^>]*>3</a>', emails.group(0))
    assert re.search(r'data-count="failed"><a [^>]*>1</a>', reports.group(0))
    assert re.search(r'data-field="oldest_pending">\d+\.\ds<', emails.group(0))
    assert "concurrency 2" in reports.group(0) and "5/s" in reports.group(0)
    assert 'class="badge paused"' in reports.group(0)
    assert 'data-action="resume"' in reports.group(0)
    assert 'data-action="pause"' in emails.group(0)
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="chart"' in body
    assert 'class="bar bar-failed"' in body


def test_the_json_poll_follows_enqueues(queue: Queue, client: TestClient) -> None:
    assert client.get("/api/overview").json()["queues"] == []
    queue.enqueue_many([{"n": i} for i in range(4)], queue="emails")
    body = client.get("/api/overview").json()
    [emails] = body["queues"]
    assert emails["name"] == "emails" and emails["counts"]["pending"] == 4
    assert body["totals"]["pending"] == 4
    assert body["chart_svg"].startswith("<svg")
    assert client.get("/api/overview?range=24h").status_code == 200


def test_job_page_shows_payload_attempts_lease_holder_traceback_and_result(
    queue: Queue, client: TestClient
) -> None:
    job = failed_job(queue)
    body = client.get(f"/jobs/{job.id}").text
    assert 'id="job-status">failed<' in body
    assert 'id="attempts">1/5<' in body
    assert 'id="worker">w-test<' in body
    # The traceback is escaped text in a <pre>, not markup.
    assert '<pre id="last-error" class="traceback">Traceback' in body
    assert "RuntimeError: &lt;smtp&gt; down" in body
    assert "a@example.com" in body
    # A failed job offers retry and delete; cancel applies to live jobs only.
    assert 'data-action="requeue"' in body and 'data-action="delete"' in body
    assert 'data-action="cancel"' not in body

    running_id = queue.enqueue({"x": 1}, queue="emails")
    [running] = queue.claim(worker="w-live", queue="emails", lease=120)
    assert running.id == running_id
    body = client.get(f"/jobs/{running_id}").text
    assert 'lease holder</th><td id="worker">w-live<' in body
    assert re.search(r'id="locked-until">\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(in ', body)
    assert 'data-action="cancel"' in body
    assert 'data-action="delete"' not in body  # a running job has a lease holder
    queue.complete(running, {"sent": True, "id": "msg-1"})
    body = client.get(f"/jobs/{running_id}").text
    assert '<pre id="result">' in body and "msg-1" in body


def test_job_list_filters_and_pages(queue: Queue, client: TestClient) -> None:
    ids = queue.enqueue_many([{"n": i} for i in range(60)], queue="bulk")
    failed = failed_job(queue, "emails")
    queue.enqueue({"other": True}, queue="emails")
    page = client.get("/jobs?queue=bulk").text
    shown = [int(i) for i in re.findall(r'<tr data-job="(\d+)">', page)]
    assert shown == sorted(ids, reverse=True)[:50]
    older = re.search(r'<a href="([^"]+)" id="older">', page)
    assert older, "no link to the older page"
    page2 = client.get(older.group(1).replace("&amp;", "&")).text
    assert [int(i) for i in re.findall(r'<tr data-job="(\d+)">', page2)] == sorted(ids)[:10][::-1]
    assert 'id="older"' not in page2 and 'id="newest"' in page2
    only_failed = client.get("/jobs?status=failed").text
    assert re.findall(r'<tr data-job="(\d+)">', only_failed) == [str(failed.id)]
    assert "RuntimeError: &lt;smtp&gt; down" in only_failed  # the error's last line


def test_the_failed_list_shows_task_and_exception_line_and_filters_by_task(
    queue: Queue, client: TestClient
) -> None:
    """Issue 38: the list showed no task, and the first 200 characters of a long
    traceback ended on a 'File ...' line.  Now the task, and the exception line."""
    frames = "".join(
        f'  File "/srv/app/module_{n}.py", line {n}, in step_{n}\n    step_{n + 1}()\n'
        for n in range(8)
    )
    trace = f"Traceback (most recent call last):\n{frames}ValueError: bad invoice 7\n"
    ids = queue.enqueue_many([{}, {}], queue="billing", task="billing.send")
    other = queue.enqueue({}, queue="billing", task="billing.refund")
    jobs = queue.claim(worker="w", queue="billing", limit=3)
    queue.fail_many([(j, trace, None, False) for j in jobs])
    page = client.get("/jobs?status=failed").text
    rows = dict(re.findall(r'<tr data-job="(\d+)">(.*?)</tr>', page, re.S))
    assert sorted(map(int, rows)) == sorted([*ids, other])
    for job_id in ids:
        row = rows[str(job_id)]
        assert ">billing.send</a>" in row
        assert '<td class="error-head">ValueError: bad invoice 7</td>' in row
        assert "File " not in row
    only = client.get("/jobs?status=failed&task=billing.send").text
    assert sorted(map(int, re.findall(r'<tr data-job="(\d+)">', only))) == sorted(ids)
    assert 'name="task" value="billing.send"' in only
    assert "No jobs match." in client.get("/jobs?task=nobody.knows").text
    assert client.get("/jobs?task=" + "x" * 300).status_code == 400  # one line, not a 500


# -- actions --------------------------------------------------------------------------------


def test_retry_cancel_delete_pause_resume(queue: Queue, client: TestClient) -> None:
    job = failed_job(queue)
    t = token(client, f"/jobs/{job.id}")
    r = client.post(f"/jobs/{job.id}/requeue", data={"csrf_token": t, "next": f"/jobs/{job.id}"})
    assert r.status_code == 200 and r.url.path == f"/jobs/{job.id}"
    assert flash(r.text) == f"ok: job {job.id} requeued: pending, attempts reset"
    again = queue.get(job.id)
    assert again is not None and again.status == "pending" and again.attempts == 0
    # The flash is shown once.
    assert 'id="flash"' not in client.get(f"/jobs/{job.id}").text

    r = client.post(f"/jobs/{job.id}/cancel", data={"csrf_token": t})
    assert flash(r.text) == f"ok: job {job.id} cancelled"
    cancelled = queue.get(job.id)
    assert cancelled is not None and cancelled.status == "cancelled"

    r = client.post(f"/jobs/{job.id}/delete", data={"csrf_token": t, "gone": "/jobs"})
    assert r.url.path == "/jobs" and flash(r.text) == f"ok: job {job.id} deleted"
    assert queue.get(job.id) is None

    queue.enqueue({}, queue="emails")
    r = client.post("/queues/emails/pause", data={"csrf_token": t, "next": "/"})
    assert flash(r.text).startswith("ok: queue 'emails' paused")
    assert [c.paused for c in queue.queue_settings() if c.name == "emails"] == [True]
    assert 'data-paused="true"' in r.text
    r = client.post("/queues/emails/resume", data={"csrf_token": t, "next": "/"})
    assert flash(r.text) == "ok: queue 'emails' resumed"
    assert [c.paused for c in queue.queue_settings() if c.name == "emails"] == [False]


def test_cancel_of_a_running_job_asks_it_to_stop(queue: Queue, client: TestClient) -> None:
    queue.enqueue({}, queue="emails")
    [job] = queue.claim(worker="w1", queue="emails", lease=60)
    t = token(client)
    r = client.post(f"/jobs/{job.id}/cancel", data={"csrf_token": t})
    assert flash(r.text) == f"ok: job {job.id} asked to stop (running)"
    assert "cancel requested" in r.text


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/jobs/999999/requeue", "error: no job with id 999999"),
        ("/jobs/999999/cancel", "error: no job with id 999999"),
        ("/jobs/999999/delete", "error: no job with id 999999"),
        ("/jobs/abc/requeue", "error: bad job id 'abc'"),
        ("/jobs/%3Cb%3E/requeue", "error: bad job id '<b>'"),
        ("/jobs/0/delete", "error: bad job id '0'"),
        ("/jobs/99999999999999999999/cancel", "error: bad job id '99999999999999999999'"),
        ("/queues/nosuch/pause", "error: unknown queue 'nosuch'"),
        ("/queues/-bad/resume", "error: invalid queue name '-bad'"),
    ],
)
def test_bad_targets_flash_an_error_not_a_500(
    queue: Queue, client: TestClient, path: str, expected: str
) -> None:
    t = token(client)
    r = client.post(path, data={"csrf_token": t, "next": "/"})
    assert r.status_code == 200
    assert flash(r.text).startswith(expected)


def test_actions_on_jobs_in_the_wrong_state_flash_the_core_error(
    queue: Queue, client: TestClient
) -> None:
    t = token(client)
    pending = queue.enqueue({}, queue="a")
    r = client.post(f"/jobs/{pending}/requeue", data={"csrf_token": t})
    assert flash(r.text).startswith("error: ") and str(pending) in flash(r.text)
    queue.enqueue({}, queue="b")
    [done] = queue.claim(worker="w", queue="b")
    queue.complete(done)
    r = client.post(f"/jobs/{done.id}/cancel", data={"csrf_token": t})
    assert flash(r.text).startswith("error: ")
    queue.enqueue({}, queue="c")
    [running] = queue.claim(worker="w", queue="c")
    r = client.post(f"/jobs/{running.id}/delete", data={"csrf_token": t})
    assert flash(r.text).startswith("error: ")
    assert queue.get(running.id) is not None


def test_bad_pages_answer_4xx_with_the_message(queue: Queue, client: TestClient) -> None:
    r = client.get("/jobs/abc")
    assert r.status_code == 404 and "bad job id 'abc'" in html.unescape(r.text)
    r = client.get("/jobs/424242")
    assert r.status_code == 404 and "no job with id 424242" in r.text
    r = client.get("/jobs?status=bogus")
    assert r.status_code == 400 and "unknown status 'bogus'" in html.unescape(r.text)
    r = client.get("/jobs?before=xyz")
    assert r.status_code == 400
    assert client.post("/jobs/1/explode", data={}).status_code in (404, 405)


# -- CSRF, auth, headers --------------------------------------------------------------------


def test_posts_without_a_valid_csrf_token_are_refused(queue: Queue, client: TestClient) -> None:
    job = failed_job(queue)
    t = token(client)
    for data in ({}, {"csrf_token": ""}, {"csrf_token": "0" * 64}, {"csrf_token": t[:-1] + "x"}):
        r = client.post(f"/jobs/{job.id}/requeue", data=data)
        assert r.status_code == 403, data
    # A token with another browser's cookie (or none) is no good either.
    with TestClient(create_app(queue)) as stranger:
        assert stranger.post(f"/jobs/{job.id}/requeue", data={"csrf_token": t}).status_code == 403
    # Nor from another origin (or a sandboxed frame's "null"), token or not.
    for origin in ("http://evil.example", "null"):
        r = client.post(
            f"/jobs/{job.id}/requeue", data={"csrf_token": t}, headers={"origin": origin}
        )
        assert r.status_code == 403, origin
    # The page's own origin is fine.
    r = client.post(
        f"/jobs/{job.id}/delete", data={"csrf_token": t}, headers={"origin": "http://testserver"}
    )
    assert r.status_code == 200 and queue.get(job.id) is None
    job = failed_job(queue)
    assert client.post("/queues/emails/pause", data={}).status_code == 403
    still = queue.get(job.id)
    assert still is not None and still.status == "failed"
    assert not [c for c in queue.queue_settings() if c.paused]


def test_a_token_from_another_process_does_not_verify(queue: Queue) -> None:
    job = failed_job(queue)
    with TestClient(create_app(queue, secret=b"a" * 32)) as one:
        t = token(one)
        with TestClient(create_app(queue, secret=b"b" * 32), cookies=one.cookies) as other:
            r = other.post(f"/jobs/{job.id}/requeue", data={"csrf_token": t})
            assert r.status_code == 403


def test_redirects_stay_on_the_site(queue: Queue, client: TestClient) -> None:
    job = failed_job(queue)
    t = token(client)
    client.follow_redirects = False
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        r = client.post(f"/jobs/{job.id}/delete", data={"csrf_token": t, "gone": target})
        assert r.status_code == 303 and r.headers["location"] == "/jobs", target
        job = failed_job(queue)


def test_basic_auth(queue: Queue) -> None:
    app = create_app(queue, auth=parse_auth("ops:s3cret:with-colon"))
    good = "Basic " + base64.b64encode(b"ops:s3cret:with-colon").decode()
    bad = "Basic " + base64.b64encode(b"ops:wrong").decode()
    with TestClient(app) as c:
        r = c.get("/")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic ")
        assert c.get("/api/overview", headers={"authorization": bad}).status_code == 401
        assert c.post("/queues/x/pause", data={}).status_code == 401
        assert c.get("/static/dashboard.js").status_code == 401
        assert c.get("/", headers={"authorization": good}).status_code == 200
    with pytest.raises(ValueError, match="user:password"):
        parse_auth("nopassword")


def test_security_headers(client: TestClient) -> None:
    r = client.get("/")
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert client.get("/static/dashboard.js").status_code == 200


def test_the_command_refuses_a_malformed_auth_with_exit_2() -> None:
    from click.testing import CliRunner

    from skiplock.cli import main

    result = CliRunner().invoke(main, ["dashboard", "--auth", "nocolon"])
    assert result.exit_code == 2
    assert "--auth expects user:password" in result.output
    listed = CliRunner().invoke(main, ["--help"])
    assert "dashboard" in listed.output


def test_overview_lists_jobs_whose_task_no_worker_knows(queue: Queue, client: TestClient) -> None:
    """A rolling deploy's waiting jobs are on the queues page, not only in `status`."""
    queue.enqueue({"order": 1}, queue="payments", task="shop.refund")
    queue.enqueue({"order": 2}, queue="payments", task="shop.charge")
    # A live worker that knows shop.charge only (what App.worker registers).
    queue.register_worker("v1", queues=["payments"], tasks=["shop.charge"])
    body = client.get("/api/overview").json()
    assert [(u["queue"], u["task"], u["jobs"]) for u in body["unserved"]] == [
        ("payments", "shop.refund", 1)
    ]
    page = client.get("/").text
    assert "Waiting for a worker that knows the task" in page
    assert 'data-task="shop.refund"' in page and 'data-task="shop.charge"' not in page


def test_workflow_page_shows_each_step_its_task_and_state(queue: Queue, client: TestClient) -> None:
    """A canvas's steps in the order written, with their state (issue 39: the dashboard
    shows a workflow), and the waiting and throttled counts on the overview."""
    from skiplock import App, chain

    app = App(queue.settings.dsn, schema=queue.schema)

    @app.task(name="wf.add")
    def add(a: int, b: int) -> int:
        return a + b

    try:
        flow = chain(add.s(1, 2), add.s(3), add.s(4)).defer()
    finally:
        app.close()
    page = client.get(f"/workflows/{flow.id}")
    assert page.status_code == 200
    body = page.text
    steps = re.findall(r'<tr data-job="(\d+)">', body)
    assert len(steps) == 3 and int(steps[0]) == flow.id
    assert body.count("wf.add") == 3
    assert "1 pending" in body and "2 waiting" in body
    overview = client.get("/").text
    assert 'data-total="waiting">2<' in overview
    missing = client.get("/workflows/424242")
    assert missing.status_code == 404 and "no workflow with id 424242" in missing.text
    assert client.get("/workflows/abc").status_code == 404
