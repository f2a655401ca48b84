"""`reflow warmstart`: supervised warm-start of a policy on an env's scripted demonstrations.

    reflow warmstart --env reflow/Calc-v0 --model tiny --out runs/calc-warm

The demonstrations slip at `--error-rate` (so RL has something left to improve), are laid out as token
rows exactly as rollout lays out sampled turns, and the loss covers only the assistant's tokens. The
run stops on a step or time budget, saves an ordinary HF folder, and reports greedy success on the
held-out task set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reflow.config import WarmstartSection
from reflow.engine import SamplingParams
from reflow.env import make, play_episode, scripted_policy
from reflow.records import Segment
from reflow.rollout.collect import DEMO_SEED_BASE, EVAL_SEED_BASE, collect, summarize
from reflow.rollout.episode import EpisodeRunner, RolloutConfig

DEFAULTS = WarmstartSection()
"""The warm-start defaults of `agent-train`'s config, shared by `warmstart()` and `reflow warmstart`."""
DEV_SEED_BASE = DEMO_SEED_BASE + 500_000
"""The dev set of early stopping: task seeds from here on, apart from the demonstrations' (from
DEMO_SEED_BASE), the RL phase's (below EVAL_SEED_BASE) and the held-out set's (from EVAL_SEED_BASE)."""


async def demo_rows(
    env_id: str,
    tokenizer: Any,
    episodes: int,
    error_rate: float,
    seed: int = 0,
    env_kwargs: dict | None = None,
) -> list[Segment]:
    """Token rows of `episodes` scripted episodes (one row per segment; mask 1 on the demo's turns),
    on the task seeds DEMO_SEED_BASE + seed + i, apart from the RL and held-out ones."""
    runner = EpisodeRunner(None, tokenizer)
    rows: list[Segment] = []
    for i in range(episodes):
        env = make(env_id, **(env_kwargs or {}))
        s = DEMO_SEED_BASE + seed + i
        rec = await runner.run(env, seed=s, demo_policy=scripted_policy(env, error_rate, s))
        await env.close()
        rows += rec.segments
    return rows


async def demo_texts(
    env_id: str, episodes: int, error_rate: float, seed: int = 0, env_kwargs: dict | None = None
) -> list[str]:
    """Whole scripted conversations as text (via the tiny preset's chat template), for tokenizer training."""
    from transformers import AutoTokenizer

    from reflow.models import resolve_model_path

    template = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    texts = []
    for i in range(episodes):
        env = make(env_id, **(env_kwargs or {}))
        s = DEMO_SEED_BASE + seed + i
        result = await play_episode(env, scripted_policy(env, error_rate, s), seed=s)
        raw = iter(r.raw_text for r in result.records)
        messages = [
            {"role": "assistant", "content": next(raw)} if m["role"] == "assistant" else m
            for m in result.messages
        ]
        tools = [t.schema for t in env.unwrapped.tools]
        texts.append(template.apply_chat_template(messages, tools=tools or None, tokenize=False))
    return texts


def env_demo_kwargs(env_id: str) -> dict[str, Any]:
    """The env's own warm-start curriculum (`Env.demo_kwargs`; {} when it declares none)."""
    probe = make(env_id)
    try:
        return dict(probe.unwrapped.demo_kwargs)
    finally:
        asyncio.run(probe.close())


