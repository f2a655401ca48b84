"""What a rollout worker reports about a stored group: rewards, spread and tool latencies."""

from reflow.records import EpisodeRecord, TurnRecord
from reflow.sched.workers import report_group


def _episode(reward: float, status: str, latencies_s: list[float]) -> EpisodeRecord:
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
    )


def test_report_carries_tool_latencies_in_ms_and_spread_without_infra_errors():
    report = report_group([_episode(1.0, "ok", [0.002, 0.004]), _episode(0.0, "ok", [0.001])], 0.5)
    assert report.tool_latencies_ms == [2.0, 4.0, 1.0]
    assert report.has_spread and report.policy_version == 2 and report.generated_tokens == 6
    # the only 0-reward episode is an infra error: masked, so no spread left
    report = report_group([_episode(1.0, "ok", []), _episode(0.0, "infra_error", [])], 0.5)
    assert not report.has_spread and report.tool_latencies_ms == []
