"""What a training run reports: each step's metrics record (`step_record`) and the run summary
(`run_summary`), written to JSONL and TensorBoard, a live rich display, the final summary table and PNG
plots of held-out success against wall-clock time and generated tokens.

Every record is one JSON object per line in `<run_dir>/metrics.jsonl` with a `kind` ("step", "eval",
"warmstart", "summary"); TensorBoard scalars go to `<run_dir>/tb/`. A resumed run appends to both. The
sinks the config's `log:` asks for (`reflow.recipes.sinks`: a W&B run) get every record too, with the
values metrics.jsonl has.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from reflow.config import RunConfig
from reflow.metrics import idle_ratio
from reflow.metrics import quantile as _quantile
from reflow.recipes.run_state import RunState

if TYPE_CHECKING:  # the workers module imports Ray: reading a run's log needs none of it
    from reflow.recipes.sinks import Sink
    from reflow.runtime.workers import GroupReport

STEP_COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("success", "success_rate", "{:.2f}"),
    ("held-out", "heldout_success", "{:.2f}"),
    ("zero-spread", "zero_spread_share", "{:.2f}"),
    ("bad calls", "malformed_call_share", "{:.2f}"),
    ("new tok/s", "new_trained_tokens_per_s", "{:.0f}"),
    ("gen tok/s", "generated_tokens_per_s", "{:.0f}"),
    ("rollout s", "rollout_s", "{:.1f}"),
    ("train s", "train_s", "{:.1f}"),
    ("sync s", "sync_s", "{:.2f}"),
    ("entropy", "entropy", "{:.3f}"),
)


class RunLog:
    def __init__(
        self,
        run_dir: str | Path,
        console: Console | None = None,
        live: bool = True,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.dir = Path(run_dir)
        self.sinks = list(sinks)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.console = console or Console()
        self.rows: list[dict[str, Any]] = []
        self.heldout: float | None = None
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"))
        except ImportError:  # tensorboard is in the `train` extra; JSONL still has everything
            self.console.print("[yellow]tensorboard not installed: metrics go to JSONL only[/yellow]")
        self._live = Live(self._table(), console=self.console, refresh_per_second=2) if live else None
        if self._live and self.console.is_terminal:
            self._live.start()
        else:
            self._live = None

    def write(self, kind: str, record: dict[str, Any]) -> None:
        row = {"kind": kind, "time": time.time(), **record}
        line = json.dumps(row, default=float)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self.sinks:
            written = json.loads(line)  # as metrics.jsonl holds it: keys as strings, numpy numbers as floats
            for sink in self.sinks:
                sink.write(kind, {key: written[key] for key in map(str, record)})
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{kind}/{key}", value, int(record["step"]))
            self._tb.flush()

    def step(self, record: dict[str, Any]) -> None:
        self.write("step", record)
        self.rows.append({**record, "heldout_success": self.heldout})
        if self._live:
            self._live.update(self._table())
        else:
            cols = [
                f"{name} {fmt.format(record[key])}"
                for name, key, fmt in STEP_COLUMNS
                if record.get(key) is not None
            ]
            self.console.print(" | ".join(cols))

    def eval(self, record: dict[str, Any]) -> None:
        self.heldout = record["success_rate"]
        self.write("eval", record)
        self.console.print(
            f"[bold]held-out[/bold] step {record['step']}: success {record['success_rate']:.3f} "
            f"({record['episodes']} episodes, {eval_kind(record)}; {record['wall_s']:.0f}s into the run)"
        )

    def _table(self) -> Table:
        table = Table(title="reflow agent-train", expand=False)
        for name, _, _ in STEP_COLUMNS:
            table.add_column(name, justify="right")
        for row in self.rows[-12:]:
            table.add_row(
                *(fmt.format(row[k]) if row.get(k) is not None else "-" for _, k, fmt in STEP_COLUMNS)
            )
        return table

    def close(self, exit_code: int = 0) -> None:
        """Stop the display and close every sink (`exit_code` non-zero: the run failed)."""
        if self._live:
            self._live.stop()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close(exit_code)


def eval_kind(record: dict[str, Any]) -> str:
    """Which evaluation made `record`: "greedy", or "mean@k at T t" (mean success of k sampled episodes
    per task)."""
    t = record.get("temperature") or 0.0
    return "greedy" if t == 0 else f"mean@{record.get('samples', 1)} at T {t:g}"


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


HEADLINE = (
    "heldout_success_start",
    "heldout_success_final",
    "heldout_success_best",
    "greedy_start",
    "greedy_final",
    "new_trained_tokens_per_s",
    "trained_tokens_per_s",
)
"""The summary table's first rows: quality, then new work per second, then work with reuse."""
LABELS = {
    "new_trained_tokens_per_s": "new_trained_tokens_per_s (first use of a group)",
    "trained_tokens_per_s": "trained_tokens_per_s (with replays)",
    "env_time_share": "env_time_share (of episode time: tools, sandboxes, grading)",
    "engine_tokens_per_decode_step": "engine_tokens_per_decode_step (its mean decode batch)",
}
"""Row labels that say which tokens a rate counts."""


