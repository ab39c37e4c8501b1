"""The race lab: claim strategies, a two-session step driver, and ``skiplock race``.

It exists to show, on a real server, why skiplock claims the way it does: the
postmortem's naive claim hands jobs out twice, plain ``FOR UPDATE`` makes workers wait
on each other, ``SERIALIZABLE`` turns collisions into retries, and ``SKIP LOCKED`` does
none of these.  The lab uses skiplock's public API plus its own SQL; the core knows
nothing of it.
"""

from ._permutations import Permutation, SpecStep, run_permutation
from ._race import Drain, RaceError, RaceResult, race_prepared, race_strategy, run_race
from ._replay import SCHEDULES, Timeline, replay, replay_prepared
from ._steps import (
    Event,
    Session,
    StepBlocked,
    StepDriver,
    StepError,
    StepHandle,
    StepNotBlocked,
    StepResult,
    StepTimeout,
)
from ._strategies import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    ClaimContext,
    ClaimOutcome,
    ClaimStep,
    Strategy,
    claim_transaction,
    custom_strategy,
    get_strategy,
    lab_statement,
    run_steps,
    scratch_schema,
    seed_scratch,
)

__all__ = [
    "DEFAULT_STRATEGY",
    "SCHEDULES",
    "STRATEGIES",
    "ClaimContext",
    "ClaimOutcome",
    "ClaimStep",
    "Drain",
    "Event",
    "Permutation",
    "RaceError",
    "RaceResult",
    "Session",
    "SpecStep",
    "StepBlocked",
    "StepDriver",
    "StepError",
    "StepHandle",
    "StepNotBlocked",
    "StepResult",
    "StepTimeout",
    "Strategy",
    "Timeline",
    "claim_transaction",
    "custom_strategy",
    "get_strategy",
    "lab_statement",
    "race_prepared",
    "race_strategy",
    "replay",
    "replay_prepared",
    "run_permutation",
    "run_race",
    "run_steps",
    "scratch_schema",
    "seed_scratch",
]
