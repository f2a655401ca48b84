"""A rollout worker's inference engine, built from the run config, and how it receives new weights.

`engine.kind: torch` (the default) is the in-process `TorchEngine` on the worker's own device: weights
arrive as a state dict and are copied in. `engine.kind: sglang` puts SGLang servers behind the worker
(GPU machines): either running servers (`engine.urls`, shared by every rollout worker) or one launched
per worker (`engine.launch_port` + the worker's index). The worker writes each new policy as a Hugging
Face folder under `engine.weights_dir` and the servers load it with `/update_weights_from_disk`: a path
that works wherever the server can read the worker's disk (the same node), with no CUDA IPC between
processes and no NCCL group to set up.

With `model.lora` the weights are the adapters alone: the torch engine holds the base with adapters
injected as the trainer's (`reflow.train.lora`) and copies them in; the SGLang servers hold the base
and load each policy as an adapter folder (`/load_lora_adapter`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from reflow.config import RunConfig
from reflow.folders import publish_dir, staging_dir
from reflow.train.settings import LoraSettings


def _is_weights(name: str) -> bool:
    """Weight files and their shard indexes (model.safetensors.index.json), optimizer and RNG state."""
    return ".safetensors" in name or ".bin" in name or name.endswith((".pt", ".pth"))


def build_engine(config: RunConfig, model_path: str, index: int) -> tuple[Any, Any]:
    """(engine, tokenizer) for rollout worker `index`."""
    lora = config.model.lora_settings()
    if config.engine.kind == "torch":
        from reflow.engine.torch_engine import TorchEngine
        from reflow.models import load_model
        from reflow.train.lora import load_lora_model

        device = config.resources.device
        if lora is None:
            model, tokenizer = load_model(model_path, device=device)
        else:  # adapters on the base, as the trainer's: weight sync copies the trainer's into them
            model, tokenizer = load_lora_model(model_path, lora, device=device, seed=config.seed)
        return TorchEngine(model, tokenizer, max_batch_size=config.rollout.max_batch_size), tokenizer

    from transformers import AutoTokenizer

    from reflow.engine.sglang_engine import SGLangEngine
    from reflow.engine.sglang_requests import lora_launch_args
    from reflow.models.adapters import base_model_path
    from reflow.models.presets import resolve_model_path

    # LoRA: the servers hold the base, and the policies arrive as adapters (`load_policy`); a resumed
    # run's adapters come with the first weight sync
    path = str(base_model_path(resolve_model_path(model_path)) if lora else resolve_model_path(model_path))
    tokenizer = AutoTokenizer.from_pretrained(path)  # token-in-token-out: the worker tokenizes
    e = config.engine
    if e.urls:  # servers started for adapters if model.lora is set (`sglang_requests.lora_launch_args`)
        return SGLangEngine(e.urls), tokenizer
    assert e.launch_port is not None  # the config validator allows only urls or launch_port
    args = list(e.launch_args)
    if lora is not None and "--enable-lora" not in args:
        args += lora_launch_args(lora.r, lora.target_modules)
    return SGLangEngine.launch(path, ports=[e.launch_port + index], extra_args=args), tokenizer


def weights_dir(config: RunConfig, index: int) -> Path:
    root = Path(config.engine.weights_dir) if config.engine.weights_dir else config.run_dir / "engine-weights"
    return root / f"worker-{index}"


def write_policy(
    state_dict: dict[str, Any], model_path: str, out: Path, lora: LoraSettings | None = None
) -> Path:
    """Write `state_dict` as a loadable Hugging Face folder at `out` (config and tokenizer files copied
    from `model_path`), or with `lora` as an adapter folder on `model_path`'s base (`state_dict`: the
    adapters); written to a sibling first and renamed, so a reader never sees half a folder."""
    from safetensors.torch import save_file

    from reflow.models.adapters import base_model_path
    from reflow.models.presets import resolve_model_path

    src = Path(resolve_model_path(model_path))
    tmp = staging_dir(out)
    if lora is not None:
        from reflow.train.lora import save_adapters

        save_adapters(tmp, state_dict, lora, base=base_model_path(src))
        return publish_dir(tmp, out)
    for f in src.iterdir():
        if f.is_file() and not _is_weights(f.name):  # config, generation config, tokenizer, template
            shutil.copy2(f, tmp / f.name)
    # Tied weights share storage, which safetensors refuses: each tensor gets its own contiguous copy.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return publish_dir(tmp, out)


async def load_policy(
    engine: Any,
    config: RunConfig,
    model_path: str,
    index: int,
    state_dict: dict[str, Any],
    version: int,
    *,
    rewind: bool = False,
) -> int:
    """Give the engine the policy of `version`: copied in (torch), or written and loaded from disk.
    Returns the version the engine confirms; an older version than the engine's is refused
    (ValueError) unless `rewind`."""
    if config.engine.kind == "torch":
        return await engine.update_weights(state_dict=state_dict, version=version, rewind=rewind)
    if version < engine.weight_version and not rewind:  # refused before writing a folder for nothing
        raise ValueError(f"weight version {version} is older than the engine's ({engine.weight_version})")
    root = weights_dir(config, index)
    folder = write_policy(state_dict, model_path, root / f"v{version:06d}", config.model.lora_settings())
    new_version = await engine.update_weights(path=str(folder.resolve()), version=version, rewind=rewind)
    for old in root.glob("v*"):  # the servers hold the weights now; keep only the newest folder
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".v*"):  # writes a kill interrupted (this worker is the folder's only writer)
        shutil.rmtree(stale, ignore_errors=True)
    return new_version
