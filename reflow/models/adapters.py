"""LoRA adapter folders on disk (peft's format): what they are, which base model they name, and that
base with the adapters merged in, which `load_model` returns for such a folder.

An adapter folder holds `adapter_config.json` (peft's `LoraConfig`, with `base_model_name_or_path`
naming the base model's folder) and `adapter_model.safetensors`; reflow's also hold the base's
`config.json` and the tokenizer. `reflow.train.lora` writes them (the trainer's checkpoints under
`model.lora`); `peft.PeftModel.from_pretrained` and SGLang's `/load_lora_adapter` read them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(folder: str | Path) -> dict[str, Any]:
    """The folder's `adapter_config.json`."""
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())


def base_model_path(path: str | Path) -> Path:
    """The base model folder an adapter folder names; any other folder is its own base."""
    if not is_adapter_folder(path):
        return Path(path)
    base = Path(adapter_config(path)["base_model_name_or_path"])
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds LoRA adapters on {base}, which is not a model folder (any more)"
        )
    return base


def merge_adapters(base: Any, folder: str | Path) -> Any:
    """`base` (a plain HF model) with the adapters of `folder` merged into its weights, through peft's
    own loader: a plain model again, no adapter layer left."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
