"""Over-provisioned rounds with an abort at the target, in the colocated sync mode: slime's rollout loop
(`generate_rollout_async` in slime/rollout/sglang_example.py of the APRIL repository,
RLsys-Foundation/APRIL; APRIL is arXiv 2509.18521).

A round needs B groups with reward spread. `mode.over_sampling_groups` (slime's
`--over-sampling-batch-size`, N' >= B) groups start at once, the groups carried over from the last
round first; whenever the groups started this round less those that came back without spread (the
dynamic-sampling filter) fall short of B, another N' start. Once B groups with spread are done, every
request still running or waiting is aborted. With `mode.abort_carry` (slime's `--partial-rollout`,
APRIL) each unfinished group keeps its samples' progress (finished samples stay finished) and starts
first in the next round, its partial responses re-prefilled under the new weights; without it the
unfinished groups are dropped. Either way the tokens they generated count as generated, as slime's
rollout throughput (total completion tokens / rollout time) counts them.

`OverProvision` is the loop's arithmetic (how many groups may start) and its one figure,
`off_policy_ratio` as APRIL's slime logs it: per round, the tokens the resumed samples had generated in
their last stretch before the abort (under older weights) over those plus the round's generated tokens.
The simulation applies the abort and the resumption (`Simulation.abort_round`, `Simulation.resume_group`).
"""

from __future__ import annotations

from collections import deque

from reflow.sim.engines import GroupState


class OverProvision:
    """One sync step's collection as slime does it: start `left()` groups (carried ones first), report
    each as it ends (`done`), `close` at the abort, `reset` for the next round."""

    def __init__(self, want: int, chunk: int) -> None:
        if chunk < want:
            raise ValueError(f"over_sampling_groups {chunk} is below the batch's {want} groups")
        self.want, self.chunk = want, chunk
        self.carried: deque[GroupState] = deque()
        """Aborted groups that start first in the next round (abort_carry), oldest first."""
        self.live: dict[str, GroupState] = {}
        """Groups started (or resumed) and not done: the ones an abort stops."""
        self.off_policy_tokens: dict[int, float] = {}
        """Per round (the weights' version it generates with): tokens its resumed samples carried in."""
        self.reset()

    def reset(self) -> None:
        """A new round: one chunk may start."""
        self.quota, self.started, self.filtered, self.closed = self.chunk, 0, 0, False

    def left(self) -> int:
        """Groups that may start now (0 once the round is closed)."""
        return 0 if self.closed else max(0, self.quota - self.started)

    def start(self, g: GroupState) -> None:
        """A group started, or a carried one resumed."""
        self.started += 1
        self.live[g.gid] = g

    def done(self, g: GroupState, has_spread: bool) -> None:
        """A group ended. One without spread is filtered: while the groups started less the filtered
        ones fall short of the target, another chunk may start (slime's remaining_batch_size)."""
        self.live.pop(g.gid, None)
        if not has_spread:
            self.filtered += 1
        while self.quota - self.filtered < self.want:
            self.quota += self.chunk

    def resumed(self, version: int, tokens: float) -> None:
        """A carried sample resumes in round `version` with `tokens` from its last stretch."""
        self.off_policy_tokens[version] = self.off_policy_tokens.get(version, 0.0) + tokens

    def summary(self, steps: list[dict], warmup: int) -> dict[str, float]:
        """Over the rounds after the warm-up (the step records' window): off-policy tokens / (those +
        generated tokens), as APRIL's slime computes `off_policy_ratio` per round, summed."""
        warm = min(warmup, len(steps) - 1)
        generated = steps[-1]["generated_tokens"] - (steps[warm - 1]["generated_tokens"] if warm > 0 else 0.0)
        off = sum(t for v, t in self.off_policy_tokens.items() if warm <= v < len(steps))
        return {"off_policy_ratio": off / (generated + off) if generated + off > 0 else 0.0}

    def close(self) -> list[GroupState]:
        """The target is met: nothing more starts this round. Returns the groups to abort, in the order
        they started."""
        self.closed = True
        out = list(self.live.values())
        self.live.clear()
        return out