def warmstart(
    env_id: str,
    model_name: str,
    out_dir: str | Path,
    *,
    demos: int = DEFAULTS.demos,
    error_rate: float = DEFAULTS.error_rate,
    seconds: float = DEFAULTS.seconds,
    max_steps: int = DEFAULTS.max_steps,
    lr: float = DEFAULTS.lr,
    batch_tokens: int = DEFAULTS.batch_tokens,
    model_config: dict[str, Any] | None = None,
    demo_env_kwargs: dict[str, Any] | None = None,
    eval_episodes: int = 100,
    seed: int = DEFAULTS.seed,
    dev_tasks: int = DEFAULTS.dev_tasks,
    dev_every: int = DEFAULTS.dev_every,
    patience: int = DEFAULTS.patience,
    dev_env_kwargs: dict[str, Any] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """SFT on the demonstrations to `max_steps` (or the `seconds` cap); with `dev_tasks` > 0, stop
    early on greedy success over a dev set of the RL env (`dev_env_kwargs`, e.g. the run's
    env.kwargs), evaluated every `dev_every` steps: after `patience` evaluations without a better one,
    ending with the best weights."""
    import torch

    from reflow.engine.torch_engine import TorchEngine
    from reflow.models import load_model
    from reflow.models.corpus import generic_corpus
    from reflow.models.presets import quiet_progress_bars
    from reflow.train.sft import SFTConfig, sft_train

    start = time.monotonic()
    torch.manual_seed(seed)
    if demo_env_kwargs is None:
        demo_env_kwargs = env_demo_kwargs(env_id)
    preset_kwargs: dict[str, Any] = dict(model_config or {})
    if model_name == "tiny":  # a fresh tiny model: fit its tokenizer to this env's text too
        preset_kwargs["corpus"] = [
            *asyncio.run(demo_texts(env_id, 300, error_rate, seed, demo_env_kwargs)),
            *generic_corpus(),
        ]
    model, tokenizer = load_model(model_name, **preset_kwargs)
    rows = asyncio.run(demo_rows(env_id, tokenizer, demos, error_rate, seed, demo_env_kwargs))
    n_tokens = sum(len(r.token_ids) for r in rows)
    log(f"{len(rows)} demo rows, {n_tokens} tokens ({sum(r.n_sampled for r in rows)} trained on)")
    config = SFTConfig(
        lr=lr,
        max_steps=max_steps,
        max_seconds=seconds,
        batch_tokens=batch_tokens,
        seed=seed,
        log_every=50,
        patience=patience if dev_tasks else 0,
    )

    def dev_success(step: int) -> dict[str, Any]:
        result = asyncio.run(held_out(dev_tasks, DEV_SEED_BASE, dev_env_kwargs))
        log(f"step {step}: dev greedy success {result['success_rate']:.1%} ({dev_tasks} tasks)")
        return {"success_rate": result["success_rate"]}

    async def held_out(episodes: int, first_seed: int, env_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        engine = TorchEngine(model, tokenizer, max_batch_size=32)
        runner = EpisodeRunner(
            engine, tokenizer, RolloutConfig(sampling=SamplingParams(max_new_tokens=128, temperature=0.0))
        )
        begin = time.monotonic()
        try:
            records = await collect(runner, env_id, episodes, seed=first_seed, env_kwargs=env_kwargs)
        finally:
            await engine.close()
        return summarize(records, time.monotonic() - begin)

    report = sft_train(
        model,
        rows,
        tokenizer.pad_token_id,
        config,
        evaluate=dev_success if dev_tasks else None,
        eval_every=dev_every,
        log=log,
    )
    if report.stopped_early:
        log(f"early stop at step {report.steps}: the best dev success was at step {report.best_step}")
    stopped_by = "dev" if report.stopped_early else "steps" if report.steps >= max_steps else "seconds"
    if stopped_by == "seconds":  # a slow machine: the model is short of what its step budget gives
        log(f"warning: SFT stopped by its {seconds:.0f}s time cap at step {report.steps} of {max_steps}")
    out = Path(out_dir)
    with quiet_progress_bars():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    result = asyncio.run(held_out(eval_episodes, EVAL_SEED_BASE, dev_env_kwargs)) if eval_episodes else {}
    summary = {
        "env": env_id,
        "model": str(out),
        "demo_rows": len(rows),
        "sft_steps": report.steps,
        "sft_max_steps": max_steps,
        "stopped_by": stopped_by,
        "best_step": report.best_step,
        "dev": report.evals,
        "sft_seconds": round(report.seconds, 1),
        "final_loss": round(sum(report.losses[-20:]) / max(1, len(report.losses[-20:])), 4),
        "heldout_success": result.get("success_rate"),
        "heldout_statuses": result.get("statuses"),
        "minutes": round((time.monotonic() - start) / 60, 2),
    }
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2))
    return summary


