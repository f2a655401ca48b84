"""A slot's role change in the elastic pool (`Cluster.move`), measured per part.

rollout -> train (at a version boundary, no train step in flight):
  1. drain: the slot's groups still generating are waited for (they are stored by the worker before
     they report, so each comes back as a `GroupReport`); past `drain_timeout_s` the rest are
     abandoned: their in-flight registrations are ended in the replay store and their ids returned.
  2. weight load, part 1: the trainer group's full state (weights, optimizer state, step, version,
     RNG) is gathered from rank 0 into Ray's object store, while the old group still exists.
  3. actor start: the worker's engine is closed, its actor killed, a `TrainerRank` started on the
     slot (its bundle) and waited for until it has imported torch and the trainer (`prepare`).
  4. group re-form: every rank leaves its process group, a group of world size m + 1 forms at a new
     rendezvous address from rank 0, and each rank rebuilds its model from the model path (the base
     weights, from disk) and shards it (FSDP2).
  5. weight load, part 2: every rank loads the gathered state; version and step carry over.

train -> rollout is the reverse: gather (2), every rank leaves (4, first half), the slot's rank is
killed and a `RolloutWorker` started (3), the m - 1 others form a group (4, second half), and both
the ranks and the new worker load the state (5): the engine gets the current weights at the current
version, so no engine's version goes backwards.

Every part is timed on the driver, one after another, so the parts sum to the wall total up to the
bookkeeping between them. `RoleChangeCost` (actor start, weight load, group re-form) is what the
elastic policy weighs a change against; the drain wait is reported beside it (it depends on the
episodes in flight, not on the slot).

A failure part-way (an actor that does not start, a rendezvous that times out) raises and leaves the
cluster as far as it got: the run stops and resumes from its last checkpoint, the replay store holding
every acknowledged group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from reflow.policy.elastic import RoleChangeCost
from reflow.runtime.workers import GroupReport, report_group


@dataclass
class Slot:
    """One device slot: its role now, the actor holding it, and its bundle (placement group, index)."""

    index: int
    role: str
    actor: Any = None
    bundle: tuple[Any, int] | None = None


class SlotOwner(Protocol):
    """What a role change needs of the cluster that owns the slot (`Cluster`, which imports this
    module to move a slot: it is not imported back)."""

    replay: Any

    @property
    def trainers(self) -> list[Any]: ...

    def place(self, slot: Slot, role: str, *, rank: int = 0, world_size: int = 1) -> Any: ...

    def roles(self) -> list[str]: ...


ACTOR_STOP_TIMEOUT_S = 60.0
"""How long a rollout worker may take to close its engine before its actor is killed: a launched SGLang
server gets up to 30 s to exit, and killing the worker first would orphan it on the GPU."""


@dataclass
class RoleChange:
    """One applied role change: what moved, what it cost per part, and what became of its groups."""

    slot: int
    from_role: str
    to_role: str
    version: int
    """The trainer's policy version at the change (carried over; a new engine gets this one)."""
    cost: RoleChangeCost
    drain_s: float
    wall_s: float
    drained: list[GroupReport] = field(default_factory=list)
    """Groups the slot finished while draining: stored in the replay store; the driver counts them."""
    failed: list[str] = field(default_factory=list)
    """Group ids whose `generate` call failed while draining (the worker freed their registrations)."""
    abandoned: list[str] = field(default_factory=list)
    """Group ids still generating at the drain timeout: never stored, registrations ended here."""
    roles: list[str] = field(default_factory=list)
    """Every slot's role after the change."""

    @property
    def direction(self) -> str:
        return f"to_{self.to_role}"

    def event(self) -> dict[str, Any]:
        """The metrics event of the change (what moved and its measured cost per part)."""
        return {
            "what": f"slot {self.slot}: {self.from_role} -> {self.to_role}",
            "slot": self.slot,
            "direction": self.direction,
            "version": self.version,
            "roles": self.roles,
            "actor_start_s": self.cost.actor_start_s,
            "weight_load_s": self.cost.weight_load_s,
            "group_reform_s": self.cost.group_reform_s,
            "cost_s": self.cost.total_s,
            "drain_s": self.drain_s,
            "wall_s": self.wall_s,
            "drained_groups": len(self.drained),
            "failed_groups": len(self.failed),
            "abandoned_groups": len(self.abandoned),
        }


