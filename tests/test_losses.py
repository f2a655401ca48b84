"""Policy losses (decoupled PPO, truncated IS) on hand-computed values, and per-token log-probs."""

import math

import pytest
import torch
from engine_helpers import small_qwen3

from reflow.records import Segment
from reflow.train.logprobs import logprobs_from_logits, pad_segments, token_logprobs
from reflow.train.losses import LossConfig, engine_gap_stats, loss_denominator, masked_mean, policy_loss

LN = math.log


def _t(values):
    return torch.tensor([values], dtype=torch.float32)


def _inputs(log_u, log_w, adv, mask=None, behav=None):
    """One row: logp = prox + log u, behav = prox - log w, with prox = -1 (any value works)."""
    prox = torch.full((1, len(log_u)), -1.0)
    logp = (prox + _t(log_u)).requires_grad_(True)
    behav_logp = prox - _t(log_w) if behav is None else behav
    mask = torch.ones_like(prox, dtype=torch.bool) if mask is None else _t(mask).bool()
    return logp, prox, behav_logp, _t(adv), mask


# ---- decoupled PPO


def test_upper_clip_by_hand():
    # A=+1, u=1.5: clipped at 1 + 0.28, the clipped branch is active and gives no gradient.
    logp, prox, behav, adv, mask = _inputs([LN(1.5)], [0.0], [1.0])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, LossConfig())
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.tolist() == [[0.0]]


def test_four_clip_cases_by_hand():
    # (A, u): (+1, 1.5) clipped at 1.28; (+1, 0.5) unclipped -0.5; (-1, 0.5) clipped at 0.8 -> +0.8;
    # (-1, 1.5) unclipped +1.5. The loss is the token mean; d loss / d logp = -A*u/4 where unclipped.
    logp, prox, behav, adv, mask = _inputs([LN(1.5), LN(0.5), LN(0.5), LN(1.5)], [0.0] * 4, [1, 1, -1, -1])
    loss, stats = policy_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4)
    assert stats["clip_frac"].item() == 0.5
    assert stats["n_tokens"].item() == 4
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4])


def test_lower_clip_uses_clip_eps():
    cfg = LossConfig(clip_eps=0.1, clip_eps_high=0.3)
    # A=-1, u=0.5: max(0.5, 0.9) = 0.9.  A=+1, u=2: max(-2, -1.3) = -1.3.
    logp, prox, behav, adv, mask = _inputs([LN(0.5), LN(2.0)], [0.0, 0.0], [-1, 1])
    loss, _ = policy_loss(logp, prox, behav, adv, mask, cfg)
    assert loss.item() == pytest.approx((0.9 - 1.3) / 2)


def test_replay_clip_stops_replayed_tokens_past_the_behaviour_clip_by_hand():
    # u = 1 (first update, theta == prox); the behaviour ratio r = pi_theta / pi_behav = w. Rows:
    # replayed (A=+1, r=1.5) past 1.28 -> no gradient; replayed (A=-1, r=0.5) under 0.8 -> none;
    # replayed (A=+1, r=1.1) inside -> gradient; fresh (A=+1, r=1.5) -> gradient (the clip is off).
    log_w = [[LN(1.5)], [LN(0.5)], [LN(1.1)], [LN(1.5)]]
    prox = torch.full((4, 1), -1.0)
    behav = prox - torch.tensor(log_w)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    replayed = torch.tensor([True, True, True, False])
    grads = {}
    for on in (False, True):
        logp = prox.clone().requires_grad_(True)
        loss, stats = policy_loss(logp, prox, behav, adv, mask, LossConfig(replay_clip=on), replayed)
        loss.backward()
        grads[on] = logp.grad[:, 0].tolist()
        if on:
            assert stats["replay_clip_frac"].item() == 0.5
            # the stopped tokens keep their value in the loss: the loss is the same with the clip off
            assert loss.item() == pytest.approx(-(1.5 - 0.5 + 1.1 + 1.5) / 4)
    # without the clip every row pushes: d loss / d logp = -A * w / 4
    assert grads[False] == pytest.approx([-1.5 / 4, 0.5 / 4, -1.1 / 4, -1.5 / 4])
    assert grads[True] == pytest.approx([0.0, 0.0, -1.1 / 4, -1.5 / 4])


