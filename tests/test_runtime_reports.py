"""What a rollout worker reports about a stored group: rewards, spread and tool latencies."""

from reflow.records import EpisodeRecord, TurnRecord
from reflow.runtime.workers import report_group


def _episode(
    reward: float,
    status: str,
    latencies_s: list[float],
    timings: dict[str, float] | None = None,
    calls: list[str | None] = (),
) -> EpisodeRecord:
    turn = TurnRecord(
        turn_index=0,
        segment_id=0,
        obs_messages=[],
        prompt_delta_ids=[],
        completion_ids=[1, 2, 3],
        completion_logprobs=[-1.0] * 3,
        finish_reason="stop",
        policy_version=2,
        token_versions=[2] * 3,
        sampling_params={},
        tool_results=[{"call_id": "c", "name": "calc", "content": "4", "latency_s": s} for s in latencies_s],
        tool_calls=[{"id": "c", "name": "calc", "arguments": {}, "parse_error": error} for error in calls],
    )
    return EpisodeRecord(
        episode_id=f"e{reward}{status}",
        group_id="g",
        env_id="e",
        task_id=1,
        task_hash="h",
        seed=0,
        status=status,
        reward=reward,
        success=reward > 0,
        policy_version_start=2,
        turns=[turn],
        timings=timings or {},
    )


def test_report_carries_tool_latencies_in_ms_and_spread_without_infra_errors():
    report = report_group([_episode(1.0, "ok", [0.002, 0.004]), _episode(0.0, "ok", [0.001])], 0.5)
    assert report.tool_latencies_ms == [2.0, 4.0, 1.0]
    assert report.has_spread and report.policy_version == 2 and report.generated_tokens == 6
    # the only 0-reward episode is an infra error: masked, so no spread left
    report = report_group([_episode(1.0, "ok", []), _episode(0.0, "infra_error", [])], 0.5)
    assert not report.has_spread and report.tool_latencies_ms == []


def test_report_carries_each_episodes_time_and_its_time_in_the_env():
    episodes = [_episode(1.0, "ok", [], {"total_s": 4.0, "env_s": 1.0, "generation_s": 3.0})]
    episodes.append(_episode(0.0, "ok", [], {"total_s": 2.0, "env_s": 1.5}))
    report = report_group([*episodes, _episode(0.0, "ok", [])], 0.5)  # an episode without timings: 0
    assert report.episode_seconds == [4.0, 2.0, 0.0] and report.env_seconds == [1.0, 1.5, 0.0]


def test_report_counts_the_tool_calls_that_did_not_parse():
    """The parser keeps an unusable call with `parse_error` set: the report counts calls and those."""
    episodes = [_episode(1.0, "ok", [], calls=[None, "tool call is not valid JSON"]), _episode(0.0, "ok", [])]
    episodes.append(_episode(0.0, "ok", [], calls=["no closing </tool_call> tag", None, None]))
    report = report_group(episodes, 0.5)
    assert (report.tool_calls, report.malformed_calls) == (5, 2)


async def test_held_out_evaluation_is_greedy_by_default_or_a_mean_over_sampled_episodes(
    tmp_path, monkeypatch
):
    """`eval.temperature` > 0 with `eval.samples` k: k sampled episodes on each held-out task, success
    their mean; the default stays one greedy episode per task."""
    import reflow.rollout.collect as collect_module
    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    played = []
    real_collect = collect_module.collect

    async def spy(runner, env_id, episodes, **kw):
        records = await real_collect(runner, env_id, episodes, **kw)
        played.append((runner.config.sampling.temperature, kw["group_size"], records))
        return records

    monkeypatch.setattr(collect_module, "collect", spy)
    base = [
        "env.id=reflow/Calc-v0",
        f"out_dir={tmp_path}",
        "eval.max_new_tokens=6",
        "rollout.max_batch_size=8",
    ]
    for overrides, (temperature, samples) in (
        ([], (0.0, 1)),
        (["eval.temperature=1.0", "eval.samples=4"], (1.0, 4)),
    ):
        worker = RolloutWorker(load_config(None, base + overrides), model_dir, replay=None)
        summary = await worker.evaluate(episodes=3, seed=1_000_000)
        await worker.close()
        t, group_size, records = played[-1]
        assert (t, group_size) == (temperature, samples)
        assert (summary["tasks"], summary["samples"], summary["temperature"]) == (3, samples, temperature)
        assert summary["episodes"] == len(records) == 3 * samples
        assert sorted({r.seed for r in records}) == [1_000_000, 1_000_001, 1_000_002]
        assert summary["success_rate"] == sum(r.success for r in records) / len(records)
