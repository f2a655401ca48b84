"""The mode benchmark's report (`reflow bench modes`): the per-row table, the paired comparisons with
sync and with async, and the plot, from run results as `bench_modes.run_one` returns them ({"mode":
the row's name, "seed", "summary", "steps", "evals", "headroom"}).

Headline first: time to each target and the final held-out success, then new tokens/s (tokens of
groups trained for the first time) beside trained tokens/s with replays counted again. Per row every
figure is a mean over seeds with its 95% interval (t-distribution, `bench_stats`); the paired tables
compare each row with sync, then with async, seed by seed: the final held-out difference (mean@k,
greedy beside it), time to each target as a ratio in which a run that never reached it counts as the
budget (named), and every rate ratio names the rate it divides.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from reflow.recipes.bench_stats import (
    Interval,
    TimeRatio,
    mean_interval,
    paired_difference,
    paired_ratio,
    time_ratio,
)
from reflow.recipes.run_log import eval_kind, time_to_target

COUNTS = (
    "role_changes",
    "role_change_s",
    "tail_over_provisioned",
    "tail_carried_over",
    "tail_migrations",
    "lent_busy_s",
    "lent_stored_s",
    "lent_yields",
    "lent_handed_over",
)
"""Summary counters of the elastic pool and the tail scheduler (0 in runs that predate them)."""
ENGINE_USE = {
    "engine decode share": "engine_decode_share",
    "engine prefill share": "engine_prefill_share",
    "engine tokens/decode step": "engine_tokens_per_decode_step",
}
"""How the rollout engines spent the loop (`reflow.metrics.engine_use`; "-" for runs without it)."""
RATES = {
    "new tok/s": "new_trained_tokens_per_s",
    "trained tok/s (with replays)": "trained_tokens_per_s",
}
"""The trained-token rates, headline first: new work, then work with every replay counted again."""


def row_names(results: list[dict[str, Any]]) -> list[str]:
    """The rows in the order their first run appears (the benchmark runs them in the table's order)."""
    return list(dict.fromkeys(r["mode"] for r in results))


def final_heldout(run: dict[str, Any]) -> tuple[float, str]:
    """Held-out success at the end of a run and what measured it: the end-of-run measurement's mean@k
    (`eval.pass_at` samples per task on `eval.end_episodes` tasks; its greedy success without samples),
    else the curve's last point."""
    final = _final_measurement(run)
    if final is not None and final.get("samples_per_task"):
        return final["sampled_success"], f"mean@{final['samples_per_task']} on {final['tasks']} tasks"
    if final is not None:
        return final["greedy_success"], f"greedy on {final['tasks']} tasks"
    last = run["evals"][-1]
    what = f"{eval_kind(last)} on {last.get('episodes', '?')} tasks (the curve's last point)"
    return last["success_rate"], what


def _final_greedy(run: dict[str, Any]) -> float | None:
    """The end-of-run measurement's greedy success (None without one): reported beside mean@k."""
    final = _final_measurement(run)
    return None if final is None else final["greedy_success"]


def _final_measurement(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((h for h in run.get("headroom") or [] if h.get("when") == "final"), None)


def start_noise(results: list[dict[str, Any]]) -> float:
    """One standard error of the start's held-out success, sqrt(p (1 - p) / n) over its n episodes: a
    gain below it is one or two problems of the held-out set, not a measured improvement (0 when
    `episodes` is unknown). With sampled evaluation (k episodes per task, the same tasks at every
    point) n counts every episode: an upper bound of the sampling noise between points."""
    first = [r["evals"][0] for r in results]
    p = statistics.fmean(e["success_rate"] for e in first)
    n = min(e.get("episodes") or 0 for e in first)
    return math.sqrt(p * (1 - p) / n) if n else 0.0


def _step_mean(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.fmean(values) if values else None


def _reuse(run: dict[str, Any]) -> float:
    """Mean uses per consumed group (groups never trained left out)."""
    hist = {int(k): v for k, v in run["summary"]["reuse_hist"].items() if int(k) > 0}
    return sum(k * v for k, v in hist.items()) / max(1, sum(hist.values()))


def _caption(results: list[dict[str, Any]], targets: dict[str, float], budget_minutes: float) -> str:
    aim = (
        "Targets held-out success, fixed before the runs: "
        + ", ".join(f"{label} {value:.3f}" for label, value in targets.items())
        if targets
        else f"No target: the pilot did not improve on its start by more than the evaluation's noise"
        f" (±{start_noise(results):.3f}); time to target not measured"
    )
    finals = sorted({final_heldout(r)[1] for r in results})
    return (
        f"{aim}; budget {budget_minutes:g} min of training per run. Final held-out: {'; '.join(finals)}. "
        "Per row: mean ± the 95% interval's half-width over seeds (t-distribution; n in the seeds column, "
        "time to a target over the seeds that reached it). New tok/s counts the tokens of groups "
        "trained for the first time; trained tok/s counts every replay again."
    )


def table(results: list[dict[str, Any]], targets: dict[str, float] | None, budget_minutes: float) -> str:
    """The Markdown report: per row, the seeds, time to each target (and how many seeds reached it),
    the final held-out success, new and trained tokens/s, then throughput and the rollout engines'
    use of their time, idle ratios, staleness/reuse/IS columns (the M2PO trust region's dropped share
    of tokens among them), the share of the run's tool calls that did not parse and the elastic/tail
    counters; then `paired_table` against sync and against async."""
    targets = targets or {}
    head = [c for label in targets for c in (f"time to {label} (s)", f"reached {label}")]
    tail = [
        "final held-out", "final greedy", *RATES, "gen tok/s", *ENGINE_USE, "held-out at budget (curve)", "start", "rollout idle",
        "trainer idle", "train slot idle", "staleness mean", "reuse (mean uses/group)", "IS w mean", "IS w max",
        "masked frac", "m2 masked frac", "malformed calls", "steps", "role changes", "role change s", "over-provisioned", "carried over",
        "migrations", "lent s", "lent stored s", "lent yields", "lent handed over",
    ]  # fmt: skip
    columns = ["mode", "seeds", *head, *tail]
    rows = [
        _caption(results, targets, budget_minutes),
        "",
        "| " + " | ".join(columns) + " |",
        "| --- " * len(columns) + "|",
    ]
    for name in row_names(results):
        runs = [r for r in results if r["mode"] == name]
        reached = []
        for target in targets.values():
            hit = [t for r in runs if (t := time_to_target(r["evals"], target)) is not None]
            reached += [pm(mean_interval(hit)), f"{len(hit)}/{len(runs)}"]
        column = [
            [_final(r) for r in runs],
            [_final_greedy(r) for r in runs],
            *([r["summary"].get(key) for r in runs] for key in RATES.values()),
            [r["summary"]["generated_tokens_per_s"] for r in runs],
            *([r["summary"].get(key) for r in runs] for key in ENGINE_USE.values()),
            [r["evals"][-1]["success_rate"] for r in runs],
            [r["evals"][0]["success_rate"] for r in runs],
            [r["summary"]["rollout_idle_ratio"] for r in runs],
            [r["summary"]["trainer_idle_ratio"] for r in runs],
            [r["summary"].get("train_slot_idle_ratio", r["summary"]["trainer_idle_ratio"]) for r in runs],
            [_step_mean(r["steps"], "staleness_mean") for r in runs],
            [_reuse(r) for r in runs],
            [_step_mean(r["steps"], "w_mean") for r in runs],
            [max((s.get("w_max", 0.0) for s in r["steps"]), default=None) for r in runs],
            [_step_mean(r["steps"], "masked_frac") for r in runs],
            [_step_mean(r["steps"], "m2_masked_frac") for r in runs],  # the M2PO trust region's drop
            [r["summary"].get("malformed_call_share") for r in runs],  # of the run's tool calls
            [r["summary"]["steps"] for r in runs],
            *([r["summary"].get(key, 0) for r in runs] for key in COUNTS),
        ]
        cells = [name, str(len(runs)), *reached, *(pm(mean_interval(values)) for values in column)]
        rows.append("| " + " | ".join(cells) + " |")
    budget_s = budget_minutes * 60
    paired = (paired_table(results, targets, budget_s, base) for base in ("sync", "async"))
    return "\n".join(rows) + "\n" + "".join(paired)


def paired_table(
    results: list[dict[str, Any]], targets: dict[str, float] | None, budget_s: float, base: str = "sync"
) -> str:
    """Each row against `base` on the same seeds: the final held-out difference (mean of the per-seed
    differences, 95% interval) and the greedy one beside it, time to each target as base's time / the
    row's (geometric mean of the per-seed ratios, interval on the log scale; a run that never reached
    the target counts as the budget, `budget_s`, and is counted by side) and the token rates as
    row / base per seed. Empty without runs of `base` or of another row."""
    targets = targets or {}
    base_runs = [r for r in results if r["mode"] == base]
    others = [name for name in row_names(results) if name != base]
    if not base_runs or not others:
        return ""
    columns = [
        "mode", "seeds paired", f"final held-out - {base}", f"final greedy - {base}",
        *(f"time to {label}: {base} / row" for label in targets),
        *(f"{label}: row / {base}" for label in RATES),
    ]  # fmt: skip
    lines = [
        "",
        f"Against {base}, seed by seed (95% intervals over the paired seeds): held-out differences in "
        f"success rate; time ratios are {base}'s time / the row's (> 1: the row reached the target "
        f"sooner), geometric mean over the paired seeds, a run that never reached the target counted as "
        f"the {budget_s:g}-s budget and named (which flatters a row that missed); token rates as the "
        f"row's / {base}'s, new tok/s counting a group's first training only, trained tok/s every replay.",
        "",
        "| " + " | ".join(columns) + " |",
        "| --- " * len(columns) + "|",
    ]
    for name in others:
        runs = [r for r in results if r["mode"] == name]
        seeds = {r["seed"] for r in runs} & {r["seed"] for r in base_runs}
        cells = [name, str(len(seeds))]
        cells += [signed(paired_difference(*_per_seed(runs, base_runs, f))) for f in (_final, _final_greedy)]
        for target in targets.values():
            ratio = time_ratio(*_per_seed(runs, base_runs, _time_to(target)), budget=budget_s)
            cells.append(time_ratio_cell(ratio, base))
        for key in RATES.values():
            rate = paired_ratio(*_per_seed(runs, base_runs, lambda r, k=key: r["summary"].get(k)))
            cells.append(times(rate))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _per_seed(runs: list[dict[str, Any]], base: list[dict[str, Any]], value: Any) -> tuple[dict, dict]:
    """{seed: value(run)} of a row's runs and of the base row's."""
    return {r["seed"]: value(r) for r in runs}, {r["seed"]: value(r) for r in base}


def _final(run: dict[str, Any]) -> float:
    return final_heldout(run)[0]


def _time_to(target: float) -> Any:
    return lambda run: time_to_target(run["evals"], target)


def plot(results: list[dict[str, Any]], out: Path, targets: dict[str, float] | None) -> Path:
    """bench_modes.png: held-out success against training seconds, and new tokens/s over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    palette = plt.get_cmap("tab10").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(row_names(results))}
    first_seed = {name: min(r["seed"] for r in results if r["mode"] == name) for name in colors}
    for r in results:
        label = r["mode"] if r["seed"] == first_seed[r["mode"]] else None
        color = colors[r["mode"]]
        evals = r["evals"]
        axes[0].plot(
            [e["wall_s"] for e in evals],
            [e["success_rate"] for e in evals],
            "o-",
            color=color,
            alpha=0.6,
            label=label,
        )
        steps = [s for s in r["steps"] if s.get("new_trained_tokens_per_s") is not None]
        axes[1].plot(
            [s["wall_s"] for s in steps],
            [s["new_trained_tokens_per_s"] for s in steps],
            color=color,
            alpha=0.6,
            label=label,
        )
    for label, target in (targets or {}).items():
        axes[0].axhline(target, color="grey", linestyle="--", linewidth=1)
        axes[0].annotate(label, (0, target), color="grey", fontsize=8, va="bottom")
    axes[0].set(
        xlabel="training seconds (evaluation excluded)",
        ylabel=f"held-out success ({eval_kind(results[0]['evals'][-1])})",
        ylim=(0, 1),
    )
    axes[1].set(xlabel="training seconds", ylabel="new tokens/s, first use of a group (cumulative)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "bench_modes.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- table cells


def _number(x: float) -> str:
    """A table figure: integers above 100, else three significant digits (0 for |x| < 5e-4)."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    return "0" if abs(x) < 5e-4 else f"{x:.3g}"


def pm(i: Interval | None) -> str:
    """ "mean ± half-width" of a symmetric interval ("mean" alone for one seed, "-" for none)."""
    if i is None:
        return "-"
    if i.low is None or i.high is None:
        return _number(i.mean)
    return f"{_number(i.mean)} ± {_number((i.high - i.low) / 2)}"


def signed(i: Interval | None) -> str:
    """A difference: "+0.031 [-0.012, +0.074]" ("-" for none)."""
    return _bracketed(i, "+.3f")


def times(i: Interval | None) -> str:
    """A ratio: "1.42x [1.10, 1.83]" ("-" for none)."""
    return _bracketed(i, ".2f", "x")


def _bracketed(i: Interval | None, spec: str, suffix: str = "") -> str:
    """The mean, then the interval in brackets when there is one (format `spec`)."""
    if i is None:
        return "-"
    text = format(i.mean, spec) + suffix
    if i.low is None or i.high is None:
        return text
    return f"{text} [{format(i.low, spec)}, {format(i.high, spec)}]"


def time_ratio_cell(t: TimeRatio, base: str = "sync") -> str:
    """The ratio with its seed count and every seed that missed or has no ratio, by why (those that
    missed are in the ratio at the budget when it has one, else left out)."""
    parts = [f"n={t.ratio.n}" if t.ratio else "n=0"]
    for count, what in (
        (t.row_missed, "row never reached"),
        (t.base_missed, f"{base} never reached"),
        (t.neither, "neither reached"),
        (t.at_start, "met at the start"),
    ):
        if count:
            parts.append(f"{what} {count}")
    if t.budget is not None and t.row_missed + t.base_missed + t.neither:
        parts.append(f"missed = {t.budget:g} s")
    return f"{times(t.ratio)} ({', '.join(parts)})"
