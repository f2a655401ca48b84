"""The run's cluster: its device slots (CPU cores here, GPUs on a Ray cluster of nodes), each holding one
role at a time, and the actors placed on them.

    cluster = Cluster(config, model_path, run_dir)
    cluster.rollout   # RolloutWorker handles, one per "rollout" slot, in slot order
    cluster.trainers  # TrainerRank handles, one per "train" slot, by rank (FSDP2 ranks of one trainer)
    cluster.replay    # the replay-store actor
    metrics = cluster.train_step(group_ids, step)          # fan-out: every rank, rank 0's metrics
    change = cluster.move("rollout", "train", in_flight)   # the elastic pool: a slot changes role

A slot's role is a parameter (`resources.slots: [rollout, train]`), not a code path: every slot reserves
the same resources whatever its role, so `move` can hand it from rollout to training and back at a
version boundary (`reflow.runtime.role_change` does the work and measures its cost per part). With
`resources.placement` each role's slots form a Ray placement group (a bundle per slot, the role's
strategy, optionally pinned to the nodes that declare a custom resource); a slot keeps its bundle when
its role changes. The cluster also does the loops' fan-out (slime's train.py style): train steps, weights,
checkpoints and evaluation are one call each, whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.metrics import ENGINE_COUNTERS
from reflow.runtime.replay_service import REPLAY_THREADS, ReplayService, cycle_config
from reflow.runtime.role_change import RoleChange, Slot, move_slot
from reflow.runtime.trainer_rank import TrainerRank
from reflow.runtime.worker_tail import engine_name
from reflow.runtime.workers import GroupReport, RolloutWorker
from reflow.sandbox.reaper import mark_run, reap_run

ROLE_ACTORS: dict[str, type] = {"rollout": RolloutWorker, "train": TrainerRank}
PLACEMENT_TIMEOUT_S = 120.0
"""How long the cluster waits for its placement groups before it says which role cannot be placed."""
COUNTERS_TIMEOUT_S = 30.0
"""How long the cluster waits for a rollout worker's engine counters (a metric) before it goes without."""
NODE_RESOURCE_SHARE = 0.001
"""Of a role's node resource, what one bundle reserves: enough to pin it, small enough for any count."""


def start_ray(config: RunConfig) -> None:
    """Join the configured cluster (`resources.ray_address`, else Ray's own RAY_ADDRESS), or start a
    fresh local Ray with one CPU per slot (at least the cores). Never joins a cluster that merely
    happens to run on this machine (`ray start`): its resources are not the run's."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    mark_run()  # the workers inherit it: their sandboxes carry the run's name, for `shutdown` to remove
    address = config.resources.ray_address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, log_to_driver=True)
    else:
        cpus = max(len(config.resources.slots), os.cpu_count() or 1)
        # Ray starts its workers at nice 15, for its own daemons' sake. Our workers are the run (rollout,
        # the trainer ranks): beside any other job at nice 0 they got a few percent of a core and the
        # run stalled (a measurement beside two busy loops sat 50 minutes in its first evaluation).
        # The raylet reads RAY_worker_niceness; a user's own setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)


def slot_resources(config: RunConfig) -> dict[str, float]:
    """What one slot reserves, whatever its role."""
    if config.resources.device == "cuda":
        return {"num_cpus": 1, "num_gpus": config.resources.gpus_per_slot}
    return {"num_cpus": 1}


def placement_groups(config: RunConfig) -> dict[str, Any]:
    """One placement group per role of the initial slots (`resources.placement`), ready; {} when the
    config asks for none. A role that cannot be placed in time is an error that names it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if not config.resources.placement:
        return {}
    res = config.resources
    groups: dict[str, Any] = {}
    for role in ("rollout", "train"):
        spec = res.placement.get(role)
        bundle: dict[str, float] = {"CPU": 1.0}
        if res.device == "cuda":
            bundle["GPU"] = res.gpus_per_slot
        if spec is not None and spec.node_resource:
            bundle[spec.node_resource] = NODE_RESOURCE_SHARE
        strategy = spec.strategy if spec is not None else "PACK"
        groups[role] = placement_group([bundle] * res.slots.count(role), strategy=strategy)
    for role, pg in groups.items():
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            for other in groups.values():
                remove_placement_group(other)
            bundle_text = ", ".join(f"{k}={v:g}" for k, v in pg.bundle_specs[0].items())
            raise RuntimeError(
                f"placement group of role {role!r} ({len(pg.bundle_specs)} bundles of {bundle_text}, "
                f"{pg.strategy}) could not be placed within {PLACEMENT_TIMEOUT_S:g} s: no node set of the "
                "cluster has those resources free (check resources.placement and the nodes' resources)"
            )
    return groups


