"""Fitting the cost model's free parameters to published phase times (`reflow simulate --fit`).

Which parameters are free and what they are fitted to is data, in each calibration file's `fit:` list
(configs/sim/calibration/*.yaml): a dotted key, the scenario and mode whose simulated phase time it
moves, and the published seconds it must hit. The fit is coordinate bisection: each key in turn is
bisected (every phase time used is monotone in its key: a longer median response length lengthens
generation, a higher decode efficiency shortens it) to within 0.2% of its value, for a few rounds. The result is printed as YAML
to paste into the calibration file; `--validate` never refits, it reads what the files say.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reflow.config import apply_overrides
from reflow.errors import ConfigError
from reflow.sim.config import _read_yaml, validate_scenario
from reflow.sim.simulation import simulate


@dataclass
class FitTerm:
    key: str
    """Dotted scenario key, e.g. workload.response_tokens.median."""
    lo: float
    hi: float
    scenario: str
    """Scenario file (relative to the calibration file) whose baseline or candidate is simulated."""
    which: str
    """baseline or mode."""
    metric: str
    """A summary key: trainer_wait_s (verl's `gen`), train_s, seconds_per_step."""
    target: float
    increasing: bool
    """Whether the metric grows with the key."""
    multiple_of: int | None = None
    """An integer key (batch.groups): bisect on multiples of this."""


def _terms(cal: dict[str, Any], where: Path) -> list[FitTerm]:
    try:
        return [FitTerm(**t) for t in cal.get("fit", [])]
    except TypeError as e:
        raise ConfigError(f"{where}: fit: {e}") from None


def _metric(data: dict[str, Any], term: FitTerm, steps: int | None) -> float:
    data = dict(data)
    if steps is not None:
        data["run"] = {**data.get("run", {}), "steps": steps, "warmup_steps": 1}
    if term.which == "baseline":
        data["mode"] = data["baseline"]
    s = validate_scenario(data, term.scenario)
    return float(simulate(s)[term.metric])


def fit(
    calibration: str | Path,
    rounds: int = 3,
    iters: int = 16,
    rel_tol: float = 2e-3,
    steps: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Fit the calibration file's free keys; returns key -> value. Each phase time is simulated with the
    scenario's own `run:` (as --validate runs it) unless `steps` shortens it."""
    path = Path(calibration).resolve()
    cal = yaml.safe_load(path.read_text()) or {}
    terms = _terms(cal, path)
    values: dict[str, float] = {t.key: _get(cal, t.key, (t.lo + t.hi) / 2) for t in terms}
    for r in range(rounds):
        for term in terms:
            base = _read_yaml((path.parent / term.scenario).resolve())
            lo, hi = term.lo, term.hi
            for _ in range(iters):  # until the interval is within rel_tol of its middle
                mid = (lo + hi) / 2
                if hi - lo <= rel_tol * abs(mid) or (term.multiple_of and hi - lo < term.multiple_of):
                    break
                if term.multiple_of:
                    mid = max(term.multiple_of, round(mid / term.multiple_of) * term.multiple_of)
                over = [f"{k}={v}" for k, v in {**values, term.key: mid}.items()]
                got = _metric(apply_overrides(dict(base), over), term, steps)
                if (got > term.target) == term.increasing:
                    hi = mid
                else:
                    lo = mid
            values[term.key] = round((lo + hi) / 2, 6)
            if term.multiple_of:
                values[term.key] = max(
                    term.multiple_of, round(values[term.key] / term.multiple_of) * term.multiple_of
                )
            log(
                f"round {r + 1}: {term.key} = {values[term.key]:g} ({term.metric} of {term.scenario} "
                f"{term.which} -> {term.target:g} s)"
            )
    return values


def _get(data: dict[str, Any], key: str, default: float) -> float:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return float(node)


def write_back(calibration: str | Path, values: dict[str, float]) -> None:
    """Put fitted values into the calibration file in place, keeping its comments and layout: each
    key's leaf is replaced at its first occurrence after its parent section's name."""
    path = Path(calibration)
    text = path.read_text()
    for key, value in values.items():
        *parents, leaf = key.split(".")
        start = 0
        for parent in parents:
            m = re.search(rf"\b{re.escape(parent)}:", text[start:])
            if m is None:
                raise ConfigError(f"{path}: no section {parent!r} to write {key} into")
            start += m.end()
        m = re.search(rf"(\b{re.escape(leaf)}:\s*)(-?[0-9][0-9.eE+-]*)", text[start:])
        if m is None:
            raise ConfigError(f"{path}: no value for {key} to overwrite")
        a, b = start + m.start(2), start + m.end(2)
        text = text[:a] + f"{value:g}" + text[b:]
    path.write_text(text)
