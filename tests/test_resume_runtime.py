"""A resumed run on Ray: the model its actors start from outlives checkpoint rotation (a role change and
a weight push after the checkpoint it resumed from was rotated away)."""

import os
from pathlib import Path

import pytest
from run_helpers import PARITY_ENV, SMALL_ROLLOUT, TINY_MODEL

from reflow.config import load_config

TESTS = Path(__file__).parent
pytestmark = pytest.mark.slow

BASE = [
    *PARITY_ENV,
    "mode=async",
    *TINY_MODEL,
    *SMALL_ROLLOUT,
    "train.lr=1e-2",
    "resources.threads_per_slot=1",
    "resources.slots=[rollout, train, train]",
]


@pytest.fixture
def ray_env(monkeypatch):
    import ray

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield
    ray.shutdown()


def test_a_resumed_run_moves_a_slot_and_pushes_weights_after_its_checkpoint_is_rotated(tmp_path, ray_env):
    import ray
    from rich.console import Console

    from reflow.models.presets import resolve_model_path
    from reflow.recipes.run_log import RunLog
    from reflow.recipes.warm_phase import prepare_model
    from reflow.sched.pool import ResourcePool

    ray.init(num_cpus=6, include_dashboard=False)
    config = load_config(None, [*BASE, f"out_dir={tmp_path}"])
    run_dir, root = tmp_path / "run", str(tmp_path / "run" / "checkpoints")
    pool = ResourcePool(config, str(resolve_model_path(config.model, **config.model_overrides)), run_dir)
    try:
        pool.save_checkpoint(root, {}, keep=1)  # step 0: the checkpoint the run resumes from
    finally:
        pool.shutdown()
    log = RunLog(run_dir, Console(quiet=True))
    model_path, _, ckpt = prepare_model(config, run_dir, log, resume=True)
    log.close()
    assert ckpt is not None and ckpt.name == "step-000000"
    pool = ResourcePool(config, model_path, run_dir)
    try:
        pool.load_checkpoint(str(ckpt))
        (report,) = ray.get(pool.rollout[0].generate.remote([0]))
        pool.train_step([report.group_id], 1)
        pool.save_checkpoint(root, {}, keep=1)  # rotation removes the checkpoint resumed from
        assert not ckpt.exists()
        change = pool.move("train", "rollout")  # a new rollout worker starts from the model path
        assert change.roles == ["rollout", "train", "rollout"]
        ref = pool.state_dict_ref()
        assert ray.get([w.update_weights.remote(ref, 1) for w in pool.rollout]) == [1, 1]
        (played,) = ray.get(pool.rollout[1].generate.remote([1]))
        assert played.policy_version == 1
    finally:
        pool.shutdown()
