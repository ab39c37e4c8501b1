"""Celery's canvas on tasks: signatures, ``chain``, ``group`` and ``chord``.

A canvas is compiled into jobs and the edges between them (``after``, migration 0016)
and written by one statement, in the caller's transaction when given one: all or
nothing.  Nothing here runs a step or decides when one may run: a step is released by
the fenced completion of its last parent, in the database (docs/workflows.md).  What
this module adds is the passing of results: a step that takes its parents' results
stores, in its job's meta, how to arrange them (one value, or lists nested as the
canvas's groups are), and the worker fills its first argument from the parents' stored
results before the call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from . import _trace
from ._errors import ConfigError, Fail, JobCancelled, JobFailed, PayloadError
from ._ops import Edge, GraphRow, encode_payload

__all__ = [
    "Canvas",
    "Chain",
    "Chord",
    "Group",
    "Signature",
    "Workflow",
    "arrange",
    "chain",
    "chord",
    "group",
    "parent_arg",
    "wait_workflow",
]

# A step's meta key: {"param": the argument the parents' results fill, "shape": how}.
META_KEY = "skiplock.canvas"


class _Task(Protocol):
    """What a canvas needs of a ``Task`` (``_tasks`` imports this module, not back)."""

    name: str
    queue: str
    priority: int
    max_attempts: int

    @property
    def app(self) -> Any: ...

    def encode(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, from_parent: bool = False
    ) -> dict[str, Any]: ...

    def first_param(self) -> str: ...


class Canvas:
    """A signature, chain, group or chord: ``defer`` writes it as one workflow."""

    def _signatures(self) -> Iterable[Signature]:
        raise NotImplementedError

    def _compile(self, graph: _Graph, incoming: Any) -> Any:
        """Add this canvas's jobs to ``graph``, each waiting for ``incoming`` (the
        output of what precedes it: a batch index, a list of outputs, or None), and
        return its own output."""
        raise NotImplementedError

    def _app(self) -> Any:
        apps = {id(s.task.app): s.task.app for s in self._signatures()}
        if not apps:
            raise ConfigError("this canvas has no task to run")
        if len(apps) > 1:
            raise ConfigError("every task of a canvas must belong to the same App")
        return next(iter(apps.values()))

    def _graph(self) -> tuple[Any, _Graph, Any]:
        app = self._app()
        graph = _Graph(app.max_payload_bytes)
        output = self._compile(graph, None)
        return app, graph, output

    def _queue(self, app: Any) -> str:
        """The queue of the canvas's first step, after checking that every step's
        queue lives on one cluster: an edge is a row of that cluster's database, and
        a step released by a parent on another could never be."""
        queues = list(dict.fromkeys(s.task.queue for s in self._signatures()))
        where = {app.dsn_of(q) for q in queues}
        if len(where) > 1:
            raise ConfigError(
                f"a workflow cannot span clusters: its queues {', '.join(queues)} live on "
                f"{len(where)} databases (a dependency cannot cross clusters)"
            )
        return queues[0]

    def defer(self, *, conn: Any = None) -> Workflow:
        """Write every job of the canvas in one statement (two round trips: the ids,
        then the jobs, their edges and the workflow's row) and return its handle.
        ``conn``: join that psycopg connection's transaction; the workflow exists only
        if it commits.  Arguments are checked first, as ``Task.defer`` checks them:
        nothing is written when one step's do not bind."""
        app, graph, output = self._graph()
        queue = self._queue(app)
        q = app._producer(queue, conn)
        ids = q._enqueue_graph(graph.rows, graph.edges, conn=conn, output=output)
        return Workflow(int(ids[0]), tuple(int(i) for i in ids), app, queue)

    async def defer_async(self, *, conn: Any = None) -> Workflow:
        """``defer`` through the app's AsyncQueue (``conn``: an AsyncConnection)."""
        app, graph, output = self._graph()
        queue = self._queue(app)
        q = await app._aproducer(queue, conn)
        ids = await q._enqueue_graph(graph.rows, graph.edges, conn=conn, output=output)
        return Workflow(int(ids[0]), tuple(int(i) for i in ids), app, queue)


class Signature(Canvas):
    """A task with its arguments, not yet deferred: ``add.s(2, 2)``, ``add.si(2, 2)``.

    In a chain, a signature made with ``s`` takes the previous step's result as its
    first positional argument (a list, after a group); one made with ``si`` is
    immutable: it waits for the previous step but takes nothing from it.
    """

    def __init__(
        self, task: _Task, args: Sequence[Any], kwargs: Mapping[str, Any], immutable: bool
    ) -> None:
        self.task = task
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.immutable = immutable

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.task.name}.{'si' if self.immutable else 's'}({', '.join(parts)})"

    def _signatures(self) -> Iterable[Signature]:
        yield self

    def _compile(self, graph: _Graph, incoming: Any) -> Any:
        return graph.add(self, incoming)


