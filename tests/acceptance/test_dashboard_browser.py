"""`skiplock dashboard` end to end: the real command, Debian's chromium driven by Playwright.

The tests need /usr/bin/chromium and install nothing system-wide: without it they are
skipped with a notice saying how to get it (``apt-get install chromium``, which
``.ci/run`` does itself, so CI always runs them; ``SKIPLOCK_REQUIRE_BROWSER=1`` turns
the skip into a failure).  Playwright's Python client comes with the ``test`` extra (its
bundled driver only; no ``playwright install``, which would download a browser); when it
is not importable it is installed from PyPI into this virtualenv.

Set SKIPLOCK_SCREENSHOTS=docs/img to refresh the documentation's screenshots.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue

pytestmark = pytest.mark.timeout(900)  # the first set-up may pip install playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EXPECT_MS = 15_000


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=800)


def _ensure_chromium() -> str:
    """The browser, or a skip saying how to install it (never an apt-get as root here:
    a test run should not change the system behind the user's back)."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    notice = (
        f"{CHROMIUM} is missing: the dashboard's browser tests need it "
        "(Debian/Ubuntu: sudo apt-get install chromium; .ci/run installs it)"
    )
    if os.environ.get("SKIPLOCK_REQUIRE_BROWSER") == "1":
        pytest.fail(notice)
    pytest.skip(notice)


