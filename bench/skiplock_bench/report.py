"""The Markdown table and the PNG chart: per-round figures, medians, ratios, verdicts."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
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
    label: str
    per_round: dict[int, float]
    target: str = ""
    ok: Callable[[float], bool] | None = None

    @property
    def median(self) -> float:
        return median(self.per_round.values())

    def verdict(self) -> str:
        if self.ok is None:
            return ""
        m = self.median
        if math.isnan(m):
            return "not measured"
        return "met" if self.ok(m) else "**missed**"


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


def ratios(res: Results, sizes: list[int], c: int = 8) -> list[Ratio]:
    out: list[Ratio] = []
    n = min(sizes) if sizes else 0
    one = _find(res, "drain", "skiplock", n, "jobs/s", lambda s: s == f"c{c}: 1 process x {c}")
    multi = _find(
        res, "drain", "skiplock", n, "jobs/s", lambda s: s.startswith(f"c{c}:") and "processes" in s
    )
    s_one = res.series(one[0]) if one else {}
    s_best = _best_per_round(res, one + multi)
    best_label = "best of " + ", ".join(k.config.split(": ")[1] for k in one + multi)
    pgq = _find(res, "drain", "pgqueuer", n, "jobs/s", lambda s: s.startswith("defaults"))
    pgb = [k for k in res.values if k.section == "pgbench" and k.metric == "jobs/s"]
    # procrastinate runs at a smaller N (--slow-max-n); its rate, not its N, is compared.
    pro = _find(res, "drain", "procrastinate", None, "jobs/s", lambda s: s.startswith(f"c{c}:"))
    # Against pgqueuer at its defaults (target: 5x) and the pgbench ceiling (0.6x): the
    # best skiplock configuration, and one process when several were measured too.
    against = [
        (pgq, "pgqueuer defaults", "≥ 5", 5.0),
        (pgb, "pgbench ceiling", "≥ 0.6", 0.6),
    ]
    for keys, name, target, floor in against:
        if not keys:
            continue
        other = res.series(keys[0])
        out.append(
            Ratio(
                f"drain c{c}, N={n:,}: skiplock ({best_label}) / {name}",
                _div(s_best, other),
                target,
                lambda m, floor=floor: m >= floor,
            )
        )
        if multi:
            out.append(
                Ratio(f"drain c{c}, N={n:,}: skiplock 1 process / {name}", _div(s_one, other))
            )
    if pro:
        out.append(
            Ratio(
                f"drain c{c}, N={n:,}: skiplock ({best_label}) / procrastinate c{c}"
                f" (N={pro[0].n:,})",
                _div(s_best, res.series(pro[0])),
            )
        )
    # The deployed command against the library, both on the database's clock (issue 14).
    db_clock = DB_CLOCK
    lib_db = _find(res, "drain", "skiplock", n, db_clock, lambda s: s == f"c{c}: 1 process x {c}")
    cli_db = _find(
        res, "drain", "skiplock", n, db_clock, lambda s: s.startswith(f"c{c}: skiplock worker CLI")
    )
    if lib_db and cli_db:
        out.append(
            Ratio(
                f"drain c{c}, N={n:,}: `skiplock worker` CLI / in-process Worker (db clock)",
                res.ratio(cli_db[0], lib_db[0]),
                "≥ 0.9",
                lambda m: m >= 0.9,
            )
        )
    for big in sorted(sizes)[1:]:
        one_b = _find(res, "drain", "skiplock", big, "jobs/s", lambda s: s.startswith(f"c{c}:"))
        pgq_b = _find(res, "drain", "pgqueuer", big, "jobs/s", lambda s: s.startswith("defaults"))
        if one_b and pgq_b:
            out.append(
                Ratio(
                    f"drain c{c}, N={big:,}: skiplock (best) / pgqueuer defaults",
                    _div(_best_per_round(res, one_b), res.series(pgq_b[0])),
                )
            )
    for what, target, ok in (
        ("bulk", "≥ 2", lambda m: m >= 2),
        ("single", "≥ 1", lambda m: m >= 1),
    ):
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
                    f"enqueue {what} (N={sk[0].n:,}): skiplock / pgqueuer",
                    res.ratio(sk[0], pq[0]),
                    target,
                    ok,
                )
            )
    claims = sorted(
        (k for k in res.values if k.section == "claim" and k.metric == "p50 ms"), key=lambda k: k.n
    )
    if len(claims) >= 2:
        k_small, k_big = claims[0], claims[-1]
        out.append(
            Ratio(
                f"claim latency p50: {k_big.n:,} / {k_small.n:,} pending",
                res.ratio(k_big, k_small),
                "≤ 1.3",
                lambda m: m <= 1.3,
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
                Ratio(
                    f"drain {config} / fresh table",
                    res.ratio(k, base),
                    "≥ 0.9",
                    lambda m: m >= 0.9,
                )
            )
    longtx = hist.get("long transaction open")
    if fresh and longtx:
        out.append(
            Ratio("drain with a long transaction open / fresh table", res.ratio(longtx, fresh))
        )
    return out


def ratio_table(res: Results, items: list[Ratio]) -> list[str]:
    rounds = list(range(1, res.rounds + 1))
    head = ["ratio", *[f"run {r}" for r in rounds], "median", "target", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for it in items:
        row = [it.label, *[fmt(it.per_round.get(r, float("nan")), "ratio") for r in rounds]]
        row += [f"**{fmt(it.median, 'ratio')}**", it.target, it.verdict()]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def pickup_targets(res: Results) -> list[str]:
    lines = []
    for metric, limit in (("p50 ms", 2.0), ("p99 ms", 5.0)):
        ks = [
            k
            for k in res.values
            if k.section == "pickup"
            and k.lib == "skiplock"
            and k.metric == metric
            and not k.config.startswith("enqueue call")
        ]
        if not ks:
            continue
        m = res.median(ks[0])
        verdict = "not measured" if math.isnan(m) else ("met" if m <= limit else "**missed**")
        over = "" if math.isnan(m) or m <= limit else f" ({m / limit:.1f}x the limit)"
        lines.append(
            f"| pickup latency {metric.split()[0]} (skiplock, idle) | {fmt(m, 'ms')} ms | "
            f"≤ {limit:g} ms | {verdict}{over} |"
        )
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
    ax.axhline(2, color="red", linestyle=":", linewidth=1)
    ax.axhline(5, color="red", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(libs)))
    ax.set_xticklabels(libs)
    ax.set_ylabel("ms, enqueue to handler start")
    ax.set_title("Pickup latency, idle workers (targets: p50 ≤ 2 ms dotted, p99 ≤ 5 ms dashed)")
    ax.legend(fontsize=8)


def _chart_scaling(res: Results, ax: Any) -> None:
    items = [
        r for r in ratios(res, []) if r.per_round and ("claim" in r.label or "drain" in r.label)
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
        if r.target:
            val = float(r.target.split()[-1])
            ax.plot([val, val], [i - 0.4, i + 0.4], color="red", linewidth=2)
    ax.axvline(1.0, color="black", linewidth=0.6)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ratio (median of per-round ratios; red: target)")
    ax.set_title("Scaling (skiplock): pending backlog, history, long transaction")
