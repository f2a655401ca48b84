"""`reflow bench modes`: sync, async and reflow on identical hardware, initial weights, task order and
seeds; a Markdown table and PNG plots of what each mode buys.

    reflow bench modes --config configs/calc-tiny.yaml --seeds 3 --budget-minutes 4 [--ablations]
    reflow bench modes --config configs/calc-short.yaml KEY=VALUE ... \\
        --rows reflow-k3=replay.max_reuse=3 async-eta2=mode=async,replay.eta=2

Rows (`bench_rows`): sync, async and reflow always; `--ablations` adds one part switched on or off:
`sync-tail` (sync with the tail scheduler: over-provisioning and partial rollouts), `reflow-static`
(the dual replay cycle only: static slots, no tail scheduler) and `reflow-no-tail` (the elastic pool
on, the tail scheduler off) and `reflow-lend` (an engine lent beside the trainer rank while it
waits), so each part shows its own share of the gain. `--rows` adds rows of your own, each `NAME=KEY=VALUE[,KEY=VALUE...]`: a name (letters,
digits, `.`, `_`, `-`), then config overrides separated by commas (a comma inside a value, as in
`resources.slots=[rollout,train]`, stays in it: a new override starts only where `KEY=` follows).
The row's mode is its `mode=` override, reflow when it has none; a sync or async row starts from the
plain mode (`PLAIN`) as the built-in ones do. Give overrides for every row before `--rows`: what
follows it is read as rows.

Every run gets the same wall-clock training budget (evaluation excluded: weights are snapshotted at
each evaluation point and evaluated after the run, so evaluation never competes with training) and
starts from the same cached warm start. Time to target is the training time at the first held-out
evaluation at or above a target, and the targets are fixed before the measured runs: `--target X`,
or (the default) a pilot run of mode sync on a seed outside the measured ones (seed N for `--seeds
N`), whose gain at the budget sets three targets, start + 50%, 75% and 90% of it (`pilot_targets`),
written to `OUT/targets.json` before the first measured run. The final held-out success is measured
after the run on at least `FINAL_TASKS` held-out tasks (or `--final-tasks`; greedy; the `eval.pass_at` measurement on
`eval.end_episodes` tasks, which the benchmark turns on), while the curve's points keep
`eval.episodes`. That measurement is taken at the start only in the pilot: every run starts from the
same warm start, so the measured runs would repeat its figure.

In parts: each run's result is written as it finishes, to `OUT/runs/<row>-seed<k>.json` with what
it was run with (the config file's hash, its mode, seed, overrides and budget), and a later call with
the same `--out` reuses the runs already done (the pilot too) and runs the rest. A stored run that
was run with anything else is refused before anything runs, in one line naming it: use another
`--out`, or delete that file to run it again.

The table (`bench_table`): per row, means over seeds with 95% intervals, time to quality and the
final held-out success first, then new tokens/s (groups trained for the first time) beside trained
tokens/s with replays; then each row against sync, paired by seed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.errors import UsageError
from reflow.recipes.bench_rows import PILOT, PLAIN, ROWS, parse_rows, select_rows, variants
from reflow.recipes.bench_table import plot, start_noise, table

FINAL_TASKS = 300
"""Held-out tasks of the final evaluation at least (`eval.end_episodes`)."""
DEFAULT_EVERY_S = 30.0
"""Seconds between evaluation points when the config and the command line set no `eval.every_s`."""


def _final_eval_overrides(
    config_path: str, overrides: list[str], final_tasks: int | None = None
) -> list[str]:
    """Overrides that make the end-of-run measurement (`eval.pass_at`, greedy on `eval.end_episodes`
    tasks) run on at least FINAL_TASKS tasks, keeping the config's own when larger; on `final_tasks`
    (`--final-tasks`) when given."""
    from reflow.config import load_config

    ev = load_config(config_path, overrides).eval
    if not ev.episodes:
        raise UsageError("the benchmark measures held-out success: eval.episodes must be > 0")
    final = [
        f"eval.pass_at={max(ev.pass_at, 1)}",
        f"eval.end_episodes={final_tasks or max(ev.end_episodes, FINAL_TASKS)}",
    ]
    # Modes are compared on one clock: evaluation points on a wall-clock grid, so a mode that steps
    # faster is not also evaluated more often (a config evaluating every N steps gets the default grid).
    clock = [] if ev.every_s is not None else ["eval.every=0", f"eval.every_s={DEFAULT_EVERY_S:g}"]
    return [*final, *clock]


def run_one(
    config_path: str, name: str, mode: str, seed: int, extra: list[str], budget_minutes: float, out_dir: Path,
    log: Any,
) -> dict[str, Any]:  # fmt: skip
    """One run of the benchmark (a fresh run dir named after the row and seed): its summary, step,
    evaluation and end-of-run measurement records."""
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
            # every run starts from the same cached warm start: its start figure is the pilot's alone
            # (the same weights and task seeds measure the same figure; minutes a run on 2 cores)
            f"eval.pass_at_start={str(name == PILOT).lower()}",
        ],
    )
    shutil.rmtree(config.run_dir, ignore_errors=True)  # a rerun starts clean
    log(f"[bold]bench[/bold] {name} seed {seed}: {budget_minutes} min budget")
    summary = train(config)
    steps = read_metrics(config.run_dir, "step")
    evals = read_metrics(config.run_dir, "eval")
    headroom = read_metrics(config.run_dir, "headroom")
    return {
        "mode": name,
        "seed": seed,
        "summary": summary,
        "steps": steps,
        "evals": evals,
        "headroom": headroom,
    }


@dataclass(frozen=True)
class Job:
    """One run of the benchmark and what it is run with (`spec`, stored with its result)."""

    name: str
    mode: str
    seed: int
    overrides: list[str]
    spec: dict[str, Any]

    def path(self, out: Path) -> Path:
        return out / "runs" / f"{self.name}-seed{self.seed}.json"


def make_job(
    config_path: str,
    name: str,
    mode: str,
    seed: int,
    overrides: list[str],
    budget_minutes: float,
    final_tasks: int | None = None,
) -> Job:
    """The job of row `name` on `seed`: `overrides` (the command line's, then the row's) plus the final
    evaluation's (on `final_tasks` held-out tasks when given)."""
    final = _final_eval_overrides(config_path, [*overrides, f"mode={mode}"], final_tasks)
    overrides = [*overrides, *final]
    spec = {
        "config_sha256": hashlib.sha256(Path(config_path).read_bytes()).hexdigest(),
        "mode": mode,
        "seed": seed,
        "budget_minutes": budget_minutes,
        "overrides": overrides,
    }
    return Job(name, mode, seed, overrides, spec)


