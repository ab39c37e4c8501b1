"""The dashboard's Starlette app: pages, the JSON poll, and the POST actions."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from skiplock import DatabaseUnavailable, Queue, SkiplockError
from skiplock.results import error_line

from ._chart import RANGES
from ._data import STATUSES, age, overview, pretty_json, when
from ._security import CSRF_COOKIE, FLASH_COOKIE, BasicAuth, Credentials, SecurityHeaders, Signer

__all__ = ["create_app"]

HERE = Path(__file__).parent
PAGE_SIZE = 50
BIGINT_MAX = 2**63 - 1
JOB_ACTIONS = ("requeue", "cancel", "delete")
QUEUE_ACTIONS = ("pause", "resume")

Endpoint = Callable[[Request], Awaitable[Response]]


class _Dashboard:
    """The routes' shared state: the queue, the signer, the templates."""

    def __init__(self, queue: Queue, signer: Signer, refresh: float) -> None:
        self.queue = queue
        self.signer = signer
        self.refresh = refresh
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(age=age, when=when, pretty_json=pretty_json)

    # -- rendering ------------------------------------------------------------------------

    def render(
        self, request: Request, name: str, context: dict[str, Any], status_code: int = 200
    ) -> Response:
        """A page with its CSRF token and the pending flash message (then forgotten)."""
        nonce = request.cookies.get(CSRF_COOKIE) or ""
        fresh = len(nonce) < 16
        if fresh:
            nonce = self.signer.new_nonce()
        flash = self.signer.load_flash(request.cookies.get(FLASH_COOKIE))
        html = self.env.get_template(name).render(
            csrf_token=self.signer.csrf_token(nonce),
            flash=context.pop("flash", flash),
            here=_here(request),
            schema=self.queue.settings.schema,
            statuses=STATUSES,
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        if fresh:
            response.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", path="/")
        if FLASH_COOKIE in request.cookies:
            response.delete_cookie(FLASH_COOKIE, path="/")
        return response

    def error_page(self, request: Request, message: str, status_code: int) -> Response:
        return self.render(request, "error.html", {"flash": ("error", message)}, status_code)

    def redirect(self, target: str, level: str, message: str) -> Response:
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            FLASH_COOKIE,
            self.signer.dump_flash(level, message),
            httponly=True,
            samesite="strict",
            path="/",
        )
        return response

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking Queue call off the event loop (Queue is thread-safe)."""
        return await run_in_threadpool(fn, *args, **kwargs)

    # -- pages ----------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        rng = RANGES.get(request.query_params.get("range", "1h"), RANGES["1h"])
        try:
            data = await self.call(overview, self.queue, rng)
        except SkiplockError as exc:
            return self.error_page(request, str(exc), 503)
        return self.render(
            request,
            "overview.html",
            {"data": data, "range": rng, "ranges": RANGES.values(), "refresh": self.refresh},
        )

    async def api_overview(self, request: Request) -> Response:
        rng = RANGES.get(request.query_params.get("range", "1h"), RANGES["1h"])
        try:
            data = await self.call(overview, self.queue, rng)
        except SkiplockError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        return JSONResponse(data.to_json(), headers={"cache-control": "no-store"})

    async def jobs(self, request: Request) -> Response:
        params = request.query_params
        queue = params.get("queue") or None
        status = params.get("status") or None
        task = params.get("task", "").strip() or None
        before: int | None = None
        if params.get("before"):
            before = _job_id(params["before"])
            if before is None:
                return self.error_page(request, f"bad job id {params['before']!r}", 400)
        try:
            rows = await self.call(
                self.queue.find_jobs,
                queue=queue,
                status=status,
                task=task,
                limit=PAGE_SIZE + 1,
                before_id=before,
            )
        except DatabaseUnavailable as exc:
            return self.error_page(request, str(exc), 503)
        except (SkiplockError, ValueError) as exc:
            return self.error_page(request, str(exc), 400)
        more = len(rows) > PAGE_SIZE
        rows = rows[:PAGE_SIZE]
        filters = {k: v for k, v in (("queue", queue), ("status", status), ("task", task)) if v}
        return self.render(
            request,
            "jobs.html",
            {
                "rows": rows,
                "queue": queue,
                "status": status,
                "task": task,
                "before": before,
                "first_page": "/jobs" + (f"?{urlencode(filters)}" if filters else ""),
                "next_page": (
                    f"/jobs?{urlencode({**filters, 'before': rows[-1].id})}" if more else None
                ),
                "queues": await self._queue_names(),
            },
        )

    async def _queue_names(self) -> list[str]:
        try:
            rows = await self.call(self.queue.status)
            cfgs = await self.call(self.queue.queue_settings)
        except SkiplockError:
            return []
        return sorted({r["queue"] for r in rows} | {c.name for c in cfgs})

    async def job(self, request: Request) -> Response:
        raw = request.path_params["job_id"]
        job_id = _job_id(raw)
        if job_id is None:
            return self.error_page(request, f"bad job id {raw!r}", 404)
        try:
            job = await self.call(self.queue.get, job_id)
        except SkiplockError as exc:
            return self.error_page(request, str(exc), 503)
        if job is None:
            return self.error_page(request, f"no job with id {job_id}", 404)
        return self.render(request, "job.html", {"job": job})

    async def workflow(self, request: Request) -> Response:
        raw = request.path_params["workflow_id"]
        workflow_id = _job_id(raw)
        if workflow_id is None:
            return self.error_page(request, f"bad workflow id {raw!r}", 404)
        try:
            flow = await self.call(self.queue.workflow, workflow_id)
        except SkiplockError as exc:
            return self.error_page(request, str(exc), 503)
        if flow is None:
            return self.error_page(
                request,
                f"no workflow with id {workflow_id} (a workflow's id is its first job's)",
                404,
            )
        steps = [{**step, "error": error_line(step.get("last_error"))} for step in flow["steps"]]
        counts: dict[str, int] = {}
        for step in steps:
            key = step["status"] or "gone"
            counts[key] = counts.get(key, 0) + 1
        context = {"flow": flow, "steps": steps, "counts": counts, "output": _ids(flow["output"])}
        return self.render(request, "workflow.html", context)

    # -- actions --------------------------------------------------------------------------

    async def _checked_form(self, request: Request) -> dict[str, str] | None:
        """The POSTed form if it carries a valid CSRF token from this origin, else None."""
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
            return None  # another site, or "null" (a sandboxed frame): never our own form
        body = (await request.body()).decode("utf-8", "replace")
        form = {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}
        if not self.signer.csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf_token")):
            return None
        return form

    def job_action(self, action: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            return await self._job_action(request, action)

        return endpoint

    def queue_action(self, action: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            return await self._queue_action(request, action)

        return endpoint

    async def _job_action(self, request: Request, action: str) -> Response:
        form = await self._checked_form(request)
        if form is None:
            return _forbidden()
        raw = request.path_params["job_id"]
        job_id = _job_id(raw)
        back = _local(form.get("next"), f"/jobs/{job_id}" if job_id else "/jobs")
        if job_id is None:
            return self.redirect(back, "error", f"bad job id {raw!r}")
        fn = {"requeue": self.queue.requeue, "cancel": self.queue.cancel}.get(
            action, self.queue.delete
        )
        try:
            outcome = await self.call(fn, job_id)
        except (SkiplockError, ValueError) as exc:
            return self.redirect(back, "error", str(exc))
        if action == "requeue":
            return self.redirect(back, "ok", f"job {job_id} requeued: pending, attempts reset")
        if action == "cancel":
            said = "cancelled" if outcome == "cancelled" else "asked to stop (running)"
            return self.redirect(back, "ok", f"job {job_id} {said}")
        return self.redirect(_local(form.get("gone"), "/jobs"), "ok", f"job {job_id} deleted")

    async def _queue_action(self, request: Request, action: str) -> Response:
        form = await self._checked_form(request)
        if form is None:
            return _forbidden()
        name = request.path_params["queue"]
        back = _local(form.get("next"), "/")
        fn = self.queue.pause if action == "pause" else self.queue.resume
        try:
            await self.call(fn, name)
        except (SkiplockError, ValueError) as exc:
            return self.redirect(back, "error", str(exc))
        done = "paused: workers stop claiming from it" if action == "pause" else "resumed"
        return self.redirect(back, "ok", f"queue {name!r} {done}")


def _ids(output: Any) -> list[int]:
    """A workflow's output job ids, flat (a group's output is a list, nested as written)."""
    if isinstance(output, list):
        return [i for part in output for i in _ids(part)]
    return [output] if isinstance(output, int) else []


def _job_id(raw: str) -> int | None:
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if 1 <= n <= BIGINT_MAX else None


def _local(target: str | None, default: str) -> str:
    """``target`` if it is a path on this site, else ``default``: no open redirect."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target