def _child_main(conn: Any, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """The fresh process's side of `in_fresh_process`: log lines, then ("done", result) or ("error", e)."""
    try:
        result = fn(**kwargs, log=lambda msg: conn.send(("log", str(msg))))
    except BaseException as e:  # the parent re-raises it (a KeyboardInterrupt too: it then stops)
        try:
            # the parent unpickles what it receives: an exception whose __init__ does not take its own
            # args pickles here and would fail there with an unrelated TypeError
            pickle.loads(pickle.dumps(e))
        except Exception:  # sent as its type and text instead
            e = RuntimeError(f"{type(e).__name__}: {e}")
        conn.send(("error", e))
    else:
        conn.send(("done", result))
    finally:
        conn.close()


def in_fresh_process(fn: Callable[..., Any], log: Callable[[str], Any], **kwargs: Any) -> Any:
    """`fn(**kwargs, log=...)` in a new (spawned) process, whose log lines reach `log` as they come and
    whose result or exception comes back here.

    Why: a warm start loads a model, its optimizer and activations; run in the driver, the allocator
    keeps that memory (RAM, or on a GPU device memory) for the whole RL run, which the actors then
    lack (a 135M-parameter warm start left the driver 5.7 GB). A process of its own hands it all back
    when it ends. `fn` and `kwargs` must pickle; the child sees the registered envs through their entry
    points, as Ray actors do. A child that dies without answering (killed, out of memory) is a
    RuntimeError naming its exit code."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, fn, kwargs), name=f"reflow-{fn.__name__}", daemon=True)
    proc.start()
    send.close()  # only the child writes: recv() sees EOF once it is gone
    try:
        while True:
            try:
                kind, payload = receive.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(
                    f"{fn.__name__}'s process ended without a result (exit code {proc.exitcode})"
                ) from None
            if kind == "log":
                log(payload)
            elif kind == "error":
                raise payload
            else:
                return payload
    finally:
        receive.close()
        proc.join(timeout=30)
        if proc.is_alive():  # interrupted here, or it hangs on the way out
            proc.kill()
            proc.join()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmstart", help="SFT a policy on an env's scripted demonstrations")
    p.add_argument("--env", required=True)
    p.add_argument("--model", default="tiny", help="a preset name or a local HF folder")
    p.add_argument("--out", help="output folder (default runs/warmstart-<env>)")
    p.add_argument("--demos", type=int, default=DEFAULTS.demos, help="scripted episodes to learn from")
    p.add_argument(
        "--error-rate", type=float, default=DEFAULTS.error_rate, help="slip probability of the demonstrations"
    )
    p.add_argument("--seconds", type=float, default=DEFAULTS.seconds, help="SFT time cap")
    p.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULTS.max_steps,
        help="SFT steps (~230 s for the tiny model on 2 idle cores)",
    )
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=DEFAULTS.batch_tokens,
        help="padded tokens per step (a shared prompt prefix counts once)",
    )
    p.add_argument(
        "--model-config",
        type=json.loads,
        default=None,
        help='JSON of model config overrides for a preset, e.g. \'{"num_hidden_layers": 3, "hidden_size": 128}\'',
    )
    p.add_argument(
        "--demo-env-kwargs",
        type=json.loads,
        default=None,
        help="JSON of env kwargs for the demonstrations only (a curriculum); default: the env's own "
        "`demo_kwargs` (Calc-v0: 1-2-step problems); '{}' for none",
    )
    p.add_argument(
        "--dev-tasks",
        type=int,
        default=DEFAULTS.dev_tasks,
        help="early stopping on greedy success over this many dev tasks (0: train to the budget)",
    )
    p.add_argument(
        "--dev-every", type=int, default=DEFAULTS.dev_every, help="SFT steps between dev evaluations"
    )
    p.add_argument(
        "--patience", type=int, default=DEFAULTS.patience, help="dev evaluations without a better one"
    )
    p.add_argument(
        "--env-kwargs",
        type=json.loads,
        default=None,
        help="JSON of env kwargs of the dev and held-out evaluations (the RL env); default: the env's defaults",
    )
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.set_defaults(fn=cmd_warmstart)


def cmd_warmstart(args: argparse.Namespace) -> int:
    from reflow.console import console

    out = args.out or f"runs/warmstart-{args.env.split('/')[-1].lower()}"
    summary = warmstart(
        args.env,
        args.model,
        out,
        demos=args.demos,
        error_rate=args.error_rate,
        seconds=args.seconds,
        max_steps=args.max_steps,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        model_config=args.model_config,
        demo_env_kwargs=args.demo_env_kwargs,
        eval_episodes=args.eval_episodes,
        seed=args.seed,
        dev_tasks=args.dev_tasks,
        dev_every=args.dev_every,
        patience=args.patience,
        dev_env_kwargs=args.env_kwargs,
        log=console.print,
    )
    console.print(
        f"[bold]warm-started {args.env}[/bold] -> {summary['model']}: {summary['sft_steps']} steps in "
        f"{summary['sft_seconds']}s, held-out greedy success {summary['heldout_success']}"
    )
    print(json.dumps(summary))
    return 0
