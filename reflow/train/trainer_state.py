"""The trainer's part of a checkpoint (`reflow.recipes.checkpoints` adds the run's): model, optimizer,
step and version, RNG states and the run's replay cursor.

    save_checkpoint(run_dir / "checkpoints", trainer, tokenizer, extra={"next_seed": 96})
    ckpt = latest_checkpoint(run_dir / "checkpoints")   # None when there is none
    extra = load_checkpoint(ckpt, trainer)

A checkpoint is a folder `step-000012/` holding an ordinary HF model folder (so `reflow rollout --model`
and any HF engine load it), `optimizer.pt`, `rng.pt` and `state.json`. Under LoRA the model folder is an
adapter folder instead (`reflow.models.adapters`: the adapters in peft's format, naming their base
model), which `reflow.models.load_model` loads merged. It is written under a temporary name and
renamed into place (`reflow.folders`), so a run killed mid-save never leaves a checkpoint that looks
complete; `latest_checkpoint` only sees finished ones. Older checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from reflow.folders import publish_dir, staging_dir
from reflow.models.weights import load_state_dict
from reflow.train.lora import save_adapters
from reflow.train.trainer import PolicyTrainer

STATE_FILE = "state.json"


def _rng_state(trainer: PolicyTrainer) -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "trainer": trainer.rng.getstate()}


def save_checkpoint(
    root: str | Path,
    trainer: PolicyTrainer,
    tokenizer: Any = None,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path | None:
    """Write a checkpoint of `trainer` (collective under FSDP: call on every rank; rank 0 writes).
    Returns the folder on rank 0, None elsewhere."""
    model_state = trainer.full_state_dict()
    optim_state = trainer.optimizer_state()
    if trainer.rank != 0:
        return None
    root = Path(root)
    final = root / f"step-{trainer.step:06d}"
    tmp = staging_dir(final)
    if trainer.lora is not None:  # the adapters, naming the base they apply to, and its config
        if not trainer.base_path:
            raise ValueError("a LoRA checkpoint names its base model's folder: load the model from one")
        save_adapters(tmp, model_state, trainer.lora, base=trainer.base_path)
        trainer.model.config.save_pretrained(tmp)
    else:
        trainer.model.save_pretrained(tmp, state_dict=model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(optim_state, tmp / "optimizer.pt")
    torch.save(_rng_state(trainer), tmp / "rng.pt")
    state = {"step": trainer.step, "version": trainer.version, "extra": extra or {}}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    publish_dir(tmp, final)  # a save of a step already saved (the run's last) replaces it
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*"):  # saves a kill interrupted (rank 0 is the only writer here)
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore weights, optimizer, step/version and RNG; returns the `extra` dict saved with it."""
    path = Path(path)
    model_state = load_state_dict(path)  # a LoRA checkpoint's adapters (the trainer checks they fit)
    tied = trainer.lora is None and getattr(trainer.model.config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in model_state:
        model_state["lm_head.weight"] = model_state["model.embed_tokens.weight"]
    optim_state = torch.load(path / "optimizer.pt", weights_only=False)
    trainer.load_state(model_state, optim_state)
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    trainer.rng.setstate(rng["trainer"])
    state = read_state(path)
    trainer.step, trainer.version = state["step"], state["version"]
    return state["extra"]
