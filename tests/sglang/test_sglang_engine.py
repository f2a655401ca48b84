"""SGLangEngine requests checked against the real sglang package's request classes.

SGLang cannot serve on this CPU machine, so the HTTP side runs against an httpx transport that parses
each request with sglang's own classes (as its FastAPI server does) and answers in the shape
`/generate` returns. `scripts/sglang_e2e.py` runs the same engine against a real server on a GPU.
"""

import dataclasses
import json

import httpx
import pytest

from reflow.engine import EngineError, SamplingParams
from reflow.engine.sglang_engine import SGLangEngine
from reflow.engine.sglang_requests import (
    abort_payload,
    generate_payload,
    parse_generate_response,
    pause_payload,
    update_from_disk_payload,
    update_from_tensor_payload,
)

pytestmark = pytest.mark.sglang

PARAMS = [
    SamplingParams(),
    SamplingParams(max_new_tokens=7, temperature=0.0),
    SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, stop=["</tool_call>", "\n\n"], stop_token_ids=[3, 5], seed=11
    ),
]


def io():
    from sglang.srt.managers import io_struct

    return io_struct


def check_generate(payload: dict) -> None:
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams

    fields = {f.name for f in dataclasses.fields(io().GenerateReqInput)}
    assert set(payload) <= fields, set(payload) - fields
    req = io().GenerateReqInput(**json.loads(json.dumps(payload)))
    req.normalize_batch_and_arguments()
    assert req.rid == payload["rid"] and req.input_ids == payload["input_ids"] and req.return_logprob
    assert generate_contract_error(json.loads(json.dumps(payload))) is None
    sp = SGLSamplingParams(**payload["sampling_params"])
    sp.normalize(ByteTokenizer())
    sp.verify(vocab_size=1000)


