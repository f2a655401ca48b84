"""The bodies of the requests `SGLangEngine` sends to SGLang's native HTTP routes, the parsing of its
`/generate` answers, and the server arguments LoRA serving needs. Each body is one of sglang's own
request classes as JSON; `tests/sglang/` checks them against those classes.
"""

from __future__ import annotations

from typing import Any

from reflow.engine.base import EngineError, FinishReason, GenerateResult, SamplingParams

TOP_K_ALL = 1 << 30  # SGLang's "no top-k filter"


def generate_payload(
    input_ids: list[int], params: SamplingParams, rid: str, adapter: str | None = None
) -> dict[str, Any]:
    """The `/generate` body for one request (a `GenerateReqInput`); `adapter`: the name of the LoRA
    adapter to generate with (None: the model alone)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else TOP_K_ALL,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the text the ids say, stop string included
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    payload = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,  # logprobs of the output only
        "stream": False,
    }
    if adapter is not None:
        payload["lora_path"] = adapter  # a loaded adapter's name (`load_lora_payload`)
    return payload


def update_from_disk_payload(path: str, version: int) -> dict[str, Any]:
    """The `/update_weights_from_disk` body (an `UpdateWeightFromDiskReqInput`). Requests in flight are
    aborted first, so none spans the update (`SGLangEngine.generate` resubmits them)."""
    return {
        "model_path": path,
        "weight_version": str(version),
        "abort_all_requests": True,
        "flush_cache": True,
    }


def update_from_tensor_payload(serialized: list[str], version: int) -> dict[str, Any]:
    """The `/update_weights_from_tensor` body (an `UpdateWeightsFromTensorReqInput`); one entry per TP
    rank. Requests in flight are aborted first, as for `update_from_disk_payload`."""
    return {
        "serialized_named_tensors": serialized,
        "weight_version": str(version),
        "flush_cache": True,
        "abort_all_requests": True,
    }


def load_lora_payload(name: str, path: str) -> dict[str, Any]:
    """The `/load_lora_adapter` body (a `LoadLoRAAdapterReqInput`): the adapter folder at `path` (peft's
    format, `reflow.models.adapters`) loaded under `name`, which requests then name (`generate_payload`)."""
    return {"lora_name": name, "lora_path": path}


def unload_lora_payload(name: str) -> dict[str, Any]:
    """The `/unload_lora_adapter` body (an `UnloadLoRAAdapterReqInput`)."""
    return {"lora_name": name}


def lora_launch_args(rank: int, target_modules: list[str]) -> list[str]:
    """`sglang.launch_server` arguments for serving adapters loaded later (`/load_lora_adapter`): their
    largest rank and target modules must be known when the server starts."""
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *target_modules]


def abort_payload(rid: str | None) -> dict[str, Any]:
    """The `/abort_request` body (an `AbortReq`); no rid aborts everything."""
    return {"rid": rid} if rid else {"rid": "", "abort_all": True}


def pause_payload(mode: str = "abort") -> dict[str, Any]:
    """The `/pause_generation` body (a `PauseGenerationReqInput`): abort | retract | in_place."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


def parse_generate_response(body: dict[str, Any], fallback_version: int) -> GenerateResult:
    """A `/generate` response (`output_ids` + `meta_info`) as a GenerateResult."""
    meta = body.get("meta_info") or {}
    output_ids = list(body.get("output_ids") or [])
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(output_ids):
        raise EngineError(f"SGLang returned {len(output_ids)} ids but {len(entries)} logprobs")
    logprobs = []
    for (logprob, token_id, *_), expected in zip(entries, output_ids, strict=True):
        if token_id != expected:
            raise EngineError(
                f"SGLang logprob entry for token {token_id} does not match output id {expected}"
            )
        logprobs.append(float(logprob))
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    finish: FinishReason = kind if kind in ("stop", "length", "abort") else "stop"
    version = meta.get("weight_version")
    try:
        version = int(version)
    except (TypeError, ValueError):
        version = fallback_version
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        matched_stop=reason.get("matched") if isinstance(reason, dict) else None,
        meta={"id": meta.get("id"), "cached_tokens": meta.get("cached_tokens")},
    )
