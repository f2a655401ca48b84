"""Run metrics defined once, for the real runs (reflow/recipes/run_log.py) and the cluster simulator
(reflow/sim/metrics.py): the idle ratio and the order-statistic quantile their summaries report, and
how a real run's rollout engines spent their time (`engine_use`, from the counters in `ENGINE_COUNTERS`).

Pure arithmetic, no Ray and no torch, so the simulator and the CLI can import it without a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ENGINE_COUNTERS = (
    "uptime_s",
    "steps",
    "decode_tokens",
    "decode_s",
    "prefill_s",
    "prefill_tokens",
    "prefix_hit_tokens",
)
"""The cumulative counters of an engine (TorchEngine's `counters()`) that `engine_use` reads: seconds
since it started, decode steps and the tokens they decoded, seconds decoding and prefilling, prompt
tokens computed in prefill and those reused from its prefix cache."""


def idle_ratio(busy_s: float, wall_s: float) -> float:
    """Idle share of wall-clock. Work that went on while an evaluation paused the clock can make busy
    time exceed it by a little: clamped to [0, 1]."""
    return min(1.0, max(0.0, 1 - busy_s / max(wall_s, 1e-9)))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile as the order statistic at index floor(q * n) (0.0 for no values): no
    interpolation, so a reported p99 is a value that was observed."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_use(
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    left_out: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """How the rollout engines spent a stretch of the run, from their cumulative counters
    (`ENGINE_COUNTERS`) at its start (`before`) and end (`after`), keyed by engine (one key per engine
    actor: a restarted one is another key), less `left_out` (counter differences of work in the stretch
    that is not the run's own, such as evaluations): `engine_decode_share` and `engine_prefill_share`
    (seconds decoding / prefilling over the engines' seconds, summed over engines; the rest is the
    loop's bookkeeping between steps and waiting for work), `engine_tokens_per_decode_step` (the mean
    batch a decode step ran) and `engine_prefix_reuse` (prompt tokens reused from the prefix cache over
    all prompt tokens). An engine not in `before` started during the stretch and counts from zero;
    {} when no engine has counters or no time passed."""
    total = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for key, end in after.items():
        start = before.get(key, {})
        for k in ENGINE_COUNTERS:
            total[k] += end[k] - start.get(k, 0.0)
    for k, v in (left_out or {}).items():
        total[k] -= v
    wall = total["uptime_s"]
    if wall <= 0:
        return {}
    prompt = total["prefill_tokens"] + total["prefix_hit_tokens"]
    return {
        "engine_decode_share": total["decode_s"] / wall,
        "engine_prefill_share": total["prefill_s"] / wall,
        "engine_tokens_per_decode_step": total["decode_tokens"] / total["steps"]
        if total["steps"] > 0
        else 0.0,
        "engine_prefix_reuse": total["prefix_hit_tokens"] / prompt if prompt > 0 else 0.0,
    }
