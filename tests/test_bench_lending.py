"""`reflow bench lending`: the report's arithmetic (per-round ratios to the idle condition, their
geometric mean and the overhead they imply; the rotating order) and one real short run of the
benchmark on a tiny model whose three conditions each time real train steps."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from run_helpers import PARITY_ENV, QUICK_RUN, SMALL_ROLLOUT, TINY_MODEL

from reflow.recipes.bench_lending import CONDITIONS, order, summarize

TESTS = Path(__file__).parent


def test_ratios_are_per_round_to_the_idle_condition_and_the_overhead_follows_from_their_mean():
    rounds = [
        {"alone": [2.0, 2.0], "yields": [2.2, 2.2], "runs_on": [3.0, 3.0]},
        {"alone": [1.0, 1.0], "yields": [1.1, 1.1], "runs_on": [1.5, 1.5]},
    ]
    alone, yields, runs_on = summarize(rounds)
    assert alone.ratio is None and alone.overhead is None and alone.step_s.mean == pytest.approx(1.5)
    # the machine got twice as fast between the rounds; each round's ratio is still 1.1 (and 1.5)
    assert yields.ratio.mean == pytest.approx(1.1) and yields.ratio.high - yields.ratio.low == pytest.approx(
        0
    )
    assert yields.overhead == pytest.approx(1 - 1 / 1.1)
    assert runs_on.ratio.mean == pytest.approx(1.5) and runs_on.overhead == pytest.approx(1 / 3)


def test_the_ratio_is_a_geometric_mean_with_an_interval_that_widens_with_disagreement():
    rounds = [
        {"alone": [1.0], "yields": [1.2], "runs_on": [1.0]},
        {"alone": [1.0], "yields": [1.0 / 1.2], "runs_on": [1.0]},
        {"alone": [1.0], "yields": [1.0], "runs_on": [1.0]},
    ]
    _, yields, runs_on = summarize(rounds)
    assert yields.ratio.mean == pytest.approx(1.0)
    assert yields.ratio.low < 0.9 and yields.ratio.high > 1.1
    assert math.isclose(yields.ratio.low * yields.ratio.high, 1.0, rel_tol=1e-9)  # symmetric on the log scale
    assert runs_on.ratio.mean == pytest.approx(1.0) and runs_on.overhead == pytest.approx(0.0)


def test_each_condition_comes_first_in_turn():
    assert [order(r)[0] for r in range(3)] == list(CONDITIONS)
    assert all(sorted(order(r)) == sorted(CONDITIONS) for r in range(6))


@pytest.mark.slow
def test_the_benchmark_times_real_train_steps_in_each_condition(tmp_path, monkeypatch):
    from reflow.cli import main

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / "bench"
    code = main(
        ["bench", "lending", "--rounds", "2", "--steps", "1", "--out", str(out), *TINY_MODEL, *SMALL_ROLLOUT,
         *QUICK_RUN, *PARITY_ENV]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "bench_lending.json").read_text())
    assert len(report["rounds"]) == 2
    assert all(len(r[c]) == 1 and r[c][0] > 0 for r in report["rounds"] for c in CONDITIONS)
    by = {r["condition"]: r for r in report["results"]}
    assert by["alone"]["ratio"] is None and by["yields"]["ratio"]["mean"] > 0
    assert "| runs_on |" in (out / "bench_lending.md").read_text()
