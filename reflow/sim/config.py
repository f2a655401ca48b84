"""Scenario files of the cluster simulator: the cost-model parameters, the workload and the mode, from YAML.

A scenario is one mapping (see configs/sim/README.md). `include:` lists files (relative to the scenario)
whose mappings are deep-merged first, so the hardware, model and workload constants live once each in
configs/sim/ and a scenario only says what differs. Every section forbids unknown keys, and an error
names the offending key (`decode.bw_efficiency: ...`), like `reflow.config` does for run configs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reflow.config import _describe, apply_overrides
from reflow.errors import ConfigError

Mode = Literal["sync", "one_step_off", "async", "reflow"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSpec(_Section):
    name: str = "gpu"
    hbm_gb_s: float = Field(gt=0, description="HBM bandwidth, GB/s (decode is bound by it)")
    bf16_tflops: float = Field(gt=0, description="dense bf16 peak, TFLOP/s")
    memory_gb: float = Field(gt=0)


class ModelSpec(_Section):
    name: str = "model"
    params_b: float = Field(gt=0, description="total parameters, billions (weight bytes, sync bytes)")
    active_params_b: float | None = Field(None, gt=0, description="active per token (MoE); default params_b")
    kv_bytes_per_token: float = Field(gt=0, description="KV cache bytes per token, all layers")
    bytes_per_param: float = Field(2.0, gt=0)
    experts: int | None = Field(None, ge=1, description="MoE: routed experts per layer")
    top_k: int | None = Field(None, ge=1, description="MoE: experts per token")

    @property
    def active_b(self) -> float:
        return self.active_params_b or self.params_b

    @property
    def weight_gb(self) -> float:
        return self.params_b * self.bytes_per_param


class DecodeCost(_Section):
    """One decode iteration of an engine with b running sequences holding C context tokens takes
    iter_fixed_s + (active weight bytes + C * kv bytes) / (tp * HBM * bw_efficiency)
    + b * (per_seq_s + 2 * active params / (tp * bf16 peak * decode_mfu)): memory-bound at small b,
    compute-bound at large b, so tokens/s = b / t_iter grows with b and saturates (on a GPU with a low
    FLOP/byte ratio such as the H20, at a few dozen sequences)."""

    tp: int = Field(1, ge=1, description="GPUs per engine (tensor parallelism)")
    bw_efficiency: float = Field(0.6, gt=0, le=1)
    per_seq_s: float = Field(2e-5, ge=0, description="per-sequence compute/scheduling cost per iteration")
    iter_fixed_s: float = Field(0.002, ge=0)
    tp_efficiency: float = Field(0.85, gt=0, le=1, description="bandwidth kept per extra TP rank")
    max_running: int = Field(256, ge=1, description="max concurrent sequences per engine")
    kv_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="GPU memory share for weights + KV, colocated"
    )
    separate_kv_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="the same on a rollout-only GPU (no trainer state beside it)"
    )
    prefill_mfu: float = Field(0.4, gt=0, le=1)
    decode_mfu: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of the bf16 peak a decode iteration reaches once compute-bound: each running "
        "sequence costs 2 x active params FLOPs per token, so engine tokens/s saturates with batch",
    )
    kv_pressure_slowdown: float = Field(
        1.0,
        ge=1,
        description="while requests wait because no engine's KV cache can hold them, an engine with "
        "sequence slots free runs a full cache: vLLM preempts and recomputes sequences, so its "
        "per-sequence (compute) term is this many times larger until the queue's head fits again",
    )
    engine_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="measured (a run's metrics): an engine's tokens/s while busy; replaces the bandwidth "
        "and FLOP terms (an iteration of b sequences costs b / this), no KV bound, prefill folded in",
    )


class TrainCost(_Section):
    """t = (fixed_s + tokens * 6 * active params / (m * peak * mfu(m))) * (1 + ref_factor + logprob_factor
    if the old log-probs are recomputed); mfu(m) = mfu / (1 + fsdp_alpha * log2(m / 8)) for m > 8 GPUs (FSDP
    scaling loss), times colocated_factor when the trainer shares its GPUs with the engines (offload,
    smaller micro-batches). mfu is an effective figure, fitted to step times, not a measured MFU."""

    mfu: float = Field(0.3, gt=0, le=1)
    fsdp_alpha: float = Field(0.0, ge=0)
    fixed_s: float = Field(5.0, ge=0, description="per update, whatever the GPU count (sequence-bound ranks)")
    logprob_factor: float = Field(0.33, ge=0, description="old-log-prob forward, relative to the update")
    ref_factor: float = Field(0.0, ge=0, description="reference-model forward (KL), relative to the update")
    colocated_factor: float = Field(1.0, gt=0, le=1, description="mfu kept when colocated with the engines")
    tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="measured (a run's metrics): tokens (prompt + generated + tool) one trainer device "
        "processes per second; replaces 6 x active params / (peak x mfu)",
    )


class SyncCost(_Section):
    """Weight sync trainer -> engines: fixed_s + weight GB / bandwidth_gb_s + gather_s_per_gb * weight GB;
    colocated_s is the reshard / wake-up cost when both roles share the GPUs."""

    fixed_s: float = Field(0.5, ge=0)
    bandwidth_gb_s: float = Field(25.0, gt=0)
    gather_s_per_gb: float = Field(0.0, ge=0)
    colocated_s: float = Field(5.0, ge=0)
    resume_s: float = Field(
        0.0,
        ge=0,
        description="partial rollout: rollout-side seconds after each sync before the engines decode again "
        "(wake-up, KV re-allocation, re-prefill of interrupted requests); the trainer does not wait for it",
    )
    colocated_wake_s: float = Field(
        0.0,
        ge=0,
        description="colocated (sync): seconds the engines stay paused after each sync before they decode "
        "(vLLM woken up, weights resharded in, KV cache re-allocated); the trainer waits through it, so it "
        "counts in the generation phase, as verl's `gen` timing does",
    )
    role_change_s: float = Field(60.0, ge=0, description="cold start of an engine or trainer rank")
    lend_switch_s: float = Field(
        0.0,
        ge=0,
        description="lending (mode.elastic_config.lend): assumed seconds to hand a train GPU between the "
        "trainer and its lent engine, each way (the engine's KV and weights offloaded before a step it "
        "yields to, onloaded before it decodes again); 0: CPU-like sharing, nothing to move",
    )
    lend_beside_slowdown: float = Field(
        0.35,
        ge=0,
        lt=1,
        description="lending: the trainer's slowdown (share of its rate) in a step a lent engine generates "
        "beside (runs on past eta); 0.35 measured on 2 CPU cores (`reflow bench lending`, calc-tiny); a "
        "step the engines yield to costs `lend_switch_s` only",
    )


class Lognormal(_Section):
    median: float = Field(gt=0)
    sigma: float = Field(0.0, ge=0)


class Drift(_Section):
    """How the workload drifts over a run (long-CoT and agentic RL: responses and turn counts grow
    several-fold as the policy trains); reflow/sim/drift.py does the arithmetic. Parametric: a group
    started at policy version v draws its response lengths with the median times f(response_growth, v)
    and its extra turns (turns_mean - 1) times f(turns_growth, v); f is 1 at version 0 and the growth at
    `over_steps` and after (linear: 1 + (g - 1) x, exponential: g ** x, x = min(v, over_steps) /
    over_steps). From a run: `from_versions` draws each group from the stored groups (groups_from) of
    the stored version nearest v, so the measured run's own growth replays. Default: no drift."""

    response_growth: float = Field(
        1.0, gt=0, description="factor on response_tokens.median (or a measured length) at over_steps"
    )
    turns_growth: float = Field(
        1.0,
        gt=0,
        description="factor on the extra turns (turns_mean - 1) at over_steps; max_turns still cuts",
    )
    over_steps: int | None = Field(
        None, ge=1, description="policy versions until the growth is reached (held after); default run.steps"
    )
    shape: Literal["linear", "exponential"] = "linear"
    from_versions: bool = Field(
        False, description="groups_from: draw stored groups of the stored version nearest the current one"
    )
    version_window: int = Field(
        0, ge=0, description="from_versions: also the stored versions this far either side of the nearest"
    )

    @property
    def parametric(self) -> bool:
        return self.response_growth != 1.0 or self.turns_growth != 1.0


