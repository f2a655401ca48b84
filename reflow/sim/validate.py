"""`reflow simulate --validate`: every published target with a full configuration (configs/sim/validate/)
simulated in its baseline and its candidate mode, the speedup compared with the published one.

A target passes when |simulated / published - 1| <= tolerance (15%). A speedup compares step times
unless the scenario's `published.metric` says `rollout_tokens_per_s` (APRIL's rollout throughput:
candidate / baseline). Targets whose scenario says
`fit_subset: true` were used to fit the free parameters (their error is in-sample); the table says so,
and the summary line reports the error over the others separately.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reflow.sim.config import Scenario, load_scenario
from reflow.sim.simulation import simulate

TOLERANCE = 0.15


@dataclass
class TargetResult:
    name: str
    published: float
    simulated: float
    baseline_step_s: float
    candidate_step_s: float
    in_sample: bool
    source: str
    note: str

    @property
    def error(self) -> float:
        return self.simulated / self.published - 1

    @property
    def passed(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _key(s: Scenario) -> str:
    return json.dumps(
        s.model_dump(exclude={"name", "description", "published", "fitted", "fit_subset", "fit"}),
        sort_keys=True,
        default=str,
    )


def rollout_tokens_per_s(summary: dict) -> float:
    """Tokens generated per second of the rollout phase, over the steady-state window: in the colocated
    sync mode nothing generates while the trainer trains or syncs, so the phase is the trainer's wait
    (APRIL's `tokens_throughput`: completion tokens of a rollout, aborted ones included, / its time)."""
    if summary["mode"] != "sync":
        raise ValueError(f"rollout_tokens_per_s is a sync-mode figure, not {summary['mode']!r}")
    return summary["generated_tokens_per_s"] * summary["seconds_per_step"] / summary["trainer_wait_s"]


def run_target(s: Scenario, cache: dict[str, dict]) -> TargetResult:
    if s.published is None or s.baseline is None:
        raise ValueError(f"{s.name}: a validation scenario needs `baseline:` and `published:`")
    base = s.model_copy(update={"mode": s.baseline})
    key = _key(base)
    if key not in cache:
        cache[key] = simulate(base)
    b = cache[key]
    c = simulate(s)
    if s.published.speedup is not None and s.published.metric == "rollout_tokens_per_s":
        published, simulated = s.published.speedup, rollout_tokens_per_s(c) / rollout_tokens_per_s(b)
    elif s.published.speedup is not None:
        published, simulated = s.published.speedup, b["seconds_per_step"] / c["seconds_per_step"]
    else:
        assert s.published.step_s is not None
        published, simulated = s.published.step_s, c["seconds_per_step"]
    return TargetResult(
        s.name,
        published,
        simulated,
        b["seconds_per_step"],
        c["seconds_per_step"],
        s.fit_subset,
        s.published.source,
        s.published.note,
    )


def validate(folder: str | Path, only: list[str] | None = None) -> list[TargetResult]:
    cache: dict[str, dict] = {}
    out = []
    for path in sorted(Path(folder).glob("*.yaml")):
        s = load_scenario(path)
        if only and s.name not in only:
            continue
        out.append(run_target(s, cache))
    return out


def markdown(results: list[TargetResult]) -> str:
    """The table for docs/results.md."""
    lines = [
        "| target | published | simulated | error | sim baseline s/step | sim candidate s/step | fit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.published:.2f}x | {r.simulated:.2f}x | {r.error:+.1%} | {r.baseline_step_s:.1f} | "
            f"{r.candidate_step_s:.1f} | {'fitted' if r.in_sample else 'held out'} |"
        )
    return "\n".join(lines)


def summary_line(results: list[TargetResult]) -> str:
    held = [r for r in results if not r.in_sample]
    ok = sum(r.passed for r in results)
    mean_held = sum(abs(r.error) for r in held) / len(held) if held else 0.0
    return (
        f"{ok} of {len(results)} targets within {TOLERANCE:.0%}; held-out targets: "
        f"{sum(r.passed for r in held)} of {len(held)} within, mean |error| {mean_held:.1%}"
    )
