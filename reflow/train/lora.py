"""LoRA on the policy through peft: adapters injected into a frozen model, their weights alone, and
saving and loading them (the folder format is `reflow.models.adapters`).

    model = apply_lora(model, LoraSettings(r=8))   # the same model object, adapters in, base frozen
    adapters = adapter_state_dict(model)           # {"model.layers.0.self_attn.q_proj.lora_A.default.weight": ...}
    save_adapters(folder, adapters, settings, base="/path/to/base")
    model, tokenizer = load_lora_model(folder, settings)   # base + injected adapters, as saved

The adapters are injected in place (`peft.inject_adapter_in_model`), so the model keeps its class and
everything that walks it (FSDP2's per-layer sharding, the engines' forward, `model.config`) works
unchanged; the adapters are its parameters whose names hold `.lora_A.` or `.lora_B.`. Trainer and
engines inject the same way, so adapter names match on both sides and a weight sync copies them by
name (`reflow.engine.weights.copy_weights`). On disk an adapter folder is peft's own format
(`adapter_config.json` naming the base folder, `adapter_model.safetensors` keyed as a `PeftModel`'s),
which `peft.PeftModel.from_pretrained` and SGLang's `/load_lora_adapter` read; a checkpoint's also holds
the base's `config.json` and the tokenizer, so it is a model folder the rest of the project accepts
(`reflow.models.load_model` merges it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from reflow.models.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_NAME,
    ADAPTER_WEIGHTS,
    adapter_config,
    base_model_path,
    is_adapter_folder,
    read_adapter_weights,
    to_peft_keys,
    write_base_link,
)
from reflow.train.settings import LoraSettings


def peft_config(settings: LoraSettings) -> Any:
    """peft's `LoraConfig` for `settings`; ImportError naming the extra when peft is not installed."""
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise ImportError(f"model.lora needs peft: pip install 'reflow-rl[train]' ({e})") from None

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> torch.nn.Module:
    """Inject fresh adapters into `model` in place and freeze everything else; returns `model`. B
    starts at zero, so the model computes what it did; A is drawn from `seed` alone, so every FSDP
    rank (and every engine) starts from the same adapters; they are float32 whatever the base's
    dtype, and in the model's mode (train or eval). ValueError when no module matches."""
    config = peft_config(settings)  # first: it names the extra when peft is missing
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    training = model.training
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
        except ValueError as e:
            raise ValueError(f"model.lora.target_modules {settings.target_modules}: {e}") from None
    # peft's new modules start in training mode: an eval model (an engine's) would sample with dropout
    model.train(training)
    # Adapters of a bf16/fp16 base in float32, as `peft.get_peft_model` makes them: AdamW's small steps
    # on the adapters would round away in bf16 (the layer casts its input to the adapters' dtype)
    cast_adapter_dtype(model, adapter_name=ADAPTER_NAME, autocast_adapter_dtype=True)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (as `apply_lora` names them)."""
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights, detached copies on the CPU."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if is_adapter(n)}


def save_adapters(
    folder: str | Path, adapters: dict[str, torch.Tensor], settings: LoraSettings, base: str | Path
) -> Path:
    """Write `adapters` in peft's format into `folder` (created), naming `base` as their base model."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_peft_keys(adapters).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(settings).to_dict()
    config["base_model_name_or_path"] = str(Path(base).resolve())
    config["target_modules"] = sorted(config["target_modules"])  # peft keeps a set: JSON needs a list
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str))
    write_base_link(folder, base)
    return folder


def read_adapters(folder: str | Path) -> tuple[dict[str, torch.Tensor], LoraSettings]:
    """(adapters by our names, their settings) of an adapter folder."""
    config = adapter_config(folder)
    settings = LoraSettings(
        r=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0),
        target_modules=sorted(config["target_modules"]),
    )
    return read_adapter_weights(folder), settings


def load_lora_model(
    path: str | Path, settings: LoraSettings, *, device: str = "cpu", seed: int = 0
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for LoRA training or serving: the base model with adapters injected, those of
    `path` when it is an adapter folder (a checkpoint: their settings must be `settings`'), fresh
    ones (`apply_lora`) when it is a plain model folder or preset."""
    from reflow.models import load_model

    model, tokenizer = load_model(base_model_path(path), device=device)
    apply_lora(model, settings, seed)
    if is_adapter_folder(path):
        adapters, saved = read_adapters(path)
        if (saved.r, saved.alpha, sorted(saved.target_modules)) != (
            settings.r,
            settings.alpha,
            sorted(settings.target_modules),
        ):
            raise ValueError(
                f"{path} holds LoRA adapters with other settings ({saved}) than model.lora ({settings})"
            )
        load_adapters(model, adapters)
    return model, tokenizer


def load_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Copy `adapters` into the model's adapters, which they must match exactly (ValueError)."""
    check_adapters(model, adapters)
    model.load_state_dict(adapters, strict=False)


def check_adapters(model: torch.nn.Module, adapters: dict[str, Any]) -> None:
    """ValueError unless `adapters` name exactly the model's adapters."""
    expected = {n for n, _ in model.named_parameters() if is_adapter(n)}
    if set(adapters) != expected:
        differ = sorted(set(adapters) ^ expected)
        raise ValueError(
            f"{len(adapters)} adapter tensors for the model's {len(expected)}: e.g. {differ[:3]} differ "
            "(adapters of another model.lora?)"
        )
