"""The layout of the file the CLI drain's handler counts into (``cli_handler``).

An int64 of processes that opened it, one int64 of executions per process (a
``skiplock worker --processes N`` runs the handler in N processes, and one shared
counter would lose increments), then one int32 per job number.
"""

SLOTS = 16  # handler processes one tally counts apart
HEADER = 8 * (1 + SLOTS)  # bytes before the per-job counts
