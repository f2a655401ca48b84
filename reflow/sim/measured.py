"""What a finished run measured, read as simulator inputs and as the figures to predict
(`reflow simulate --from-run RUN`).

What it owns: reading a run folder as `reflow agent-train` and `reflow bench modes` leave it —
`config.yaml` (the run config), `metrics.jsonl` (reflow/recipes/run_log.py: `step` records with
cumulative counters, `no_signal` records, the `summary`) and `replay.sqlite` (every group generated) —
into (1) the measured costs: an engine's tokens/s while busy, a trainer device's tokens/s, the weight
sync seconds, the slot split, the run's policy settings and its stored groups (each episode's prompt,
turns, tool seconds and tool-output tokens, the group's reward spread), and (2) the run's figures:
steps/s, trained tokens/s and the rollout and trainer idle ratios at its last step.
The scenario is built in reflow/sim/from_run.py.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from reflow.errors import ConfigError
from reflow.sim.costs import GroupShape, SampleShape

FIGURES = ("steps_per_s", "trained_tokens_per_s", "rollout_idle_ratio", "trainer_idle_ratio")
"""What --from-run predicts and compares."""
LENDING = ("lent_busy_s", "lent_yields", "lent_handed_over", "train_slot_idle_ratio")
"""A lending run's counters and its train slot's idle share (its summary's, whole-run; a `--from-run`
scenario has no warm-up steps, so the simulated ones are whole-run too), shown beside the figures."""


@dataclass
class RunMeasurement:
    run_dir: Path
    config: dict[str, Any]
    """The run's config.yaml as written (no validation: a run may predate today's fields)."""
    mode: str
    steps: int
    wall_s: float
    figures: dict[str, float]
    """The FIGURES at the run's last step (cumulative over the run, as its step records give them)."""
    costs: dict[str, float]
    """The measured inputs (see `measure`)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Other measured figures, printed beside the comparison."""

    @property
    def store(self) -> Path:
        return self.run_dir / "replay.sqlite"


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a run folder of reflow agent-train)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{n}: not a JSON record") from None
    return rows


