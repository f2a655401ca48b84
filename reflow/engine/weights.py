"""Weight updates for in-process engines: check a state dict, copy it in place (checkpoints are read
by `reflow.models.weights.load_state_dict`).

Weights are copied into the existing parameters (never replaced) so that everything holding them (tied
embeddings, the engine's model reference) sees the new values at once, and so that a trainer's tensors
on another device or in another dtype can be passed as they are.
"""

from __future__ import annotations

from typing import Any

import torch


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # remove_duplicate=False: tied weights answer to both names (lm_head.weight and embed_tokens.weight).
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Raise KeyError for names the model lacks and ValueError for shape mismatches."""
    targets = _targets(model)
    unknown = sorted(k for k in state_dict if k not in targets)
    if unknown:
        raise KeyError(f"state dict has {len(unknown)} keys the model lacks, e.g. {unknown[:3]}")
    for key, value in state_dict.items():
        if tuple(value.shape) != tuple(targets[key].shape):
            raise ValueError(f"{key}: shape {tuple(value.shape)} != model's {tuple(targets[key].shape)}")


@torch.no_grad()
def copy_weights(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Copy `state_dict` into the model's tensors in place (converting device and dtype)."""
    targets = _targets(model)
    for key, value in state_dict.items():
        target = targets[key]
        target.copy_(value.detach().to(device=target.device, dtype=target.dtype))
