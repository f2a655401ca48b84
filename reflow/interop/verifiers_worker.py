"""The verifiers side of `VerifiersEnv`: run by the python of a verifiers venv, never imported by ReFlow.

`python verifiers_worker.py '{"env_id": ..., "env_args": {...}, "paths": [...]}'` loads the env with
`vf.load_environment(env_id, **env_args)` and runs rollouts (`env.run_rollout`) as the parent asks, many
at once. The env calls its model through verifiers' own `OpenAIChatCompletionsClient` over a real
`AsyncOpenAI`, whose HTTP transport hands each chat-completion request to the parent and answers with
the parent's turn: the verifiers multi-turn loop, tools and rubric run unchanged.

Wire (one JSON object a line; the real stdout carries only these, library output goes to stderr):
  worker -> parent: ready {num_examples, pass_threshold} | chat {rid, body} | done {rid, reward, metrics,
                    stop_condition, is_truncated, completion, error} | failed {rid, error} | fatal {error}
  parent -> worker: start {rid, seed} | reply {rid, message, finish_reason} | abort {rid}
The worker exits when its stdin closes (the parent went away).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # print() and logging of the env go to stderr, never into the protocol
sys.stdout = sys.stderr


def send(message: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(message, default=str) + "\n")


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        sys.path[:0] = list(spec.get("paths", []))
        import verifiers as vf

        self.vf = vf
        self.env = vf.load_environment(spec["env_id"], **spec.get("env_args", {}))
        try:
            dataset = self.env.get_dataset()
        except ValueError:  # an env with an eval dataset only
            dataset = self.env.get_eval_dataset()
        self.rows = [dict(row) for row in dataset]
        self.replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.running: dict[str, asyncio.Task[None]] = {}

    def client(self, rid: str) -> Any:
        import httpx
        from openai import AsyncOpenAI

        worker = self

        class Bridge(httpx.AsyncBaseTransport):
            """Each chat-completion request goes to the parent; its turn comes back as the response."""

            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                body = json.loads(request.content or b"{}")
                reply = asyncio.get_running_loop().create_future()
                worker.replies[rid] = reply
                send({"op": "chat", "rid": rid, "body": body})
                answer = await reply
                return httpx.Response(200, json=completion(body.get("model", ""), answer), request=request)

        http = httpx.AsyncClient(transport=Bridge())
        openai = AsyncOpenAI(
            base_url="http://reflow-policy.invalid/v1", api_key="-", http_client=http, max_retries=0
        )
        return self.vf.OpenAIChatCompletionsClient(openai)

    async def rollout(self, rid: str, seed: int) -> None:
        row = self.rows[seed % len(self.rows)]
        inp = {k: row[k] for k in ("prompt", "example_id", "answer", "info") if row.get(k) is not None}
        try:
            out = await self.env.run_rollout(inp, self.client(rid), "reflow-policy", {})
        except asyncio.CancelledError:
            return
        except Exception as e:
            send(
                {
                    "op": "failed",
                    "rid": rid,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                }
            )
            return
        finally:
            self.replies.pop(rid, None)
            self.running.pop(rid, None)
        send(
            {
                "op": "done",
                "rid": rid,
                "reward": float(out.get("reward") or 0.0),
                "metrics": out.get("metrics") or {},
                "stop_condition": out.get("stop_condition"),
                "is_truncated": bool(out.get("is_truncated")),
                "completion": [plain(m) for m in out.get("completion") or []],
                "error": plain(out.get("error")),
            }
        )

    def handle(self, message: dict[str, Any]) -> None:
        op, rid = message.get("op"), message.get("rid", "")
        if op == "start":
            self.running[rid] = asyncio.ensure_future(self.rollout(rid, int(message.get("seed") or 0)))
        elif op == "reply":
            reply = self.replies.pop(rid, None)
            if reply is not None and not reply.done():
                reply.set_result(message)
        elif op == "abort":
            task = self.running.pop(rid, None)
            if task is not None:
                task.cancel()


def plain(message: Any) -> Any:
    """A verifiers message (a pydantic model in 0.3) as a plain dict."""
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else message


def completion(model: str, answer: dict[str, Any]) -> dict[str, Any]:
    """The chat.completion object for the parent's turn (one choice, as verifiers requires)."""
    message = {"role": "assistant", "content": answer["message"].get("content") or ""}
    if answer["message"].get("tool_calls"):
        message["tool_calls"] = answer["message"]["tool_calls"]
    finish = "tool_calls" if message.get("tool_calls") else answer.get("finish_reason", "stop")
    return {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


async def main(spec: dict[str, Any]) -> None:
    try:
        worker = Worker(spec)
    except Exception as e:
        send({"op": "fatal", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    if not worker.rows:
        send({"op": "fatal", "error": f"{spec['env_id']} has an empty dataset"})
        return
    send(
        {
            "op": "ready",
            "num_examples": len(worker.rows),
            "pass_threshold": getattr(worker.env, "pass_threshold", 0.5),
        }
    )
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        worker.handle(json.loads(line))
    for task in list(worker.running.values()):
        task.cancel()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
