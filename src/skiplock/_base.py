"""What Queue and AsyncQueue share: settings, argument checks, and the operations."""

from __future__ import annotations

import json
import random
import select
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg
from psycopg import errors as pgerrors

from . import _control, _ops
from ._config import (
    DEFAULT_SCHEMA,
    RetryPolicy,
    check_dsn,
    redact_dsn,
    resolve_dsn,
    validate_queue,
    validate_schema,
)
from ._embedded import embedded_dsn
from ._errors import ConfigError, DatabaseUnavailable, DuplicateJob, LeaseLost, PayloadError
from ._job import Job, skiplock_adapters
from ._ops import FenceResult, Op
from ._sql import Statements, statements

__all__ = [
    "ConnectionSource",
    "QueueBase",
    "QueueSettings",
    "backoff",
    "reconnect_delay",
    "translate_error",
]

MakeOp = Callable[[bool], Op[Any]]


class ConnectionSource(Protocol):
    """Where a queue borrows connections: its pool, or a worker's own lane."""

    def connection(self, timeout: float | None = None) -> Any: ...

    def close(self) -> Any: ...


@dataclass(frozen=True)
class QueueSettings:
    """Everything a queue object needs besides its connections; cheap to copy."""

    dsn: str = field(repr=False)  # may carry a password; display_dsn is the safe form
    schema: str = DEFAULT_SCHEMA
    application_name: str = "skiplock"
    max_payload_bytes: int = _ops.DEFAULT_MAX_PAYLOAD_BYTES
    max_result_bytes: int = _control.DEFAULT_MAX_RESULT_BYTES
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)
    connect_timeout: float = 10.0
    op_retries: int = 6
    # A worker may turn this off on its own connections: see Worker(synchronous_commit=).
    synchronous_commit: bool = True
    # Behind a transaction pooler (PgBouncer pool_mode=transaction): no session state.
    pooler: bool = False

    @classmethod
    def build(cls, dsn: str | None, **kwargs: Any) -> QueueSettings:
        resolved = resolve_dsn(dsn)
        resolved = check_dsn(resolved) if resolved is not None else embedded_dsn()
        validate_schema(kwargs.get("schema", DEFAULT_SCHEMA))
        limit = kwargs.get("max_payload_bytes", _ops.DEFAULT_MAX_PAYLOAD_BYTES)
        if type(limit) is not int or limit < 1:
            raise ConfigError(f"max_payload_bytes must be a positive integer, not {limit!r}")
        return cls(dsn=resolved, **kwargs)

    @property
    def display_dsn(self) -> str:
        return redact_dsn(self.dsn)

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "context": skiplock_adapters(),
            "application_name": self.application_name[:63],
            "connect_timeout": max(1, int(self.connect_timeout)),
        }
        if self.pooler:
            # Consecutive transactions may run on different server connections: a
            # prepared statement would be missing (or another client's), and PgBouncer
            # refuses the `options` startup parameter.
            kwargs["prepare_threshold"] = None
        elif not self.synchronous_commit:
            kwargs["options"] = "-c synchronous_commit=off"
        return kwargs


def reconnect_delay(failures: int, cap: float = 0.25) -> float:
    """Seconds before connect attempt ``failures + 1``: at once, then 25 ms doubling to
    ``cap``, jittered.  Lanes and queue pools share it, so a producer is back as soon
    as a worker is after the server returns."""
    if failures <= 0:
        return 0.0
    # Bounded exponent, as in backoff: failures keep counting through a long outage.
    return float(min(cap, 0.025 * 2.0 ** min(failures - 1, 60)) * random.uniform(0.5, 1.0))


def backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> float:
    """Sleep before retry ``attempt`` (1-based): short at first, full jitter.

    The exponent is bounded: the worker's loops count failures for as long as an
    outage lasts, and ``base * 2 ** 1024`` is an OverflowError, not a float.  Uncapped,
    a listener (or a lane, or a claim loop) died of it after about 1,000 failed
    reconnects, some 3 minutes of a server down at 0.25 s apart.
    """
    return random.uniform(0, min(cap, base * 2.0 ** min(max(attempt - 1, 0), 60)))


