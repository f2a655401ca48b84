"""Per-token log-probabilities and entropies of a causal LM, and padding of segments into tensors.

This module owns the one convention the losses rely on: position t of a [B, T] result holds
log p(token_t | tokens_<t), the same alignment as `Segment.logprobs` (position 0, which has no
context, holds 0). It is computed without a full float32 log-softmax over the vocabulary: the
logits are read a chunk of positions at a time, the chosen token's logit minus the logsumexp, and
under autograd each chunk is recomputed in the backward pass instead of keeping its float32 copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from reflow.records import Segment


def _chunk_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    # H = lse - sum(p * z): no log-softmax tensor needed.
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: Literal["none", "detached", "grad"] = "detached",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[..., t]) under logits[..., t, :] / temperature, chunked over positions.

    `entropy`: "none" skips it, "detached" computes it without autograd (for logging), "grad"
    keeps its graph (for an entropy bonus).
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    use_grad = torch.is_grad_enabled() and logits.requires_grad
    logps, ents = [], []
    for start in range(0, logits.shape[-2], chunk_size):
        part = logits[..., start : start + chunk_size, :]
        tgt = targets[..., start : start + chunk_size]
        if not use_grad:
            lp, ent = _chunk_logprobs(part, tgt, temperature, entropy != "none")
        else:
            # Recomputed in backward: no float32 chunk is kept alive between forward and backward.
            lp, ent = checkpoint(
                _chunk_logprobs, part, tgt, temperature, entropy == "grad", use_reentrant=False
            )
            if entropy == "detached":
                with torch.no_grad():
                    ent = _chunk_logprobs(part, tgt, temperature, True)[1]
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps, dim=-1)
    return logp, (None if entropy == "none" else torch.cat(ents, dim=-1))


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: Literal["none", "detached", "grad"] = "detached",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities [B, T] (float32) of `input_ids` under `model`, and the entropy
    [B, T] of the distribution each token was drawn from (None when `entropy="none"`).

    Position t holds log p(token_t | tokens_<t); position 0 and padding (attention_mask 0) hold 0.
    `temperature` must be the sampling temperature for the result to be comparable with the
    behaviour log-probabilities the engine recorded. Gradient flows to the model through the
    log-probabilities (and the entropy when `entropy="grad"`); call under `torch.no_grad()` for the
    prox pass.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    lp, ent = logprobs_from_logits(
        logits[:, :-1], input_ids[:, 1:], temperature=temperature, entropy=entropy, chunk_size=chunk_size
    )
    keep = attention_mask[:, 1:].bool()
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    first = torch.zeros_like(lp[:, :1])
    logp = torch.cat([first, torch.where(keep, lp, zero)], dim=1)
    if ent is not None:
        ent = torch.cat([first, torch.where(keep, ent, zero)], dim=1)
    return logp, ent


def pad_segments(
    segments: Sequence[Segment], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad segments into (input_ids, attention_mask, loss_mask, behav_logp, versions).

    input_ids and attention_mask are int64, loss_mask bool, behav_logp float32 (the behaviour
    log-probability of token t at position t, 0 elsewhere), versions int64 (-1 off the sampled
    tokens). Position 0 is never in the loss mask: no log-probability can be computed for it.
    """
    if not segments:
        raise ValueError("no segments to pad")
    for seg in segments:
        n = len(seg.token_ids)
        if not len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions) == n:
            raise ValueError(
                f"segment {seg.segment_id}: token_ids, loss_mask, logprobs, versions differ in length"
            )
    batch, length = len(segments), max(len(s.token_ids) for s in segments)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.bool)
    behav_logp = torch.zeros((batch, length), dtype=torch.float32)
    versions = torch.full((batch, length), -1, dtype=torch.long)
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        input_ids[i, :n] = torch.tensor(seg.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(seg.loss_mask, dtype=torch.bool)
        behav_logp[i, :n] = torch.tensor(seg.logprobs, dtype=torch.float32)
        versions[i, :n] = torch.tensor(seg.versions, dtype=torch.long)
    loss_mask[:, 0] = False
    return input_ids, attention_mask, loss_mask, behav_logp, versions
