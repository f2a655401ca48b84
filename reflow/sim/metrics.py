"""What a simulation reports, under the names the real runs use (reflow/recipes/run_log.py
`step_record` and `run_summary`): seconds_per_step, generated_tokens_per_s, new_trained_tokens_per_s
(the tokens of groups trained for the first time: a step's fresh groups, as the store knows them),
trained_tokens_per_s (every replay counted again), rollout_idle_ratio, trainer_idle_ratio, staleness_hist, reuse_hist, plus the simulator's own
(steps_per_s, partial_ratio, the policy events, and the workload as sampled: response_tokens_mean and
turns_mean per sample, also per step in the step records, where a drifting workload's growth shows).
Per-step rates are steady-state: measured from the end of the warm-up steps to the end of the run, as
one would read them off a long run's metrics.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from reflow.metrics import idle_ratio
from reflow.metrics import quantile as _quantile
from reflow.sim.config import Scenario
from reflow.sim.costs import SampleShape
from reflow.sim.store import SimStore


class Recorder:
    def __init__(self, n_engines: int) -> None:
        self.generated_tokens = 0.0
        self.trained_tokens = 0.0
        self.new_trained_tokens = 0.0
        self.processed_tokens = 0.0
        self.resume_s: list[float] = []
        self.steps_no_signal = 0
        self.samples_trained = 0
        self.samples_generated = 0
        self.trainer_busy_s = 0.0
        self.sync_s: list[float] = []
        self.staleness: Counter[int] = Counter()
        self.partial_groups = 0
        self.groups_trained = 0
        self.replayed_groups = 0
        self.group_seconds: list[float] = []
        self.tool_s: list[float] = []
        self.episode_seconds: list[float] = []
        self.steps: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.engine_slots = n_engines
        self.retired_busy_s = 0.0
        self.retired_alive_s = 0.0
        self._created: dict[int, float] = {}
        self.started_by_version: dict[int, list[int]] = {}  # version -> samples, generated, turns

    def generated(self, tokens: float) -> None:
        self.generated_tokens += tokens

    def started(self, shapes: list[SampleShape], version: int) -> None:
        """A group starts at `version` with these sample shapes: the workload as sampled, so a drifting
        workload's growth shows per step without the bias of which groups finish first."""
        counts = self.started_by_version.setdefault(version, [0, 0, 0])
        counts[0] += len(shapes)
        counts[1] += sum(sum(x.turns) for x in shapes)
        counts[2] += sum(len(x.turns) for x in shapes)

    def tool(self, seconds: float) -> None:
        self.tool_s.append(seconds)

    def group(self, seconds: float, samples: int) -> None:
        self.group_seconds.append(seconds)
        self.samples_generated += samples

    def episode(self, seconds: float) -> None:
        self.episode_seconds.append(seconds)

    def trained(self, plan, version: int, samples: int) -> None:
        """A step starts on `plan`: its generated tokens are what the runs count as trained tokens
        (the loss's tokens), the fresh groups' (unconsumed in the store until this step) new work;
        the prompt and tool tokens it processes as well count separately."""
        self.trained_tokens += sum(g.meta["generated"] for g in plan.groups)
        self.new_trained_tokens += sum(g.meta["generated"] for g in plan.fresh)
        self.processed_tokens += sum(g.meta["tokens"] for g in plan.groups)
        self.samples_trained += plan.size * samples
        self.groups_trained += plan.size
        self.replayed_groups += len(plan.replay)
        self.partial_groups += sum(bool(g.meta.get("partial")) for g in plan.groups)
        for age in plan.staleness(version):
            self.staleness[age] += 1

    def trainer_busy(self, seconds: float) -> None:
        self.trainer_busy_s += seconds

    def sync(self, seconds: float) -> None:
        self.sync_s.append(seconds)

    def resume(self, seconds: float) -> None:
        """An engine's pause after a partial-rollout sync (`SimTrainer.resume_pause`)."""
        self.resume_s.append(seconds)

    def no_signal(self) -> None:
        """A sync step's rounds ended with no group with reward spread: no step taken."""
        self.steps_no_signal += 1

    def event(self, record: dict[str, Any]) -> None:
        self.events.append(record)

    def retire(self, engine, now: float) -> None:
        self.retired_busy_s += engine.busy_s
        self.retired_alive_s += now - self._created.get(engine.eid, 0.0)

    def created(self, engine, now: float) -> None:
        self._created[engine.eid] = now

    def rollout_busy(self, engines: list, now: float) -> tuple[float, float]:
        """Busy and alive engine-seconds so far, the retired engines' included."""
        busy = self.retired_busy_s + sum(e.busy_s for e in engines if e.alive)
        alive = self.retired_alive_s + sum(now - self._created.get(e.eid, 0.0) for e in engines if e.alive)
        return busy, alive

    def version(
        self,
        now: float,
        version: int,
        engines: list,
        tp: int,
        train_gpus: int,
        replay_share: float,
        phase: dict[str, float],
    ) -> None:
        """A version boundary: one step record (`phase`: the trainer's wait and train seconds)."""
        busy, alive = self.rollout_busy(engines, now)
        samples, generated, turns = self.started_by_version.get(version - 1, (0, 0, 0))
        self.steps.append(
            {
                "step": len(self.steps) + 1,
                "version": version,
                "wall_s": now,
                "generated_tokens": self.generated_tokens,
                "trained_tokens": self.trained_tokens,
                "new_trained_tokens": self.new_trained_tokens,
                "processed_tokens": self.processed_tokens,
                "samples_trained": self.samples_trained,
                "rollout_idle_ratio": idle_ratio(busy, alive),
                "trainer_idle_ratio": idle_ratio(self.trainer_busy_s, now),
                "replay_share": replay_share,
                "rollout_gpus": sum(e.alive for e in engines) * tp,
                "train_gpus": train_gpus,
                "trainer_wait_s": phase.get("wait_s", 0.0),
                "train_s": phase.get("train_s", 0.0),
                # per sample of the groups started at the version that just ended (None: none started)
                "response_tokens_mean": generated / samples if samples else None,
                "turns_mean": turns / samples if samples else None,
                "_busy": (busy, alive, self.trainer_busy_s),
            }
        )

    def summary(self, s: Scenario, mode: str, store: SimStore, now: float) -> dict[str, Any]:
        steps = self.steps
        warm = min(s.run.warmup_steps, len(steps) - 1)
        first = (
            steps[warm - 1]
            if warm > 0
            else {
                "wall_s": 0.0,
                "generated_tokens": 0.0,
                "trained_tokens": 0.0,
                "new_trained_tokens": 0.0,
                "processed_tokens": 0.0,
                "samples_trained": 0,
                "_busy": (0.0, 0.0, 0.0),
            }
        )
        last = steps[-1]
        window = max(last["wall_s"] - first["wall_s"], 1e-9)
        n = len(steps) - warm
        busy0, alive0, train0 = first["_busy"]
        busy1, alive1, train1 = last["_busy"]
        hist = store.reuse_histogram()
        started = [sum(c[i] for c in self.started_by_version.values()) for i in range(3)]
        return {
            "mode": mode,
            "scenario": s.name,
            "gpus": s.gpus,
            "rollout_gpus": last["rollout_gpus"],
            "train_gpus": last["train_gpus"],
            "steps": len(steps),
            "seconds_per_step": window / n,
            "steps_per_s": n / window,
            "generated_tokens_per_s": (last["generated_tokens"] - first["generated_tokens"]) / window,
            "new_trained_tokens_per_s": (last["new_trained_tokens"] - first["new_trained_tokens"]) / window,
            "trained_tokens_per_s": (last["trained_tokens"] - first["trained_tokens"]) / window,
            "processed_tokens_per_s": (last["processed_tokens"] - first["processed_tokens"]) / window,
            "samples_per_s": (last["samples_trained"] - first["samples_trained"]) / window,
            "rollout_idle_ratio": idle_ratio(busy1 - busy0, alive1 - alive0),
            "trainer_idle_ratio": idle_ratio(train1 - train0, window),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "staleness_mean": sum(k * v for k, v in self.staleness.items())
            / max(1, sum(self.staleness.values())),
            "reuse_hist": {str(k): v for k, v in hist.items()},
            "replay_fraction": self.replayed_groups / max(1, self.groups_trained),
            "partial_ratio": self.partial_groups / max(1, self.groups_trained),
            "sync_s_mean": sum(self.sync_s) / max(1, len(self.sync_s)),
            "resume_s_mean": sum(self.resume_s) / max(1, len(self.resume_s)),
            "steps_no_signal": self.steps_no_signal,
            "trainer_wait_s": sum(r["trainer_wait_s"] for r in steps[warm:]) / n,
            "train_s": sum(r["train_s"] for r in steps[warm:]) / n,
            "group_seconds_p50": _quantile(self.group_seconds, 0.5),
            "group_seconds_p99": _quantile(self.group_seconds, 0.99),
            "tool_latency_p50_ms": 1000 * _quantile(self.tool_s, 0.5),
            "tool_latency_p99_ms": 1000 * _quantile(self.tool_s, 0.99),
            "response_tokens_mean": started[1] / max(1, started[0]),
            "turns_mean": started[2] / max(1, started[0]),
            "wall_s": now,
            "events": self.events,
            "step_records": [{k: v for k, v in r.items() if not k.startswith("_")} for r in steps],
        }
