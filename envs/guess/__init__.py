"""Guess-v0: find a secret number with higher/lower feedback from a `guess` tool."""

from reflow.env import register


def register_envs() -> None:
    register("reflow/Guess-v0", entry_point="reflow_envs.guess.env:GuessEnv", max_turns=12, deadline_s=60.0)