class Chain(Canvas):
    """Steps run one after another; each step's result feeds the next (``chain``)."""

    def __init__(self, steps: Sequence[Canvas]) -> None:
        if not steps:
            raise ValueError("chain() needs at least one step")
        self.steps = [_canvas(s, "chain") for s in steps]

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.steps))})"

    def _signatures(self) -> Iterable[Signature]:
        for s in self.steps:
            yield from s._signatures()

    def _compile(self, graph: _Graph, incoming: Any) -> Any:
        out = incoming
        for step in self.steps:
            out = step._compile(graph, out)
        return out


class Group(Canvas):
    """Members run side by side; the result is the list of their results (``group``)."""

    def __init__(self, members: Sequence[Canvas]) -> None:
        self.members = [_canvas(m, "group") for m in members]

    def __repr__(self) -> str:
        return f"group({', '.join(map(repr, self.members))})"

    def _signatures(self) -> Iterable[Signature]:
        for m in self.members:
            yield from m._signatures()

    def _compile(self, graph: _Graph, incoming: Any) -> Any:
        return [m._compile(graph, incoming) for m in self.members]


class Chord(Canvas):
    """A group, then a callback that gets the list of its results (``chord``)."""

    def __init__(self, header: Group, body: Canvas) -> None:
        if not isinstance(header, Group):
            raise TypeError(f"chord() takes a group first, not {header!r:.60}")
        self.header = header
        self.body = _canvas(body, "chord")

    def __repr__(self) -> str:
        return f"chord({self.header!r}, {self.body!r})"

    def _signatures(self) -> Iterable[Signature]:
        yield from self.header._signatures()
        yield from self.body._signatures()

    def _compile(self, graph: _Graph, incoming: Any) -> Any:
        return self.body._compile(graph, self.header._compile(graph, incoming))


def chain(*steps: Canvas) -> Chain:
    """``chain(add.s(1, 2), add.s(3), mul.s(10))``: 1 + 2, then 3 + 3, then 6 * 10."""
    return Chain(steps)


def group(*members: Canvas | Iterable[Canvas]) -> Group:
    """``group(add.s(1, 1), add.s(2, 2))`` or ``group(add.s(i, i) for i in range(10))``:
    its result is the list of its members' results, in order."""
    if len(members) == 1 and not isinstance(members[0], Canvas):
        return Group(list(members[0]))
    return Group(list(members))  # type: ignore[arg-type]


def chord(header: Group | Iterable[Canvas], body: Canvas) -> Chord:
    """``chord(group(...), tsum.s())``: the callback runs once every member is done and
    gets the list of their results as its first argument."""
    return Chord(header if isinstance(header, Group) else group(header), body)


def _canvas(value: Any, where: str) -> Canvas:
    if not isinstance(value, Canvas):
        hint = " (a task: write task.s(...))" if hasattr(value, "defer") else ""
        raise TypeError(f"{where}() takes signatures and canvases, not {value!r:.60}{hint}")
    return value


class _Graph:
    """The jobs of a canvas being compiled: rows, edges, in the order written."""

    def __init__(self, max_payload_bytes: int) -> None:
        self.rows: list[GraphRow] = []
        self.edges: list[Edge] = []
        self.max_payload_bytes = max_payload_bytes

    def add(self, sig: Signature, incoming: Any) -> int:
        task = sig.task
        if getattr(task, "rate_every", None) is not None:
            # A step is released when its parents finish, long after a slot taken at
            # enqueue: it would run outside its rate (migration 0020).
            raise ConfigError(f"{task.name}: a rate-limited task cannot be a canvas step (yet)")
        me = len(self.rows)
        parents = _leaves(incoming)
        takes = bool(parents) or isinstance(incoming, list)
        meta = dict(_trace.inject() or {})
        if takes and not sig.immutable:
            payload = task.encode(sig.args, sig.kwargs, from_parent=True)
            meta[META_KEY] = {"param": task.first_param(), "shape": _shape(incoming)}
        else:
            payload = task.encode(sig.args, sig.kwargs)
        try:
            meta_text = encode_payload(meta, self.max_payload_bytes) if meta else None
            text = encode_payload(payload, self.max_payload_bytes)
        except PayloadError as exc:
            raise PayloadError(f"{task.name}: {exc}") from None
        self.rows.append(
            GraphRow(task.queue, text, task.priority, None, task.max_attempts, task.name, meta_text)
        )
        self.edges.extend(
            Edge(parent, me, pos, cancel=True, local=True) for pos, parent in enumerate(parents)
        )
        return me