class ByteTokenizer:
    """What SamplingParams.normalize asks of a tokenizer (stop-string lengths): one id per byte."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def check_struct(cls, payload: dict):
    """Build the msgspec Struct from the JSON body (unknown keys raise), then type-check a round trip."""
    import msgspec  # comes with sglang (`make test-sglang`), not with the venv

    obj = cls(**json.loads(json.dumps(payload)))
    msgspec.convert(msgspec.to_builtins(obj), cls)
    for key, value in payload.items():
        assert getattr(obj, key) == value
    return obj


@pytest.mark.parametrize("params", PARAMS)
def test_generate_payload_is_a_valid_generate_req_input(params):
    payload = generate_payload([1, 2, 3], params, "rid-1")
    check_generate(payload)
    sampling = payload["sampling_params"]
    assert sampling["max_new_tokens"] == params.max_new_tokens
    assert sampling["top_k"] == (params.top_k or 1 << 30)


def test_an_invalid_request_is_caught_by_sglangs_own_checks():
    payload = generate_payload([1], SamplingParams(), "r")
    payload["sampling_params"]["temperature"] = -1.0
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams

    with pytest.raises(ValueError):
        SGLSamplingParams(**payload["sampling_params"]).verify(vocab_size=1000)
    with pytest.raises(TypeError):
        io().GenerateReqInput(**{**payload, "no_such_field": 1})


def test_weight_update_abort_pause_and_continue_payloads():
    obj = check_struct(io().UpdateWeightFromDiskReqInput, update_from_disk_payload("/ckpt/step-3", 3))
    assert obj.weight_version == "3"
    check_struct(io().UpdateWeightsFromTensorReqInput, update_from_tensor_payload(["AAECAw=="], 4))
    assert check_struct(io().AbortReq, abort_payload("rid-9")).rid == "rid-9"
    assert check_struct(io().AbortReq, abort_payload(None)).abort_all is True
    for mode in ("abort", "retract", "in_place"):
        check_struct(io().PauseGenerationReqInput, pause_payload(mode))
    check_struct(io().ContinueGenerationReqInput, {})
    check_struct(io().FlushCacheReqInput, {})
    with pytest.raises(ValueError):
        pause_payload("sideways")


def sglang_transport(log: list, weight_version: list, fail: bool = False) -> httpx.MockTransport:
    """Parses every request with sglang's classes and answers like SGLang's HTTP server does."""
    routes = {
        "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
        "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
        "/abort_request": "AbortReq",
        "/pause_generation": "PauseGenerationReqInput",
        "/continue_generation": "ContinueGenerationReqInput",
        "/flush_cache": "FlushCacheReqInput",
    }

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content or b"{}")
        log.append((request.url.host, path, body))
        if fail:
            return httpx.Response(503, text="server overloaded")
        if path == "/generate":
            check_generate(body)
            n = min(body["sampling_params"]["max_new_tokens"], 4)
            ids = [(t * 7 + 1) % 50 for t in body["input_ids"][-n:]][:n]
            return httpx.Response(
                200,
                json={
                    "text": "x" * n,
                    "output_ids": ids,
                    "meta_info": {
                        "id": body["rid"],
                        "finish_reason": {"type": "length", "length": n},
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": n,
                        "weight_version": weight_version[0],
                        "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)],
                    },
                },
            )
        check_struct(getattr(io(), routes[path]), body)
        if path == "/update_weights_from_disk":
            weight_version[0] = body["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        return httpx.Response(200, json={"success": True})

    return httpx.MockTransport(handler)


async def test_engine_round_trip_routing_and_weight_versions():
    log, version = [], ["0"]
    engine = SGLangEngine(
        ["http://gpu-a:30000", "http://gpu-b:30000"], transport=sglang_transport(log, version)
    )
    results = [await engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=3)) for _ in range(2)]
    assert results[0].output_ids == [(t * 7 + 1) % 50 for t in [6, 7, 8]]
    assert results[0].logprobs == [-0.5, -1.5, -2.5] and results[0].finish_reason == "length"
    assert results[0].weight_version == 0 and results[0].prompt_tokens == 4
    assert await engine.update_weights(path="/ckpt/step-1") == 1
    after = await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    assert after.weight_version == 1 and engine.weight_version == 1
    assert {host for host, path, _ in log if path == "/update_weights_from_disk"} == {"gpu-a", "gpu-b"}
    await engine.pause("retract")
    await engine.resume()
    await engine.flush_cache()
    assert (await engine.health())["ok"] is True
    await engine.close()


async def test_server_errors_become_engine_errors():
    engine = SGLangEngine(["http://gpu-a:30000"], transport=sglang_transport([], ["0"], fail=True))
    with pytest.raises(EngineError, match="HTTP 503"):
        await engine.generate([1], SamplingParams())
    await engine.close()


def test_response_parsing_checks_consistency():
    body = {
        "output_ids": [4, 9, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 10,
            "weight_version": "default",
            "output_token_logprobs": [[-0.1, 4, None], [-0.2, 9, None], [-0.3, 2, None]],
        },
    }
    result = parse_generate_response(body, fallback_version=5)
    assert (result.finish_reason, result.matched_stop, result.weight_version) == ("stop", 2, 5)
    body["meta_info"]["output_token_logprobs"][1][1] = 8
    with pytest.raises(EngineError, match="does not match"):
        parse_generate_response(body, 0)


def sglang_run(tmp_path, *overrides: str):
    """(a small tiny-preset model folder, a run config with `engine.kind: sglang` and `overrides`)."""
    from reflow.config import load_config
    from reflow.models import build_tiny

    model_dir = str(
        build_tiny(tmp_path / "model", num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    )
    engine = ["env.id=reflow/Calc-v0", "engine.kind=sglang", "engine.urls=[http://gpu-a:30000]"]
    return model_dir, load_config(None, [*engine, f"out_dir={tmp_path / 'runs'}", *overrides])


async def test_a_rollout_worker_drives_sglang_servers_and_hands_them_each_policy_from_disk(tmp_path):
    """`engine.kind: sglang`: the worker tokenizes and plays episodes through `/generate`, and a new
    policy reaches the servers as a folder they load with `/update_weights_from_disk`."""
    import torch

    from reflow.models import load_model
    from reflow.runtime.workers import RolloutWorker

    model_dir, config = sglang_run(tmp_path, "eval.max_new_tokens=4")
    worker = RolloutWorker(config, model_dir, replay=None)
    assert isinstance(worker.engine, SGLangEngine)
    log, version = [], ["0"]
    await worker.engine.client.aclose()  # the worker's own client would dial gpu-a: answer in process
    worker.engine.client = httpx.AsyncClient(transport=sglang_transport(log, version))

    summary = await worker.evaluate(episodes=3, seed=0)  # garbage tokens: episodes end unanswered
    assert sum(summary["statuses"].values()) == 3
    assert sum(1 for _, path, _ in log if path == "/generate") >= 3

    policy, _ = load_model(model_dir)
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.5)  # the "trained" weights (tied to lm_head)
    killed = tmp_path / "runs" / "run" / "engine-weights" / "worker-0" / ".v000001.x1y2.tmp"
    killed.mkdir(parents=True)  # a write a kill interrupted (in an earlier life of the run)
    (killed / "model.safetensors").write_bytes(b"half")
    for step in (1, 2):
        assert await worker.update_weights(policy.state_dict(), version=step) == step
        (body,) = [b for _, path, b in log if path == "/update_weights_from_disk"][-1:]
        assert body["weight_version"] == str(step)
        loaded, tok = load_model(body["model_path"])  # what the server loads
        assert torch.equal(loaded.model.embed_tokens.weight, policy.model.embed_tokens.weight)
        assert torch.equal(loaded.lm_head.weight, policy.model.embed_tokens.weight)
        assert tok.chat_template
    folders = sorted(p.name for p in (tmp_path / "runs" / "run" / "engine-weights" / "worker-0").iterdir())
    assert folders == ["v000002"]  # the servers hold the weights: only the newest folder stays, and
    # no half-written one
    assert await worker.weight_version() == 2
    await worker.close()


def _part_answer(body: dict, aborted: bool, version: str) -> httpx.Response:
    """`/generate`'s answer: aborted after two tokens of version 0, or the whole budget at `version`."""
    if aborted:
        ids, finish, version = [11, 12], {"type": "abort", "message": "aborted"}, "0"
    else:
        n = body["sampling_params"]["max_new_tokens"]
        ids, finish = list(range(20, 20 + n)), {"type": "length", "length": n}
    meta = {
        "id": body["rid"],
        "finish_reason": finish,
        "prompt_tokens": len(body["input_ids"]),
        "weight_version": version,
        "output_token_logprobs": [[-0.25, t, None] for t in ids],
    }
    return httpx.Response(200, json={"output_ids": ids, "meta_info": meta})


