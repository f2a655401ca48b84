"""The learnability filter (reflow.policy.task_selection) and the wall-clock evaluation schedule
(reflow.policy.eval_schedule), as arithmetic: hand-made observations in, decisions checked."""

import json
import random
from collections import Counter

import pytest

from reflow.policy.eval_schedule import EvalSchedule
from reflow.policy.task_selection import LearnabilityConfig, LearnabilityFilter, learnability


def seen(f, seed, successes):
    f.start([seed])
    f.observe(seed, successes)


def test_only_tasks_strictly_between_never_and_always_solved_are_revisited():
    f = LearnabilityFilter(LearnabilityConfig(revisit_share=1.0, max_attempts=3))
    seen(f, 0, [False] * 8)  # too hard
    seen(f, 1, [True] * 8)  # too easy
    seen(f, 2, [True, False, False, False])  # 1/4
    seen(f, 3, [True, True, False, False])  # 1/2
    assert f.candidates() == [2, 3]
    assert f.rate(2) == 0.25 and f.rate(3) == 0.5
    # tasks with no signal are forgotten at once: the table holds only what may be revisited
    assert set(f.stats) == {"2", "3"} and f.rate(0) is None
    assert sorted(f.pick(10, random.Random(0))) == [2, 3]  # fewer candidates than asked for


def test_revisits_are_a_share_of_the_round_and_weighted_by_p_times_one_minus_p():
    f = LearnabilityFilter(LearnabilityConfig(revisit_share=0.5, max_attempts=10**6))
    seen(f, 10, [True, False])  # p = 1/2: weight 1/4
    seen(f, 11, [True, False, False, False, False, False, False, False])  # p = 1/8: weight 7/64
    assert f.revisits(4) == 2 and f.revisits(3) == 1 and f.revisits(1) == 0
    rng = random.Random(1)
    counts = Counter(f.pick(3, rng)[0] for _ in range(4000))
    expected = learnability(0.5) / (learnability(0.5) + learnability(1 / 8))  # 16/23
    assert counts[10] / 4000 == pytest.approx(expected, abs=0.03)
    assert learnability(0.0) == learnability(1.0) == 0.0 and learnability(0.5) == 0.25


def test_a_task_is_revisited_at_most_max_attempts_minus_one_times_and_the_rate_is_recent():
    f = LearnabilityFilter(LearnabilityConfig(revisit_share=1.0, max_attempts=3, window=2))
    seen(f, 5, [True, False, False, False])  # attempt 1: 1/4
    assert f.pick(1, random.Random(0)) == [5]
    seen(f, 5, [True, True, True, False])  # attempt 2: recent rate (1/4 + 3/4) / 2
    assert f.rate(5) == 0.5
    assert f.candidates() == [5]
    seen(f, 5, [True, False])  # attempt 3 of 3: out of attempts, forgotten
    assert f.candidates() == [] and f.stats == {}
    g = LearnabilityFilter(LearnabilityConfig(window=1, max_attempts=5))
    seen(g, 7, [True, False])
    seen(g, 7, [True, True])  # the window of 1 sees only the last group: solved now, so dropped
    assert g.candidates() == [] and g.rate(7) is None


def test_a_task_in_flight_is_not_proposed_again_until_observed():
    f = LearnabilityFilter(LearnabilityConfig(revisit_share=1.0, max_attempts=5))
    seen(f, 1, [True, False])
    picked = f.pick(4, random.Random(0))
    assert picked == [1]
    f.start(picked)
    assert f.pick(4, random.Random(0)) == []  # its second group is still in flight
    f.observe(1, [False, True])
    assert f.pick(4, random.Random(0)) == [1]


def test_same_seeded_rng_same_picks_and_the_state_is_plain_json():
    def run(seed):
        f = LearnabilityFilter(LearnabilityConfig(revisit_share=0.5, max_attempts=4))
        for s in range(20):
            seen(f, s, [s % 3 == 0, s % 2 == 0, True, False])
        rng = random.Random(seed)
        return [f.pick(8, rng) for _ in range(5)], f.stats

    a, stats = run(3)
    assert a == run(3)[0]
    assert all(len(p) == 4 and len(set(p)) == 4 for p in a)
    restored = LearnabilityFilter(LearnabilityConfig(), json.loads(json.dumps(stats)))
    assert restored.candidates() == LearnabilityFilter(LearnabilityConfig(), stats).candidates()


