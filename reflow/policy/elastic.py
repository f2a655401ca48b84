"""The elastic policy: how many of the N device slots roll out and how many train.

A plain object, observations in, decisions out; no Ray, no clock, no I/O. Two drivers feed it the same
`ElasticObservation`, built by `observe` from the counters of the interval between two version
boundaries: the Ray runtime (`reflow.runtime.elastic`, real actors) and the cluster simulator
(`reflow.sim.policies`, simulated time). Each applies the decision through its
`reflow.policy.actuator.Actuator` (drain a rollout worker, start a trainer rank, re-form the group, or
the reverse), which reports the change's cost for the next observations; `decision_event` is the
decision's metrics event, whichever driver writes it.

The pipeline model (units: `unit` per second, samples or tokens; the same unit everywhere):

    n rollout slots, m train slots, n + m = N
    r = fresh work generated per second by one rollout slot
    t = work trained per second by one train slot
    u = reuse: trained uses per generated unit (1 without replay; 1 / (1 - replay share) with it)

    T(n, m) = min(n * r * u, m * t)           trained work per second: the slower side sets the pace
    step(n, m) = S / T(n, m)                  seconds per train step of S units (`batch_size`)
    gain(n -> n') = H * (step(n, m) - step(n', m'))   seconds saved over the next H = horizon_steps

A change is made only when gain > margin * cost (cost: the measured seconds of one role change in
that direction: actor start + weight load + group re-form), at least `min_dwell_steps` after the last
one, never twice in one version, and never below `min_rollout` / `min_train` slots. One slot moves per
decision: the per-slot rates are measured at the current split and extrapolated linearly, so a short
step keeps the extrapolation honest, and the next decision sees rates re-measured at the new split.
T is unimodal in n (the min of a rising and a falling line), so repeated one-slot moves reach the
best split. The reuse u is taken as it was measured; the replay share adapts on its own and the
next decision sees the new value.

`observe` measures r as the work generated per busy rollout slot-second, t as the work trained per
trainer-busy second and train slot, and u from the replay share. The idle ratios are 1 - busy /
offered: rollout slot-seconds busy over those offered (counted by the driver, or the interval's
seconds x the rollout slots), trainer-busy seconds over the interval's.

The idle ratios guard the model: a move towards rollout needs the trainer to idle at least as much
as rollout does, a move towards training the reverse. When the measured idle ratios contradict the
rate model the policy holds and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from reflow.policy.lending import LendWindow, lending_cost, lent_throughput, relative_gain


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic policy's knobs; `reflow.config` builds its `elastic:` section from these fields."""

    horizon_steps: int = field(default=10, metadata=_doc("train steps over which a change must pay off"))
    margin: float = field(
        default=1.5, metadata=_doc("a change needs predicted gain > margin x measured change cost")
    )
    min_dwell_steps: int = field(default=5, metadata=_doc("train steps between two changes, at least"))
    min_rollout: int = field(default=1, metadata=_doc("rollout slots never fall below this"))
    min_train: int = field(default=1, metadata=_doc("train slots never fall below this"))
    initial_change_cost_s: float = field(
        default=30.0, metadata=_doc("assumed seconds of a role change until one has been measured")
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=_doc(
            "a move to training waits this long at most for the drained worker's groups in flight; the "
            "rest are abandoned (their admission slots freed, generated again elsewhere)"
        ),
    )
    lend: bool = field(
        default=False,
        metadata=_doc(
            "each train slot also holds a rollout engine the policy may lend: it takes groups while the "
            "trainer waits for a batch and yields the moment a step starts (torch engine; two slots)"
        ),
    )
    lend_overhead: float = field(
        default=0.05,
        metadata=_doc(
            "the trainer's slowdown (share of its rate) assumed for lending until it is measured: once "
            "engines lend, the policy reads it over the steps since its last change, those a lent engine "
            "ran on beside and the yields' seconds against the steps alone (`reflow bench lending` "
            "measured 35% a run-on step and 1.5% a yield on calc-tiny)"
        ),
    )
    lend_window_steps: int = field(
        default=20,
        metadata=_doc(
            "lending's cost is read over the last this many train steps since the policy's last change"
        ),
    )
    lend_min_gain: float = field(
        default=0.02,
        metadata=_doc("lending or reclaiming a slot needs its predicted throughput this much higher (share)"),
    )

    def __post_init__(self) -> None:
        if self.horizon_steps < 1:
            raise ValueError(f"horizon_steps must be >= 1, got {self.horizon_steps}")
        if not (math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(f"margin must be a finite number >= 1 (hysteresis), got {self.margin}")
        if self.min_dwell_steps < 0:
            raise ValueError(f"min_dwell_steps must be >= 0, got {self.min_dwell_steps}")
        if self.min_rollout < 1 or self.min_train < 1:
            raise ValueError(
                f"min_rollout and min_train must be >= 1, got {self.min_rollout} and {self.min_train}"
            )
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s > 0):
            raise ValueError(f"drain_timeout_s must be finite and > 0, got {self.drain_timeout_s}")
        if not 0.0 <= self.lend_overhead < 1.0:
            raise ValueError(f"lend_overhead is a share in [0, 1), got {self.lend_overhead}")
        if self.lend_window_steps < 1:
            raise ValueError(f"lend_window_steps must be >= 1, got {self.lend_window_steps}")
        if not (math.isfinite(self.lend_min_gain) and self.lend_min_gain >= 0):
            raise ValueError(f"lend_min_gain must be finite and >= 0, got {self.lend_min_gain}")
        if not (math.isfinite(self.initial_change_cost_s) and self.initial_change_cost_s >= 0):
            raise ValueError(
                f"initial_change_cost_s must be finite and >= 0, got {self.initial_change_cost_s}"
            )


