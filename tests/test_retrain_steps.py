"""benchmarks/retrain_steps.py: retraining a run's recorded steps from its checkpoint reproduces the run's
weights (same groups, optimizer and RNG state), and a changed setting changes them."""

import sys
from pathlib import Path

import pytest
import torch
from run_helpers import PARITY_ENV, SMALL_ROLLOUT, TINY_MODEL

from reflow.config import load_config
from reflow.models import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from retrain_steps import retrain, retrained  # noqa: E402


@pytest.mark.slow
def test_retraining_the_recorded_steps_reproduces_the_runs_weights(tmp_path, ray_env):
    from reflow.recipes.agent_train import train

    overrides = [*PARITY_ENV, *TINY_MODEL, *SMALL_ROLLOUT, "train.lr=1e-2", "eval.every=0"]
    overrides += [f"out_dir={tmp_path}", "run_name=r", "mode=reflow", "train.steps=4"]
    overrides += ["train.checkpoint_every=1", "train.keep_checkpoints=5", "resources.threads_per_slot=1"]
    assert train(load_config(None, overrides))["steps"] == 4
    run_dir = tmp_path / "r"

    def weights(model) -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.state_dict().values()]

    run = {s: weights(load_model(str(run_dir / "checkpoints" / f"step-{s:06d}"))[0]) for s in (1, 4)}
    redone = {step: weights(model) for step, model, _ in retrained(run_dir, 1, 4, [])}
    assert all(torch.equal(a, b) for a, b in zip(redone[1], run[1], strict=True))  # the start itself
    assert not all(torch.equal(a, b) for a, b in zip(redone[4], run[1], strict=True))  # steps trained
    for a, b in zip(redone[4], run[4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # three steps redone: the run's weights
    other = {s: weights(m) for s, m, _ in retrained(run_dir, 1, 4, ["train.loss.agg=seq_mean_token_mean"])}
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(other[4], run[4], strict=True))

    records = retrain(run_dir, 3, 4, [["train.lr=1e-3"]], prompts=2, samples=2)
    assert [(r["variant"], r["step"]) for r in records] == [
        ("as run", 3), ("as run", 4), ("train.lr=1e-3", 3), ("train.lr=1e-3", 4)
    ]  # fmt: skip
    assert "run_malformed" in records[1] and all(0 <= r["malformed"] <= 1 for r in records)


def test_a_variant_of_a_setting_the_records_fixed_is_refused_in_one_line(capsys):
    from retrain_steps import main

    for variant in (
        "env.malformed_call_penalty=0.1",
        "train.advantage_scale=none",
        "train.lr=1,replay.eta=2",
    ):
        with pytest.raises(SystemExit) as stop:
            main(["some/run", "--from-step", "1", "--to-step", "2", "--variant", variant])
        assert stop.value.code == 2
        assert "fixed when it stored them" in capsys.readouterr().err