def test_bad_observations_and_settings_are_clear_errors():
    f = LearnabilityFilter(LearnabilityConfig())
    with pytest.raises(ValueError, match="no group in flight"):
        f.observe(3, [True])
    f.start([3])
    with pytest.raises(ValueError, match="no episodes"):
        f.observe(3, [])
    for bad in ({"revisit_share": 1.5}, {"max_attempts": 0}, {"window": 0}):
        with pytest.raises(ValueError):
            LearnabilityConfig(**bad)


def test_eval_schedule_fires_once_per_grid_interval_and_catches_up_without_a_burst():
    s = EvalSchedule(30.0)
    assert [s.due(t) for t in (0.0, 10.0, 29.9, 30.0, 31.0, 59.0)] == [
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    # a slow step jumps from 59 s past three grid points (60, 90, 120): one point, the next at 150
    assert s.due(125.0) is True
    assert s.next_s == 150.0
    assert [s.due(t) for t in (126.0, 149.0, 150.5)] == [False, False, True]


def test_eval_schedule_points_do_not_depend_on_how_many_steps_a_mode_takes():
    def points(step_s):
        s, t, taken = EvalSchedule(20.0), 0.0, []
        while t < 200:
            t += step_s
            if s.due(t):
                taken.append(t)
        return taken

    fast, slow = points(0.5), points(4.0)
    assert len(fast) == len(slow) == 10  # 20, 40, ..., 200 for both, whatever the step length
    assert all(abs(a - b) < 4.0 for a, b in zip(fast, slow, strict=True))


def test_eval_schedule_after_a_resume_and_bad_settings():
    s = EvalSchedule(60.0, after_s=130.0)  # the last point before the crash was at 130 s
    assert s.due(170.0) is False and s.due(180.0) is True
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            EvalSchedule(bad)
    with pytest.raises(ValueError):
        EvalSchedule(10.0, after_s=-1.0)


# --- where the loops use them (reflow.recipes.run_state, .evaluation), with a real RunConfig and RunState ---


def _config(*overrides):
    from reflow.config import load_config

    return load_config(None, ["env.id=reflow/Calc-v0", *overrides])


def _report(successes):
    from reflow.runtime.workers import GroupReport

    rewards = [float(s) for s in successes]
    n = len(successes)
    return GroupReport("g", 0, rewards, successes, ["ok"] * n, [1] * n, 0, len(set(rewards)) > 1, 0.0)


def test_next_seeds_revisits_learnable_tasks_and_counts_fresh_seeds_on():
    from reflow.recipes.run_state import RunState, next_seeds, observe_tasks

    config, state = _config("tasks.learnability=true", "tasks.revisit_share=0.5"), RunState()
    first = next_seeds(state, 4, config)
    assert first == [0, 1, 2, 3] and state.next_seed == 4  # nothing seen yet: all fresh
    outcomes = {0: [True, False], 1: [True, True], 2: [False, False], 3: [False, True]}
    observe_tasks(config, state, first, [_report(outcomes[s]) for s in first])
    second = next_seeds(state, 4, config)
    assert sorted(second[:2]) == [0, 3] and second[2:] == [4, 5]  # the learnable two, then fresh ones
    assert state.next_seed == 6 and state.task_stats["0"]["attempts"] == 2
    # off (the default), or no config: fresh seeds only, and observations are a no-op
    plain = RunState()
    assert next_seeds(plain, 3, _config()) == [0, 1, 2] and next_seeds(plain, 2) == [3, 4]
    observe_tasks(_config(), plain, [0], [_report([True, False])])
    assert plain.task_stats == {}
    with pytest.raises(ValueError, match="seeds for"):
        observe_tasks(config, state, [0, 3], [_report([True, False])])


def test_observations_follow_the_pools_round_robin_deal_over_workers():
    from reflow.recipes.run_state import RunState, next_seeds, observe_tasks

    config, state = _config("tasks.learnability=true", "tasks.revisit_share=1.0"), RunState()
    seeds = next_seeds(state, 5, config)
    # two workers: worker 0 played seeds 0, 2, 4 and worker 1 seeds 1, 3; reports come worker by worker
    outcome = {0: [True, True], 2: [True, False], 4: [False, False], 1: [True, False], 3: [True, True]}
    observe_tasks(config, state, seeds, [_report(outcome[s]) for s in (0, 2, 4, 1, 3)], workers=2)
    assert sorted(next_seeds(state, 5, config)[:2]) == [1, 2]  # the two with spread, whatever the deal


def test_learnability_is_a_sync_mode_switch():
    from reflow.errors import ConfigError

    with pytest.raises(ConfigError, match="mode sync only"):
        _config("tasks.learnability=true", "mode=reflow")


def test_eval_due_follows_the_wall_clock_when_every_s_is_set_else_the_steps():
    from reflow.recipes.evaluation import eval_due
    from reflow.recipes.run_state import RunState

    state = RunState(step=10, wall_s=5.0)
    steps = _config("eval.every=10")
    assert eval_due(steps, state)
    state.step = 11
    assert not eval_due(steps, state)
    timed = _config("eval.every=10", "eval.every_s=30")
    state = RunState(history=[{"wall_s": 0.0}], snapshots=[{"wall_s": 40.0}])  # the last point: 40 s
    due = []
    for step, wall in enumerate([45.0, 59.0, 61.0, 62.0, 200.0, 201.0], start=1):
        state.step, state.wall_s = step * 10, wall  # every step a multiple of eval.every: ignored
        due.append(eval_due(timed, state))
        if due[-1]:  # the loop evaluates: a new point in the run state
            state.history.append({"wall_s": wall})
    assert due == [False, False, True, False, True, False]


def test_the_run_summary_ends_with_the_headroom_before_and_after():
    from reflow.recipes.run_log import headroom_summary

    room = {"samples_per_task": 8, "greedy_success": 0.4, "sampled_success": 0.3, "pass_at_k": 0.8}
    out = headroom_summary({"start": {**room, "headroom": 0.42}, "final": {**room, "headroom": 0.2}})
    assert list(out) == [
        *("greedy_start", "mean@8_start", "pass@8_start", "headroom_start"),
        *("greedy_final", "mean@8_final", "pass@8_final", "headroom_final"),
    ]
    assert out["headroom_start"] == 0.42 and out["headroom_final"] == 0.2
    assert headroom_summary({}) == {}


async def test_the_worker_headroom_plays_greedy_then_k_samples_on_the_same_held_out_tasks(
    tmp_path, monkeypatch
):
    """`RolloutWorker.headroom` (eval.pass_at): one greedy episode and k sampled ones per held-out task,
    paired by seed and scored by `rl_headroom`; on `eval.env_kwargs` when set."""
    import reflow.rollout.collect as collect_module
    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    played = []
    real_collect = collect_module.collect

    async def spy(runner, env_id, episodes, **kw):
        records = await real_collect(runner, env_id, episodes, **kw)
        played.append((runner.config.sampling.temperature, kw["group_size"], kw["env_kwargs"], records))
        return records

    monkeypatch.setattr(collect_module, "collect", spy)
    overrides = [
        "env.id=reflow/Calc-v0",
        f"out_dir={tmp_path}",
        "eval.max_new_tokens=6",
        "rollout.max_batch_size=8",
        "rollout.temperature=0.9",
        "env.kwargs={max_steps: 2}",
    ]
    worker = RolloutWorker(load_config(None, overrides), model_dir, replay=None)
    room = await worker.headroom(episodes=3, seed=1_000_000, k=2)
    await worker.close()
    (t0, g0, kw0, greedy), (t1, g1, kw1, sampled) = played
    assert (t0, g0, len(greedy)) == (0.0, 1, 3) and (t1, g1, len(sampled)) == (0.9, 2, 6)
    assert kw0 == kw1 == {"max_steps": 2}
    assert {r.seed for r in greedy} == {r.seed for r in sampled} == {1_000_000, 1_000_001, 1_000_002}
    assert room["tasks"] == 3 and room["samples_per_task"] == 2
    assert room["sampled_success"] == sum(r.success for r in sampled) / 6
    assert room["greedy_success"] == sum(r.success for r in greedy) / 3
    assert room["pass_at_k"] >= room["headroom"] and room["seconds"] > 0


async def test_the_worker_headroom_measures_the_same_weights_the_same_in_every_run(tmp_path):
    """The sampled half of the measurement is seeded (`RolloutWorker.held_out`): two measurements of
    the same weights, one per worker as in two runs, play the same sampled episodes token for token."""
    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    config = load_config(
        None,
        [
            "env.id=reflow/Calc-v0",
            f"out_dir={tmp_path}",
            "eval.max_new_tokens=8",
            "rollout.max_batch_size=8",
            "rollout.temperature=1.0",
        ],
    )
    played = []
    for _ in range(2):
        worker = RolloutWorker(config, model_dir, replay=None)
        played.append(await worker.held_out(4, 1_000_000, 1.0, 3))
        await worker.close()
    first, second = ([r.segments[0].token_ids for r in recs] for recs in played)
    assert first == second
    assert len({tuple(ids) for ids in first}) > 4  # the samples of a task differ from each other
