"""`reflow simulate --from-run RUN`: a finished run's measured costs in, that run's figures predicted.

What it owns: the scenario built from a `RunMeasurement` (reflow/sim/measured.py) — the run's slots as
devices, its engines as constant-rate servers at their measured busy tokens/s, its trainer at its
measured tokens/s, its sync seconds, its stored groups resampled (shapes, turns, tool seconds, reward
spread), and its own policy settings (mode, eta, the replay cycle, the elastic and tail sections, lending among
them, the runtime's group limit per rollout worker, the sync loop's resample rounds) — and the
comparison: the run's steps/s, trained tokens/s and idle ratios against the simulated ones, averaged
over a few simulator seeds (a lending run's lent busy seconds, yields, episodes handed over and train
slot idle share shown beside them). Rates are compared relatively; idle ratios (shares of time) by
their difference.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from reflow.config import policy_active
from reflow.sim.config import Scenario, validate_scenario
from reflow.sim.measured import FIGURES, LENDING, RunMeasurement
from reflow.sim.simulation import simulate

TOLERANCE = 0.15
SEEDS = 5
"""Simulator seeds averaged per run (the run is one draw; the simulation's own noise is kept small)."""
RATES = ("steps_per_s", "trained_tokens_per_s")
"""Compared as simulated / measured - 1; the other figures (idle ratios) as simulated - measured."""


def _known(config_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """The run's settings that today's policy config has (a run's config may predate a field)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in (values or {}).items() if k in names}


def scenario_for(m: RunMeasurement, seed: int = 0) -> Scenario:
    """The simulator scenario of a measured run (see the module docstring)."""
    from reflow.config import renamed_replay_keys
    from reflow.policy.dual_cycle import CycleConfig
    from reflow.policy.elastic import ElasticConfig
    from reflow.policy.tail import TailConfig

    cfg, c = m.config, m.costs
    rollout = cfg.get("rollout") or {}
    replay = cfg.get("replay") or {}
    n = int(rollout.get("group_size", 8))
    max_batch = int(rollout.get("max_batch_size", 64))
    n_rollout, n_train = int(c["rollout_slots"]), int(c["train_slots"])
    sync = m.mode == "sync"
    gpus = n_rollout if sync else n_rollout + n_train
    train_gpus = gpus if sync else n_train
    tail = _known(TailConfig, cfg.get("tail") or {})  # the run's own: what its runtime applied
    mode: dict[str, Any] = {
        "mode": m.mode,
        "eta": int(replay.get("eta", 1)) if not sync else None,
        "partial_rollout": True,  # engines swap weights between decode steps; requests continue
        "recompute_logprob": False,  # the measured train seconds include it
        "elastic": policy_active((cfg.get("elastic") or {}).get("enabled"), m.mode),
        "tail": policy_active((cfg.get("tail") or {}).get("enabled"), m.mode),
        "tail_config": tail,
        "elastic_config": _known(ElasticConfig, cfg.get("elastic") or {}),
        "groups_per_engine": max(1, max_batch // n),
    }
    if m.mode not in ("async", "reflow"):  # only the decoupled loop feeds lent engines
        mode["elastic_config"].pop("lend", None)
    if sync:
        mode["resample_rounds"] = int(rollout.get("max_resample_rounds", 0))
        del mode["eta"]
    else:
        mode["rollout_gpus"] = n_rollout
    if m.mode == "reflow":
        mode["cycle"] = _known(CycleConfig, renamed_replay_keys(replay))
    device = (cfg.get("resources") or {}).get("device", "cpu")
    data = {
        "name": f"from-run {m.run_dir.name}",
        "description": f"measured costs of {m.run_dir}",
        "gpus": gpus,
        # placeholders: the measured rates below replace every hardware term
        "gpu": {"name": f"{device} slot", "hbm_gb_s": 1.0, "bf16_tflops": 1.0, "memory_gb": 1.0},
        "model": {"name": str(cfg.get("model", "model")), "params_b": 1e-3, "kv_bytes_per_token": 1.0},
        "decode": {
            "engine_tokens_per_s": c["engine_tokens_per_s"],
            "iter_fixed_s": 0.0,
            "max_running": max_batch,
        },
        "train": {
            "tokens_per_s": c["trainer_tokens_per_s"] * n_train / train_gpus,
            "fixed_s": 0.0,
            "logprob_factor": 0.0,
            "ref_factor": 0.0,
            "colocated_factor": 1.0,
        },
        "sync": {
            "fixed_s": c["sync_s"],
            "colocated_s": c["sync_s"],
            "bandwidth_gb_s": 1e6,
            "resume_s": 0.0,
            "role_change_s": c["role_change_s"],
        },
        "workload": {"groups_from": str(m.store), "max_response_tokens": 10**9},
        "batch": {"groups": int(rollout.get("groups_per_step", 8)), "samples_per_group": n},
        "mode": mode,
        "run": {"steps": m.steps, "warmup_steps": 0, "seed": seed},
    }
    return validate_scenario(data, f"--from-run {m.run_dir}")


@dataclass
class FigureRow:
    name: str
    measured: float
    simulated: float

    @property
    def relative(self) -> bool:
        return self.name in RATES

    @property
    def error(self) -> float:
        if self.relative:
            return self.simulated / self.measured - 1 if self.measured else float("inf")
        return self.simulated - self.measured

    @property
    def passed(self) -> bool:
        return abs(self.error) <= TOLERANCE


@dataclass
class RunComparison:
    measurement: RunMeasurement
    rows: list[FigureRow]
    simulated: dict[str, float]
    """The averaged simulated summary figures (FIGURES and a few more)."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)


SHOWN = (
    *FIGURES,
    "new_trained_tokens_per_s",
    "generated_tokens_per_s",
    "train_s",
    "trainer_wait_s",
    "staleness_mean",
)


def compare(m: RunMeasurement, seeds: int = SEEDS) -> RunComparison:
    """Simulate the measured run with `seeds` simulator seeds and compare the mean with the run."""
    runs = [simulate(scenario_for(m, seed)) for seed in range(seeds)]
    shown = [*SHOWN, *(k for k in LENDING if k in runs[0])]  # a lending run's counters too
    sim = {k: statistics.fmean(float(r[k]) for r in runs) for k in shown}
    rows = [FigureRow(k, m.figures[k], sim[k]) for k in FIGURES]
    return RunComparison(m, rows, sim)


def markdown(results: list[RunComparison]) -> str:
    lines = [
        "| run | mode | steps | figure | measured | simulated | error | within 15% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in results:
        m = c.measurement
        for r in c.rows:
            err = f"{r.error:+.1%}" if r.relative else f"{100 * r.error:+.1f} pt"
            lines.append(
                f"| {m.run_dir.name} | {m.mode} | {m.steps} | {r.name} | {r.measured:.4g} | {r.simulated:.4g} | "
                f"{err} | {'yes' if r.passed else 'no'} |"
            )
    return "\n".join(lines)
