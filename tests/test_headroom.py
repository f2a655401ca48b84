"""`rl_headroom`: what RL can add to greedy success, from greedy and sampled episodes of the same tasks."""

import pytest

from reflow.records import EpisodeRecord
from reflow.rollout.collect import rl_headroom


def rec(seed: int, success: bool, status: str = "ok") -> EpisodeRecord:
    return EpisodeRecord(
        episode_id=f"e{seed}-{success}",
        group_id=f"g{seed}",
        env_id="x",
        task_id=seed,
        task_hash="h",
        seed=seed,
        status=status,
        success=success,
    )


def test_headroom_counts_tasks_greedy_fails_and_a_sample_solves():
    greedy = [rec(0, True), rec(1, False), rec(2, False), rec(3, False)]
    sampled = [
        *[rec(0, s) for s in (True, False, False, False)],  # greedy solves it: nothing to gain
        *[rec(1, s) for s in (False, False, True, False)],  # headroom
        *[rec(2, False) for _ in range(4)],  # no sample solves it: RL gets no signal
        *[rec(3, s) for s in (True, True, True, False)],  # headroom
    ]
    room = rl_headroom(greedy, sampled)
    assert room == {
        "tasks": 4,
        "samples_per_task": 4,
        "greedy_success": 0.25,
        "sampled_success": (1 + 1 + 0 + 3) / 16,
        "pass_at_k": 0.75,
        "headroom": 0.5,
    }


def test_headroom_pairs_by_seed_and_ignores_unpaired_or_repeated_greedy_tasks():
    greedy = [rec(5, False), rec(5, True), rec(6, False), rec(99, False)]
    sampled = [rec(6, True), rec(6, False), rec(5, True), rec(5, True), rec(7, True), rec(7, True)]
    room = rl_headroom(greedy, sampled)
    assert room["tasks"] == 2 and room["samples_per_task"] == 2
    assert room["greedy_success"] == 0.0 and room["headroom"] == 1.0  # first greedy episode of seed 5
    # an infra error is no success
    assert rl_headroom([rec(1, False)], [rec(1, False, status="infra_error")])["headroom"] == 0.0
    with pytest.raises(ValueError, match="no task"):
        rl_headroom([rec(1, False)], [rec(2, True)])