@dataclass(frozen=True)
class RoleChangeCost:
    """Measured seconds of one role change in one direction, per part (the paper's cold-start figure)."""

    actor_start_s: float = 0.0
    """Stopping the old actor and starting the new one on the slot."""
    weight_load_s: float = 0.0
    """Loading the current weights (and, towards training, the optimizer state)."""
    group_reform_s: float = 0.0
    """Re-forming the trainer group (FSDP2) or the rollout workers' group assignment."""

    def __post_init__(self) -> None:
        for name in ("actor_start_s", "weight_load_s", "group_reform_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"RoleChangeCost.{name} must be finite and >= 0, got {value}")

    @property
    def total_s(self) -> float:
        return self.actor_start_s + self.weight_load_s + self.group_reform_s


@dataclass(frozen=True)
class ElasticObservation:
    """What the driver measured, at a version boundary. Rates are per slot, in `unit` per second."""

    step: int
    """Train steps done in this run."""
    version: int
    """The policy version the trainer just published (the boundary being crossed)."""
    steps_since_change: int
    """Train steps since the last applied role change (or since the run start)."""
    rollout_slots: int
    train_slots: int
    rollout_rate: float
    """r: fresh work generated per second by one rollout slot while generating."""
    train_rate: float
    """t: work trained per second by one train slot while training."""
    batch_size: float
    """S: work per train step (samples: B x group size; tokens: the step's trained tokens)."""
    reuse: float = 1.0
    """u: trained uses per generated unit (mean reuse); see `reuse_from_share`."""
    rollout_idle: float = 0.0
    """Share of the last interval the rollout slots waited (0..1)."""
    train_idle: float = 0.0
    """Share of the last interval the train slots waited for data (0..1)."""
    fresh_waiting: int = 0
    """Fresh groups stored and not yet trained on (reported in the reason; the rates decide)."""
    in_flight: int = 0
    """Groups being generated (reported in the reason)."""
    to_rollout_cost: RoleChangeCost | None = None
    """Measured cost of turning a train slot into a rollout slot (None: none measured yet)."""
    to_train_cost: RoleChangeCost | None = None
    """Measured cost of turning a rollout slot into a train slot (None: none measured yet)."""
    unit: Literal["samples", "tokens"] = "samples"
    lent_slots: int = 0
    """l: train slots lending their engine now (their generation is in `rollout_rate`'s counters)."""
    lendable_slots: int = 0
    """Train slots that hold an engine to lend (0: lending is off)."""
    train_rate_alone: float | None = None
    """t over the steps since the last change beside which no lent engine generated (None: none yet,
    or lending off)."""
    lend_slowdown: float | None = None
    """Lending's measured slowdown of the trainer over those steps (`LendWindow.slowdown`; None
    while no slot lends)."""

    def __post_init__(self) -> None:
        if not 0 <= self.lent_slots <= self.lendable_slots <= self.train_slots:
            raise ValueError(
                f"lent_slots {self.lent_slots} <= lendable_slots {self.lendable_slots} <= train_slots "
                f"{self.train_slots} does not hold"
            )
        for name in ("step", "version", "steps_since_change", "fresh_waiting", "in_flight"):
            if getattr(self, name) < 0:
                raise ValueError(f"ElasticObservation.{name} must be >= 0, got {getattr(self, name)}")
        if self.rollout_slots < 0 or self.train_slots < 0:
            raise ValueError(f"slot counts must be >= 0, got {self.rollout_slots} and {self.train_slots}")
        for name in ("rollout_rate", "train_rate", "batch_size", "train_rate_alone", "lend_slowdown"):
            value = getattr(self, name)
            if value is None and name in ("train_rate_alone", "lend_slowdown"):
                continue
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ElasticObservation.{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.reuse) and self.reuse >= 1.0):
            raise ValueError(f"reuse counts the first use too, so it is >= 1, got {self.reuse}")
        for name in ("rollout_idle", "train_idle"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"ElasticObservation.{name} is a ratio in [0, 1], got {value}")

    @property
    def slots(self) -> int:
        """N, the slots both roles share."""
        return self.rollout_slots + self.train_slots


