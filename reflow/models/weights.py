"""Reading model weights from disk: a single checkpoint file or an HF folder of them. Shared by the
engines (weight updates from a path) and the trainer (restoring a checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_state_dict(path: Path) -> dict[str, Any]:
    """Read a checkpoint: a `.safetensors` / `.pt` / `.bin` file, or a folder of them (an HF folder); of a
    folder of LoRA adapters, the adapters (`reflow.models.adapters`)."""
    from reflow.models.adapters import is_adapter_folder, read_adapter_weights

    if is_adapter_folder(path):
        return read_adapter_weights(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) or sorted(path.glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"no .safetensors, .bin or .pt weights in {path}")
    elif path.exists():
        files = [path]
    else:
        raise FileNotFoundError(path)
    state: dict[str, Any] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            import torch

            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state
