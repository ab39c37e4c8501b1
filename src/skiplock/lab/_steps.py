"""A two-session step driver, so concurrency bugs are replayed in a chosen order, not hoped for.

Modeled on PostgreSQL's isolation tester (``src/test/isolation``): named sessions, each
owning one connection and one thread; steps run in a session's thread; a step that waits
on a lock is detected from the server's own view of lock waits, ``pg_blocking_pids``,
polled on a separate observer connection.  Nothing here sleeps to synchronise: the
driver waits for a step to finish or to be seen blocked, whichever comes first.

Usage::

    with StepDriver(dsn) as d:
        a, b = d.session("A"), d.session("B")
        a.run("BEGIN")
        ra = a.run(claim_sql, params)             # returns: A holds its rows
        b.run("BEGIN")
        hb = b.start(claim_sql, params)           # runs in B's thread
        d.wait_blocked(hb)                        # ["A"]: B waits on A's row locks
        a.run("COMMIT")
        rb = hb.result(timeout=10)                # B returns after A's commit
        b.run("COMMIT")
        for event in d.events:                    # the timeline, in observed order
            print(event.session, event.step, event.status, event.ids)

* ``Session.start(query, params)`` sends a step and returns a :class:`StepHandle` at
  once; ``Session.run`` sends it and waits, raising :class:`StepBlocked` (with the still
  running handle) if the step blocks instead of returning.
* ``Session.call(fn)`` runs ``fn(connection)`` in the session's thread, for a step that
  is a whole Python routine (a claim transaction with retries, say).
* ``StepDriver.settle(handle)`` waits until the step is done or blocked and says which;
  ``StepDriver.wait_blocked(handle)`` insists on blocked and returns the names of the
  sessions it waits for.
* ``StepHandle.result()`` waits for the step and returns its :class:`StepResult`
  (rows, ``ids``, status message), re-raising the database error if it failed;
  ``StepHandle.outcome()`` returns the result with ``error`` set instead of raising.
* ``StepDriver.events`` is the timeline: one :class:`Event` per observation (a step
  returned, failed, or was seen blocked), in the order the driver saw them.
* :func:`run_permutation` (``_permutations.py``) runs isolation-tester style specs:
  named steps of several sessions in one given order, blocked steps carried along
  until they complete.

The scripted two-session claim lives next door: ``skiplock.lab.replay(dsn, claim)``
(``_replay.py``) takes a strategy name, a :class:`~skiplock.lab.Strategy` or a raw claim
statement (``{schema}.jobs`` is the seeded scratch table), runs "A begins and claims;
B claims; if B is blocked, A commits; B returns" on this driver, and returns a
``Timeline``: the :class:`Event` list plus the ids each session holds::

    t = replay(dsn, "naive")
    t.double_claimed        # [1, 2, 3]
    t.blocked("B")          # True
    print(t.format())

A session's connection is in autocommit mode, so ``BEGIN`` and ``COMMIT`` are steps
like any other, as in a psql window.  Only sessions of this driver count as blockers:
a step waiting on an unrelated backend is not "blocked" in the tester's sense.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal

import psycopg
from psycopg import sql

__all__ = [
    "Event",
    "Query",
    "Session",
    "StepBlocked",
    "StepDriver",
    "StepError",
    "StepHandle",
    "StepNotBlocked",
    "StepResult",
    "StepTimeout",
]

# What a session executes: text, or a statement composed with psycopg.sql.
Query = str | bytes | sql.SQL | sql.Composed
Params = Mapping[str, Any] | Sequence[Any] | None
Settled = Literal["done", "blocked"]

# How long one wait on a step's completion lasts between two looks at pg_blocking_pids.
# The wait ends early the moment the step finishes, so this only bounds how late a
# block is noticed, never how late a completion is.
_POLL = 0.002


class StepError(RuntimeError):
    """The driver could not do what it was asked (not a database error)."""


class StepTimeout(StepError):
    """A step neither finished nor blocked within the timeout."""


class StepBlocked(StepError):
    """``Session.run`` saw its step block; ``handle`` is still running."""

    def __init__(self, handle: StepHandle, blockers: list[str]) -> None:
        super().__init__(
            f"step {handle.label!r} of session {handle.session.name} is blocked by "
            f"{', '.join(blockers) or '?'}"
        )
        self.handle = handle
        self.blockers = blockers


class StepNotBlocked(StepError):
    """``wait_blocked`` expected a block, but the step finished."""

    def __init__(self, result: StepResult) -> None:
        super().__init__(
            f"step {result.label!r} of session {result.session} finished without blocking"
            + (f" (error: {result.error})" if result.error else "")
        )
        self.result = result


@dataclass(frozen=True)
class StepResult:
    """What a finished step returned.

    ``blocked`` says whether the driver saw the step wait on another session before it
    finished; ``value`` is the return value of a ``Session.call`` step.
    """

    session: str
    label: str
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    status: str | None = None
    error: psycopg.Error | None = None
    blocked: bool = False
    elapsed: float = 0.0
    value: Any = None
    # The column holding the job keys, when the step names it (a table keyed by msg_id).
    id_column: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ids(self) -> list[int]:
        """The ``id_column`` of the rows (default: ``id``, else the first), integers only.

        A step that returns something other than job ids (``SELECT pg_advisory_lock``,
        say) has no ids, rather than an error.
        """
        if not self.rows or not self.columns:
            return []
        if self.id_column is not None:
            if self.id_column not in self.columns:
                return []
            col = self.columns.index(self.id_column)
        else:
            col = self.columns.index("id") if "id" in self.columns else 0
        values = [r[col] for r in self.rows]
        return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


@dataclass(frozen=True)
class Event:
    """One entry of a driver's timeline.

    ``status`` is ``"blocked"`` (seen waiting, ``blocked_by`` names the sessions),
    ``"returned"`` or ``"error"`` (``detail`` holds the message, ``sqlstate`` the code).
    """

    seq: int
    session: str
    step: str
    status: Literal["blocked", "returned", "error"]
    ids: tuple[int, ...] = ()
    detail: str = ""
    blocked_by: tuple[str, ...] = ()
    sqlstate: str = ""


class StepHandle:
    """A step sent to a session: poll it, or wait for its result."""

    def __init__(self, session: Session, label: str) -> None:
        self.session = session
        self.label = label
        self._done = threading.Event()
        self._result: StepResult | None = None
        self._exc: BaseException | None = None
        self.blocked = False
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, result: StepResult | None, exc: BaseException | None = None) -> None:
        self._result, self._exc = result, exc
        self._done.set()

    def _wait_done(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    def outcome(self, timeout: float | None = None) -> StepResult:
        """Wait for the step to finish and return its result, database error included.

        Raises
        ------
        StepTimeout
            When it does not finish within ``timeout`` seconds (default: the driver's).
        """
        limit = self.session.driver.timeout if timeout is None else timeout
        if not self._done.wait(limit):
            raise StepTimeout(
                f"step {self.label!r} of session {self.session.name} still running "
                f"after {limit:.1f}s"
            )
        if self._exc is not None:
            raise self._exc
        assert self._result is not None
        if self.blocked and not self._result.blocked:
            # The session thread cannot know; the driver saw it wait.
            self._result = replace(self._result, blocked=True)
        self.session.driver._observed(self, self._result)
        return self._result

    def result(self, timeout: float | None = None) -> StepResult:
        """Like :meth:`outcome`, but re-raise the step's database error, if any."""
        res = self.outcome(timeout)
        if res.error is not None:
            raise res.error
        return res


class Session:
    """A named session: one autocommit connection and the thread that drives it."""

    def __init__(self, driver: StepDriver, name: str, conn: psycopg.Connection[Any]) -> None:
        self.driver = driver
        self.name = name
        self.conn = conn
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.pid: int = int(row[0])
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._current: StepHandle | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"skiplock-step-{name}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    @property
    def busy(self) -> bool:
        """A step of this session is still running (possibly blocked)."""
        return self._current is not None and not self._current.done()

    def _submit(
        self, label: str, body: Callable[[psycopg.Connection[Any]], StepResult]
    ) -> StepHandle:
        if self.busy:
            assert self._current is not None
            raise StepError(
                f"session {self.name} is still running step {self._current.label!r}; "
                "wait for it before sending another"
            )
        handle = StepHandle(self, label)
        self._current = handle

        def task() -> None:
            try:
                handle._finish(body(self.conn))
            except BaseException as exc:  # handed to the waiting thread, not lost here
                handle._finish(None, exc)

        self._tasks.put(task)
        return handle

    def start(
        self,
        query: Query,
        params: Params = None,
        *,
        label: str | None = None,
        id_column: str | None = None,
    ) -> StepHandle:
        """Send one statement to this session's thread; return at once.

        Parameters
        ----------
        query
            SQL text, bytes or a ``psycopg.sql`` composable.
        params
            Its parameters (``%(name)s`` or ``%s`` placeholders).
        label
            The step's name in the timeline; default: the statement's first words.
        id_column
            The result column holding job keys (see :attr:`StepResult.ids`).
        """
        name = label or _label_of(query)
        name_of_session = self.name

        def body(conn: psycopg.Connection[Any]) -> StepResult:
            t0 = time.perf_counter()
            with conn.cursor() as cur:
                try:
                    cur.execute(query, params)
                except psycopg.Error as exc:
                    return StepResult(
                        name_of_session,
                        name,
                        error=exc,
                        elapsed=time.perf_counter() - t0,
                        id_column=id_column,
                    )
                described = cur.description is not None
                return StepResult(
                    name_of_session,
                    name,
                    rows=cur.fetchall() if described else [],
                    columns=[c.name for c in cur.description or ()],
                    status=cur.statusmessage,
                    elapsed=time.perf_counter() - t0,
                    id_column=id_column,
                )

        return self._submit(name, body)

    def call(
        self, fn: Callable[[psycopg.Connection[Any]], Any], *, label: str = "call"
    ) -> StepHandle:
        """Run ``fn(connection)`` in this session's thread as one step.

        Its return value is the result's ``value``; a ``psycopg.Error`` it raises is the
        result's ``error``.  If the value has an ``ids`` attribute, the timeline shows it.
        """
        name_of_session = self.name

        def body(conn: psycopg.Connection[Any]) -> StepResult:
            t0 = time.perf_counter()
            try:
                value = fn(conn)
            except psycopg.Error as exc:
                return StepResult(
                    name_of_session, label, error=exc, elapsed=time.perf_counter() - t0
                )
            ids = list(getattr(value, "ids", []) or [])
            return StepResult(
                name_of_session,
                label,
                rows=[(i,) for i in ids],
                columns=["id"],
                elapsed=time.perf_counter() - t0,
                value=value,
            )

        return self._submit(label, body)

    def run(
        self,
        query: Query,
        params: Params = None,
        *,
        label: str | None = None,
        timeout: float | None = None,
    ) -> StepResult:
        """Send a statement and wait for it, re-raising its database error.

        Raises
        ------
        StepBlocked
            If the step blocks instead of returning; ``exc.handle`` is still running.
        """
        handle = self.start(query, params, label=label)
        if self.driver.settle(handle, timeout) == "blocked":
            raise StepBlocked(handle, self.driver.blocking_sessions(self))
        return handle.result(timeout)

    def close(self) -> None:
        if self.busy:
            # A blocked step would keep the thread (and close()) waiting forever.
            self.conn.cancel_safe()
        self._tasks.put(None)
        self._thread.join(self.driver.timeout)
        self.conn.close()


class StepDriver:
    """Sessions plus an observer connection that watches their lock waits.

    Parameters
    ----------
    dsn
        Where the sessions connect.
    timeout
        Default seconds to wait for a step to finish or block.
    application_name
        Prefix of the sessions' ``application_name`` (``<prefix>:<session>``).
    """

    def __init__(
        self, dsn: str, *, timeout: float = 10.0, application_name: str = "skiplock-steps"
    ) -> None:
        self.dsn = dsn
        self.timeout = timeout
        self.application_name = application_name
        self._observer = psycopg.connect(
            dsn, autocommit=True, application_name=f"{application_name}:observer"[:63]
        )
        self._observer_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self.events: list[Event] = []

    # -- sessions -------------------------------------------------------------------------

    def session(self, name: str) -> Session:
        """Open (or return the existing) session ``name``."""
        if name in self._sessions:
            return self._sessions[name]
        conn = psycopg.connect(
            self.dsn, autocommit=True, application_name=f"{self.application_name}:{name}"[:63]
        )
        s = Session(self, name, conn)
        self._sessions[name] = s
        return s

    @property
    def sessions(self) -> dict[str, Session]:
        return dict(self._sessions)

    # -- watching lock waits ----------------------------------------------------------------

    def blockers(self, session: Session) -> list[int]:
        """Backend pids ``session`` waits for: heavyweight locks or a safe snapshot."""
        with self._observer_lock:
            row = self._observer.execute(
                "SELECT pg_blocking_pids(%(pid)s) || pg_safe_snapshot_blocking_pids(%(pid)s)",
                {"pid": session.pid},
            ).fetchone()
        return list(row[0]) if row and row[0] else []

    def blocking_sessions(self, session: Session) -> list[str]:
        """Names of this driver's sessions that ``session`` waits for."""
        by_pid = {s.pid: s.name for s in self._sessions.values()}
        return sorted({by_pid[p] for p in self.blockers(session) if p in by_pid})

    def settle(self, handle: StepHandle, timeout: float | None = None) -> Settled:
        """Wait until ``handle``'s step finished or is blocked by another session.

        Returns
        -------
        "done" or "blocked"
            A blocked step is also recorded in :attr:`events` (once per block).

        Raises
        ------
        StepTimeout
            Neither happened within ``timeout`` seconds.
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if handle._wait_done(_POLL):
                return "done"
            names = self.blocking_sessions(handle.session)
            # Re-check completion: a step that finished after the look at the lock table
            # was not blocked when we looked, but blocked_by may name a session that has
            # just committed; "done" is the truth.
            if names and not handle.done():
                if not handle.blocked:
                    handle.blocked = True
                    self._record(handle.session.name, handle.label, "blocked", blocked_by=names)
                return "blocked"
            if time.monotonic() > deadline:
                raise StepTimeout(
                    f"step {handle.label!r} of session {handle.session.name} neither "
                    f"finished nor blocked within {limit:.1f}s"
                )

    def wait_blocked(self, target: Session | StepHandle, timeout: float | None = None) -> list[str]:
        """Wait until the step in flight (of a session, or a handle) is seen blocked.

        Returns
        -------
        list[str]
            The sessions it waits for.

        Raises
        ------
        StepNotBlocked
            The step finished instead; ``exc.result`` is its result.
        """
        handle = target if isinstance(target, StepHandle) else target._current
        if handle is None:
            raise StepError(f"session {target.name} has no step in flight")  # type: ignore[union-attr]
        if self.settle(handle, timeout) == "done":
            raise StepNotBlocked(handle.outcome(0))
        return self.blocking_sessions(handle.session)

    def is_blocked(self, session: Session) -> bool:
        """One look: is ``session`` waiting on another session of this driver now?"""
        return session.busy and bool(self.blocking_sessions(session))

    # -- the timeline -------------------------------------------------------------------------

    def _record(
        self,
        session: str,
        step: str,
        status: Literal["blocked", "returned", "error"],
        *,
        ids: Iterable[int] = (),
        detail: str = "",
        blocked_by: Iterable[str] = (),
        sqlstate: str = "",
    ) -> None:
        seq = len(self.events) + 1
        self.events.append(
            Event(seq, session, step, status, tuple(ids), detail, tuple(blocked_by), sqlstate)
        )

    def _observed(self, handle: StepHandle, res: StepResult) -> None:
        # Recorded when the caller first looks at the result: the timeline follows the
        # order in which the script saw things happen, as isolation-tester output does.
        if handle._reported:
            return
        handle._reported = True
        if res.error is not None:
            message = (res.error.diag.message_primary or str(res.error)).strip()
            state = res.error.sqlstate or ""
            self._record(res.session, res.label, "error", detail=message, sqlstate=state)
        else:
            self._record(res.session, res.label, "returned", ids=res.ids, detail=res.status or "")

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close every session (cancelling steps still running) and the observer."""
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
        self._observer.close()

    def __enter__(self) -> StepDriver:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _label_of(query: Query) -> str:
    """A short name for a step: the first words of its statement, comments skipped."""
    if isinstance(query, bytes):
        text = query.decode("utf-8", "replace")
    elif isinstance(query, str):
        text = query
    else:
        try:
            text = query.as_string(None)
        except Exception:  # a composition that needs a live connection to render
            text = "statement"
    code = " ".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))
    words = code.split()
    return " ".join(words[:3]) if words else "empty"