def _leaves(output: Any) -> list[int]:
    if output is None:
        return []
    if isinstance(output, int):
        return [output]
    return [leaf for item in output for leaf in _leaves(item)]


def _shape(output: Any) -> Any:
    """How a step's parents' results (in the order of its edges) make its argument:
    None takes one result, an integer n a list of the next n, a list one of each of
    its items.  A group of 10,000 is the 5 characters of "10000"."""
    if isinstance(output, int):
        return None
    if all(isinstance(item, int) for item in output):
        return len(output)
    return [_shape(item) for item in output]


def arrange(shape: Any, results: Sequence[Any]) -> Any:
    """The argument ``shape`` (``_shape``) makes of ``results``, taken in order."""
    it = iter(results)

    def build(s: Any) -> Any:
        if s is None:
            return next(it)
        if isinstance(s, int):
            return [next(it) for _ in range(s)]
        return [build(item) for item in s]

    return build(shape)


def parent_arg(job_meta: Any, parents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The keyword argument a step takes from its parents (empty: it takes none)."""
    spec = job_meta.get(META_KEY) if isinstance(job_meta, Mapping) else None
    if not spec:
        return {}
    unfinished = [p for p in parents if p["status"] != "done"]
    if unfinished:
        p = unfinished[0]
        raise Fail(f"parent job {p['id']} is {p['status']}, not done: no result to pass on")
    return {str(spec["param"]): arrange(spec["shape"], [p["result"] for p in parents])}


def needs_parents(job_meta: Any) -> bool:
    return isinstance(job_meta, Mapping) and META_KEY in job_meta


@dataclasses.dataclass(frozen=True)
class Workflow:
    """A deferred canvas: its ``id`` (the id of its first job) and its ``jobs``, in the
    order written.  ``app.wait(workflow)`` (or ``app.wait(workflow.id)``) returns its
    result; ``skiplock workflow ID`` shows its steps.  ``queue``: its first step's, which
    names the cluster it lives on (ids are per cluster; ``app.wait`` looks there)."""

    id: int
    jobs: tuple[int, ...]
    app: Any = dataclasses.field(repr=False, compare=False)
    queue: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def wait(self, timeout: float | None = None) -> Any:
        return self.app.wait(self, timeout=timeout)


def wait_workflow(queue: Any, workflow: Mapping[str, Any], timeout: float | None) -> Any:
    """Wait for every job of a workflow's output and arrange their results as the
    output is nested.  A step that failed (or was cancelled by hand) ends the wait with
    JobFailed (JobCancelled) naming that step, not the step that was waited for."""
    deadline = None if timeout is None else time.monotonic() + timeout
    output = workflow["output"]
    ids = [int(i) for i in _leaves(output)] if not isinstance(output, int) else [output]
    results: dict[int, Any] = {}
    for job_id in ids:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            results[job_id] = queue.wait(job_id, timeout=left)
        except (JobFailed, JobCancelled):
            raise _failed_step(queue, int(workflow["id"])) from None
    if isinstance(output, int):
        return results[output]

    def build(o: Any) -> Any:
        return results[int(o)] if isinstance(o, int) else [build(i) for i in o]

    return build(output)


def _failed_step(queue: Any, workflow_id: int) -> Exception:
    wf = queue.workflow(workflow_id)
    steps = wf["steps"] if wf else []
    for s in steps:
        if s["status"] == "failed":
            return _step_error(JobFailed(int(s["id"]), s["last_error"]), workflow_id, s)
    for s in steps:
        if s["status"] == "cancelled" and not str(s["last_error"] or "").startswith(
            "cancelled: parent job"
        ):
            return _step_error(JobCancelled(int(s["id"])), workflow_id, s)
    return JobFailed(workflow_id, f"workflow {workflow_id} did not finish")


def _step_error(
    exc: JobFailed | JobCancelled, workflow_id: int, step: Mapping[str, Any]
) -> Exception:
    what = "failed" if isinstance(exc, JobFailed) else "was cancelled"
    last = (str(step["last_error"] or "")).strip().splitlines()
    tail = f": {last[-1]}" if last and isinstance(exc, JobFailed) else ""
    exc.args = (f"workflow {workflow_id}: step {step['task']} (job {step['id']}) {what}{tail}",)
    exc.workflow_id = workflow_id
    return exc
