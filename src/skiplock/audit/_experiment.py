"""The audit's experiment: run the user's own claim concurrently on a scratch copy of their schema.

The static rules say a claim *can* hand one job to two workers; this shows whether it
does, with the user's DDL and statement on a real server, using the race lab's machinery
(``skiplock.lab``): W workers, each with its own connection, drain N seeded rows and every
key a claim returned is counted; then two sessions replay the race step by step on the
lab's step driver, which sees waits through ``pg_blocking_pids``.

Nothing of the user's is touched.  The DDL runs in a fresh schema, and every connection
(DDL, seeding, workers, replay sessions) gets ``search_path`` set to it, so unqualified
names land there; the schema is dropped afterwards.  DDL or a claim that names a schema,
creates one or an extension, or sets ``search_path`` gets a scratch database instead.

Seeding, unless ``--seed`` gives a script: rows are inserted into the claim's table with
every column at its default except (1) columns the claim tests against a value
(``status = 'pending'``, ``queue = $1``), which get that value, so the rows are
claimable; (2) NOT NULL columns without a default, which get a value made up from their
type (``'seed-' || g`` for text, ``g`` for numbers, ``now()`` for times, the first label
of an enum, ``gen_random_uuid()``, ``jsonb_build_object('seed', g)``).  Identity and
generated columns are left alone, so keys come out 1..N in order.  Rows another table
must hold first (a foreign key, the queue a join asks for) need a ``--seed`` script.

Placeholders get, unless ``--param NAME=VALUE`` or a psql ``\\set`` says otherwise: the
claim's LIMIT for a LIMIT; the keys the previous statement returned for ``id = $n``,
``id = ANY($n)`` or ``id IN ($a, $b)`` in the second statement of a two-step claim; the
worker's name for a text column it sets; now() plus a 5-minute lease for a time it sets;
and a made-up value for a column it compares (seeded rows carry the same value).  Types
come from the server (PREPARE on the scratch copy), not guessed from the text.

The phases live in their own modules: ``_exp_scratch`` (the scripts and the scratch
schema), ``_exp_prepare`` (the claim against it), ``_exp_load`` (seeding and the load),
``_exp_replay`` (the step-by-step replays) and ``_exp_verdict`` (the result); this one
runs them in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import psycopg

from skiplock.connect import redact_dsn
from skiplock.lab import SCHEDULES, RaceError, RaceResult, StepError, Timeline

from ._claim import ClaimPlan, ExperimentError, _qualified_names, parse_claim
from ._engine import AuditResult, audit_paths
from ._exp_load import run_load, seed_text
from ._exp_prepare import prepare
from ._exp_replay import run_replay
from ._exp_scratch import Script, message, scratch_with
from ._exp_verdict import ExperimentResult

__all__ = ["ExperimentError", "ExperimentResult", "run_experiment"]


def run_experiment(
    dsn: str,
    schema_path: str | Path,
    claim_path: str | Path,
    *,
    seed_path: str | Path | None = None,
    workers: int = 8,
    jobs: int = 5000,
    params: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    load: bool = True,
    fail_on: str = "info",
    progress: Callable[[str], None] | None = None,
) -> ExperimentResult:
    """Run the user's claim concurrently against their schema, in scratch space.

    Parameters
    ----------
    dsn
        The server.  A scratch schema (or database) is created there and dropped.
    schema_path
        The user's DDL.
    claim_path
        The claim: a .sql file or a Python file, read as ``skiplock audit`` reads them.
    seed_path
        A script that fills the tables instead of the generated rows; ``:jobs`` in it is
        the number of rows wanted.
    workers, jobs
        The load: concurrent workers (threads, each with its own connection) and rows.
    params
        Values for placeholders, by name (``worker``) or number (``1``).
    timeout
        Seconds the load may take before it is called off.
    load
        Run the load (else only the replays).
    fail_on
        Lowest severity of a static finding that makes the exit code 1.
    progress
        Called with a line now and then (the command prints them on stderr).

    Returns
    -------
    ExperimentResult

    Raises
    ------
    ExperimentError
        Input that cannot be run, or a server that cannot be reached: one line.
    """
    say = progress or (lambda _line: None)
    ddl = Script.read(schema_path)
    plan = parse_claim(claim_path)
    seed = Script.read(seed_path) if seed_path is not None else None
    static = audit_paths([claim_path])
    reason = ddl.needs_database() or (seed.needs_database() if seed else None)
    if reason is None and plan.qualified:
        reason = f"{claim_path} names {_qualified_names(plan.statements[0].tree)[0]}"
    try:
        return _run(
            dsn, ddl, plan, seed, static, reason, workers, jobs, params or {}, timeout, load,
            fail_on, say,
        )  # fmt: skip
    except psycopg.OperationalError as exc:
        raise ExperimentError(f"cannot use {redact_dsn(dsn)}: {message(exc)}") from None
    except psycopg.Error as exc:
        raise ExperimentError(message(exc)) from None
    except (RaceError, StepError) as exc:
        raise ExperimentError(str(exc)) from None


def _run(
    dsn: str,
    ddl: Script,
    plan: ClaimPlan,
    seed: Script | None,
    static: AuditResult,
    reason: str | None,
    workers: int,
    jobs: int,
    params: Mapping[str, str],
    timeout: float,
    load: bool,
    fail_on: str,
    say: Callable[[str], None],
) -> ExperimentResult:
    database = reason is not None
    result: RaceResult | None = None
    note: str | None = None
    timelines: list[Timeline] = []
    with scratch_with(dsn, database, ddl) as (scratch, conn):
        first_scratch = scratch.name
        prepared = prepare(conn, plan, params, scratch)
        if plan.read_only:
            note = (
                "the claim writes nothing, so a committed claim leaves its rows claimable "
                "(a hold-lock claim needs the statement that ends the job in the same file)"
            )
        elif not load:
            note = "not asked for"
        else:
            say(f"load: {workers} workers on {jobs} rows of {prepared.table}")
            result = run_load(scratch, conn, prepared, seed, workers, jobs, timeout)
        if result is None:
            # Nothing ran in this scratch copy yet: the first replay can use it.
            say("replay: schedule 'A first'")
            timelines.append(run_replay(scratch, conn, prepared, seed, "A first"))
    for schedule in SCHEDULES:
        if any(t.double_claimed for t in timelines) or any(
            t.schedule == schedule for t in timelines
        ):
            continue
        say(f"replay: schedule {schedule!r}")
        with scratch_with(dsn, database, ddl) as (scratch, conn):
            timelines.append(run_replay(scratch, conn, prepared, seed, schedule))
    shown = next((t for t in timelines if t.double_claimed), timelines[0])
    where = (
        f"database {first_scratch} (because {reason})"
        if database
        else f"schema {first_scratch} (search_path set to it on every connection)"
    )
    return ExperimentResult(
        claim_path=plan.path,
        plan=plan,
        table=prepared.table,
        key=prepared.key,
        scratch=where,
        server=redact_dsn(dsn),
        parameters=[b.note for b in prepared.bindings],
        seed=seed_text(prepared, seed),
        static=static,
        timeline=shown,
        other_replays=[t for t in timelines if t is not shown],
        load=result,
        load_note=note,
        fail_on=fail_on,
    )
