"""WorkerBase: the parts of a worker put together, and the checks of its arguments.

``Worker`` (threads) and ``AsyncWorker`` (tasks) differ only in how they wait and send
the queue's statements; what they decide is here, one part per responsibility:

- ``_wclaims``: the claim chain (what to claim, how much, from where, for which chain);
- ``_woutcomes``: handler outcomes, the fenced writes that carry them, and what each
  answer meant (counters, events, one log line per attempt);
- ``_wheartbeat``: the heartbeat's interval and what its answer meant;
- ``_wliveness``: the worker's row, its ``waiting`` flag and its session mark;
- ``_wupkeep``: when to sweep and prune, and the pace of the generations' upkeep;
- ``_wshutdown``: stop, signals, and what the grace could not save;
- ``_wcore``: the state they share (name, settings, counters, hooks).

The sync worker is written beside the async one, not generated from it as ``Queue`` is
(docs/decisions/0018-worker-written-not-generated.md).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ._base import QueueBase
from ._config import validate_queue
from ._errors import ConfigError
from ._handlers import Handler
from ._health import DEFAULT_HOST, DEFAULT_STALL, HealthServer, Steps
from ._periodic import Periodic, check_periodic
from ._wclaims import WorkerClaims
from ._wcore import Event, Measure, WorkerStats, default_worker_name
from ._wheartbeat import WorkerHeartbeat
from ._wliveness import WorkerLiveness
from ._woutcomes import WorkerOutcomes
from ._wshutdown import WorkerShutdown
from ._wupkeep import WorkerUpkeep

__all__ = ["WorkerBase"]


class WorkerBase(
    WorkerClaims,
    WorkerOutcomes,
    WorkerHeartbeat,
    WorkerLiveness,
    WorkerUpkeep,
    WorkerShutdown,
):
    """A worker's parts, its arguments checked, and its health endpoints."""

    def __init__(
        self,
        queue: QueueBase,
        handler: Handler | Mapping[str, Handler],
        *,
        queues: Sequence[str] | None,
        concurrency: int,
        lease: float,
        heartbeat_interval: float | None,
        name: str | None,
        poll_interval: float,
        sweep_interval: float,
        job_timeout: float | None,
        listen: bool,
        shutdown_grace: float,
        on_event: Event | None,
        on_measure: Measure | None,
        retention: float | None,
        prune_interval: float,
        synchronous_commit: bool,
        periodic: Sequence[Periodic] = (),
        tasks: Sequence[str] | None = None,
        task_timeouts: Mapping[str, float] | None = None,
        liveness: bool = True,
        fuse_claims: bool = True,
        health_port: int | None = None,
        health_host: str = DEFAULT_HOST,
        health_stall: float = DEFAULT_STALL,
    ) -> None:
        if isinstance(handler, Mapping):
            self._handlers = dict(handler)
            names = list(queues) if queues is not None else list(self._handlers)
        else:
            names = list(queues) if queues is not None else ["default"]
            self._handlers = dict.fromkeys(names, handler)
        if not names:
            raise ConfigError("a worker needs at least one queue")
        for q in names:
            validate_queue(q)
            if q not in self._handlers:
                raise ConfigError(f"no handler for queue {q!r}")
        if concurrency < 1:
            raise ConfigError("concurrency must be at least 1")
        if not lease > 0:
            raise ConfigError("lease must be positive")
        self.queues = names
        self.concurrency = concurrency
        self.lease = float(lease)
        self._init_heartbeat(heartbeat_interval)
        self._init_outcomes(job_timeout, task_timeouts)
        self._init_health(health_port, health_host, health_stall)
        self.periodic = check_periodic(periodic)
        # The tasks this worker can run (None: every job of its queues).  Its claims take
        # only those, so a job of a task it does not know waits for a worker that does.
        self.tasks = None if tasks is None else sorted(set(tasks))
        if self.tasks is not None and not self.tasks:
            raise ConfigError("a worker of tasks needs at least one task")
        self.name = name or default_worker_name()
        self.poll_interval = poll_interval
        self._init_liveness(listen, liveness, queue.settings.pooler)
        self._init_claims()
        self._init_upkeep(sweep_interval, retention, prune_interval)
        self.shutdown_grace = shutdown_grace
        # The writer completes a batch and claims the slots it frees in one transaction
        # (``_fused_round``, the queue's ``_complete_and_claim``).
        self.fuse_claims = fuse_claims
        self.stats = WorkerStats()
        self._on_event = on_event
        self._on_measure = on_measure
        self._settings = replace(
            queue.settings,
            application_name=f"skiplock-worker:{self.name}",
            op_retries=2,
            synchronous_commit=synchronous_commit,
        )

    # -- health: /livez and /readyz (_health.py) ----------------------------------------

    def _init_health(self, port: int | None, host: str, stall: float) -> None:
        if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
            raise ConfigError(f"health_port must be a port number (0-65535), not {port!r}")
        if not stall > 0:
            raise ConfigError(f"health_stall must be positive, not {stall!r}")
        self.health_port = port
        self.health_host = host
        self.health_stall = float(stall)
        # A socket already listening to serve health on (a --processes child's, made by
        # the supervisor), instead of binding health_host:health_port.
        self._health_socket: socket.socket | None = None
        self.health: HealthServer | None = None  # while run() runs with a health_port
        # The step each loop is in, for /livez; each worker names its loops (_watch).
        self._steps = Steps(())

    CLAIM_LOOP, HEARTBEAT, MARK = "claim loop", "heartbeat", "liveness mark"

    @staticmethod
    def _writer_loop_name(index: int) -> str:
        return "writer" if index == 0 else f"writer {index}"

    def _watch(self, chains: int, heartbeat: bool) -> None:
        """Name the loops whose steps /livez watches: the claim loop, a writer per chain,
        the heartbeat (its own loop in Worker, the first writer's in AsyncWorker) and
        the liveness mark."""
        loops = [self.CLAIM_LOOP, *(self._writer_loop_name(i) for i in range(chains))]
        if heartbeat:
            loops.append(self.HEARTBEAT)
        self._steps = Steps([*loops, self.MARK])

    def _stuck(self, now: float) -> dict[str, float]:
        """The loops stuck in one step for longer than ``health_stall``: their step's age."""
        return self._steps.stuck(now, self.health_stall)

    def _start_health(self) -> HealthServer | None:
        """Serve /livez and /readyz if asked to (ConfigError when the port is taken)."""
        if self.health_port is None:
            return None
        self.health = HealthServer(
            name=self.name,
            settings=self._settings,
            stuck=self._stuck,
            stopping=self._stop_asked,
            host=self.health_host,
            port=self.health_port,
            stall=self.health_stall,
            sock=self._health_socket,
        )
        return self.health

    def _stop_health(self) -> None:
        if self.health is not None:
            self.health.close()
            self.health = None
