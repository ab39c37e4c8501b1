"""Periodic jobs: cron schedules whose every tick is enqueued once, however many workers run.

Three layers, like the queue's operations (_ops.py):

- ``Periodic``, a checked spec, and ``plan_ticks``, a pure function from (spec, the last
  enqueued tick, now) to the ticks to enqueue under the catch-up policy;
- ``schedule``, an I/O-free operation: it yields the statements (read the database's
  clock and each schedule's last tick, then one insert per tick) and never touches a
  connection, so a sync and an async driver share it;
- ``PeriodicScheduler``, the small sync driver a ``Worker`` runs in a thread.

Exactly-once comes from the database, not from a leader: ``periodic_ticks`` has a
primary key on (name, scheduled_at) and each tick is inserted together with its job in
one statement, so a second scheduler's insert of the same tick conflicts and inserts no
job.  Semantics: docs/periodic.md.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from psycopg import sql

from ._base import backoff
from ._config import validate_queue
from ._errors import ConfigError, PayloadError
from ._ops import Execute, Op, encode_payload
from ._sql import _read, parse_named

__all__ = [
    "CatchUp",
    "Periodic",
    "PeriodicScheduler",
    "ScheduleResult",
    "Tick",
    "TickPlan",
    "check_periodic",
    "next_tick",
    "plan_ticks",
    "schedule",
]

logger = logging.getLogger("skiplock.periodic")

CatchUp = Literal["skip", "all", "latest"]
CATCH_UP: tuple[str, ...] = ("skip", "all", "latest")

# 'all' enqueues at most this many missed ticks of one schedule per round (the most
# recent ones); a per-second schedule down for a day would otherwise flood its queue.
MAX_CATCH_UP = 1000

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/@-]{0,127}$")
_ONE_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class Periodic:
    """A job enqueued on a cron schedule.

    Parameters
    ----------
    name
        Identifies the schedule across workers and restarts: the same name on every
        worker is one schedule, enqueued once per tick.  Renaming starts a new history.
    cron
        Five fields (minute hour day-of-month month day-of-week), or six with
        seconds first (``*/15 * * * * *``: every 15 seconds).  Parsed by cronsim:
        names (``MON``, ``JAN``), ranges, steps, ``L``, ``W`` and ``#`` are allowed.
    queue
        The queue the jobs go to; any queue, not only those the worker serves.
    payload
        The jobs' JSON payload.  Default: ``{"periodic": name, "scheduled_at": ISO}``.
    timezone
        IANA name (``Europe/Berlin``) the cron fields are read in; default UTC.
        Across DST, skiplock follows Debian cron (as cronsim does): a time skipped
        by the spring change runs at the change, a fixed time repeated in autumn
        runs once, and ``*``-hour schedules run in both repeated hours.
    catch_up
        Which missed ticks to enqueue when the scheduler comes back after downtime:
        ``skip`` (default) those at most ``grace`` seconds late, ``all`` every one
        (the latest ``MAX_CATCH_UP``), ``latest`` as ``skip``, or else the most
        recent missed tick alone.
    grace
        Seconds a tick may be late and still be enqueued under ``skip`` and
        ``latest``; a schedule with no history enqueues its newest tick if it is
        at most this old.
    priority, max_attempts
        As for ``Queue.enqueue``.
    task
        The task name the jobs carry (``App.periodic`` sets it, with the task's
        arguments as the payload); None for handler-per-queue jobs.
    """

    name: str
    cron: str
    queue: str = "default"
    payload: Any = None
    timezone: str = "UTC"
    catch_up: CatchUp = "skip"
    grace: float = 60.0
    priority: int = 0
    max_attempts: int = 5
    task: str | None = None
    zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"invalid periodic name {self.name!r}: use 1-128 letters, digits or "
                "_ . : / @ -, starting with a letter, digit or underscore"
            )
        if not isinstance(self.cron, str):
            raise ConfigError(f"periodic {self.name!r}: cron must be a string, not {self.cron!r}")
        try:
            CronSim(self.cron, datetime(2000, 1, 1))
        except (CronSimError, ValueError, IndexError, KeyError) as exc:
            raise ConfigError(
                f"periodic {self.name!r}: invalid cron expression {self.cron!r} ({exc})"
            ) from None
        object.__setattr__(self, "zone", _zone(self.name, self.timezone))
        if self.catch_up not in CATCH_UP:
            raise ConfigError(
                f"periodic {self.name!r}: catch_up must be 'skip', 'all' or 'latest', "
                f"not {self.catch_up!r}"
            )
        if (
            isinstance(self.grace, bool)
            or not isinstance(self.grace, int | float)
            or not 0 < self.grace < math.inf
        ):
            raise ConfigError(
                f"periodic {self.name!r}: grace must be a positive number of seconds, "
                f"not {self.grace!r}"
            )
        try:
            validate_queue(self.queue)
        except ConfigError as exc:
            raise ConfigError(f"periodic {self.name!r}: {exc}") from None
        for what, value in (("priority", self.priority), ("max_attempts", self.max_attempts)):
            low = 1 if what == "max_attempts" else -(2**31)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
                raise ConfigError(
                    f"periodic {self.name!r}: {what} must be an integer from {low} "
                    f"to {2**31 - 1}, not {value!r}"
                )
        try:
            self.payload_for(datetime(2000, 1, 1, tzinfo=UTC))
        except PayloadError as exc:
            raise ConfigError(f"periodic {self.name!r}: {exc}") from None

    def payload_for(self, scheduled_at: datetime) -> str:
        """The JSON text of the job enqueued for the tick at ``scheduled_at``."""
        if self.payload is None:
            return encode_payload({"periodic": self.name, "scheduled_at": scheduled_at.isoformat()})
        return encode_payload(self.payload)


def _zone(name: str, tz: object) -> ZoneInfo:
    if not isinstance(tz, str) or not tz:
        raise ConfigError(f"periodic {name!r}: unknown timezone {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # ValueError/OSError: a path-like key such as '../etc' or one with a NUL.
        raise ConfigError(
            f"periodic {name!r}: unknown timezone {tz!r} (use an IANA name like 'Europe/Berlin')"
        ) from None


def check_periodic(specs: Sequence[Periodic]) -> list[Periodic]:
    """The specs as a list, refusing anything that is not a Periodic and duplicate names."""
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, Periodic):
            raise ConfigError(f"periodic entries must be skiplock.Periodic, not {spec!r}")
        if spec.name in seen:
            raise ConfigError(f"duplicate periodic name {spec.name!r}")
        seen.add(spec.name)
    return list(specs)


# -- tick computation: pure ---------------------------------------------------------------


@dataclass(frozen=True)
class TickPlan:
    """The ticks to enqueue for one schedule, oldest first, and those the policy dropped.

    ``dropped`` is the (oldest, newest) missed tick left out, or None; it is not a count,
    which would mean walking every tick of a long outage.
    """

    ticks: list[datetime]
    dropped: tuple[datetime, datetime] | None = None


def next_tick(spec: Periodic, after: datetime) -> datetime | None:
    """The schedule's first tick strictly after ``after`` (aware), in UTC; None if none
    within cronsim's horizon of 50 years."""
    try:
        return next(iter(CronSim(spec.cron, after.astimezone(spec.zone)))).astimezone(UTC)
    except StopIteration:
        return None