def translate_error(
    exc: Exception, settings: QueueSettings, what: str = "query"
) -> Exception | None:
    """Turn a driver error into skiplock's own, or None if it should propagate as is."""
    if isinstance(
        exc, pgerrors.UndefinedTable | pgerrors.InvalidSchemaName | pgerrors.UndefinedFunction
    ):
        return ConfigError(
            f"skiplock schema {settings.schema!r} is missing or not migrated "
            f"on {settings.display_dsn}; run `skiplock migrate`"
        )
    if isinstance(exc, psycopg.Error) and exc.sqlstate == "SL409":
        # enqueue_keyed (migration 0017): the key's holder, as JSON in the DETAIL.
        held = json.loads(exc.diag.message_detail or "{}")
        return DuplicateJob(
            int(held["job_id"]), held["key"], held["queue"], held["status"], held["reason"]
        )
    if isinstance(exc, pgerrors.InsufficientPrivilege):
        if what == "migrate":
            return ConfigError(
                f"cannot migrate schema {settings.schema!r}: "
                f"{exc.diag.message_primary or exc}; run `skiplock migrate` as the schema's "
                "owner, and start producers and workers that use the roles of "
                "`skiplock roles` with --no-migrate"
            )
        return ConfigError(f"permission denied: {exc.diag.message_primary or exc}")
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def unavailable(exc: BaseException, settings: QueueSettings, what: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"{what}: cannot reach PostgreSQL at {settings.display_dsn}: {_first_line(exc)}"
    )


def is_connection_error(exc: BaseException) -> bool:
    """A broken or unreachable connection, as opposed to an error in the statement."""
    if isinstance(exc, pgerrors.DeadlockDetected | pgerrors.SerializationFailure):
        return True  # transient: the retry is a new transaction
    if isinstance(exc, pgerrors.AdminShutdown | pgerrors.CannotConnectNow | pgerrors.CrashShutdown):
        return True
    return isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, pgerrors.QueryCanceled | pgerrors.LockNotAvailable
    )


