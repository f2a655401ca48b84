"""A rollout worker's inference engine, built from the run config, and how it receives new weights.

`engine.kind: torch` (the default) is the in-process `TorchEngine` on the worker's own device: weights
arrive as a state dict and are copied in. `engine.kind: sglang` puts SGLang servers behind the worker
(GPU machines): either running servers (`engine.urls`, shared by every rollout worker) or one launched
per worker (`engine.launch_port` + the worker's index). The worker writes each new policy as a Hugging
Face folder under `engine.weights_dir` and the servers load it with `/update_weights_from_disk`: a path
that works wherever the server can read the worker's disk (the same node), with no CUDA IPC between
processes and no NCCL group to set up.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from reflow.config import RunConfig


def _is_weights(name: str) -> bool:
    """Weight files and their shard indexes (model.safetensors.index.json), optimizer and RNG state."""
    return ".safetensors" in name or ".bin" in name or name.endswith((".pt", ".pth"))


def build_engine(config: RunConfig, model_path: str, index: int) -> tuple[Any, Any]:
    """(engine, tokenizer) for rollout worker `index`."""
    if config.engine.kind == "torch":
        from reflow.engine.torch_engine import TorchEngine
        from reflow.models import load_model

        model, tokenizer = load_model(model_path, device=config.resources.device)
        return TorchEngine(model, tokenizer, max_batch_size=config.rollout.max_batch_size), tokenizer

    from transformers import AutoTokenizer

    from reflow.engine.sglang_engine import SGLangEngine
    from reflow.models.presets import resolve_model_path

    path = str(resolve_model_path(model_path))
    tokenizer = AutoTokenizer.from_pretrained(path)  # token-in-token-out: the worker tokenizes
    e = config.engine
    if e.urls:
        return SGLangEngine(e.urls), tokenizer
    assert e.launch_port is not None  # the config validator allows only urls or launch_port
    return SGLangEngine.launch(path, ports=[e.launch_port + index], extra_args=e.launch_args), tokenizer


def weights_dir(config: RunConfig, index: int) -> Path:
    root = Path(config.engine.weights_dir) if config.engine.weights_dir else config.run_dir / "engine-weights"
    return root / f"worker-{index}"


def write_policy(state_dict: dict[str, Any], model_path: str, out: Path) -> Path:
    """Write `state_dict` as a loadable Hugging Face folder at `out` (config and tokenizer files copied
    from `model_path`); written to a sibling first and renamed, so a reader never sees half a folder."""
    from safetensors.torch import save_file

    from reflow.models.presets import resolve_model_path

    src = Path(resolve_model_path(model_path))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not _is_weights(f.name):  # config, generation config, tokenizer, template
            shutil.copy2(f, tmp / f.name)
    # Tied weights share storage, which safetensors refuses: each tensor gets its own contiguous copy.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


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
    folder = write_policy(state_dict, model_path, root / f"v{version:06d}")
    new_version = await engine.update_weights(path=str(folder.resolve()), version=version, rewind=rewind)
    for old in root.glob("v*"):  # the servers hold the weights now; keep only the newest folder
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return new_version