def plan_ticks(spec: Periodic, last: datetime | None, now: datetime) -> TickPlan:
    """The ticks in (last, now] to enqueue under ``spec.catch_up``.

    ``last`` is the schedule's last enqueued tick (from the database), None if it never
    ran; ``now`` an aware datetime.  A schedule with no history enqueues at most its
    newest tick, if that is at most ``grace`` seconds old, whatever the policy: it
    missed nothing, and a deploy just after a tick should not lose it.
    """
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    window = now - timedelta(seconds=spec.grace)
    newest_first: list[datetime] = []
    too_old: datetime | None = None
    # Backwards from now (inclusive: cronsim's start is exclusive), so a long outage
    # costs at most the ticks we keep plus one, never a walk through all it missed.
    for local in CronSim(spec.cron, (now + _ONE_MICROSECOND).astimezone(spec.zone), reverse=True):
        tick = local.astimezone(UTC)
        if last is not None and tick <= last:
            break
        if last is None:
            # Nothing was missed: at most the newest tick, if it is not yet too late.
            if tick >= window:
                newest_first.append(tick)
            break
        if spec.catch_up != "all" and tick < window:
            if spec.catch_up == "latest" and not newest_first:
                newest_first.append(tick)
                continue  # the next older one, if any, is the newest dropped
            too_old = tick
            break
        if len(newest_first) >= MAX_CATCH_UP:
            too_old = tick
            break
        newest_first.append(tick)
    newest_first.reverse()
    dropped = None
    if too_old is not None and last is not None:
        oldest = next_tick(spec, last)
        dropped = (oldest if oldest is not None else too_old, too_old)
    return TickPlan(newest_first, dropped)


# -- the operation: I/O-free --------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def statements(schema: str) -> dict[str, sql.Composed]:
    """periodic.sql's statements rendered for ``schema``."""
    ident = sql.Identifier(schema)
    return {
        name: sql.SQL(text).format(schema=ident)
        for name, text in parse_named(_read("periodic.sql")).items()
    }


@dataclass(frozen=True, slots=True)
class Tick:
    """A tick this scheduler enqueued: its schedule, time (UTC) and job."""

    name: str
    scheduled_at: datetime
    job_id: int


@dataclass
class ScheduleResult:
    """What one round did: the clock it used, the ticks it enqueued (ticks another
    scheduler enqueued first are not listed), drops, and when the next tick is due."""

    now: datetime
    enqueued: list[Tick] = field(default_factory=list)
    dropped: dict[str, tuple[datetime, datetime]] = field(default_factory=dict)
    next_at: datetime | None = None


