"""Remote-v0: an env served by `reflow serve-envs` elsewhere, played through its HTTP client.

`reflow.make("reflow/Remote-v0", url="http://host:port", env_id="reflow/Calc-v0", token=...)`. The client
itself lives in `reflow.server.client`; only its name is written here, so `import reflow` stays light.
"""

from reflow.env import register


def register_envs() -> None:
    register("reflow/Remote-v0", entry_point="reflow.server.client:RemoteEnv")
