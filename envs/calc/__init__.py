"""Calc-v0: multi-turn arithmetic word problems solved with a calculator tool."""

from reflow.env import register


def register_envs() -> None:
    register("reflow/Calc-v0", entry_point="reflow_envs.calc.env:CalcEnv", max_turns=12, deadline_s=120.0)
