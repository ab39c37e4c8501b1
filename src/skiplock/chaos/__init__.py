"""Fault injection for skiplock: a queue is trusted for what it does on its worst day.

``skiplock chaos`` runs producers and worker processes against a scratch schema while
workers are killed and paused, backends terminated, connections reset through a proxy
and (on a scratch cluster only) the server restarted; then a Jepsen-style checker reads
every process's history and the final table and counts lost, unexpected, twice-run and
twice-completed jobs.  It uses skiplock's public API; the core knows nothing of it.
"""

from ._faults import FAULTS, ConnectionHog, LongTransaction, ScratchCluster
from ._history import (
    ALLOWED_CAUSES,
    CheckResult,
    DuplicateExecution,
    HistoryWriter,
    check,
    load_history,
)
from ._proxy import ChaosProxy, proxied_dsn, upstream_of
from ._run import ChaosConfig, ChaosReport, run_chaos

__all__ = [
    "ALLOWED_CAUSES",
    "FAULTS",
    "ChaosConfig",
    "ChaosProxy",
    "ChaosReport",
    "CheckResult",
    "ConnectionHog",
    "DuplicateExecution",
    "HistoryWriter",
    "LongTransaction",
    "ScratchCluster",
    "check",
    "load_history",
    "proxied_dsn",
    "run_chaos",
    "upstream_of",
]