class Workload(_Section):
    """Per sample: prompt tokens, then `turns` turns of (response tokens, tool call). Response tokens are
    lognormal per turn (a per-group factor exp(N(0, group_sigma)) makes hard prompts long for the whole
    group); the total is cut at max_response_tokens, which gives the truncation spike. `drift` makes
    the lengths and turns grow with the policy version (`Drift`)."""

    prompt_tokens: Lognormal = Lognormal(median=200, sigma=0.3)
    response_tokens: Lognormal = Lognormal(median=2000, sigma=1.0)
    group_sigma: float = Field(0.0, ge=0)
    max_response_tokens: int = Field(8192, ge=1)
    turns_mean: float = Field(1.0, ge=1, description="mean assistant turns (1 + geometric extra turns)")
    max_turns: int = Field(1, ge=1)
    obs_tokens: int = Field(0, ge=0, description="tool-result tokens added per extra turn")
    tool_latency_s: Lognormal = Lognormal(median=1.0, sigma=0.5)
    zero_spread_prob: float = Field(0.0, ge=0, lt=1, description="groups with identical rewards")
    lengths_from: str | None = Field(
        None, description="replay store (.sqlite) or export (.jsonl) to resample"
    )
    groups_from: str | None = Field(
        None,
        description="a run's replay store (.sqlite): whole stored groups are resampled (every episode's "
        "prompt, turns, tool seconds and tool-output tokens, and the group's reward spread)",
    )
    drift: Drift = Drift()

    @model_validator(mode="after")
    def _drift_applies(self) -> Workload:
        d = self.drift
        if d.from_versions and not self.groups_from:
            raise ValueError("drift.from_versions needs workload.groups_from (a run's replay store)")
        if d.parametric and self.groups_from:
            raise ValueError(
                "drift.response_growth / drift.turns_growth do not apply to stored groups "
                "(workload.groups_from); use drift.from_versions to replay the run's own growth"
            )
        if d.turns_growth != 1.0 and (self.max_turns < 2 or self.turns_mean <= 1):
            raise ValueError("drift.turns_growth needs extra turns: turns_mean > 1 and max_turns > 1")
        return self