def reuse_from_share(replay_share: float) -> float:
    """Mean trained uses per generated sample when `replay_share` of every batch is replayed."""
    if not 0.0 <= replay_share < 1.0:
        raise ValueError(f"replay share must be in [0, 1), got {replay_share}")
    return 1.0 / (1.0 - replay_share)


def throughput(obs: ElasticObservation, rollout_slots: int, train_slots: int) -> float:
    """T(n, m) = min(n * r * u, m * t): trained work per second at the split (n, m)."""
    return min(rollout_slots * obs.rollout_rate * obs.reuse, train_slots * obs.train_rate)


def step_seconds(obs: ElasticObservation, rollout_slots: int, train_slots: int) -> float:
    """S / T(n, m): seconds per train step at the split (n, m); inf when one side makes nothing."""
    rate = throughput(obs, rollout_slots, train_slots)
    return obs.batch_size / rate if rate > 0 else math.inf


def _ratio(value: float) -> float:
    """Busy time measured across an evaluation pause can exceed the interval a little: clamp to [0, 1]."""
    return min(1.0, max(0.0, value))


@dataclass(frozen=True)
class Totals:
    """A driver's cumulative counters since the run started (work in the policy's unit)."""

    wall_s: float = 0.0
    rollout_busy_s: float = 0.0
    """Summed over rollout slots: time with at least one group in flight (slot-seconds)."""
    generated: float = 0.0
    trainer_busy_s: float = 0.0
    """Time the trainer group spent in train steps."""
    trained: float = 0.0
    lent_busy_s: float = 0.0
    """Summed over lent engines: time generating (not paused) with a group in flight."""


@dataclass(frozen=True)
class Interval:
    """What happened between two version boundaries: `Totals` now minus `Totals` then."""

    seconds: float
    rollout_busy_s: float
    generated: float
    trainer_busy_s: float
    trained: float
    rollout_offered_s: float | None = None
    """Rollout slot-seconds offered in the interval (slots that came or went count for the time they
    were there); None: the interval's seconds x the rollout slots at the boundary."""
    lent_busy_s: float = 0.0
    """Lent engines' generating seconds (in the rollout rate; not in the rollout slots' idle ratio)."""

    @classmethod
    def between(cls, then: Totals, now: Totals) -> Interval:
        diff = {name: getattr(now, name) - getattr(then, name) for name in Totals.__dataclass_fields__}
        if any(v < 0 for v in diff.values()):
            raise ValueError(f"counters went backwards between {then} and {now}")
        return cls(
            seconds=diff["wall_s"],
            rollout_busy_s=diff["rollout_busy_s"],
            generated=diff["generated"],
            trainer_busy_s=diff["trainer_busy_s"],
            trained=diff["trained"],
            lent_busy_s=diff["lent_busy_s"],
        )