def test_replay_clip_without_replayed_rows_changes_nothing():
    torch.manual_seed(1)
    logp = (-torch.rand(3, 4)).requires_grad_(True)
    prox, behav = logp.detach() + 0.05, logp.detach() - 0.3
    adv, mask = torch.randn(3), torch.ones(3, 4)
    on, _ = policy_loss(
        logp, prox, behav, adv, mask, LossConfig(replay_clip=True), torch.zeros(3, dtype=torch.bool)
    )
    (g_on,) = torch.autograd.grad(on, logp)
    off, _ = policy_loss(logp, prox, behav, adv, mask, LossConfig())
    (g_off,) = torch.autograd.grad(off, logp)
    assert torch.equal(g_on, g_off) and on.item() == off.item()


def test_behaviour_weight_and_cap_masking_by_hand():
    # Token 0: w = 2, A=+1, u=1.1 -> w*pg = 2 * -1.1. Token 1: w = 6 > cap 5 -> masked out: it adds 0
    # but stays in the denominator (the loss mask's, as in verl and AReaL), so its neighbours do not
    # weigh more. Token 2: w = 5 exactly is kept (only w > cap is masked): A=-1, u=1 -> 5 * 1.
    logp, prox, behav, adv, mask = _inputs([LN(1.1), 0.0, 0.0], [LN(2.0), LN(6.0), LN(5.0)], [1, 1, -1])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, LossConfig(kind="decoupled_ppo"))
    assert loss.item() == pytest.approx((-2.2 + 5.0) / 3)
    assert stats["masked_frac"].item() == pytest.approx(1 / 3)
    assert stats["n_tokens"].item() == 2
    assert stats["w_mean"].item() == pytest.approx(3.5)
    assert stats["w_max"].item() == pytest.approx(5.0)
    assert stats["trunc_frac"].item() == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([2 * -1.1 / 3, 0.0, 5 * 1.0 / 3])


def test_everything_capped_gives_zero_loss_not_nan():
    logp, prox, behav, adv, mask = _inputs([0.0, 0.0], [LN(10.0), LN(100.0)], [1, -1])
    loss, stats = policy_loss(logp, prox, behav, adv, mask)
    assert loss.item() == 0.0
    assert stats["masked_frac"].item() == 1.0 and stats["n_tokens"].item() == 0
    assert stats["w_max"].item() == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# ---- truncated IS


def test_tis_truncates_instead_of_masking():
    # Token 0: w = 1.5, A=+1, u=1.1 -> 1.5 * -1.1. Token 1: w = 6 truncated to C=2, A=+1, u=1 -> 2 * -1.
    logp, prox, behav, adv, mask = _inputs([LN(1.1), 0.0], [LN(1.5), LN(6.0)], [1, 1])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, LossConfig(kind="tis", tis_cap=2.0))
    assert loss.item() == pytest.approx((-1.65 - 2.0) / 2)
    assert stats["masked_frac"].item() == 0.0
    assert stats["trunc_frac"].item() == 0.5
    assert stats["w_mean"].item() == pytest.approx(1.75)
    assert stats["w_max"].item() == pytest.approx(2.0)
    assert stats["n_tokens"].item() == 2


def test_tis_keeps_the_clipped_ppo_term():
    # w = 1 (below the cap); A=+1, u=1.5 -> clipped at 1.28.
    logp, prox, behav, adv, mask = _inputs([LN(1.5)], [0.0], [1.0])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, LossConfig(kind="tis"))
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_frac"].item() == 1.0


