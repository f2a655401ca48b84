"""LongTail-v0: follow a trail of keys with a `lookup` tool; trails are heavy-tailed in length."""

from reflow.env import register


def register_envs() -> None:
    # 64 hops at most, one answer turn, and room for a few slipped calls.
    register(
        "reflow/LongTail-v0",
        entry_point="reflow_envs.longtail.env:LongTailEnv",
        max_turns=72,
        deadline_s=600.0,
    )
