"""The standard comparison of a scenario (`reflow simulate --config X --predict`): sync, async at eta 1
and 2, reflow with the static split (dual cycle only) and reflow in full (plus the elastic pool and
the tail scheduler), all on the same GPUs; the same at each value of one key (`--sweep KEY=v1,v2`), and
the plot of several scenarios (`--plot PNG`). Results are simulated, and say so wherever they are printed.

The tables headline new tokens/s (tokens of groups trained for the first time) and give trained
tokens/s with replays beside it; every "vs sync" ratio names the rate it divides.
"""

from __future__ import annotations

from typing import Any

from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.drift import describe, drifts
from reflow.sim.policies import SGLANG_TAIL
from reflow.sim.simulation import simulate

COLUMNS = (
    "seconds_per_step",
    "samples_per_s",
    "new_trained_tokens_per_s",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "rollout_idle_ratio",
    "trainer_idle_ratio",
    "staleness_mean",
    "replay_fraction",
)


def standard_modes(s: Scenario) -> dict[str, ModeConfig]:
    """The five modes, keeping the scenario's split and reflow cycle settings; reflow full's tail does
    what the Ray runtime does on the GPU clusters predicted here, whose engines are SGLang
    (`policies.SGLANG_TAIL`: no migration, no concurrency limit), unless the scenario's tail_config
    says more."""
    base = s.mode.model_dump(exclude={"mode", "eta", "staleness_threshold", "elastic", "tail", "tail_config"})
    tail = {**SGLANG_TAIL, **s.mode.tail_config}
    return {
        "sync": ModeConfig(mode="sync"),
        "async eta=1": ModeConfig(**base, mode="async", eta=1),
        "async eta=2": ModeConfig(**base, mode="async", eta=2),
        "reflow static": ModeConfig(**base, mode="reflow", eta=1),
        "reflow full": ModeConfig(**base, mode="reflow", eta=1, elastic=True, tail=True, tail_config=tail),
    }


def predict(s: Scenario) -> dict[str, dict[str, Any]]:
    return {name: simulate(s, mode) for name, mode in standard_modes(s).items()}


def markdown(s: Scenario, rows: dict[str, dict[str, Any]]) -> str:
    """The comparison table; with a drifting workload, a line on the drift and two more columns: the
    split at the first step against the last (the elastic policy's moves) and the mean response tokens
    per sample of the groups started in the first and the last step."""
    sync, drift = rows["sync"], drifts(s)
    head = [f"{s.name}: {s.gpus} x {s.gpu.name}, {s.model.name} (simulated)"]
    if drift:
        head.append(f"{describe(s)}; {s.run.steps} steps, {s.run.warmup_steps} warm-up steps left out")
    extra = " split step 1 -> last | resp. tok/sample step 1 -> last |" if drift else ""
    lines = [
        *head,
        "",
        "| mode | split | new tok/s | vs sync (new tok/s) | trained tok/s (with replays) | "
        "vs sync (with replays) | s/step | generated tok/s | rollout idle | trainer idle | staleness | replay |"
        + extra,
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if drift else ""),
    ]
    for name, r in rows.items():
        split = "colocated" if r["mode"] == "sync" else f"{r['rollout_gpus']}:{r['train_gpus']}"
        lines.append(
            f"| {name} | {split} | {_rates(r, sync)} | {r['seconds_per_step']:.1f} | "
            f"{r['generated_tokens_per_s']:.0f} | {r['rollout_idle_ratio']:.2f} | "
            f"{r['trainer_idle_ratio']:.2f} | {r['staleness_mean']:.2f} | {r['replay_fraction']:.2f} |"
            + (_drift_cells(r) if drift else "")
        )
    return "\n".join(lines)


def _drift_cells(r: dict[str, Any]) -> str:
    """The split and the mean response tokens per sample at the first and the last step."""
    steps = r["step_records"]
    first, last = steps[0], steps[-1]
    split = "colocated"
    if r["mode"] != "sync":
        split = " -> ".join(f"{x['rollout_gpus']}:{x['train_gpus']}" for x in (first, last))
    tokens = [x["response_tokens_mean"] for x in (first, last)]
    resp = " -> ".join("-" if x is None else f"{x:.0f}" for x in tokens)
    return f" {split} | {resp} |"


def _rates(r: dict[str, Any], sync: dict[str, Any]) -> str:
    """The cells new tok/s, its ratio to sync's, trained tok/s with replays, its ratio to sync's."""
    cells = []
    for key in ("new_trained_tokens_per_s", "trained_tokens_per_s"):
        cells += [f"{r[key]:.0f}", f"{r[key] / sync[key]:.2f}x"]
    return " | ".join(cells)


def sweep(
    path: str, overrides: list[str], key: str, values: list[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """The standard comparison at each value of one scenario key (e.g. the response-length sigma, the
    reuse cap mode.cycle.max_reuse): value -> mode name -> summary."""
    from reflow.sim.config import load_scenario

    return {v: predict(load_scenario(path, [*overrides, f"{key}={v}"])) for v in values}


def sweep_markdown(key: str, rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        f"| {key} | mode | new tok/s | vs sync (new tok/s) | trained tok/s (with replays) | "
        "vs sync (with replays) | s/step | rollout idle | trainer idle | staleness | replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for value, by_mode in rows.items():
        for name, r in by_mode.items():
            lines.append(
                f"| {value} | {name} | {_rates(r, by_mode['sync'])} | "
                f"{r['seconds_per_step']:.1f} | {r['rollout_idle_ratio']:.2f} | {r['trainer_idle_ratio']:.2f} | "
                f"{r['staleness_mean']:.2f} | {r['replay_fraction']:.2f} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    """Grouped bars: new tokens/s (groups trained for the first time) of each mode relative to sync's,
    per scenario (labelled simulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    modes = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [
            results[n][mode]["new_trained_tokens_per_s"] / results[n]["sync"]["new_trained_tokens_per_s"]
            for n in names
        ]
        ax.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(names))], ys, width, label=mode)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), [n.replace("qwen3-", "") for n in names], fontsize=8)
    ax.set_ylabel("new tokens/s vs sync (first use)")
    ax.set_title("reflow simulate --predict (simulated, not measured)", fontsize=10)
    top = max(
        r[m]["new_trained_tokens_per_s"] / r["sync"]["new_trained_tokens_per_s"]
        for r in results.values()
        for m in modes
    )
    ax.set_ylim(0, top * 1.25)
    ax.legend(fontsize=7, ncol=len(modes), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