def stored_result(job: Job, out: Path) -> dict[str, Any] | None:
    """The job's stored result, None when it has none; UsageError when it is unreadable or was run
    with anything else than `job.spec`."""
    path = job.path(out)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        spec = saved["spec"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(f"{path} is not a benchmark result: delete it to run it again") from None
    if spec == job.spec:
        return saved
    key = next(k for k in job.spec if spec.get(k) != job.spec[k])
    was, now = spec.get(key), job.spec[key]
    if key == "overrides":
        was = [o for o in was or [] if o not in now] or "fewer"
        now = [o for o in now if o not in (spec.get(key) or [])] or "fewer"
    raise UsageError(
        f"{path} was run with {key} {was} and this benchmark has {now}: use another --out, or delete "
        "the file to run it again"
    )


def run_or_reuse(config_path: str, job: Job, budget_minutes: float, out: Path, log: Any) -> dict[str, Any]:
    """The job's stored result, or run it and store its result (with its spec) as it finishes."""
    saved = stored_result(job, out)
    if saved is not None:
        log(f"bench {job.name} seed {job.seed}: reused {job.path(out)}")
        return saved
    result = run_one(config_path, job.name, job.mode, job.seed, job.overrides, budget_minutes, out, log)
    result = {**result, "spec": job.spec}
    path = job.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, path)  # whole or absent: a kill mid-write leaves no half result to reuse
    return result


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from reflow.recipes import bench_lending

    bench_lending.add_parser(bench_sub)  # `reflow bench lending`
    p = bench_sub.add_parser(
        "modes",
        help="sync vs async vs reflow at equal hardware and budget",
        description="Run each row on each seed for the same training budget; report time to targets, "
        "the final held-out success and new tokens/s with 95% intervals, and each row against "
        "sync seed by seed. A re-run with the same --out reuses the runs already done.",
    )
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides of every run")
    p.add_argument("--seeds", type=int, default=3, help="measured seeds 0..N-1 (the pilot runs on seed N)")
    p.add_argument("--budget-minutes", type=float, default=4.0, help="training wall-clock per run")
    p.add_argument(
        "--target",
        type=float,
        help="held-out success target fixed by hand (default: three from a sync pilot run, see the module docs)",
    )
    p.add_argument(
        "--final-tasks",
        type=int,
        help=f"the end-of-run measurement's held-out tasks (default: the config's eval.end_episodes, at "
        f"least {FINAL_TASKS}): fewer where long episodes make it cost more than the run itself",
    )
    p.add_argument(
        "--out",
        default="runs/bench-modes",
        help="results (each run in OUT/runs/ as it finishes); a re-run with it skips the runs done",
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also run sync-tail (sync with the tail scheduler), reflow-static (elastic pool and tail "
        "scheduler off) and reflow-no-tail",
    )
    p.add_argument(
        "--rows",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=KEY=VALUE,KEY=VALUE",
        help="rows of your own beside the built-in ones, e.g. async-eta2=mode=async,replay.eta=2 "
        "(mode: the row's mode=, reflow by default; give overrides for every row before --rows)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        action="extend",
        default=[],
        metavar="ROW",
        help="run only these rows (built-in, --ablations or --rows names), e.g. --ablations --only sync "
        "sync-tail reflow reflow-lend; the table then holds every run stored in --out",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the table and plot from OUT/bench_modes.json, or the runs stored in OUT/runs "
        "(e.g. with a --target fixed by hand), no runs",
    )
    p.set_defaults(fn=cmd_bench_modes)


def _report_inputs(out: Path) -> tuple[list[dict[str, Any]], float | None, dict[str, float] | None]:
    """(results, budget, targets) of `--report-only`: the last full report, else the runs stored so far."""
    report = out / "bench_modes.json"
    if report.is_file():
        saved = json.loads(report.read_text())
        return saved["results"], saved.get("budget_minutes"), saved.get("targets")
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    results = _measured(runs)
    if not results:
        raise UsageError(f"--report-only: no bench_modes.json and no stored runs in {out}")
    targets_file = out / "targets.json"
    pilots = [r for r in runs if r["mode"] == PILOT]
    if targets_file.is_file():
        targets = json.loads(targets_file.read_text())["targets"]
    else:  # runs copied without it (e.g. from an archive): the stored pilot fixes the same targets
        targets = pilot_targets(pilots[0]) if pilots else None
    return results, results[0]["spec"]["budget_minutes"], targets


def _measured(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured runs (not the pilot), by seed, built-in rows in the table's order, then the others."""
    rank = {name: i for i, name in enumerate(ROWS)}
    results = [r for r in runs if r["mode"] != PILOT]
    return sorted(results, key=lambda r: (r["seed"], rank.get(r["mode"], len(rank)), r["mode"]))


def cmd_bench_modes(args: argparse.Namespace) -> int:
    from reflow.console import console

    out = Path(args.out)
    budget = args.budget_minutes
    if args.report_only:
        results, saved_budget, targets = _report_inputs(out)
        budget = saved_budget or budget
        if args.target is not None:
            targets = {"target": args.target}
    else:
        if args.seeds < 1:
            raise UsageError(f"--seeds {args.seeds}: at least one seed")
        if args.final_tasks is not None and args.final_tasks < 1:
            raise UsageError(f"--final-tasks {args.final_tasks}: at least one task")
        rows = select_rows(variants(args.ablations, parse_rows(args.rows)), args.only)
        jobs = [
            make_job(args.config, name, mode, seed, [*args.overrides, *extra], budget, args.final_tasks)
            for seed in range(args.seeds)
            for name, mode, extra in rows
        ]
        pilot_job = None
        if args.target is None:
            plain = [*args.overrides, *PLAIN]
            pilot_job = make_job(args.config, PILOT, "sync", args.seeds, plain, budget, args.final_tasks)
        for job in [pilot_job, *jobs] if pilot_job else jobs:  # refuse a mismatch before running anything
            stored_result(job, out)
        out.mkdir(parents=True, exist_ok=True)
        if pilot_job is None:
            targets, pilot = {"target": args.target}, None
        else:
            pilot = run_or_reuse(args.config, pilot_job, budget, out, console.print)
            targets = pilot_targets(pilot)
        (out / "targets.json").write_text(json.dumps({"targets": targets, "pilot": pilot}, default=str))
        console.print(f"targets (fixed before the measured runs): {targets}")
        results = [run_or_reuse(args.config, job, budget, out, console.print) for job in jobs]
        if args.only:  # the table holds every run stored in OUT, those of earlier calls too
            stored = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
            results = _measured(stored)
    markdown = table(results, targets, budget)
    (out / "bench_modes.md").write_text(markdown)
    report = {"targets": targets, "budget_minutes": budget, "results": results}
    (out / "bench_modes.json").write_text(json.dumps(report, default=str))
    png = plot(results, out, targets)
    console.print(markdown)
    console.print(f"table: {out / 'bench_modes.md'}, plot: {png}")
    return 0
