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
the worker computes; results come back through `loop.call_soon_threadsafe`.

Semantics the rollout and trainer rely on:
- `output_ids` are every sampled token, the final EOS / stop id included, and also the tokens that
  completed a stop string (the text is not cut): token-in-token-out keeps what was sampled.
- `logprobs[i]` = log_softmax(logits / T)[output_ids[i]] (T = 0 counted as 1), before top-k/top-p.
- EOS ids (the tokenizer's and the generation config's) always stop, with `matched_stop` = that id.
- `update_weights` waits for the current step, swaps the weights, bumps the version, and running
  requests continue on the new weights, attending to keys/values computed under the old ones (as in
  SGLang's in-flight updates). A result's `weight_version` is the version of its last token; if it
  changed during the request, `meta["token_versions"]` gives the version of every output token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reflow.engine.base import EngineError, FinishReason, GenerateResult, SamplingParams
from reflow.engine.kv_cache import SlotKVCache
from reflow.engine.sampling import BatchParams, IncrementalDetokenizer, find_stop, sample
from reflow.engine.weights import check_state_dict, copy_weights, load_state_dict

log = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    submitted: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    row: int = -1


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
    ) -> None:
        """`model`: an HF causal LM whose attention layers call `cache.update(k, v, layer_idx)` (Llama,
        Qwen2/3, Mistral and most decoder-only models); sliding-window layers are not supported.
        `tokenizer`: needed for stop strings and default EOS ids. `num_threads`: torch intra-op
        threads (a process-wide setting; left alone when None). `max_prefill_tokens`: padded-token
        budget of one batched prefill pass. `eos_token_ids`: ids that always stop (default: the
        tokenizer's EOS plus the model's generation-config EOS ids). `kv_headroom`: free KV columns
        added when the cache grows (fewer means less memory and more frequent copies)."""
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
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else self._default_eos())
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self._pad_id = pad if pad is not None else 0
        dtype = next(model.parameters()).dtype
        self._cache = SlotKVCache(config.num_hidden_layers, max_batch_size, self.device, dtype, kv_headroom)
        self._version = weight_version
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # row -> request
        self._by_id: dict[str, _Request] = {}
        self._params: BatchParams | None = None  # of the rows in sorted order; None when stale
        self._closed = False
        self._started = time.time()
        self._stats: dict[str, float] = {
            "steps": 0,
            "prefills": 0,
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "prefill_s": 0.0,  # time in prefill passes (sampling included)
            "decode_s": 0.0,  # time in decode steps
            "errors": 0,
        }
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._worker, name="reflow-torch-engine", daemon=True)
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
        return self._version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate one completion of `input_ids`. Raises ValueError on a bad request and EngineError
        when the engine is closed or a model step fails. Cancelling the awaiting task aborts it."""
        if self._closed or not self._thread.is_alive():
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
        if rid in self._by_id:
            raise ValueError(f"request id {rid!r} is already in flight")
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        loop = asyncio.get_running_loop()
        req = _Request(
            rid=rid,
            input_ids=ids,
            params=params,
            future=loop.create_future(),
            loop=loop,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=generator,
            detok=IncrementalDetokenizer(self._decode) if params.stop else None,
        )
        self._by_id[rid] = req
        self._post("generate", req)
        try:
            return await req.future
        except asyncio.CancelledError:
            self._post("abort", rid)
            raise

    async def abort(self, request_id: str) -> None:
        """Finish a request now with finish_reason "abort" and the tokens it has; unknown ids are ignored."""
        self._post("abort", request_id)

    async def update_weights(
        self, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        """Load new weights (a state dict, or a checkpoint file / HF folder) between two decode steps;
        returns the new weight version (`version` if given, else the current one plus 1). Keys the
        model lacks raise KeyError; keys left out keep their current values."""
        if (state_dict is None) == (path is None):
            raise ValueError("pass exactly one of state_dict or path")
        if self._closed:
            raise EngineError("engine is closed")
        if path is not None:
            state_dict = await asyncio.to_thread(load_state_dict, Path(path))
        assert state_dict is not None
        check_state_dict(self.model, state_dict)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._post("update", (state_dict, version, done, asyncio.get_running_loop()))
        return await done

    async def health(self) -> dict[str, Any]:
        return {
            "ok": self._thread.is_alive() and not self._closed,
            "engine": "torch",
            "weight_version": self._version,
            "running": len(self._running),
            "waiting": len(self._waiting) + sum(1 for kind, _ in list(self._inbox) if kind == "generate"),
            "max_batch_size": self.max_batch_size,
            "device": str(self.device),
            "kv_capacity": self._cache.capacity,
            "kv_rebases": self._cache.rebases,
            "uptime_s": time.time() - self._started,
            "last_error": self._last_error,
            **self._stats,
        }

    async def close(self) -> None:
        """Stop the worker; requests still in flight fail with EngineError("engine closed")."""
        if self._closed:
            return
        self._closed = True
        self._post("close", None)
        await asyncio.to_thread(self._thread.join)

    # -- worker side ------------------------------------------------------------------------------------
    def _post(self, kind: str, item: Any) -> None:
        with self._wake:
            self._inbox.append((kind, item))
            self._wake.notify()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _worker(self) -> None:
        try:
            self._loop()
        finally:  # closed, or the loop itself died: nobody may wait forever
            self._closed = True
            err = EngineError("engine closed")
            for req in [*self._running.values(), *self._waiting]:
                self._fail(req, err)
            for kind, item in self._inbox:
                if kind == "generate":
                    self._fail(item, err)
                elif kind == "update":
                    _resolve(item[3], item[2], err)

    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                with self._wake:
                    while not self._inbox and not self._running and not self._waiting:
                        self._wake.wait()
                    inbox = list(self._inbox)
                    self._inbox.clear()
                if not self._handle(inbox):
                    break
                try:
                    if self._waiting and len(self._running) < self.max_batch_size:
                        self._admit()
                    if self._running:
                        self._step()
                except Exception as e:  # a failed step fails its requests, never the whole engine
                    log.exception("TorchEngine step failed")
                    self._stats["errors"] += 1
                    self._last_error = repr(e)
                    for req in list(self._running.values()):
                        self._fail(req, EngineError(f"engine step failed: {e!r}"))
                    self._cache.reset()
                    self._params = None

    def _handle(self, inbox: list[tuple[str, Any]]) -> bool:
        """Apply control messages; False when the engine must stop."""
        for kind, item in inbox:
            if kind == "generate":
                self._waiting.append(item)
            elif kind == "abort":
                req = self._by_id.get(item)
                if req is not None and not req.future.done():
                    if req in self._waiting:
                        self._waiting.remove(req)
                    self._finish(req, "abort", None)
            elif kind == "update":
                state_dict, version, done, loop = item
                try:
                    copy_weights(self.model, state_dict)
                    self._version = self._version + 1 if version is None else int(version)
                    _resolve(loop, done, self._version)
                except Exception as e:
                    _resolve(loop, done, e)
            elif kind == "close":
                return False
        return True

    def _admit(self) -> None:
        """Prefill as many waiting prompts as there are free rows (within the prefill token budget)."""
        started = time.perf_counter()
        free = self._cache.free_rows()
        batch: list[_Request] = []
        width = 0
        while self._waiting and len(batch) < len(free):
            n = len(self._waiting[0].input_ids)
            if batch and (len(batch) + 1) * max(width, n) > self.max_prefill_tokens:
                break
            batch.append(self._waiting.popleft())
            width = max(width, n)
        rows = free[: len(batch)]
        for req, row in zip(batch, rows, strict=True):  # first, so that a failure below fails them
            req.row = row
            self._running[row] = req
        self._params = None
        lengths = [len(r.input_ids) for r in batch]
        self._cache.ensure_room(left=width, right=1)
        mask = self._cache.begin_prefill(rows, lengths)
        ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        for i, req in enumerate(batch):
            ids[i, width - lengths[i] :] = torch.tensor(req.input_ids)
        pads = torch.tensor([width - n for n in lengths])[:, None]
        positions = (torch.arange(width)[None] - pads).clamp(min=0)
        logits = self._forward(ids, positions, mask)
        tokens, logprobs = sample(logits, self._build_params(batch))
        self._stats["prefills"] += 1
        self._stats["prefill_tokens"] += sum(lengths)
        self._stats["prefill_s"] += time.perf_counter() - started
        for req, tok, lp in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            self._accept(req, tok, lp)

    def _step(self) -> None:
        """One decode step for every running sequence."""
        started = time.perf_counter()
        cache = self._cache
        cache.ensure_room(right=1)
        n = cache.n_rows
        last = [self._pad_id] * n
        positions = [0] * n
        for row, req in self._running.items():
            last[row] = req.output_ids[-1]
            positions[row] = cache.length(row)
        mask = cache.begin_decode()
        logits = self._forward(torch.tensor(last)[:, None], torch.tensor(positions)[:, None], mask)
        cache.end_decode()
        rows = sorted(self._running)
        if len(rows) != n:  # free rows in the middle were stepped too: drop their logits
            logits = logits[torch.tensor(rows)]
        if self._params is None:
            self._params = self._build_params([self._running[r] for r in rows])
        tokens, logprobs = sample(logits, self._params)
        self._stats["steps"] += 1
        self._stats["decode_s"] += time.perf_counter() - started
        for row, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            self._accept(self._running[row], tok, lp)
        if not self._waiting and len(self._running) < cache.n_rows:
            self._compact()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _build_params(self, reqs: list[_Request]) -> BatchParams:
        return BatchParams.build(
            [r.params.temperature for r in reqs],
            [r.params.top_p for r in reqs],
            [r.params.top_k for r in reqs],
            [r.generator for r in reqs],
            self.vocab_size,
            self.device,
        )

    def _compact(self) -> None:
        """Move the highest live rows into lower free ones, so decode steps skip no rows."""
        free = [r for r in self._cache.free_rows() if r < self._cache.n_rows]
        for dst in free:
            src = self._cache.n_rows - 1
            if src <= dst:
                break
            self._cache.move_row(src, dst)
            req = self._running.pop(src)
            req.row = dst
            self._running[dst] = req
        self._params = None

    def _accept(self, req: _Request, token: int, logprob: float) -> None:
        """Record one sampled token and finish the request if it hit a stop condition."""
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self._version)
        self._stats["generated_tokens"] += 1
        if token in req.stop_ids:
            self._finish(req, "stop", token)
            return
        if req.detok is not None:
            delta = req.detok.push(req.output_ids)
            matched = find_stop(req.detok.text, delta, req.params.stop)
            if matched is not None:
                self._finish(req, "stop", matched)
                return
        n = len(req.output_ids)
        if n >= req.params.max_new_tokens or len(req.input_ids) + n >= self.max_context:
            self._finish(req, "length", None)

    def _finish(self, req: _Request, reason: FinishReason, matched: str | int | None) -> None:
        self._release(req)
        meta: dict[str, Any] = {"request_id": req.rid, "latency_s": time.perf_counter() - req.submitted}
        if req.versions and req.versions[0] != req.versions[-1]:
            meta["token_versions"] = list(req.versions)
        result = GenerateResult(
            output_ids=req.output_ids,
            logprobs=req.logprobs,
            finish_reason=reason,
            weight_version=req.versions[-1] if req.versions else self._version,
            prompt_tokens=len(req.input_ids),
            matched_stop=matched,
            meta=meta,
        )
        _resolve(req.loop, req.future, result)

    def _fail(self, req: _Request, error: Exception) -> None:
        self._release(req)
        _resolve(req.loop, req.future, error)

    def _release(self, req: _Request) -> None:
        self._by_id.pop(req.rid, None)
        if req.row >= 0 and self._running.get(req.row) is req:
            del self._running[req.row]
            self._cache.release(req.row)
            self._params = None
        req.row = -1


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Complete `future` from the worker thread (a value, or an exception to raise)."""

    def apply() -> None:
        if future.done():  # cancelled by the caller meanwhile
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(apply)