def idle_connection_suspect(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """True if a pooled connection may have been closed by the server while idle.

    A backend that is terminated or shut down sends an error before closing, so an
    idle connection with bytes waiting to be read is suspect: only then do the pools'
    checks pay for a round trip.  The hot path costs one zero-timeout select() instead
    of a ping, and a non-idempotent enqueue is not sent down a dead connection.
    """
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("connection is closed")
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return bool(readable)


def _chained(new: BaseException, cause: BaseException | None) -> BaseException:
    """``raise new from cause`` (or ``from None``), prepared for a plain ``raise``."""
    new.__cause__ = cause
    new.__suppress_context__ = True
    return new


def stale_plan(exc: BaseException) -> bool:
    """A prepared statement that returns a whole row, refused since a migration added
    a column ("cached plan must not change result type"): it never runs again on that
    connection, and nothing of it ran."""
    return isinstance(exc, pgerrors.FeatureNotSupported) and (
        "cached plan must not change result type" in str(exc)
    )


def give_up(
    exc: Exception,
    *,
    sent: bool,
    idempotent: bool,
    attempt: int,
    settings: QueueSettings,
    what: str,
) -> BaseException | None:
    """The one retry policy of both drivers: None to retry after ``backoff(attempt)``,
    else the exception to raise.

    ``sent``: the statement may have reached the server (a connection was lent), so a
    non-idempotent operation's outcome is unknown and it must not be repeated blindly.
    ``exc`` is a driver error or the pool's timeout.
    """
    if isinstance(exc, psycopg.Error):
        mapped = translate_error(exc, settings, what)
        if mapped is not None:
            return _chained(mapped, None)
        if isinstance(exc, pgerrors.ReadOnlySqlTransaction):
            # The server refuses writes (default_transaction_read_only, a standby, a
            # disk-full guard): refused before anything was written, so even an enqueue
            # may be sent again, and the error says why rather than a bare driver one.
            if attempt > settings.op_retries:
                return _chained(
                    DatabaseUnavailable(
                        f"{what}: PostgreSQL at {settings.display_dsn} is read-only "
                        f"({_first_line(exc)}); nothing was written"
                    ),
                    exc,
                )
            return None
        if stale_plan(exc) and attempt <= settings.op_retries:
            return None  # refused before it ran; _writable dropped the connection
        if not is_connection_error(exc):
            return exc
        if sent and not idempotent:
            return _chained(
                DatabaseUnavailable(
                    f"{what}: connection lost mid-statement; it may or may not have "
                    "committed (pass an idempotency_key to make a retry safe)"
                ),
                exc,
            )
    if attempt > settings.op_retries:
        return _chained(unavailable(exc, settings, what), None)
    return None


class QueueBase:
    """Argument checks and op construction; subclasses only run the ops."""

    settings: QueueSettings
    _stmts: Statements

    # The generations of jobs (migration 0009, docs/architecture.md): the current one
    # rotates once it took ROTATE_ROWS ids and is ROTATE_AFTER seconds old, or took any
    # and is ROTATE_IDLE seconds old.  ROTATE_ROWS bounds what a held xmin can leave
    # behind: the dead tuples of a generation come from its own jobs only, and a claim
    # from the head walks them (3,000 rather than 10,000 since migration 0013, which adds
    # a generation only at three times these).  Upkeep moves UPKEEP_BATCH jobs a step.
    ROTATE_ROWS = 3_000
    ROTATE_AFTER = 2.0
    ROTATE_IDLE = 3600.0
    UPKEEP_BATCH = 2_000
    # retry_failed retries this many jobs a statement: a short lock on each batch's rows,
    # rather than one statement holding every failed job of a big outage.
    RETRY_BATCH = 500

    def _configure(
        self,
        dsn: str | None,
        *,
        schema: str,
        application_name: str,
        min_size: int,
        max_size: int,
        max_payload_bytes: int,
        retry_policy: RetryPolicy | None,
        connect_timeout: float,
        check_connections: bool,
        pooler: bool = False,
    ) -> None:
        """The constructor arguments Queue and AsyncQueue share, checked once."""
        settings = QueueSettings.build(
            dsn,
            schema=schema,
            application_name=application_name,
            max_payload_bytes=max_payload_bytes,
            retry_policy=retry_policy or RetryPolicy(),
            connect_timeout=connect_timeout,
            pooler=bool(pooler),
        )
        self._init_base(settings)
        self._min_size = min_size
        self._max_size = max(max_size, min_size)
        self._check = check_connections

    def _init_base(self, settings: QueueSettings) -> None:
        self.settings = settings
        self._stmts = statements(settings.schema)
        self._counter_lock = threading.Lock()
        self._lease_lost = 0
        # Job ids reserved by unkeyed enqueues for the next ones (see _ops.enqueue_one);
        # list.pop and append are atomic, so callers on many threads may share it.
        self._spare_ids: list[tuple[int, float]] = []

    @property
    def schema(self) -> str:
        return self.settings.schema

    @property
    def lease_lost_count(self) -> int:
        """How many fenced writes this object saw rejected (stale lease token)."""
        return self._lease_lost

    def _count_lost(self, n: int) -> None:
        if n:
            with self._counter_lock:
                self._lease_lost += n

    # -- op builders: each returns f(after_disconnect) -> generator ----------------------

    def _enqueue_op(
        self,
        payload: Any,
        queue: str,
        priority: int,
        run_at: datetime | None,
        max_attempts: int,
        idempotency_key: str | None,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
        retryable: bool = True,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        concurrency_key: str | None = None,
        concurrency: int | None = None,
        rate_key: str | None = None,
        rate_every: float | None = None,
    ) -> MakeOp:
        """One job.  ``retryable``: the driver may send it again after a lost reply.

        It goes under an id reserved beforehand (by the previous enqueue's insert, so no
        extra round trip; ``_ops.enqueue_one``), so a retry can tell whether the lost
        attempt committed; in the caller's transaction (``retryable=False``) nothing is
        repeated, and an unkeyed job takes the plain insert.  A keyed one goes through
        ``enqueue_keyed`` (migration 0017), which decides what a held key gets.
        """
        _check_enqueue_options(queue, priority, run_at, max_attempts)
        _check_concurrency(concurrency_key, concurrency)
        _check_rate(rate_key, rate_every)
        text = _ops.encode_payload(payload, self.settings.max_payload_bytes)
        meta_text = _meta_text(task, meta)
        row: dict[str, Any] = {
            "queue": queue,
            "payload": text,
            "priority": int(priority),
            "run_at": run_at,
            "max_attempts": max_attempts,
            "task": task,
            "meta": meta_text,
            "concurrency_key": concurrency_key,
            "concurrency": concurrency,
            "rate_key": rate_key,
            "rate_every": None if rate_every is None else float(rate_every),
        }
        held = _ops.Reserved()
        spares = self._spare_ids
        if idempotency_key is None:
            if unique_for is not None or on_conflict != "return":
                raise ConfigError("unique_for and on_conflict need an idempotency key")
            if retryable:
                return lambda after: _ops.enqueue_one(
                    self._stmts, **row, reserved=held, spares=spares, retry=after
                )
            return lambda _after: _ops.enqueue(self._stmts, **row)
        if concurrency_key is not None:
            raise ValueError(_KEYS_TOGETHER)
        if rate_key is not None:
            raise ValueError(_RATE_TOGETHER)
        del row["concurrency_key"], row["concurrency"], row["rate_key"], row["rate_every"]
        _check_key(idempotency_key)
        seconds = check_unique(unique_for, on_conflict)
        payloads = [row.pop("payload")]

        def keyed(after: bool) -> Op[int]:
            ids = yield from _ops.enqueue_keyed(
                self._stmts,
                **row,
                payloads=payloads,
                keys=[idempotency_key],
                unique_for=seconds,
                on_conflict=on_conflict,
                reserved=held,
                spares=spares,
                retry=after,
            )
            return ids[0]

        return keyed

    def _enqueue_many_op(
        self,
        payloads: Sequence[Any],
        queue: str,
        priority: int,
        run_at: datetime | None,
        max_attempts: int,
        idempotency_keys: Sequence[str | None] | None,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        concurrency_key: str | Sequence[str | None] | None = None,
        concurrency: int | None = None,
        rate_key: str | Sequence[str | None] | None = None,
        rate_every: float | None = None,
    ) -> MakeOp:
        """Many jobs; the ids reserved by the first attempt are kept for the retries.

        ``concurrency_key``, ``rate_key``: one key for every job, or one (or None) per job.
        """
        _check_enqueue_options(queue, priority, run_at, max_attempts)
        ckeys = _per_job(
            "concurrency", concurrency_key, len(payloads), concurrency, _check_concurrency
        )
        if ckeys is not None and idempotency_keys is not None:
            raise ValueError(_KEYS_TOGETHER)
        rkeys = _per_job("rate", rate_key, len(payloads), rate_every, _check_rate)
        if rkeys is not None and idempotency_keys is not None:
            raise ValueError(_RATE_TOGETHER)
        self._spare_ids.clear()  # ids follow the enqueues: a later one takes newer ids
        meta_text = _meta_text(task, meta)
        limit = self.settings.max_payload_bytes
        # Encode everything first: one bad payload rejects the batch before any I/O.
        texts = []
        for n, p in enumerate(payloads):
            try:
                texts.append(_ops.encode_payload(p, limit))
            except PayloadError as exc:
                raise PayloadError(f"payload #{n}: {exc}") from None
        keyed = False
        if idempotency_keys is not None:
            for k in idempotency_keys:
                if k is not None:
                    _check_key(k)
                    keyed = True
        if not keyed and (unique_for is not None or on_conflict != "return"):
            raise ConfigError("unique_for and on_conflict need idempotency keys")
        seconds = check_unique(unique_for, on_conflict)
        keys = list(idempotency_keys) if idempotency_keys is not None else None
        held = _ops.Reserved()
        return lambda after: _ops.enqueue_many(
            self._stmts,
            queue=queue,
            payloads=texts,
            priority=int(priority),
            run_at=run_at,
            max_attempts=max_attempts,
            keys=keys,
            task=task,
            meta=meta_text,
            reserved=held,
            retry=after,
            unique_for=seconds,
            on_conflict=on_conflict,
            concurrency_keys=ckeys,
            concurrency=concurrency,
            rate_keys=rkeys,
            rate_every=None if rate_every is None else float(rate_every),
        )

    def _graph_op(
        self, rows: Sequence[_ops.GraphRow], edges: Sequence[_ops.Edge], output: Any = None
    ) -> MakeOp:
        """Jobs with dependencies (``_ops.enqueue_graph``); ids reserved once, kept for
        the retries."""
        self._spare_ids.clear()  # as for enqueue_many: ids follow the enqueues
        held = _ops.Reserved()
        return lambda after: _ops.enqueue_graph(
            self._stmts, rows=rows, edges=edges, reserved=held, retry=after, output=output
        )

    def _workflow_op(self, workflow_id: int) -> MakeOp:
        _check_job_id(workflow_id)
        return lambda _after: _workflow(self._stmts, workflow_id)

    def _after_op(
        self,
        payloads: Sequence[Any],
        queue: str,
        priority: int,
        run_at: datetime | None,
        max_attempts: int,
        task: str | None,
        meta: Mapping[str, Any] | None,
        after: Sequence[int],
        on_parent_failure: str,
    ) -> MakeOp:
        """Every job of ``payloads`` waits for every job of ``after``."""
        _check_enqueue_options(queue, priority, run_at, max_attempts)
        parents = check_after(after)
        cancel = check_on_parent_failure(on_parent_failure)
        meta_text = _meta_text(task, meta)
        limit = self.settings.max_payload_bytes
        rows = []
        for n, p in enumerate(payloads):
            try:
                text = _ops.encode_payload(p, limit)
            except PayloadError as exc:
                raise PayloadError(
                    f"payload #{n}: {exc}" if len(payloads) > 1 else str(exc)
                ) from None
            rows.append(
                _ops.GraphRow(queue, text, int(priority), run_at, max_attempts, task, meta_text)
            )
        edges = [
            _ops.Edge(parent, child, pos, cancel)
            for child in range(len(rows))
            for pos, parent in enumerate(parents)
        ]
        return self._graph_op(rows, edges)

    def _parents_op(self, job_id: int) -> MakeOp:
        _check_job_id(job_id)
        return lambda _after: _parents(self._stmts, job_id)

    def _claim_op(
        self,
        worker: str,
        queue: str,
        limit: int,
        lease: float,
        own_transaction: bool = True,
        start: _ops.ClaimPosition | None = None,
        tasks: Sequence[str] | None = None,
    ) -> MakeOp:
        validate_queue(queue)
        names = None if tasks is None else [check_task_name(t) for t in tasks]
        if not isinstance(worker, str) or not worker or len(worker) > 200 or "\x00" in worker:
            raise ConfigError(
                "worker name must be a non-empty string of at most 200 characters, without NUL"
            )
        if limit < 1:
            raise ValueError("limit must be at least 1")
        _check_lease(lease)
        return lambda _after: _ops.claim(
            self._stmts,
            worker=worker,
            queue=queue,
            limit=int(limit),
            lease=float(lease),
            own_transaction=own_transaction,
            start=start,
            tasks=names,
        )

    def _fenced_op(
        self,
        action: str,
        jobs: Sequence[Job],
        params: dict[str, Any] | None = None,
        recheck: bool = False,
    ) -> MakeOp:
        # recheck: the caller repeats a write whose earlier call failed (outcome unknown).
        return lambda after: _ops.fenced(
            self._stmts, action, jobs, params, recheck=after or recheck
        )

    def _fail_params(
        self, items: Sequence[tuple[Job, str | None, float | None, bool]]
    ) -> dict[str, Any]:
        policy = self.settings.retry_policy
        return {
            # Handler text: text columns cannot hold NUL, and a write that fails on it
            # would be retried forever while heartbeats keep the job running.
            "errors": [None if e is None else e.replace("\x00", "\\x00") for _, e, _, _ in items],
            "delays": [
                _clamp_delay(policy.delay(j.attempts) if d is None else float(d))
                for j, _, d, _ in items
            ],
            "retries": [bool(r) for _, _, _, r in items],
        }

    def _complete_params(
        self, items: Sequence[Job | tuple[Job, Any]]
    ) -> tuple[list[Job], dict[str, Any]]:
        """Jobs and their results (JSON text, checked before any write) for `complete`."""
        jobs: list[Job] = []
        results: list[str | None] = []
        for item in items:
            job, value = (item, None) if isinstance(item, Job) else item
            jobs.append(job)
            results.append(
                _control.encode_result(value, self.settings.max_result_bytes)
                if job.store_result
                else None
            )
        return jobs, {"results": results}

    def _raise_if_lost(self, result: FenceResult, action: str) -> None:
        self._count_lost(len(result.lost))
        if result.lost:
            raise LeaseLost(result.lost, action)

    def _sweep_op(self, limit: int, window: float | None = None) -> MakeOp:
        if window is not None:
            _check_window(window)
        params = {"limit": limit, "window": window}
        return lambda _after: _single(self._stmts.sweep, params)

    def _prune_op(self, older_than: float) -> MakeOp:
        params = {"older_than": float(older_than)}
        return lambda _after: _count_rows(self._stmts.prune, params)

    def _upkeep_op(self) -> MakeOp:
        params = {
            "rotate_rows": self.ROTATE_ROWS,
            "rotate_after": self.ROTATE_AFTER,
            "rotate_idle": self.ROTATE_IDLE,
            "batch": self.UPKEEP_BATCH,
        }
        return lambda _after: _single(self._stmts.upkeep, params)

    def _status_op(self, attempts_alert: int) -> MakeOp:
        return lambda _after: _single(self._stmts.status, {"attempts_alert": attempts_alert})

    def _unserved_op(self, alive: float) -> MakeOp:
        return lambda _after: _single(self._stmts.unserved, {"alive": float(alive)})

    def _worker_seen_op(
        self, name: str, queues: Sequence[str], tasks: Sequence[str] | None
    ) -> MakeOp:
        params = {
            "name": name,
            "queues": list(queues),
            "tasks": None if tasks is None else list(tasks),
        }
        return lambda _after: _single(self._stmts.worker_seen, params)

    def _worker_waiting_op(self, name: str, waiting: bool) -> MakeOp:
        params = {"name": name, "waiting": waiting}
        return lambda _after: _single(self._stmts.worker_waiting, params)

    def _worker_gone_op(self, name: str) -> MakeOp:
        return lambda _after: _single(self._stmts.worker_gone, {"name": name})

    def _get_op(self, job_id: int) -> MakeOp:
        return lambda _after: _get(self._stmts, job_id)

    def _cancel_op(self, job_id: int) -> MakeOp:
        _check_job_id(job_id)
        return lambda _after: _control.cancel(self._stmts, job_id)

    def _pause_op(self, queue: str, paused: bool) -> MakeOp:
        validate_queue(queue)
        return lambda _after: _control.set_paused(self._stmts, queue, paused)

    def _configure_op(
        self,
        queue: str,
        concurrency_limit: int | None,
        rate_limit: float | None,
        rate_burst: float | None,
        store_results: bool | None,
        clear_concurrency: bool,
        clear_rate: bool,
        create: bool = True,
    ) -> MakeOp:
        validate_queue(queue)
        _control.check_limits(concurrency_limit, rate_limit, rate_burst)
        op_args: dict[str, Any] = {
            "concurrency_limit": concurrency_limit,
            "rate_limit": rate_limit,
            "rate_burst": rate_burst,
            "store_results": store_results,
            "clear_concurrency": clear_concurrency,
            "clear_rate": clear_rate,
            "create": create,
        }
        return lambda _after: _control.configure(self._stmts, queue, **op_args)

    def _requeue_op(self, job_id: int) -> MakeOp:
        _check_job_id(job_id)
        return lambda _after: _control.requeue(self._stmts, job_id)

    def _find_jobs_op(
        self,
        status: str | Sequence[str] | None,
        queue: str | None,
        task: str | None,
        since: datetime | timedelta | None,
        error: str | None,
        limit: int,
        before_id: int | None,
    ) -> MakeOp:
        if isinstance(status, str):
            status = [status]
        if status is not None:
            for s in status:
                _check_status(s)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be an integer from 1 to 10000, not {limit!r}")
        if before_id is not None:
            _check_job_id(before_id)
        if error is not None and (not isinstance(error, str) or not error or "\x00" in error):
            raise ValueError(f"error must be a non-empty string without NUL, not {error!r}")
        params = {
            **_filters(queue, task, since),
            "statuses": None if status is None else list(status),
            "error": error,
            "limit": limit,
            "before": before_id,
        }
        return lambda _after: _control.find_jobs(self._stmts, params)

    def _retry_jobs_op(self, job_ids: Sequence[int]) -> MakeOp:
        if isinstance(job_ids, int | str):
            raise ValueError(f"job ids must be a sequence of ids, not {job_ids!r}")
        ids = list(job_ids)
        for job_id in ids:
            _check_job_id(job_id)
        progress = _control.RetryProgress()
        return lambda _after: _control.retry_jobs(self._stmts, ids, progress)

    def _retry_failed_op(
        self, queue: str | None, task: str | None, since: datetime | timedelta | None
    ) -> MakeOp:
        filters = _filters(queue, task, since)
        progress = _control.RetryProgress()
        batch = self.RETRY_BATCH
        return lambda _after: _control.retry_failed(self._stmts, filters, progress, batch)

    def _delete_op(self, job_id: int) -> MakeOp:
        _check_job_id(job_id)
        return lambda _after: _control.delete(self._stmts, job_id)

    def _list_jobs_op(
        self, queue: str | None, status: str | None, limit: int, before_id: int | None
    ) -> MakeOp:
        if queue is not None:
            validate_queue(queue)
        if status is not None and status not in _control.STATUSES:
            raise ValueError(
                f"unknown status {status!r}; one of {', '.join(sorted(_control.STATUSES))}"
            )
        if not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be from 1 to 10000, not {limit!r}")
        params = {"queue": queue, "status": status, "limit": limit, "before": before_id}
        return lambda _after: _single(self._stmts.list_jobs, params)

    def _throughput_op(self, window: float, bucket: float) -> MakeOp:
        if not 0 < bucket <= window:
            raise ValueError("bucket must be positive and at most the window")
        params = {"window": float(window), "bucket": float(bucket)}
        return lambda _after: _single(self._stmts.throughput, params)

    def _queues_op(self) -> MakeOp:
        return lambda _after: _control.queue_configs(self._stmts)

    def _watch_op(self, job_id: int, register: bool) -> MakeOp:
        _check_job_id(job_id)
        return lambda _after: _control.watch(self._stmts, job_id, register)


# Longest lease or retry delay: now() plus this stays far inside timestamptz's range.
MAX_DELAY_SECONDS = 100 * 365 * 86400.0
_INT4_MAX = 2**31 - 1


def check_task_name(name: str) -> str:
    """A task name as the jobs table stores it: non-empty text of at most 200 characters."""
    if not isinstance(name, str) or not name or len(name) > 200 or "\x00" in name:
        raise ConfigError(
            f"task name must be a non-empty string of at most 200 characters, not {name!r}"
        )
    return name


def _meta_text(task: str | None, meta: Mapping[str, Any] | None) -> str | None:
    if task is not None:
        check_task_name(task)
    if not meta:
        return None
    try:
        return _ops.encode_payload(dict(meta), 64 * 1024)
    except PayloadError as exc:
        raise PayloadError(f"job meta: {exc}") from None


ON_CONFLICT = ("return", "replace", "raise")


def check_unique(unique_for: float | timedelta | None, on_conflict: str) -> float | None:
    """``unique_for`` in seconds (None: for as long as the job is kept), checked with
    ``on_conflict``; ConfigError in one line otherwise."""
    if on_conflict not in ON_CONFLICT:
        raise ConfigError(
            f"on_conflict must be one of {', '.join(map(repr, ON_CONFLICT))}, not {on_conflict!r}"
        )
    if unique_for is None:
        return None
    if isinstance(unique_for, timedelta):
        seconds = unique_for.total_seconds()
    elif type(unique_for) in (int, float):
        seconds = float(unique_for)
    else:
        raise ConfigError(
            f"unique_for must be seconds or a timedelta (or None), not {unique_for!r:.40}"
        )
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"unique_for must be zero or more seconds, not {unique_for!r:.40}")
    return seconds


