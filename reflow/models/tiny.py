"""The `tiny` preset: a ~0.9M-parameter Qwen3 and a byte-level BPE tokenizer, built offline.

`build_tiny(out_dir)` writes an ordinary Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with the chat template), so that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` and any HF-compatible engine
load it. Nothing is downloaded: the tokenizer is trained here with `tokenizers` on a corpus built in code
(`reflow.models.corpus`), and the weights are a seeded random init. The same arguments give the same
folder contents on every machine.

Tokenizer choices, and why:
- byte-level BPE with Qwen2's pre-tokenizer regex, except that runs of up to 3 digits stay together
  and each such run is one token: all 1,110 strings of 1-3 digits are in the vocabulary (the 1,100
  of 2-3 digits on top of `vocab_size`; as in GPT-4's tokenizer; `digits_per_token=1` gives Qwen's one digit per token), and
  no normalizer, so that decode(encode(text)) == text for any unicode string (Qwen's NFC would not).
  Measured on the calculator env after `make train`'s warm start: digit by digit 2-11% held-out
  success, runs of digits split by BPE merges (216 as 2|16, 148 as 14|8) 22%, whole numbers 26%
  (1-step problems 93%; the remaining errors had been miscopied last tokens of numbers);
- the size (3 layers, width 128) is what a 2-core CPU can warm-start in minutes: a 3.7M-parameter
  version (width 256, 4 layers) ran ~3x fewer steps in the same time and did not get there;
- `<|im_end|>` is the EOS (the end of an assistant turn), `<|endoftext|>` the pad; the tool-call and
  think markup are single tokens but not "special", so decoding with skip_special_tokens keeps them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reflow.models.chat_template import (
    CHAT_TEMPLATE,
    CONTROL_TOKENS,
    ENDOFTEXT,
    IM_END,
    MARKUP_TOKENS,
)
from reflow.models.corpus import generic_corpus

# Bump when the builder's output changes, so cached preset folders are rebuilt.
BUILDER_VERSION = 4

# Qwen2/Qwen3's pre-tokenization pattern (as in their tokenizer.json).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}


def pretokenize_pattern(digits_per_token: int = 3) -> str:
    """Qwen's pattern, or with runs of up to `digits_per_token` digits kept together (as GPT-4's
    tokenizer keeps up to 3): a tiny model then copies a number below 1000 as one token, not digit by digit."""
    if not 1 <= digits_per_token <= 3:  # each extra digit multiplies the number tokens by ten
        raise ValueError(f"digits_per_token must be 1, 2 or 3, got {digits_per_token}")
    if digits_per_token == 1:
        return PRETOKENIZE_PATTERN
    return PRETOKENIZE_PATTERN.replace(r"|\p{N}|", rf"|\p{{N}}{{1,{digits_per_token}}}|")


def _with_number_tokens(bpe: dict[str, Any], digits_per_token: int) -> Any:
    """The trained BPE model plus every string of 2..`digits_per_token` digits as one token.

    Left to BPE, which runs of digits become tokens depends on their frequency in the corpus: 216 came
    out as 2|16 and 148 as 14|8, so a number's tokens vary with its value and copying it took several
    uneven steps. With all of them in the vocabulary (as in GPT-4's, which has every 1-3 digit string),
    each pre-tokenized run of digits is exactly one token. Every split of a run gets a merge into it, so
    the result does not depend on which pair BPE merges first.
    """
    from tokenizers import models

    vocab: dict[str, int] = dict(bpe["vocab"])
    merges = [tuple(m) for m in bpe["merges"]]
    for length in range(2, digits_per_token + 1):
        for value in range(10**length):
            digits = str(value).zfill(length)
            vocab.setdefault(digits, len(vocab))
            merges += [(digits[:cut], digits[cut:]) for cut in range(1, length)]
    return models.BPE(vocab=vocab, merges=merges, ignore_merges=False)


def train_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = 2048, digits_per_token: int = 3
) -> Any:
    """Train the byte-level BPE tokenizer; returns a `PreTrainedTokenizerFast` (not yet saved).

    `vocab_size` counts the learnt tokens and the special ones; the number tokens (1,100 with
    `digits_per_token=3`) come on top.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    n_special = len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
    if vocab_size < 256 + n_special + 1:
        raise ValueError(f"vocab_size must exceed the 256 bytes plus {n_special} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(pretokenize_pattern(digits_per_token)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,  # the special tokens go on top, at the end, as in Qwen
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(generic_corpus() if corpus is None else corpus)
    if digits_per_token > 1:  # the number tokens are added whole below; BPE learns the text
        texts = [re.sub(r"[0-9]+", " ", t) for t in texts]
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if digits_per_token > 1:
        tok.model = _with_number_tokens(json.loads(tok.to_str())["model"], digits_per_token)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break exact round trips
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def make_tokenizer_config_portable(out: Path) -> None:
    """transformers 5 names the class `TokenizersBackend` and keeps the template in chat_template.jinja;
    transformers 4.x (which SGLang and vLLM may pin) knows neither, so name the class by its
    4.x/5.x-common alias and also keep the template inline."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def build_tiny(
    out_dir: str | Path,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 2048,
    seed: int = 0,
    digits_per_token: int = 3,
    **config_overrides: Any,
) -> Path:
    """Build the tiny Qwen3 model and its tokenizer into `out_dir` (created); returns the folder.

    `corpus` trains the tokenizer (default: the generic built-in corpus); `config_overrides` change
    `Qwen3Config` fields (e.g. `num_hidden_layers=2, hidden_size=128` for faster tests).
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, vocab_size, digits_per_token)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    fields = {**TINY_CONFIG, **config_overrides}
    if "head_dim" not in config_overrides:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config = Qwen3Config(
        vocab_size=len(tokenizer),  # exactly the tokenizer's ids: no unused rows to sample from
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **fields,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    make_tokenizer_config_portable(out)
    (out / "reflow_preset.json").write_text(
        json.dumps(
            {
                "preset": "tiny",
                "builder_version": BUILDER_VERSION,
                "seed": seed,
                "vocab_size": vocab_size,
                "digits_per_token": digits_per_token,
            }
        )
    )
    return out