def observe(
    interval: Interval,
    *,
    step: int,
    version: int,
    steps_since_change: int,
    rollout_slots: int,
    train_slots: int,
    batch_size: float,
    replay_share: float = 0.0,
    fresh_waiting: int = 0,
    in_flight: int = 0,
    to_rollout_cost: RoleChangeCost | None = None,
    to_train_cost: RoleChangeCost | None = None,
    unit: Literal["samples", "tokens"] = "samples",
    lent_slots: int = 0,
    lendable_slots: int = 0,
    lend_window: LendWindow | None = None,
) -> ElasticObservation:
    """The policy's observation from one interval's counters (see the module docstring); a side with
    no busy time measured gets rate 0 (the policy then holds), an interval of no time idle 0. A lent
    engine's generating seconds count in r (work per generating slot-second), not in the rollout
    idle ratio, which stays the rollout slots' own (a lent engine generating would hide their wait).
    With lending on, `lend_window` (the trainer's steps since the last change, alone and beside a lent
    engine) gives the trainer's rate alone and lending's slowdown (`reflow.policy.lending`)."""
    generating = interval.rollout_busy_s + interval.lent_busy_s
    r = interval.generated / generating if generating > 0 else 0.0
    busy_train = interval.trainer_busy_s * train_slots
    t = interval.trained / busy_train if busy_train > 0 else 0.0
    wall = interval.seconds
    offered = interval.rollout_offered_s
    if offered is None:
        offered = rollout_slots * wall
    return ElasticObservation(
        step=step,
        version=version,
        steps_since_change=steps_since_change,
        rollout_slots=rollout_slots,
        train_slots=train_slots,
        rollout_rate=r,
        train_rate=t,
        batch_size=batch_size,
        reuse=reuse_from_share(replay_share),
        rollout_idle=_ratio(1 - interval.rollout_busy_s / offered) if offered > 0 else 0.0,
        train_idle=_ratio(1 - interval.trainer_busy_s / wall) if wall > 0 else 0.0,
        fresh_waiting=fresh_waiting,
        in_flight=in_flight,
        to_rollout_cost=to_rollout_cost,
        to_train_cost=to_train_cost,
        unit=unit,
        lent_slots=lent_slots,
        lendable_slots=lendable_slots,
        train_rate_alone=lend_window.alone_rate(train_slots) if lend_window is not None else None,
        lend_slowdown=lend_window.slowdown() if lend_window is not None and lent_slots else None,
    )


@dataclass(frozen=True)
class ElasticDecision:
    """The split to hold or move to, what the move is predicted to buy, and why (a metrics event)."""

    action: Literal["hold", "to_rollout", "to_train", "lend", "reclaim"]
    """to_rollout: one train slot becomes a rollout slot; to_train: the reverse; lend: one more train
    slot lends its engine (`reflow.policy.lending`); reclaim: one fewer does."""
    rollout_slots: int
    train_slots: int
    """The target split (the current one when holding)."""
    gain_s: float
    """Predicted seconds saved over the horizon by the move considered (0 when none was)."""
    cost_s: float
    """The change cost the gain was weighed against (measured, or the initial assumption)."""
    throughput_now: float
    throughput_target: float
    """T at the current and the target split (`unit` per second)."""
    reason: str
    lent_slots: int = 0
    """The target number of lending train slots (the current one unless lending or reclaiming)."""

    @property
    def moves(self) -> bool:
        return self.action != "hold"


