"""TorchEngine: an in-process engine for any Hugging Face causal LM, with continuous batching.

    engine = TorchEngine(model, tokenizer, max_batch_size=32)
    result = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64, temperature=1.0))
    await engine.update_weights(state_dict=trainer_model.state_dict())   # applied between decode steps
    await engine.close()

A dedicated worker thread owns the model and loops: take new requests and control messages, prefill the
new prompts (batched, left-padded) into free rows of a `SlotKVCache`, then run one decode step for every
running sequence. A request that finishes frees its row at once and the next waiting request takes it
on the following iteration (continuous batching): short requests never wait for the longest one in
their batch. torch releases the GIL inside its kernels, so the asyncio event loop stays responsive while
the worker computes; results come back through `loop.call_soon_threadsafe`. (The worker's loop lives in
`torch_worker.py`: `DecodeLoop`, held by the engine; the KV cache in `kv_cache.py`, sampling in `sampling.py`.)

Prefix reuse (`prefix_cache=True`): a finished request's row keeps its keys/values ("parked"); a new
prompt that starts with that request's prompt + completion (the next turn of a multi-turn episode,
token-in-token-out) copies them and computes only its new tokens. It hits when the next turn arrives
while the row is still parked: parked rows are the free rows that new requests take last. Identical
prompts admitted together (a GRPO group's first turn) are computed once and copied.

Semantics the rollout and trainer rely on:
- `output_ids` are every sampled token, the final EOS / stop id included, and also the tokens that
  completed a stop string (the text is not cut): token-in-token-out keeps what was sampled.
- `logprobs[i]` = log_softmax(logits / T)[output_ids[i]] (T = 0 counted as 1), before top-k/top-p.
- EOS ids (the tokenizer's and the generation config's) always stop, with `matched_stop` = that id.
- `update_weights` waits for the current step, swaps the weights, bumps the version, and running
  requests continue on the new weights, attending to keys/values computed under the old ones (as in
  SGLang's in-flight updates). A result's `weight_version` is the version of its last token; if it
  changed during the request, `meta["token_versions"]` gives the version of every output token.
  Parked prefixes are dropped on every update, so a later request never reuses stale keys/values.
  Versions never go back: a version older than the newest one given (applied or still queued) is
  refused with ValueError, so updates that race (an async actor does not order its calls) cannot
  leave the engine on older weights; the same version loads again. `rewind=True` loads an older
  version on purpose (evaluating a snapshot after the run).
- `meta`: `request_id`, `latency_s` (submission to result), and `token_versions` when mixed.
- `health()`: ok, weight_version, running, waiting, and counters (steps, prefills, generated_tokens,
  prefill_tokens, prefix_hits, prefix_hit_tokens, prefill_s, decode_s, errors, kv_capacity, kv_rebases).
- The engine owns its model: a trainer must train its own copy and push weights with `update_weights`.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from reflow.engine.base import EngineError, GenerateResult, SamplingParams
from reflow.engine.kv_cache import SlotKVCache
from reflow.engine.sampling import IncrementalDetokenizer
from reflow.engine.torch_worker import DecodeLoop, Request
from reflow.engine.weights import check_state_dict
from reflow.models.weights import load_state_dict


class TorchEngine:
    """The `Engine` protocol on a local torch model (CPU by default). See the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 32,
        device: str | torch.device | None = None,
        num_threads: int | None = None,
        max_prefill_tokens: int = 8192,
        eos_token_ids: list[int] | None = None,
        weight_version: int = 0,
        kv_headroom: int = 256,
        prefix_cache: bool = True,
    ) -> None:
        """`model`: an HF causal LM whose attention layers call `cache.update(k, v, layer_idx)` (Llama,
        Qwen2/3, Mistral and most decoder-only models); sliding-window layers are not supported.
        `tokenizer`: needed for stop strings and default EOS ids. `num_threads`: torch intra-op
        threads (a process-wide setting; left alone when None). `max_prefill_tokens`: padded-token
        budget of one batched prefill pass. `eos_token_ids`: ids that always stop (default: the
        tokenizer's EOS plus the model's generation-config EOS ids). `kv_headroom`: free KV columns
        added when the cache grows (fewer means less memory and more frequent copies). `prefix_cache`:
        reuse the keys/values of a finished request whose prompt + completion begin a new prompt (the
        next turn of an episode), instead of recomputing them; dropped on every weight update."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        config = model.config
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise NotImplementedError("TorchEngine does not support sliding-window attention layers")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device != next(model.parameters()).device:
            self.model = model.to(self.device)
        self.max_batch_size = max_batch_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else self._default_eos())
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        dtype = next(model.parameters()).dtype
        # transformers 5 calls the cache argument `cache`; 4.x calls it `past_key_values`.
        forward_args = inspect.signature(model.forward).parameters
        self._decoder = DecodeLoop(
            self.model,
            SlotKVCache(config.num_hidden_layers, max_batch_size, self.device, dtype, kv_headroom),
            device=self.device,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            prefix_cache=prefix_cache,
            pad_id=pad if pad is not None else 0,
            cache_kwarg="cache" if "cache" in forward_args else "past_key_values",
            version=weight_version,
        )
        self._newest = weight_version  # the newest version given to update_weights (applied or queued)
        self._started = time.time()
        self._started_monotonic = time.monotonic()
        self._thread = threading.Thread(target=self._decoder.run, name="reflow-torch-engine", daemon=True)
        self._thread.start()

    def _default_eos(self) -> list[int]:
        ids: set[int] = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return sorted(ids)

    # -- the Engine API (called from the event loop) ----------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._decoder.version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate one completion of `input_ids`. Raises ValueError on a bad request and EngineError
        when the engine is closed or a model step fails. Cancelling the awaiting task aborts it."""
        if self._decoder.closed or not self._thread.is_alive():
            raise EngineError("engine is closed")
        ids = [int(i) for i in input_ids]
        if not ids:
            raise ValueError("input_ids is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room in the {self.max_context}-token context"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        rid = request_id or uuid.uuid4().hex
        if rid in self._decoder.by_id:
            raise ValueError(f"request id {rid!r} is already in flight")
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        loop = asyncio.get_running_loop()
        req = Request(
            rid=rid,
            input_ids=ids,
            params=params,
            future=loop.create_future(),
            loop=loop,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=generator,
            detok=IncrementalDetokenizer(self._decode) if params.stop else None,
        )
        self._decoder.by_id[rid] = req
        self._decoder.post("generate", req)
        try:
            return await req.future
        except asyncio.CancelledError:
            self._decoder.post("abort", rid)
            raise

    async def abort(self, request_id: str) -> None:
        """Finish a request now with finish_reason "abort" and the tokens it has; unknown ids are ignored."""
        self._decoder.post("abort", request_id)

    async def release_cache(self) -> bool:
        """Hand the KV buffers' memory back if no request is running or waiting (else nothing; returns
        whether it did): they grow to the largest batch served (gigabytes with dozens of long
        sequences) and would keep that size while the engine waits, e.g. through a sync trainer's step
        on the same machine."""
        if self._decoder.closed or not self._thread.is_alive():
            return False
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        self._decoder.post("free", (done, loop))
        return await done

    async def update_weights(
        self,
        state_dict: dict[str, Any] | None = None,
        path: str | None = None,
        version: int | None = None,
        *,
        rewind: bool = False,
    ) -> int:
        """Load new weights (a state dict, or a checkpoint file / HF folder) between two decode steps;
        returns the new weight version (`version` if given, else the newest one plus 1). Keys the
        model lacks raise KeyError; keys left out keep their current values. A `version` older than
        the newest one given raises ValueError unless `rewind` (see the module docstring)."""
        if (state_dict is None) == (path is None):
            raise ValueError("pass exactly one of state_dict or path")
        if self._decoder.closed:
            raise EngineError("engine is closed")
        self._check_version(version, rewind)  # before reading a file for nothing
        if path is not None:
            state_dict = await asyncio.to_thread(load_state_dict, Path(path))
        assert state_dict is not None
        check_state_dict(self.model, state_dict)
        # Checked again and posted with no await in between: the inbox is applied in order, so the
        # versions the worker applies never go back.
        target = self._check_version(version, rewind)
        self._newest = target
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._decoder.post("update", (state_dict, target, done, loop))
        try:
            return await done
        except Exception:  # the copy failed (a cancelled caller leaves the update queued)
            if self._newest == target:  # nothing newer queued since: the engine stays where it is
                self._newest = self._decoder.version
            raise

    def _check_version(self, version: int | None, rewind: bool) -> int:
        if version is None:
            return self._newest + 1
        if version < self._newest and not rewind:
            raise ValueError(
                f"weight version {version} is older than the engine's newest ({self._newest}): refused "
                "(pass rewind=True to load older weights on purpose)"
            )
        return int(version)

    async def health(self) -> dict[str, Any]:
        return {
            "ok": self._thread.is_alive() and not self._decoder.closed,
            "engine": "torch",
            "weight_version": self._decoder.version,
            "max_batch_size": self.max_batch_size,
            "device": str(self.device),
            "uptime_s": time.time() - self._started,
            "last_error": self._decoder.last_error,
            **self._decoder.load(),
        }

    def counters(self) -> dict[str, float]:
        """The decode loop's cumulative work counters (`health()`'s: steps, tokens, prefill and decode
        seconds, ...), with `uptime_s` (monotonic seconds since it started) and `started_at` (the
        wall-clock second it started: which engine the counters belong to, across readings)."""
        counters = {k: float(v) for k, v in self._decoder.stats.items()}
        return {
            **counters,
            "uptime_s": time.monotonic() - self._started_monotonic,
            "started_at": self._started,
        }

    async def close(self) -> None:
        """Stop the worker; requests still in flight fail with EngineError("engine closed")."""
        if self._decoder.closed:
            return
        self._decoder.closed = True
        self._decoder.post("close", None)
        await asyncio.to_thread(self._thread.join)

    # -- the worker thread's helper ---------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