def summary_table(summary: dict[str, Any]) -> Table:
    """The run summary, headline rows first (`HEADLINE`), then the rest in the summary's order."""
    table = Table(title="run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = [k for k in HEADLINE if k in summary] + [k for k in summary if k not in HEADLINE]
    for key in keys:
        value = summary[key]
        table.add_row(LABELS.get(key, key), f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


def trained_rates(state: RunState, wall_s: float) -> dict[str, float]:
    """Trained tokens per training second, new work (groups trained for the first time) and with every
    replay counted again: a mode that reuses groups raises the second, not the first."""
    return {
        "new_trained_tokens_per_s": state.new_trained_tokens / wall_s,
        "trained_tokens_per_s": state.trained_tokens / wall_s,
    }


def plot_run(run_dir: str | Path) -> list[Path]:
    """success_vs_time.png and success_vs_tokens.png from the run's metrics (held-out and training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    evals, steps = read_metrics(run_dir, "eval"), read_metrics(run_dir, "step")
    out = []
    for x_key, label, name in (
        ("wall_s", "wall-clock seconds", "success_vs_time.png"),
        ("generated_tokens", "generated tokens", "success_vs_tokens.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        if evals:
            ax.plot(
                [e[x_key] for e in evals],
                [e["success_rate"] for e in evals],
                "o-",
                label=f"held-out ({eval_kind(evals[-1])})",
            )
        if steps:
            ax.plot(
                [s[x_key] for s in steps],
                [s["success_rate"] for s in steps],
                alpha=0.5,
                label="training (sampled)",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("success rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        out.append(run_dir / name)
    return out


def step_record(
    state: RunState,
    n_workers: int,
    reports: list[GroupReport],
    n_trained: int,
    train_metrics: dict[str, float],
    staleness: list[int],
    times: dict[str, float],
) -> dict[str, Any]:
    """One line of metrics for a train step: rollout (the groups that arrived since the last step; `n_workers`
    rollout slots held since the previous count, see `RunState.count_rollout_slots`),
    training, IS health, staleness, idle ratios so far and the phase times. `staleness` per trained
    group: the trainer's version at the update (the weights the gradient is taken at, `state.version`
    before the step) minus the group's version (the policy version of its oldest sampled token)."""
    rewards = [x for r in reports for x in r.rewards]
    successes = [x for r in reports for x in r.successes]
    turns = [float(x) for r in reports for x in r.turns]
    latencies = [x for r in reports for x in r.tool_latencies_ms]
    generated = sum(r.generated_tokens for r in reports)
    state.generated_tokens += generated
    episode_s = sum(x for r in reports for x in r.episode_seconds)
    env_s = sum(x for r in reports for x in r.env_seconds)
    state.episode_s += episode_s
    state.env_s += env_s
    calls, malformed = sum(r.tool_calls for r in reports), sum(r.malformed_calls for r in reports)
    state.tool_calls += calls
    state.malformed_calls += malformed
    state.trained_tokens += train_metrics["trained_tokens"]
    state.new_trained_tokens += train_metrics["new_trained_tokens"]
    for s in staleness:
        state.staleness_hist[str(s)] = state.staleness_hist.get(str(s), 0) + 1
    statuses: dict[str, int] = {}
    for r in reports:
        for s in r.statuses:
            statuses[s] = statuses.get(s, 0) + 1
    wall = max(state.wall_s, 1e-9)
    state.count_rollout_slots(n_workers, state.wall_s)
    return {
        "step": state.step,
        "version": state.version,
        "wall_s": state.wall_s,
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "success_rate": sum(successes) / max(1, len(successes)),
        "groups_generated": len(reports),
        "groups_trained": n_trained,
        "zero_spread_share": 1 - sum(r.has_spread for r in reports) / max(1, len(reports)),
        "generated_tokens": state.generated_tokens,
        "step_generated_tokens": generated,
        "generated_tokens_per_s": state.generated_tokens / wall,
        **trained_rates(state, wall),
        "rollout_idle_ratio": idle_ratio(state.rollout_busy_s, state.rollout_slot_s),
        "trainer_idle_ratio": idle_ratio(state.trainer_busy_s, wall),
        "staleness_mean": sum(staleness) / max(1, len(staleness)),
        "staleness_max": max(staleness, default=0),
        "steps_no_signal": state.steps_no_signal,
        "turns_p50": _quantile(turns, 0.5),
        "turns_p90": _quantile(turns, 0.9),
        "turns_max": max(turns, default=0.0),
        "tool_latency_p50_ms": _quantile(latencies, 0.5),
        "tool_latency_p99_ms": _quantile(latencies, 0.99),
        "env_time_share": env_s / episode_s if episode_s > 0 else 0.0,
        "malformed_call_share": malformed / calls if calls else 0.0,
        **times,
        **{f"status_{k}": v for k, v in statuses.items()},
        **{k: v for k, v in train_metrics.items() if k != "train_s"},
    }


def _train_slot_idle(config: RunConfig, state: RunState, wall: float) -> float:
    """A train slot's idle share: wall time minus its trainer's step time minus its lent engine's
    generation that ended in stored groups (lent time that produced nothing is idle); the trainer's
    idle ratio without lending. Lent seconds are shared over the train slots (lending runs on one)."""
    slots = max(1, config.resources.slots.count("train"))
    return idle_ratio(state.trainer_busy_s + state.lent_stored_s / slots, wall)


def run_summary(
    config: RunConfig,
    state: RunState,
    reuse_hist: dict[int, int] | None = None,
    engines: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's summary record. `engines`: how the rollout engines spent the training loop
    (`reflow.metrics.engine_use`; absent for engines that keep no counters)."""
    evals = state.history
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    wall = max(state.wall_s, 1e-9)
    return {
        "run": str(config.run_dir),
        "mode": config.mode,
        "steps": state.step,
        "steps_no_signal": state.steps_no_signal,
        "minutes": round(state.wall_s / 60, 2),
        "heldout_success_start": first.get("success_rate"),
        "heldout_success_final": last.get("success_rate"),
        "heldout_success_best": max((e["success_rate"] for e in evals), default=None),
        "generated_tokens": state.generated_tokens,
        "generated_tokens_per_s": state.generated_tokens / wall,
        **trained_rates(state, wall),
        "seconds_per_step": state.wall_s / max(state.step, 1),
        "rollout_idle_ratio": idle_ratio(state.rollout_busy_s, state.rollout_slot_s),
        "trainer_idle_ratio": idle_ratio(state.trainer_busy_s, wall),
        "train_slot_idle_ratio": _train_slot_idle(config, state, wall),
        "env_time_share": state.env_s / state.episode_s if state.episode_s > 0 else 0.0,
        "malformed_call_share": state.malformed_calls / state.tool_calls if state.tool_calls else 0.0,
        "staleness_hist": dict(sorted(state.staleness_hist.items(), key=lambda kv: int(kv[0]))),
        "reuse_hist": reuse_hist or {},
        "role_changes": state.role_changes,
        "role_change_s": state.role_change_s,
        "tail_over_provisioned": state.tail_over_provisioned,
        "tail_carried_over": state.tail_carried_over,
        "tail_migrations": state.tail_migrations,
        "lent_busy_s": state.lent_busy_s,
        "lent_stored_s": state.lent_stored_s,
        "lent_yields": state.lent_yields,
        "lent_handed_over": state.lent_handed_over,
        "groups_quarantined": state.groups_quarantined,
        **(engines or {}),
        **headroom_summary(state.headroom),
    }


def headroom_summary(headroom: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The `eval.pass_at` figures, start then final ({} when not measured)."""
    out: dict[str, Any] = {}
    for when in ("start", "final"):
        room = headroom.get(when)
        if room:
            k = room["samples_per_task"]
            out[f"greedy_{when}"] = room["greedy_success"]
            out[f"mean@{k}_{when}"] = room["sampled_success"]
            out[f"pass@{k}_{when}"] = room["pass_at_k"]
            out[f"headroom_{when}"] = room["headroom"]
    return out


def time_to_target(history: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds at the first evaluation reaching `target` held-out success (None: never)."""
    return next((e["wall_s"] for e in history if e["success_rate"] >= target), None)
