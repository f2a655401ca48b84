"""Commands on a trained model: `reflow eval` measures it on a run config's held-out tasks, `reflow
export` writes it as a plain Hugging Face folder for serving.

    reflow eval --config configs/calc-short.yaml --model runs/calc-short     # its latest checkpoint
    reflow eval --model runs/calc-short/checkpoints/step-000070 --pass-at 8 --json eval.json
    reflow export runs/calc-short exported/calc-short                       # then serve it anywhere

A model argument is a preset name, an HF folder, a checkpoint folder (`step-000070/`) or a run folder
(its latest checkpoint; its `config.yaml` is the default `--config`). Evaluation plays the config's env
with its kwargs (`eval.env_kwargs` when set) on the held-out task seeds, exactly as a run's own start
and end measurement does (`RolloutWorker.headroom`): one greedy episode per task, then `--pass-at` K
sampled ones at the rollout temperature (mean@K, pass@K and the RL headroom).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from reflow.config import RunConfig, load_config
from reflow.errors import UsageError
from reflow.folders import publish_dir, staging_dir
from reflow.records import EpisodeRecord, write_records

CHECKPOINTS = "checkpoints"
EXPORT_INFO = "reflow_export.json"


def model_folder(arg: str) -> str:
    """What a model argument names: a run folder gives its latest checkpoint, anything else (a
    checkpoint or HF folder, a preset name) is returned as given."""
    path = Path(arg).expanduser()
    if (path / "config.json").is_file() or not path.is_dir():
        return arg
    if (path / CHECKPOINTS).is_dir() or (path / "config.yaml").is_file():
        from reflow.train.trainer_state import latest_checkpoint

        found = latest_checkpoint(path / CHECKPOINTS)
        if found is None:
            raise UsageError(f"run folder {arg} has no finished checkpoint under {CHECKPOINTS}/")
        return str(found)
    raise UsageError(f"{arg} is neither a model folder (config.json), a checkpoint nor a run folder")


def eval_config(config_arg: str | None, model_arg: str, overrides: list[str]) -> RunConfig:
    """The run config an evaluation reads its env, kwargs and sampling from: `--config`, else the run
    folder's own `config.yaml`."""
    if config_arg is None:
        run_config = Path(model_arg).expanduser() / "config.yaml"
        if not run_config.is_file():
            raise UsageError("give --config (the run config whose env and held-out tasks to use)")
        config_arg = str(run_config)
    return load_config(config_arg, overrides)


async def play_held_out(
    config: RunConfig, model_path: str, episodes: int, pass_at: int, first_task: int = 0
) -> tuple[list[EpisodeRecord], list[EpisodeRecord], float]:
    """Greedy episodes on `episodes` held-out tasks from the `first_task`-th on, then `pass_at` sampled
    ones on each (none when 0), on one in-process rollout worker; and the greedy half's seconds."""
    from reflow.console import console
    from reflow.models.adapters import is_adapter_folder
    from reflow.rollout.collect import EVAL_SEED_BASE, ProgressLines, deadline_note, summarize, summary_line
    from reflow.runtime.workers import RolloutWorker

    def say(line: str) -> None:
        console.print(line, highlight=False)

    config = config.model_copy(deep=True)
    config.resources.threads_per_slot = os.cpu_count() or 1  # an evaluation has the machine to itself
    worker = RolloutWorker(config, model_path, replay=None)
    try:
        if config.model.lora is not None and is_adapter_folder(model_path):
            # SGLang servers under LoRA hold the base (a run's first weight sync brings its adapters):
            # the checkpoint's adapters go to them as a run's would (a torch engine has them already)
            folder = str(Path(model_path).resolve())
            await worker.engine.update_weights(path=folder, version=worker.engine.weight_version)
        start = time.monotonic()
        greedy = await worker.held_out(
            episodes, EVAL_SEED_BASE, 0.0, 1, ProgressLines(say, "greedy"), first_task=first_task
        )
        seconds = time.monotonic() - start
        sampled = []
        if pass_at:  # the greedy figure now: a sampled half cut short (hours on a real model) keeps it
            say(f"greedy done: {summary_line(summarize(greedy, seconds))}")
            if note := deadline_note(greedy, "greedy", _deadline_keys(config)):
                say(note)
            t = config.rollout.temperature
            lines = ProgressLines(say, f"{pass_at} samples per task at temperature {t:g}")
            sampled = await worker.held_out(
                episodes, EVAL_SEED_BASE, t, pass_at, lines, first_task=first_task
            )
    finally:
        await worker.close()
    return greedy, sampled, seconds


def _deadline_keys(config: RunConfig) -> str:
    """The setting that gives an evaluation's episodes a wall-clock deadline (the env's; evaluation
    runs no runner deadline), with its value."""
    if (env_s := (config.held_out_env_kwargs or {}).get("deadline_s")) is not None:
        return f"env.kwargs.deadline_s (now {env_s:g} s)"
    return "env.kwargs.deadline_s (the env's registered deadline applies)"