def _split_transport(log: list, state: dict) -> httpx.MockTransport:
    """A server whose first /generate runs until a weight update aborts it (SGLang's
    `abort_all_requests`), answering then with the tokens sampled so far; later requests finish."""

    async def handler(request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content or b"{}")
        log.append((path, body))
        if path == "/generate":
            check_generate(body)
            first = sum(p == "/generate" for p, _ in log) == 1
            if first:
                await state["aborted"].wait()
            return _part_answer(body, first or body["rid"] in state["user_aborted"], state["v"])
        if path == "/abort_request":
            state["user_aborted"].add(check_struct(io().AbortReq, body).rid)
            state["aborted"].set()
            return httpx.Response(200, json={})
        obj = check_struct(io().UpdateWeightFromDiskReqInput, body)
        assert obj.abort_all_requests  # nothing in flight may span the update
        state["v"] = obj.weight_version
        state["aborted"].set()
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})

    return httpx.MockTransport(handler)


async def test_a_request_spanning_a_weight_update_is_split_there_with_per_token_versions():
    import asyncio

    log, state = [], {"v": "0", "aborted": asyncio.Event(), "user_aborted": set()}
    engine = SGLangEngine(["http://gpu-a:30000"], transport=_split_transport(log, state))
    task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5), "req"))
    await asyncio.sleep(0.05)
    assert await engine.update_weights(path="/ckpt/v1", version=1) == 1
    result = await task
    assert result.output_ids == [11, 12, 20, 21, 22] and result.logprobs == [-0.25] * 5
    assert result.meta["token_versions"] == [0, 0, 1, 1, 1] and result.weight_version == 1
    assert (result.finish_reason, result.prompt_tokens) == ("length", 3)
    first, second = [body for path, body in log if path == "/generate"]
    # the exact prefix, token in, with what is left of the budget, as a request of its own
    assert second["input_ids"] == [1, 2, 3, 11, 12] and second["sampling_params"]["max_new_tokens"] == 3
    assert second["rid"] != first["rid"] and result.meta["reprefill_tokens"] == 5
    await engine.close()


