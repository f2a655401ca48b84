"""The resource pool: device slots (CPU cores here, GPUs on a cluster), each given a role.

    pool = ResourcePool(config, model_path, run_dir)
    pool.rollout   # RolloutWorker handles, one per "rollout" slot
    pool.trainers  # TrainerRank handles, one per "train" slot (FSDP2 ranks of one trainer)
    pool.replay    # the replay-store actor

A slot's role is a parameter (`resources.slots: [rollout, train]`), not a code path: `place(role, i)`
puts the actor class of that role on a slot with the same resources whatever the role, so a later
scheduler can hand a slot from rollout to training and back.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.sched.replay_service import ReplayService, cycle_config
from reflow.sched.workers import RolloutWorker, TrainerRank

ROLE_ACTORS: dict[str, type] = {"rollout": RolloutWorker, "train": TrainerRank}


def start_ray(config: RunConfig) -> None:
    """Join the configured cluster, or start Ray locally with one CPU per slot (at least the cores)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if config.resources.ray_address:
        ray.init(address=config.resources.ray_address, log_to_driver=True)
    else:
        cpus = max(len(config.resources.slots), os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)


class ResourcePool:
    def __init__(self, config: RunConfig, model_path: str, run_dir: str | Path) -> None:
        self.config = config
        self.replay = (
            ray.remote(ReplayService)
            .options(num_cpus=0, max_concurrency=1)
            .remote(str(Path(run_dir) / "replay.sqlite"), config.run_name, cycle_config(config))
        )
        roles = config.resources.slots
        n_train = roles.count("train")
        self.rollout: list[Any] = []
        self.trainers: list[Any] = []
        for slot, role in enumerate(roles):
            if role == "rollout":
                self.rollout.append(self.place(role, slot, model_path, self.replay, len(self.rollout)))
            else:
                rank = len(self.trainers)
                self.trainers.append(self.place(role, slot, model_path, self.replay, rank, n_train))
        master = ray.get(self.trainers[0].master_address.remote()) if n_train > 1 else None
        ray.get([t.setup.remote(master) for t in self.trainers])

    def slot_resources(self) -> dict[str, float]:
        if self.config.resources.device == "cuda":
            return {"num_cpus": 1, "num_gpus": self.config.resources.gpus_per_slot}
        return {"num_cpus": 1}

    def place(self, role: str, slot: int, *args: Any) -> Any:
        actor = ray.remote(ROLE_ACTORS[role]).options(**self.slot_resources())
        return actor.remote(self.config, *args)

    def shutdown(self) -> None:
        for worker in self.rollout:
            with contextlib.suppress(Exception):  # a dead worker has nothing left to close
                ray.get(worker.close.remote(), timeout=10)
        for actor in [*self.rollout, *self.trainers, self.replay]:
            ray.kill(actor)
