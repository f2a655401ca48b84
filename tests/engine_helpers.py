"""Shared helpers of the TorchEngine tests: a small, lively tiny model and reference computations."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import transformers

from reflow.engine import SamplingParams
from reflow.engine.torch_engine import TorchEngine
from reflow.models import build_tiny

# A larger init than the preset's 0.02: with tied embeddings a small random model just repeats its input
# token, and a constant output would hide position or cache mix-ups; this one writes varied,
# context-dependent text.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "initializer_range": 0.2,
}


def build_tiny_engine_model(folder: Path) -> tuple[Path, Any, Any]:
    """(path, model, tokenizer) of a small tiny-preset model built into `folder`."""
    path = build_tiny(folder, **SMALL)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, model, tokenizer


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(n)]  # ordinary (non-special) ids


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def reference_logprobs(model, ids: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one full forward pass over prompt+output."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    logp = (logits / (temperature or 1.0)).log_softmax(-1)
    return logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


async def solo(tiny, ids: list[int], params: SamplingParams) -> list[int]:
    """The same request through a fresh engine that serves nothing else."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=1)
    try:
        return (await eng.generate(ids, params)).output_ids
    finally:
        await eng.close()


def small_qwen3(vocab_size: int = 64, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised 2-layer Qwen3 (width 32) built in code, for trainer and loss tests."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        **overrides,
    }
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, **fields)).eval()
