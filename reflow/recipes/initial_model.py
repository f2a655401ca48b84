"""The model a run starts from: the last checkpoint (resume), a warm-started policy, or the configured
model as it is.

A warm start is cached under `$REFLOW_CACHE_DIR/warmstart/<hash>` (default `~/.cache/reflow`), keyed on
everything that shapes it (env, model, overrides, warm-start settings, seed, tiny-builder version), so
runs that differ only in RL settings reuse it; `warmstart.cache: false` always trains a new one. A
warm start that its time cap (`warmstart.seconds`) cut short of `warmstart.max_steps` serves its own
run but is not reused: the key promises what the step budget gives, and a slow spell of the machine
would otherwise pin a weaker model under it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from reflow.config import RunConfig
from reflow.folders import publish_dir, staging_dir
from reflow.models.presets import cache_dir, resolve_model_path
from reflow.recipes.run_state import RunState
from reflow.recipes.warmstart import env_demo_kwargs, in_fresh_process, warmstart
from reflow.rollout.collect import DEMO_SEED_BASE

if TYPE_CHECKING:
    from reflow.recipes.run_log import RunLog


def warmstart_key(config: RunConfig) -> str:
    from reflow.models.tiny import BUILDER_VERSION
    from reflow.train.sft import RECIPE_VERSION

    blob = {
        "env": config.env.id,  # demonstrations use warmstart.demo_env_kwargs, never env.kwargs
        "model": config.model.name,
        "overrides": config.model_overrides,
        "warmstart": config.warmstart.model_dump(exclude={"cache"}),
        # with no curriculum in the config, the env's own one shapes the demos: key on it too
        "demo_env_kwargs": config.warmstart.demo_env_kwargs or env_demo_kwargs(config.env.id),
        "seed": config.warmstart.seed,
        "builder": BUILDER_VERSION,
        "sft": RECIPE_VERSION,
        "demo_seeds": DEMO_SEED_BASE,
    }
    if config.warmstart.dev_tasks:  # early stopping evaluates on the RL env: its kwargs shape the model
        blob["dev_env_kwargs"] = config.env.kwargs
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_warmstart(config: RunConfig, log: RunLog) -> str:
    ws = config.warmstart
    out = cache_dir().parent / "warmstart" / warmstart_key(config)
    summary_file = out / "warmstart.json"
    cached = json.loads(summary_file.read_text()) if ws.cache and summary_file.is_file() else None
    if cached is not None and cached.get("stopped_by") != "seconds":
        log.console.print(f"warm start: reusing {out}")
        # the cached summary names the staging folder it was built in: the model is `out`
        log.write("warmstart", {**cached, "model": str(out), "cached": True})
        return str(out)
    if cached is not None:
        log.console.print(
            f"warm start: the cached one stopped at step {cached['sft_steps']} of {cached['sft_max_steps']}"
            " (time cap); training it again"
        )
    tmp = staging_dir(out)  # its own: two runs with one key may build it at once
    log.console.print(
        f"warm start: SFT on {ws.demos} scripted {config.env.id} episodes (≤ {ws.seconds:.0f}s)"
    )
    # in a process of its own, so the driver does not keep the memory SFT took for the whole run
    summary = in_fresh_process(
        warmstart,
        lambda msg: log.console.print(f"  {msg}"),
        env_id=config.env.id,
        model_name=config.model.name,
        out_dir=tmp,
        demos=ws.demos,
        error_rate=ws.error_rate,
        seconds=ws.seconds,
        max_steps=ws.max_steps,
        lr=ws.lr,
        batch_tokens=ws.batch_tokens,
        model_config=config.model_overrides or None,
        demo_env_kwargs=ws.demo_env_kwargs or None,
        eval_episodes=0,  # the RL loop's step-0 evaluation measures the warm-start level
        seed=config.warmstart.seed,
        dev_tasks=ws.dev_tasks,
        dev_every=ws.dev_every,
        patience=ws.patience,
        dev_env_kwargs=config.env.kwargs,
    )
    publish_dir(tmp, out)
    log.write("warmstart", {**summary, "model": str(out), "cached": False})
    return str(out)


def prepare_model(
    config: RunConfig, run_dir: Path, log: RunLog, *, resume: bool
) -> tuple[str, RunState, Path | None]:
    """(model path for the actors, the starting run state, the checkpoint to restore or None)."""
    from reflow.train.trainer_state import latest_checkpoint

    if resume:
        ckpt = latest_checkpoint(run_dir / "checkpoints")
        if ckpt is not None:
            return str(resumed_model(ckpt, run_dir)), RunState(), ckpt
        log.console.print("[yellow]no checkpoint yet: starting the run over[/yellow]")
    if config.warmstart.enabled:
        path = run_warmstart(config, log)
    else:
        path = str(resolve_model_path(config.model.name, **dict(config.model_overrides)))
    path = str(run_base(Path(path), run_dir))
    return path, RunState(), None


TRAINER_ONLY = ("optimizer.pt", "rng.pt")
"""Files of a checkpoint that only the trainer reads (restored from the checkpoint itself)."""

RUN_BASE = "model-base"
"""In the run folder: the model the run started from, when it came from reflow's cache or a checkpoint
(`run_base`)."""


def run_base(path: Path, run_dir: Path) -> Path:
    """The model folder a run starts from and its actors read for the whole run (a trainer rank or
    rollout worker started by an elastic role change loads it then; a `model.lora` run's checkpoints,
    adapters alone, name it by path). A folder in reflow's cache is reflow's to replace (a run with the
    same warm-start key trains a time-capped or uncached warm start again) or to clear, and another
    run's checkpoint goes when that run rotates it: such a folder is linked into `run_dir/model-base`
    first, which nothing else writes, so the run, its resume and its export read the model it started
    from. Any other folder is used where it is."""
    from reflow.models.adapters import is_adapter_folder
    from reflow.train.trainer_state import STATE_FILE

    cached = path.resolve().is_relative_to(cache_dir().parent.resolve())
    checkpoint = (path / STATE_FILE).is_file() and not is_adapter_folder(path)
    if not (cached or checkpoint):
        return path
    return link_model(path, run_dir / RUN_BASE, skip=(*TRAINER_ONLY, STATE_FILE))


def resumed_model(ckpt: Path, run_dir: Path) -> Path:
    """The checkpoint's model folder (weights, config, tokenizer) linked into `run_dir/model-resumed`,
    which checkpoint rotation never touches: the actors a resumed run starts later (an elastic role
    change, a new rollout worker) and SGLang weight pushes (which copy its config and tokenizer files)
    read it for the whole run, after `train.keep_checkpoints` has removed the checkpoint itself.
    Adapters keep naming the base they were trained on, relative to their new place."""
    from reflow.models.adapters import base_model_path, is_adapter_folder, write_base_link

    dest = link_model(ckpt, run_dir / "model-resumed", skip=TRAINER_ONLY)
    if is_adapter_folder(ckpt):
        write_base_link(dest, base_model_path(ckpt))
    return dest


def link_model(src: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    """The files of folder `src` (but `skip`) at `dest`, replacing it: hard links where the file system
    allows (no copy of the weights; they outlive `src`'s removal), else copies."""
    tmp = staging_dir(dest)
    for file in src.iterdir():
        if file.name in skip or not file.is_file():
            continue
        try:
            os.link(file, tmp / file.name)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(file, tmp / file.name)
    return publish_dir(tmp, dest)
