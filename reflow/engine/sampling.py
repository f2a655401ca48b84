"""Batched sampling with per-row parameters, and incremental detokenization for stop strings.

Logprobs follow `GenerateResult`'s contract: log_softmax(logits / T) with T = 0 counted as 1, before
any top-k / top-p filter, so they are the behaviour-policy logprobs the trainer recomputes. Sampling uses
the exponential race (argmax of p / E with E = -log U ~ Exp(1)), which draws exactly from p and lets each seeded
request draw its noise from its own generator: a seeded request's tokens then depend on its own seed and
logits only, not on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class BatchParams:
    """Per-row sampling settings of the rows in one step, as tensors (rebuilt when the batch changes)."""

    temperature: torch.Tensor  # [n], 0 replaced by 1 (greedy rows' logprobs are at temperature 1)
    greedy: torch.Tensor  # [n] bool
    top_p: torch.Tensor | None  # [n] or None when no row filters
    top_k: torch.Tensor | None  # [n] (0 -> vocab size) or None
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool  # every row at T = 1 (or greedy): no scaling needed
    any_seeded: bool

    @classmethod
    def build(
        cls,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> BatchParams:
        greedy = [t == 0 for t in temperatures]
        filters = any(p < 1.0 for p in top_ps) or any(0 < k < vocab_size for k in top_ks)
        return cls(
            temperature=torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device),
            greedy=torch.tensor(greedy, device=device),
            top_p=torch.tensor(top_ps, device=device) if filters else None,
            top_k=torch.tensor([k if k > 0 else vocab_size for k in top_ks], device=device)
            if filters
            else None,
            generators=generators,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            unit_temperature=all(t in (0, 1) for t in temperatures),
            any_seeded=any(g is not None for g in generators),
        )


def filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (the best token always stays)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None]
    drop = (before > top_p[:, None]) | (rank >= top_k[:, None])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: BatchParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [n, V]; returns (tokens [n], logprobs [n]) in float32."""
    logits = logits.float()
    # Every op here runs once per decode step on the whole batch; the shortcuts skip work a batch
    # does not need (scaling at T = 1, a second softmax without filters, greedy handling).
    scaled = logits if params.unit_temperature else logits / params.temperature[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if params.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        if params.top_p is not None and params.top_k is not None:
            probs = filter_top_k_top_p(scaled, params.top_k, params.top_p).softmax(dim=-1)
        else:
            probs = logp.exp()
        # Exp(1) noise as -log(U): torch's exponential_ is ~7x slower than rand on CPU.
        uniform = torch.rand_like(probs)
        if params.any_seeded:
            for i, gen in enumerate(params.generators):
                if gen is not None:
                    uniform[i] = torch.rand(probs.shape[-1], generator=gen, device=probs.device)
        tokens = (probs / -torch.log(uniform)).argmax(dim=-1)
        if params.any_greedy:
            tokens = torch.where(params.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class IncrementalDetokenizer:
    """Decodes a growing list of ids piece by piece, holding back an incomplete UTF-8 character.

    Decoding only a short tail each token (not the whole output) keeps stop-string checks O(1) per step.
    A byte-level BPE token can end in the middle of a character; its text then ends in U+FFFD until the
    next token completes it, so such a piece is held back rather than matched against stop strings.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] were already turned into text (kept as decoding context)
        self._read = 0

    def push(self, ids: list[int]) -> str:
        """Account for ids appended since the last call; returns the newly completed text."""
        new_text = self._decode(ids[self._prefix :])
        if new_text.endswith("\ufffd"):
            return ""
        done = self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        delta = new_text[len(done) :]
        self._prefix, self._read = self._read, len(ids)
        self.text += delta
        return delta


def find_stop(text: str, delta: str, stops: Sequence[str]) -> str | None:
    """The first stop string that ends inside the newly added `delta` of `text` (None if none)."""
    if not delta:
        return None
    for stop in stops:
        # A match must overlap the new text; earlier text was already checked.
        begin = max(0, len(text) - len(delta) - len(stop) + 1)
        if stop in text[begin:]:
            return stop
    return None
