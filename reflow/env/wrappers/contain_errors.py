"""ContainErrors: an exception inside the env's `step` ends the episode as env_error instead of crashing
(as infra_error when it is an `InfraError`: the sandbox or a service under the env failed).

The caller gets a normal `StepResult` (truncated, reward 0, `info["status"] == "env_error"`, the error
text in `info["error"]`) so one broken env cannot take down a batch of episodes. A failing `reset` has
no episode to mark, so it raises `EnvError` with the cause attached (an `InfraError` passes through
unchanged, and the episode runner marks the episode infra_error).
"""

from __future__ import annotations

import logging
import traceback

from reflow.env.core import AssistantTurn, EnvError, InfraError, Observation, StepResult, Task, Wrapper

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ContainErrors(Wrapper):
    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        try:
            return await self.env.reset(task=task, seed=seed)
        except (ValueError, TypeError) as e:  # a bad task or argument from the caller: say so plainly
            raise ValueError(f"{self.unwrapped!r}: reset rejected its input: {e}") from e
        except InfraError:  # a sandbox or env server that failed to start: not the env's fault
            raise
        except Exception as e:
            raise EnvError(f"{self.unwrapped!r}: reset failed: {describe(e)}") from e

    async def step(self, turn: AssistantTurn) -> StepResult:
        try:
            return await self.env.step(turn)
        except Exception as e:
            status = "infra_error" if isinstance(e, InfraError) else "env_error"
            log.warning("env %r raised in step (%s):\n%s", self.unwrapped, status, traceback.format_exc())
            return StepResult(
                messages=[],
                reward=0.0,
                terminated=False,
                truncated=True,
                info={"status": status, "termination": status, "error": describe(e)},
            )