def _ensure_playwright() -> Any:
    try:
        return importlib.import_module("playwright.sync_api")
    except ImportError:
        done = _run([sys.executable, "-m", "pip", "install", "--quiet", "playwright"])
        if done.returncode != 0:
            pytest.skip(f"playwright could not be installed from PyPI: {done.stderr[-300:]}")
        importlib.invalidate_caches()
        return importlib.import_module("playwright.sync_api")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = _ensure_chromium()
    sync_api = _ensure_playwright()
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    p.set_default_timeout(EXPECT_MS)
    yield p
    context.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(dsn: str, queue: Queue) -> Iterator[str]:
    """``skiplock dashboard`` as a user starts it, on a free port, over the test schema."""
    schema = queue.settings.schema
    port = _free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "skiplock.cli", "dashboard"),
            *("--dsn", dsn, "--schema", schema, "--port", str(port), "--refresh", "0.5"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/overview", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"skiplock dashboard did not come up on port {port}:\n{out}")
        time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def shoot(page: Any, tmp_path: Path, name: str, *, publish: bool = False) -> Path:
    """A screenshot checked to be a real picture; with ``publish``, also copied to
    $SKIPLOCK_SCREENSHOTS when set (the README's pictures come from these tests)."""
    path = tmp_path / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    width, height = _png_size(path)
    assert width >= 1000 and height >= 300, (width, height)
    assert path.stat().st_size > 20_000, "a near-empty screenshot"
    keep = os.environ.get("SKIPLOCK_SCREENSHOTS")
    if keep and publish:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def fail_one(queue: Queue, name: str, error: str) -> int:
    job_id = queue.enqueue({"invoice": 1042, "to": "billing@example.com"}, queue=name)
    [job] = queue.claim(worker="host-a:4242", queue=name)
    assert job.id == job_id
    queue.fail(job, error, retry=False)
    return job_id


TRACEBACK = """Traceback (most recent call last):
  File "/srv/app/jobs.py", line 41, in send_invoice
    provider.send(invoice, idempotency_key=job.idempotency_key)
  File "/srv/app/provider.py", line 88, in send
    raise ProviderError(f"{resp.status} from provider: {resp.text}")
app.provider.ProviderError: 503 from provider: upstream unavailable"""


def test_counts_change_live_after_an_enqueue(
    page: Any, server: str, queue: Queue, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    queue.enqueue_many([{"n": i} for i in range(3)], queue="emails")
    page.goto(server + "/")
    pending = page.locator('#queues tr[data-queue="emails"] [data-count="pending"]')
    expect(pending).to_have_text("3")
    queue.enqueue_many([{"n": i} for i in range(4)], queue="emails")
    expect(pending).to_have_text("7")  # the JSON poll, no reload
    expect(page.locator('[data-total="pending"]')).to_have_text("7")
    # A queue that appears after the page loaded gets a row (the page reloads itself).
    queue.enqueue({"report": "monthly"}, queue="reports")
    expect(page.locator('#queues tr[data-queue="reports"] [data-count="pending"]')).to_have_text(
        "1"
    )
    expect(page.locator("#updated")).to_contain_text("live")
    shoot(page, tmp_path, "live")


def test_retry_a_failed_job_by_clicking(
    page: Any, server: str, queue: Queue, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    job_id = fail_one(queue, "emails", TRACEBACK)
    page.goto(server + "/jobs?status=failed")
    page.click(f'#jobs tr[data-job="{job_id}"] a')
    expect(page.locator("#job-status")).to_have_text("failed")
    expect(page.locator("#attempts")).to_have_text("1/5")
    expect(page.locator("#worker")).to_have_text("host-a:4242")
    expect(page.locator("pre#last-error")).to_contain_text("ProviderError: 503 from provider")
    expect(page.locator("pre#payload")).to_contain_text("billing@example.com")
    assert page.locator('button[data-action="cancel"]').count() == 0  # absent, not dead
    shoot(page, tmp_path, "job", publish=True)

    page.click('button[data-action="requeue"]')
    expect(page.locator("#flash")).to_have_text(f"job {job_id} requeued: pending, attempts reset")
    expect(page.locator("#job-status")).to_have_text("pending")
    expect(page.locator("#attempts")).to_have_text("0/5")
    job = queue.get(job_id)
    assert job is not None and job.status == "pending" and job.attempts == 0


def test_pause_and_resume_a_queue_by_clicking(page: Any, server: str, queue: Queue) -> None:
    from playwright.sync_api import expect

    queue.enqueue({"n": 1}, queue="emails")
    page.goto(server + "/")
    row = page.locator('#queues tr[data-queue="emails"]')
    expect(row.locator(".badge")).to_have_text("active")
    row.locator('button[data-action="pause"]').click()
    expect(page.locator("#flash")).to_contain_text("queue 'emails' paused")
    expect(row.locator(".badge")).to_have_text("paused")
    assert [c.paused for c in queue.queue_settings() if c.name == "emails"] == [True]
    assert queue.claim(worker="w", queue="emails") == []  # the pause is real
    row.locator('button[data-action="resume"]').click()
    expect(page.locator("#flash")).to_have_text("queue 'emails' resumed")
    expect(row.locator(".badge")).to_have_text("active")
    assert [c.paused for c in queue.queue_settings() if c.name == "emails"] == [False]


def test_overview_screenshot_has_the_key_elements(
    page: Any, server: str, queue: Queue, dsn: str, tmp_path: Path
) -> None:
    """A queue with history: counts, limits, a paused queue and an hour of throughput."""
    from playwright.sync_api import expect

    queue.enqueue_many([{"invoice": i} for i in range(40)], queue="emails")
    finished = []
    for _ in range(34):
        [job] = queue.claim(worker="host-a:4242", queue="emails")
        queue.complete(job, {"sent": True})
        finished.append(job.id)
    for i in range(5):
        finished.append(fail_one(queue, "webhooks", TRACEBACK if i % 2 else "timeout after 30s"))
    queue.enqueue_many([{"report": i} for i in range(12)], queue="reports")
    queue.configure_queue("reports", concurrency_limit=2, rate_limit=5.0)
    queue.pause("reports")
    queue.enqueue({"n": 1}, queue="webhooks")
    queue.claim(worker="host-b:977", queue="webhooks", lease=300)
    # Spread the finished jobs over the last hour so the chart shows a history.  The
    # public API stamps finished_at with now(), so the test backdates them directly.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET finished_at = now() - make_interval(secs => "
                "(id * 523) %% 3500) WHERE id = ANY(%s)"
            ).format(sql.Identifier(queue.settings.schema)),
            (finished,),
        )
    page.goto(server + "/")
    expect(page.locator('#queues tr[data-queue="emails"] [data-count="done"]')).to_have_text("34")
    expect(page.locator('#queues tr[data-queue="webhooks"] [data-count="failed"]')).to_have_text(
        "5"
    )
    expect(page.locator('#queues tr[data-queue="reports"] .badge')).to_have_text("paused")
    expect(page.locator('#queues tr[data-queue="reports"] .limits')).to_contain_text(
        "concurrency 2"
    )
    expect(page.locator("#throughput-chart")).to_have_attribute("data-total", "39")
    assert page.locator("#throughput-chart rect.bar-done").count() >= 5
    assert page.locator("#throughput-chart rect.bar-failed").count() >= 1
    expect(page.locator('[data-legend="done"]')).to_have_text("34")
    shoot(page, tmp_path, "overview", publish=True)
    chart = tmp_path / "chart.png"
    # The page replaces the chart's SVG when a poll brings a new one (every 0.5 s here,
    # and the time axis moves): shot through its container, which stays, a replacement
    # mid-shot cannot detach the element being shot.
    page.locator("#chart").screenshot(path=str(chart))
    assert _png_size(chart)[0] >= 600 and chart.stat().st_size > 3_000


def test_a_missing_chromium_is_a_notice_not_an_apt_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("SKIPLOCK_REQUIRE_BROWSER", raising=False)

    def no_subprocess(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the set-up ran {args[0]!r}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install chromium; \.ci/run"):
        _ensure_chromium()
    monkeypatch.setenv("SKIPLOCK_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="/nonexistent/chromium is missing"):
        _ensure_chromium()
