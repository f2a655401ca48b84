"""`reflow rollout`: play N episodes of an env with a model, write the trajectories, print a summary.

reflow rollout --env reflow/Calc-v0 --model tiny --episodes 64 --out runs/calc.jsonl
reflow rollout --env reflow/Calc-v0 --model FOLDER --eval --episodes 300 --pass-at 8   # RL headroom
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from reflow.engine import Engine, SamplingParams
from reflow.records import EpisodeRecord
from reflow.rollout.collect import EVAL_SEED_BASE, collect, rl_headroom, summarize
from reflow.rollout.episode import EpisodeRunner, RolloutConfig


def write_records(records: list[EpisodeRecord], path: str | Path) -> None:
    """JSONL, or Parquet when the name ends in .parquet (one row per episode, nested columns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r.to_dict() for r in records]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Free-form dicts (messages, tool results, info) vary in shape: store them as JSON text.
        for row in rows:
            for key in ("messages", "reward_components", "timings"):
                row[key] = json.dumps(row[key])
            for turn in row["turns"]:
                for key in ("obs_messages", "tool_calls", "tool_results", "sampling_params"):
                    turn[key] = json.dumps(turn[key])
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


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

    async def run(engine: Engine, tokenizer: Any, temperature: float, group_size: int, episodes: int):
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=temperature,
            top_p=args.top_p,
            seed=EVAL_SEED_BASE if args.eval else None,  # a held-out measurement: the same every run
        )
        return await collect(
            EpisodeRunner(engine, tokenizer, RolloutConfig(sampling=sampling)),
            args.env,
            episodes,
            group_size=group_size,
            seed=EVAL_SEED_BASE if args.eval else args.seed,
            concurrency=args.max_batch_size,
        )

    async def main() -> tuple[list[EpisodeRecord], list[EpisodeRecord], float]:
        engine, tokenizer = make_engine(args.model, args.max_batch_size)
        start = time.monotonic()
        try:
            temperature = 0.0 if args.eval else args.temperature
            records = await run(engine, tokenizer, temperature, args.group_size, args.episodes)
            seconds = time.monotonic() - start
            sampled = []
            if args.pass_at:  # K samples on each task the greedy run played
                sampled = await run(
                    engine, tokenizer, args.temperature, args.pass_at, len(records) * args.pass_at
                )
        finally:
            await engine.close()
        return records, sampled, seconds

    records, sampled, seconds = asyncio.run(main())
    summary = summarize(records, seconds)
    if args.out:
        write_records(records + sampled, args.out)
    console.print(
        f"[bold]{args.env}[/bold] with {args.model}: {summary['episodes']} episodes, "
        f"success {summary['success_rate']:.1%}, reward {summary['reward_mean']:.3f}, "
        f"turns p50/p90/max {summary['turns_p50']:g}/{summary['turns_p90']:g}/{summary['turns_max']}, "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s, statuses {summary['statuses']}"
    )
    if sampled:
        room = rl_headroom(records, sampled)
        summary["rl_headroom"] = room
        console.print(
            f"{room['samples_per_task']} samples per task at temperature {args.temperature:g}: "
            f"sampled success {room['sampled_success']:.1%}, pass@{room['samples_per_task']} "
            f"{room['pass_at_k']:.1%}; RL headroom {room['headroom']:.1%} (tasks greedy fails and "
            "some sample solves: what RL can turn into greedy success)"
        )
    print(json.dumps(summary))
    return 0
