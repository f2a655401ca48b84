"""The standard comparison of a scenario (`reflow simulate --config X --predict`): sync, async at eta 1
and 2, reflow with the static split (dual cycle only) and reflow in full (plus the elastic pool and
the tail scheduler), all on the same GPUs. Results are simulated, and say so wherever they are printed.
"""

from __future__ import annotations

from typing import Any

from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.engine import simulate

COLUMNS = (
    "seconds_per_step",
    "samples_per_s",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "rollout_idle_ratio",
    "trainer_idle_ratio",
    "staleness_mean",
    "replay_fraction",
)


def standard_modes(s: Scenario) -> dict[str, ModeConfig]:
    """The five modes, keeping the scenario's split and reflow cycle settings."""
    base = s.mode.model_dump(exclude={"mode", "eta", "staleness_threshold", "elastic", "tail"})
    return {
        "sync": ModeConfig(mode="sync"),
        "async eta=1": ModeConfig(**base, mode="async", eta=1),
        "async eta=2": ModeConfig(**base, mode="async", eta=2),
        "reflow static": ModeConfig(**base, mode="reflow", eta=1),
        "reflow full": ModeConfig(**base, mode="reflow", eta=1, elastic=True, tail=True),
    }


def predict(s: Scenario) -> dict[str, dict[str, Any]]:
    return {name: simulate(s, mode) for name, mode in standard_modes(s).items()}


def markdown(s: Scenario, rows: dict[str, dict[str, Any]]) -> str:
    sync = rows["sync"]["samples_per_s"]
    lines = [
        f"{s.name}: {s.gpus} x {s.gpu.name}, {s.model.name} (simulated)",
        "",
        "| mode | split | s/step | trained samples/s | vs sync | generated tok/s | trained tok/s | rollout idle | "
        "trainer idle | staleness | replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        split = "colocated" if r["mode"] == "sync" else f"{r['rollout_gpus']}:{r['train_gpus']}"
        lines.append(
            f"| {name} | {split} | {r['seconds_per_step']:.1f} | {r['samples_per_s']:.2f} | "
            f"{r['samples_per_s'] / sync:.2f}x | {r['generated_tokens_per_s']:.0f} | {r['trained_tokens_per_s']:.0f} | "
            f"{r['rollout_idle_ratio']:.2f} | "
            f"{r['trainer_idle_ratio']:.2f} | {r['staleness_mean']:.2f} | {r['replay_fraction']:.2f} |"
        )
    return "\n".join(lines)
