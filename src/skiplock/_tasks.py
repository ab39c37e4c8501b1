"""Tasks: functions deferred by name with checked arguments, run by the one claim loop.

A task is a plain function registered on an ``App``.  Deferring it writes one job whose
``task`` column names the function and whose payload holds its arguments by name; the
call is bound against the function's signature and encoded to JSON in the producer,
so a misspelt argument fails there, in one line, never in a worker hours later.  A
worker built by ``App.worker`` is an ordinary ``Worker`` whose claims ask for the
app's task names only and whose single handler looks each job's task up: the claim,
the fence, the leases and the sweep are the ones the rest of skiplock proves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import functools
import inspect
import string
import sys
import threading
import traceback
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, TypeVar, overload

from . import _trace
from ._aqueue import AsyncQueue
from ._aworker import AsyncWorker
from ._base import _check_enqueue_options, check_run_at, check_task_name, check_unique
from ._canvas import Signature, Workflow, needs_parents, parent_arg, wait_workflow
from ._clusters import (
    ClusterWorkers,
    Identity,
    aserver_identity,
    check_same_database,
    server_identity,
)
from ._config import RetryPolicy, validate_queue
from ._errors import ConfigError, Fail, PayloadError, Retry, UnknownJob
from ._handlers import run_coroutine
from ._job import Job
from ._ops import encode_payload
from ._periodic import CatchUp, Periodic
from ._queue import Queue
from ._worker import Worker

__all__ = ["App", "Deferral", "Task"]

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

# Annotations whose values JSON carries as they are: checked by encoding alone when
# pydantic (the `typed` extra) is not installed.
_JSON_NATIVE: frozenset[Any] = frozenset({int, float, str, bool, type(None), Any, list, dict})


def _json_native(tp: Any) -> bool:
    if tp in _JSON_NATIVE or tp is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(tp)
    if origin in (list, dict, tuple, typing.Union, types.UnionType):
        return all(_json_native(a) for a in typing.get_args(tp) if a is not Ellipsis)
    if origin is Literal:
        return all(isinstance(a, int | float | str | bool | None) for a in typing.get_args(tp))
    return False


def _adapter(tp: Any, where: str) -> Any:
    """A pydantic TypeAdapter for ``tp``, or None where JSON alone will do."""
    try:
        from pydantic import TypeAdapter
    except ImportError:
        if _json_native(tp):
            return None
        raise ConfigError(
            f"{where} is annotated {tp!r}, which JSON cannot carry as it is; "
            "install the 'typed' extra (pip install 'skiplock[typed]') to validate and "
            "convert it with pydantic"
        ) from None
    if tp is Any or tp is inspect.Parameter.empty:
        return None
    return TypeAdapter(tp)


def _hints(fn: Callable[..., Any], localns: Mapping[str, Any] | None) -> dict[str, Any]:
    """The function's annotations, resolved where they can be.

    ``localns`` is the namespace the decorator ran in, so that a string annotation
    (``from __future__ import annotations``) naming a class defined in a function
    resolves too.  A hint that does not resolve stays a string and is treated as
    unannotated (checked by JSON encoding only), except the string "Job".
    """
    ns = dict(localns or {})
    try:
        return typing.get_type_hints(fn, localns=ns)
    except Exception:
        out: dict[str, Any] = {}
        for k, v in getattr(fn, "__annotations__", {}).items():
            if isinstance(v, str):
                with contextlib.suppress(Exception):
                    v = eval(v, getattr(fn, "__globals__", {}), ns)
            out[k] = v
        return out


def _is_job(tp: Any) -> bool:
    return tp is Job or tp == "Job" or (isinstance(tp, str) and tp.endswith(".Job"))


_RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(rate: Any, where: str) -> float:
    """``"10/m"`` (jobs per second, minute or hour) as the seconds between two jobs."""
    text = rate.strip() if isinstance(rate, str) else None
    count, _, unit = (text or "").partition("/")
    try:
        n = float(count)
    except ValueError:
        n = 0.0
    if unit.strip() not in _RATE_PERIODS or not 0 < n < float("inf"):
        raise ConfigError(
            f'{where}: rate_limit must be "N/s", "N/m" or "N/h" with N > 0, not {rate!r:.40}'
        )
    return _RATE_PERIODS[unit.strip()] / n


class Task(Generic[R]):
    """A function registered with ``App.task``; call it directly, or defer it as a job.

    ``task(...)`` runs the function here and now, as the plain function would.
    ``task.defer(...)`` binds the arguments to its signature, encodes them to JSON and
    enqueues one job; it returns the job's id.  ``task.configure(...)`` sets a delay,
    a time, a priority, a key, a queue or a connection for one deferral.
    """

    def __init__(
        self,
        app: App,
        fn: Callable[..., R],
        *,
        name: str,
        queue: str,
        priority: int,
        max_attempts: int,
        retry: RetryPolicy | None,
        timeout: float | None,
        lease: float | None,
        retry_on: tuple[type[BaseException], ...] | None = None,
        no_retry_on: tuple[type[BaseException], ...] = (),
        key: str | Callable[..., str] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        localns: Mapping[str, Any] | None = None,
        soft_timeout: float | None = None,
        concurrency_key: str | Callable[..., str] | None = None,
        concurrency: int | None = None,
        rate_limit: str | None = None,
        rate_limit_key: str | Callable[..., str] | None = None,
    ) -> None:
        self.app = app
        self.fn = fn
        self.name = check_task_name(name)
        self.queue = queue
        self.priority = priority
        self.max_attempts = max_attempts
        self.retry = retry
        self.timeout = timeout
        self.soft_timeout = soft_timeout
        self.lease = lease
        self.retry_on = retry_on
        self.no_retry_on = no_retry_on
        self.key = key
        self.unique_for = unique_for
        self.on_conflict = on_conflict
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        sig = inspect.signature(fn)
        hints = _hints(fn, localns)
        self._job_param: str | None = None
        params: list[inspect.Parameter] = []
        self._adapters: dict[str, Any] = {}
        self._var_kw: str | None = None
        for p in sig.parameters.values():
            where = f"task {name!r}: parameter {p.name!r}"
            tp = hints.get(p.name, inspect.Parameter.empty)
            if _is_job(tp):
                if self._job_param is not None:
                    raise ConfigError(f"task {name!r}: only one parameter may be a Job")
                self._job_param = p.name
                continue
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                raise ConfigError(
                    f"{where}: *{p.name} cannot be deferred (a job's arguments are named)"
                )
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise ConfigError(f"{where} is positional-only; a job's arguments are named")
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                self._var_kw = p.name
            elif isinstance(tp, str):
                tp = inspect.Parameter.empty  # unresolvable: checked by encoding only
            adapter = _adapter(tp, where) if p.kind is not p.VAR_KEYWORD else None
            if adapter is not None:
                self._adapters[p.name] = adapter
            params.append(p)
        # The signature a deferral binds against: the function's, without its Job.
        self._signature = sig.replace(parameters=params)
        if concurrency_key is not None and key is not None:
            raise ConfigError(
                f"task {name!r}: concurrency_key cannot be combined with key (not built yet)"
            )
        self.concurrency_key = concurrency_key
        self.concurrency = concurrency
        if concurrency_key is None:
            if concurrency is not None:
                raise ConfigError(f"task {name!r}: concurrency needs a concurrency_key")
        else:
            self._check_template("concurrency_key", concurrency_key)
        if concurrency_key is not None and (
            type(concurrency) is not int or not 1 <= concurrency <= 2**31 - 1
        ):
            raise ConfigError(
                f"task {name!r}: concurrency must be a positive integer, not {concurrency!r:.40}"
            )
        # A rate limit (migration 0020): seconds between two jobs of the task, or of one
        # rate_limit_key (None: the task's own budget, keyed by its name).
        self.rate_limit = rate_limit
        self.rate_limit_key = rate_limit_key
        self.rate_every: float | None = None
        if rate_limit is None:
            if rate_limit_key is not None:
                raise ConfigError(f"task {name!r}: rate_limit_key needs a rate_limit")
        else:
            self.rate_every = parse_rate(rate_limit, f"task {name!r}")
            if key is not None:
                raise ConfigError(
                    f"task {name!r}: rate_limit cannot be combined with key (not built yet)"
                )
            if rate_limit_key is not None:
                self._check_template("rate_limit_key", rate_limit_key)

    def __repr__(self) -> str:
        return f"<Task {self.name} queue={self.queue!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self.fn(*args, **kwargs)

    # -- producers -----------------------------------------------------------------------

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature for a canvas (``skiplock.chain``, ``group``, ``chord``): in a
        chain, it takes the previous step's result as its first positional argument."""
        return Signature(self, args, kwargs, immutable=False)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: in a chain, it waits for the previous step but
        takes nothing from it."""
        return Signature(self, args, kwargs, immutable=True)

    def first_param(self) -> str:
        """The parameter a previous step's result fills (``s`` in a chain): the first
        one that may be given by position, the Job aside."""
        for p in self._signature.parameters.values():
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                return p.name
            break
        raise TypeError(
            f"{self.name}.s(): the task has no first positional parameter to take the "
            f"previous step's result; use {self.name}.si(...)"
        )

    def encode(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, from_parent: bool = False
    ) -> dict[str, Any]:
        """The job payload of a call: arguments by name, validated, JSON-ready.

        Raises TypeError for a call that does not bind to the function (a missing or
        misspelt argument) and PayloadError for a value JSON cannot carry.
        ``from_parent``: the first positional parameter is left out, for a canvas
        step whose previous step's result fills it when it runs.
        """
        if from_parent:
            first = self.first_param()
            if first in kwargs:
                raise TypeError(
                    f"{self.name}.s(): {first!r} is given, but takes the previous "
                    f"step's result; use {self.name}.si(...) to give it yourself"
                )
            args = (_FROM_PARENT, *args)
        if self._var_kw is None:
            # A misspelt name is the likeliest mistake: say so (and what was meant)
            # rather than report the argument it left missing.
            known = list(self._signature.parameters)
            for given in kwargs:
                if given not in known:
                    close = difflib.get_close_matches(given, known, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise TypeError(
                        f"{self.name}.defer(): unexpected argument {given!r}{hint}; "
                        f"it takes {', '.join(known) or 'no arguments'}"
                    )
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}.defer(): {exc}") from None
        out: dict[str, Any] = {}
        for pname, value in bound.arguments.items():
            if value is _FROM_PARENT:
                continue
            if pname == self._var_kw:
                out.update(value)
                continue
            adapter = self._adapters.get(pname)
            if adapter is not None:
                out[pname] = _validated(self.name, pname, adapter, value, to_json=True)
            else:
                out[pname] = value
        try:
            encode_payload(out, self.app.max_payload_bytes)
        except PayloadError as exc:
            raise PayloadError(f"{self.name}.defer(): arguments: {exc}") from None
        return out

    def _check_template(self, option: str, template: Any) -> None:
        """A key option is a format template whose every field names an argument (a
        typo is caught here, not at the first deferral), or a callable."""
        if isinstance(template, str):
            for _text, field, _spec, _conv in string.Formatter().parse(template):
                if field is None:
                    continue
                root = field.split(".", 1)[0].split("[", 1)[0]
                if root not in self._signature.parameters:
                    known = ", ".join(self._signature.parameters) or "no arguments"
                    raise ConfigError(
                        f"task {self.name!r}: {option} {template!r} names "
                        f"{root!r}, not an argument (it takes {known})"
                    )
        elif not callable(template):
            raise ConfigError(
                f"task {self.name!r}: {option} must be a format string or a callable, "
                f"not {template!r:.40}"
            )

    def key_of(self, payload: Mapping[str, Any]) -> str | None:
        """The concurrency key of a job with this ``payload`` (``encode``'s), or None.

        The template is formatted, or the callable called, with the call's arguments by
        name, the function's defaults filled in.
        """
        if self.concurrency_key is None:
            return None
        return self._render("concurrency_key", self.concurrency_key, payload)

    def rate_key_of(self, payload: Mapping[str, Any]) -> str | None:
        """The rate key of a job with this ``payload``: its ``rate_limit_key`` rendered
        as ``key_of`` renders, or ``task:<name>`` without one; None without a limit."""
        if self.rate_every is None:
            return None
        if self.rate_limit_key is None:
            return f"task:{self.name}"
        return self._render("rate_limit_key", self.rate_limit_key, payload)

    def _render(self, option: str, ck: Any, payload: Mapping[str, Any]) -> str:
        named = dict(payload)
        for pname, p in self._signature.parameters.items():
            if pname not in named and p.default is not inspect.Parameter.empty:
                named[pname] = p.default
        try:
            key = ck.format(**named) if isinstance(ck, str) else ck(**named)
        except Exception as exc:
            raise ConfigError(
                f"{self.name}.defer(): {option} failed: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"{self.name}.defer(): {option} gave {key!r:.40}, not a non-empty string"
            )
        return key

    def key_for(self, payload: Mapping[str, Any]) -> str | None:
        """The task's key for a call (its arguments, as ``encode`` made them), or None
        if the task has no ``key``: a format template over the arguments, or a callable
        given them by name."""
        if self.key is None:
            return None
        try:
            key = self.key.format_map(payload) if isinstance(self.key, str) else self.key(**payload)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
            raise TypeError(f"{self.name}.defer(): key {self.key!r}: {exc!r}") from None
        if not isinstance(key, str):
            raise TypeError(f"{self.name}.defer(): key must make a str, not {key!r:.40}")
        return key

    def configure(
        self,
        *,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        key: str | None = None,
        queue: str | None = None,
        max_attempts: int | None = None,
        conn: Any = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str | None = None,
        after: Sequence[int] | None = None,
        on_parent_failure: str = "cancel",
    ) -> Deferral:
        """Options for one deferral: ``task.configure(delay=60).defer(invoice_id=7)``.

        ``delay`` (seconds or a timedelta) and ``run_at`` (an aware datetime) are
        exclusive.  ``key`` is an idempotency key (it replaces the task's own): a second
        deferral with the same key in the same queue and the same arguments returns
        the first job's id; with other arguments it raises ``DuplicateJob``.
        ``unique_for`` and ``on_conflict`` (default: the task's) say how long the key
        holds and what a conflict gets (docs/tasks.md, "Unique jobs").  ``conn`` joins
        a psycopg connection's transaction (an ``AsyncConnection`` for ``defer_async``).
        ``after``: ids of jobs the new job(s) wait for, ``on_parent_failure`` what a
        failed one does to them (``Queue.enqueue``; docs/workflows.md).
        """
        if delay is not None and run_at is not None:
            raise ConfigError("give delay or run_at, not both")
        try:
            check_run_at(run_at)  # here, not at defer: the line that set it is the one to fix
        except ValueError as exc:
            raise ValueError(f"{self.name}.configure(): {exc}") from None
        if delay is not None:
            seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
            if not seconds >= 0:
                raise ConfigError(f"delay must be a non-negative number of seconds, not {delay!r}")
            # The server's clock decides when a job is due; ours is close enough for a
            # delay (the claim compares run_at with the server's now()).
            from datetime import UTC

            run_at = datetime.now(UTC) + timedelta(seconds=seconds)
        if unique_for is not None or on_conflict is not None:
            check_unique(unique_for, on_conflict or "return")
            if key is None and self.key is None:
                raise ConfigError("unique_for and on_conflict need a key (key= or the task's)")
        return Deferral(
            self,
            run_at=run_at,
            priority=self.priority if priority is None else priority,
            key=key,
            queue=self.queue if queue is None else queue,
            max_attempts=self.max_attempts if max_attempts is None else max_attempts,
            conn=conn,
            unique_for=self.unique_for if unique_for is None else unique_for,
            on_conflict=self.on_conflict if on_conflict is None else on_conflict,
            after=None if after is None else list(after),
            on_parent_failure=on_parent_failure,
        )

    def defer(self, *args: Any, **kwargs: Any) -> int:
        """Enqueue one job running this task with these arguments; returns its id."""
        return self.configure().defer(*args, **kwargs)

    async def defer_async(self, *args: Any, **kwargs: Any) -> int:
        """``defer`` for asyncio code, through the app's AsyncQueue."""
        return await self.configure().defer_async(*args, **kwargs)

    def defer_many(
        self, calls: Iterable[Mapping[str, Any]], *, conn: Any = None, **options: Any
    ) -> list[int]:
        """Enqueue one job per mapping of arguments, with one COPY; returns the ids."""
        return self.configure(conn=conn, **options).defer_many(calls)

    async def defer_many_async(
        self, calls: Iterable[Mapping[str, Any]], *, conn: Any = None, **options: Any
    ) -> list[int]:
        return await self.configure(conn=conn, **options).defer_many_async(calls)

    # -- workers -------------------------------------------------------------------------

    def call_args(self, job: Job, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keyword arguments of a job's call: decoded, converted, its Job added.
        ``extra``: arguments from the parents of a canvas step."""
        payload = job.payload
        if not isinstance(payload, dict):
            raise Fail(f"task {self.name}: payload is not an object of arguments: {payload!r}")
        kwargs = dict(payload)
        if extra:
            kwargs.update(extra)
        for pname, adapter in self._adapters.items():
            if pname in kwargs:
                kwargs[pname] = _validated(self.name, pname, adapter, kwargs[pname], to_json=False)
        if self._job_param is not None:
            kwargs[self._job_param] = job
        try:
            self._signature.bind(**{k: v for k, v in kwargs.items() if k != self._job_param})
        except TypeError as exc:
            # Deferred by an older version of the function: a retry cannot fix it.
            raise Fail(f"task {self.name}: stored arguments no longer bind: {exc}") from None
        return kwargs

    def run(self, job: Job, extra: Mapping[str, Any] | None = None) -> Any:
        """Run the job's call (a coroutine for an async task); used by the workers."""
        try:
            kwargs = self.call_args(job, extra)
        except Fail:
            raise
        except Exception as exc:
            raise Fail(f"task {self.name}: arguments do not validate: {exc}") from None
        return self.fn(**kwargs)

    def retries(self, exc: BaseException) -> bool:
        """Whether an exception raised by the task is retried (``retry_on`` /
        ``no_retry_on``).  ``no_retry_on`` wins where both match, as Celery's
        ``dont_autoretry_for`` does; with neither, every exception is retried."""
        if isinstance(exc, self.no_retry_on):
            return False
        return self.retry_on is None or isinstance(exc, self.retry_on)

    def retry_for(self, exc: BaseException, job: Job) -> BaseException:
        """An exception of the task as the worker should see it.

        One its ``retry_on`` / ``no_retry_on`` say not to retry becomes a ``Fail`` that
        keeps the traceback (the job ends failed now); otherwise the task's own retry
        policy, if it has one, turns it into a Retry with its delay.  ``Retry`` and
        ``Fail`` are the task's explicit word and pass as they are; so does the
        TimeoutError of the task's own ``timeout``, which is retried as any timeout, and
        anything that is not an Exception (KeyboardInterrupt, a cancel).
        """
        if not isinstance(exc, Exception) or isinstance(exc, Retry | Fail):
            return exc
        if self.timeout and isinstance(exc, TimeoutError):
            return exc
        if not self.retries(exc):
            text = "".join(traceback.format_exception(exc))
            return Fail(f"{type(exc).__name__} is not retried (task {self.name})\n{text}")
        if self.retry is None:
            return exc
        text = "".join(traceback.format_exception(exc))
        return Retry(self.retry.delay(job.attempts), text)


# Holds the place of the argument a canvas step takes from its parents, while the
# other arguments are bound and checked at defer.
_FROM_PARENT: Any = object()


def _validated(task: str, pname: str, adapter: Any, value: Any, *, to_json: bool) -> Any:
    try:
        converted = adapter.validate_python(value)
        return adapter.dump_python(converted, mode="json") if to_json else converted
    except Exception as exc:  # pydantic's ValidationError: one line, the first error
        errors = getattr(exc, "errors", None)
        first = errors()[0]["msg"] if callable(errors) and errors() else str(exc)
        if to_json:
            raise TypeError(f"{task}.defer(): argument {pname!r}: {first}") from None
        raise Fail(f"task {task}: argument {pname!r} does not validate: {first}") from None


@dataclasses.dataclass(frozen=True)
class Deferral:
    """One deferral's options (``Task.configure``); its ``defer`` methods enqueue."""

    task: Task[Any]
    run_at: datetime | None
    priority: int
    key: str | None
    queue: str
    max_attempts: int
    conn: Any
    unique_for: float | timedelta | None = None
    on_conflict: str = "return"
    after: list[int] | None = None
    on_parent_failure: str = "cancel"

    def _options(self) -> dict[str, Any]:
        """What ``Queue.enqueue`` / ``enqueue_many`` take besides the payload(s) and
        the key(s)."""
        options: dict[str, Any] = {
            "queue": self.queue,
            "priority": self.priority,
            "run_at": self.run_at,
            "max_attempts": self.max_attempts,
            "conn": self.conn,
            "task": self.task.name,
            "meta": _trace.inject(),
        }
        # Only with a key: the queue refuses unique options without one, and an
        # unkeyed deferral of a task that declares them is a plain enqueue.
        if self.unique_for is not None:
            options["unique_for"] = self.unique_for
        if self.on_conflict != "return":
            options["on_conflict"] = self.on_conflict
        if self.after is not None:
            options["after"] = self.after
            options["on_parent_failure"] = self.on_parent_failure
        return options

    def _one(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        payload = self.task.encode(args, kwargs)
        key = self.key if self.key is not None else self.task.key_for(payload)
        options = self._options() if key is not None else self._unkeyed()
        if self.task.concurrency_key is not None:
            options["concurrency_key"] = self.task.key_of(payload)
            options["concurrency"] = self.task.concurrency
        if self.task.rate_every is not None:
            options["rate_key"] = self.task.rate_key_of(payload)
            options["rate_every"] = self.task.rate_every
        return payload, {**options, "idempotency_key": key}

    def _unkeyed(self) -> dict[str, Any]:
        options = self._options()
        options.pop("unique_for", None)
        options.pop("on_conflict", None)
        return options

    def _keyed(self, payloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The concurrency and rate options of these jobs (none for a task without)."""
        out: dict[str, Any] = {}
        if self.task.concurrency_key is not None:
            keys = [self.task.key_of(p) for p in payloads]
            out.update(concurrency_key=keys, concurrency=self.task.concurrency)
        if self.task.rate_every is not None:
            rkeys = [self.task.rate_key_of(p) for p in payloads]
            out.update(rate_key=rkeys, rate_every=self.task.rate_every)
        return out

    def defer(self, *args: Any, **kwargs: Any) -> int:
        payload, options = self._one(args, kwargs)
        return self.task.app._producer(self.queue, self.conn).enqueue(payload, **options)

    async def defer_async(self, *args: Any, **kwargs: Any) -> int:
        payload, options = self._one(args, kwargs)
        q = await self.task.app._aproducer(self.queue, self.conn)
        return await q.enqueue(payload, **options)

    def _many(self, calls: Iterable[Mapping[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
        if self.key is not None:
            raise ConfigError(
                "defer_many takes no key: one key cannot dedup many jobs "
                "(give the task a key template: @app.task(key='...{arg}...'))"
            )
        out = []
        keys: list[str | None] = []
        for n, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise TypeError(f"{self.task.name}.defer_many(): call #{n} is not a mapping")
            try:
                payload = self.task.encode((), call)
                keys.append(self.task.key_for(payload))
            except (TypeError, PayloadError) as exc:
                raise type(exc)(f"call #{n}: {exc}") from None
            out.append(payload)
        if self.task.key is None:
            return out, {**self._unkeyed(), **self._keyed(out)}
        return out, {**self._options(), "idempotency_keys": keys}

    def defer_many(self, calls: Iterable[Mapping[str, Any]]) -> list[int]:
        payloads, options = self._many(calls)
        return self.task.app._producer(self.queue, self.conn).enqueue_many(payloads, **options)

    async def defer_many_async(self, calls: Iterable[Mapping[str, Any]]) -> list[int]:
        payloads, options = self._many(calls)
        q = await self.task.app._aproducer(self.queue, self.conn)
        return await q.enqueue_many(payloads, **options)


class App:
    """A set of tasks, the queue they are deferred to, and the workers that run them.

    Parameters
    ----------
    dsn
        As everywhere in skiplock: None takes ``$SKIPLOCK_DSN``, then ``$DATABASE_URL``,
        else the embedded PostgreSQL.  Nothing connects until the first deferral,
        ``wait`` or worker, so importing the module that defines the app is free.
    schema
        The skiplock schema (``skiplock migrate --schema``).
    queues
        Queues that live on another database than ``dsn``: ``{"reports": dsn2}``.
        Deferrals route by queue, a worker serves each cluster with a Worker of its
        own, and job ids are per cluster: ``app.wait(job_id, queue="reports")``.  See
        docs/scaling.md for what a split keeps of the guarantees.
    queue_options
        Passed to ``Queue`` (``max_size``, ``retry_policy``, ``pooler``, ...), on every
        cluster.

    Examples
    --------
    >>> app = App()
    >>> @app.task(queue="emails", max_attempts=10)
    ... def send_invoice(invoice_id: int) -> None: ...
    >>> job_id = send_invoice.defer(invoice_id=7)          # doctest: +SKIP
    >>> app.worker(concurrency=8).run()                     # doctest: +SKIP
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "skiplock",
        queues: Mapping[str, str] | None = None,
        **queue_options: Any,
    ) -> None:
        self.dsn = dsn
        self.schema = schema
        routes: dict[str, str] = {}
        for name, where in (queues or {}).items():
            validate_queue(name)
            if not isinstance(where, str) or not where:
                raise ConfigError(f"queues={{{name!r}: ...}} takes a DSN string, not {where!r}")
            if where != dsn:
                routes[name] = where
        # queue -> DSN, for the queues not on ``dsn``; empty for a one-cluster app,
        # which then never looks here nor checks a connection's server.
        self._routes = routes
        self._queues: dict[str, Queue] = {}
        self._aqueues: dict[str, AsyncQueue] = {}
        self._qlock = threading.Lock()
        # A transactional deferral's connection and each cluster: which database.
        self._identities: dict[str | None, Identity] = {}
        self._conn_identities: weakref.WeakKeyDictionary[Any, Identity] = (
            weakref.WeakKeyDictionary()
        )
        self._queue_options = queue_options
        self.max_payload_bytes: int = queue_options.get("max_payload_bytes", 1 << 20)
        self.tasks: dict[str, Task[Any]] = {}
        self.periodic_specs: list[Periodic] = []
        self._queue: Queue | None = None
        self._aqueue: AsyncQueue | None = None
        self._alock: asyncio.Lock | None = None
        # Set by the CLI (--app): where a process pool's children import the app from.
        self._import_path: str | None = None

    def __repr__(self) -> str:
        return f"<App schema={self.schema!r} tasks={sorted(self.tasks)}>"

    # -- declaring -----------------------------------------------------------------------

    @overload
    def task(self, fn: Callable[..., R], /) -> Task[R]: ...

    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 5,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        lease: float | None = None,
        retry_on: type[BaseException] | Iterable[type[BaseException]] | None = None,
        no_retry_on: type[BaseException] | Iterable[type[BaseException]] = (),
        key: str | Callable[..., str] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        soft_timeout: float | None = None,
        concurrency_key: str | Callable[..., str] | None = None,
        concurrency: int | None = None,
        rate_limit: str | None = None,
        rate_limit_key: str | Callable[..., str] | None = None,
    ) -> Callable[[Callable[..., R]], Task[R]]: ...

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 5,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        lease: float | None = None,
        retry_on: type[BaseException] | Iterable[type[BaseException]] | None = None,
        no_retry_on: type[BaseException] | Iterable[type[BaseException]] = (),
        key: str | Callable[..., str] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        soft_timeout: float | None = None,
        concurrency_key: str | Callable[..., str] | None = None,
        concurrency: int | None = None,
        rate_limit: str | None = None,
        rate_limit_key: str | Callable[..., str] | None = None,
    ) -> Any:
        """Register a ``def`` or ``async def`` function as a task.

        ``name`` defaults to ``module.qualname`` and is what the jobs store: renaming
        or moving the function renames the task (pass ``name=`` to keep it stable).
        ``priority`` (lower runs first) and ``max_attempts`` are the deferral defaults.
        ``retry`` replaces the queue's backoff for this task's exceptions.  ``timeout``:
        seconds an attempt may run (then it fails and is retried; under a worker's
        process pool its process is killed).  ``soft_timeout``: under the process pool,
        seconds after which ``SoftTimeLimitExceeded`` is raised in the task so it can
        clean up (shorter than ``timeout``; threads cannot be interrupted and ignore
        it).  ``lease``: the worker running this task holds leases of at least this
        many seconds.
        ``retry_on``: the exception classes that are retried (default: every one);
        ``no_retry_on``: those that end the job failed at once, which wins where both
        match.  ``Retry`` and ``Fail`` raised by the task always mean what they say.
        ``key``: every deferral's idempotency key, a format template over the arguments
        (``"charge:{customer_id}:{month}"``) or a callable given them by name;
        ``unique_for`` and ``on_conflict``: how long a key holds and what a conflict
        gets (docs/tasks.md, "Unique jobs").
        ``concurrency_key`` (a format template over the arguments, ``"customer:{customer_id}"``,
        or a callable taking them by name) with ``concurrency=N`` (default 1): at most N
        jobs of one key run at once across all workers; the others wait unclaimed
        (docs/workflows.md, "Per-key concurrency").  Not together with ``key`` (yet).
        ``rate_limit`` (``"10/m"``; ``/s``, ``/m``, ``/h``): each deferral takes the next
        slot of the task's budget, ``1/rate`` after the previous one, as its run_at, so
        jobs start no faster than the rate and nothing else waits behind them;
        ``rate_limit_key`` (a template or callable, as ``concurrency_key``) gives each
        key its own budget (docs/workflows.md, "Per-task rate limits").  Not together
        with ``key`` or ``after`` (yet).
        """
        if concurrency_key is not None and concurrency is None:
            concurrency = 1
        validate_queue(queue)
        _check_enqueue_options(queue, priority, None, max_attempts)
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"task timeout must be positive, not {timeout!r}")
        if lease is not None and not lease > 0:
            raise ConfigError(f"task lease must be positive, not {lease!r}")
        retry_classes = None if retry_on is None else _exception_classes("retry_on", retry_on)
        no_retry_classes = _exception_classes("no_retry_on", no_retry_on)
        check_unique(unique_for, on_conflict)
        if key is not None and not (isinstance(key, str) or callable(key)):
            raise ConfigError(f"task key must be a format string or a callable, not {key!r}")
        if soft_timeout is not None and not soft_timeout > 0:
            raise ConfigError(f"task soft_timeout must be positive, not {soft_timeout!r}")
        if soft_timeout is not None and timeout is not None and soft_timeout >= timeout:
            raise ConfigError(
                f"task soft_timeout ({soft_timeout:g}s) must be shorter than its timeout "
                f"({timeout:g}s)"
            )

        def register(f: Callable[..., Any], depth: int = 1) -> Task[Any]:
            # The decorated function's own namespace, for annotations naming its locals.
            localns = sys._getframe(depth).f_locals
            if isinstance(f, Task):
                raise ConfigError(f"{f.name} is already a task")
            if not callable(f):
                raise ConfigError(f"@app.task needs a function, not {f!r}")
            task_name = name or f"{f.__module__}.{f.__qualname__}"
            if task_name in self.tasks:
                other = self.tasks[task_name].fn
                raise ConfigError(
                    f"task {task_name!r} is defined twice ({other.__module__}."
                    f"{other.__qualname__} and {f.__module__}.{f.__qualname__}); "
                    "give one of them name="
                )
            t = Task(
                self,
                f,
                name=task_name,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                retry=retry,
                timeout=timeout,
                lease=lease,
                retry_on=retry_classes,
                no_retry_on=no_retry_classes,
                key=key,
                unique_for=unique_for,
                on_conflict=on_conflict,
                localns=localns,
                soft_timeout=soft_timeout,
                concurrency_key=concurrency_key,
                concurrency=concurrency,
                rate_limit=rate_limit,
                rate_limit_key=rate_limit_key,
            )
            self.tasks[task_name] = t
            return t

        return register if fn is None else register(fn, depth=2)

    def periodic(
        self,
        cron: str,
        *,
        name: str | None = None,
        timezone: str = "UTC",
        catch_up: CatchUp = "skip",
        grace: float = 60.0,
        kwargs: Mapping[str, Any] | None = None,
    ) -> Callable[[Task[R]], Task[R]]:
        """Defer a task on a cron schedule, once per tick across all workers.

        Stack it on ``@app.task``::

            @app.periodic("0 3 * * *", timezone="Europe/Berlin")
            @app.task(queue="reports")
            def nightly_report() -> None: ...

        ``kwargs`` are the task's arguments for every tick (checked now).  ``name``
        (default: the task's name) identifies the schedule's history; see
        docs/periodic.md for ``catch_up`` and ``grace``.  Workers of this app run the
        schedule (``App.worker``).
        """

        def register(t: Task[R]) -> Task[R]:
            if not isinstance(t, Task) or t.app is not self:
                raise ConfigError("@app.periodic goes above @app.task of the same app")
            payload = t.encode((), kwargs or {})
            spec = Periodic(
                name or t.name,
                cron,
                queue=t.queue,
                payload=payload,
                timezone=timezone,
                catch_up=catch_up,
                grace=grace,
                priority=t.priority,
                max_attempts=t.max_attempts,
                task=t.name,
            )
            if any(p.name == spec.name for p in self.periodic_specs):
                raise ConfigError(f"periodic schedule {spec.name!r} is defined twice")
            self.periodic_specs.append(spec)
            return t

        return register

    def get_task(self, name: str) -> Task[Any]:
        """The task registered under ``name``; ConfigError naming the known ones if none."""
        try:
            return self.tasks[name]
        except KeyError:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise ConfigError(f"unknown task {name!r} (this app's tasks: {known})") from None

    def defer(self, name: str, /, *args: Any, **kwargs: Any) -> int:
        """Defer a task by name (``app.defer("billing.send_invoice", invoice_id=7)``)."""
        return self.get_task(name).defer(*args, **kwargs)

    # -- connections ---------------------------------------------------------------------

    @property
    def queue(self) -> Queue:
        """The app's Queue (on ``dsn``), made on first use (its pool connects then)."""
        if self._queue is None:
            self._queue = Queue(self.dsn, schema=self.schema, **self._queue_options)
        return self._queue

    def dsn_of(self, queue: str) -> str | None:
        """The DSN of the cluster a queue lives on (``dsn`` unless ``queues`` says)."""
        return self._routes.get(queue, self.dsn)

    @property
    def clusters(self) -> list[str | None]:
        """The DSNs of the app's clusters, ``dsn`` first."""
        return [self.dsn, *dict.fromkeys(self._routes.values())]

    def queue_for(self, queue: str) -> Queue:
        """The Queue of the cluster ``queue`` lives on (``app.queue`` for ``dsn``)."""
        where = self._routes.get(queue)
        return self.queue if where is None else self._queue_at(where)

    def _queue_at(self, dsn: str | None) -> Queue:
        if dsn == self.dsn:
            return self.queue
        assert dsn is not None  # every routed queue has a DSN
        with self._qlock:
            q = self._queues.get(dsn)
            if q is None:
                q = self._queues[dsn] = Queue(dsn, schema=self.schema, **self._queue_options)
            return q

    async def async_queue(self, queue: str | None = None) -> AsyncQueue:
        """The AsyncQueue of the app's ``dsn`` (or of the cluster ``queue`` lives on),
        opened on first use in the running event loop."""
        where = None if queue is None else self._routes.get(queue)
        if self._alock is None:
            self._alock = asyncio.Lock()
        if where is None:
            if self._aqueue is None:
                async with self._alock:
                    if self._aqueue is None:
                        q = AsyncQueue(self.dsn, schema=self.schema, **self._queue_options)
                        await q.open()
                        self._aqueue = q
            return self._aqueue
        if where not in self._aqueues:
            async with self._alock:
                if where not in self._aqueues:
                    q = AsyncQueue(where, schema=self.schema, **self._queue_options)
                    await q.open()
                    self._aqueues[where] = q
        return self._aqueues[where]

    def _producer(self, queue: str, conn: Any) -> Queue:
        """The Queue a deferral to ``queue`` writes through; with ``conn`` on an app of
        several clusters, first the check that the connection is on that queue's
        database (one query per connection, then remembered)."""
        q = self.queue_for(queue)
        if conn is not None and self._routes:
            where = self.dsn_of(queue)
            if where not in self._identities:
                with q.connection() as c:
                    self._identities[where] = server_identity(c)
            mine = self._conn_identities.get(conn)
            if mine is None:
                mine = self._conn_identities[conn] = server_identity(conn)
            check_same_database(queue, mine, self._identities[where])
        return q

    async def _aproducer(self, queue: str, conn: Any) -> AsyncQueue:
        q = await self.async_queue(queue)
        if conn is not None and self._routes:
            where = self.dsn_of(queue)
            if where not in self._identities:
                async with q.connection() as c:
                    self._identities[where] = await aserver_identity(c)
            mine = self._conn_identities.get(conn)
            if mine is None:
                mine = self._conn_identities[conn] = await aserver_identity(conn)
            check_same_database(queue, mine, self._identities[where])
        return q

    def migrate(self) -> list[int]:
        """Create or upgrade the schema (idempotent), on every cluster of the app;
        returns the versions applied on ``dsn``'s."""
        for where in self.clusters[1:]:
            self._queue_at(where).migrate()
        return self.queue.migrate()

    def wait(
        self, job_id: int | Workflow, timeout: float | None = None, *, queue: str | None = None
    ) -> Any:
        """The return value of the job's task; JobFailed / JobCancelled if it did not
        succeed, TimeoutError after ``timeout`` seconds.

        A workflow (the handle ``defer`` of a canvas returns, or its id): its result,
        that of its last step, or the list of a group's results; JobFailed or
        JobCancelled naming the step that failed.

        Job ids are per cluster: on an app with ``queues`` on other databases, name the
        job's queue (``queue="reports"``) to wait on its cluster; a Workflow handle
        knows its own."""
        wid = job_id.id if isinstance(job_id, Workflow) else job_id
        if queue is None and isinstance(job_id, Workflow):
            queue = job_id.queue
        q = self.queue if queue is None else self.queue_for(queue)
        try:
            wf = q.workflow(wid)
        except ConfigError:
            # A schema before migration 16 (a rolling deploy) has no workflows, or a
            # role without the grant reads none: a plain id is a job's.
            if isinstance(job_id, Workflow):
                raise
            wf = None
        if wf is None:
            if isinstance(job_id, Workflow):
                raise UnknownJob(wid)
            return q.wait(wid, timeout=timeout)
        return wait_workflow(q, wf, timeout)

    async def wait_async(
        self, job_id: int, timeout: float | None = None, *, queue: str | None = None
    ) -> Any:
        """``wait`` for one job, for asyncio code (``queue``: as for ``wait``)."""
        return await (await self.async_queue(queue)).wait(job_id, timeout=timeout)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        with self._qlock:
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            q.close()

    async def aclose(self) -> None:
        """Close the AsyncQueues (and the Queues, if any were made)."""
        if self._aqueue is not None:
            await self._aqueue.close()
            self._aqueue = None
        aqueues, self._aqueues = list(self._aqueues.values()), {}
        for aq in aqueues:
            await aq.close()
        self.close()

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers -------------------------------------------------------------------------

    def _served(self, queues: Sequence[str] | None) -> tuple[list[str], list[Task[Any]]]:
        if not self.tasks:
            raise ConfigError("this app has no tasks to run")
        names = list(queues) if queues else sorted({t.queue for t in self.tasks.values()})
        served = [t for t in self.tasks.values() if t.queue in names]
        if not served:
            raise ConfigError(
                f"no task of this app uses queue(s) {', '.join(names)}; its queues: "
                + ", ".join(sorted({t.queue for t in self.tasks.values()}))
            )
        return names, served

    def _worker_options(self, served: list[Task[Any]], options: dict[str, Any]) -> None:
        leases = [t.lease for t in served if t.lease is not None]
        if leases and "lease" not in options:
            options["lease"] = max(max(leases), 30.0)
        options.setdefault("periodic", list(self.periodic_specs))
        options["task_timeouts"] = {t.name: t.timeout for t in served if t.timeout}

    def worker(
        self,
        *,
        queues: Sequence[str] | None = None,
        using: Queue | None = None,
        **options: Any,
    ) -> Worker | ClusterWorkers:
        """A ``Worker`` running this app's tasks (all its queues, or ``queues``).

        ``options`` are ``Worker``'s (``concurrency``, ``lease``, ``pool``, ...);
        ``using`` is a Queue whose settings replace the app's ``dsn`` (the CLI's
        ``--dsn``).  Queues on several clusters (``App(queues=...)``) get one Worker
        per cluster, run and stopped as one by the ``ClusterWorkers`` returned.
        The worker claims only the tasks it knows: a job deferred by a newer version
        of the app waits, uncharged, for a worker that knows its task.

        With ``pool="process"`` each child imports the modules of the app's tasks and
        finds the app in one of them (ConfigError if it is not a module-level name
        there); ``async def`` tasks then run in the child with ``asyncio.run``.
        """
        names, served = self._served(queues)
        self._worker_options(served, options)
        # An event loop cannot interrupt a task either: soft limits are the process pool's.
        options["task_soft_timeouts"] = {t.name: t.soft_timeout for t in served if t.soft_timeout}
        groups = self._by_cluster(names)
        if len(groups) > 1 and options.get("health_port") is not None:
            raise ConfigError(
                "a health port answers for one cluster's worker: run one worker per "
                "cluster (queues=...) to give each a health port"
            )
        workers = []
        for where, here in groups.items():
            q = using if using is not None and where == self.dsn else self._queue_at(where)
            opts = dict(options)
            if self._routes:
                # A schedule enqueues to its queue's own cluster, so only its worker runs it.
                opts["periodic"] = [p for p in opts["periodic"] if self.dsn_of(p.queue) == where]
            tasks = sorted(t.name for t in served if t.queue in here)
            handle = TaskHandler(self, tasks, q.settings.dsn, q.schema, results=q)
            workers.append(Worker(q, handle, queues=here, tasks=handle.names, **opts))
        return workers[0] if len(workers) == 1 else ClusterWorkers(workers)

    def _by_cluster(self, names: Sequence[str]) -> dict[str | None, list[str]]:
        """The queues ``names`` grouped by the DSN of their cluster, ``dsn``'s first."""
        groups: dict[str | None, list[str]] = {}
        for name in names:
            groups.setdefault(self.dsn_of(name), []).append(name)
        return dict(sorted(groups.items(), key=lambda kv: kv[0] != self.dsn))

    def import_path(self) -> str:
        """``module:name`` under which this app can be imported: where a process pool's
        children find it.  The CLI's ``--app`` path; else a module-level name bound to
        this app in one of its tasks' modules."""
        if self._import_path is not None:
            return self._import_path
        for module_name in sorted({t.fn.__module__ for t in self.tasks.values()}):
            module = sys.modules.get(module_name)
            for attr, value in vars(module).items() if module is not None else ():
                if value is self:
                    return f"{module_name}:{attr}"
        raise ConfigError(
            "pool='process' needs the app importable by its children: bind it to a "
            "module-level name in the module of one of its tasks (or run it with "
            "skiplock worker --app module:app)"
        )

    def async_worker(self, *, queues: Sequence[str] | None = None, **options: Any) -> AsyncWorker:
        """An ``AsyncWorker`` running this app's tasks on one event loop.

        ``async def`` tasks run as tasks of the loop; ``def`` tasks in a thread each
        (``asyncio.to_thread``), so a blocking call does not stall the loop.
        """
        names, served = self._served(queues)
        groups = self._by_cluster(names)
        if len(groups) > 1:
            raise ConfigError(
                "async_worker serves queues on one cluster; "
                + "; ".join(f"{', '.join(v)} on another" for v in list(groups.values())[1:])
                + ": run one async_worker per cluster (queues=...)"
            )
        (where,) = groups
        if self._routes:
            options["periodic"] = [
                p
                for p in options.get("periodic", self.periodic_specs)
                if self.dsn_of(p.queue) == where
            ]
        self._worker_options(served, options)
        known = {t.name: t for t in served}

        async def handle(job: Job) -> Any:
            task = known[str(job.task)]
            with _trace.span(task.name, job):
                try:
                    extra: dict[str, Any] = {}
                    if needs_parents(job.meta):  # a canvas step: its parents' results
                        q = await self.async_queue(names[0])
                        extra = parent_arg(job.meta, await q.parent_results(job.id))
                    # The worker cancels the attempt at the task's timeout (task_timeouts).
                    if task.is_async:
                        return await task.run(job, extra)
                    return await asyncio.to_thread(task.run, job, extra)
                except BaseException as exc:
                    _reraise(task, exc, job)

        return AsyncWorker(
            self._settings_queue(where), handle, queues=names, tasks=sorted(known), **options
        )

    def _settings_queue(self, dsn: str | None = None) -> AsyncQueue:
        # AsyncWorker takes an AsyncQueue for its settings only and opens its own.
        where = self.dsn if dsn is None else dsn
        return AsyncQueue(where, schema=self.schema, **self._queue_options)


def _exception_classes(
    what: str, given: type[BaseException] | Iterable[type[BaseException]]
) -> tuple[type[BaseException], ...]:
    """``retry_on`` / ``no_retry_on`` as a tuple of Exception classes; ConfigError else."""
    try:
        classes = (given,) if isinstance(given, type) else tuple(given)
    except TypeError:
        raise ConfigError(f"{what} takes Exception classes, not {given!r}") from None
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, Exception)):
            raise ConfigError(f"{what} takes Exception classes, not {c!r}")
        if issubclass(c, Retry | Fail):
            raise ConfigError(
                f"{what} cannot name {c.__name__}: a task that raises it is always obeyed"
            )
    return classes


