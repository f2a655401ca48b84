"""`reflow simulate`: run a scenario, validate against published figures, fit the free parameters.

    reflow simulate --config configs/sim/predict/qwen3-8b-32-reasoning.yaml [--mode async] [KEY=VALUE ...]
    reflow simulate --validate [--folder configs/sim/validate] [--only NAME ...] [--markdown] [--require 8]
    reflow simulate --fit configs/sim/calibration/verl-h20-7b.yaml
    reflow simulate --config configs/sim/predict/qwen3-8b-32-agentic.yaml --predict
    reflow simulate --config configs/sim/predict/*.yaml --predict --plot docs/sim-predictions.png
    reflow simulate --config configs/sim/predict/qwen3-8b-32-reasoning.yaml --sweep mode.cycle.max_reuse=1,2,4
    reflow simulate --plan --model-size 8B --gpus 32 --workload configs/sim/predict/qwen3-8b-32-agentic.yaml
    reflow simulate --from-run runs/bench-modes [--markdown]   # a run, or each run of a bench folder
    reflow simulate --config configs/sim/predict/drift/qwen3-8b-32-reasoning-drift.yaml --predict

Only argparse at import: the simulator is imported inside the handler, so `reflow --help` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from reflow.errors import ConfigError

MODES = ("sync", "one_step_off", "async", "reflow")
_SHOWN = (
    "seconds_per_step",
    "steps_per_s",
    "new_trained_tokens_per_s",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "samples_per_s",
    "rollout_idle_ratio",
    "trainer_idle_ratio",
    "trainer_wait_s",
    "train_s",
    "sync_s_mean",
    "staleness_mean",
    "replay_fraction",
    "partial_ratio",
    "group_seconds_p50",
    "group_seconds_p99",
    "response_tokens_mean",
    "turns_mean",
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a cluster run with the project's own policies (calibrated costs; results are simulated)",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--config",
        nargs="+",
        metavar="SCENARIO",
        help="a scenario YAML (configs/sim/...); several with --predict",
    )
    what.add_argument("--validate", action="store_true", help="run the published targets, exit 1 on a miss")
    what.add_argument("--fit", metavar="CALIBRATION", help="refit a calibration file's free parameters")
    what.add_argument(
        "--plan", action="store_true", help="recommend the rollout:train split, eta and K (needs --workload)"
    )
    what.add_argument(
        "--from-run",
        nargs="+",
        metavar="RUN",
        help="predict finished runs from their measured costs (a run folder or a bench modes folder); "
        "exit 1 when a figure misses by more than 15%%",
    )
    p.add_argument("--mode", choices=MODES, help="run the scenario in this mode instead of its own")
    p.add_argument("--modes", help="comma-separated modes to compare side by side")
    p.add_argument(
        "--predict",
        action="store_true",
        help="compare sync, async eta 1/2, reflow static and full (Markdown)",
    )
    p.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="--config: the --predict comparison at each value of one scenario key",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="--predict: a bar chart of new tokens/s (first use of a group) vs sync per scenario",
    )
    p.add_argument("--folder", default="configs/sim/validate", help="--validate: the scenario folder")
    p.add_argument("--only", nargs="*", help="--validate: only these target names")
    p.add_argument(
        "--require",
        type=int,
        metavar="N",
        help="--validate: exit 0 when at least N targets are within 15%% (default: every target)",
    )
    p.add_argument(
        "--markdown", action="store_true", help="--validate, --from-run: also print the table as Markdown"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the full summary as JSON (--validate: every target's figures)",
    )
    p.add_argument("--workload", help="--plan: a scenario YAML with the workload and cost model")
    p.add_argument("--model-size", help="--plan: the model, e.g. 8B (configs/sim/models/*-8b.yaml)")
    p.add_argument("--gpus", type=int, help="--plan: the cluster size")
    p.add_argument("--top", type=int, default=5, help="--plan: grid points shown")
    p.add_argument("--write", action="store_true", help="--fit: write the fitted values into the file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="scenario overrides, e.g. gpus=64")
    p.set_defaults(fn=cmd_simulate)


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return code


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        if args.validate:
            return _validate(args)
        if args.fit:
            return _fit(args)
        if args.plan:
            return _plan(args)
        if args.from_run:
            return _from_run(args)
        return _run(args)
    except ConfigError as e:
        return _fail(str(e))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from reflow.sim.config import ModeConfig, load_scenario
    from reflow.sim.simulation import simulate

    if args.sweep:
        return _sweep(args)
    if args.predict:
        return _predict(args)
    if len(args.config) > 1:
        return _fail("several --config files need --predict")
    s = load_scenario(args.config[0], args.overrides)
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else [args.mode] if args.mode else [None]
    bad = [m for m in modes if m is not None and m not in MODES]
    if bad:
        return _fail(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    results = []
    for m in modes:
        mode = (
            s.mode
            if m is None
            else (s.mode if s.mode.mode == m else ModeConfig(**{**_mode_defaults(s), "mode": m}))
        )
        results.append(simulate(s, mode))
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], default=str))
        return 0
    table = Table(title=f"{s.name}: {s.gpus} x {s.gpu.name}, {s.model.name} (simulated)")
    table.add_column("metric")
    for r in results:
        table.add_column(
            f"{r['mode']} {r['rollout_gpus']}:{r['train_gpus']}" if r["mode"] != "sync" else "sync"
        )
    for key in _SHOWN:
        table.add_row(key, *(f"{r[key]:.4g}" for r in results))
    table.add_row("staleness_hist", *(json.dumps(r["staleness_hist"]) for r in results))
    table.add_row("reuse_hist", *(json.dumps(r["reuse_hist"]) for r in results))
    table.add_row("policy events", *(str(len(r["events"])) for r in results))
    Console(width=None if sys.stdout.isatty() else 150).print(table)
    return 0


def _predict(args: argparse.Namespace) -> int:
    from reflow.sim.config import load_scenario
    from reflow.sim.predict import markdown, plot, predict

    results = {}
    for path in args.config:
        s = load_scenario(path, args.overrides)
        results[s.name] = rows = predict(s)
        print(markdown(s, rows) + "\n")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from reflow.sim.predict import sweep, sweep_markdown

    key, sep, values = args.sweep.partition("=")
    if not sep or not key or not values:
        return _fail(f"--sweep {args.sweep!r}: expected KEY=V1,V2,...")
    if len(args.config) > 1:
        return _fail("--sweep takes one --config file")
    rows = sweep(args.config[0], list(args.overrides), key, [v.strip() for v in values.split(",")])
    print(f"{args.config[0]}: {key} swept (simulated)\n")
    print(sweep_markdown(key, rows))
    return 0


def _mode_defaults(s: Any) -> dict[str, Any]:
    """Keep the scenario's split and bounds when only the mode name changes."""
    return s.mode.model_dump(exclude={"mode"})


