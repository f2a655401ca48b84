"""Weight sync ordering: engines never go back a version (TorchEngine and SGLangEngine),
the loop's push tracker keeps one push per engine in flight, in order, coalescing to the newest
version, and surfaces a failed push; admission counts from the versions the engines confirmed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

torch = pytest.importorskip("torch")

from engine_helpers import build_tiny_engine_model, greedy, prompt  # noqa: E402

from reflow.engine.sglang_engine import SGLangEngine  # noqa: E402
from reflow.engine.torch_engine import TorchEngine  # noqa: E402
from reflow.recipes.weight_sync import EngineVersions  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_engine_model(tmp_path_factory.mktemp("tiny"))


def _shifted(model, by: float) -> dict:
    return {k: v + by for k, v in model.state_dict().items()}


# ---- engines refuse an older version


async def test_torch_engine_given_version_3_then_2_keeps_3(tiny):
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=2)
    v3 = _shifted(model, 0.0)
    try:
        assert await eng.update_weights(state_dict=v3, version=3) == 3
        with pytest.raises(ValueError, match="older"):
            await eng.update_weights(state_dict=_shifted(model, 0.5), version=2)
        assert eng.weight_version == 3
        assert (await eng.generate(prompt(4, 0), greedy(2))).weight_version == 3
        assert await eng.update_weights(state_dict=v3, version=3) == 3  # the same version loads again
        # Racing updates (an async actor does not order its calls): the older one is refused even
        # though the newer one is still queued, not yet applied.
        results = await asyncio.gather(
            eng.update_weights(state_dict=v3, version=5),
            eng.update_weights(state_dict=v3, version=4),
            return_exceptions=True,
        )
        assert results[0] == 5 and isinstance(results[1], ValueError)
        assert eng.weight_version == 5 and await eng.update_weights(state_dict=v3) == 6
        # evaluating a snapshot after the run loads older weights on purpose
        assert await eng.update_weights(state_dict=v3, version=2, rewind=True) == 2
    finally:
        await eng.close()


def _sglang_transport(loaded: list[str]) -> httpx.MockTransport:
    """Answers the weight-update route as an SGLang server does, recording the versions loaded."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        assert request.url.path == "/update_weights_from_disk"
        loaded.append(body["weight_version"])
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})

    return httpx.MockTransport(handler)


async def test_sglang_engine_given_version_3_then_2_keeps_3_and_orders_racing_updates():
    loaded: list[str] = []
    engine = SGLangEngine(["http://gpu-a:30000"], transport=_sglang_transport(loaded))
    try:
        assert await engine.update_weights(path="/w/v3", version=3) == 3
        with pytest.raises(ValueError, match="older"):
            await engine.update_weights(path="/w/v2", version=2)
        assert engine.weight_version == 3 and loaded == ["3"]  # the servers were never asked
        results = await asyncio.gather(
            engine.update_weights(path="/w/v5", version=5),
            engine.update_weights(path="/w/v4", version=4),
            return_exceptions=True,
        )
        assert results[0] == 5 and isinstance(results[1], ValueError)
        assert loaded == ["3", "5"] and engine.weight_version == 5
        assert await engine.update_weights(path="/w/v2", version=2, rewind=True) == 2
    finally:
        await engine.close()


