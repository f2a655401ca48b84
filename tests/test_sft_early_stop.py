"""Early stopping of the warm start on a dev set (reflow.train.sft: SFTConfig.patience): a real tiny
model and real SFT steps; the dev scores come from a scripted callback, so the stopping rule is checked
as arithmetic."""

import copy

import pytest
import torch

from reflow.models import load_model
from reflow.records import Segment
from reflow.train.sft import SFTConfig, sft_train


@pytest.fixture(scope="module")
def built():
    return load_model("tiny", num_hidden_layers=1, hidden_size=64, intermediate_size=128)


def _setup(built):
    model, tok = copy.deepcopy(built[0]), built[1]
    rows = []
    for i in range(8):
        row = Segment(0)
        row.extend_prompt([5, 6, 7 + i])
        row.extend_sampled([9 + i, 10], [0.0, 0.0], [0, 0])
        rows.append(row)
    return model, tok, rows


def _scripted(model, scores):
    """An `evaluate` callback that returns the next scripted score and keeps the weights it saw."""
    seen = {}

    def evaluate(step):
        seen[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return {"success_rate": scores[len(seen) - 1]}

    return evaluate, seen


@pytest.mark.parametrize(
    ("scores", "steps", "best"),
    [
        ([0.2, 0.5, 0.4, 0.45, 0.9], 8, 4),  # two evaluations without a better one after step 4: stop at 8
        ([0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 10, 10),  # always better: the step budget ends it, final kept
        ([0.6, 0.5, 0.7, 0.65, 0.6], 10, 6),  # the final weights (step 10) are evaluated too
    ],
)
def test_sft_stops_after_patience_evaluations_without_a_better_one_and_keeps_the_best(
    built, scores, steps, best
):
    model, tok, rows = _setup(built)
    evaluate, seen = _scripted(model, scores)
    cfg = SFTConfig(lr=1e-2, max_steps=10, max_seconds=600, batch_tokens=64, log_every=0, patience=2)
    report = sft_train(
        model, rows, tok.pad_token_id, cfg, evaluate=evaluate, eval_every=2, log=lambda m: None
    )
    assert report.steps == steps and report.best_step == best
    assert report.stopped_early == (steps < 10)
    assert [e["step"] for e in report.evals] == sorted(seen)
    final = model.state_dict()
    assert all(torch.equal(final[k], v) for k, v in seen[best].items())
    if best != max(seen):
        assert not all(torch.equal(final[k], v) for k, v in seen[max(seen)].items())


def test_without_patience_the_evaluations_only_record(built):
    model, tok, rows = _setup(built)
    evaluate, seen = _scripted(model, [0.9, 0.1, 0.1, 0.1, 0.1])
    cfg = SFTConfig(lr=1e-2, max_steps=10, max_seconds=600, batch_tokens=64, log_every=0)
    report = sft_train(
        model, rows, tok.pad_token_id, cfg, evaluate=evaluate, eval_every=2, log=lambda m: None
    )
    assert report.steps == 10 and report.best_step is None and not report.stopped_early
    assert sorted(seen) == [2, 4, 6, 8, 10]


def test_a_time_cap_lets_the_first_step_through_whatever_the_set_up_took(built):
    # The cap is checked after each step: a cap already spent when the loop starts (a loaded machine's
    # set-up, here a cap of 0 s) still trains exactly one step, so the count does not depend on load.
    model, tok, rows = _setup(built)
    cfg = SFTConfig(lr=1e-2, max_steps=10, max_seconds=0.0, batch_tokens=64, log_every=0)
    report = sft_train(model, rows, tok.pad_token_id, cfg, log=lambda m: None)
    assert report.steps == 1


def test_the_weights_a_step_budget_gives_do_not_depend_on_how_long_the_steps_took(built, monkeypatch):
    # The learning rate follows the step budget alone: a slow (loaded) machine must end with the same
    # weights as a fast one. Here one run's clock moves 50 s a reading, as if every step were slow; the
    # time cap (1e6 s) never ends either run.
    import reflow.train.sft as sft

    def train(clock_step: float) -> dict[str, torch.Tensor]:
        model, tok, rows = _setup(built)
        now = [0.0]

        def monotonic() -> float:
            now[0] += clock_step
            return now[0]

        monkeypatch.setattr(sft.time, "monotonic", monotonic)
        cfg = SFTConfig(lr=1e-2, max_steps=30, max_seconds=1e6, warmup_steps=2, batch_tokens=64, log_every=0)
        report = sft_train(model, rows, tok.pad_token_id, cfg, log=lambda m: None)
        assert report.steps == 30
        return {k: v.clone() for k, v in model.state_dict().items()}

    fast, slow = train(1e-3), train(50.0)
    assert all(torch.equal(fast[k], slow[k]) for k in fast)