def _here(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _forbidden() -> Response:
    return Response(
        "forbidden: missing or bad CSRF token, or a cross-origin request; reload the page\n",
        status_code=403,
        media_type="text/plain",
    )


def create_app(
    queue: Queue,
    *,
    auth: Credentials | None = None,
    secret: bytes | None = None,
    refresh: float = 2.0,
) -> Any:
    """The dashboard as an ASGI app over ``queue`` (opened and closed by the caller).

    Parameters
    ----------
    queue
        A migrated, open ``Queue``; the app calls only its public methods.
    auth
        Require HTTP basic auth with these credentials (``parse_auth("user:pw")``).
    secret
        Key of the CSRF and flash signatures; default a random one per process.
    refresh
        Seconds between the overview's polls of ``/api/overview``.
    """
    d = _Dashboard(queue, Signer(secret), refresh)
    routes = [
        Route("/", d.index),
        Route("/api/overview", d.api_overview),
        Route("/jobs", d.jobs),
        Route("/jobs/{job_id:str}", d.job),
        Route("/workflows/{workflow_id:str}", d.workflow),
        *(
            Route(f"/jobs/{{job_id:str}}/{a}", d.job_action(a), methods=["POST"])
            for a in JOB_ACTIONS
        ),
        *(
            Route(f"/queues/{{queue:path}}/{a}", d.queue_action(a), methods=["POST"])
            for a in QUEUE_ACTIONS
        ),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app: Any = SecurityHeaders(Starlette(routes=routes))
    return BasicAuth(app, auth) if auth is not None else app
