"""PyCode-v0: write a Python function that passes hidden tests, trying code with a run_python tool."""

from reflow.env import register


def register_envs() -> None:
    register(
        "reflow/PyCode-v0", entry_point="reflow_envs.pycode.env:PyCodeEnv", max_turns=8, deadline_s=120.0
    )
