"""The run's idle ratios count the rollout slots actually held: the elastic pool changes their number."""

import pytest

from reflow.config import load_config
from reflow.recipes.run_log import run_summary, step_record, summary_table
from reflow.recipes.run_state import RunState


def test_rollout_idle_ratio_integrates_the_slot_count_over_time():
    state = RunState()
    state.count_rollout_slots(2, 10.0)  # two rollout slots for 10 s, then one moves to the trainer
    state.wall_s, state.rollout_busy_s = 20.0, 15.0
    record = step_record(state, 1, [], 0, {"trained_tokens": 0.0, "new_trained_tokens": 0.0}, [], {})
    assert state.rollout_slot_s == 30.0  # 2 x 10 + 1 x 10, not 1 x 20 (nor 2 x 20)
    assert record["rollout_idle_ratio"] == pytest.approx(0.5)
    config = load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow"])
    assert run_summary(config, state)["rollout_idle_ratio"] == pytest.approx(0.5)
    state.count_rollout_slots(1, 15.0)  # a count for an earlier second adds nothing
    assert (state.rollout_slot_s, state.slots_counted_s) == (30.0, 20.0)


def test_env_time_share_is_the_envs_part_of_the_episodes_time_per_step_and_over_the_run():
    """The sandbox's (any env's) share of rollout time: step 1's episodes spent 3 of 12 s in their
    env, step 2's 6 of 8 s; over the run 9 of 20 s."""
    from reflow.runtime.workers import GroupReport

    def report(episode_s: list[float], env_s: list[float]) -> GroupReport:
        n = len(episode_s)
        return GroupReport("g", 0, [0.0] * n, [False] * n, ["ok"] * n, [1] * n, 0, False, 1.0,
                           episode_seconds=episode_s, env_seconds=env_s)  # fmt: skip

    state, metrics = RunState(), {"trained_tokens": 0.0, "new_trained_tokens": 0.0}
    first = step_record(state, 1, [report([4.0, 4.0], [1.0, 1.0]), report([4.0], [1.0])], 0, metrics, [], {})
    second = step_record(state, 1, [report([8.0], [6.0])], 0, metrics, [], {})
    assert first["env_time_share"] == pytest.approx(0.25) and second["env_time_share"] == pytest.approx(0.75)
    assert step_record(state, 1, [], 0, metrics, [], {})["env_time_share"] == 0.0  # no episodes: no share
    config = load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow"])
    assert run_summary(config, state)["env_time_share"] == pytest.approx(9 / 20)


def test_malformed_call_share_is_the_share_of_tool_calls_that_did_not_parse_per_step_and_over_the_run():
    """Step 1's groups made 10 tool calls, 1 malformed; step 2's 10, 9 malformed (a policy losing its
    call format); over the run 10 of 20."""
    from reflow.runtime.workers import GroupReport

    def report(calls: int, malformed: int) -> GroupReport:
        return GroupReport("g", 0, [0.0], [False], ["ok"], [1], 0, False, 1.0, tool_calls=calls,
                           malformed_calls=malformed)  # fmt: skip

    state, metrics = RunState(), {"trained_tokens": 0.0, "new_trained_tokens": 0.0}
    first = step_record(state, 1, [report(6, 1), report(4, 0)], 0, metrics, [], {})
    second = step_record(state, 1, [report(10, 9)], 0, metrics, [], {})
    assert first["malformed_call_share"] == pytest.approx(0.1)
    assert second["malformed_call_share"] == pytest.approx(0.9)
    assert step_record(state, 1, [report(0, 0)], 0, metrics, [], {})["malformed_call_share"] == 0.0
    config = load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow"])
    assert run_summary(config, state)["malformed_call_share"] == pytest.approx(0.5)


