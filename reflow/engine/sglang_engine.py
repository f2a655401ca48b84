"""`SGLangEngine`: the Engine interface over SGLang servers' native HTTP API.

It launches `python -m sglang.launch_server` or attaches to running servers, and speaks the native
routes: `/generate` with `input_ids` (token-in-token-out, `return_logprob`), `/update_weights_from_disk`,
`/update_weights_from_tensor`, `/load_lora_adapter`, `/unload_lora_adapter`, `/pause_generation`,
`/continue_generation`, `/abort_request`, `/flush_cache`, `/health`. Requests go to the server with the
fewest requests in flight.

LoRA (`model.lora`): the servers keep the base model and each policy arrives as an adapter folder,
loaded under a new name (`/load_lora_adapter`) that every request then names (`lora_path`).

Per-token versions: a weight update aborts the requests in flight on the servers
(`abort_all_requests`), and `generate` resubmits each one with its exact token prefix (prompt + what
it sampled so far) once the update is in, as a partial rollout; the tokens before the update carry the
old version and the rest the new one (`meta["token_versions"]`, as `TorchEngine` reports them), so the
loss weighs every token against the policy that sampled it. The resubmission re-prefills the prefix
(`meta["reprefill_tokens"]`); a stop string that would straddle the split is not matched.

SGLang needs a GPU, so this module never imports sglang at module level; the request bodies
(`reflow.engine.sglang_requests`) are checked against sglang's own request classes in `tests/sglang/`,
and `scripts/sglang_e2e.py` exercises a real server on a GPU machine. Logprobs: SGLang returns log_softmax(logits / temperature) for sampled
requests (greedy: unscaled), which is the `GenerateResult` contract.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from reflow.engine.base import EngineError, GenerateResult, SamplingParams
from reflow.engine.sglang_requests import (
    abort_payload,
    generate_payload,
    load_lora_payload,
    parse_generate_response,
    pause_payload,
    unload_lora_payload,
    update_from_disk_payload,
    update_from_tensor_payload,
)
from reflow.models.adapters import is_adapter_folder

KEEP_ADAPTERS = 2
"""LoRA adapters an engine keeps loaded: the current one and the one before it, and any older one
that a request still names (`SGLangEngine._adapter_users`)."""


def _raise_failed(results: list[Any], what: str) -> None:
    """EngineError when a server answered an update with success false."""
    failed = [r for r in results if isinstance(r, dict) and r.get("success") is False]
    if failed:
        message = failed[0].get("message") or failed[0].get("error_message")
        raise EngineError(f"SGLang {what} failed: {message}")


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    process: subprocess.Popen | None = None
    rids: set[str] = field(default_factory=set)


class SGLangEngine:
    """One or more SGLang servers behind the Engine interface."""

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        version: int = 0,
    ) -> None:
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)
        self._version = version
        self._updating = asyncio.Lock()  # one weight update at a time, so versions never go back
        # Moves once the servers have answered an update, so after they aborted what was in flight: a
        # request aborted while it moved (waiting out an update under way) was aborted by an update.
        self._updates_done = 0
        self._user_aborted: set[str] = set()
        self._parts: dict[str, str] = {}  # request id -> the server rid of its current part
        self._adapter: tuple[str, int] | None = None  # LoRA: the adapter requests name, its version
        self._adapters: list[str] = []  # the adapters loaded on the servers, oldest first
        # LoRA: the parts that name each adapter, from when they read its name until their answer. A
        # part may wait for a connection while updates come and go; unloading the adapter it names
        # would get it refused (HTTP 400), so an adapter in use is unloaded at a later update.
        self._adapter_users: dict[str, int] = {}

    @classmethod
    def launch(
        cls,
        model_path: str,
        *,
        ports: list[int],
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        wait_s: float = 900.0,
    ) -> SGLangEngine:
        """Start one server per port (`python -m sglang.launch_server`) and wait until each is healthy."""
        procs = []
        for port in ports:
            cmd = [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                model_path,
                "--host",
                host,
                "--port",
                str(port),
                *(extra_args or []),
            ]
            procs.append(subprocess.Popen(cmd, env=os.environ.copy()))
        engine = cls([f"http://{host}:{p}" for p in ports])
        for server, proc in zip(engine.servers, procs, strict=True):
            server.process = proc
        deadline = time.monotonic() + wait_s
        for server in engine.servers:
            while True:
                if server.process and server.process.poll() is not None:
                    raise EngineError(f"SGLang server {server.url} exited with {server.process.returncode}")
                try:
                    if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"SGLang server {server.url} not healthy after {wait_s}s")
                time.sleep(2)
        return engine

    @property
    def weight_version(self) -> int:
        return self._version

    async def _post(self, server: _Server, route: str, payload: dict[str, Any]) -> Any:
        try:
            response = await self.client.post(f"{server.url}{route}", json=payload)
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang {server.url}{route}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise EngineError(
                f"SGLang {server.url}{route}: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json() if response.content else {}

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """One completion; split into parts where a weight update aborted it (see the module
        docstring), each part resubmitted with the exact prefix so far."""
        rid = request_id or uuid.uuid4().hex
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reprefill = 0
        part: GenerateResult | None = None
        try:
            while True:
                remaining = params.max_new_tokens - len(out_ids)
                updates_before, version_before, adapter = self._updates_done, self._version, self._adapter
                part_rid = rid if part is None else f"{rid}.{len(out_ids)}"  # unique per part
                self._parts[rid] = part_rid
                name = adapter[0] if adapter else None
                if name is not None:  # counted before any await: no update can unload it from here on
                    self._adapter_users[name] = self._adapter_users.get(name, 0) + 1
                try:
                    body = await self._generate_part(
                        [*input_ids, *out_ids], replace(params, max_new_tokens=remaining), part_rid, name
                    )
                finally:
                    if name is not None:
                        self._adapter_users[name] -= 1
                part = parse_generate_response(body, version_before)
                if adapter is not None:  # the servers' own version is the base's: the adapter's counts
                    part = replace(part, weight_version=adapter[1])
                out_ids += part.output_ids
                logprobs += part.logprobs
                versions += [part.weight_version] * len(part.output_ids)
                split = part.finish_reason == "abort" and rid not in self._user_aborted
                if split:
                    # The servers abort before they load: the update that cut this part may still be
                    # under way. Once it is in, the count says whether one came since the part was sent.
                    async with self._updating:
                        split = self._updates_done != updates_before
                if not split or len(out_ids) >= params.max_new_tokens:
                    break
                reprefill += len(input_ids) + len(out_ids)
        finally:
            self._parts.pop(rid, None)
            self._user_aborted.discard(rid)
        finish = part.finish_reason
        if finish == "abort" and split:  # cut by an update at the very end of its token budget
            finish = "length"
        meta = dict(part.meta)
        if versions and versions[0] != versions[-1]:
            meta["token_versions"] = versions
        if reprefill:
            meta["reprefill_tokens"] = reprefill
        return GenerateResult(
            output_ids=out_ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=versions[-1] if versions else part.weight_version,
            prompt_tokens=len(input_ids),
            matched_stop=part.matched_stop,
            meta=meta,
        )

    async def _generate_part(
        self, input_ids: list[int], params: SamplingParams, rid: str, adapter: str | None
    ) -> Any:
        server = min(self.servers, key=lambda s: s.in_flight)
        server.in_flight += 1
        server.rids.add(rid)
        try:
            return await self._post(server, "/generate", generate_payload(input_ids, params, rid, adapter))
        finally:
            server.in_flight -= 1
            server.rids.discard(rid)

    async def abort(self, request_id: str) -> None:
        self._user_aborted.add(request_id)
        rid = self._parts.get(request_id, request_id)
        for server in self.servers:
            if rid in server.rids:
                await self._post(server, "/abort_request", abort_payload(rid))

    async def _all(self, route: str, payload: dict[str, Any]) -> list[Any]:
        return list(await asyncio.gather(*(self._post(s, route, payload) for s in self.servers)))

    async def update_weights(
        self,
        state_dict: dict[str, Any] | None = None,
        path: str | None = None,
        version: int | None = None,
        *,
        rewind: bool = False,
    ) -> int:
        """From a checkpoint folder every server can read, or from tensors (same host: CUDA IPC handles).
        A folder of LoRA adapters (`reflow.models.adapters`) is loaded as an adapter instead
        (`_load_adapter`), on servers launched for them (`lora_launch_args`). Updates run one at a
        time; a `version` older than the engine's raises ValueError unless `rewind` (loading older
        weights on purpose), as `TorchEngine.update_weights` does."""
        if (state_dict is None) == (path is None):
            raise ValueError("update_weights needs exactly one of a state_dict or a path")
        async with self._updating:
            new_version = self._version + 1 if version is None else int(version)
            if new_version < self._version and not rewind:
                raise ValueError(
                    f"weight version {new_version} is older than the engine's ({self._version}): refused "
                    "(pass rewind=True to load older weights on purpose)"
                )
            if path is not None and is_adapter_folder(path):
                await self._load_adapter(path, new_version)
                return new_version
            try:
                if path is not None:
                    results = await self._all(
                        "/update_weights_from_disk", update_from_disk_payload(path, new_version)
                    )
                else:
                    from sglang.srt.utils import MultiprocessingSerializer  # only where sglang is installed

                    serialized = MultiprocessingSerializer.serialize(
                        list(state_dict.items()), output_str=True
                    )
                    results = await self._all(
                        "/update_weights_from_tensor", update_from_tensor_payload([serialized], new_version)
                    )
            finally:
                # Counted only now that the servers have aborted their requests, and even when the
                # update failed (they may have aborted them anyway): every request aborted in between
                # sees the count move and is resubmitted, on whatever weights the servers then hold.
                self._updates_done += 1
            _raise_failed(results, "weight update")
            self._version = new_version
            return new_version

    async def _load_adapter(self, path: str, version: int) -> None:
        """LoRA: load the adapters at `path` on every server under a new name, switch new requests to
        it, then abort the requests in flight, which `generate` resubmits with it (as after a weight
        update: each token keeps the version of the adapter that sampled it). The adapter before
        stays loaded (a part sent just before the switch may still name it); older ones are unloaded once
        no part names them (`_adapter_users`)."""
        name = f"reflow-{uuid.uuid4().hex[:12]}-v{version}"  # unique: servers may be shared, versions rewound
        _raise_failed(await self._all("/load_lora_adapter", load_lora_payload(name, path)), "LoRA load")
        self._adapters.append(name)
        self._adapter, self._version = (name, version), version
        try:
            await self._all("/abort_request", abort_payload(None))
        finally:
            self._updates_done += 1  # as for a weight update: aborted parts see it and resubmit
        stale = self._adapters[:-KEEP_ADAPTERS]
        for old in [n for n in stale if not self._adapter_users.get(n)]:
            await self._all("/unload_lora_adapter", unload_lora_payload(old))
            self._adapters.remove(old)
            self._adapter_users.pop(old, None)

    async def pause(self, mode: str = "abort") -> None:
        await self._all("/pause_generation", pause_payload(mode))

    async def resume(self) -> None:
        await self._all("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("/flush_cache", {})

    async def health(self) -> dict[str, Any]:
        status = {}
        for server in self.servers:
            try:
                status[server.url] = (await self.client.get(f"{server.url}/health")).status_code == 200
            except httpx.HTTPError:
                status[server.url] = False
        return {"ok": all(status.values()), "servers": status, "weight_version": self._version}

    async def close(self) -> None:
        await self.client.aclose()
        for server in self.servers:
            if server.process and server.process.poll() is None:
                server.process.terminate()
                try:
                    server.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.process.kill()