class Cluster:
    """The run's slots, their actors and the replay-store actor; the loops' one handle on Ray (module
    docstring). Not a pool: nothing is handed out and taken back, a slot only changes role."""

    def __init__(self, config: RunConfig, model_path: str, run_dir: str | Path) -> None:
        self.config, self.model_path = config, model_path
        self.replay = (
            ray.remote(ReplayService)
            .options(num_cpus=0, max_concurrency=REPLAY_THREADS)
            .remote(str(Path(run_dir) / "replay.sqlite"), config.run_name, cycle_config(config))
        )
        self.groups = placement_groups(config)
        self.slots: list[Slot] = []
        ordinal = {"rollout": 0, "train": 0}
        for index, role in enumerate(config.resources.slots):
            bundle = (self.groups[role], ordinal[role]) if self.groups else None
            ordinal[role] += 1
            self.slots.append(Slot(index, role, bundle=bundle))
        n_train = len(self.train_slots)
        for slot in self.slots:
            slot.actor = self.place(slot, slot.role, rank=len(self.trainers), world_size=n_train)
        master = ray.get(self.trainers[0].master_address.remote()) if n_train > 1 else None
        ray.get([t.setup.remote(master) for t in self.trainers])
        self.engines_gone: dict[str, dict[str, float]] = {}
        """The counters of rollout engines that moved to training, as read when they left (their work
        stays in the run's engine figures, `engine_counters`)."""
        self.engines_evaluating = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        """What held-out evaluations (`evaluate`) took of the rollout engines' counters, summed: the
        run's engine figures leave it out (`reflow.metrics.engine_use`'s `left_out`)."""
        self.lent: list[Any] = []
        """With `elastic.lend`: a rollout engine beside each trainer rank, in rank order, that the
        decoupled loop gives groups while the trainer waits (`reflow.runtime.lending`)."""
        if config.elastic.lend:
            self.lent = [self.place_lent(slot) for slot in self.train_slots]

    # -- slots and roles --------------------------------------------------------------------------

    @property
    def rollout_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.role == "rollout" and s.actor is not None]

    @property
    def train_slots(self) -> list[Slot]:
        """The train slots in rank order (rank = position: slot order)."""
        return [s for s in self.slots if s.role == "train"]

    @property
    def rollout(self) -> list[Any]:
        """The rollout workers, in slot order (a role change re-numbers this list)."""
        return [s.actor for s in self.rollout_slots]

    @property
    def trainers(self) -> list[Any]:
        """The trainer ranks, rank 0 first."""
        return [s.actor for s in self.train_slots if s.actor is not None]

    def slot_resources(self) -> dict[str, float]:
        return slot_resources(self.config)

    def place(self, slot: Slot, role: str, *, rank: int = 0, world_size: int = 1) -> Any:
        """Start the actor of `role` on `slot` (its bundle, when there are placement groups). A rollout
        worker's index is its slot's, so it stays unique across role changes (SGLang ports, weight
        folders)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = self.slot_resources()
        if slot.bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.bundle[0], placement_group_bundle_index=slot.bundle[1]
            )
        actor = ray.remote(ROLE_ACTORS[role]).options(**options)
        if role == "rollout":
            return actor.remote(self.config, self.model_path, self.replay, slot.index)
        return actor.remote(self.config, self.model_path, self.replay, rank, world_size)

    def place_lent(self, slot: Slot) -> Any:
        """A rollout worker beside `slot`'s trainer rank, on the slot's resources (it reserves none of
        its own: it generates only while the trainer waits). Its index follows the slots' so its
        engine name and weight folder are its own."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if slot.bundle is not None:
            strategy: Any = PlacementGroupSchedulingStrategy(
                placement_group=slot.bundle[0], placement_group_bundle_index=slot.bundle[1]
            )
        else:
            strategy = NodeAffinitySchedulingStrategy(ray.get(slot.actor.node_id.remote()), soft=False)
        actor = ray.remote(RolloutWorker).options(num_cpus=0, scheduling_strategy=strategy)
        return actor.remote(self.config, self.model_path, self.replay, len(self.slots) + slot.index)

    @property
    def engines(self) -> list[Any]:
        """Every engine that generates for the run: the rollout workers, then the lent engines."""
        return [*self.rollout, *self.lent]

    def move(
        self,
        slot_or_role: int | str,
        to_role: str,
        in_flight: Mapping[Any, Sequence[str]] | None = None,
        drain_timeout_s: float | None = None,
    ) -> RoleChange:
        """Move one slot to `to_role` at a version boundary (no train step in flight); returns the
        `RoleChange` with its measured cost per part. `slot_or_role`: a slot index, or the role to take
        a slot from (the last slot of that role). `in_flight`: the slot's groups still generating
        (object ref of the `generate` call -> the group ids registered for it), waited for before its
        worker stops (at most `drain_timeout_s`; the rest are abandoned and named in the result).
        See `reflow.runtime.role_change`."""
        slot = self.pick_slot(slot_or_role, to_role)
        if slot.role == "rollout":  # its engine's work so far stays in the run's engine figures
            self.engines_gone.update(self._read_counters([slot]))
        return move_slot(self, slot, to_role, in_flight, drain_timeout_s)

    def pick_slot(self, slot_or_role: int | str, to_role: str) -> Slot:
        if to_role not in ROLE_ACTORS:
            raise ValueError(f"unknown role {to_role!r} (roles: {', '.join(ROLE_ACTORS)})")
        if isinstance(slot_or_role, str):
            if slot_or_role not in ROLE_ACTORS:
                raise ValueError(f"unknown role {slot_or_role!r} (roles: {', '.join(ROLE_ACTORS)})")
            candidates = [s for s in self.slots if s.role == slot_or_role]
            slot = candidates[-1] if candidates else None
        else:
            slot = self.slots[slot_or_role] if 0 <= slot_or_role < len(self.slots) else None
        if slot is None:
            raise ValueError(f"no slot {slot_or_role!r} in the cluster ({self.roles()})")
        if slot.role == to_role:
            raise ValueError(f"slot {slot.index} already has role {to_role!r}")
        if sum(s.role == slot.role for s in self.slots) <= 1:
            raise ValueError(f"slot {slot.index} is the last {slot.role!r} slot; each role keeps one")
        return slot

    def roles(self) -> list[str]:
        """Each slot's role now, in slot order (`resources.slots` at the start)."""
        return [s.role for s in self.slots]

    # -- fan-out ------------------------------------------------------------------------------------

    def generate(self, seeds: list[int]) -> list[GroupReport]:
        """One group per task seed, the seeds dealt round-robin over the rollout workers; returns once
        every group is stored (`GroupReport`s, worker by worker)."""
        n = len(self.rollout)
        calls = [w.generate.remote(seeds[i::n]) for i, w in enumerate(self.rollout) if seeds[i::n]]
        return [report for batch in ray.get(calls) for report in batch]

    def start_train_step(self, group_ids: list[str], step: int) -> list[Any]:
        """One train step on every rank (each takes its share of the rows); one object ref per rank,
        rank 0's first (its result carries the metrics)."""
        return [t.train_step.remote(group_ids, step) for t in self.trainers]

    def train_step(self, group_ids: list[str], step: int) -> dict[str, float]:
        """One train step on every rank; rank 0's metrics."""
        return ray.get(self.start_train_step(group_ids, step))[0]

    def state_dict_ref(self) -> Any:
        """An object ref to the trainer's full weights (rank 0's; every rank takes part under FSDP).
        Ray moves it to each engine's node when a worker's `update_weights` receives it: no shared disk."""
        refs = [t.state_dict.remote() for t in self.trainers]
        return refs[0]

    def version(self) -> int:
        return ray.get(self.trainers[0].version.remote())

    def save_checkpoint(self, root: str, extra: dict[str, Any], keep: int) -> str | None:
        """A trainer checkpoint (collective; rank 0 writes); its folder."""
        return ray.get([t.save_checkpoint.remote(root, extra, keep) for t in self.trainers])[0]

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Every rank restores the checkpoint; the `extra` dict saved with it."""
        return ray.get([t.load_checkpoint.remote(path) for t in self.trainers])[0]

    def evaluate(self, episodes: int, seed: int, worker: int = 0) -> dict[str, Any]:
        """Held-out evaluation on rollout worker `worker` (its engine's current weights); what it took
        of the engine's counters is added to `engines_evaluating`."""
        slot = self.rollout_slots[worker]
        before = self._read_counters([slot])
        result = ray.get(slot.actor.evaluate.remote(episodes, seed))
        after = self._read_counters([slot])
        for key, end in after.items():  # the same engine before and after (a key names one actor)
            for k in ENGINE_COUNTERS:
                self.engines_evaluating[k] += end[k] - before.get(key, end)[k]
        return result

    def engine_counters(self) -> dict[str, dict[str, float]]:
        """The rollout engines' counters (`RolloutWorker.engine_counters`) now, and those of engines that
        moved to training as they left (`engines_gone`), one key per engine actor: its slot's name and
        its start (`w0@<time>`; a slot that moves back gets a new engine, and a new key). Not the lent
        engines (their figures are the run's lent_* ones). For `reflow.metrics.engine_use`."""
        return {**self.engines_gone, **self._read_counters(self.rollout_slots)}

    def _read_counters(self, slots: list[Slot]) -> dict[str, dict[str, float]]:
        """`engine_counters` of `slots`' rollout workers; a worker that does not answer (dead, or
        stuck past `COUNTERS_TIMEOUT_S`) and an engine without counters give none: a metric never
        stops a run."""
        refs = [(s, s.actor.engine_counters.remote()) for s in slots]
        out = {}
        for slot, ref in refs:
            try:
                counters = ray.get(ref, timeout=COUNTERS_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                continue
            if counters:
                out[f"{engine_name(slot.index)}@{counters['started_at']:.6f}"] = counters
        return out

    def weight_versions(self) -> list[int]:
        """The weight version each rollout worker's engine has, in `rollout` order."""
        return ray.get([w.weight_version.remote() for w in self.rollout])

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for worker in self.engines:
            with contextlib.suppress(Exception):  # a dead worker has nothing left to close
                ray.get(worker.close.remote(), timeout=10)
        for actor in [*(s.actor for s in self.slots if s.actor is not None), *self.lent, self.replay]:
            ray.kill(actor)
        for pg in self.groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        reap_run()  # killed workers close nothing: their sandbox containers go here (also on Ctrl-C)
