"""The planning helper (`reflow simulate --plan`): a small grid over the rollout:train split, the staleness
bound eta, the reuse cap K and lending (each trainer GPU group's engine lent while the trainer waits,
reflow/sim/lending.py, on or off), each point simulated with the runtime's own policies (async: admission
control; reflow: plus the dual replay cycle), ranked by predicted trained tokens/s with replays; the
table gives new tokens/s (groups trained for the first time) beside it, since the simulator has no
model of what a replay is worth against a new group. Results are simulated and say so.

What it owns: the grid, the ranking and the table. The scenario (GPU, model, workload, costs) comes from
the workload file with `--model-size` and `--gpus` applied on top; a drifting workload (`workload.drift`)
drifts the same way at every grid point, so each split is judged over the whole run's growth.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.drift import describe
from reflow.sim.simulation import simulate

SPLITS = (0.25, 0.5, 0.75)
"""Rollout share of the GPUs tried by default."""
ETAS = (1, 2)
REUSE = (1, 2)
"""Reuse caps K (CycleConfig.max_reuse) tried for reflow; K = 1 trains every sample once."""
LEND = (False, True)
"""Lending tried off and on (static: every train slot lends, at the scenario's
`sync.lend_beside_slowdown` and `sync.lend_switch_s`; the elastic policy, which would reclaim where it
does not pay, is off)."""


@dataclass
class PlanRow:
    mode: str
    rollout_gpus: int | None
    train_gpus: int | None
    eta: int | None
    max_reuse: int | None
    summary: dict[str, Any]
    lend: bool = False

    @property
    def trained_tok_s(self) -> float:
        return float(self.summary["trained_tokens_per_s"])


def model_file(size: str, folder: str | Path = "configs/sim/models") -> Path:
    """The model file for a size such as 8B (configs/sim/models/*-8b.yaml); exactly one must match."""
    hits = sorted(Path(folder).glob(f"*-{size.lower()}.yaml"))
    if len(hits) != 1:
        names = ", ".join(p.stem for p in sorted(Path(folder).glob("*.yaml")))
        raise ValueError(f"--model-size {size}: {len(hits)} model files match in {folder} (have: {names})")
    return hits[0]


def rollout_gpu_choices(s: Scenario, splits: tuple[float, ...]) -> list[int]:
    """Rollout GPU counts for the split shares: whole engines (decode.tp), at least one trainer GPU."""
    tp = s.decode.tp
    out = []
    for share in splits:
        n = max(tp, round(s.gpus * share / tp) * tp)
        if n < s.gpus and n not in out:
            out.append(n)
    if not out:
        raise ValueError(f"{s.gpus} GPUs leave no rollout:train split with {tp}-GPU engines")
    return out


def plan(
    s: Scenario,
    splits: tuple[float, ...] = SPLITS,
    etas: tuple[int, ...] = ETAS,
    reuse: tuple[int, ...] = REUSE,
    lend: tuple[bool, ...] = LEND,
) -> list[PlanRow]:
    """Every grid point plus the colocated sync baseline, best predicted trained tokens/s first."""
    cycle = dict(s.mode.cycle) if s.mode.mode == "reflow" else {}
    rows = [PlanRow("sync", None, None, 0, None, simulate(s, ModeConfig(mode="sync")))]
    for r in rollout_gpu_choices(s, splits):
        for eta in etas:
            for lends in lend:
                # lending's policy knobs as the scenario gives them, else the policy's defaults; every
                # row keeps the scenario's groups per engine (dropped, a rollout engine took all of
                # admission's room and a lending row's lent engines none)
                lending = {"elastic_config": {**s.mode.elastic_config, "lend": True}} if lends else {}
                lending["groups_per_engine"] = s.mode.groups_per_engine
                mode = ModeConfig(mode="async", rollout_gpus=r, eta=eta, **lending)
                rows.append(PlanRow("async", r, s.gpus - r, eta, None, simulate(s, mode), lends))
                for k in reuse:
                    k_cycle = {**cycle, "max_reuse": k}
                    mode = ModeConfig(mode="reflow", rollout_gpus=r, eta=eta, cycle=k_cycle, **lending)
                    rows.append(PlanRow("reflow", r, s.gpus - r, eta, k, simulate(s, mode), lends))
    return sorted(rows, key=lambda row: -row.trained_tok_s)


def markdown(s: Scenario, rows: list[PlanRow], top: int = 5) -> str:
    sync_row = next(r for r in rows if r.mode == "sync")
    sync, sync_new = sync_row.trained_tok_s, sync_row.summary["new_trained_tokens_per_s"]
    best = rows[0]
    split = "colocated" if best.mode == "sync" else f"{best.rollout_gpus}:{best.train_gpus}"
    lines = [
        f"plan for {s.name}: {s.gpus} x {s.gpu.name}, {s.model.name} (simulated)",
        f"recommended: {best.mode} {split} eta={best.eta} K={best.max_reuse or 1} "
        f"lending {'on' if best.lend else 'off'} "
        f"({best.trained_tok_s:.0f} trained tok/s with replays, {best.trained_tok_s / sync:.2f}x sync's; "
        f"{best.summary['new_trained_tokens_per_s'] / sync_new:.2f}x sync's new tok/s)",
        *([f"{describe(s)}; {s.run.steps} steps"] if describe(s) else []),
        "",
        "| rank | mode | rollout:train | eta | K | lend | new tok/s | vs sync (new tok/s) | "
        "trained tok/s (with replays) | vs sync (with replays) | s/step | rollout idle | "
        "trainer idle | staleness | replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown = rows[:top] + [r for r in rows[top:] if r.mode == "sync"]
    for r in shown:
        m = r.summary
        split = "colocated" if r.mode == "sync" else f"{r.rollout_gpus}:{r.train_gpus}"
        rank = rows.index(r) + 1
        lines.append(
            f"| {rank} | {r.mode} | {split} | {r.eta} | {r.max_reuse or 1} | {'on' if r.lend else 'off'} | "
            f"{m['new_trained_tokens_per_s']:.0f} | {m['new_trained_tokens_per_s'] / sync_new:.2f}x | "
            f"{r.trained_tok_s:.0f} | {r.trained_tok_s / sync:.2f}x | {m['seconds_per_step']:.1f} | {m['rollout_idle_ratio']:.2f} | "
            f"{m['trainer_idle_ratio']:.2f} | {m['staleness_mean']:.2f} | {m['replay_fraction']:.2f} |"
        )
    return "\n".join(lines)
