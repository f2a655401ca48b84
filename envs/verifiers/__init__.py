"""Verifiers-v0: a verifiers environment (classic API, verifiers 0.3.x) run in its own process and venv.

`reflow.make("reflow/Verifiers-v0", env_id="my_vf_env", python="/path/to/venv/bin/python")`. The
adapter lives in `reflow.interop.verifiers_env`; only its name is written here, so `import reflow`
stays light.
"""

from reflow.env import register


def register_envs() -> None:
    register(
        "reflow/Verifiers-v0",
        entry_point="reflow.interop.verifiers_env:VerifiersEnv",
        max_turns=32,
        deadline_s=600.0,
    )
