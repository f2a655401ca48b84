"""Inference engines: token ids in, sampled token ids with their logprobs out.

This package knows no environments, replay or training. `Engine` is the interface; `TorchEngine`
(in-process, CPU default) and `SGLangEngine` (remote SGLang servers) implement it.
"""

from reflow.engine.base import Engine, EngineError, GenerateResult, SamplingParams

__all__ = ["Engine", "EngineError", "GenerateResult", "SamplingParams"]
