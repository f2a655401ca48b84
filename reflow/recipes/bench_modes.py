"""`reflow bench modes`: sync, async and reflow on identical hardware, initial weights, task order and
seeds; a Markdown table and PNG plots of what each mode buys.

    reflow bench modes --config configs/calc-tiny.yaml --seeds 3 --budget-minutes 4 [--ablations]

`--ablations` adds mode reflow with parts switched off beside the three modes (`ABLATIONS`):
`reflow-static` (the dual replay cycle only: static slots, no tail scheduler) and `reflow-no-tail`
(the elastic pool on, the tail scheduler off), so each part shows its own share of the gain; the
table's last columns count role changes (and their measured cost) and tail actions.

Every run gets the same wall-clock training budget (evaluation excluded: weights are snapshotted at
each evaluation point and evaluated after the run, so evaluation never competes with training) and
starts from the same cached warm start. Time to target is the training time at the first held-out
evaluation at or above a target, and the targets are fixed before the measured runs: `--target X`,
or (the default) a pilot run of mode sync on a seed outside the measured ones, whose gain at the
budget sets three targets, start + 50%, 75% and 90% of it (`pilot_targets`), written to
`OUT/targets.json` before the first measured run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

MODES = ("sync", "async", "reflow")
ABLATIONS: dict[str, list[str]] = {
    "reflow-static": ["elastic.enabled=false", "tail.enabled=false"],
    "reflow-no-tail": ["tail.enabled=false"],
}
"""Rows of mode reflow with parts switched off: row name -> config overrides."""
ROWS = (*MODES, *ABLATIONS)
"""Every row the table can have, in its order."""
PLAIN = ["elastic.enabled=null", "tail.enabled=null"]
"""Overrides of the sync and async rows (and the sync pilot): the mode as it is, the elastic pool and
tail scheduler at their defaults (off outside reflow), whatever the config file switches on."""
COUNTS = ("role_changes", "role_change_s", "tail_over_provisioned", "tail_carried_over", "tail_migrations")
"""Summary counters of the elastic pool and the tail scheduler (0 in runs that predate them)."""


def variants(ablations: bool) -> list[tuple[str, str, list[str]]]:
    """(row name, mode, overrides) of each run per seed."""
    rows = [(mode, mode, [] if mode == "reflow" else PLAIN) for mode in MODES]
    if ablations:
        rows += [(name, "reflow", extra) for name, extra in ABLATIONS.items()]
    return rows


def run_one(
    config_path: str, name: str, mode: str, seed: int, extra: list[str], budget_minutes: float, out_dir: Path,
    log: Any,
) -> dict[str, Any]:  # fmt: skip
    """One run of the benchmark (a fresh run dir named after the row and seed): its summary, step and
    evaluation records."""
    from reflow.config import load_config
    from reflow.recipes.agent_train import train
    from reflow.recipes.run_log import read_metrics

    config = load_config(
        config_path,
        [
            *extra,
            f"mode={mode}",
            f"seed={seed}",
            f"run_name=bench-{name}-seed{seed}",
            f"out_dir={out_dir}",
            f"train.seconds={budget_minutes * 60}",
            "train.steps=100000",
            "eval.deferred=true",
        ],
    )
    shutil.rmtree(config.run_dir, ignore_errors=True)  # a rerun starts clean
    log(f"[bold]bench[/bold] {name} seed {seed}: {budget_minutes} min budget")
    summary = train(config)
    steps = read_metrics(config.run_dir, "step")
    evals = read_metrics(config.run_dir, "eval")
    return {"mode": name, "seed": seed, "summary": summary, "steps": steps, "evals": evals}


def run_pilot(
    config_path: str, seeds: int, budget_minutes: float, out_dir: Path, overrides: list[str], log: Any
) -> dict[str, Any]:
    """Mode sync on seed `seeds`, one past the measured ones, so the target is not fitted to them."""
    return run_one(config_path, "pilot", "sync", seeds, [*overrides, *PLAIN], budget_minutes, out_dir, log)


def run_modes(
    config_path: str,
    seeds: int,
    budget_minutes: float,
    out_dir: Path,
    overrides: list[str],
    log: Any,
    ablations: bool = False,
) -> list[dict[str, Any]]:
    return [
        run_one(config_path, name, mode, seed, [*overrides, *extra], budget_minutes, out_dir, log)
        for seed in range(seeds)
        for name, mode, extra in variants(ablations)
    ]


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{_number(mean)} ± {_number(spread)}"


def _number(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:.0f}"
    return "0" if abs(x) < 5e-4 else f"{x:.3g}"


def _step_mean(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.fmean(values) if values else None


def start_noise(results: list[dict[str, Any]]) -> float:
    """One standard error of the start's held-out success, sqrt(p (1 - p) / n) over its n episodes: a
    gain below it is one or two problems of the held-out set, not a measured improvement (0 when
    `episodes` is unknown). With sampled evaluation (k episodes per task, the same tasks at every
    point) n counts every episode: an upper bound of the sampling noise between points."""
    first = [r["evals"][0] for r in results]
    p = statistics.fmean(e["success_rate"] for e in first)
    n = min(e.get("episodes") or 0 for e in first)
    return math.sqrt(p * (1 - p) / n) if n else 0.0


GAIN_SHARES = (0.5, 0.75, 0.9)
"""The pilot's gain shares that set the targets (time to 50%, 75% and 90% of the gain)."""


