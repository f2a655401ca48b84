"""The RL trainer: sync-mode IS weights, masking of infra errors, micro-batching, checkpoints."""

import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import small_qwen3

from reflow.records import EpisodeRecord, Segment
from reflow.replay import StoredGroup
from reflow.train.batch import rows_from_groups, shard_groups, trained_before
from reflow.train.losses import LossConfig
from reflow.train.settings import LoraSettings
from reflow.train.trainer import PolicyTrainer, TrainerConfig, TrainRow
from reflow.train.trainer_state import (
    STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _model(seed: int = 0):
    return small_qwen3(vocab_size=64, seed=seed, tie_word_embeddings=True)


def _segment(rng: random.Random, prompt: int, sampled: int, logprob: float = -1.0) -> Segment:
    seg = Segment(0)
    seg.extend_prompt([rng.randrange(1, 64) for _ in range(prompt)])
    seg.extend_sampled([rng.randrange(1, 64) for _ in range(sampled)], [logprob] * sampled, [0] * sampled)
    return seg


def _rows(n: int = 6, seed: int = 0) -> list[TrainRow]:
    rng = random.Random(seed)
    return [
        TrainRow(_segment(rng, rng.randint(3, 9), rng.randint(2, 7)), adv) for adv in [1.0, -1.0] * (n // 2)
    ]


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _capped_rows(n: int = 8, seed: int = 4, moderate: bool = False) -> list[TrainRow]:
    """Rows of varied lengths whose recorded log-probs put some tokens over the decoupled-PPO cap
    (-30: w = pi_prox / pi_behav ~ e^26) and the others near w = 1 (-4.2 ~ log 1/64, the tiny model's);
    the last row is capped everywhere; every third row is a replay. `moderate`: some tokens also get
    weights under the cap but far from 1 (-3 and -5.5: |log w| ~ 1.2 and 1.3), for the M2 threshold."""
    rng = random.Random(seed)
    choices = [-30.0, -4.2, -4.2, -3.0, -5.5] if moderate else [-30.0, -4.2, -4.2]
    rows = []
    for i in range(n):
        seg = Segment(0)
        seg.extend_prompt([rng.randrange(1, 64) for _ in range(rng.randint(2, 8))])
        k = rng.randint(1, 9)
        logprobs = [-30.0 if i == n - 1 else rng.choice(choices) for _ in range(k)]
        seg.extend_sampled([rng.randrange(1, 64) for _ in range(k)], logprobs, [0] * k)
        adv = rng.choice([1.0, -1.0]) * rng.uniform(0.5, 1.5)
        rows.append(TrainRow(seg, adv, replayed=i % 3 == 0))  # no replay clip: only the counts differ
    return rows


M2_TAU = 0.45
"""The M2 trust region of `rows="m2"`: over `_capped_rows(moderate=True)` it keeps every token near
w = 1 and some of the moderate ones, and each of two ranks' shares (`shard_groups`) alone would keep
another set (a rank that skipped the gathering would drop other tokens)."""


def _config(micro_batch_tokens: int = 16384, agg: str = "token_mean", rows: str = "plain") -> TrainerConfig:
    """The tests' trainer settings; `rows="lora"` (or "lora-bf16") trains `_rows` with LoRA adapters; `rows="capped"` trains `_capped_rows` off-policy (the engine's
    log-probs as behaviour) with no gradient clipping, so raw gradients compare; `rows="m2"` the same
    on `_capped_rows(moderate=True)` with the M2 trust region at `M2_TAU`."""
    capped = rows in ("capped", "m2")
    return TrainerConfig(
        lora=LoraSettings(r=4, alpha=8.0) if rows.startswith("lora") else None,
        lr=1e-2,
        bf16=False,
        micro_batch_tokens=micro_batch_tokens,
        loss=LossConfig(agg=agg, m2_tau=M2_TAU if rows == "m2" else 0.0),
        behaviour_is_prox=not capped,
        grad_clip=1e9 if capped else 1.0,
    )


def _capture_grads(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Filled with the (reduced, unsharded) gradients each time the trainer takes an optimizer step."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update(
            {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in trainer.model.named_parameters()
                if p.requires_grad  # a frozen (LoRA base) weight has none
            }
        )
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return grads


def _two_ranks(tmp_path, *args: object) -> dict:
    """Runs tests/fsdp_worker.py on two gloo ranks; what rank 0 saved (state, metrics, grads)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "fsdp.pt"
    tests = Path(__file__).parent
    argv = [str(port), str(out), *map(str, args)]
    procs = [
        subprocess.Popen([sys.executable, str(tests / "fsdp_worker.py"), str(rank), "2", *argv], cwd=tests)
        for rank in range(2)
    ]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    return torch.load(out, weights_only=False)


def test_sync_mode_weight_is_one_and_nothing_is_masked():
    trainer = PolicyTrainer(
        _model(), pad_id=0, config=TrainerConfig(lr=1e-2, behaviour_is_prox=True, bf16=False)
    )
    before = _weights(trainer.model)
    metrics = trainer.train_step(_rows())
    assert metrics["w_mean"] == pytest.approx(1.0)
    assert metrics["w_max"] == pytest.approx(1.0)
    assert metrics["masked_frac"] == 0.0
    assert metrics["clip_frac"] == 0.0  # theta == prox on the first (only) update
    assert metrics["trained_tokens"] == sum(r.segment.n_sampled - (r.segment.loss_mask[0]) for r in _rows())
    assert trainer.version == 1
    after = _weights(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_replayed_rows_past_the_behaviour_clip_leave_the_weights_unchanged():
    # Negative advantages and a recorded log-prob of -1.0, far above the tiny model's (~ -4): the
    # behaviour ratio pi_theta / pi_behav is far under 1 - clip_eps, so a replayed row gives no gradient.
    def rows(replayed):
        return [replace(r, advantage=-1.0, replayed=replayed) for r in _rows()]

    loss = LossConfig(replay_clip=True)
    for replayed in (True, False):
        trainer = PolicyTrainer(
            _model(), 0, TrainerConfig(lr=1e-2, behaviour_is_prox=False, bf16=False, loss=loss)
        )
        before = _weights(trainer.model)
        metrics = trainer.train_step(rows(replayed))
        after = _weights(trainer.model)
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        assert metrics["replay_clip_frac"] == (1.0 if replayed else 0.0)
        assert moved != replayed


def test_the_engine_trainer_gap_is_reported_in_sync_mode_and_corrected_on_request():
    from reflow.train.logprobs import pad_segments, token_logprobs

    rows = _rows()  # the "engine" recorded log-prob -1.0 for every sampled token
    sync = PolicyTrainer(_model(), 0, TrainerConfig(behaviour_is_prox=True, bf16=False))
    m = sync.train_step(rows)
    assert m["w_mean"] == pytest.approx(1.0)  # behaviour = prox: the gap is not corrected ...
    assert m["engine_kl"] > 0.1 and m["engine_gap_max"] > 0.5 and m["is_ess"] < 0.999  # ... shown
    corrected = PolicyTrainer(_model(), 0, TrainerConfig(behaviour_is_prox=False, bf16=False))
    assert corrected.train_step(_rows())["w_mean"] != pytest.approx(1.0, abs=1e-3)

    # An engine that agrees with the trainer: no gap, every weight 1, ESS 1.
    model = _model()
    agreeing = _rows()
    for row in agreeing:
        seg = row.segment
        ids, attn, mask, _, _ = pad_segments([seg], 0)
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, attn, entropy="none")
        seg.logprobs = [
            float(lp) if m else x for lp, m, x in zip(logp[0], mask[0], seg.logprobs, strict=True)
        ]
    m = PolicyTrainer(model, 0, TrainerConfig(behaviour_is_prox=True, bf16=False)).train_step(agreeing)
    assert m["engine_kl"] == pytest.approx(0.0, abs=1e-6) and m["is_ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["engine_gap_max"] < 1e-4


def test_minibatches_and_epochs_take_one_optimizer_step_each_against_the_pre_update_prox():
    rows = _rows(8)
    one = PolicyTrainer(_model(), pad_id=0, config=TrainerConfig(lr=5e-2, bf16=False))
    single = one.train_step(rows)
    assert single["updates"] == 1 and single["clip_frac"] == 0.0
    many = PolicyTrainer(
        _model(), pad_id=0, config=TrainerConfig(lr=5e-2, bf16=False, minibatches=2, epochs=3)
    )
    metrics = many.train_step(rows)
    assert metrics["updates"] == 6
    assert many.optimizer.state_dict()["state"][0]["step"] == 6
    assert many.version == 1  # one batch, one policy version, however many updates
    # sync mode: behaviour is the pre-update prox, so w stays exactly 1 over all six updates ...
    assert metrics["w_mean"] == pytest.approx(1.0) and metrics["masked_frac"] == 0.0
    # ... while the later updates move theta away from prox and the PPO clip starts to bite
    assert metrics["clip_frac"] > 0.0
    assert metrics["trained_tokens"] == single["trained_tokens"]
    # more rows than mini-batches asked for: as many mini-batches as rows
    few = PolicyTrainer(_model(), pad_id=0, config=TrainerConfig(lr=1e-3, bf16=False, minibatches=5))
    assert few.train_step(rows[:2])["updates"] == 2


def test_prox_of_later_minibatches_is_the_weights_before_the_first_update(monkeypatch):
    import reflow.train.trainer as trainer_mod

    rows = _rows(6)
    model = _model()
    with torch.no_grad():
        reference = PolicyTrainer(_model(), pad_id=0, config=TrainerConfig(bf16=False))
        reference.model.load_state_dict(model.state_dict())
        expected = {id(r): reference._forward([r])["logp"][0] for r in rows}
    seen = []
    real_loss = trainer_mod.policy_loss

    def spy(logp, prox, behav, adv, mask, cfg, *rest):
        seen.append((prox.clone(), mask.clone()))
        return real_loss(logp, prox, behav, adv, mask, cfg, *rest)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    trainer = PolicyTrainer(
        model, pad_id=0, config=TrainerConfig(lr=5e-2, bf16=False, minibatches=3, micro_batch_tokens=1)
    )
    trainer.train_step(rows)
    assert len(seen) == 6  # one row per micro-batch (a 1-token budget), 3 updates
    for prox, mask in seen:
        # every prox row is one of the pre-update log-prob rows, on the masked (sampled) positions
        matches = [
            torch.allclose(prox[0][mask[0].bool()], e[-prox.shape[1] :][mask[0].bool()], atol=1e-5)
            for e in expected.values()
            if e.shape[0] >= prox.shape[1]
        ]
        assert any(matches)


def test_loglinear_prox_interpolates_by_staleness_without_an_extra_forward(monkeypatch):
    import reflow.train.trainer as trainer_mod
    from reflow.train.trainer import loglinear_prox

    behav, theta = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-3.0, -3.0, -3.0]])
    got = loglinear_prox(behav, theta, torch.tensor([[5, 4, 2]]), prox_version=5)
    assert torch.allclose(got, torch.tensor([[-1.0, -2.0, -2.5]]))  # alpha 0, 1/2, 3/4

    rows = _rows(6)
    for r in rows:  # sampled two versions before the trainer's current weights
        r.segment.versions = [0] * len(r.segment.versions)
    seen = []
    real_loss = trainer_mod.policy_loss

    def spy(logp, prox, behav, adv, mask, cfg, *rest):
        seen.append((logp.detach().clone(), prox.clone(), behav.clone(), mask.bool()))
        return real_loss(logp, prox, behav, adv, mask, cfg, *rest)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    trainer = PolicyTrainer(
        _model(),
        pad_id=0,
        config=TrainerConfig(
            lr=5e-2, bf16=False, behaviour_is_prox=False, minibatches=3, prox_logp="loglinear"
        ),
    )
    trainer.version = 2
    monkeypatch.setattr(trainer, "_prox_logprobs", lambda plan: pytest.fail("no prox forward with loglinear"))
    metrics = trainer.train_step(rows)
    assert metrics["updates"] == 3
    first, later = seen[0], seen[1:]
    assert torch.equal(first[1], first[0])  # first update: theta is prox, exactly
    for logp, prox, behav, mask in later:  # later ones: alpha = 2 / 3 on every sampled token
        assert torch.allclose(prox[mask], (behav + 2 / 3 * (logp - behav))[mask], atol=1e-6)
    with pytest.raises(ValueError, match="prox_logp"):  # checked when the config is made
        TrainerConfig(minibatches=2, prox_logp="nope")


def test_behaviour_logprobs_far_from_the_policy_are_masked_off_sync():
    # the engine's recorded log-probs (-1 per token) differ from the model's (~ -log 64): w = pi_prox /
    # pi_behav is far from 1 and, above the cap, masked
    trainer = PolicyTrainer(
        _model(), pad_id=0, config=TrainerConfig(lr=1e-2, behaviour_is_prox=False, bf16=False)
    )
    metrics = trainer.train_step(_rows())
    assert metrics["w_mean"] < 0.1  # pi_prox ~ 1/64 vs pi_behav = e^-1
    high = [TrainRow(_segment(random.Random(1), 4, 5, logprob=-30.0), 1.0)]
    metrics = trainer.train_step(high)
    assert metrics["masked_frac"] == pytest.approx(1.0)  # w = e^(~-4.2 + 30) > cap 5 everywhere


def test_micro_batches_give_the_same_update_as_one_batch():
    rows = _rows(8)
    results = []
    for micro in (10_000, 24):  # one micro-batch vs many
        trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, micro_batch_tokens=micro, bf16=False))
        grads = {}
        step = trainer.optimizer.step

        def capture(*args, _model=trainer.model, _step=step, _grads=grads, **kwargs):
            _grads.update({n: p.grad.clone() for n, p in _model.named_parameters()})
            return _step(*args, **kwargs)

        trainer.optimizer.step = capture
        metrics = trainer.train_step(rows)
        assert (len(trainer._micro_batches(rows)) > 1) == (micro == 24)
        results.append((grads, metrics["loss"]))
    (g1, loss1), (g2, loss2) = results
    assert loss1 == pytest.approx(loss2, abs=1e-5)
    for k in g1:
        assert torch.allclose(g1[k], g2[k], atol=1e-6), k


def test_shared_prompt_prefix_runs_once_with_the_same_loss_and_gradients(monkeypatch):
    rng = random.Random(5)
    prompt = [rng.randrange(1, 64) for _ in range(30)]
    rows = []
    for adv in [1.0, -1.0, 0.5, -0.5]:
        seg = Segment(0)
        seg.extend_prompt(prompt + [rng.randrange(1, 64) for _ in range(rng.randint(1, 4))])
        seg.extend_sampled([rng.randrange(1, 64) for _ in range(5)], [-2.0] * 5, [0] * 5)
        rows.append(TrainRow(seg, adv))
    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr("reflow.train.trainer.shared_prefix_len", lambda segments: 0)
        trainer = PolicyTrainer(_model(), 0, TrainerConfig(behaviour_is_prox=False, bf16=False))
        grads = {}
        step = trainer.optimizer.step

        def capture(*args, _trainer=trainer, _step=step, _grads=grads, **kwargs):
            _grads.update({n: p.grad.clone() for n, p in _trainer.model.named_parameters()})
            return _step(*args, **kwargs)

        trainer.optimizer.step = capture
        results.append((trainer.train_step(rows), grads))
    (m1, g1), (m2, g2) = results
    for key in ("loss", "w_mean", "kl_behav", "entropy", "trained_tokens"):
        assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6), name


def test_zero_advantage_rows_do_not_move_the_policy():
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False, weight_decay=0.0))
    rows = [TrainRow(r.segment, 0.0) for r in _rows()]
    before = _weights(trainer.model)
    trainer.train_step(rows)
    for k, v in _weights(trainer.model).items():
        assert torch.allclose(before[k], v, atol=1e-7), k


def test_a_step_with_no_sampled_token_changes_nothing():
    # AdamW with weight decay moves the weights even on zero gradients: an empty step must not step.
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False, weight_decay=0.1))
    full = trainer.train_step(_rows())  # momentum to carry, version 1
    no_tokens = [TrainRow(_segment(random.Random(1), 5, 0), 1.0)]
    before, optim_steps = _weights(trainer.model), len(trainer.optimizer.state)
    for rows in ([], no_tokens):
        metrics = trainer.train_step(rows)
        assert metrics["updates"] == 0.0 and metrics["trained_tokens"] == 0.0
        # every key a real step reports (the loops read them), with neutral values
        assert set(metrics) == set(full)
        assert (metrics["masked_frac"], metrics["kl_behav"], metrics["is_ess"]) == (0.0, 0.0, 1.0)
        assert metrics["new_trained_tokens"] == 0.0 and metrics["w_mean"] == 1.0
    assert (trainer.version, trainer.step, len(trainer.optimizer.state)) == (1, 1, optim_steps)
    for k, v in _weights(trainer.model).items():
        assert torch.equal(before[k], v), k


def test_new_trained_tokens_count_the_rows_of_groups_trained_for_the_first_time():
    rows = _capped_rows()
    metrics = PolicyTrainer(_model(), 0, _config(rows="capped")).train_step(rows)
    assert metrics["trained_tokens"] == sum(r.segment.n_sampled for r in rows)
    assert metrics["new_trained_tokens"] == sum(r.segment.n_sampled for r in rows if not r.replayed)
    assert 0 < metrics["new_trained_tokens"] < metrics["trained_tokens"]


def _episode(status: str, reward: float, gid: str = "g") -> EpisodeRecord:
    seg = _segment(random.Random(len(status)), 3, 4)
    return EpisodeRecord(
        episode_id=f"{gid}-{status}-{reward}",
        group_id=gid,
        env_id="e",
        task_id=1,
        task_hash="h",
        seed=0,
        status=status,
        reward=reward,
        segments=[seg],
    )


def test_infra_error_episodes_are_masked_out_of_training():
    episodes = [
        _episode("ok", 1.0),
        _episode("infra_error", 0.0),
        _episode("ok", 0.0),
        _episode("truncated", 0.0),
    ]
    group = StoredGroup(
        group_id="g",
        seq=0,
        policy_version=0,
        episodes=episodes,
        advantages=[1.0, 0.0, -0.5, -0.5],
        reward_spread=1.0,
        consumed=0,
        last_step=None,
        meta={},
    )
    rows = rows_from_groups([group])
    assert len(rows) == 3
    assert [r.advantage for r in rows] == [1.0, -0.5, -0.5]
    assert all(r.segment is not episodes[1].segments[0] for r in rows)


def test_a_row_is_replayed_when_an_earlier_step_trained_its_group():
    def group(consumed, last_step):
        return StoredGroup(
            "g", 0, 0, 1.0, consumed, last_step, {}, episodes=[_episode("ok", 1.0)], advantages=[1.0]
        )

    # (consumed, last_step, step): sync marks after the update, the decoupled modes when they plan it
    assert not trained_before(group(0, None), 5)  # sync, fresh
    assert trained_before(group(1, 3), 5)  # trained at step 3, not yet marked for 5
    assert not trained_before(group(1, 5), 5)  # decoupled, fresh: marked for this step only
    assert trained_before(group(2, 5), 5)  # decoupled, replayed
    assert [r.replayed for r in rows_from_groups([group(2, 5)], 5)] == [True]
    assert [r.replayed for r in rows_from_groups([group(2, 5)])] == [False]  # no step: fresh


def test_sharding_rows_by_tokens_balances_them_and_keeps_every_row():
    rows = _rows(10)
    shards = [[rows[i] for i in s] for s in shard_groups([len(r.segment.token_ids) for r in rows], 3)]
    assert sorted(id(r) for s in shards for r in s) == sorted(id(r) for r in rows)
    loads = [sum(len(r.segment.token_ids) for r in s) for s in shards]
    assert max(loads) - min(loads) <= max(len(r.segment.token_ids) for r in rows)


def test_shard_groups_by_hand():
    # largest first to the lightest rank, ties by position: 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 3 -> r0
    assert shard_groups([3, 9, 5, 7], 2) == [[0, 1], [2, 3]]
    assert shard_groups([4, 4, 4], 2) == [[0, 2], [1]]
    assert shard_groups([1], 3) == [[0], [], []]  # a rank may get nothing (it trains a dummy row)
    assert shard_groups([], 2) == [[], []]


def test_checkpoint_round_trip_restores_weights_optimizer_step_and_rng(tmp_path):
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False))
    trainer.train_step(_rows())
    path = save_checkpoint(tmp_path, trainer, extra={"next_seed": 42}, keep=2)
    assert path == latest_checkpoint(tmp_path)
    expected_next = trainer.train_step(_rows(seed=3))  # what the run would have done next
    expected_weights = _weights(trainer.model)

    fresh = PolicyTrainer(_model(seed=9), 0, TrainerConfig(lr=1e-2, bf16=False))
    extra = load_checkpoint(path, fresh)
    assert extra == {"next_seed": 42}
    assert (fresh.step, fresh.version) == (1, 1)
    resumed = fresh.train_step(_rows(seed=3))
    assert resumed["loss"] == pytest.approx(expected_next["loss"], abs=1e-6)
    for k, v in _weights(fresh.model).items():
        assert torch.allclose(v, expected_weights[k], atol=1e-6), k


def test_checkpoint_optimizer_state_is_keyed_by_name_and_an_index_keyed_one_still_loads(tmp_path):
    # Keyed by parameter name, the state loads into a trainer group of any size (FSDP2 ranks come
    # and go with elastic role changes); checkpoints written before keyed it by index.
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False))
    trainer.train_step(_rows())
    path = save_checkpoint(tmp_path, trainer)
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    assert set(saved["state"]) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    torch.save(trainer.optimizer.state_dict(), path / "optimizer.pt")  # the old, index-keyed format
    expected = trainer.train_step(_rows(seed=3))
    old = PolicyTrainer(_model(seed=9), 0, TrainerConfig(lr=1e-2, bf16=False))
    load_checkpoint(path, old)
    assert old.train_step(_rows(seed=3))["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert old.optimizer.state_dict()["state"][0]["step"] == 2


def test_checkpoints_are_pruned_and_half_written_ones_ignored(tmp_path):
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(bf16=False))
    for _ in range(3):
        trainer.train_step(_rows())
        save_checkpoint(tmp_path, trainer, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    (tmp_path / ".step-000004.x1.tmp").mkdir()  # a save killed midway
    (tmp_path / "step-000005").mkdir()  # no state.json: not finished
    assert latest_checkpoint(tmp_path).name == "step-000003"
    save_checkpoint(tmp_path, trainer, keep=2)  # the next save clears what killed saves left
    assert not list(tmp_path.glob(".*"))


def test_a_save_killed_while_replacing_a_checkpoint_of_the_same_step_leaves_it_whole(tmp_path, monkeypatch):
    """The run's last save may repeat its last periodic one: the folder of that step is replaced. A
    kill while the old files are deleted must leave the new checkpoint in place, not neither."""
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(bf16=False))
    trainer.train_step(_rows())
    save_checkpoint(tmp_path, trainer, keep=1)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        done = [p for p in Path(path).rglob(STATE_FILE)]
        if done:  # deletes one file of a finished checkpoint, then the process dies
            done[0].unlink()
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, trainer, keep=1, extra={"again": True})
    monkeypatch.undo()
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "step-000001"
    resumed = PolicyTrainer(_model(seed=9), 0, TrainerConfig(bf16=False))
    assert load_checkpoint(found, resumed) == {"again": True}


@pytest.mark.slow
@pytest.mark.parametrize(
    "n_rows, micro_batch_tokens",
    [(8, 16384), (5, 1), (1, 16384)],
    ids=["balanced", "unequal-micro-batches", "a-rank-without-rows"],
)
def test_fsdp2_two_ranks_match_one_rank(tmp_path, n_rows, micro_batch_tokens):
    """Two gloo ranks with the model sharded by fully_shard take the same step as one rank, also when
    their shares pack into different numbers of micro-batches or one rank has no row at all (each
    forward is a collective: unequal counts used to hang the group)."""
    sharded = _two_ranks(tmp_path, n_rows, micro_batch_tokens)
    single = PolicyTrainer(_model(), 0, _config(micro_batch_tokens))
    grads = _capture_grads(single)
    metrics = single.train_step(_rows(n_rows + n_rows % 2)[:n_rows])
    assert sharded["metrics"]["trained_tokens"] == metrics["trained_tokens"]
    assert sharded["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(sharded["grads"][name], grad, atol=1e-6), name
    # Adam's first step is ~lr * sign(grad): gradients that are float noise may flip, no more than that
    for key, value in single.model.state_dict().items():
        assert torch.allclose(sharded["state"][key], value, atol=2.5e-2), key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("agg", "kind"), [("token_mean", "capped"), ("seq_mean_token_mean", "capped"), ("token_mean", "m2")]
)
def test_the_gradient_is_the_rows_own_whatever_the_packing_and_the_rank_count(tmp_path, agg, kind):
    """The loss is a function of the mini-batch alone: one micro-batch on one rank, one micro-batch
    per row, and two FSDP2 ranks give the same gradient, also with tokens the decoupled-PPO cap drops
    (they used to leave a micro-batch's denominator but not its weight in the mini-batch) and with the
    M2 trust region (one threshold over every micro-batch and rank)."""
    rows = _capped_rows(moderate=kind == "m2")
    runs = {}
    for name, micro in (("one micro-batch", 1 << 20), ("a micro-batch per row", 1)):
        trainer = PolicyTrainer(_model(), 0, _config(micro, agg, kind))
        grads = _capture_grads(trainer)
        metrics = trainer.train_step(rows)
        assert len(trainer._micro_batches(rows)) == (1 if micro > 1 else len(rows))
        runs[name] = grads, metrics
    sharded = _two_ranks(tmp_path, len(rows), 1, agg, kind)
    runs["two ranks"] = sharded["grads"], sharded["metrics"]
    ref_grads, ref = runs["one micro-batch"]
    assert 0.05 < ref["masked_frac"] < 0.95  # some tokens capped, not all
    assert (ref["m2_masked_frac"] > ref["masked_frac"]) == (kind == "m2")  # and more by the M2 threshold
    for name, (grads, metrics) in runs.items():
        diff = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
        assert diff <= 1e-6, (name, diff)
        assert metrics["loss"] == pytest.approx(ref["loss"], abs=1e-6), name
        assert metrics["masked_frac"] == pytest.approx(ref["masked_frac"], abs=1e-6), name
        assert metrics["m2_masked_frac"] == pytest.approx(ref["m2_masked_frac"], abs=1e-6), name
        assert (metrics["trained_tokens"], metrics["new_trained_tokens"]) == (
            ref["trained_tokens"],
            ref["new_trained_tokens"],
        ), name


def test_one_step_raises_rewarded_tokens_and_lowers_penalised_ones():
    """The direction of the update: sampled tokens of a positive-advantage row become more likely,
    those of a negative-advantage row less likely."""
    from reflow.train.logprobs import pad_segments, token_logprobs

    rng = random.Random(3)
    good, bad = _segment(rng, 4, 6), _segment(rng, 4, 6)
    trainer = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False))

    def sampled_logp(seg):
        ids, attn, mask, _, _ = pad_segments([seg], 0)
        with torch.no_grad():
            logp, _ = token_logprobs(trainer.model, ids, attn, entropy="none")
        return float(logp[mask].sum())

    before = sampled_logp(good), sampled_logp(bad)
    trainer.train_step([TrainRow(good, 1.0), TrainRow(bad, -1.0)])
    after = sampled_logp(good), sampled_logp(bad)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1