# ---- statistics, masking, gradients


def test_kl_behav_is_the_k3_estimate_over_mask_tokens():
    # r = logp - behav_logp: k3 = exp(r) - 1 - r, averaged over the mask tokens (capped ones too).
    logp, prox, behav, adv, mask = _inputs([0.3, -0.2, 0.0], [0.1, LN(8.0), 0.0], [1, 1, 1])
    _, stats = policy_loss(logp, prox, behav, adv, mask)
    rs = [0.3 + 0.1, -0.2 + LN(8.0), 0.0]
    expected = sum(math.exp(r) - 1 - r for r in rs) / 3
    assert stats["kl_behav"].item() == pytest.approx(expected, rel=1e-5)
    assert stats["masked_frac"].item() == pytest.approx(1 / 3)


def test_masked_tokens_contribute_nothing_even_with_garbage():
    logp, prox, behav, adv, mask = _inputs(
        [LN(1.5), 0.0, LN(0.5)], [0.0, 0.0, 0.0], [1, 1, -1], mask=[1, 0, 1]
    )
    ref_loss, ref_stats = policy_loss(logp, prox, behav, adv, mask)
    # Padding may hold anything: inf / nan in every input at the masked position changes nothing.
    with torch.no_grad():
        garbage_logp = logp.detach().clone()
        garbage_logp[0, 1] = float("inf")
    garbage_logp.requires_grad_(True)
    garbage_prox, garbage_behav, garbage_adv = prox.clone(), behav.clone(), adv.clone()
    garbage_prox[0, 1] = float("-inf")
    garbage_behav[0, 1] = float("nan")
    garbage_adv[0, 1] = float("nan")
    loss, stats = policy_loss(garbage_logp, garbage_prox, garbage_behav, garbage_adv, mask)
    assert loss.item() == pytest.approx(ref_loss.item())
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value.item()), key
    loss.backward()
    assert garbage_logp.grad[0, 1].item() == 0.0
    assert torch.isfinite(garbage_logp.grad).all()


def test_gradient_flows_only_through_logp():
    torch.manual_seed(0)
    logp = (-torch.rand(2, 5)).requires_grad_(True)
    prox = (logp.detach() + 0.1 * torch.randn(2, 5)).requires_grad_(True)
    behav = (prox.detach() + 0.1 * torch.randn(2, 5)).requires_grad_(True)
    adv = torch.randn(2, 5).requires_grad_(True)
    for kind in ("decoupled_ppo", "tis"):
        loss, stats = policy_loss(logp, prox, behav, adv, torch.ones(2, 5), LossConfig(kind=kind))
        loss.backward()
        assert logp.grad is not None and logp.grad.abs().sum() > 0
        assert prox.grad is None and behav.grad is None and adv.grad is None
        assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
        logp.grad = None


def _plain_ppo(logp, old, adv, mask, lo=0.2, hi=0.28):
    u = torch.exp(logp - old)
    obj = torch.minimum(adv * u, adv * u.clamp(1 - lo, 1 + hi))
    return -(obj * mask).sum() / mask.sum()


@pytest.mark.parametrize("kind", ["decoupled_ppo", "tis"])
def test_sync_mode_is_plain_clipped_ppo(kind):
    # Behaviour == prox (on-policy, synchronous): w == 1 exactly, nothing masked or truncated.
    torch.manual_seed(1)
    prox = -3 * torch.rand(3, 7)
    logp = (prox + 0.4 * torch.randn(3, 7)).requires_grad_(True)
    adv = torch.randn(3, 1).expand(3, 7)
    mask = (torch.rand(3, 7) > 0.3).float()
    loss, stats = policy_loss(logp, prox, prox.clone(), adv, mask, LossConfig(kind=kind))
    ref = _plain_ppo(logp, prox, adv, mask)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert stats["masked_frac"].item() == 0.0 and stats["trunc_frac"].item() == 0.0
    assert stats["w_mean"].item() == 1.0 and stats["w_max"].item() == 1.0
    assert stats["n_tokens"].item() == mask.sum().item()
    (grad,) = torch.autograd.grad(loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(grad, ref_grad, atol=1e-7)


def test_per_row_advantages_broadcast():
    torch.manual_seed(2)
    prox = -torch.rand(2, 4)
    logp = prox + 0.3 * torch.randn(2, 4)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 4, dtype=torch.bool)
    a, _ = policy_loss(logp, prox, prox, adv, mask)
    b, _ = policy_loss(logp, prox, prox, adv[:, None].expand(2, 4), mask)
    assert a.item() == pytest.approx(b.item())


