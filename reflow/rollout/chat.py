"""Text <-> tokens for rollout, through the model's own chat template.

Assistant turns are rendered from the exact text the model sampled (`{"role": "assistant", "content":
raw}`), never from re-serialised tool calls, so the template's rendering of history can only differ
from what was sampled where the template itself rewrites history (e.g. dropping old <think> blocks).
"""

from __future__ import annotations

import hashlib
from typing import Any

from reflow.env import Message


class ChatRenderer:
    """Wraps a Hugging Face tokenizer with a chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; rollout needs one to render turns")
        self.tokenizer = tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_ids: list[int] = eos
        self.eos_texts = [tokenizer.decode([i]) for i in eos]
        self.chat_template_id = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]
        vocab = sorted(tokenizer.get_vocab().items())
        self.tokenizer_id = (
            f"{getattr(tokenizer, 'name_or_path', '') or 'tokenizer'}@"
            + (hashlib.sha256(repr(vocab).encode()).hexdigest()[:16])
        )

    def render(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def strip_eos(self, text: str) -> str:
        for eos in self.eos_texts:
            if eos and text.endswith(eos):
                return text[: -len(eos)]
        return text
