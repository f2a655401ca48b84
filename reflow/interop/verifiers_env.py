"""`VerifiersEnv`: a verifiers environment (classic API: `MultiTurnEnv`, `ToolEnv`, `SingleTurnEnv` with a
`Rubric`, loaded by `load_environment`) stepped by our episode runner, from its own process and venv.

`reflow.make("reflow/Verifiers-v0", env_id="my_env", env_args={...}, python=".../bin/python")`, or
$REFLOW_VERIFIERS_PYTHON for `python`; `paths` are put on the worker's `sys.path` (a local env module).

verifiers owns its loop and calls the model itself, so control is inverted: `verifiers_worker.py` runs
`env.run_rollout` in the verifiers venv with verifiers' own OpenAI chat client, whose transport hands
each chat-completion request back here. A request is an observation for our runner; our runner's turn
is the completion that answers it. One worker process per (env, args, python) serves every episode of
this event loop at once; it exits when we close its stdin or go away.

| verifiers (classic)                              | ReFlow                                                   |
|--------------------------------------------------|----------------------------------------------------------|
| dataset row `seed % len(dataset)`                | the task `{"id", "seed"}` (`pick_task(seed)`)             |
| the first request's `messages`, `tools`          | the reset observation (messages and OpenAI tool schemas) |
| each later request: messages after our last turn | the step's messages (tool results, env responses)        |
| the completion we answer with                    | our turn: content and `tool_calls` (OpenAI form)         |
| `RolloutOutput.reward` (the rubric's weighted sum) | the final step's reward (earlier steps: 0)              |
| `metrics`                                        | `reward_components`                                      |
| `stop_condition`, `is_truncated`                 | `termination`; `truncated` rather than `terminated`      |
| reward >= the env's `pass_threshold`             | `success`                                                |
| a rollout `error` / an exception in the rollout  | env_error (an empty model reply is the policy's: scored) |
| the worker dies or cannot start                  | `InfraError`: infra_error, masked in training            |

verifiers 0.4 (v1: `Taskset`/`Harness`, its ZMQ `EnvServer`) is not supported: its harnesses run agent
programs that call an OpenAI endpoint themselves, which needs a served endpoint, not this bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import uuid
import weakref
from pathlib import Path
from typing import Any

from reflow.env import (
    AssistantTurn,
    Env,
    EnvError,
    InfraError,
    Message,
    Observation,
    ResetNeeded,
    SchemaTool,
    StepResult,
    Task,
)

PYTHON_ENV_VAR = "REFLOW_VERIFIERS_PYTHON"
WORKER = Path(__file__).with_name("verifiers_worker.py")
MODEL_ERRORS = ("EmptyModelResponseError", "InvalidModelResponseError")


class VerifiersWorker:
    """One worker process and the per-rollout queues of what it sends."""

    def __init__(self, python: str, spec: dict[str, Any]) -> None:
        self.python, self.spec = python, spec
        self.proc: asyncio.subprocess.Process | None = None
        self.queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.info: dict[str, Any] = {}
        self.dead: str | None = None
        self._ready = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> None:
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python,
                str(WORKER),
                json.dumps(self.spec),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=64 * 2**20,
            )
        except OSError as e:
            raise InfraError(f"cannot start the verifiers worker with {self.python}: {e}") from e
        self._reader = asyncio.create_task(self._read())
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            await self.stop()
            raise InfraError(
                f"the verifiers worker did not load {self.spec['env_id']} in {timeout_s}s"
            ) from None

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            message = json.loads(line)
            op = message.get("op")
            if op == "ready" and not self._ready.done():
                self._ready.set_result(message)
            elif op == "fatal":
                self._fail(f"the verifiers worker failed to load {self.spec['env_id']}: {message['error']}")
            elif message.get("rid") in self.queues:
                self.queues[message["rid"]].put_nowait(message)
        code = await self.proc.wait()
        self._fail(self.dead or f"the verifiers worker exited with code {code}")

    def _fail(self, reason: str) -> None:
        self.dead = self.dead or reason
        if not self._ready.done():
            self._ready.set_exception(InfraError(reason))
        for queue in self.queues.values():
            queue.put_nowait({"op": "dead", "error": reason})

    def send(self, message: dict[str, Any]) -> None:
        if self.dead is not None or self.proc is None or self.proc.stdin is None:
            raise InfraError(self.dead or "the verifiers worker is not running")
        self.proc.stdin.write((json.dumps(message) + "\n").encode())

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader


# Per event loop (a process's pipes belong to one), per spec: the worker its envs share. A worker of a
# loop that is gone sees its stdin close and exits.
_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, VerifiersWorker]] = (
    weakref.WeakKeyDictionary()
)


async def shared_worker(python: str, spec: dict[str, Any], timeout_s: float) -> VerifiersWorker:
    """The worker for `spec` on this loop, started (and waited for) on first use or after it died."""
    workers = _workers.setdefault(asyncio.get_running_loop(), {})
    key = json.dumps([python, spec], sort_keys=True)
    worker = workers.get(key)
    if worker is None or worker.dead is not None:
        worker = workers[key] = VerifiersWorker(python, spec)
        try:
            await worker.start(timeout_s)
        except BaseException:
            workers.pop(key, None)
            raise
    else:
        await asyncio.shield(worker._ready)
    return worker


class VerifiersEnv(Env):
    metadata = {"remote": True}  # noqa: RUF012  (Env's convention)

    def __init__(
        self,
        env_id: str | None = None,
        env_args: dict[str, Any] | None = None,
        *,
        python: str | None = None,
        paths: list[str] | None = None,
        start_timeout_s: float = 180.0,
        turn_timeout_s: float = 600.0,
        tasks: list[Task] | str | None = None,
    ) -> None:
        """`env_id`: the verifiers env module (`load_environment` in it); `env_args` its kwargs;
        `python`: the verifiers venv's interpreter (else $REFLOW_VERIFIERS_PYTHON)."""
        super().__init__(tasks)
        self.python = python or os.environ.get(PYTHON_ENV_VAR, "")
        self.env_id = env_id or ""
        self.spec_id = f"verifiers/{env_id}" if env_id else None  # records name the served env
        self.spec = {
            "env_id": env_id,
            "env_args": dict(env_args or {}),
            "paths": [str(p) for p in paths or []],
        }
        self.start_timeout_s, self.turn_timeout_s = start_timeout_s, turn_timeout_s
        self.worker: VerifiersWorker | None = None
        self.rid: str | None = None
        self.prompt: list[Message] = []

    def pick_task(self, seed: int | None) -> Task:
        if self.tasks:
            return super().pick_task(seed)
        seed = seed if seed is not None else random.randrange(2**31)
        return {"id": f"{self.env_id}-{seed}", "seed": seed}

    def generate_task(self, rng: random.Random) -> Task:
        return self.pick_task(rng.randrange(2**31))

    async def _reset(self, task: Task) -> Observation:
        if not self.env_id or not self.python:
            raise ValueError(
                f"VerifiersEnv needs env_id= and python= (or ${PYTHON_ENV_VAR}: a verifiers venv)"
            )
        await self._abort()
        self.worker = await shared_worker(self.python, self.spec, self.start_timeout_s)
        self.rid = uuid.uuid4().hex
        self.worker.queues[self.rid] = asyncio.Queue()
        self.worker.send({"op": "start", "rid": self.rid, "seed": int(task.get("seed") or 0)})
        message = await self._next()
        if message["op"] != "chat":
            self._forget()
            raise EnvError(f"{self!r}: the rollout ended before asking the model: {message}")
        body = message["body"]
        self.prompt = list(body.get("messages", []))
        self.tools = [
            SchemaTool(f["name"], f.get("description") or "", f.get("parameters") or {"type": "object"})
            for f in (t.get("function", {}) for t in body.get("tools") or [])
        ]
        return Observation(list(self.prompt), info={"verifiers": {"env_id": self.env_id, "rid": self.rid}})

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.worker is None or self.rid is None:
            raise ResetNeeded(f"step() on {self!r} needs a live episode; call reset() first")
        sent = turn.to_message()
        sent.pop("reasoning_content", None)
        sent["tool_calls"] = [c for c in sent.get("tool_calls", []) if c["function"]["name"]]
        self.worker.send(
            {"op": "reply", "rid": self.rid, "message": sent, "finish_reason": turn.finish_reason}
        )
        message = await self._next()
        if message["op"] == "chat":
            messages = list(message["body"].get("messages", []))
            new = messages[len(self.prompt) + 1 :]  # after the prompt it had and our turn
            self.prompt = messages
            return StepResult(new)
        self._forget()
        if message["op"] == "failed":
            raise EnvError(f"{self!r}: the rollout raised: {message['error']}")
        return self._final(message)

    def _final(self, done: dict[str, Any]) -> StepResult:
        completion = done.get("completion") or []
        last = max((i for i, m in enumerate(completion) if m.get("role") == "assistant"), default=-1)
        messages = completion[last + 1 :]  # a final env response, if the env gave one
        error = done.get("error")
        info: dict[str, Any] = {
            "success": done["reward"] >= self.worker.info.get("pass_threshold", 0.5)
            if self.worker
            else False,
            "reward_components": {k: float(v) for k, v in (done.get("metrics") or {}).items()},
            "termination": done.get("stop_condition") or "completed",
        }
        if error and not any(name in json.dumps(error, default=str) for name in MODEL_ERRORS):
            info.update(status="env_error", error=f"verifiers rollout error: {error}")
        truncated = bool(done.get("is_truncated"))
        return StepResult(
            messages, reward=done["reward"], terminated=not truncated, truncated=truncated, info=info
        )

    async def _next(self) -> dict[str, Any]:
        assert self.worker is not None and self.rid is not None
        try:
            message = await asyncio.wait_for(self.worker.queues[self.rid].get(), self.turn_timeout_s)
        except TimeoutError:
            await self._abort()
            raise InfraError(
                f"{self!r}: no word from the verifiers worker in {self.turn_timeout_s}s"
            ) from None
        if message["op"] == "dead":
            self._forget()
            raise InfraError(f"{self!r}: {message['error']}")
        return message

    def _forget(self) -> None:
        if self.worker is not None and self.rid is not None:
            self.worker.queues.pop(self.rid, None)
        self.rid = None

    async def _abort(self) -> None:
        if self.worker is not None and self.rid is not None and self.worker.dead is None:
            with contextlib.suppress(InfraError):
                self.worker.send({"op": "abort", "rid": self.rid})
        self._forget()

    async def close(self) -> None:
        await self._abort()

    def __repr__(self) -> str:
        return f"<VerifiersEnv {self.env_id}>"