def measure(run_dir: str | Path) -> RunMeasurement:
    """Read a finished run's folder; ConfigError (one line) when it is not one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--from-run {run_dir}: no such folder")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a run folder of reflow agent-train)")
    config = yaml.safe_load(cfg_path.read_text()) or {}
    rows = _records(run_dir)
    steps = [r for r in rows if r.get("kind") == "step"]
    if not steps:
        raise ConfigError(f"{run_dir}: metrics.jsonl has no step records (the run trained no step)")
    if not (run_dir / "replay.sqlite").is_file():
        raise ConfigError(f"{run_dir}: no replay.sqlite (the groups the run generated)")
    missing = [k for k in ("wall_s", "generated_tokens", "trained_tokens", "train_s") if k not in steps[-1]]
    if missing:
        raise ConfigError(f"{run_dir}: step records lack {', '.join(missing)}")
    last = steps[-1]
    slots = (config.get("resources") or {}).get("slots") or ["rollout", "train"]
    n_rollout, n_train = slots.count("rollout"), slots.count("train")
    wall = float(last["wall_s"])
    rollout_busy = (1 - float(last["rollout_idle_ratio"])) * wall * n_rollout
    sync = [float(r["sync_s"]) for r in steps if r.get("sync_s") is not None]
    train = [float(r["train_s"]) for r in steps]
    summary = next((r for r in reversed(rows) if r.get("kind") == "summary"), {})
    groups = load_groups(str(run_dir / "replay.sqlite"))
    processed_per_generated = _processed_per_generated(groups)
    # a lent engine's tokens are in the generated count: its seconds join the rollout slots' (as the
    # elastic policy measures r), the engines being alike
    lent_busy = float(summary.get("lent_busy_s") or 0.0)
    costs = {
        "rollout_slots": n_rollout,
        "train_slots": n_train,
        "engine_tokens_per_s": float(last["generated_tokens"]) / max(rollout_busy + lent_busy, 1e-9),
        "trainer_tokens_per_s": processed_per_generated
        * sum(float(r["trained_tokens"]) for r in steps)
        / max(sum(train), 1e-9),
        "processed_per_generated": processed_per_generated,
        "sync_s": statistics.fmean(sync) if sync else 0.0,
        "role_change_s": float(summary["role_change_s"]) / summary["role_changes"]
        if summary.get("role_changes")
        else float((config.get("elastic") or {}).get("initial_change_cost_s", 30.0)),
        "stored_groups": len(groups),
    }
    figures = {
        "steps_per_s": int(last["step"]) / wall,
        "trained_tokens_per_s": float(last["trained_tokens_per_s"]),
        "rollout_idle_ratio": float(last["rollout_idle_ratio"]),
        "trainer_idle_ratio": float(last["trainer_idle_ratio"]),
    }
    extra = {
        "generated_tokens_per_s": float(last.get("generated_tokens_per_s", math.nan)),
        # runs from before the count have none
        "new_trained_tokens_per_s": float(last.get("new_trained_tokens_per_s", math.nan)),
        "train_s": statistics.fmean(train),
        "trainer_wait_s": _mean(steps, "trainer_wait_s"),  # the sync loop does not report it
        "staleness_mean": _mean(steps, "staleness_mean"),
    }
    if (config.get("elastic") or {}).get("lend"):  # the lending counters of the run's summary
        extra.update({k: float(summary.get(k, math.nan)) for k in LENDING})
    return RunMeasurement(
        run_dir, config, str(config.get("mode", "sync")), int(last["step"]), wall, figures, costs, extra
    )


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else math.nan


def run_folders(path: str | Path) -> list[Path]:
    """A run folder, or a `reflow bench modes --out` folder: each of its runs (sub-folders with a
    metrics.jsonl), in name order."""
    path = Path(path)
    if (path / "metrics.jsonl").is_file() or not path.is_dir():
        return [path]
    runs = sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file())
    if not runs:
        raise ConfigError(f"--from-run {path}: no metrics.jsonl in it or in its sub-folders")
    return runs


def _processed_per_generated(groups: tuple[GroupShape, ...]) -> float:
    """Tokens a train step processes (prompt + generated + tool output) per generated (trained) token,
    over the groups with reward spread (the ones trained)."""
    processed = generated = 0
    for g in groups:
        if not g.spread:
            continue
        for s in g.samples:
            processed += s.prompt + sum(s.turns) + s.obs_tokens * (len(s.turns) - 1)
            generated += sum(s.turns)
    return processed / generated if generated else 1.0


def load_groups(path: str) -> tuple[GroupShape, ...]:
    """Every group of a run's replay store, as sample shapes with the policy version it was started at
    (cached per file and modification time)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"workload.groups_from: no replay store at {path}")
    return _load_groups(str(p.resolve()), p.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_groups(path: str, _mtime: int) -> tuple[GroupShape, ...]:
    from reflow.replay.schema import reward_spread
    from reflow.replay.store import ReplayStore

    by_group: dict[str, list] = {}
    with ReplayStore(path) as store:
        for e in store.episodes(run=None):
            if e.turns:
                by_group.setdefault(e.group_id, []).append(e)
    out = []
    for episodes in by_group.values():
        samples = []
        for e in episodes:
            later = [len(t.prompt_delta_ids) for t in e.turns[1:]]
            samples.append(
                SampleShape(
                    prompt=max(1, len(e.turns[0].prompt_delta_ids)),
                    turns=[max(1, len(t.completion_ids)) for t in e.turns],
                    tool_s=[float(t.env_s) for t in e.turns[:-1]],
                    obs_tokens=round(statistics.fmean(later)) if later else 0,
                )
            )
        version = min(e.policy_version_start for e in episodes)  # the version the group started at
        out.append(GroupShape(tuple(samples), reward_spread(episodes) > 0, version))
    if not out:
        raise ConfigError(f"{path}: no stored episodes with turns")
    return tuple(out)