def check_after(after: Sequence[int]) -> list[int]:
    """The ids of ``after=``: job ids, each named once."""
    if isinstance(after, str | bytes) or not isinstance(after, Sequence):
        raise ValueError(f"after must be a sequence of job ids, not {after!r:.40}")
    out: list[int] = []
    for p in after:
        if type(p) is not int or p < 1:
            raise ValueError(f"after must hold job ids (positive integers), not {p!r:.40}")
        if p in out:
            raise ValueError(f"after names job {p} twice")
        out.append(p)
    return out


def check_on_parent_failure(value: str) -> bool:
    """True: a failed or cancelled parent cancels the child ("cancel"); "run": it runs."""
    if value not in ("cancel", "run"):
        raise ValueError(f'on_parent_failure must be "cancel" or "run", not {value!r:.40}')
    return value == "cancel"


def _check_enqueue_options(
    queue: str, priority: int, run_at: datetime | None, max_attempts: int
) -> None:
    """What enqueue and enqueue_many check before anything is encoded or sent."""
    validate_queue(queue)
    _check_attempts(max_attempts)
    _check_priority(priority)
    check_run_at(run_at)


# Not yet: the unique-key path (migration 0017) inserts through statements of its own.
_KEYS_TOGETHER = "concurrency_key cannot be combined with an idempotency key (not built yet)"