def _lora_transport(loaded: set[str], arrive: asyncio.Event) -> httpx.MockTransport:
    """An SGLang server under LoRA: loads and unloads adapters by name; a `/generate` reaches it only
    once `arrive` is set (a request still on its way, behind a busy connection pool), and one naming an
    adapter no longer loaded is refused as SGLang refuses it (HTTP 400)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        if path == "/load_lora_adapter":
            loaded.add(body["lora_name"])
        elif path == "/unload_lora_adapter":
            loaded.remove(body["lora_name"])
        elif path == "/generate":
            await arrive.wait()
            if body["lora_path"] not in loaded:
                return httpx.Response(400, json={"error": f"LoRA adapter {body['lora_path']} not loaded"})
            n = body["sampling_params"]["max_new_tokens"]
            meta = {
                "finish_reason": {"type": "length"},
                "weight_version": "default",
                "output_token_logprobs": [[-0.5, 7, None]] * n,
            }
            return httpx.Response(200, json={"output_ids": [7] * n, "meta_info": meta})
        return httpx.Response(200, json={"success": True})

    return httpx.MockTransport(handler)


async def test_sglang_engine_never_unloads_an_adapter_a_request_on_its_way_names(tmp_path):
    from reflow.engine import SamplingParams
    from reflow.models.adapters import ADAPTER_CONFIG

    (tmp_path / ADAPTER_CONFIG).write_text("{}")  # an adapter folder, as far as the engine looks
    loaded: set[str] = set()
    arrive = asyncio.Event()
    engine = SGLangEngine(["http://gpu-a:30000"], transport=_lora_transport(loaded, arrive))
    try:
        await engine.update_weights(path=str(tmp_path), version=1)
        request = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=3)))
        for _ in range(5):
            await asyncio.sleep(0)  # the request has named adapter v1 and is on its way
        for version in (2, 3):  # two updates before it arrives: v1 would be the one unloaded
            await engine.update_weights(path=str(tmp_path), version=version)
        arrive.set()
        result = await request
        assert result.weight_version == 1 and result.output_ids == [7, 7, 7]  # sampled by v1, tagged v1
        await engine.update_weights(path=str(tmp_path), version=4)  # v1 unused now: unloaded
        assert sorted(name[-2:] for name in loaded) == ["v3", "v4"]
    finally:
        await engine.close()


# ---- the loop's push tracker (pure bookkeeping)


def test_one_push_per_engine_in_flight_in_order_and_coalesced_to_the_newest():
    v = EngineVersions(2, version=0)
    assert v.publish(1) == [0, 1] and v.pushing == [1, 1]
    assert v.publish(2) == [] and v.publish(3) == []  # both busy: nothing starts (back-pressure)
    assert v.confirm(1, 1) == 3  # engine 1 skips version 2: the newest is ready
    assert v.confirmed == [0, 1] and v.min_confirmed == 0  # engine 0 has not confirmed anything yet
    assert v.confirm(0, 1) == 3
    assert v.confirm(0, 3) is None and v.confirm(1, 3) is None
    assert v.min_confirmed == 3 and v.in_flight == 0
    assert v.publish(4) == [0, 1]
    with pytest.raises(ValueError, match="confirmed version 3"):
        v.confirm(0, 3)  # a confirmation that does not match the push in flight
    with pytest.raises(ValueError, match="must grow"):
        v.publish(4)


def test_an_engine_leaving_or_joining_keeps_every_other_engines_versions_in_place():
    v = EngineVersions(3, version=2)
    assert v.publish(3) == [0, 1, 2]
    assert v.confirm(2, 3) is None
    v.remove(1)  # its slot moved to training while its push was in flight: the push is forgotten
    assert v.confirmed == [2, 3] and v.pushing == [3, None] and v.in_flight == 1
    assert v.add(1, 3) is None  # joins with the trainer's weights at the change: nothing due
    assert v.confirmed == [2, 3, 3] and v.pushing == [3, None, None] and v.min_confirmed == 2
    assert v.confirm(0, 3) is None and v.min_confirmed == 3
    assert v.publish(4) == [0, 1, 2]
    assert v.add(0, 3) == 4  # loaded version 3, but 4 was published since: 4 is due at once
    assert v.confirmed == [3, 3, 3, 3] and v.pushing == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="newer than the newest"):
        v.add(0, 5)
    with pytest.raises(ValueError, match="position 9"):
        v.add(9, 4)
    one = EngineVersions(1, version=0)
    with pytest.raises(ValueError, match="each run keeps one"):
        one.remove(0)


# ---- through real Ray actors: rollout workers and a trainer rank on a tiny model


@pytest.fixture
def ray_cluster(tmp_path, monkeypatch):
    import ray

    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.cluster import Cluster
    from reflow.runtime.trainer_rank import TrainerRank
    from reflow.runtime.workers import RolloutWorker

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    config = load_config(
        None,
        ["env.id=reflow/Calc-v0", f"out_dir={tmp_path}", "resources.threads_per_slot=1", "train.bf16=false"],
    )
    ray.init(address="local", num_cpus=3, include_dashboard=False)  # never a cluster someone else started
    try:
        rollout = [ray.remote(RolloutWorker).remote(config, model_dir, None, i) for i in range(2)]
        trainer = ray.remote(TrainerRank).remote(config, model_dir, None)
        ray.get(trainer.setup.remote())

        class FakeCluster:  # what WeightPusher needs of a Cluster
            state_dict_ref = Cluster.state_dict_ref
            engines = Cluster.engines

        cluster = FakeCluster()
        cluster.rollout, cluster.trainers, cluster.lent = rollout, [trainer], []
        yield cluster
    finally:
        ray.shutdown()


def test_the_rollout_workers_are_admitted_from_their_own_weights_not_a_lagging_lent_engines():
    from types import SimpleNamespace

    from reflow.recipes.weight_sync import WeightPusher

    cluster = SimpleNamespace(rollout=["w0", "w1"], lent=["lent0"])
    cluster.engines = [*cluster.rollout, *cluster.lent]
    pusher = WeightPusher(cluster, version=2)
    assert pusher.versions.publish(3) == [0, 1, 2]
    pusher.versions.confirm(0, 3)
    pusher.versions.confirm(1, 3)  # the lent engine (2) is still loading version 3 beside a step
    assert pusher.rollout_confirmed == 3 and pusher.confirmed == 2
    # a start on either rollout worker counts from 3, one on the lent engine (index 2) from its own 2
    assert [pusher.admission_version(e) for e in range(3)] == [3, 3, 2]
    with pytest.raises(ValueError, match="no engine 3"):
        pusher.admission_version(3)
    pusher.versions.confirm(2, 3)
    assert pusher.versions.publish(4) == [0, 1, 2]
    pusher.versions.confirm(1, 4)  # the oldest rollout worker sets it
    assert pusher.rollout_confirmed == 3 and pusher.admission_version(1) == 3


@pytest.mark.slow
def test_pushes_through_ray_are_confirmed_in_order_and_a_failed_one_names_its_worker(ray_cluster):
    import ray

    from reflow.recipes.weight_sync import WeightPusher

    pusher = WeightPusher(ray_cluster, version=0)
    for version in (1, 2, 3):  # published faster than the loop collects the pushes
        pusher.publish(version)
    assert len(pusher.refs) == 2 and pusher.versions.pushing == [1, 1]  # one push per worker in flight
    assert pusher.confirmed == 0  # admission counts from what the engines confirmed, not from 3
    pusher.wait_all()
    assert pusher.confirmed == 3 and pusher.versions.confirmed == [3, 3]
    assert ray.get([w.weight_version.remote() for w in ray_cluster.rollout]) == [3, 3]

    ray.get(ray_cluster.rollout[1].close.remote())  # worker 1's engine is gone: its next push fails
    pusher.publish(4)
    with pytest.raises(RuntimeError, match="version 4 to rollout worker 1 failed"):
        pusher.wait_all()
    assert pusher.versions.confirmed[1] == 3
