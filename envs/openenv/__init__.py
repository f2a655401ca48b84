"""OpenEnv-v0: an unmodified OpenEnv server, played over its `/ws` session protocol.

`reflow.make("reflow/OpenEnv-v0", url="http://host:8000", name="echo")`. The adapter lives in
`reflow.interop.openenv_client` (it needs the `interop` extra); only its name is written here, so
`import reflow` stays light.
"""

from reflow.env import register


def register_envs() -> None:
    register(
        "reflow/OpenEnv-v0",
        entry_point="reflow.interop.openenv_client:OpenEnvEnv",
        max_turns=32,
        deadline_s=600.0,
    )