_RATE_TOGETHER = "a rate limit cannot be combined with an idempotency key (not built yet)"


def _per_job(
    what: str,
    key: str | Sequence[str | None] | None,
    n: int,
    limit: Any,
    check: Callable[[str | None, Any], None],
) -> list[str | None] | None:
    """A batch's concurrency or rate keys, one per job: ``key`` for every job, or one
    (or None) each; each key checked with its limit by ``check``."""
    if key is None or isinstance(key, str):
        check(key, limit)
        return None if key is None else [key] * n
    keys = list(key)
    if len(keys) != n:
        raise ValueError(f"{n} payloads but {len(keys)} {what} keys")
    for k in keys:
        if k is not None:
            check(k, limit)
    return keys


def _check_rate(key: str | None, every: float | None) -> None:
    """A rate key and its interval come together (migration 0020)."""
    if key is None:
        if every is not None:
            raise ValueError("rate_every needs a rate_key to count jobs by")
        return
    if not isinstance(key, str) or not key or len(key) > 500 or "\x00" in key:
        raise ValueError(
            f"rate_key must be a non-empty string of at most 500 characters, "
            f"without NUL, not {key!r:.40}"
        )
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every < 10**9:
        raise ValueError(
            f"rate_every (seconds between two jobs of a key) must be a positive number, "
            f"not {every!r:.40}"
        )