def test_seq_mean_token_mean_aggregation():
    # Row 0: one token at -1.28 (A=+1, u=1.5). Row 1: tokens -0.5 and +1.5. Row 2: nothing valid.
    prox = torch.full((3, 2), -1.0)
    logp = prox + torch.tensor([[LN(1.5), 0.0], [LN(0.5), LN(1.5)], [0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [1.0, -1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 0], [1, 1], [0, 0]])
    seq, _ = policy_loss(logp, prox, prox, adv, mask, LossConfig(agg="seq_mean_token_mean"))
    assert seq.item() == pytest.approx((-1.28 + (-0.5 + 1.5) / 2) / 2)
    tok, _ = policy_loss(logp, prox, prox, adv, mask, LossConfig(agg="token_mean"))
    assert tok.item() == pytest.approx((-1.28 - 0.5 + 1.5) / 3)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_losses_over_the_mini_batch_denominator_add_up_to_its_loss(agg):
    # Rows of different lengths, some tokens capped (w > 5), one row capped everywhere: split in two
    # micro-batches, each divided by the whole batch's denominator, the losses and gradients add up.
    torch.manual_seed(3)
    prox = -3 * torch.rand(5, 6)
    behav = prox - torch.where(torch.rand(5, 6) < 0.3, 3.0, 0.2 * torch.randn(5, 6))
    behav[4] = prox[4] - 3.0
    adv = torch.randn(5)
    mask = torch.ones(5, 6)
    mask[0, 3:], mask[2, 1:], mask[3, :] = 0, 0, 0  # lengths 3, 6, 1, 0 (no loss token), 6
    logp = (prox + 0.1 * torch.randn(5, 6)).requires_grad_(True)
    cfg = LossConfig(agg=agg)
    full, _ = policy_loss(logp, prox, behav, adv, mask, cfg)
    (g_full,) = torch.autograd.grad(full, logp)
    denominator = loss_denominator(mask.sum(dim=-1), agg)
    assert denominator == (16 if agg == "token_mean" else 4)  # capped tokens and rows count
    parts = [
        policy_loss(logp[rows], prox[rows], behav[rows], adv[rows], mask[rows], cfg, None, denominator)[0]
        for rows in (slice(0, 2), slice(2, 5))
    ]
    (g_parts,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(g_parts, g_full, atol=1e-7)


def test_config_validation_and_masked_mean():
    with pytest.raises(ValueError):
        LossConfig(kind="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(agg="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(clip_eps=1.0)
    values = torch.tensor([1.0, float("nan"), 3.0])
    assert masked_mean(values, torch.tensor([1, 0, 1])).item() == 2.0
    assert masked_mean(values, torch.zeros(3)).item() == 0.0


# ---- per-token log-probabilities


@pytest.fixture(scope="module")
def tiny_model():
    with torch.random.fork_rng(devices=[]):
        return small_qwen3(
            vocab_size=64, max_position_embeddings=64, bos_token_id=None, eos_token_id=1, pad_token_id=0
        )


def _segments():
    a = Segment(segment_id=0)
    a.extend_prompt([5, 9, 12])
    a.extend_sampled([20, 33, 7], [-1.0, -2.0, -0.5], [3, 3, 4])
    a.extend_prompt([40])
    a.extend_sampled([41, 1], [-0.1, -0.2], [4, 4])
    b = Segment(segment_id=1)
    b.extend_prompt([5, 8])
    b.extend_sampled([60, 1], [-3.0, -0.25], [2, 2])
    return [a, b]


def test_pad_segments_right_pads_and_aligns():
    ids, attn, loss_mask, behav, versions = pad_segments(_segments(), pad_id=0)
    assert ids.tolist() == [[5, 9, 12, 20, 33, 7, 40, 41, 1], [5, 8, 60, 1, 0, 0, 0, 0, 0]]
    assert attn.tolist() == [[1] * 9, [1] * 4 + [0] * 5]
    assert loss_mask.dtype == torch.bool
    assert loss_mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert behav[0].tolist() == pytest.approx([0, 0, 0, -1.0, -2.0, -0.5, 0, -0.1, -0.2])
    assert behav[1, :4].tolist() == [0.0, 0.0, -3.0, -0.25] and behav[1, 4:].abs().sum() == 0
    assert versions.tolist() == [[-1, -1, -1, 3, 3, 4, -1, 4, 4], [-1, -1, 2, 2, -1, -1, -1, -1, -1]]
    # A row that starts with a sampled token cannot train on it: there is no context to score it.
    odd = Segment(segment_id=2)
    odd.extend_sampled([3, 4], [-1.0, -1.0], [0, 0])
    assert pad_segments([odd], 0)[2].tolist() == [[False, True]]
    with pytest.raises(ValueError):
        pad_segments([Segment(segment_id=3, token_ids=[1, 2], loss_mask=[0])], 0)


def _naive(model, ids, attn, temperature):
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logsm = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    keep = attn[:, 1:].bool()
    pad = torch.zeros(ids.shape[0], 1)
    return torch.cat([pad, lp * keep], 1), torch.cat([pad, ent * keep], 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_naive_log_softmax(tiny_model, temperature):
    ids, attn, _, _, _ = pad_segments(_segments(), pad_id=0)
    with torch.no_grad():
        ref_lp, ref_ent = _naive(tiny_model, ids, attn, temperature)
        for chunk in (3, 1024):  # several chunks, and one
            lp, ent = token_logprobs(tiny_model, ids, attn, temperature=temperature, chunk_size=chunk)
            assert lp.shape == ids.shape and lp.dtype == torch.float32
            assert torch.allclose(lp, ref_lp, atol=1e-5)
            assert torch.allclose(ent, ref_ent, atol=1e-5)
    assert lp[:, 0].abs().sum() == 0 and lp[1, 4:].abs().sum() == 0 and ent[1, 4:].abs().sum() == 0


def test_token_logprobs_gradients_match_naive(tiny_model):
    # The chunked pass recomputes each chunk in backward: parameter gradients must be unchanged.
    ids, attn, loss_mask, _, _ = pad_segments(_segments(), pad_id=0)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view(ids.shape) * loss_mask

    def grads(fn):
        tiny_model.zero_grad(set_to_none=True)
        (fn() * weights).sum().backward()
        return [p.grad.clone() for p in tiny_model.parameters()]

    ours = grads(lambda: token_logprobs(tiny_model, ids, attn, temperature=0.8, chunk_size=2)[0])
    ref = grads(lambda: _naive(tiny_model, ids, attn, 0.8)[0])
    for g, r in zip(ours, ref, strict=True):
        assert torch.allclose(g, r, atol=1e-6)

    lp, ent = token_logprobs(tiny_model, ids, attn, entropy="detached", chunk_size=2)
    assert lp.requires_grad and not ent.requires_grad
    lp, ent = token_logprobs(tiny_model, ids, attn, entropy="grad", chunk_size=2)
    assert ent.requires_grad
    ent_ours = grads(lambda: token_logprobs(tiny_model, ids, attn, entropy="grad", chunk_size=2)[1])
    ent_ref = grads(lambda: _naive(tiny_model, ids, attn, 1.0)[1])
    for g, r in zip(ent_ours, ent_ref, strict=True):
        assert torch.allclose(g, r, atol=1e-6)
    assert token_logprobs(tiny_model, ids, attn, entropy="none")[1] is None
    tiny_model.zero_grad(set_to_none=True)


def test_logprobs_from_logits_bf16_input():
    # bf16 logits are upcast per chunk: the result is float32 and matches the float32 computation.
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 11).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    lp, ent = logprobs_from_logits(logits, targets, chunk_size=2)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=1e-6)
    assert ent is not None and ent.shape == (2, 5)


def test_segments_to_loss_end_to_end(tiny_model):
    # Sync mode: prox from a no-grad pass is the behaviour; the loss then trains through logp only.
    segments = _segments()
    ids, attn, loss_mask, _, _ = pad_segments(segments, pad_id=0)
    with torch.no_grad():
        prox, _ = token_logprobs(tiny_model, ids, attn, entropy="none")
    logp, ent = token_logprobs(tiny_model, ids, attn)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logp, prox, prox, adv, loss_mask)
    assert stats["n_tokens"].item() == loss_mask.sum().item() == 7
    assert stats["clip_frac"].item() == 0.0 and stats["kl_behav"].item() == pytest.approx(0.0, abs=1e-6)
    # u == 1 everywhere: the loss is -mean(A) over tokens = -(5 * 1 - 2 * 1) / 7.
    assert loss.item() == pytest.approx(-3 / 7, abs=1e-6)
    tiny_model.zero_grad(set_to_none=True)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_model.parameters())
    assert masked_mean(ent, loss_mask).item() > 0
    tiny_model.zero_grad(set_to_none=True)


