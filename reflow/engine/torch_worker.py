"""The worker-thread half of TorchEngine: `DecodeLoop`, the loop that admits, prefills, decodes and
finishes requests, and the state only it touches.

`TorchEngine` (torch_engine.py) is the asyncio-facing half: it validates requests, posts them to the
loop's inbox (`DecodeLoop.post`) and awaits their futures. The `DecodeLoop` it holds runs in the
engine's dedicated thread (`run`) and is the only code that touches the model and the KV cache. One
loop iteration: apply control messages (new requests, aborts, weight updates) -> prefill waiting
requests into free rows -> one decode step for all running rows -> finish what stopped -> compact the
rows if nothing waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from reflow.engine.base import EngineError, FinishReason, GenerateResult, SamplingParams
from reflow.engine.kv_cache import SlotKVCache
from reflow.engine.sampling import BatchParams, IncrementalDetokenizer, find_stop, sample
from reflow.engine.weights import copy_weights

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity semantics: queues find and remove this very request
class Request:
    """One generate call, from submission to result (owned by the worker once posted)."""

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


class DecodeLoop:
    """The engine's worker loop and everything it owns: the model, the KV cache, the request queues
    and the counters. Other threads may only `post` messages, register a request id (`by_id`) and
    read `version`, `closed`, `last_error` and `load()`."""

    def __init__(
        self,
        model: Any,
        cache: SlotKVCache,
        *,
        device: torch.device,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_context: int,
        vocab_size: int,
        prefix_cache: bool,
        pad_id: int,
        cache_kwarg: str,
        version: int,
    ) -> None:
        self.model = model
        self._cache = cache
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.prefix_cache = prefix_cache
        self._pad_id = pad_id
        self._cache_kwarg = cache_kwarg
        self.version = version
        """The weights' version: every token sampled from now on is tagged with it."""
        self.closed = False
        self.last_error: str | None = None
        self.by_id: dict[str, Request] = {}
        """Requests in flight by id: the engine registers one before posting it, the loop drops it when
        it finishes."""
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # row -> request
        self._params: BatchParams | None = None  # of the rows in sorted order; None when stale
        self.stats: dict[str, float] = {
            "steps": 0,
            "prefills": 0,
            "generated_tokens": 0,
            "decode_tokens": 0,  # tokens of decode steps (a prefill's first tokens not counted)
            "prefill_tokens": 0,  # prompt tokens computed (reused prefixes not counted)
            "prefix_hits": 0,
            "prefix_hit_tokens": 0,  # prompt tokens whose keys/values were copied, not computed
            "prefill_s": 0.0,  # time in prefill passes (sampling included)
            "decode_s": 0.0,  # time in decode steps
            "errors": 0,
        }

    def post(self, kind: str, item: Any) -> None:
        """A control message for the loop ("generate", "abort", "update", "free", "close"), applied in
        order."""
        with self._wake:
            self._inbox.append((kind, item))
            self._wake.notify()

    def load(self) -> dict[str, Any]:
        """What the loop holds now (read from another thread: a consistent-enough snapshot)."""
        return {
            "running": len(self._running),
            "waiting": len(self._waiting) + sum(1 for kind, _ in list(self._inbox) if kind == "generate"),
            "kv_capacity": self._cache.capacity,
            "kv_rebases": self._cache.rebases,
            **self.stats,
        }

    def run(self) -> None:
        """The thread's target: loop until "close" (or the loop dies), then fail whatever is left."""
        try:
            self._loop()
        finally:  # closed, or the loop itself died: nobody may wait forever
            self.closed = True
            err = EngineError("engine closed")
            for req in [*self._running.values(), *self._waiting]:
                self._fail(req, err)
            for kind, item in self._inbox:
                if kind == "generate":
                    self._fail(item, err)
                elif kind == "update":
                    resolve(item[3], item[2], err)
                elif kind == "free":
                    resolve(item[1], item[0], False)

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
                    self.stats["errors"] += 1
                    self.last_error = repr(e)
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
                req = self.by_id.get(item)
                if req is not None and not req.future.done():
                    if req in self._waiting:
                        self._waiting.remove(req)
                    self._finish(req, "abort", None)
            elif kind == "update":
                state_dict, version, done, loop = item
                try:
                    copy_weights(self.model, state_dict)
                    self._cache.drop_parked()  # their keys/values belong to the old weights
                    self.version = self.version + 1 if version is None else int(version)
                    resolve(loop, done, self.version)
                except Exception as e:
                    resolve(loop, done, e)
            elif kind == "free":  # only with nothing to run: posted after a generate, it waits its turn
                done, loop = item
                freed = not self._running and not self._waiting
                try:
                    if freed:
                        self._cache.free()
                        if self.device.type == "cuda":  # else the rollout process's allocator keeps it
                            torch.cuda.empty_cache()
                except Exception:  # a cache that cannot be freed stays as it is; the engine runs on
                    log.exception("TorchEngine could not free its KV cache")
                    freed = False
                resolve(loop, done, freed)
            elif kind == "close":
                return False
        return True

    def _admit(self) -> None:
        """Prefill as many waiting prompts as there are free rows (within the prefill token budget)."""
        started = time.perf_counter()
        cache = self._cache
        n_free = len(cache.free_rows())
        batch: list[Request] = []
        width = 0
        while self._waiting and len(batch) < n_free:
            n = len(self._waiting[0].input_ids)
            if batch and (len(batch) + 1) * max(width, n) > self.max_prefill_tokens:
                break
            batch.append(self._waiting.popleft())
            width = max(width, n)
        try:
            cache.ensure_room(left=width, right=1)
        except Exception as e:
            for req in batch:
                self._fail(req, EngineError(f"engine step failed: {e!r}"))
            raise
        # Match prefixes after making room: a rebase may have dropped old parked rows.
        reuse = [cache.find_prefix(r.input_ids) if self.prefix_cache else (-1, 0) for r in batch]
        free, taken, rows = cache.free_rows(), set(), []
        for src, p in reuse:
            # A continuation takes over its source row; the others take idle rows, then parked ones.
            row = src if p and src not in taken else next(r for r in free if r not in taken)
            taken.add(row)
            rows.append(row)
        for req, row in zip(batch, rows, strict=True):
            req.row = row
            self._running[row] = req
        self._params = None
        # Identical prompts (a GRPO group's first turn) are computed once and copied to the others.
        first: dict[tuple[int, ...], int] = {}
        leader = [first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(batch)]
        lead = [i for i in range(len(batch)) if leader[i] == i]
        lengths = [len(batch[i].input_ids) for i in lead]
        todo = [n - reuse[i][1] for n, i in zip(lengths, lead, strict=True)]
        mask = cache.begin_prefill([rows[i] for i in lead], lengths, [reuse[i] for i in lead])
        suffix = max(todo)
        ids = torch.full((len(lead), suffix), self._pad_id, dtype=torch.long)
        positions = torch.zeros((len(lead), suffix), dtype=torch.long)
        for j, i in enumerate(lead):
            p = reuse[i][1]
            ids[j, suffix - todo[j] :] = torch.tensor(batch[i].input_ids[p:])
            positions[j, suffix - todo[j] :] = torch.arange(p, lengths[j])
        logits = self._forward(ids, positions, mask)
        copies = [i for i in range(len(batch)) if leader[i] != i]
        for i in copies:
            cache.clone_block(rows[leader[i]], rows[i], len(batch[i].input_ids))
        if copies:
            logits = logits[torch.tensor([lead.index(leader[i]) for i in range(len(batch))])]
        tokens, logprobs = sample(logits, self._build_params(batch))
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(todo)
        self.stats["prefix_hits"] += sum(1 for _, p in reuse if p) + len(copies)
        self.stats["prefix_hit_tokens"] += sum(reuse[i][1] for i in lead) + sum(
            len(batch[i].input_ids) for i in copies
        )
        self.stats["prefill_s"] += time.perf_counter() - started
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
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self.stats["decode_s"] += time.perf_counter() - started
        for row, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            self._accept(self._running[row], tok, lp)
        if not self._waiting and len(self._running) < cache.n_rows:
            self._compact()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,  # 4D: HF models use it as given
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: self._cache},
        )
        return out.logits[:, -1]

    def _build_params(self, reqs: list[Request]) -> BatchParams:
        return BatchParams.build(
            [r.params.temperature for r in reqs],
            [r.params.top_p for r in reqs],
            [r.params.top_k for r in reqs],
            [r.generator for r in reqs],
            self.vocab_size,
            self.device,
        )

    def _compact(self) -> None:
        """Move the highest live rows into the holes below them, so decode steps skip no rows. A parked
        hole is swapped rather than overwritten: its keys/values move above the live rows."""
        cache = self._cache
        holes = [r for r in range(cache.n_rows) if r not in cache.live]
        for dst in holes:
            src = cache.n_rows - 1
            if src <= dst:
                break
            if dst in cache.parked:
                cache.swap_rows(src, dst)
            else:
                cache.move_row(src, dst)
            req = self._running.pop(src)
            req.row = dst
            self._running[dst] = req
        self._params = None

    def _accept(self, req: Request, token: int, logprob: float) -> None:
        """Record one sampled token and finish the request if it hit a stop condition."""
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version)
        self.stats["generated_tokens"] += 1
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

    def _finish(self, req: Request, reason: FinishReason, matched: str | int | None) -> None:
        self._release(req, park=True)
        meta: dict[str, Any] = {"request_id": req.rid, "latency_s": time.perf_counter() - req.submitted}
        if req.versions and req.versions[0] != req.versions[-1]:
            meta["token_versions"] = list(req.versions)
        result = GenerateResult(
            output_ids=req.output_ids,
            logprobs=req.logprobs,
            finish_reason=reason,
            weight_version=req.versions[-1] if req.versions else self.version,
            prompt_tokens=len(req.input_ids),
            matched_stop=matched,
            meta=meta,
        )
        resolve(req.loop, req.future, result)

    def _fail(self, req: Request, error: Exception) -> None:
        self._release(req)
        resolve(req.loop, req.future, error)

    def _release(self, req: Request, park: bool = False) -> None:
        """Free the request's row; with `park`, keep its keys/values for a continuation (only when all of
        them come from the current weights)."""
        self.by_id.pop(req.rid, None)
        if req.row >= 0 and self._running.get(req.row) is req:
            del self._running[req.row]
            fresh = park and self.prefix_cache and req.versions and req.versions[0] == self.version
            self._cache.release(req.row, req.input_ids + req.output_ids[:-1] if fresh else None)
            self._params = None
        req.row = -1


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
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