def _check_concurrency(key: str | None, concurrency: int | None) -> None:
    """A concurrency key and its limit come together (migration 0018)."""
    if key is None:
        if concurrency is not None:
            raise ValueError("concurrency needs a concurrency_key to count jobs by")
        return
    if not isinstance(key, str) or not key or len(key) > 500 or "\x00" in key:
        raise ValueError(
            f"concurrency_key must be a non-empty string of at most 500 characters, "
            f"without NUL, not {key!r:.40}"
        )
    if type(concurrency) is not int or not 1 <= concurrency <= _INT4_MAX:
        raise ValueError(
            f"concurrency (jobs of one key running at once) must be an integer from 1 to "
            f"{_INT4_MAX}, not {concurrency!r:.40}"
        )


def _check_attempts(max_attempts: int) -> None:
    # type() and not isinstance(): True is an int to Python, not an attempt count.
    if type(max_attempts) is not int or not 1 <= max_attempts <= _INT4_MAX:
        raise ValueError(
            f"max_attempts must be an integer from 1 to {_INT4_MAX}, not {max_attempts!r:.40}"
        )


def _check_priority(priority: int) -> None:
    if type(priority) is not int or not -_INT4_MAX - 1 <= priority <= _INT4_MAX:
        raise ValueError(
            f"priority must be an integer from {-_INT4_MAX - 1} to {_INT4_MAX}, "
            f"not {priority!r:.40}"
        )