def move_slot(
    cluster: SlotOwner,
    slot: Slot,
    to_role: str,
    in_flight: Mapping[Any, Sequence[str]] | None,
    drain_timeout_s: float | None,
) -> RoleChange:
    start = time.monotonic()
    from_role = slot.role
    drained: list[GroupReport] = []
    failed: list[str] = []
    abandoned: list[str] = []
    if from_role == "rollout":
        drained, failed, abandoned = _drain(cluster, dict(in_flight or {}), drain_timeout_s)
    elif in_flight:
        raise ValueError("in_flight names rollout groups: a train slot has none to drain")
    t_drain = time.monotonic()

    model_ref, rest_ref = _gather_state(cluster)
    version = ray.get(cluster.trainers[0].version.remote())  # not from rest_ref: that is the optimizer too
    t_gather = time.monotonic()

    if to_role == "train":
        _stop(slot)
        late, abandoned = stored_after_all(cluster.replay, abandoned)
        drained += late
        slot.role = "train"
        slot.actor = cluster.place(slot, "train")
        ray.get(slot.actor.prepare.remote())
        t_actor = time.monotonic()
        ray.get([t.leave.remote() for t in cluster.trainers])
        _join(cluster)
        t_group = time.monotonic()
        ray.get([t.load_full_state.remote(model_ref, rest_ref) for t in cluster.trainers])
        actor_s, reform_s = t_actor - t_gather, t_group - t_actor
    else:
        ray.get([t.leave.remote() for t in cluster.trainers])
        t_left = time.monotonic()
        _stop(slot)
        slot.role = "rollout"
        slot.actor = cluster.place(slot, "rollout")
        ray.get(slot.actor.__ray_ready__.remote())
        t_actor = time.monotonic()
        _join(cluster)
        t_group = time.monotonic()
        loads = [t.load_full_state.remote(model_ref, rest_ref) for t in cluster.trainers]
        confirmed = ray.get(slot.actor.update_weights.remote(model_ref, version))
        ray.get(loads)
        if confirmed != version:
            raise RuntimeError(
                f"the new rollout worker on slot {slot.index} confirms v{confirmed}, not v{version}"
            )
        actor_s, reform_s = t_actor - t_left, (t_left - t_gather) + (t_group - t_actor)
    end = time.monotonic()
    cost = RoleChangeCost(
        actor_start_s=actor_s,
        weight_load_s=(t_gather - t_drain) + (end - t_group),
        group_reform_s=reform_s,
    )
    return RoleChange(
        slot=slot.index,
        from_role=from_role,
        to_role=to_role,
        version=version,
        cost=cost,
        drain_s=t_drain - start,
        wall_s=end - start,
        drained=drained,
        failed=failed,
        abandoned=abandoned,
        roles=cluster.roles(),
    )


def _drain(
    cluster: SlotOwner, in_flight: dict[Any, Sequence[str]], timeout_s: float | None
) -> tuple[list[GroupReport], list[str], list[str]]:
    """Wait for the slot's groups in flight; (stored reports, failed group ids, abandoned group ids)."""
    if not in_flight:
        return [], [], []
    done, pending = ray.wait(list(in_flight), num_returns=len(in_flight), timeout=timeout_s)
    drained: list[GroupReport] = []
    failed: list[str] = []
    for ref in done:
        try:
            drained += ray.get(ref)
        except Exception:  # the worker ended the registrations itself (`RolloutWorker.generate`)
            failed += list(in_flight[ref])
    abandoned = [g for ref in pending for g in in_flight[ref]]
    for ref in pending:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    # the actor is killed next, so its own clean-up never runs: free the admission slots here
    ray.get([cluster.replay.end_group.remote(g) for g in abandoned])
    return drained, failed, abandoned


def stored_after_all(replay: Any, abandoned: list[str]) -> tuple[list[GroupReport], list[str]]:
    """(reports of the abandoned groups the worker stored before it was stopped, the ids of the rest),
    asked of the replay actor once the worker is gone: a group can finish between the drain's timeout
    and the kill, and then it is stored, planned and trained like any other, so it must arrive."""
    late: list[GroupReport] = []
    gone: list[str] = []
    for gid in abandoned:
        try:
            late.append(report_group(ray.get(replay.group.remote(gid)).episodes, 0.0))
        except KeyError:  # never stored: abandoned indeed
            gone.append(gid)
    return late, gone


def _gather_state(cluster: SlotOwner) -> tuple[Any, Any]:
    """Object refs to rank 0's (weights, rest of the state); every rank takes part (a collective)."""
    refs = [t.full_state.options(num_returns=2).remote() for t in cluster.trainers]
    ray.wait(list(refs[0]), num_returns=2)
    ray.get([r for pair in refs[1:] for r in pair])  # the other ranks are done with the collective too
    return refs[0][0], refs[0][1]


def _stop(slot: Slot) -> None:
    """Close the slot's actor (a rollout worker's engine) and kill it: its resources go back."""
    if slot.role == "rollout":
        with contextlib.suppress(Exception):  # a dead worker has nothing left to close
            ray.get(slot.actor.close.remote(), timeout=ACTOR_STOP_TIMEOUT_S)
    ray.kill(slot.actor)
    slot.actor = None


def _join(cluster: SlotOwner) -> None:
    """The train slots form a new group: ranks by slot order, rendezvous at rank 0's address."""
    trainers = cluster.trainers
    world = len(trainers)
    master = ray.get(trainers[0].master_address.remote()) if world > 1 else None
    ray.get([t.reform.remote(rank, world, master) for rank, t in enumerate(trainers)])
