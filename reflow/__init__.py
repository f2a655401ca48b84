"""ReFlow: agentic, multi-turn RL post-training with replay-driven decoupling.

`import reflow` registers every env found through the `reflow.envs` entry-point group (the built-in
ones included), so `gymnasium.make("reflow/Calc-v0")` works right after it.
"""

from reflow.env import Env, ToolEnv, env_ids, make, register
from reflow.env.registration import discover

__version__ = "0.1.0"
__all__ = ["Env", "ToolEnv", "__version__", "env_ids", "make", "register"]

discover()