def check_run_at(run_at: datetime | None) -> None:
    """ValueError for a run_at that is not an aware datetime (or None).

    A naive datetime is refused, not read as UTC or as local time: either guess is
    hours off for someone, and the job would run at once or hours late.
    """
    if run_at is None:
        return
    if not isinstance(run_at, datetime):
        raise ValueError(f"run_at must be a datetime or None, not {run_at!r:.40}")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise ValueError(
            f"run_at {run_at.isoformat()} has no timezone; pass an aware datetime, "
            "such as datetime.now(UTC) + timedelta(hours=1) or dt.replace(tzinfo=...)"
        )


def _check_status(status: str) -> None:
    if status not in _control.STATUSES:
        raise ValueError(
            f"unknown status {status!r}; one of {', '.join(sorted(_control.STATUSES))}"
        )


def _filters(
    queue: str | None, task: str | None, since: datetime | timedelta | None
) -> dict[str, Any]:
    """The queue, task and since filters of find_jobs and retry_failed, checked."""
    if queue is not None:
        validate_queue(queue)
    if task is not None:
        check_task_name(task)
    if isinstance(since, timedelta):
        if since < timedelta(0):
            raise ValueError(f"since must not be a negative timedelta, not {since!r}")
        # From this machine's clock, as a delay is: close enough for "the last hour".
        since_param: Any = datetime.now(UTC) - since
    elif since is None or isinstance(since, datetime):
        if since is not None and (since.tzinfo is None or since.utcoffset() is None):
            raise ValueError(
                f"since {since.isoformat()} has no timezone; pass an aware datetime "
                "or a timedelta (that long ago)"
            )
        since_param = since
    else:
        raise ValueError(f"since must be a datetime, a timedelta or None, not {since!r:.40}")
    return {"queue": queue, "task": task, "since": since_param}