def _validate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from reflow.sim.validate import TOLERANCE, markdown, summary_line, validate

    if not Path(args.folder).is_dir():
        return _fail(f"--folder {args.folder} is not a directory")
    results = validate(args.folder, args.only)
    if not results:
        return _fail(
            f"no validation scenarios in {args.folder}" + (f" named {args.only}" if args.only else "")
        )
    need = len(results) if args.require is None else args.require
    passed = sum(abs(r.error) <= TOLERANCE for r in results) >= need
    if args.json:  # every target's figures at full precision, for scripts and before/after checks
        rows = [{**dataclasses.asdict(r), "error": r.error, "passed": r.passed} for r in results]
        print(json.dumps(rows))
        return 0 if passed else 1
    table = Table(title="reflow simulate --validate (simulated vs published)")
    for col in ("target", "published", "simulated", "error", "sim s/step base -> cand", "fit", "source"):
        table.add_column(col)
    for r in results:
        err = f"{r.error:+.1%}"
        table.add_row(
            r.name,
            f"{r.published:.2f}x",
            f"{r.simulated:.2f}x",
            err if r.passed else f"[red]{err}[/red]",
            f"{r.baseline_step_s:.0f} -> {r.candidate_step_s:.0f}",
            "fitted" if r.in_sample else "held out",
            r.source,
        )
    console = Console(width=None if sys.stdout.isatty() else 170)
    console.print(table)
    console.print(summary_line(results))
    if args.markdown:
        print(markdown(results))
    return 0 if passed else 1


def _from_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from reflow.sim.from_run import SHOWN, TOLERANCE, compare, markdown
    from reflow.sim.measured import measure, run_folders

    results = [compare(measure(run)) for arg in args.from_run for run in run_folders(arg)]
    console = Console(width=None if sys.stdout.isatty() else 150)
    for c in results:
        m = c.measurement
        table = Table(
            title=f"{m.run_dir}: mode {m.mode}, {m.steps} steps in {m.wall_s:.0f} s (simulated vs measured)"
        )
        for col in ("figure", "measured", "simulated", "error"):
            table.add_column(col)
        for r in c.rows:
            err = f"{r.error:+.1%}" if r.relative else f"{100 * r.error:+.1f} pt"
            table.add_row(
                r.name, f"{r.measured:.4g}", f"{r.simulated:.4g}", err if r.passed else f"[red]{err}[/red]"
            )
        for key in [k for k in c.simulated if k not in SHOWN[: len(c.rows)]]:
            table.add_row(key, f"{m.extra.get(key, float('nan')):.4g}", f"{c.simulated[key]:.4g}", "")
        console.print(table)
        costs = ", ".join(f"{k} {v:.4g}" for k, v in m.costs.items())
        console.print(f"measured costs fed in: {costs}")
    ok = sum(c.passed for c in results)
    console.print(
        f"{ok} of {len(results)} runs within {TOLERANCE:.0%} on every figure "
        "(rates relative; idle ratios in points of time)"
    )
    if args.markdown:
        print(markdown(results))
    return 0 if ok == len(results) else 1


def _plan(args: argparse.Namespace) -> int:
    from reflow.sim.config import load_scenario
    from reflow.sim.plan import markdown, model_file, plan

    if not args.workload:
        return _fail("--plan needs --workload SCENARIO.yaml")
    if not Path(args.workload).is_file():
        return _fail(f"workload file {args.workload} does not exist")
    over = list(args.overrides)
    if args.gpus is not None:
        if args.gpus < 2:
            return _fail("--gpus must be at least 2 (a rollout and a trainer GPU)")
        over.append(f"gpus={args.gpus}")
    s = load_scenario(args.workload, over)
    if args.model_size:
        import yaml

        from reflow.sim.config import ModelSpec

        model = yaml.safe_load(model_file(args.model_size).read_text())["model"]
        s = s.model_copy(update={"model": ModelSpec(**model)})
    print(markdown(s, plan(s), top=args.top))
    return 0


def _fit(args: argparse.Namespace) -> int:
    import yaml

    from reflow.sim.fit import fit, write_back

    if not Path(args.fit).is_file():
        return _fail(f"calibration file {args.fit} does not exist")
    values = fit(args.fit, log=lambda line: print(line, file=sys.stderr))
    if args.write:
        write_back(args.fit, values)
    nested: dict[str, Any] = {}
    for key, value in values.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    print(yaml.safe_dump(nested, sort_keys=False), end="")
    return 0