def test_engine_gap_stats_by_hand():
    # prox 0.5 and the engine 0.25 on two tokens, the third off the mask (garbage must not leak)
    prox = torch.tensor([[LN(0.5), LN(0.5), 0.0]])
    engine = torch.tensor([[LN(0.25), LN(0.25), -1e9]])
    mask = torch.tensor([[1, 1, 0]])
    g = engine_gap_stats(prox, engine, mask)
    d = LN(0.25) - LN(0.5)  # k3 with r = pi_prox / pi_engine = exp(-d) = 2: r - 1 - log r
    assert g["engine_kl_sum"].item() == pytest.approx(2 * (2 - 1 - LN(2.0)), rel=1e-5)
    assert g["engine_kl_sum"].item() == pytest.approx(2 * (math.exp(-d) - 1 + d), rel=1e-5)
    assert g["engine_gap_max"].item() == pytest.approx(LN(2.0), rel=1e-5)
    assert (g["w_sum"].item(), g["w_sq_sum"].item(), g["n"].item()) == pytest.approx((4.0, 8.0, 2.0))
    # weights 1 and 3: ESS = (1 + 3)^2 / (2 * (1 + 9)) = 0.8
    g = engine_gap_stats(torch.tensor([[0.0, LN(3.0)]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[1, 1]]))
    ess = g["w_sum"].item() ** 2 / (g["n"].item() * g["w_sq_sum"].item())
    assert ess == pytest.approx(0.8, rel=1e-5)


def test_engine_kl_estimates_kl_engine_to_prox_on_tokens_the_engine_sampled():
    # The engine samples from p, the trainer's prox is q: the mean of the per-token terms over many
    # engine samples must approach the exact KL(p || q) (the old exp(d) - 1 - d gave 0.97 here).
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = float((p * (p / q).log()).sum())  # 0.635
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    engine, prox = p.log()[tokens][None], q.log()[tokens][None]
    g = engine_gap_stats(prox, engine, torch.ones_like(prox))
    assert g["engine_kl_sum"].item() / g["n"].item() == pytest.approx(exact, rel=0.02)
