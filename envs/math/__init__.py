"""Math-v0: single-turn reasoning problems with a verifiable final answer."""

from reflow.env import register


def register_envs() -> None:
    register("reflow/Math-v0", entry_point="reflow_envs.math.env:MathEnv", max_turns=1, deadline_s=60.0)
