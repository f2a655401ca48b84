"""Hand-built EpisodeRecords for the replay tests (no model), and the writer the durability test kills.

`python tests/replay_helpers.py DB` adds groups to DB in a loop and prints each group id only after
`add_group` returned, so a printed id is an acknowledged group.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reflow.records import EpisodeRecord, Segment, TurnRecord


def make_episode(
    group_id: str,
    index: int,
    *,
    version: int = 0,
    reward: float = 0.0,
    status: str = "ok",
    n_turns: int = 2,
    tokens: int = 8,
    seed: int = 0,
) -> EpisodeRecord:
    """A multi-turn record with tool calls, tool results and one segment per episode; deterministic
    in its arguments, so a test can rebuild the expected record."""
    rng = random.Random(f"{group_id}/{index}/{seed}")
    rec = EpisodeRecord(
        episode_id=f"{group_id}-e{index}",
        group_id=group_id,
        env_id="reflow/Calc-v0",
        task_id={"id": index, "split": "train"},
        task_hash=f"h{index}",
        seed=seed + index,
        status=status,
        termination="answered" if status == "ok" else status,
        reward=reward,
        reward_components={"correct": reward},
        success=reward > 0.5,
        policy_version_start=version,
        policy_version_end=version + (index % 2),
        tokenizer_id="tok",
        chat_template_id="tmpl",
        timings={"generation_s": 0.5, "env_s": 0.1},
        messages=[{"role": "user", "content": f"what is {index} + 2?"}],
    )
    segment = Segment(0)
    segment.extend_prompt([rng.randrange(50_000) for _ in range(20)])
    for t in range(n_turns):
        ids = [rng.randrange(50_000) for _ in range(tokens)]
        logprobs = [-rng.random() * 3 for _ in range(tokens)]
        delta = [rng.randrange(50_000) for _ in range(5)]
        segment.extend_prompt(delta)
        segment.extend_sampled(ids, logprobs, [version] * tokens)
        rec.turns.append(
            TurnRecord(
                turn_index=t,
                segment_id=0,
                obs_messages=[{"role": "tool", "content": f"result {t}", "name": "calc"}],
                prompt_delta_ids=delta,
                completion_ids=ids,
                completion_logprobs=logprobs,
                finish_reason="stop",
                policy_version=version,
                token_versions=[version] * tokens,
                sampling_params={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 256, "stop": []},
                raw_text=f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{index}+2"}}}}</tool_call> {t}',
                tool_calls=[
                    {"name": "calc", "arguments": {"expr": f"{index}+2"}, "raw": "...", "parse_error": None}
                ],
                tool_results=[
                    {"content": str(index + 2), "exit_code": 0, "latency_s": 0.01, "truncated": False}
                ],
                reward=reward if t == n_turns - 1 else 0.0,
                generation_s=0.25,
                env_s=0.05,
            )
        )
    rec.segments.append(segment)
    return rec


def make_group(
    group_id: str, rewards: list[float], *, version: int = 0, **kwargs
) -> tuple[list[EpisodeRecord], list[float]]:
    """A group's episodes with GRPO advantages (reward minus the group mean)."""
    episodes = [make_episode(group_id, i, version=version, reward=r, **kwargs) for i, r in enumerate(rewards)]
    mean = sum(rewards) / len(rewards)
    return episodes, [r - mean for r in rewards]


def writer_group(n: int) -> tuple[list[EpisodeRecord], list[float]]:
    """The n-th group the durability writer adds (the test rebuilds it to compare)."""
    return make_group(f"g{n}", [float(i % 2) for i in range(2 + n % 4)], version=n // 3, n_turns=1 + n % 3)


def _writer(db: str) -> None:
    from reflow.replay import ReplayStore

    store = ReplayStore(db, run="durability")
    n = 0
    while True:
        episodes, advantages = writer_group(n)
        store.add_group(episodes, advantages, meta={"n": n})
        print(episodes[0].group_id, flush=True)  # the acknowledgement: only after add_group returned
        n += 1


if __name__ == "__main__":
    _writer(sys.argv[1])