class TaskHandler:
    """The one handler of an app's Worker: looks each job's task up and runs it.

    A process pool's child gets it by pickle: it travels as the app's import path, the
    modules of its tasks and the task names, and is rebuilt in the child
    (``_task_handler``), which imports the same code the worker did.
    """

    def __init__(
        self,
        app: App,
        names: Sequence[str],
        dsn: str,
        schema: str,
        results: Queue | None = None,
    ) -> None:
        self.app = app
        self.names = list(names)
        self._known = {name: app.tasks[name] for name in names}
        # Where a canvas step reads its parents' results: the worker's Queue in its own
        # process; a process pool's child reaches the same database with a connection
        # of its own, opened once a step needs it.
        self._dsn, self._schema = dsn, schema
        self._results = results
        self._own = False
        self._lock = threading.Lock()

    def _parent_results(self, job: Job) -> list[Any]:
        with self._lock:
            if self._results is None:
                self._results = Queue(self._dsn, schema=self._schema, max_size=2)
                self._own = True
            q = self._results
        return q.parent_results(job.id)

    def __call__(self, job: Job) -> Any:
        task = self._known[str(job.task)]
        with _trace.span(task.name, job):
            try:
                extra: dict[str, Any] = {}
                if needs_parents(job.meta):  # a canvas step: its parents' results
                    extra = parent_arg(job.meta, self._parent_results(job))
                if task.is_async:
                    # A coroutine is cancelled at the task's timeout, for real.
                    return asyncio.run(
                        run_coroutine(functools.partial(task.run, extra=extra), job, task.timeout)
                    )
                return task.run(job, extra)
            except BaseException as exc:
                _reraise(task, exc, job)

    def close(self) -> None:
        if self._own and self._results is not None:
            self._results.close()
            self._results = None

    def __reduce__(self) -> tuple[Any, ...]:
        modules = sorted({t.fn.__module__ for t in self._known.values()})
        args = (self.app.import_path(), modules, self.names, self._dsn, self._schema)
        return (_task_handler, args)


def _task_handler(
    app_path: str, modules: list[str], names: list[str], dsn: str, schema: str
) -> TaskHandler:
    """A TaskHandler rebuilt in a child process from what ``__reduce__`` sent."""
    import importlib

    from ._handlers import load_object

    for module in modules:
        importlib.import_module(module)
    app = load_object(app_path, what="app")
    if not isinstance(app, App):
        raise ConfigError(f"{app_path} is a {type(app).__name__}, not a skiplock.App")
    missing = [n for n in names if n not in app.tasks]
    if missing:
        raise ConfigError(f"the app {app_path} has no task(s) {', '.join(missing)} here")
    return TaskHandler(app, names, dsn, schema)


def _reraise(task: Task[Any], exc: BaseException, job: Job) -> typing.NoReturn:
    new = task.retry_for(exc, job)
    if new is exc:
        raise exc
    raise new from exc