def _check_lease(lease: float) -> None:
    # `not 0 < x` also refuses NaN.
    if not 0 < lease <= MAX_DELAY_SECONDS:
        raise ValueError("lease must be a positive, finite number of seconds (at most 100 years)")


def _check_window(window: float) -> None:
    # `not 0 <= x` also refuses NaN; the cap keeps now() - window inside timestamptz.
    if not 0 <= window <= MAX_DELAY_SECONDS:
        raise ValueError(
            f"sweep window must be a finite number of seconds >= 0 (at most 100 years), "
            f"not {window!r}"
        )


def _clamp_delay(delay: float) -> float:
    """A retry delay the database can add to now(): NaN and negatives are 0, inf is 100y."""
    return min(delay, MAX_DELAY_SECONDS) if delay > 0 else 0.0


def _check_job_id(job_id: int) -> None:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id < 2**63:
        raise ValueError(f"job id must be a positive integer, not {job_id!r}")


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > 512 or "\x00" in key:
        raise ConfigError(
            "idempotency key must be a non-empty string of at most 512 characters, without NUL"
        )


def _single(query: Any, params: dict[str, Any]) -> Op[list[dict[str, Any]]]:
    rows = yield _ops.Execute(query, params)
    return rows


def _count_rows(query: Any, params: dict[str, Any]) -> Op[int]:
    rows = yield _ops.Execute(query, params)
    return int(rows[0]["n"])


def _workflow(stmts: Statements, workflow_id: int) -> Op[dict[str, Any] | None]:
    rows = yield _ops.Execute(stmts.workflow, {"id": workflow_id})
    if not rows:
        return None
    steps = [
        {k: r[k] for k in ("id", "task", "status", "attempts", "max_attempts", "last_error")}
        for r in rows
    ]
    first = rows[0]
    return {
        "id": int(first["workflow"]),
        "output": first["output"],
        "created_at": first["created_at"],
        "steps": steps,
    }


def _parents(stmts: Statements, job_id: int) -> Op[list[dict[str, Any]]]:
    rows = yield _ops.Execute(stmts.parents, {"id": job_id})
    return [dict(r) for r in rows]


def _get(stmts: Statements, job_id: int) -> Op[Job | None]:
    rows = yield _ops.Execute(stmts.get, {"id": job_id})
    return Job.from_row(rows[0]) if rows else None