def evaluate_model(
    config: RunConfig,
    model_arg: str,
    episodes: int,
    pass_at: int,
    out: str | None = None,
    first_task: int = 0,
) -> dict[str, Any]:
    """Play, print a table and return the summary (`reflow eval`, and `reflow rollout --eval`)."""
    from reflow.console import console
    from reflow.rollout.collect import deadline_note, rl_headroom, summarize, summary_line

    path = model_folder(model_arg)
    greedy, sampled, seconds = asyncio.run(play_held_out(config, path, episodes, pass_at, first_task))
    if out:
        write_records(greedy + sampled, out)
    summary: dict[str, Any] = {
        "env_id": config.env.id,
        "env_kwargs": config.held_out_env_kwargs,
        "model": path,
        "first_task": first_task,
        **summarize(greedy, seconds),
        "timeouts": {"greedy": sum(r.status == "timeout" for r in greedy),
                     "sampled": sum(r.status == "timeout" for r in sampled)},
    }  # fmt: skip
    console.print(
        f"[bold]{config.env.id}[/bold] with {path}: {summary['episodes']} held-out tasks, greedy "
        f"{summary_line(summary)}"
    )
    for records, half in ((greedy, "greedy"), (sampled, "sampled")):
        if note := deadline_note(records, half, _deadline_keys(config)):
            console.print(f"[yellow]{note}[/yellow]", highlight=False)
    if sampled:
        room = rl_headroom(greedy, sampled)
        summary["rl_headroom"] = room
        k = room["samples_per_task"]
        console.print(
            f"{k} samples per task at temperature {config.rollout.temperature:g}: mean@{k} "
            f"{room['sampled_success']:.1%}, pass@{k} {room['pass_at_k']:.1%}; RL headroom "
            f"{room['headroom']:.1%} (tasks greedy fails and some sample solves: what RL can turn into "
            "greedy success)"
        )
    return summary


def _table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"held-out evaluation: {summary['env_id']}, {summary['episodes']} tasks")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("greedy success", f"{summary['success_rate']:.1%}")
    room = summary.get("rl_headroom")
    if room:
        k = room["samples_per_task"]
        table.add_row(f"mean@{k}", f"{room['sampled_success']:.1%}")
        table.add_row(f"pass@{k}", f"{room['pass_at_k']:.1%}")
        table.add_row("RL headroom", f"{room['headroom']:.1%}")
    table.add_row("reward (greedy)", f"{summary['reward_mean']:.3f}")
    return table


def cmd_eval(args: argparse.Namespace) -> int:
    from reflow.console import console

    config = eval_config(args.config, args.model, args.overrides)
    episodes = config.eval.end_episodes if args.episodes is None else args.episodes
    pass_at = config.eval.pass_at if args.pass_at is None else args.pass_at
    if episodes < 1 or pass_at < 0 or args.first_task < 0:
        raise UsageError("--episodes must be >= 1, --pass-at and --first-task >= 0")
    summary = evaluate_model(config, args.model, episodes, pass_at, args.out, args.first_task)
    console.print(_table(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export_model(source: str, out: str | Path, *, overwrite: bool = False, dtype: str = "float32") -> Path:
    """Write the model `source` names as a Hugging Face folder at `out`: weights (safetensors, in
    `dtype`: the checkpoint's float32, or half the size in bfloat16 / float16 as servers run them),
    config, generation config, tokenizer and chat template; no optimizer, RNG or run state. Written
    beside `out` and renamed into place, so a reader never sees half a folder."""
    import torch

    from reflow.models import load_model

    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"--dtype {dtype}: one of {', '.join(EXPORT_DTYPES)}")

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UsageError(f"{out} exists and is not empty: pick another folder or pass --overwrite")
    path = model_folder(source)
    model, tokenizer = load_model(path)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{path}: the tokenizer has no chat template, so a server could not prompt it")
    tmp = staging_dir(out)
    model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info: dict[str, Any] = {
        "source": str(Path(path).resolve()) if Path(path).is_dir() else path,
        "dtype": dtype,
    }
    state = Path(path) / "state.json"
    if state.is_file():
        saved = json.loads(state.read_text())
        info.update(step=saved.get("step"), version=saved.get("version"))
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return publish_dir(tmp, out)


def cmd_export(args: argparse.Namespace) -> int:
    from reflow.console import console

    out = export_model(args.checkpoint, args.out, overwrite=args.overwrite, dtype=args.dtype)
    console.print(f"exported {model_folder(args.checkpoint)} to {out} (a Hugging Face folder, {args.dtype})")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure a model on a run config's held-out tasks")
    p.add_argument("--config", help="the run config (env, kwargs, sampling); default: the run folder's own")
    p.add_argument(
        "--model",
        required=True,
        help="a run folder (its latest checkpoint), a checkpoint, an HF folder or a preset",
    )
    p.add_argument("--episodes", type=int, help="held-out tasks (default: the config's eval.end_episodes)")
    p.add_argument(
        "--pass-at",
        type=int,
        metavar="K",
        help="sampled episodes per task for mean@K, pass@K and the RL headroom (default: the config's "
        "eval.pass_at; 0: greedy only)",
    )
    p.add_argument(
        "--first-task",
        type=int,
        default=0,
        metavar="I",
        help="start at the I-th held-out task (0: the first): a long evaluation in parts, e.g. tasks "
        "0-99 then --first-task 100, plays the same episodes, sampled ones included, as in one go",
    )
    p.add_argument("--out", help="write the episodes here (.jsonl or .parquet)")
    p.add_argument("--json", metavar="PATH", help="write the summary here as JSON (it is also printed last)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. eval.max_new_tokens=64"
    )
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder (to serve or share)")
    p.add_argument("checkpoint", help="a run folder (its latest checkpoint), a checkpoint or an HF folder")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="float32",
        help="the weights' type: float32 (as trained, the default) or half the size as servers run them",
    )
    p.set_defaults(fn=cmd_export)