class ElasticPolicy:
    """Decides, at each version boundary, whether one slot changes role (see the module docstring).

    `decide` keeps three facts between calls: the last version asked about (versions never go back),
    the version of its last move (it never moves twice in one version, however often asked) and the
    last slowdown lending was measured at (`lend_slowdown`: what lending costs once no slot lends
    any more, in place of `lend_overhead`).
    """

    def __init__(self, cfg: ElasticConfig | None = None) -> None:
        self.cfg = cfg or ElasticConfig()
        self.last_version: int | None = None
        self.last_move_version: int | None = None
        self.lend_slowdown: float | None = None

    def best_split(self, obs: ElasticObservation) -> tuple[int, int]:
        """The split with the highest T (no slot lending) within the slot minimums; ties go to the
        current split's side."""
        low, high = self.cfg.min_rollout, obs.slots - self.cfg.min_train
        if low > high:
            return obs.rollout_slots, obs.train_slots
        candidates = range(low, high + 1)
        best = max(
            candidates,
            key=lambda n: (self.throughput(obs, n, obs.slots - n), -abs(n - obs.rollout_slots)),
        )
        return best, obs.slots - best

    def throughput(
        self, obs: ElasticObservation, rollout_slots: int, train_slots: int, lent: int = 0
    ) -> float:
        """T at a split with `lent` train slots lending (`reflow.policy.lending.lent_throughput`), with
        the trainer's rate alone and lending's slowdown as the window measured them, else the last
        slowdown measured, else `lend_overhead` (`reflow.policy.lending.lending_cost`)."""
        prior = self.lend_slowdown if self.lend_slowdown is not None else self.cfg.lend_overhead
        rate, overhead = lending_cost(
            obs.train_rate, obs.lent_slots, prior, obs.train_rate_alone, obs.lend_slowdown
        )
        return lent_throughput(
            rollout_slots,
            train_slots,
            lent,
            rollout_rate=obs.rollout_rate,
            train_rate=rate,
            reuse=obs.reuse,
            overhead=overhead,
        )

    def decide(self, obs: ElasticObservation) -> ElasticDecision:
        """Hold, move one slot, or lend or reclaim one (module docstring; `reflow.policy.lending`). A
        move is weighed from the split with no slot lending (a lending slot's engine is reclaimed
        first, at this boundary, and the move comes at a later one); when both a move and a lend
        pay, the larger gain net of margin x cost wins (a lend costs nothing but its slowdown)."""
        if self.last_version is not None and obs.version < self.last_version:
            raise ValueError(f"policy version went backwards: {obs.version} after {self.last_version}")
        self.last_version = obs.version
        if obs.lent_slots and obs.lend_slowdown is not None:
            self.lend_slowdown = obs.lend_slowdown
        n, m, lent = obs.rollout_slots, obs.train_slots, obs.lent_slots
        now = self.throughput(obs, n, m, lent)
        state = (
            f"split {n} rollout + {m} train; r={obs.rollout_rate:g} {obs.unit}/s/slot x reuse "
            f"{obs.reuse:g}, t={obs.train_rate:g} {obs.unit}/s/slot; idle rollout {obs.rollout_idle:.0%} "
            f"train {obs.train_idle:.0%}; {obs.fresh_waiting} fresh groups waiting, {obs.in_flight} in flight"
        )
        if obs.lendable_slots:
            state += f"; {lent} of {obs.lendable_slots} train slots lending"
        if self.last_move_version == obs.version:
            return ElasticDecision(
                "hold",
                n,
                m,
                0.0,
                0.0,
                now,
                now,
                f"already moved a slot at version {obs.version} (or lent or reclaimed one); {state}",
                lent,
            )
        if n < self.cfg.min_rollout or m < self.cfg.min_train:
            raise ValueError(
                f"split {n} rollout + {m} train is below the minimums {self.cfg.min_rollout} + "
                f"{self.cfg.min_train}"
            )
        if obs.rollout_rate <= 0 or obs.train_rate <= 0:
            return ElasticDecision(
                "hold", n, m, 0.0, 0.0, now, now, f"no rate measured yet on both sides; {state}", lent
            )
        move = self._move(obs, now, state)
        lending = self._lending(obs, now, state)
        margin = self.cfg.margin
        if move.moves and (lending is None or move.gain_s - margin * move.cost_s >= lending.gain_s):
            decision = move
            if lent:  # the move needs every engine on its slots reclaimed first
                decision = replace(
                    move, action="reclaim", rollout_slots=n, train_slots=m, lent_slots=lent - 1,
                    reason=f"reclaim a lent engine first, then {move.reason}",
                )  # fmt: skip
        elif lending is not None:
            decision = lending
        else:
            decision = move
        if decision.moves:
            self.last_move_version = obs.version
        return decision

    def _move(self, obs: ElasticObservation, now: float, state: str) -> ElasticDecision:
        """One slot changing role, or a hold that says why not (the role-change model above)."""
        cfg = self.cfg
        n, m, lent = obs.rollout_slots, obs.train_slots, obs.lent_slots

        def hold(reason: str, gain: float = 0.0, cost: float = 0.0, target: float = now) -> ElasticDecision:
            return ElasticDecision("hold", n, m, gain, cost, now, target, reason, lent)

        best_n, _ = self.best_split(obs)
        if best_n == n:
            return hold(f"the current split is the best the model sees (T={now:.3g} {obs.unit}/s); {state}")
        if best_n > n:
            action, n2, m2, cost_obs = "to_rollout", n + 1, m - 1, obs.to_rollout_cost
            guard_ok = obs.train_idle >= obs.rollout_idle
            guard = "the trainer idles less than rollout"
        else:
            action, n2, m2, cost_obs = "to_train", n - 1, m + 1, obs.to_train_cost
            guard_ok = obs.rollout_idle >= obs.train_idle
            guard = "rollout idles less than the trainer"
        target = self.throughput(obs, n2, m2)
        cost = cost_obs.total_s if cost_obs is not None else cfg.initial_change_cost_s
        cost_src = "measured" if cost_obs is not None else "assumed"
        step_now, step_new = _seconds(obs.batch_size, now), _seconds(obs.batch_size, target)
        gain = cfg.horizon_steps * (step_now - step_new)
        move = (
            f"{action} ({n2} rollout + {m2} train): step {step_now:.3g} s -> {step_new:.3g} s, "
            f"gain {gain:.3g} s over {cfg.horizon_steps} steps vs {cost_src} cost {cost:.3g} s x margin "
            f"{cfg.margin:g} = {cost * cfg.margin:.3g} s"
        )
        if obs.steps_since_change < cfg.min_dwell_steps:
            return hold(
                f"dwell: {obs.steps_since_change} of {cfg.min_dwell_steps} steps since the last change; "
                f"would be {move}; {state}",
                gain,
                cost,
                target,
            )
        if not gain > cfg.margin * cost:
            return hold(f"not worth it: {move}; {state}", gain, cost, target)
        if not guard_ok:
            return hold(
                f"idle ratios disagree with the rate model ({guard}): {move}; {state}", gain, cost, target
            )
        return ElasticDecision(action, n2, m2, gain, cost, now, target, f"{move}; {state}", lent)

    def _lending(self, obs: ElasticObservation, now: float, state: str) -> ElasticDecision | None:
        """One more (or one fewer) train slot lending its engine when that lifts T by more than
        `lend_min_gain`, the idle ratios agree (lend: the trainer idles at least as much as rollout;
        reclaim: the reverse) and the last change is `min_dwell_steps` old; None when neither does."""
        n, m, lent = obs.rollout_slots, obs.train_slots, obs.lent_slots
        options = []
        if obs.steps_since_change < self.cfg.min_dwell_steps:
            return None  # a change (a move, a lend or a reclaim) needs its dwell, measured at its split
        if lent < obs.lendable_slots and obs.train_idle >= obs.rollout_idle:
            options.append(("lend", lent + 1))
        if lent > 0 and obs.rollout_idle >= obs.train_idle:
            options.append(("reclaim", lent - 1))
        best = None
        for action, lent2 in options:
            target = self.throughput(obs, n, m, lent2)
            if not relative_gain(now, target) > self.cfg.lend_min_gain:
                continue
            step_now, step_new = _seconds(obs.batch_size, now), _seconds(obs.batch_size, target)
            gain = self.cfg.horizon_steps * (step_now - step_new)
            why = (
                f"{action} ({lent2} of {obs.lendable_slots} train slots lending): T {now:.3g} -> "
                f"{target:.3g} {obs.unit}/s (+{relative_gain(now, target):.0%} > "
                f"{self.cfg.lend_min_gain:.0%}), step {step_now:.3g} s -> {step_new:.3g} s; {state}"
            )
            if best is None or gain > best.gain_s:
                best = ElasticDecision(action, n, m, gain, 0.0, now, target, why, lent2)  # type: ignore[arg-type]
        return best


def _seconds(batch_size: float, rate: float) -> float:
    return batch_size / rate if rate > 0 else math.inf


def decision_event(decision: ElasticDecision, obs: ElasticObservation) -> dict[str, Any]:
    """The metrics event of one decision, a hold too (the reason says why): what, why, the numbers
    (the schema in `reflow.policy.actuator`; the writer adds `kind`)."""
    return {
        "what": decision.action,
        "why": decision.reason,
        "step": obs.step,
        "version": obs.version,
        "rollout_slots": decision.rollout_slots,
        "train_slots": decision.train_slots,
        "gain_s": decision.gain_s,
        "cost_s": decision.cost_s,
        "throughput_now": decision.throughput_now,
        "throughput_target": decision.throughput_target,
        "lent_slots": decision.lent_slots,
        "rollout_rate": obs.rollout_rate,
        "train_rate": obs.train_rate,
        "train_rate_alone": obs.train_rate_alone,
        "lend_slowdown": obs.lend_slowdown,
        "rollout_idle": obs.rollout_idle,
        "train_idle": obs.train_idle,
        "reuse": obs.reuse,
        "unit": obs.unit,
    }
