"""`reflow rollout`: play N episodes of an env with a model, write the trajectories, print a summary.

reflow rollout --env reflow/Calc-v0 --model tiny --episodes 64 --out runs/calc.jsonl
reflow rollout --env reflow/Calc-v0 --model FOLDER --eval --episodes 300 --pass-at 8   # RL headroom

`--eval` is an alias of `reflow eval` (`reflow.recipes.model_cli`) with a config made of the env id and
these flags; `reflow eval --config` also takes a run config's env kwargs and sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from reflow.config import RunConfig
from reflow.engine import Engine, SamplingParams
from reflow.recipes.model_cli import evaluate_model
from reflow.records import EpisodeRecord, write_records
from reflow.rollout.collect import collect, summarize, summary_line
from reflow.rollout.episode import EpisodeRunner, RolloutConfig


def make_engine(model_name: str, max_batch_size: int = 32) -> tuple[Engine, Any]:
    from reflow.engine.torch_engine import TorchEngine
    from reflow.models import load_model

    model, tokenizer = load_model(model_name)
    return TorchEngine(model, tokenizer, max_batch_size=max_batch_size), tokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="play episodes of an env with a model and write trajectories")
    p.add_argument("--env", required=True, help="env id, e.g. reflow/Calc-v0")
    p.add_argument("--model", default="tiny", help="a preset name or a local HF folder")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--group-size", type=int, default=1, help="episodes per task (not with --eval)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="task seed of the first group")
    p.add_argument("--eval", action="store_true", help="greedy, on the held-out task seeds")
    p.add_argument(
        "--pass-at",
        type=int,
        metavar="K",
        help="with --eval: also sample K episodes per held-out task (at --temperature) and report "
        "pass@K and the RL headroom (tasks greedy fails and some sample solves)",
    )
    p.add_argument("--out", help="write trajectories here (.jsonl or .parquet)")
    p.set_defaults(fn=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    from reflow.console import console
    from reflow.errors import UsageError

    if args.pass_at is not None and (not args.eval or args.pass_at < 1):
        raise UsageError("--pass-at K needs --eval and K >= 1")
    if args.eval and args.group_size != 1:  # greedy decoding would play the same episode G times
        raise UsageError("--eval plays one greedy episode per held-out task: drop --group-size")

    if args.eval:
        summary = evaluate_model(_eval_config(args), args.model, args.episodes, args.pass_at or 0, args.out)
        print(json.dumps(summary))
        return 0

    async def main() -> tuple[list[EpisodeRecord], float]:
        engine, tokenizer = make_engine(args.model, args.max_batch_size)
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p
        )
        start = time.monotonic()
        try:
            records = await collect(
                EpisodeRunner(engine, tokenizer, RolloutConfig(sampling=sampling)),
                args.env,
                args.episodes,
                group_size=args.group_size,
                seed=args.seed,
                concurrency=args.max_batch_size,
            )
        finally:
            await engine.close()
        return records, time.monotonic() - start

    records, seconds = asyncio.run(main())
    summary = summarize(records, seconds)
    if args.out:
        write_records(records, args.out)
    console.print(
        f"[bold]{args.env}[/bold] with {args.model}: {summary['episodes']} episodes, {summary_line(summary)}"
    )
    print(json.dumps(summary))
    return 0


def _eval_config(args: argparse.Namespace) -> RunConfig:
    """The run config `--eval` stands for: the env id, the model and the sampling flags."""
    from reflow.config import validate_config

    return validate_config(
        {
            "env": {"id": args.env},
            "model": args.model,
            "rollout": {
                "temperature": args.temperature,
                "top_p": args.top_p,
                "max_batch_size": args.max_batch_size,
            },
            "eval": {"max_new_tokens": args.max_new_tokens},
        }
    )
