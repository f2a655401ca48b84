"""Tail handling in sync mode (`tail.enabled: true`; off by default in sync): over-provisioning and
partial rollouts, as slime's APRIL has them.

A round starts B + delta groups (delta from the tail's heaviness: the `TailGate` the decoupled loop
asks, without per-episode actions) and ends once B are done. With `tail.carry_over` (the default) the
groups still running pause (`RolloutWorker.pause_episodes`: requests aborted, their tokens kept) through
the train step and the weight update, and resume in the next round on the new weights: their earlier
tokens are one version stale, so their per-token versions and the importance weights apply (the sync
trainer takes the engine's log-probs as the behaviour policy's for tokens older than its weights). With
`carry_over: false` they are cancelled and their tasks start over in the next round. Groups with
reward spread done beyond B train in the next round first (the oldest groups train first). A round waits
for the groups it carried in, so no token is more than one version stale: the price is that a carried
straggler holds its second round open. An episode's deadlines (the runner's, the env's, an env
server's session) move by the seconds it waited paused (`reflow.rollout.pauses`). Nothing is lost between rounds; a
resume takes up the groups one version old; at the end of the run the unfinished groups are cancelled
(one that finished first is stored, and the `run_end` event says so).

With more than one rollout worker, the tail's per-episode actions apply as in the decoupled modes
(`tail.migrate`, `tail.set_concurrency`; `reflow.runtime.tail.TailRuntime`): a round's stragglers
migrate onto fewer engines, and an engine so freed starts the next round's groups (counted as
over-provisioned): they count in the next round, not in this one (so a short group started early
cannot close this round ahead of its own stragglers), pause with the stragglers at the round's end and
resume on the new weights (with carry-over; without it, nothing starts early); with
`tail.set_concurrency`, each engine's concurrency limit follows its measured knee. With one rollout
worker there is nothing to migrate to.

A round counts as done its groups with reward spread, and its zero-spread groups beyond the ones
`rollout.max_resample_rounds` lets it replace (B per resampling round): with resampling off a round
ends after B groups, as plain sync's does. The group and episode durations the tail reads leave the
pauses out (an episode's record keeps `timings["total_s"]` and `timings["paused_s"]`); checkpoints save
them and, with `tail.set_concurrency`, the engines' concurrency limits (`state_dict`), which a resume
restores.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.policy.tail import TailPolicy
from reflow.recipes.loop_counters import saved_durations
from reflow.recipes.run_log import RunLog
from reflow.recipes.run_state import RunState, next_seeds, observe_tasks
from reflow.runtime.cluster import Cluster
from reflow.runtime.tail import GroupInFlight
from reflow.runtime.tail_gate import TailGate, tail_runtime
from reflow.runtime.workers import GroupReport

CANCEL_TIMEOUT_S = 30.0
"""How long the loop waits for its cancelled groups to end before it goes on without them."""


@dataclass
class Running:
    """A group in flight: its task seed, where and since when (pauses left out)."""

    seed: int
    group: GroupInFlight
    carried: bool = False
    """Carried into this round: the round waits for it (its tokens stay at most one version stale)."""
    early: bool = False
    """Started for the next round on an engine freed by consolidation: it counts there, not in this one."""


class SyncTail:
    """The sync loop's collector with tail handling (module docstring). `pending`: groups stored with
    the current weights before a resume, used first."""

    def __init__(self, cluster: Cluster, config: RunConfig, pending: list[GroupReport] | None = None) -> None:
        r = config.rollout
        self.cluster, self.config, self.batch = cluster, config, r.groups_per_step
        self.policy = TailPolicy(config.tail.policy_config())
        self.carry = self.policy.cfg.carry_over
        per_worker = max(1, r.max_batch_size // r.group_size)
        # per-episode actions need a second engine to move to (one engine keeps its limits as they are)
        runtime = tail_runtime(cluster, config) if len(cluster.rollout) > 1 else None
        self.gate = TailGate(self.policy, self.batch, per_worker, r.group_size, runtime)
        self.running: dict[Any, Running] = {}
        self.spare: list[GroupReport] = []  # groups with spread done beyond B, counted already
        self.leftover = list(pending or [])  # stored before a resume, counted in the next round
        self.restart: list[int] = []  # task seeds of cancelled groups (carry_over off)
        self.seconds: list[float] = []
        self.episode_seconds: list[float] = []
        self.paused_at: float | None = None
        self.dropped: list[str] = []
        """Groups the last round retired untrained (they would have trained two versions stale)."""

    def collect(self, state: RunState, log: RunLog) -> tuple[list[GroupReport], list[GroupReport]]:
        """(B groups with reward spread or fewer, every group that arrived in this round)."""
        self._resume()
        reports, self.leftover = self.leftover, []
        usable = [*self.spare, *(r for r in reports if r.has_spread)]
        zero, self.spare = sum(not r.has_spread for r in reports), []
        allowance = self.config.rollout.max_resample_rounds * self.batch
        while True:
            done = len(usable) + max(0, zero - allowance)
            loads = [0] * len(self.cluster.rollout)
            for run in self.running.values():
                loads[run.group.worker] += 1
            # an engine freed by consolidating the stragglers may start the next round's groups:
            # they pause with the round's stragglers and resume on the new weights (carry-over only)
            early_done = len(self.leftover)  # the next round's groups done already (started early)
            next_room = max(0, 2 * self.batch - done - len(self.running) - early_done) if self.carry else 0
            in_flight = [r.group for r in self.running.values()]
            versions = [state.version] * len(loads)  # sync: every engine holds the trainer's weights
            look = self.gate.look(done, in_flight, loads, time.monotonic(), next_room, versions)
            state.tail_migrations += look.migrations
            self._log(state, log, look.events)
            early = look.only is not None  # the room is the next round's, on the freed engines
            while done < self.batch and look.allows() and (w := look.worker()) is not None:
                state.tail_over_provisioned += look.take(w) or early  # started beyond this round's B
                self._launch(w, state, early)
            current = [r for r in self.running.values() if not r.early]
            if (
                not current and done < self.batch
            ):  # only early groups left to fill this round: they count here
                for run in self.running.values():
                    run.early = False
                current = list(self.running.values())
            if not current or (done >= self.batch and not any(r.carried for r in current)):
                break
            wake = self.gate.wake_s(len(self.running))  # with migrations: look again at the tail
            ready, _ = ray.wait(list(self.running), num_returns=1, timeout=wake)
            for ref in ready:
                run = self.running.pop(ref)
                (report,) = ray.get(ref)
                report.seconds = time.monotonic() - run.group.started  # its pauses left out
                observe_tasks(self.config, state, [run.seed], [report])
                self.seconds.append(report.seconds)
                if run.early:  # the next round's: it counts there (one version stale)
                    self.leftover.append(report)
                    self.episode_seconds += report.episode_seconds
                    continue
                reports.append(report)
                usable += [report] if report.has_spread else []
                zero += not report.has_spread
                self.episode_seconds += report.episode_seconds
            self.gate.observe(self.seconds, self.episode_seconds)
        usable.sort(key=lambda r: r.policy_version)  # the carried-in groups train now, not a round later
        self.spare = [r for r in usable[self.batch :] if r.policy_version >= state.version]
        # a spare group already one version old would train two versions stale next round: retired
        # (rare: more groups of the last version done than a batch, e.g. after a resume)
        self.dropped = [r.group_id for r in usable[self.batch :] if r.policy_version < state.version]
        if self.dropped:
            why = f"{len(self.dropped)} groups of version < {state.version} left beyond the batch: retired, not trained two versions stale"
            self._log(
                state,
                log,
                [{"what": "stale_retired", "why": why, "applied": True, "groups": len(self.dropped)}],
            )
        self._carry(state)
        return usable[: self.batch], reports

    def state_dict(self) -> dict[str, Any]:
        """The adaptive state a checkpoint saves (`RunState.scheduler`, the decoupled loop's keys): the
        recent group and episode durations behind the quantiles, each engine's concurrency limit."""
        return {
            "durations": saved_durations(self.seconds, self.episode_seconds),
            "tail": self.gate.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any], state: RunState, log: RunLog) -> None:
        """A resume: the saved durations and concurrency limits back (the limits' events logged)."""
        durations = saved.get("durations", {})
        self.seconds += durations.get("group_s", [])
        self.episode_seconds += durations.get("episode_s", [])
        if self.seconds:
            self.gate.observe(self.seconds, self.episode_seconds)
        self._log(state, log, self.gate.load_state_dict(saved.get("tail", {})))

    def close(self, state: RunState, log: RunLog) -> None:
        """The run is over: the groups still in flight or paused are cancelled (a group that finished
        meanwhile is stored: its tokens count, its event says so), then the workers' episodes may
        generate again. Groups started early for a next round and done are stored untrained: counted
        the same way."""
        dropped = len(self.running)
        done = [report for _, report in self._cancel()] + self.leftover
        self.leftover = []
        state.generated_tokens += sum(r.generated_tokens for r in done)
        if done or dropped:
            why = (
                f"the run ended: {dropped} unfinished groups cancelled, {len(done)} groups stored "
                "untrained (finished first, or started for a next round)"
            )
            log.write("tail", {"step": state.step, "version": state.version, "what": "run_end",
                               "why": why, "applied": True, "dropped": dropped, "stored": len(done)})  # fmt: skip
        if self.paused_at is not None:
            ray.get([w.resume_episodes.remote() for w in self.cluster.rollout])
            self.paused_at = None
        self._log(state, log, self.gate.close(time.monotonic()))  # migrations measured, not yet logged
        state.scheduler = self.state_dict()  # the run's final checkpoint keeps what it ended with

    @staticmethod
    def _log(state: RunState, log: RunLog, events: list[dict[str, Any]]) -> None:
        for event in events:
            log.write("tail", {"step": state.step, "version": state.version, **event})

    def _cancel(self) -> list[tuple[Running, GroupReport]]:
        """Cancel every group in flight and wait for the cancellations (a paused episode ends where it
        waits): none runs on after this. Returns the groups that finished first (stored)."""
        running, self.running = self.running, {}
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        refs = list(running)
        ended, _ = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_TIMEOUT_S) if refs else ([], [])
        done: list[tuple[Running, GroupReport]] = []
        for ref in ended:
            with contextlib.suppress(Exception):  # cancelled (or failed): nothing was stored
                (report,) = ray.get(ref)
                done.append((running[ref], report))
        return done

    def _launch(self, worker: int, state: RunState, early: bool = False) -> None:
        seed = self.restart.pop(0) if self.restart else next_seeds(state, 1, self.config)[0]
        group_id = uuid.uuid4().hex  # named here: the tail runtime finds its episodes in the workers' reports
        ref = self.cluster.rollout[worker].generate.remote([seed], [group_id])
        self.running[ref] = Running(seed, GroupInFlight(worker, group_id, time.monotonic()), early=early)

    def _carry(self, state: RunState) -> None:
        """B done: the groups still running pause until the next round, or start over then."""
        if not self.running:
            return
        if self.carry:
            ray.get([w.pause_episodes.remote() for w in self.cluster.rollout])
            self.paused_at = time.monotonic()
            state.tail_carried_over += len(self.running)
            for run in self.running.values():
                run.carried, run.early = True, False  # the next round waits for each, and counts it
            return
        seeds = [run.seed for run in self.running.values()]
        finished = self._cancel()  # a group that finished meanwhile is stored: the next round counts it
        self.leftover += [report for _, report in finished]
        done = {run.seed for run, _ in finished}
        self.restart += [seed for seed in seeds if seed not in done]

    def _resume(self) -> None:
        if self.paused_at is None:
            return
        ray.get([w.resume_episodes.remote() for w in self.cluster.rollout])
        paused_s, self.paused_at = time.monotonic() - self.paused_at, None
        for run in self.running.values():
            run.group.started += paused_s
