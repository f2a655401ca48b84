"""What the env server tells a client when an env fails: the kind of failure and an error id, never its
cause. A reset or step error's text can name host paths, sandbox internals or the server's code (an
exception's message, a traceback's frames); the cause goes to the server's log under the id instead.

Locally the same errors keep their text (`ContainErrors` puts it in `info["error"]`): the user running
the env is the one who needs it. Timeouts keep theirs: the server or a wrapper wrote them, from limits
the client knows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets

from reflow.env import EnvError, InfraError, StepResult
from reflow.server.schemas import ApiError

log = logging.getLogger(__name__)

REDACTED_STATUSES = ("env_error", "infra_error")
"""Step statuses whose `info["error"]` is replaced by an error id before it leaves the server."""


def _error_id() -> str:
    return secrets.token_hex(6)


def _ref(error_id: str) -> str:
    return f"(error id {error_id}; the server's log has the cause)"


def reset_error(e: BaseException, env_id: str, task_given: bool) -> ApiError:
    """The client's answer to a failed reset: what kind of failure, and an id under which the log has
    its cause."""
    error_id = _error_id()
    log.warning("session of %s failed to start (error id %s): %s: %s", env_id, error_id, type(e).__name__, e)
    ref = _ref(error_id)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ApiError(504, "infra", "deadline", f"the env did not start within its deadline {ref}")
    if isinstance(e, (ValueError, TypeError)):  # a bad task or kwarg (ContainErrors says so)
        return ApiError(422, "agent", "bad_task", f"the env rejected the task or its kwargs {ref}")
    if isinstance(e, InfraError) or isinstance(e.__cause__, InfraError):
        return ApiError(503, "infra", "env_infra", f"the env's infrastructure failed {ref}")
    if isinstance(e, EnvError) and task_given:  # most likely the task the client sent
        return ApiError(422, "env", "reset_failed", f"the env failed on the given task {ref}")
    return ApiError(500, "env", "reset_failed", f"the env failed to start {ref}")


def redact_step(result: StepResult, session_id: str, env_id: str) -> StepResult:
    """`result` with the text of an env or infrastructure error replaced by an error id (logged with
    the text); any other result unchanged."""
    status = result.info.get("status")
    error = result.info.get("error")
    if status not in REDACTED_STATUSES or error is None:
        return result
    error_id = _error_id()
    log.warning(
        "step of session %s (%s) ended %s (error id %s): %s", session_id, env_id, status, error_id, error
    )
    what = "the env's infrastructure failed" if status == "infra_error" else "the env failed"
    return dataclasses.replace(result, info={**result.info, "error": f"{what} in this step {_ref(error_id)}"})


def crashed_step(e: Exception) -> StepResult:
    """The result of a step whose exception got past `ContainErrors` (`redact_step` hides its text)."""
    error = f"{type(e).__name__}: {e}"
    return StepResult(
        [], truncated=True, info={"status": "env_error", "termination": "env_error", "error": error}
    )


def timed_out_step(deadline: bool, step_timeout_s: float) -> StepResult:
    """The result of a step cut off by the session's deadline or by the step timeout."""
    error = "the session deadline passed" if deadline else f"the step took longer than {step_timeout_s:g}s"
    termination = "deadline" if deadline else "step_timeout"
    return StepResult(
        [], truncated=True, info={"status": "timeout", "termination": termination, "error": error}
    )
