"""Simulated rollout engines: continuous batching as processor sharing, and the requests they serve.

Every running sequence of an engine gains one token per decode iteration, and an iteration of b
sequences holding C context tokens costs `DecodeModel.iter_s(b, C)`; so a service counter S (tokens
per sequence so far) is all the engine advances, in closed form between events (the iteration cost
grows linearly with S, since every sequence's context does). A sequence is admitted while its whole
turn fits in the KV cache beside the others (`Engine.has_room`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from reflow.sim.costs import DecodeModel, SampleShape


@dataclass(eq=False)
class Request:
    group: GroupState
    shape: SampleShape
    turn: int = 0
    ctx: float = 0.0
    """Context tokens when this turn was admitted (prompt + earlier turns + tool output)."""
    left: float = 0.0
    """Tokens still to generate in this turn."""
    s0: float = 0.0
    engine: Engine | None = None
    versions: set[int] = field(default_factory=set)
    started_at: float = 0.0
    resumed: bool = False
    """Taken off an engine mid-turn (consolidation, role change): resubmitted with its token prefix."""
    segment: float = 0.0
    """Tokens of its last stretch on an engine before an abort (reflow/sim/oversample.py): what slime
    counts as off-policy when it resumes."""
    handed: bool = False
    """Handed over by its lent engine at a yield (reflow/sim/lending.py): the rest of its episode runs
    on the rollout engines."""

    @property
    def lent_engine(self) -> Engine | None:
        """The lent engine this episode runs on, None: the rollout engines'."""
        return None if self.handed else self.group.lent


@dataclass(eq=False)
class GroupState:
    gid: str
    version: int
    pending: int
    started_at: float
    tokens: int = 0
    """Prompt + generated + tool tokens of all its samples: what a train step over it processes."""
    generated: int = 0
    """Generated tokens of all its samples: what the runs count as trained tokens (the loss's)."""
    partial: bool = False
    zero: bool | None = None
    """Whether it has no reward spread, when the sampler knows (a stored group); None: draw it."""
    lent: Engine | None = None
    """The lent engine it started on (every turn of every sample, but those it hands over), None: the
    rollout engines'."""
    episodes: list[Request] | None = None
    """A lent group's episodes still running (None on the rollout engines': nothing looks them up)."""
    held: list[Request] | None = None
    """Aborted at a round's target (reflow/sim/oversample.py): its unfinished requests, with their
    progress, until it resumes; None while it runs."""

    @property
    def episodes_away(self) -> int:
        """Of `pending`, the episodes its lent engine handed over to the rollout engines (0 on the
        rollout engines'): the group is at home on its lent engine while pending > episodes_away."""
        return sum(r.handed for r in self.episodes) if self.episodes else 0


class Engine:
    """One rollout engine (tp GPUs): its running sequences as processor sharing with a service counter S."""

    def __init__(self, eid: int, dm: DecodeModel, lent: bool = False) -> None:
        self.eid, self.dm = eid, dm
        self.lent = lent  # an engine lent beside a trainer rank (reflow/sim/lending.py), not a rollout slot
        self.running: list[tuple[float, int, Request]] = []  # heap of (S at which the turn ends, id, req)
        self.S = 0.0
        self.base = 0.0  # sum over running of (ctx_i - s0_i): context = base + b * S
        self.t = 0.0
        self.paused = 0
        self.alive = True
        self.token = 0
        self.busy_s = 0.0
        self.max_running = dm.max_running
        self.reserved = 0.0  # sum over running of their turn's final context
        self.pressure = 1.0  # factor on the per-sequence term (KV pressure: preemption and recompute)

    @property
    def b(self) -> int:
        return len(self.running)

    def context(self) -> float:
        return self.base + self.b * self.S

    def _ab(self) -> tuple[float, float]:
        dm, b = self.dm, self.b
        per_seq = dm.per_seq_s * self.pressure
        return dm.k * b / 2, dm.weights_s(b) + per_seq * b + dm.k * self.base + dm.k * b * self.S

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and self.b and not self.paused:
            alpha, beta = self._ab()  # t(d) = beta * d + alpha * d^2 for d tokens per sequence
            self.S += 2 * dt / (beta + math.sqrt(beta * beta + 4 * alpha * dt))
            self.busy_s += dt
        self.t = max(self.t, now)

    def next_event(self) -> float | None:
        """When the next turn ends (None: nothing runs)."""
        if not self.running or self.paused:
            return None
        alpha, beta = self._ab()
        d = max(0.0, self.running[0][0] - self.S)
        return self.t + beta * d + alpha * d * d

    def has_room(self, req: Request) -> bool:
        """Whether the sequence's whole turn fits in the KV cache beside the others' whole turns. The
        simulator knows each turn's length, so it reserves instead of modelling vLLM's preemptions
        (admit on current use, recompute the newest when full): the same KV-bound concurrency, without
        the thrashing, at about half the cache use; kv_memory_fraction is fitted with this rule."""
        if not self.alive or self.b >= self.max_running:
            return False
        return self.b == 0 or self.reserved + req.ctx + req.left <= self.dm.kv_capacity_tokens

    def admit(self, req: Request, seq: int) -> None:
        req.engine, req.s0 = self, self.S
        self.base += req.ctx - self.S
        self.reserved += req.ctx + req.left
        heapq.heappush(self.running, (self.S + req.left, seq, req))

    def remove(self, req: Request) -> float:
        """Take a request off (consolidation, role change): its progress so far is kept in `req`.
        Returns the tokens it generated on this engine."""
        done = self.S - req.s0
        self.running = [e for e in self.running if e[2] is not req]
        heapq.heapify(self.running)
        self.base -= req.ctx - req.s0
        self.reserved -= req.ctx + req.left
        req.ctx += done
        req.left -= done
        req.engine, req.resumed = None, True
        return done
