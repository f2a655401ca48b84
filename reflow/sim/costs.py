"""The cost model of the cluster simulator: seconds for decode iterations, prefill, training, weight sync
and role changes, and the sampler of response lengths, turns and tool-call latencies.

Each formula is one function over the validated scenario sections (reflow/sim/config.py), so the
simulator (reflow/sim/simulation.py) and the planner read the same numbers. The forms are from
decode is memory-bound (every iteration reads the active weights and the KV of
every running sequence), training scales with tokens x 6 x active parameters, weight sync is a fixed
cost plus bytes over bandwidth plus a gather.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from reflow.sim.config import DecodeCost, GpuSpec, ModelSpec, SyncCost, TrainCost, Workload
from reflow.sim.drift import VersionedGroups, WorkloadDrift

GB = 1e9


@dataclass(frozen=True)
class DecodeModel:
    """t_iter(b, C) = a + a_moe * (1 - (1 - top_k / experts) ** b) + per_seq_s * b + k * C, in seconds,
    for an engine of `tp` GPUs. The MoE term: a batch of b tokens touches that share of the expert
    weights that are not active for one token (all of them, soon, at large batch)."""

    a: float
    """Fixed part of an iteration: iter_fixed_s + active weight bytes / effective bandwidth."""
    k: float
    """Seconds per context token held (its KV is read every iteration)."""
    per_seq_s: float
    max_running: int
    kv_capacity_tokens: float
    prefill_s_per_token: float
    a_moe: float = 0.0
    """Seconds to read the inactive-for-one-token expert weights, all of them."""
    miss: float = 1.0
    """1 - top_k / experts: the chance that one token leaves a given expert untouched."""
    kv_pressure: float = 1.0
    """Factor on per_seq_s while the engine runs a full cache with requests waiting (preemption)."""

    def weights_s(self, b: int) -> float:
        """Weight-reading seconds of one iteration of b sequences."""
        return self.a + (self.a_moe * (1 - self.miss**b) if self.a_moe else 0.0)

    def iter_s(self, b: int, context_tokens: float) -> float:
        return self.weights_s(b) + self.per_seq_s * b + self.k * context_tokens

    def tokens_per_s(self, b: int, context_tokens: float) -> float:
        """Engine decode throughput (all sequences together)."""
        return b / self.iter_s(b, context_tokens) if b else 0.0


def decode_model(gpu: GpuSpec, model: ModelSpec, cost: DecodeCost, colocated: bool = True) -> DecodeModel:
    """The iteration cost of one engine from the scenario's decode section (see `DecodeModel`). With a
    measured `engine_tokens_per_s` the engine is a constant-rate processor-sharing server: b sequences
    share that rate, whatever b."""
    if cost.engine_tokens_per_s is not None:
        return DecodeModel(
            a=cost.iter_fixed_s,
            k=0.0,
            per_seq_s=1 / cost.engine_tokens_per_s,
            max_running=cost.max_running,
            kv_capacity_tokens=math.inf,
            prefill_s_per_token=0.0,
        )
    bandwidth = gpu.hbm_gb_s * GB * cost.bw_efficiency * cost.tp * cost.tp_efficiency ** (cost.tp - 1)
    active_bytes = model.active_b * 1e9 * model.bytes_per_param
    share = cost.kv_memory_fraction if colocated else cost.separate_kv_memory_fraction
    kv_room = gpu.memory_gb * GB * share * cost.tp - model.weight_gb * GB
    if kv_room <= 0:
        raise ValueError(
            f"decode: {model.name} weights ({model.weight_gb:.0f} GB) do not fit in "
            f"{cost.tp} x {gpu.memory_gb} GB x memory share {share} (decode.kv_memory_fraction)"
        )
    prefill_flops = gpu.bf16_tflops * 1e12 * cost.tp * cost.prefill_mfu
    moe = {}
    if model.experts and model.top_k:
        moe = {
            "a_moe": (model.weight_gb * GB - active_bytes) / bandwidth,
            "miss": 1 - model.top_k / model.experts,
        }
    return DecodeModel(
        **moe,
        a=cost.iter_fixed_s + active_bytes / bandwidth,
        k=model.kv_bytes_per_token / bandwidth,
        per_seq_s=cost.per_seq_s
        + 2 * model.active_b * 1e9 / (gpu.bf16_tflops * 1e12 * cost.tp * cost.decode_mfu),
        kv_pressure=cost.kv_pressure_slowdown,
        max_running=cost.max_running,
        kv_capacity_tokens=kv_room / model.kv_bytes_per_token,
        prefill_s_per_token=2 * model.active_b * 1e9 / prefill_flops,
    )


def train_s(
    tokens: float,
    gpus: int,
    gpu: GpuSpec,
    model: ModelSpec,
    cost: TrainCost,
    recompute: bool,
    colocated: bool = False,
    fixed_share: float = 1.0,
) -> float:
    """Seconds for one update over `tokens` (prompt + response) on `gpus` trainer GPUs; `fixed_share`
    of the fixed cost (a sync period split into mini-batches pays it once in all)."""
    if tokens <= 0:
        return 0.0
    scale = 1.0 + cost.fsdp_alpha * math.log2(gpus / 8) if gpus > 8 else 1.0
    mfu = cost.mfu * (cost.colocated_factor if colocated else 1.0)
    if cost.tokens_per_s is not None:  # measured: tokens per second of one trainer device
        compute = tokens * scale / (gpus * cost.tokens_per_s * (mfu / cost.mfu))
    else:
        compute = tokens * 6 * model.active_b * 1e9 * scale / (gpus * gpu.bf16_tflops * 1e12 * mfu)
    return (cost.fixed_s * fixed_share + compute) * (
        1 + cost.ref_factor + (cost.logprob_factor if recompute else 0.0)
    )


def sync_s(model: ModelSpec, cost: SyncCost, colocated: bool) -> float:
    """One weight sync trainer -> engines."""
    if colocated:
        return cost.colocated_s
    return cost.fixed_s + model.weight_gb / cost.bandwidth_gb_s + cost.gather_s_per_gb * model.weight_gb


def role_change_s(cost: SyncCost) -> float:
    """A slot changing role (rollout <-> trainer): cold start, weights loaded, group re-formed."""
    return cost.role_change_s


@dataclass
class SampleShape:
    prompt: int
    turns: list[int]
    """Response tokens of each assistant turn."""
    tool_s: list[float]
    """Tool-call seconds after each turn but the last."""
    obs_tokens: int


@dataclass(frozen=True)
class GroupShape:
    """A group as a run stored it: its episodes' shapes and whether its rewards had any spread."""

    samples: tuple[SampleShape, ...]
    spread: bool
    version: int = 0
    """The policy version the run started it at (its episodes' earliest)."""


