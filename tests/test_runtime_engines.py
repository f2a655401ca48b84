"""`reflow.runtime`: the policy folder a rollout worker writes for SGLang servers to load, and what a
device slot reserves."""

import torch

from reflow.models import build_tiny, load_model
from reflow.runtime.engines import write_policy


def test_written_policy_is_a_complete_model_folder_without_stale_weight_files(tmp_path):
    src = build_tiny(tmp_path / "ckpt", num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    # a training checkpoint also holds optimizer/RNG state and may hold a shard index: none of it may
    # travel, or the server would look for shards that the new folder does not have
    for name in ("optimizer.pt", "rng.pt", "model.safetensors.index.json"):
        (src / name).write_text("{}")
    model, _ = load_model(str(src))
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    out = write_policy(state, str(src), tmp_path / "w" / "v000001")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not names & {"optimizer.pt", "rng.pt", "model.safetensors.index.json"}
    assert not (tmp_path / "w" / "v000001.tmp").exists()
    loaded, _ = load_model(str(out))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_a_slot_reserves_the_configured_share_of_a_gpu():
    from types import SimpleNamespace

    from reflow.config import load_config
    from reflow.runtime.cluster import Cluster

    def reserved(*overrides):
        config = load_config(None, ["env.id=reflow/Calc-v0", *overrides])
        return Cluster.slot_resources(SimpleNamespace(config=config))

    assert reserved() == {"num_cpus": 1}
    assert reserved("resources.device=cuda") == {"num_cpus": 1, "num_gpus": 1.0}
    # two slots on one GPU (rollout engine + trainer on a single-GPU machine)
    assert reserved("resources.device=cuda", "resources.gpus_per_slot=0.5") == {
        "num_cpus": 1,
        "num_gpus": 0.5,
    }
