"""The Markdown table and the PNG chart: per-round figures, medians, ratios, verdicts."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import Key, Results, median

# Drains timed from the first claim to the last completion committed, as the server
# stamps them (started_at, finished_at): the one clock every configuration shares.
DB_CLOCK = "jobs/s, db clock"

# The two pgbench ceilings, by the SQL they run: skiplock's own statements (issue 11
# compared the drain with it) and the postmortem's plain SQL (issue 19's yardstick).
OWN_SQL = "skiplock's SQL"
PLAIN_SQL = "plain SQL"


def ceiling_config(what: str, clients: int, batch: int) -> str:
    return f"{what}: {clients} clients, batch {batch}"


# skiplock's drain configurations the targets name (suite.variants builds them).
def worker_config(c: int) -> str:
    return f"c{c}: 1 process x {c}"


def async_config(c: int) -> str:
    return f"c{c}: AsyncWorker, 1 process x {c}"


def cli_config(c: int) -> str:
    return f"c{c}: skiplock worker CLI x {c}"


def cli_procs_config(c: int, p: int) -> str:
    return f"c{c}: skiplock worker --processes {p} x {c // p}"


LIB_ORDER = {"skiplock": 0, "pgqueuer": 1, "procrastinate": 2, "pgbench": 3}
COLORS = {"skiplock": "#1f77b4", "pgqueuer": "#ff7f0e", "procrastinate": "#2ca02c"}


def fmt(x: float, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if "ms" in unit:
        return f"{x:.2f}"
    if unit == "ratio":
        return f"{x:.2f}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}"


def _sort_key(k: Key) -> tuple[Any, ...]:
    return (LIB_ORDER.get(k.lib, 9), k.n, _config_order(k.config), k.config, k.metric)


def _config_order(config: str) -> int:
    # c8 before c32; "defaults" first for pgqueuer.
    if config.startswith("defaults"):
        return 0
    if config.startswith("c") and ":" in config:
        try:
            return int(config[1 : config.index(":")])
        except ValueError:
            return 99
    return 99


def value_table(res: Results, keys: list[Key], unit_from_metric: bool = True) -> list[str]:
    rounds = list(range(1, res.rounds + 1))
    head = ["library", "configuration", "N", "metric", *[f"run {r}" for r in rounds]]
    head += ["median", "min-max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(keys, key=_sort_key):
        s = res.series(k)
        unit = k.metric if unit_from_metric else ""
        vals = [v for v in s.values() if not math.isnan(v)]
        rng = f"{fmt(min(vals), unit)}-{fmt(max(vals), unit)}" if vals else "-"
        row = [k.lib, k.config, f"{k.n:,}", k.metric]
        row += [fmt(s.get(r, float("nan")), unit) for r in rounds]
        row += [f"**{fmt(res.median(k), unit)}**", rng]
        lines.append("| " + " | ".join(row) + " |")
    return lines


@dataclass
class Ratio:
    """A figure taken within each round (a ratio, or a difference in ms), and its median.

    With a ``goal`` it is a target: the median is judged against it, and the verdict
    says by how much it is met or missed, and in how many rounds.
    """

    label: str
    per_round: dict[int, float]
    goal: float | None = None
    at_least: bool = True  # the goal is a floor (≥); False: a ceiling (≤)
    unit: str = ""  # "" for ratios, " ms" for differences of latencies

    @property
    def median(self) -> float:
        return median(self.per_round.values())

    @property
    def target(self) -> str:
        if self.goal is None:
            return ""
        return f"{'≥' if self.at_least else '≤'} {self.goal:g}{self.unit}"

    def _margin(self, x: float) -> float:
        """How far x is on the good side of the goal (negative: missed), with the float
        noise of a difference such as 2.2 - 1.7 taken off, so the goal itself is met."""
        assert self.goal is not None
        margin = x - self.goal if self.at_least else self.goal - x
        return 0.0 if abs(margin) < 1e-9 else margin

    def status(self) -> str:
        """ "met", "missed", "not measured", or "" when it is no target."""
        if self.goal is None:
            return ""
        m = self.median
        if math.isnan(m):
            return "not measured"
        return "met" if self._margin(m) >= 0 else "missed"

    def verdict(self) -> str:
        status = self.status()
        if status in ("", "not measured"):
            return status
        m = self.median
        margin = self._margin(m)
        vals = [v for v in self.per_round.values() if not math.isnan(v)]
        rounds = f"; {sum(1 for v in vals if self._margin(v) >= 0)} of {len(vals)} rounds"
        if status == "met":
            return f"met, {margin:.2f}{self.unit} to spare{rounds}"
        text = f"**missed** by {-margin:.2f}{self.unit}"
        if self.at_least and not self.unit and m > 0 and self.goal is not None:
            text += f" (needs {self.goal / m:.2f}x)"
        return text + rounds


def _find(res: Results, section: str, lib: str, n: int | None, metric: str, pred: Any) -> list[Key]:
    return [
        k
        for k in res.values
        if k.section == section
        and k.lib == lib
        and (n is None or k.n == n)
        and k.metric == metric
        and pred(k.config)
    ]


def _series(res: Results, keys: list[Key]) -> dict[int, float]:
    return res.series(keys[0]) if keys else {}


def _best_per_round(res: Results, keys: list[Key]) -> dict[int, float]:
    """Per round, the best of several configurations (say which in the label)."""
    out: dict[int, float] = {}
    for k in keys:
        for r, v in res.series(k).items():
            if not math.isnan(v):
                out[r] = max(out.get(r, float("-inf")), v)
    return out


def _div(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {r: a[r] / b[r] for r in a if r in b and b[r] and not math.isnan(b[r])}


def _med(s: dict[int, float], unit: str = "") -> str:
    return fmt(median(s.values()), unit)


def _ceiling(res: Results, what: str) -> dict[int, float]:
    return _series(
        res, _find(res, "pgbench", "pgbench", None, "jobs/s", lambda s: s.startswith(f"{what}:"))
    )


def issue19_targets(res: Results, sizes: list[int], concurrency: list[int]) -> list[Ratio]:
    """Issue 19's targets, each taken within a round and judged on the median.

    Drain: in-process ``Worker`` (bench clock) and the ``skiplock worker`` CLI (db clock:
    its only one) at every N and C against the plain-SQL ceiling (≥ 0.6) and pgqueuer's
    defaults at the same N (the moonshot, ≥ 5); ``AsyncWorker`` against ``Worker`` at
    the same N and C (≥ 0.8, "within 20%").  Pickup: per round, skiplock's pickup
    percentile less the enqueue call's own (the floor, same samples), ≤ 0.5 ms at p50
    and ≤ 2 ms at p99.  A configuration not measured is listed as such, not dropped.
    """
    ceiling: list[Ratio] = []
    moonshot: list[Ratio] = []
    asyncs: list[Ratio] = []
    if res.keys("drain"):
        plain = _ceiling(res, PLAIN_SQL)
        for n in sizes:
            pgq = _series(
                res,
                _find(res, "drain", "pgqueuer", n, "jobs/s", lambda s: s.startswith("defaults")),
            )
            for c in concurrency:
                where = f"c{c}, N={n:,}"
                worker = res.series(Key("drain", "skiplock", worker_config(c), n, "jobs/s"))
                cli = res.series(Key("drain", "skiplock", cli_config(c), n, DB_CLOCK))
                aw = res.series(Key("drain", "skiplock", async_config(c), n, "jobs/s"))
                subjects = [("Worker", worker), ("`skiplock worker` CLI (db clock)", cli)]
                # Several processes, if the run had them: not a target of its own (the
                # issue names one process), a row beside them for what a host's cores
                # give (docs/scaling.md).
                prefix = f"c{c}: skiplock worker "
                for k in res.keys("drain"):
                    if (k.lib, k.n, k.metric) == ("skiplock", n, DB_CLOCK) and k.config.startswith(
                        prefix + "--processes "
                    ):
                        how = k.config.removeprefix(prefix)
                        subjects.append((f"`skiplock worker {how}` (db clock)", res.series(k)))
                for name, s in subjects:
                    ceiling.append(
                        Ratio(
                            f"drain {where}: {name} {_med(s)} / plain-SQL ceiling "
                            f"{_med(plain)} jobs/s",
                            _div(s, plain),
                            0.6,
                        )
                    )
                    moonshot.append(
                        Ratio(
                            f"moonshot: drain {where}: {name} {_med(s)} / pgqueuer defaults "
                            f"{_med(pgq)} jobs/s",
                            _div(s, pgq),
                            5.0,
                        )
                    )
                asyncs.append(
                    Ratio(
                        f"drain {where}: AsyncWorker {_med(aw)} / Worker {_med(worker)} jobs/s",
                        _div(aw, worker),
                        0.8,
                    )
                )
    pickup: list[Ratio] = []
    for q, slack in ((50, 0.5), (99, 2.0)):
        metric = f"p{q} ms"
        floor = _series(
            res, _find(res, "pickup", "skiplock", None, metric, lambda s: s.startswith("enqueue"))
        )
        got = _series(
            res,
            _find(res, "pickup", "skiplock", None, metric, lambda s: not s.startswith("enqueue")),
        )
        if got or floor:
            pickup.append(
                Ratio(
                    f"pickup p{q}, idle workers, less the enqueue call's own (the floor): "
                    f"{_med(got, 'ms')} - {_med(floor, 'ms')} ms",
                    {r: got[r] - floor[r] for r in got if r in floor},
                    slack,
                    at_least=False,
                    unit=" ms",
                )
            )
    return ceiling + moonshot + asyncs + pickup


def targets_summary(items: list[Ratio]) -> str:
    counts = Counter(it.status() for it in items if it.goal is not None)
    return (
        f"{counts['met']} of {sum(counts.values())} targets met, {counts['missed']} missed, "
        f"{counts['not measured']} not measured."
    )


def other_ratios(res: Results, sizes: list[int], c: int = 8) -> list[Ratio]:
    """The ratios of earlier issues that still mean something beside issue 19's.

    Judged only where no issue-19 target covers the same question: the CLI against the
    library (issue 14), enqueue against pgqueuer, the claim at a large backlog and the
    drain after a history (issue 6).  The drain against pgqueuer (issues 6 and 11's 5x,
    issue 19's moonshot) and against skiplock's own SQL (issue 11's 0.6, which issue 19
    moved to the plain SQL) are given without a verdict: the targets table judges them.
    """
    out: list[Ratio] = []
    n = min(sizes) if sizes else 0
    one = _find(res, "drain", "skiplock", n, "jobs/s", lambda s: s == worker_config(c))
    multi = _find(
        res, "drain", "skiplock", n, "jobs/s", lambda s: s.startswith(f"c{c}:") and "processes" in s
    )
    s_best = _best_per_round(res, one + multi)
    best_label = "best of " + ", ".join(k.config.split(": ")[1] for k in one + multi)
    pgq = _find(res, "drain", "pgqueuer", n, "jobs/s", lambda s: s.startswith("defaults"))
    # procrastinate runs at a smaller N (--slow-max-n); its rate, not its N, is compared.
    pro = _find(res, "drain", "procrastinate", None, "jobs/s", lambda s: s.startswith(f"c{c}:"))
    if pgq and (one or multi):
        out.append(
            Ratio(
                f"issues 6, 11: drain c{c}, N={n:,}: skiplock ({best_label}) / pgqueuer defaults",
                _div(s_best, res.series(pgq[0])),
            )
        )
    own = _ceiling(res, OWN_SQL)
    if own and one:
        out.append(
            Ratio(
                f"issue 11: drain c{c}, N={n:,}: skiplock 1 process / pgbench on skiplock's SQL",
                _div(res.series(one[0]), own),
            )
        )
    plain = _ceiling(res, PLAIN_SQL)
    if own and plain:
        out.append(Ratio("pgbench ceilings: skiplock's SQL / plain SQL", _div(own, plain)))
    if pro and (one or multi):
        out.append(
            Ratio(
                f"drain c{c}, N={n:,}: skiplock ({best_label}) / procrastinate c{c}"
                f" (N={pro[0].n:,})",
                _div(s_best, res.series(pro[0])),
            )
        )
    # The deployed command against the library, both on the database's clock (issue 14).
    lib_db = _find(res, "drain", "skiplock", n, DB_CLOCK, lambda s: s == worker_config(c))
    cli_db = _find(res, "drain", "skiplock", n, DB_CLOCK, lambda s: s == cli_config(c))
    if lib_db and cli_db:
        out.append(
            Ratio(
                f"issue 14: drain c{c}, N={n:,}: `skiplock worker` CLI / in-process Worker "
                "(db clock)",
                res.ratio(cli_db[0], lib_db[0]),
                0.9,
            )
        )
    for what, goal in (("bulk", 2.0), ("single", 1.0)):
        sk = [
            k
            for k in res.values
            if k.section == "enqueue" and k.lib == "skiplock" and k.config == what
        ]
        pq = [
            k
            for k in res.values
            if k.section == "enqueue" and k.lib == "pgqueuer" and k.config == what
        ]
        if what == "bulk":
            sk = [k for k in sk if k.n == n]
            pq = [k for k in pq if k.n == n]
        if sk and pq:
            out.append(
                Ratio(
                    f"issue 6: enqueue {what} (N={sk[0].n:,}): skiplock / pgqueuer",
                    res.ratio(sk[0], pq[0]),
                    goal,
                )
            )
    claims = sorted(
        (k for k in res.values if k.section == "claim" and k.metric == "p50 ms"), key=lambda k: k.n
    )
    if len(claims) >= 2:
        k_small, k_big = claims[0], claims[-1]
        out.append(
            Ratio(
                f"issue 6: claim latency p50: {k_big.n:,} / {k_small.n:,} pending",
                res.ratio(k_big, k_small),
                1.3,
                at_least=False,
            )
        )
        s99 = Key(k_small.section, k_small.lib, k_small.config, k_small.n, "p99 ms")
        b99 = Key(k_big.section, k_big.lib, k_big.config, k_big.n, "p99 ms")
        out.append(
            Ratio(f"claim latency p99: {k_big.n:,} / {k_small.n:,} pending", res.ratio(b99, s99))
        )
    hist = {k.config: k for k in res.values if k.section == "history" and k.metric == "jobs/s"}
    fresh, fresh2 = hist.get("fresh table"), hist.get("fresh table, second set")
    for config, k in sorted(hist.items()):
        if not config.startswith("after"):
            continue
        base = fresh2 if config.endswith(", vacuumed") else fresh
        if base is not None:
            out.append(
                Ratio(f"issues 6, 11: drain {config} / fresh table", res.ratio(k, base), 0.9)
            )
    longtx = hist.get("long transaction open")
    if fresh and longtx:
        out.append(
            Ratio("drain with a long transaction open / fresh table", res.ratio(longtx, fresh))
        )
    return out


def ratio_table(res: Results, items: list[Ratio], first: str = "ratio") -> list[str]:
    rounds = list(range(1, res.rounds + 1))
    head = [first, *[f"run {r}" for r in rounds], "median", "goal", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for it in items:
        unit = "ms" if it.unit else "ratio"
        row = [it.label, *[fmt(it.per_round.get(r, float("nan")), unit) for r in rounds]]
        row += [f"**{fmt(it.median, unit)}**", it.target, it.verdict()]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def checks_table(res: Results) -> list[str]:
    groups: dict[tuple[str, str, str, int], list[Any]] = {}
    for c in res.checks:
        groups.setdefault((c.section, c.lib, c.config, c.n), []).append(c)
    head = ["section", "library", "configuration", "N", "runs", "executions", "duplicates"]
    head += ["missing", "runs not OK", "database state (last run)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (section, lib, config, n), cs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], LIB_ORDER.get(kv[0][1], 9), kv[0][3], kv[0][2])
    ):
        row = [
            section,
            lib,
            config,
            f"{n:,}",
            str(len(cs)),
            f"{sum(c.executed for c in cs):,}",
            str(sum(c.duplicates for c in cs)),
            str(sum(c.missing for c in cs)),
            str(sum(1 for c in cs if not c.ok)),
            cs[-1].db_state,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def profile_summary(raw: Path, worker_name: str, top: int = 18) -> list[str]:
    """Self and inclusive shares of py-spy's collapsed stacks, by function and by module."""
    if not raw.exists():
        return ["(no profile file)"]
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    by_module: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        thread = ""
        if frames and frames[0].startswith(("thread (", "process ")):
            thread = frames[0].split(": ", 1)[1] if ": " in frames[0] else frames[0]
            frames = frames[1:]
        if not frames:
            continue
        total += count
        leaf = frames[-1]
        self_c[_short(leaf)] += count
        by_module[_module(leaf)] += count
        by_thread[_thread_role(thread, worker_name)] += count
        for f in set(frames):
            incl[_short(f)] += count
    if total == 0:
        return ["(profile is empty)"]
    out = [f"{total:,} samples of threads on CPU (py-spy, idle threads excluded).", ""]
    out += ["By thread role:", "", "| thread | share |", "|---|---|"]
    out += [f"| {k} | {v / total:.0%} |" for k, v in by_thread.most_common()]
    out += ["", "By module of the innermost frame:", "", "| module | share |", "|---|---|"]
    out += [f"| `{k}` | {v / total:.0%} |" for k, v in by_module.most_common(12)]
    out += ["", "Top functions, self time:", "", "| function | self |", "|---|---|"]
    out += [f"| `{k}` | {v / total:.1%} |" for k, v in self_c.most_common(top)]
    out += ["", "Top functions, inclusive:", "", "| function | inclusive |", "|---|---|"]
    out += [f"| `{k}` | {v / total:.0%} |" for k, v in incl.most_common(top)]
    return out


def server_samples(counts: dict[str, int]) -> list[str]:
    """pg_stat_activity samples of the worker's backends, by skiplock statement."""
    total = sum(counts.values())
    if not total:
        return ["(no server-side samples)"]
    out = [
        f"Server side: {total:,} samples of the worker's active backends (pg_stat_activity, "
        "every 20 ms), by statement:",
        "",
        "| statement | share of active samples |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {v / total:.0%} |" for k, v in counts.items()]
    return out


def _short(frame: str) -> str:
    # "func (path/to/module.py:123)" -> "func (module.py)"
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    tail = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({tail})" if where else name


def _module(frame: str) -> str:
    """py-spy names files relative to sys.path: "psycopg/cursor.py", "threading.py"."""
    _, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    if "/" in path:
        return path.split("/", 1)[0]
    return f"stdlib {path}" if path else "?"


def _thread_role(thread: str, worker_name: str) -> str:
    """Thread names with the worker's name and counters taken out: one row per role."""
    if not thread:
        return "?"
    return re.sub(r"\d+", "N", thread.replace(worker_name, "{name}"))


# -- chart --------------------------------------------------------------------------------


def chart(res: Results, path: Path, sizes: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    fig.suptitle(title, fontsize=11)
    _chart_drain(res, axes[0][0], sizes)
    _chart_enqueue(res, axes[0][1])
    _chart_pickup(res, axes[1][0])
    _chart_scaling(res, axes[1][1])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _err(res: Results, k: Key) -> tuple[float, float, float]:
    vals = [v for v in res.series(k).values() if not math.isnan(v)]
    if not vals:
        return float("nan"), 0.0, 0.0
    m = median(vals)
    return m, m - min(vals), max(vals) - m


def _chart_drain(res: Results, ax: Any, sizes: list[int]) -> None:
    keys = sorted(res.keys("drain"), key=_sort_key)
    configs: list[tuple[str, str]] = []
    for k in keys:
        if (k.lib, k.config) not in configs:
            configs.append((k.lib, k.config))
    all_n = sorted({k.n for k in keys} | set(sizes))
    width = 0.8 / max(1, len(all_n))
    for j, n in enumerate(all_n):
        xs, ys, lo, hi, colors = [], [], [], [], []
        for i, (lib, config) in enumerate(configs):
            k = Key("drain", lib, config, n, "jobs/s")
            if k not in res.values:
                k = Key("drain", lib, config, n, DB_CLOCK)  # the CLI worker has only this
            if k not in res.values:
                continue
            m, a, b = _err(res, k)
            xs.append(i + (j - (len(all_n) - 1) / 2) * width)
            ys.append(m)
            lo.append(a)
            hi.append(b)
            colors.append(COLORS.get(lib, "grey"))
        ax.bar(
            xs,
            ys,
            width=width,
            color=colors,
            yerr=[lo, hi],
            capsize=2,
            alpha=1.0 - 0.3 * j / max(1, len(all_n) - 1),
            hatch=[None, "//", ".."][j % 3],
            label=f"N={n:,}",
            edgecolor="black",
            linewidth=0.4,
        )
    for k in res.keys("pgbench"):
        if k.metric == "jobs/s":
            ax.axhline(res.median(k), color="red", linestyle="--", linewidth=1)
            ax.text(0, res.median(k), f" pgbench ceiling ({k.config})", color="red", va="bottom")
            if k.config.startswith(f"{PLAIN_SQL}:"):
                goal = 0.6 * res.median(k)
                ax.axhline(goal, color="red", linestyle=":", linewidth=1)
                # At the right edge: the ceilings' labels sit at the left one, and the
                # goal can fall on skiplock's own ceiling.
                ax.text(
                    1.0,
                    goal,
                    "0.6 x plain-SQL ceiling (issue 19) ",
                    color="red",
                    va="top",
                    ha="right",
                    transform=ax.get_yaxis_transform(),
                )
    ax.set_xticks(range(len(configs)))
    labels = [f"{lib}\n{c}" + ("\n(db clock)" if "CLI" in c else "") for lib, c in configs]
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("jobs/s (log)")
    ax.set_title("Drain: pre-enqueued no-op jobs until all finished (median, min-max)")
    ax.legend(fontsize=8)


def _chart_enqueue(res: Results, ax: Any) -> None:
    keys = sorted(res.keys("enqueue"), key=lambda k: (k.config, k.n, LIB_ORDER.get(k.lib, 9)))
    labels, ys, lo, hi, colors = [], [], [], [], []
    for k in keys:
        m, a, b = _err(res, k)
        labels.append(f"{k.lib}\n{k.config} ({k.n:,})")
        ys.append(m)
        lo.append(a)
        hi.append(b)
        colors.append(COLORS.get(k.lib, "grey"))
    ax.bar(range(len(ys)), ys, color=colors, yerr=[lo, hi], capsize=2)
    ax.set_xticks(range(len(ys)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("jobs/s (log)")
    ax.set_title("Enqueue: single calls and the bulk API")


def _chart_pickup(res: Results, ax: Any) -> None:
    keys = sorted(res.keys("pickup"), key=_sort_key)
    if not keys:
        ax.set_axis_off()
        ax.set_title("Pickup latency: not measured")
        return
    libs = sorted({k.lib for k in keys}, key=lambda x: LIB_ORDER.get(x, 9))
    for j, metric in enumerate(("p50 ms", "p99 ms")):
        xs, ys, lo, hi, colors = [], [], [], [], []
        for i, lib in enumerate(libs):
            ks = [
                k
                for k in keys
                if k.lib == lib and k.metric == metric and not k.config.startswith("enqueue")
            ]
            if not ks:
                continue
            m, a, b = _err(res, ks[0])
            xs.append(i + (j - 0.5) * 0.4)
            ys.append(m)
            lo.append(a)
            hi.append(b)
            colors.append(COLORS.get(lib, "grey"))
        ax.bar(
            xs,
            ys,
            width=0.4,
            color=colors,
            yerr=[lo, hi],
            capsize=2,
            alpha=1.0 if j == 0 else 0.55,
            hatch=None if j == 0 else "//",
            label=metric.split()[0],
            edgecolor="black",
            linewidth=0.4,
        )
    # Issue 19's limits are the floor (skiplock's enqueue call, same samples) plus a slack.
    for metric, slack, style in (("p50 ms", 0.5, ":"), ("p99 ms", 2.0, "--")):
        floor = [k for k in keys if k.config.startswith("enqueue") and k.metric == metric]
        if floor:
            ax.axhline(res.median(floor[0]) + slack, color="red", linestyle=style, linewidth=1)
    ax.set_xticks(range(len(libs)))
    ax.set_xticklabels(libs)
    ax.set_ylabel("ms, enqueue to handler start")
    ax.set_title(
        "Pickup latency, idle workers (limits: skiplock's enqueue floor p50 + 0.5 ms dotted, "
        "p99 + 2 ms dashed)",
        fontsize=9,
    )
    ax.legend(fontsize=8)


def _chart_scaling(res: Results, ax: Any) -> None:
    items = [
        r
        for r in other_ratios(res, [])
        if r.per_round and ("claim" in r.label or "drain" in r.label)
    ]
    if not items:
        ax.set_axis_off()
        ax.set_title("Scaling: not measured")
        return
    labels = [r.label.replace(": ", ":\n") for r in items]
    meds = [r.median for r in items]
    lo = [
        m - min(r.per_round.values()) if r.per_round else 0
        for m, r in zip(meds, items, strict=True)
    ]
    hi = [
        max(r.per_round.values()) - m if r.per_round else 0
        for m, r in zip(meds, items, strict=True)
    ]
    ax.barh(range(len(items)), meds, xerr=[lo, hi], color=COLORS["skiplock"], capsize=2)
    for i, r in enumerate(items):
        if r.goal is not None:
            ax.plot([r.goal, r.goal], [i - 0.4, i + 0.4], color="red", linewidth=2)
    ax.axvline(1.0, color="black", linewidth=0.6)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ratio (median of per-round ratios; red: target)")
    ax.set_title("Scaling (skiplock): pending backlog, history, long transaction")