class Batch(_Section):
    groups: int = Field(512, ge=1, description="groups (prompts) per train step, B")
    samples_per_group: int = Field(16, ge=1)


class ModeConfig(_Section):
    mode: Mode = "sync"
    rollout_gpus: int | None = Field(None, ge=1, description="separate modes; default: half the cluster")
    eta: int | None = Field(None, ge=0, description="AReaL staleness bound in versions (async/reflow)")
    staleness_threshold: float | None = Field(
        None, ge=0, description="verl's fractional bound, instead of eta"
    )
    partial_rollout: bool = True
    trigger: int = Field(1, ge=1, description="trainer mini-batch updates per weight sync (verl streaming)")
    recompute_logprob: bool | None = Field(None, description="default: True for sync and one_step_off")
    cycle: dict[str, Any] = Field(
        default_factory=dict, description="reflow.policy.dual_cycle.CycleConfig fields"
    )
    kl_per_version: float = Field(
        0.01, ge=0, description="IS-health proxy fed to ReplayShare: KL per version"
    )
    elastic: bool = False
    tail: bool = False
    tail_config: dict[str, Any] = Field(
        default_factory=dict, description="reflow.policy.tail.TailConfig fields (the run's `tail:`)"
    )
    elastic_config: dict[str, Any] = Field(
        default_factory=dict, description="reflow.policy.elastic.ElasticConfig fields (the run's `elastic:`)"
    )
    groups_per_engine: int | None = Field(
        None,
        ge=1,
        description="async/reflow: groups in flight per engine at most (the runtime's rollout workers: "
        "rollout.max_batch_size // group_size); None: only the engines' sequence limit",
    )
    resample_rounds: int | None = Field(
        None,
        ge=0,
        description="sync: collect in rounds as the runtime's sync loop does (a round of B groups, then up "
        "to this many rounds for the groups that came back without reward spread; the step trains on "
        "those with spread, at most B); None: replacements start as soon as a slot frees",
    )
    over_sampling_groups: int | None = Field(
        None,
        ge=1,
        description="sync: slime's rollout loop (APRIL, reflow/sim/oversample.py): this many groups "
        "start at once (carried ones first), again whenever the groups started less those without "
        "reward spread fall short of B; once B groups with spread are done the rest is aborted; "
        "None: admission control (or resample_rounds)",
    )
    abort_carry: bool = Field(
        False,
        description="over_sampling_groups: aborted groups keep their progress and start first in the "
        "next round (slime's --partial-rollout); false: they are dropped",
    )

    @model_validator(mode="after")
    def _one_bound(self) -> ModeConfig:
        if self.eta is not None and self.staleness_threshold is not None:
            raise ValueError("give eta or staleness_threshold, not both")
        if self.over_sampling_groups is not None and (
            self.mode != "sync" or self.resample_rounds is not None
        ):
            raise ValueError("over_sampling_groups needs mode sync without resample_rounds")
        if self.abort_carry and self.over_sampling_groups is None:
            raise ValueError("abort_carry needs over_sampling_groups")
        if self.lends and (self.mode not in ("async", "reflow") or self.staleness_threshold is not None):
            raise ValueError(
                "elastic_config.lend needs mode async or reflow with eta (a lent engine runs on past eta)"
            )
        return self

    @property
    def lends(self) -> bool:
        """Whether each trainer GPU group holds an engine to lend (reflow/sim/lending.py)."""
        return bool(self.elastic_config.get("lend"))