def schedule(schema: str, specs: Sequence[Periodic], now: datetime | None = None) -> Op[Any]:
    """One scheduling round: enqueue every tick due for ``specs``, each exactly once.

    ``now`` injects a clock (tests); by default the database's clock is used, which
    every scheduler on every host shares.  Each tick is its own statement, so a round
    cut short by a lost connection has enqueued a prefix and the next round resumes.
    Returns a ScheduleResult.
    """
    stmts = statements(schema)
    result = ScheduleResult(now=now or datetime.now(UTC))
    if not specs:
        return result
    rows = yield Execute(stmts["periodic_last"], {"names": [s.name for s in specs]})
    if now is None:
        result.now = rows[0]["now"]
    last = {r["name"]: r["last"] for r in rows}
    for spec in specs:
        plan = plan_ticks(spec, last.get(spec.name), result.now)
        if plan.dropped is not None:
            result.dropped[spec.name] = plan.dropped
        for tick in plan.ticks:
            inserted = yield Execute(
                stmts["periodic_enqueue"],
                {
                    "schema": schema,
                    "name": spec.name,
                    "scheduled_at": tick,
                    "queue": spec.queue,
                    "payload": spec.payload_for(tick),
                    "priority": spec.priority,
                    "max_attempts": spec.max_attempts,
                    "task": spec.task,
                },
            )
            if inserted:
                result.enqueued.append(Tick(spec.name, tick, int(inserted[0]["id"])))
        upcoming = next_tick(spec, result.now)
        if upcoming is not None and (result.next_at is None or upcoming < result.next_at):
            result.next_at = upcoming
    return result


def prune_ticks(schema: str, names: Sequence[str], keep: float, limit: int = 1000) -> Op[Any]:
    """Delete ticks older than ``keep`` seconds, except each schedule's latest."""
    yield Execute(
        statements(schema)["periodic_prune"],
        {"names": list(names), "keep": float(keep), "limit": limit},
    )
    return None


# -- the sync driver ----------------------------------------------------------------------


class PeriodicScheduler:
    """Runs ``schedule`` rounds on a Queue until ``stop`` is set: wakes at each tick.

    Every worker with the same specs runs one; the database keeps them from enqueuing a
    tick twice, so none of them is special and any may die.
    """

    # Sleep at most this long between rounds, so new history (another scheduler's
    # ticks, a clock step) is seen within it even when the next tick is far away.
    max_sleep = 30.0
    # Wake this long after a tick is due: the database's clock must have passed it.
    lag = 0.005
    # Ticks older than this are pruned (the latest of each schedule always stays).
    keep_ticks = 86400.0
    prune_every = 600.0

    def __init__(
        self,
        queue: Any,
        specs: Sequence[Periodic],
        *,
        stop: threading.Event | None = None,
        name: str = "scheduler",
    ) -> None:
        self._q = queue
        self.specs = check_periodic(specs)
        self.stop = stop or threading.Event()
        self.name = name
        self._failures = 0

    def run_once(self, now: datetime | None = None) -> ScheduleResult:
        """One round, on the queue's pool with its retries (a tick insert is
        idempotent: a retried one that had committed conflicts and adds nothing)."""
        schema, specs = self._q.schema, self.specs
        result: ScheduleResult = self._q._execute(
            lambda _after: schedule(schema, specs, now), what="periodic"
        )
        for name, (first, newest) in result.dropped.items():
            logger.warning(
                "periodic %s: missed ticks from %s to %s not enqueued (catch_up=%s)",
                name,
                first.isoformat(),
                newest.isoformat(),
                next(s.catch_up for s in specs if s.name == name),
            )
        return result

    def prune(self) -> None:
        schema, names = self._q.schema, [s.name for s in self.specs]
        self._q._execute(
            lambda _after: prune_ticks(schema, names, self.keep_ticks), what="periodic prune"
        )

    def run(self) -> None:
        """Rounds until ``stop``; database errors are logged and retried with backoff."""
        next_prune = 0.0
        while not self.stop.is_set():
            try:
                result = self.run_once()
                self._failures = 0
                if result.now.timestamp() >= next_prune:
                    self.prune()
                    next_prune = result.now.timestamp() + self.prune_every
            except Exception as exc:
                self._failures += 1
                if self._failures == 1 or self._failures % 20 == 0:
                    text = str(exc).strip().splitlines()
                    logger.warning(
                        "%s: periodic round failed (%s); retrying",
                        self.name,
                        text[0] if text else type(exc).__name__,
                    )
                self.stop.wait(backoff(self._failures, base=0.1, cap=5.0))
                continue
            wait = self.max_sleep
            if result.next_at is not None:
                wait = min(wait, (result.next_at - result.now).total_seconds() + self.lag)
            self.stop.wait(max(wait, 0.0))
