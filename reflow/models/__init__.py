"""Model presets built with no hub downloads: the `tiny` CPU default and local HF folders.

    from reflow.models import load_model, resolve_model_path, build_tiny
    model, tokenizer = load_model("tiny")        # or "smollm2-135m", or any local HF folder

`chat_template` holds the Qwen-style template and special tokens (no heavy imports); the rest loads
torch and transformers on first use, so `import reflow.models` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reflow.models.chat_template import CHAT_TEMPLATE, SPECIAL_TOKENS

if TYPE_CHECKING:
    from reflow.models.presets import PRESETS, cache_dir, load_model, resolve_model_path
    from reflow.models.smollm2 import build_smollm2
    from reflow.models.tiny import build_tiny, train_tokenizer

_LAZY = {
    "PRESETS": "reflow.models.presets",
    "cache_dir": "reflow.models.presets",
    "load_model": "reflow.models.presets",
    "resolve_model_path": "reflow.models.presets",
    "build_smollm2": "reflow.models.smollm2",
    "build_tiny": "reflow.models.tiny",
    "train_tokenizer": "reflow.models.tiny",
}

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "build_smollm2",
    "build_tiny",
    "cache_dir",
    "load_model",
    "resolve_model_path",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'reflow.models' has no attribute {name!r}")