async def test_a_request_the_caller_aborts_is_not_resubmitted():
    import asyncio

    log, state = [], {"v": "0", "aborted": asyncio.Event(), "user_aborted": set()}
    engine = SGLangEngine(["http://gpu-a:30000"], transport=_split_transport(log, state))
    task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5), "req"))
    await asyncio.sleep(0.05)
    await engine.abort("req")
    result = await task
    assert result.finish_reason == "abort" and result.output_ids == [11, 12]
    assert "token_versions" not in result.meta
    assert sum(path == "/generate" for path, _ in log) == 1
    await engine.close()


def _held_update_transport(log: list, state: dict) -> httpx.MockTransport:
    """A server that holds a weight update (`state["release"]`) and, when released, aborts the request
    in flight first (as SGLang does with `abort_all_requests`) and answers the update only after that
    request's aborted answer has gone back; later requests finish on the new weights."""

    async def handler(request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content or b"{}")
        log.append((path, body))
        if path == "/generate":
            check_generate(body)
            first = sum(p == "/generate" for p, _ in log) == 1
            if first:
                state["generating"].set()
                await state["abort_in_flight"].wait()
                state["aborted_answer"].set()
            return _part_answer(body, first, state["v"])
        obj = check_struct(io().UpdateWeightFromDiskReqInput, body)
        state["updating"].set()
        await state["release"].wait()
        state["abort_in_flight"].set()
        await state["aborted_answer"].wait()
        state["v"] = obj.weight_version
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 1})

    return httpx.MockTransport(handler)


def _held_state() -> dict:
    import asyncio

    events = ("updating", "release", "generating", "abort_in_flight", "aborted_answer")
    return {"v": "0", **{name: asyncio.Event() for name in events}}


async def test_a_request_sent_while_an_update_is_held_and_then_aborted_by_it_is_resubmitted():
    """The window between an update reaching the servers and their abort of what is in flight: a
    request sent then and aborted by that update is split and resubmitted, not ended as an abort (the
    update used to be counted before the servers aborted, so such a request looked user-aborted)."""
    import asyncio

    log, state = [], _held_state()
    engine = SGLangEngine(["http://gpu-a:30000"], transport=_held_update_transport(log, state))
    update = asyncio.create_task(engine.update_weights(path="/ckpt/v1", version=1))
    await state["updating"].wait()  # the update is at the server, held
    task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5), "req"))
    await state["generating"].wait()  # sent in the window
    state["release"].set()
    result = await task
    assert await update == 1
    assert result.output_ids == [11, 12, 20, 21, 22] and result.finish_reason == "length"
    assert result.meta["token_versions"] == [0, 0, 1, 1, 1] and result.weight_version == 1
    second = [body for path, body in log if path == "/generate"][1]
    assert second["input_ids"] == [1, 2, 3, 11, 12] and second["sampling_params"]["max_new_tokens"] == 3
    await engine.close()


async def test_an_episode_whose_request_an_update_aborts_in_that_window_completes(tmp_path):
    """The same race under a rollout worker's episode: the episode ends as it would without the update
    (out of turn budget on the mock's tokens), not as an infra error."""
    import asyncio

    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

    model_dir = str(
        build_tiny(tmp_path / "model", num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    )
    overrides = ["env.id=reflow/Calc-v0", "engine.kind=sglang", "engine.urls=[http://gpu-a:30000]"]
    config = load_config(None, [*overrides, f"out_dir={tmp_path / 'runs'}", "eval.max_new_tokens=4"])
    worker = RolloutWorker(config, model_dir, replay=None)
    log, state = [], _held_state()
    await worker.engine.client.aclose()
    worker.engine.client = httpx.AsyncClient(transport=_held_update_transport(log, state))
    update = asyncio.create_task(worker.engine.update_weights(path="/ckpt/v1", version=1))
    await state["updating"].wait()
    episode = asyncio.create_task(worker.evaluate(episodes=1, seed=0))
    await state["generating"].wait()
    state["release"].set()
    summary = await episode
    assert await update == 1
    assert sum(summary["statuses"].values()) == 1 and "infra_error" not in summary["statuses"]
    assert sum(path == "/generate" for path, _ in log) >= 2  # the aborted request went again
    await worker.close()
