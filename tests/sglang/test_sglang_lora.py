"""LoRA on SGLang servers (`model.lora` with `engine.kind: sglang`): the adapter requests checked
against sglang's own request classes and server arguments, and a rollout worker handing the servers
each policy as an adapter folder that peft loads."""

import argparse
import json

import httpx
import pytest
from test_sglang_engine import check_generate, check_struct, io, sglang_run

from reflow.engine import SamplingParams
from reflow.engine.sglang_engine import KEEP_ADAPTERS
from reflow.engine.sglang_requests import (
    generate_payload,
    load_lora_payload,
    lora_launch_args,
    unload_lora_payload,
)

pytestmark = pytest.mark.sglang


def test_adapter_requests_and_launch_arguments_are_sglangs():
    obj = check_struct(io().LoadLoRAAdapterReqInput, load_lora_payload("reflow-ab-v3", "/w/worker-0/v000003"))
    assert (obj.lora_name, obj.lora_path, obj.pinned) == ("reflow-ab-v3", "/w/worker-0/v000003", False)
    assert check_struct(io().UnloadLoRAAdapterReqInput, unload_lora_payload("reflow-ab-v3")).lora_name
    payload = generate_payload([1, 2], SamplingParams(), "rid", adapter="reflow-ab-v3")
    check_generate(payload)
    req = io().GenerateReqInput(**json.loads(json.dumps(payload)))
    req.normalize_batch_and_arguments()
    assert req.lora_path == "reflow-ab-v3"
    assert "lora_path" not in generate_payload([1, 2], SamplingParams(), "rid")  # the base alone

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "/base", *lora_launch_args(8, ["q_proj", "down_proj"])])
    assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules) == (
        True,
        8,
        ["q_proj", "down_proj"],
    )


def lora_transport(log: list, loaded: list[str]) -> httpx.MockTransport:
    """Parses each request with sglang's classes; keeps the loaded adapters' names; `/generate` must
    name the newest one once one is loaded."""

    def handler(request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content or b"{}")
        log.append((path, body))
        if path == "/load_lora_adapter":
            loaded.append(check_struct(io().LoadLoRAAdapterReqInput, body).lora_name)
            return httpx.Response(200, json={"success": True, "loaded_adapters": {n: n for n in loaded}})
        if path == "/unload_lora_adapter":
            loaded.remove(check_struct(io().UnloadLoRAAdapterReqInput, body).lora_name)
            return httpx.Response(200, json={"success": True})
        if path == "/abort_request":
            assert check_struct(io().AbortReq, body).abort_all  # in flight: resubmitted on the new adapter
            return httpx.Response(200, json={})
        assert path == "/generate"
        check_generate(body)
        assert body.get("lora_path") == (loaded[-1] if loaded else None)
        n = min(body["sampling_params"]["max_new_tokens"], 3)
        ids = [7] * n
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "default",  # the base's: never updated under LoRA
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        return httpx.Response(200, json={"output_ids": ids, "meta_info": meta})

    return httpx.MockTransport(handler)


async def test_a_rollout_worker_under_lora_hands_the_servers_each_policy_as_an_adapter(tmp_path):
    import torch

    from reflow.models import load_model
    from reflow.models.adapters import merge_adapters
    from reflow.runtime.workers import RolloutWorker
    from reflow.train.lora import adapter_state_dict, load_lora_model, read_adapters

    model_dir, config = sglang_run(tmp_path, "model.lora={r: 4, target_modules: [q_proj, v_proj]}")
    worker = RolloutWorker(config, model_dir, replay=None)
    log, loaded = [], []
    await worker.engine.client.aclose()
    worker.engine.client = httpx.AsyncClient(transport=lora_transport(log, loaded))
    params = SamplingParams(max_new_tokens=3)
    assert (await worker.engine.generate([1, 2], params)).weight_version == 0  # the base, no adapter

    policy, _ = load_lora_model(model_dir, config.model.lora_settings())  # a trainer's copy
    for version in (1, 2, 3):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".lora_B." in name:
                    p.add_(0.01 * version)  # "trained" adapters
        adapters = adapter_state_dict(policy)
        assert await worker.update_weights(adapters, version=version) == version
        (body,) = [b for p, b in log if p == "/load_lora_adapter"][-1:]
        sent, settings = read_adapters(body["lora_path"])  # what the servers load, in peft's format
        assert settings.r == 4 and all(torch.equal(sent[k], adapters[k]) for k in adapters)
        assert (await worker.engine.generate([1, 2], params)).weight_version == version
    assert len(loaded) == KEEP_ADAPTERS and loaded[-1].endswith("-v3")  # older adapters unloaded
    assert [p for p, _ in log].count("/abort_request") == 3

    base, _ = load_lora_model(model_dir, config.model.lora_settings())  # fresh adapters: the base's output
    plain, _ = load_model(model_dir)
    merged = merge_adapters(plain, body["lora_path"])  # peft's own loader reads the folder
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, policy(ids).logits, atol=1e-5)
        assert not torch.allclose(base(ids).logits, policy(ids).logits, atol=1e-3)
    await worker.close()
