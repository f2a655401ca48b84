"""A resumed run on Ray: the model its actors start from outlives checkpoint rotation (a role change and
a weight push after the checkpoint it resumed from was rotated away)."""

import pytest
from run_helpers import PARITY_ENV, SMALL_ROLLOUT, TINY_MODEL

from reflow.config import load_config

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


def test_a_resumed_run_moves_a_slot_and_pushes_weights_after_its_checkpoint_is_rotated(tmp_path, ray_env):
    import ray
    from rich.console import Console

    from reflow.models.presets import resolve_model_path
    from reflow.recipes.initial_model import prepare_model
    from reflow.recipes.run_log import RunLog
    from reflow.runtime.cluster import Cluster

    ray.init(address="local", num_cpus=6, include_dashboard=False)
    config = load_config(None, [*BASE, f"out_dir={tmp_path}"])
    run_dir, root = tmp_path / "run", str(tmp_path / "run" / "checkpoints")
    cluster = Cluster(config, str(resolve_model_path(config.model.name, **config.model_overrides)), run_dir)
    try:
        cluster.save_checkpoint(root, {}, keep=1)  # step 0: the checkpoint the run resumes from
    finally:
        cluster.shutdown()
    log = RunLog(run_dir, Console(quiet=True))
    model_path, _, ckpt = prepare_model(config, run_dir, log, resume=True)
    log.close()
    assert ckpt is not None and ckpt.name == "step-000000"
    cluster = Cluster(config, model_path, run_dir)
    try:
        cluster.load_checkpoint(str(ckpt))
        (report,) = ray.get(cluster.rollout[0].generate.remote([0]))
        cluster.train_step([report.group_id], 1)
        cluster.save_checkpoint(root, {}, keep=1)  # rotation removes the checkpoint resumed from
        assert not ckpt.exists()
        change = cluster.move("train", "rollout")  # a new rollout worker starts from the model path
        assert change.roles == ["rollout", "train", "rollout"]
        ref = cluster.state_dict_ref()
        assert ray.get([w.update_weights.remote(ref, 1) for w in cluster.rollout]) == [1, 1]
        (played,) = ray.get(cluster.rollout[1].generate.remote([1]))
        assert played.policy_version == 1
    finally:
        cluster.shutdown()


def test_a_resume_restores_the_scheduler(tmp_path, ray_env):
    """The adaptive state a checkpoint saved comes back on resume: the slot layout, the replay share
    and its history, the group durations, the engines' concurrency limits and the elastic pool's
    measured costs (edited in the checkpoint here, so a run that started afresh could not match)."""
    import json

    from rich.console import Console

    from reflow.recipes.agent_train import train
    from reflow.train.trainer_state import STATE_FILE, latest_checkpoint

    overrides = [
        *BASE,
        f"out_dir={tmp_path}",
        "run_name=r",
        "mode=reflow",
        "resources.slots=[rollout, train]",
        "tail.set_concurrency=true",  # limits are saved and restored where the run sets them
    ]
    overrides += ["train.checkpoint_every=1", "eval.episodes=0", "eval.pass_at=0"]
    train(load_config(None, [*overrides, "train.steps=3"]), console=Console(quiet=True))
    run_dir = tmp_path / "r"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    state = json.loads((ckpt / STATE_FILE).read_text())
    saved = state["extra"]["run_state"]["scheduler"]
    assert saved["roles"] == ["rollout", "train"] and len(saved["durations"]["group_s"]) >= 6
    assert [s for s, _ in saved["replay_share"]["history"]] == [1, 2, 3]
    saved["roles"] = ["train", "rollout"]  # as if the elastic pool had swapped them
    saved["replay_share"] = {"share": 0.4, "history": [[1, 0.3], [2, 0.35], [3, 0.4]]}
    saved["tail"] = {"limits": {"w1": 3}}  # the rollout slot is now slot 1
    cost = {"actor_start_s": 1.5, "weight_load_s": 0.5, "group_reform_s": 0.25}
    saved["elastic"] = {
        "costs": {"to_rollout": cost, "to_train": None},
        "last_change_step": 2,
        "last_move_version": 2,
    }
    (ckpt / STATE_FILE).write_text(json.dumps(state))

    train(load_config(None, [*overrides, "train.steps=5"]), resume=True, console=Console(quiet=True))
    after = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    restored = after["extra"]["run_state"]["scheduler"]
    assert restored["roles"] == ["train", "rollout"]
    history = restored["replay_share"]["history"]
    assert history[:3] == [[1, 0.3], [2, 0.35], [3, 0.4]] and [s for s, _ in history[3:]] == [4, 5]
    assert abs(history[3][1] - 0.4) <= 0.05 + 1e-9  # one share_step at most from the saved share
    assert len(restored["durations"]["group_s"]) > len(saved["durations"]["group_s"])
    assert restored["elastic"]["costs"]["to_rollout"] == cost  # no move since: the measured cost stays
    assert restored["elastic"]["last_change_step"] == 2
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(
        e["kind"] == "tail" and e.get("why") == "restored from the checkpoint" and e.get("limit") == 3
        for e in events
    )


def test_a_run_ended_by_its_budget_checkpoints_the_scheduler_it_ended_with(tmp_path, ray_env):
    """The final checkpoint of a run that ends on its time budget holds the scheduler as the run left
    it (what a resume from it restores), not that of the last periodic checkpoint, or none."""
    import json

    from rich.console import Console

    from reflow.recipes.agent_train import train
    from reflow.recipes.run_log import read_metrics
    from reflow.train.trainer_state import STATE_FILE, latest_checkpoint

    overrides = [
        *BASE,
        f"out_dir={tmp_path}",
        "run_name=r",
        "mode=reflow",
        "resources.slots=[rollout, train]",
    ]
    overrides += ["train.steps=1000", "train.seconds=20", "train.checkpoint_every=1000"]  # the budget ends it
    train(load_config(None, [*overrides, "eval.episodes=0", "eval.pass_at=0"]), console=Console(quiet=True))
    run_dir = tmp_path / "r"
    steps = read_metrics(run_dir, "step")
    assert steps and steps[-1]["step"] < 1000
    state = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    saved = state["extra"]["run_state"]["scheduler"]
    assert saved["roles"] == ["rollout", "train"]
    assert [s for s, _ in saved["replay_share"]["history"]] == [r["step"] for r in steps]
    assert len(saved["durations"]["group_s"]) >= 2 * len(steps)  # every step's groups arrived first