def test_new_trained_tokens_per_s_counts_a_group_once_and_trained_tokens_per_s_every_replay():
    """Step 1 trains groups a and b for the first time (100 + 60 tokens); step 2 replays a and trains
    c for the first time (40 tokens): 300 tokens trained, 200 of them new work."""
    state = RunState()
    steps = [({"trained_tokens": 160.0, "new_trained_tokens": 160.0}, 10.0)]
    steps += [({"trained_tokens": 140.0, "new_trained_tokens": 40.0}, 20.0)]
    records = []
    for metrics, wall in steps:
        state.wall_s = wall
        records.append(step_record(state, 1, [], 2, metrics, [0, 1], {}))
    assert records[0]["new_trained_tokens_per_s"] == records[0]["trained_tokens_per_s"] == 16.0
    assert records[1]["new_trained_tokens_per_s"] == pytest.approx(10.0)  # 200 / 20
    assert records[1]["trained_tokens_per_s"] == pytest.approx(15.0)  # 300 / 20
    assert records[1]["new_trained_tokens"] == 40.0  # the step's own count is kept in its record
    config = load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow"])
    summary = run_summary(config, state)
    assert summary["new_trained_tokens_per_s"] == pytest.approx(10.0)
    assert summary["new_trained_tokens_per_s"] <= summary["trained_tokens_per_s"]
    rows = [row[0] for row in _cells(summary_table(summary))]
    # the table headlines new work, then work with replays, each saying which tokens it counts
    assert (
        rows.index("new_trained_tokens_per_s (first use of a group)")
        < rows.index("trained_tokens_per_s (with replays)")
        < rows.index("generated_tokens")
    )


def _cells(table):
    columns = [list(c.cells) for c in table.columns]
    return list(zip(*columns, strict=True))


def test_engine_use_sums_each_engines_counters_over_the_stretch_it_ran():
    """Shares are seconds decoding / prefilling over the engines' seconds, summed over engines, less
    what `left_out` names (evaluations); an engine that started during the stretch (a key not in
    `before`: a restarted engine is a new key) counts from zero; one gone by the end is not counted;
    tokens per decode step are decode tokens over decode steps."""
    from reflow.metrics import engine_use

    def c(up, steps, tokens, dec, pre, computed, reused):
        return dict(
            uptime_s=up, steps=steps, decode_tokens=tokens, decode_s=dec, prefill_s=pre,
            prefill_tokens=computed, prefix_hit_tokens=reused,
        )  # fmt: skip

    before = {"w0@1": c(100, 1000, 9000, 50, 20, 500, 500), "w1@1": c(300, 50, 100, 9, 9, 9, 9)}
    after = {
        "w0@1": c(160, 1600, 24000, 80, 35, 1500, 2500),  # +60 s: decoding 30, prefill 15, 600 steps
        "w1@7": c(20, 200, 2000, 10, 5, 500, 0),  # w1 restarted: a new engine, from zero (20 s)
        "w2@9": c(20, 200, 6000, 10, 0, 0, 0),  # joined during the stretch
    }
    use = engine_use(before, after)
    assert use["engine_decode_share"] == pytest.approx((30 + 10 + 10) / (60 + 20 + 20))
    assert use["engine_prefill_share"] == pytest.approx((15 + 5) / 100)
    assert use["engine_tokens_per_decode_step"] == pytest.approx((15000 + 2000 + 6000) / 1000)
    assert use["engine_prefix_reuse"] == pytest.approx(2000 / (2000 + 1500))
    # an evaluation of 20 s that decoded 10 s in 100 steps of 8 tokens is not the run's
    evaluation = {"uptime_s": 20, "decode_s": 10, "steps": 100, "decode_tokens": 800}
    use = engine_use(before, after, evaluation)
    assert use["engine_decode_share"] == pytest.approx((50 - 10) / (100 - 20))
    assert use["engine_prefill_share"] == pytest.approx(20 / 80)
    assert use["engine_tokens_per_decode_step"] == pytest.approx((23000 - 800) / 900)
    assert engine_use({}, {}) == {}