def pilot_targets(pilot: dict[str, Any], shares: tuple[float, ...] = GAIN_SHARES) -> dict[str, float] | None:
    """Targets from a pilot run, fixed before the measured runs: {"50%": start + 0.5 gain, ...} with gain
    = held-out success at the budget (the last evaluation) - the start; None when the gain is within
    the evaluation's noise (`start_noise`), where time to such a target would measure nothing."""
    start, end = pilot["evals"][0]["success_rate"], pilot["evals"][-1]["success_rate"]
    if end - start <= start_noise([pilot]):
        return None
    return {f"{share:.0%}": round(start + share * (end - start), 3) for share in shares}


def table(results: list[dict[str, Any]], targets: dict[str, float] | None, budget_minutes: float) -> str:
    """The Markdown table: per row, time to each target (seeds that reached it, n shown), held-out at
    the budget, throughput, idle ratios, staleness/reuse/IS columns and the elastic/tail counters; then
    how much sooner than sync each row reached each target (ratio of the mean times)."""
    from reflow.recipes.run_log import time_to_target

    targets = targets or {}
    aim = (
        "Targets held-out success, fixed before the runs: "
        + ", ".join(f"{label} {value:.3f}" for label, value in targets.items())
        if targets
        else f"No target: the pilot did not improve on its start by more than the evaluation's noise"
        f" (±{start_noise(results):.3f}); time to target not measured"
    )
    head = [c for label in targets for c in (f"time to {label} (s)", f"reached {label}")]
    tail = [
        "held-out at budget", "start", "gen tok/s", "trained tok/s", "rollout idle", "trainer idle",
        "staleness mean", "reuse (mean uses/group)", "IS w mean", "IS w max", "masked frac", "steps",
        "role changes", "role change s", "over-provisioned", "carried over", "migrations",
    ]  # fmt: skip
    columns = ["mode", *head, *tail]
    rows = [
        f"{aim}; budget {budget_minutes:g} min of training per run; "
        f"mean ± std over {len({r['seed'] for r in results})} seeds.",
        "",
        "| " + " | ".join(columns) + " |",
        "| --- " * len(columns) + "|",
    ]
    mean_time: dict[tuple[str, str], float] = {}
    for mode in ROWS:
        runs = [r for r in results if r["mode"] == mode]
        if not runs:
            continue
        reached = []
        for label, target in targets.items():
            times = [t for r in runs if (t := time_to_target(r["evals"], target)) is not None]
            if times:
                mean_time[mode, label] = statistics.fmean(times)
            reached += [_mean_std(times), f"{len(times)}/{len(runs)}"]
        reuse = []
        for r in runs:
            hist = {int(k): v for k, v in r["summary"]["reuse_hist"].items() if int(k) > 0}
            reuse.append(sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())))
        cells = [
            mode,
            *reached,
            _mean_std([r["evals"][-1]["success_rate"] for r in runs]),
            _mean_std([r["evals"][0]["success_rate"] for r in runs]),
            _mean_std([r["summary"]["generated_tokens_per_s"] for r in runs]),
            _mean_std([r["summary"]["trained_tokens_per_s"] for r in runs]),
            _mean_std([r["summary"]["rollout_idle_ratio"] for r in runs]),
            _mean_std([r["summary"]["trainer_idle_ratio"] for r in runs]),
            _mean_std([_step_mean(r["steps"], "staleness_mean") for r in runs]),
            _mean_std(reuse),
            _mean_std([_step_mean(r["steps"], "w_mean") for r in runs]),
            _mean_std([max((s.get("w_max", 0.0) for s in r["steps"]), default=None) for r in runs]),
            _mean_std([_step_mean(r["steps"], "masked_frac") for r in runs]),
            _mean_std([r["summary"]["steps"] for r in runs]),
            *(_mean_std([r["summary"].get(key, 0) for r in runs]) for key in COUNTS),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    sooner = [
        f"{mode} {mean_time['sync', label] / mean_time[mode, label]:.2f}x at {label}"
        for label in targets
        for mode in ROWS
        if mode != "sync" and (mode, label) in mean_time and mean_time.get(("sync", label))
    ]
    if sooner:
        rows += [
            "",
            "Sooner than sync (sync's mean time / the row's, seeds that reached it): "
            + "; ".join(sooner)
            + ".",
        ]
    return "\n".join(rows) + "\n"


def plot(results: list[dict[str, Any]], out: Path, targets: dict[str, float] | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {
        "sync": "tab:blue",
        "async": "tab:orange",
        "reflow": "tab:green",
        "reflow-static": "tab:olive",
        "reflow-no-tail": "tab:cyan",
    }
    for r in results:
        evals = r["evals"]
        label = r["mode"] if r["seed"] == 0 else None
        axes[0].plot(
            [e["wall_s"] for e in evals],
            [e["success_rate"] for e in evals],
            "o-",
            color=colors[r["mode"]],
            alpha=0.6,
            label=label,
        )
        axes[1].plot(
            [s["wall_s"] for s in r["steps"]],
            [s.get("trained_tokens_per_s", 0) for s in r["steps"]],
            color=colors[r["mode"]],
            alpha=0.6,
            label=label,
        )
    for label, target in (targets or {}).items():
        axes[0].axhline(target, color="grey", linestyle="--", linewidth=1)
        axes[0].annotate(label, (0, target), color="grey", fontsize=8, va="bottom")
    from reflow.recipes.run_log import eval_kind

    axes[0].set(
        xlabel="training seconds (evaluation excluded)",
        ylabel=f"held-out success ({eval_kind(results[0]['evals'][-1])})",
        ylim=(0, 1),
    )
    axes[1].set(xlabel="training seconds", ylabel="trained tokens/s (cumulative)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "bench_modes.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("modes", help="sync vs async vs reflow at equal hardware and budget")
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--budget-minutes", type=float, default=4.0, help="training wall-clock per run")
    p.add_argument(
        "--target",
        type=float,
        help="held-out success target fixed by hand (default: three from a sync pilot run, see the module docs)",
    )
    p.add_argument("--out", default="runs/bench-modes")
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also run reflow-static (elastic pool and tail scheduler off) and reflow-no-tail",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the table and plot from OUT/bench_modes.json (e.g. with a --target fixed by hand), no runs",
    )
    p.set_defaults(fn=cmd_bench_modes)


def cmd_bench_modes(args: argparse.Namespace) -> int:
    from reflow.console import console

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_minutes
    if args.report_only:
        saved = json.loads((out / "bench_modes.json").read_text())
        results, budget, targets = saved["results"], saved.get("budget_minutes", budget), saved.get("targets")
        if args.target is not None:
            targets = {"target": args.target}
    else:
        if args.target is not None:
            targets, pilot = {"target": args.target}, None
        else:
            pilot = run_pilot(args.config, args.seeds, budget, out, args.overrides, console.print)
            targets = pilot_targets(pilot)
        (out / "targets.json").write_text(json.dumps({"targets": targets, "pilot": pilot}, default=str))
        console.print(f"targets (fixed before the measured runs): {targets}")
        results = run_modes(
            args.config, args.seeds, budget, out, args.overrides, console.print, args.ablations
        )
    markdown = table(results, targets, budget)
    (out / "bench_modes.md").write_text(markdown)
    report = {"targets": targets, "budget_minutes": budget, "results": results}
    (out / "bench_modes.json").write_text(json.dumps(report, default=str))
    png = plot(results, out, targets)
    console.print(markdown)
    console.print(f"table: {out / 'bench_modes.md'}, plot: {png}")
    return 0
