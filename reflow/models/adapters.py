"""LoRA adapter folders on disk (peft's format): what they are, which base model they name, and that
base with the adapters merged in, which `load_model` returns for such a folder.

An adapter folder holds `adapter_config.json` (peft's `LoraConfig`, with `base_model_name_or_path`
naming the base model's folder) and `adapter_model.safetensors`; reflow's also hold the base's
`config.json`, the tokenizer and `reflow_base.json` (the base's path relative to the folder, which
wins: a moved or copied run folder reads its own base). `reflow.train.lora` writes them (the trainer's
checkpoints under `model.lora`); `peft.PeftModel.from_pretrained` and SGLang's `/load_lora_adapter`
read them too.
A model with adapters injected in place (`peft.inject_adapter_in_model`, as the trainer and the engines
hold them) names them `...q_proj.lora_A.default.weight`; the file names them as a `PeftModel` does
(`to_peft_keys`, `from_peft_keys`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_LINK = "reflow_base.json"
"""reflow's note beside peft's config: the base's path relative to the adapter folder, so that a run
folder (its checkpoints and its `model-base`) still finds its base when moved or copied elsewhere."""
ADAPTER_NAME = "default"  # peft's name for a model's only adapter
_PEFT_PREFIX = "base_model.model."  # a PeftModel's prefix of the wrapped model's names


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write_base_link(folder: str | Path, base: str | Path) -> None:
    """Write `folder`'s `reflow_base.json`: `base` relative to it (a new file, never through a hard
    link that another folder shares)."""
    link = Path(folder) / BASE_LINK
    link.unlink(missing_ok=True)
    link.write_text(json.dumps({"relative": os.path.relpath(Path(base).resolve(), Path(folder).resolve())}))


def adapter_config(folder: str | Path) -> dict[str, Any]:
    """The folder's `adapter_config.json`."""
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())


def base_model_path(path: str | Path) -> Path:
    """The base model folder of an adapter folder: at its `reflow_base.json`'s relative path (a run
    folder moved or copied elsewhere reads its own base), else the absolute path peft's config names;
    any other folder is its own base."""
    if not is_adapter_folder(path):
        return Path(path)
    base = Path(adapter_config(path)["base_model_name_or_path"])
    link = Path(path) / BASE_LINK
    if link.is_file():
        near = (Path(path) / json.loads(link.read_text())["relative"]).resolve()
        base = near if (near / "config.json").is_file() else base
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds LoRA adapters on {base}, which is not a model folder (any more)"
        )
    return base


def to_peft_keys(adapters: dict[str, Any]) -> dict[str, Any]:
    """Our names to peft's file format: `model.layers.0.self_attn.q_proj.lora_A.default.weight` is
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` there."""
    return {_PEFT_PREFIX + k.replace(f".{ADAPTER_NAME}.", "."): v for k, v in adapters.items()}


def from_peft_keys(tensors: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `to_peft_keys`."""
    out = {}
    for key, value in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{ADAPTER_NAME}.")
        out[name] = value
    return out


def read_adapter_weights(folder: str | Path) -> dict[str, Any]:
    """The adapter weights of an adapter folder, by the names of a model with them injected
    (`from_peft_keys`)."""
    from safetensors.torch import load_file

    return from_peft_keys(load_file(str(Path(folder) / ADAPTER_WEIGHTS)))


def merge_adapters(base: Any, folder: str | Path) -> Any:
    """`base` (a plain HF model) with the adapters of `folder` merged into its weights, through peft's
    own loader: a plain model again, no adapter layer left."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
