"""Lending: a train slot's idle time generates rollouts, without the slot changing role.

Plain arithmetic, no Ray, no clock. A lending train slot holds a rollout engine beside its trainer rank;
the engine takes groups while the trainer waits for a batch and yields (its requests aborted, their
tokens kept) the moment a step starts; its episodes resume when the step ends, on the weights of then
(per-token versions). It is the fine-grained, cheap counterpart of moving a slot (`ElasticPolicy`
weighs both, from the same observation).

The pipeline model with lending (the elastic policy's units; n rollout slots, m train slots of which
l lend, r and t the per-slot rates, u the reuse):

    a lent engine generates only while its trainer idles: 1 - b of the time, b = T / (m t') the
    trainer's busy share, t' = t (1 - o) with o the trainer's slowdown beside a lent engine
    T = u r (n + l (1 - T / (m t')))   solved for T:
    T_lend(n, m, l) = min(u r (n + l) / (1 + u r l / (m t')), m t')

With l = 0 it is the pool's T(n, m) = min(n r u, m t). Lending never lifts T past the trainer's own
capacity m t'; it pays where rollout is the bottleneck and the trainer idles, and costs o where the
trainer is the bottleneck.

A lent engine yields at every step start, unless its oldest group in flight was started more than
`eta` versions before the step's version (`lent_engine_yields`): a trainer that never waits would
otherwise hold those episodes paused for ever. The bound is looser than admission's: a group started
on version c yields to the steps that train versions c + 1 to c + eta + 1, runs on beside the one
that trains c + eta + 2 and, if it finishes there, is trained by the next from version c + eta + 2:
eta + 2 versions stale (3 at eta 1; a rollout worker's groups in start order: eta). Its per-token
versions and the decoupled loss's weights carry that staleness as any straggler's.
"""

from __future__ import annotations

import math


def unlent_train_rate(train_rate: float, lent_now: int, overhead: float) -> float:
    """The trainer's rate without a lent engine beside it, from the rate measured with `lent_now`
    slots lending (measured with lending, the slowdown `overhead` is in it)."""
    return train_rate / (1.0 - overhead) if lent_now > 0 else train_rate


def lent_throughput(
    rollout_slots: int,
    train_slots: int,
    lent: int,
    *,
    rollout_rate: float,
    train_rate: float,
    reuse: float = 1.0,
    overhead: float = 0.0,
) -> float:
    """T_lend(n, m, l) of the module docstring; `train_rate`: the trainer's rate without a lent engine
    beside it (`unlent_train_rate`)."""
    if not 0 <= lent <= train_slots:
        raise ValueError(f"{lent} lending slots of {train_slots} train slots")
    if not 0.0 <= overhead < 1.0:
        raise ValueError(f"overhead is a slowdown share in [0, 1), got {overhead}")
    capacity = train_slots * train_rate * (1.0 - overhead if lent else 1.0)
    supply = reuse * rollout_rate
    if lent == 0 or capacity <= 0:
        return min(rollout_slots * supply, capacity)
    return min(supply * (rollout_slots + lent) / (1.0 + supply * lent / capacity), capacity)


def lent_engine_yields(oldest_started_version: int | None, version: int, eta: int) -> bool:
    """Whether a lent engine pauses its episodes for the step that trains `version` + 1 (`version`: the
    trainer's now): yes unless its oldest group in flight started (on weights) more than `eta`
    versions ago, which then runs on beside the step. No group in flight: nothing to pause, yes."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if oldest_started_version is None:
        return True
    return version - oldest_started_version <= eta


def relative_gain(now: float, target: float) -> float:
    """How much faster the target throughput is, as a share of now's (inf from nothing)."""
    if now <= 0:
        return math.inf if target > 0 else 0.0
    return target / now - 1.0