class RunSpec(_Section):
    steps: int = Field(8, ge=1)
    warmup_steps: int = Field(2, ge=0, description="steps left out of the per-step figures")
    seed: int = 0


class Published(_Section):
    speedup: float | None = Field(None, gt=0, description="baseline time / candidate time")
    metric: Literal["seconds_per_step", "rollout_tokens_per_s"] = Field(
        "seconds_per_step",
        description="what `speedup` compares: step time (baseline / candidate), or, sync only, the "
        "tokens generated per second of the rollout phase (candidate / baseline; APRIL's figure)",
    )
    step_s: float | None = Field(None, gt=0, description="candidate seconds per step")
    source: str = ""
    note: str = ""


class Scenario(_Section):
    name: str = "scenario"
    description: str = ""
    gpus: int = Field(8, ge=1)
    gpu: GpuSpec
    model: ModelSpec
    decode: DecodeCost = DecodeCost()
    train: TrainCost = TrainCost()
    sync: SyncCost = SyncCost()
    workload: Workload = Workload()
    batch: Batch = Batch()
    mode: ModeConfig = ModeConfig()
    run: RunSpec = RunSpec()
    baseline: ModeConfig | None = Field(None, description="--validate: the mode the speedup is against")
    published: Published | None = None
    fitted: list[str] = Field(default_factory=list, description="keys fitted on the calibration subset")
    fit_subset: bool = Field(False, description="this target was used to fit the free parameters")
    fit: list[dict[str, Any]] = Field(default_factory=list, description="fit terms (reflow/sim/fit.py)")

    @model_validator(mode="after")
    def _fits(self) -> Scenario:
        for m in (self.mode, self.baseline):
            if m is not None and m.mode != "sync":
                n = m.rollout_gpus or self.gpus // 2
                if not 1 <= n < self.gpus:
                    raise ValueError(f"rollout_gpus must leave trainer GPUs: {n} of {self.gpus}")
                if n % self.decode.tp:
                    raise ValueError(f"rollout_gpus {n} is not a multiple of decode.tp {self.decode.tp}")
        if self.gpus % self.decode.tp:
            raise ValueError(f"gpus {self.gpus} is not a multiple of decode.tp {self.decode.tp}")
        for m in (self.mode, self.baseline):
            if (
                m is not None
                and m.over_sampling_groups is not None
                and m.over_sampling_groups < self.batch.groups
            ):
                raise ValueError(
                    f"over_sampling_groups {m.over_sampling_groups} is below batch.groups {self.batch.groups}"
                )
        return self


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in seen:
        raise ConfigError(f"{path}: include cycle")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    includes = data.pop("include", [])
    if not isinstance(includes, list):
        raise ConfigError(f"{path}: include: must be a list of files")
    merged: dict[str, Any] = {}
    for inc in includes:
        merged = _merge(merged, _read_yaml((path.parent / str(inc)).resolve(), (*seen, path)))
    return _merge(merged, data)


def validate_scenario(data: dict[str, Any], where: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: invalid scenario:\n{_describe(e)}") from None


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read a scenario YAML (with its includes), apply KEY=VALUE overrides, validate."""
    p = Path(path).resolve()
    data = apply_overrides(_read_yaml(p), list(overrides or []))
    for key in ("lengths_from", "groups_from"):  # relative to the scenario file
        if data.get("workload", {}).get(key):
            data["workload"][key] = str((p.parent / data["workload"][key]).resolve())
    return validate_scenario(data, str(path))
