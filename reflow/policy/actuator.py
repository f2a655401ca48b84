"""The seam between the scheduling policies and what runs them: the `Actuator` protocol, and the one
function that applies a tail action through it.

A policy decides (`ElasticPolicy.decide`, `TailPolicy.decide`); an actuator applies. Two implement
this protocol: the Ray runtime's `reflow.runtime.actuator.RayActuator` (real actors: a slot's actor
stopped and another started, an episode's request aborted and resubmitted on another engine, a
worker's concurrency limit) and the simulator's `reflow.sim.policies.SimActuator` (the same acts in
simulated time, priced by its cost model). `tests/test_layout.py` checks that both match the
protocol's signatures, so a change to the seam is a change to both.

Each method applies one decision and answers with what it did: `move_slot` the role change's cost
(the next observations price moves with it), the others the fields of the decision's metrics event,
`"applied"` (bool) always among them, with `"error"` when refused. The events share one schema,
whoever applies: `kind` (the policy: elastic or tail), `what` (the action), `why` (the policy's reason
with its numbers), then the decision's and the outcome's fields (`tail_event`,
`reflow.policy.elastic.decision_event`).
"""

from __future__ import annotations

from typing import Any, Protocol

from reflow.policy.elastic import ElasticDecision, RoleChangeCost
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency, TailAction


class Actuator(Protocol):
    """Applies the scheduling policies' decisions (see the module docstring)."""

    def move_slot(self, decision: ElasticDecision) -> RoleChangeCost:
        """One slot changes role as `decision.action` says (`to_rollout` / `to_train`); the actuator
        picks the slot (the rollout slot with the least work in flight, the last train slot). Returns
        the change's cost, measured or modelled."""
        ...

    def lend(self, decision: ElasticDecision) -> dict[str, Any]:
        """Set how many train slots lend their engine (`decision.lent_slots`, after a `lend` or
        `reclaim` decision): a lent engine takes groups while its trainer waits and yields when a step
        starts, without its slot changing role (`reflow.policy.lending`)."""
        ...

    def migrate(self, action: Migrate) -> dict[str, Any]:
        """Move one running episode to another engine, resubmitting its exact token prefix."""
        ...

    def free_engine(self, action: FreeSlot) -> dict[str, Any]:
        """Hand an engine with nothing left to run to the next batch (or the trainer)."""
        ...

    def set_concurrency(self, action: SetConcurrency) -> dict[str, Any]:
        """Set one engine's concurrency limit (sequences)."""
        ...


GATE_ACTIONS = ("over_provision", "carry_over")
"""Tail actions the driver's gate applies itself (how many groups start), not an actuator."""


def apply_tail(action: TailAction, actuator: Actuator) -> dict[str, Any]:
    """Apply one tail action: `Migrate`, `FreeSlot` and `SetConcurrency` through the actuator;
    `OverProvision` and `CarryOver` are the gate's (the driver starts that many groups, or none), so
    they count as applied here. Returns the outcome's event fields (`"applied"` among them)."""
    if action.kind in GATE_ACTIONS:
        return {"applied": True}
    by_kind = {
        "migrate": actuator.migrate,
        "free_slot": actuator.free_engine,
        "set_concurrency": actuator.set_concurrency,
    }
    return by_kind[action.kind](action)


def tail_event(action: TailAction, outcome: dict[str, Any]) -> dict[str, Any]:
    """The metrics event of one tail decision and its outcome (the schema in the module docstring,
    less `kind`, which the writer adds)."""
    fields = {k: v for k, v in vars(action).items() if k not in ("kind", "reason")}
    return {"what": action.kind, "why": action.reason, "applied": outcome["applied"], **fields, **outcome}
