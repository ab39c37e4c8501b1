"""The pool a ``Worker`` runs handlers in: threads, or child processes with limits.

``pool="thread"`` (the default) runs handlers in threads of the worker's process;
``pool="process"`` in child processes, which a thread cannot match on three counts: a
child can be interrupted at a soft time limit (``SoftTimeLimitExceeded``), killed at the
job's timeout, and retired after so many jobs or so much memory.  This part checks
those options when the worker is made, so that a handler the children cannot import
is refused then and not once per child; says each job's soft limit; and makes the
pool when the worker runs.  Claims, fenced writes and heartbeats stay in the worker,
whichever pool runs the handlers.  ``AsyncWorker`` has no pool: its handlers are tasks
on its event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ._errors import ConfigError
from ._handlers import HandlerPool, Outcome
from ._job import Job
from ._procpool import ProcessPool, check_picklable
from ._woutcomes import WorkerOutcomes

__all__ = ["WorkerPool"]


class WorkerPool(WorkerOutcomes):
    """The handler pool's kind and limits, checked, and the pool made from them."""

    pool: str

    def _init_pool(
        self,
        pool: str,
        soft_timeout: float | None,
        task_soft_timeouts: Mapping[str, float] | None,
        max_tasks_per_child: int | None,
        max_memory_per_child: float | None,
    ) -> None:
        self.pool = pool
        self._soft_timeout = soft_timeout
        self._task_soft_timeouts = dict(task_soft_timeouts or {})
        self._max_tasks_per_child = max_tasks_per_child
        self._max_memory_per_child = max_memory_per_child
        self._check_pool_options()

    def _check_pool_options(self) -> None:
        if self.pool not in ("thread", "process"):
            raise ConfigError(f"pool must be 'thread' or 'process', not {self.pool!r}")
        limits = {
            "soft_timeout": self._soft_timeout,
            "max_tasks_per_child": self._max_tasks_per_child,
            "max_memory_per_child": self._max_memory_per_child,
        }
        for what, value in limits.items():
            if value is None:
                continue
            if self.pool != "process":
                # A thread can be neither interrupted at a soft limit nor retired.
                raise ConfigError(f"{what} needs pool='process'")
            if not value > 0:
                raise ConfigError(f"{what} must be positive, not {value!r}")
        soft = [("the worker", self._soft_timeout, self.job_timeout)] + [
            (f"task {name!r}", t, self._task_timeouts.get(name, self.job_timeout))
            for name, t in self._task_soft_timeouts.items()
        ]
        for who, s, hard in soft:
            if s is not None and not s > 0:
                raise ConfigError(f"{who}: soft timeout must be positive, not {s!r}")
            if s is not None and hard is not None and s >= hard:
                raise ConfigError(
                    f"{who}: soft timeout {s:g}s must be shorter than the timeout {hard:g}s"
                )
        if self.pool == "process":
            check_picklable(self._handlers)  # ConfigError now, not in each child

    def soft_timeout_for(self, job: Job) -> float | None:
        """Seconds after which the job's handler gets SoftTimeLimitExceeded (process pool)."""
        if job.task is not None and job.task in self._task_soft_timeouts:
            return self._task_soft_timeouts[job.task]
        return self._soft_timeout

    def _new_pool(
        self,
        run_one: Callable[[Job], Outcome],
        done: Callable[[Job, Outcome], None],
        wake: Callable[[], None],
    ) -> HandlerPool | ProcessPool:
        """The pool: ``run_one`` runs a job in a thread; a child process runs the
        handler itself.  ``done`` takes each outcome, ``wake`` rouses the claim loop
        when a child's slot frees."""
        if self.pool == "thread":
            return HandlerPool(
                self.concurrency, run_one, done, self.timeout_for, name=f"skiplock-{self.name}"
            )
        mib = self._max_memory_per_child
        return ProcessPool(
            self.concurrency,
            self._handlers,
            lambda job: self._emit("started", job),
            done,
            self.timeout_for,
            self.soft_timeout_for,
            name=f"skiplock-{self.name}",
            max_result_bytes=self._settings.max_result_bytes,
            max_tasks=self._max_tasks_per_child,
            max_memory=None if mib is None else int(mib * 2**20),
            wake=wake,
        )
