"""Partial rollouts: an episode in flight across a weight update keeps per-turn (per-token) versions,
and the trainer's loss uses each token's own behaviour log-prob."""

import copy

import pytest
import torch
from fake_envs import EchoEnv

from reflow.engine import SamplingParams
from reflow.rollout.episode import EpisodeRunner, RolloutConfig
from reflow.train.logprobs import token_logprobs
from reflow.train.trainer import PolicyTrainer, TrainerConfig, TrainRow

pytestmark = pytest.mark.slow


class UpdatingEchoEnv(EchoEnv):
    """After the first turn, the trainer 'finishes a step': new weights reach the engine mid-episode."""

    def __init__(self, engine, new_weights) -> None:
        super().__init__()
        self.engine, self.new_weights, self.turns = engine, new_weights, 0

    async def step(self, turn):
        self.turns += 1
        if self.turns == 1:
            await self.engine.update_weights(state_dict=self.new_weights, version=1)
        result = await super().step(turn)
        result.truncated = self.turns >= 3
        return result


async def test_weight_update_mid_episode_is_recorded_per_turn_and_used_by_the_loss():
    from reflow.engine.torch_engine import TorchEngine
    from reflow.models import load_model

    # seeded: with the RNG as earlier tests left it, the random model could sample 12 tokens without
    # its stop string ("e"), a cut-off first turn that ends the episode (seen once in a test run)
    torch.manual_seed(0)
    model, tok = load_model("tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))  # "version 1": the weights after a train step
    new_weights = {k: v.clone() for k, v in trained.state_dict().items()}

    engine = TorchEngine(model, tok, max_batch_size=4)
    runner = EpisodeRunner(
        engine,
        tok,
        RolloutConfig(sampling=SamplingParams(max_new_tokens=12, stop=["e"]), max_context_tokens=2048),
    )
    try:
        rec = await runner.run(UpdatingEchoEnv(engine, new_weights), seed=0)
    finally:
        await engine.close()

    assert rec.n_turns >= 2
    assert rec.turns[0].policy_version == 0 and set(rec.turns[0].token_versions) == {0}
    assert all(t.policy_version == 1 and set(t.token_versions) == {1} for t in rec.turns[1:])
    assert (rec.policy_version_start, rec.policy_version_end) == (0, 1)
    (seg,) = rec.segments
    sampled_versions = {v for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m}
    assert sampled_versions == {0, 1}

    # the recorded behaviour log-probs are those of the weights that sampled each token: under the new
    # weights they match on version-1 tokens and differ on version-0 tokens
    ids = torch.tensor([seg.token_ids])
    with torch.no_grad():
        now, _ = token_logprobs(trained, ids, torch.ones_like(ids), entropy="none")
    recorded = torch.tensor(seg.logprobs)
    versions = torch.tensor(seg.versions)
    v1, v0 = versions == 1, versions == 0
    assert torch.allclose(now[0][v1], recorded[v1], atol=1e-4)
    assert not torch.allclose(now[0][v0], recorded[v0], atol=1e-3)

    # the decoupled loss weighs each token by pi_prox / pi_behav with its own behaviour log-prob: the
    # version-1 tokens have weight 1, the version-0 tokens do not
    sync_model = copy.deepcopy(trained)  # the step below changes `trained`
    trainer = PolicyTrainer(trained, tok.pad_token_id, TrainerConfig(behaviour_is_prox=False, bf16=False))
    metrics = trainer.train_step([TrainRow(seg, 1.0)])
    log_w = (now[0] - recorded)[v0 | v1]
    assert metrics["w_mean"] == pytest.approx(float(torch.exp(log_w).clamp(max=5.0).mean()), rel=1e-3)
    assert metrics["w_mean"] != pytest.approx(1.0, abs=1e-3)

    # sync mode, the trainer at version 1 (a partial rollout carried over its step): the version-1
    # tokens take prox as their behaviour policy (weight exactly 1), the version-0 ones keep the engine's
    sync = PolicyTrainer(sync_model, tok.pad_token_id, TrainerConfig(behaviour_is_prox=True, bf16=False))
    sync.version = 1
    metrics = sync.train_step([TrainRow(seg, 1.0)])
    sampled = (v0 | v1)[torch.tensor(seg.loss_mask, dtype=torch.bool)]
    old = v0[torch.tensor(seg.loss_mask, dtype=torch.bool)]
    w = torch.where(old, torch.exp(now[0] - recorded)[torch.tensor(seg.loss_mask, dtype=torch.bool)], 1.0)
    assert sampled.all() and 0 < int(old.sum()) < len(old)
    assert metrics["w_mean"] == pytest.approx(float(w.clamp(max=5.0).mean()), rel=1e-3)


async def test_default_trainer_precision_matches_the_engine_on_cpu():
    """On-policy rows scored by a trainer with default settings: every IS weight is 1 (no bf16 drift
    between the fp32 engine and the trainer), so nothing but staleness moves w."""
    from reflow.engine.torch_engine import TorchEngine
    from reflow.models import load_model

    model, tok = load_model("tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    engine = TorchEngine(copy.deepcopy(model), tok, max_batch_size=4)
    runner = EpisodeRunner(
        engine, tok, RolloutConfig(sampling=SamplingParams(max_new_tokens=16), max_context_tokens=2048)
    )
    try:
        records = [await runner.run(EchoEnv(), seed=s) for s in range(3)]
    finally:
        await engine.close()
    rows = [TrainRow(seg, 1.0) for rec in records for seg in rec.segments if seg.n_sampled]
    trainer = PolicyTrainer(model, tok.pad_token_id, TrainerConfig(behaviour_is_prox=False))
    assert trainer.bf16 is False  # CPU default
    metrics = trainer.train_step(rows)
    assert metrics["w_max"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["w_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["kl_behav"] < 1e-6
