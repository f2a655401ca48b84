"""The shared-prefix forward gives the loss and gradients of the full rows."""

import random

import pytest
import torch
from engine_helpers import small_qwen3

from reflow.records import Segment
from reflow.train.prefix import shared_prefix_len
from reflow.train.sft import masked_nll, pack_batches


def _model():
    return small_qwen3(vocab_size=128).train()


def _rows(prefix_len: int, n: int = 5) -> list[Segment]:
    rng = random.Random(1)
    prefix = [rng.randrange(1, 128) for _ in range(prefix_len)]
    rows = []
    for i in range(n):
        suffix = [rng.randrange(1, 128) for _ in range(rng.randint(8, 20))]
        mask = [0] * (prefix_len + 3) + [1] * (len(suffix) - 3)
        ids = prefix + suffix
        rows.append(Segment(i, ids, mask, [0.0] * len(ids), [-1] * len(ids)))
    return rows


def _loss_and_grads(model, rows):
    loss, n = masked_nll(model, rows, pad_id=0)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.item(), n, grads


def test_shared_prefix_matches_full_rows(monkeypatch):
    model = _model()
    rows = _rows(prefix_len=40)
    assert shared_prefix_len(rows) == 39
    shared = _loss_and_grads(model, rows)
    monkeypatch.setattr("reflow.train.sft.shared_prefix_len", lambda rows: 0)
    full = _loss_and_grads(model, rows)
    assert shared[0] == pytest.approx(full[0], abs=1e-6)
    assert shared[1] == full[1] == sum(sum(r.loss_mask[1:]) for r in rows)
    for a, b in zip(shared[2], full[2], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_shared_prefix_len_stops_before_trained_tokens_and_differences():
    rows = _rows(prefix_len=40)
    assert shared_prefix_len(rows) == 39  # rows differ right after the 40 shared tokens
    rows[0].loss_mask[20] = 1  # a trained token inside the shared part cuts the prefix there
    assert shared_prefix_len(rows) == 19
    assert shared_prefix_len(_rows(prefix_len=5)) == 0  # too short to bother


def test_pack_batches_counts_the_shared_prefix_once():
    rows = _rows(prefix_len=40, n=20)
    batches = pack_batches(rows, batch_tokens=200, rng=random.Random(0), shared=39)
    assert sorted(r.segment_id for b in batches for r in b) == list(range(20))
    for batch in batches:
        longest = max(len(r.token_ids) for r in batch)
        assert len(batch) == 1 or 39 + (longest - 39) * len(batch) <= 200