class LengthSampler:
    """Draws sample shapes for one group at a time from the workload's distributions (or from a list of
    measured response lengths, `lengths`, e.g. a replay store's, or whole stored groups, `groups`),
    with its own seeded generator. A group is drawn at the policy version it starts at: a parametric
    `drift` scales its lengths and turns, and with the workload's `drift.from_versions` the stored
    groups are those of the nearest stored version (reflow/sim/drift.py)."""

    def __init__(
        self,
        workload: Workload,
        seed: int,
        lengths: list[int] | None = None,
        groups: tuple[GroupShape, ...] | None = None,
        drift: WorkloadDrift | None = None,
    ) -> None:
        self.w = workload
        self.rng = random.Random(seed)
        self.lengths = lengths
        self.groups = groups
        self.drift = drift
        self.by_version = (
            VersionedGroups(groups, workload.drift.version_window)
            if groups and workload.drift.from_versions
            else None
        )

    def _lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(self.rng.gauss(0.0, sigma)) if sigma > 0 else median

    def group(self, n: int, version: int = 0) -> list[SampleShape]:
        return self.draw(n, version)[0]

    def draw(self, n: int, version: int = 0) -> tuple[list[SampleShape], bool | None]:
        """n sample shapes for one group started at policy `version`, and whether the group has no
        reward spread (None: unknown, the caller draws it from `zero_spread_prob`). A stored group of
        another size gives n of its episodes, drawn with replacement."""
        if self.groups:
            pool = self.by_version.near(version) if self.by_version else self.groups
            g = self.rng.choice(pool)
            samples = list(g.samples) if len(g.samples) == n else self.rng.choices(g.samples, k=n)
            return samples, not g.spread
        w = self.w
        factor = math.exp(self.rng.gauss(0.0, w.group_sigma)) if w.group_sigma > 0 else 1.0
        scale, turns_mean = 1.0, w.turns_mean
        if self.drift is not None:  # the group's lengths and turns as of the version it starts at
            scale = self.drift.response_factor(version)
            turns_mean = self.drift.turns_mean(turns_mean, version)
        return [self._sample(factor, scale, turns_mean) for _ in range(n)], None

    def _sample(self, factor: float, scale: float, turns_mean: float) -> SampleShape:
        """One sample: `factor` is the group's length factor (group_sigma), `scale` the drift's."""
        w = self.w
        prompt = max(1, round(self._lognormal(w.prompt_tokens.median, w.prompt_tokens.sigma)))
        n_turns = 1
        if w.max_turns > 1 and turns_mean > 1:
            p_more = 1 - 1 / turns_mean  # geometric number of extra turns, mean turns_mean - 1
            while n_turns < w.max_turns and self.rng.random() < p_more:
                n_turns += 1
        budget = w.max_response_tokens
        turns: list[int] = []
        for _ in range(n_turns):
            if self.lengths:
                want = self.rng.choice(self.lengths) * scale
            else:
                want = self._lognormal(w.response_tokens.median * factor * scale, w.response_tokens.sigma)
            tokens = min(budget, max(1, round(want)))
            turns.append(tokens)
            budget -= tokens
            if budget <= 0:
                break
        tool = [self._lognormal(w.tool_latency_s.median, w.tool_latency_s.sigma) for _ in turns[1:]]
        return SampleShape(prompt, turns, tool, w.obs_tokens)


def load_lengths(path: str) -> list[int]:
    """Response lengths (generated tokens per episode) of a real run: a replay store (.sqlite) or a
    `reflow replay export` JSONL file."""
    import json

    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            out = [int(json.loads(line)["n_generated_tokens"]) for line in f if line.strip()]
    else:
        from reflow.replay.store import ReplayStore

        with ReplayStore(path) as store:
            out = [sum(len(t.completion_ids) for t in e.turns) for e in store.episodes(run=None)]
    out = [n for n in out if n > 0]
    if not out:
        raise ValueError(f"{path}: no episodes with generated tokens")
    return out
