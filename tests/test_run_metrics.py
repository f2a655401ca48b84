"""The run's idle ratios count the rollout slots actually held: the elastic pool changes their number."""

import pytest

from reflow.config import load_config
from reflow.recipes.run_log import run_summary, step_record
from reflow.recipes.run_state import RunState


def test_rollout_idle_ratio_integrates_the_slot_count_over_time():
    state = RunState()
    state.count_rollout_slots(2, 10.0)  # two rollout slots for 10 s, then one moves to the trainer
    state.wall_s, state.rollout_busy_s = 20.0, 15.0
    record = step_record(state, 1, [], 0, {"trained_tokens": 0.0}, [], {})
    assert state.rollout_slot_s == 30.0  # 2 x 10 + 1 x 10, not 1 x 20 (nor 2 x 20)
    assert record["rollout_idle_ratio"] == pytest.approx(0.5)
    config = load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow"])
    assert run_summary(config, state)["rollout_idle_ratio"] == pytest.approx(0.5)
    state.count_rollout_slots(1, 15.0)  # a count for an earlier second adds nothing
    assert (state.rollout_slot_s, state.slots_counted_s) == (30.0, 20.0)
