"""Run configuration for `reflow agent-train`: one pydantic model, loaded from YAML plus overrides.

    cfg = load_config("configs/calc-tiny.yaml", ["train.lr=3e-4", "rollout.group_size=4"])

Unknown keys, wrong types and a missing or unregistered env are errors that name the offending key
(`ConfigError`), never a silent default. Overrides use dotted keys; values are parsed as YAML scalars,
so `train.lr=3e-4`, `warmstart.enabled=false` and `env.kwargs={max_steps: 2}` all work.

Every section is a pydantic model (`_Section`). Where a lower layer's config dataclass defines a
section's settings (the trainer's, the loss's, the replay cycle's, the scheduler policies'), the
section takes that dataclass's fields (`_fields_of`: names, types and defaults, each defined once,
there), the dataclass's own checks validate them, and the section adds only the run's own keys.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from pathlib import Path
from typing import Any, ClassVar, Literal, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from reflow.errors import ConfigError

# The lower layers' config dataclasses (standard library only: no Ray, no torch): sections hold them or
# read their defaults, so each default is defined once.
from reflow.policy.dual_cycle import CycleConfig
from reflow.policy.elastic import ElasticConfig
from reflow.policy.tail import TailConfig
from reflow.policy.task_selection import LearnabilityConfig
from reflow.train.settings import LoraSettings, LossConfig, TrainerConfig
from reflow.wandb_sink import WandbConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic assigns a value before a whole-section check (`model_validator(mode="after")`)
        # runs and keeps it when the check refuses it: take the old value back, so a refused
        # assignment changes nothing
        had, old = name in self.__dict__, self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValueError:
            if had:
                self.__dict__[name] = old
            raise


class _DataclassSection(_Section):
    """A section over a lower layer's config dataclass (`settings_class`), made by `_fields_of`: every
    value it holds is checked by building the dataclass, whose errors name the field."""

    settings_class: ClassVar[type]

    @model_validator(mode="after")
    def _settings_accept(self) -> _DataclassSection:
        self._settings()
        return self

    def _settings(self, **given: Any) -> Any:
        """The dataclass with this section's values (a nested section's built too) and `given` (the
        fields the run sets elsewhere)."""
        names = [f.name for f in dataclasses.fields(self.settings_class) if f.name in type(self).model_fields]
        values = {name: getattr(self, name) for name in names}
        for name, value in values.items():
            if isinstance(value, _DataclassSection):
                values[name] = value._settings()
        return self.settings_class(**values, **given)


def _fields_of(
    config_class: type, *, base: type[_DataclassSection] = _DataclassSection, exclude: tuple[str, ...] = ()
) -> Any:
    """A section model with the fields of `config_class` (but `exclude`): their types, defaults and docs
    (`metadata["doc"]`, or the string under the field) read from the dataclass. A section subclasses it to add the run's own keys."""
    hints = get_type_hints(config_class)
    docstrings = _attribute_docstrings(config_class)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(config_class):
        if f.name in exclude:
            continue
        doc = f.metadata.get("doc") or docstrings.get(f.name)
        if f.default is dataclasses.MISSING:
            fields[f.name] = (hints[f.name], Field(default_factory=f.default_factory, description=doc))
        else:
            fields[f.name] = (hints[f.name], Field(f.default, description=doc))
    section = create_model(f"{config_class.__name__}Fields", __base__=base, **fields)
    section.settings_class = config_class
    return section


def _attribute_docstrings(config_class: type) -> dict[str, str]:
    """The string literal under each annotated field of a class body (the dataclasses of
    `reflow.train.settings` document their fields that way)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config_class))).body[0].body
    return {
        field.target.id: " ".join(doc.value.value.split())
        for field, doc in itertools.pairwise(body)
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


class EnvSection(_Section):
    plugins: list[str] = Field(
        default_factory=list,
        description="modules (or module:function) that register envs, loaded in every worker first",
    )
    id: str = Field(
        description="a registered env id, e.g. reflow/Calc-v0, or openenv/<name> (an OpenEnv server's env)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor kwargs for the env")
    malformed_call_penalty: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="reward each tool call the parser rejected (did not parse, unknown tool, arguments off "
        "its schema) costs in training rollouts (0: none; the env's `MalformedCallPenalty` wrapper; "
        "held-out evaluation never pays it): a group of failures then ranks loops on broken calls below "
        "failures of well-formed ones",
    )

    @model_validator(mode="after")
    def _registered(self) -> EnvSection:
        from reflow.env import env_ids
        from reflow.env.registration import load_env_plugin, namespaces

        for spec in self.plugins:
            try:
                load_env_plugin(spec)
            except Exception as e:
                raise ValueError(f"env plugin {spec!r} failed to load: {type(e).__name__}: {e}") from None
        namespace, _, name = self.id.partition("/")
        if self.id not in env_ids() and not (name and namespace in namespaces()):  # openenv/<name>
            known = ", ".join(env_ids() + [f"{ns}/<name>" for ns in sorted(namespaces())])
            raise ValueError(f"env {self.id!r} is not registered (registered: {known})")
        return self


class WarmstartSection(_Section):
    """Supervised warm-start on the env's scripted demonstrations before RL (`reflow warmstart`)."""

    enabled: bool = True
    demos: int = Field(2000, gt=0)
    error_rate: float = Field(0.05, ge=0.0, le=1.0)
    seconds: float = Field(360.0, gt=0)
    max_steps: int = Field(1200, gt=0)
    lr: float = Field(1e-2, gt=0)
    batch_tokens: int = Field(2048, gt=0)
    demo_env_kwargs: dict[str, Any] = Field(default_factory=dict, description="a curriculum for the demos")
    dev_tasks: int = Field(
        0,
        ge=0,
        description="> 0: early stopping on a dev set of this many tasks of the RL env (env.kwargs; seeds "
        "apart from the demos' and the held-out ones), greedy, every `dev_every` SFT steps",
    )
    dev_every: int = Field(200, gt=0, description="SFT steps between dev-set evaluations")
    patience: int = Field(
        2, gt=0, description="stop after this many dev evaluations without a better one; keep the best"
    )
    cache: bool = Field(True, description="reuse a warm-start built earlier with identical settings")
    seed: int = Field(0, description="the warm start's own seed: runs with other RL seeds share it")


class RolloutSection(_Section):
    group_size: int = Field(8, ge=2, description="episodes per task (a GRPO group)")
    groups_per_step: int = Field(8, gt=0, description="groups with reward spread wanted per train step")
    max_resample_rounds: int = Field(
        2, ge=0, description="extra generation rounds when too many groups have zero spread (DAPO)"
    )
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="agent-train needs 1 (see RunConfig)")
    top_k: int = Field(0, ge=0, description="agent-train needs 0 (see RunConfig)")
    stop: list[str] = Field(default_factory=list, description="stop strings ending a turn (besides EOS)")
    max_new_tokens: int = Field(128, gt=0, description="per turn")
    max_context_tokens: int = Field(4096, gt=0)
    max_generated_tokens: int = Field(2048, gt=0, description="per episode")
    max_turns: int = Field(16, gt=0)
    episode_deadline_s: float | None = Field(
        None, gt=0, description="wall-clock budget of an episode, generation included, time paused not"
    )
    max_batch_size: int = Field(64, gt=0, description="concurrent sequences per engine")


class LossSection(_fields_of(LossConfig)):
    """`train.loss:`, the policy loss: the fields of `reflow.train.settings.LossConfig`."""


class TrainSection(
    _fields_of(TrainerConfig, exclude=("loss", "behaviour_is_prox", "temperature", "seed", "lora"))
):
    """`train:`, the RL phase: its length, checkpoints, advantages and loss, and the trainer's settings
    (the fields of `reflow.train.settings.TrainerConfig`; `trainer_config` adds the ones the mode, the
    rollout temperature, the run's seed and `model.lora` decide)."""

    steps: int = Field(100, gt=0, description="train steps; sync rounds without reward spread count too")
    seconds: float | None = Field(
        None, gt=0, description="wall-clock budget of the RL phase: no step starts that would end past it"
    )
    advantage_scale: Literal["std", "none"] = Field(
        "std",
        description="std: a group's advantages divided by its reward std (GRPO); none: not scaled (Dr. GRPO)",
    )
    loss: LossSection = Field(default_factory=LossSection, description="the policy loss")
    engine_correction: bool = Field(
        False,
        description="sync mode: weight tokens by pi_prox / pi_engine (the engine's recorded log-probs, "
        "capped or truncated by train.loss) to correct the engine-trainer mismatch, instead of behaviour "
        "= prox (weight 1); async and reflow always use the engine's log-probs",
    )
    checkpoint_every: int = Field(5, gt=0, description="a checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = Field(2, gt=0, description="the newest this many checkpoints are kept")

    def trainer_config(
        self, *, behaviour_is_prox: bool, temperature: float, seed: int, lora: LoraSettings | None = None
    ) -> TrainerConfig:
        """The trainer's settings: this section's, and those the run decides elsewhere."""
        return self._settings(
            behaviour_is_prox=behaviour_is_prox, temperature=temperature, seed=seed, lora=lora
        )


class EvalSection(_Section):
    every: int = Field(10, ge=0, description="steps between held-out evaluations (0: only at the ends)")
    every_s: float | None = Field(
        None,
        gt=0,
        description="seconds of training wall-clock between held-out evaluations, in place of `every` "
        "(reflow.policy.eval_schedule): a mode with more steps per second is not evaluated more often",
    )
    episodes: int = Field(100, ge=0, description="held-out tasks per evaluation")
    pass_at: int = Field(
        0,
        ge=0,
        description="> 0: at the start and the end of RL also measure, on `end_episodes` held-out tasks, "
        "greedy success, the mean of `pass_at` sampled episodes (rollout temperature), pass@k and the RL "
        "headroom (what `reflow rollout --eval --pass-at` reports)",
    )
    end_episodes: int = Field(300, gt=0, description="held-out tasks of the `pass_at` measurement")
    pass_at_start: bool = Field(
        True,
        description="take the `pass_at` measurement at the start too (False: at the end only; the mode "
        "benchmark's runs all start from one cached warm start, whose start figure its pilot measures)",
    )
    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(
        0.0,
        ge=0,
        description="0: greedy (the default); > 0: sampled at this temperature (the rollout's top-p/top-k), "
        "which measures the policy RL optimises rather than its argmax",
    )
    samples: int = Field(
        1,
        ge=1,
        description="episodes per held-out task; success is their mean (mean@k), whose sampling noise "
        "falls as 1/sqrt(episodes x samples); > 1 needs temperature > 0",
    )
    env_kwargs: dict[str, Any] | None = Field(
        None,
        description="env kwargs of the held-out evaluation (None: env.kwargs); lets RL train on a "
        "curriculum (e.g. Calc-v0 max_steps: 2) while evaluation covers the whole task distribution",
    )
    deferred: bool = Field(
        False,
        description="snapshot the weights at each evaluation point and evaluate after the run, so that "
        "evaluation never competes with training (the mode benchmark uses this); always on in modes "
        "async and reflow, whose rollout would go on generating during a live evaluation",
    )

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> EvalSection:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("samples > 1 needs temperature > 0: greedy episodes of one task are identical")
        return self


def renamed_replay_keys(replay: dict[str, Any]) -> dict[str, Any]:
    """`replay:` of a run saved before `selection` existed: `prefer_spread` true is "spread", false
    "newest", so its config.yaml still resumes (and `reflow simulate --from-run` reads it)."""
    if "prefer_spread" not in replay:
        return replay
    replay = dict(replay)
    spread = replay.pop("prefer_spread")
    replay.setdefault("selection", "spread" if spread in (True, "true", "True") else "newest")
    return replay


class ReplaySection(_fields_of(CycleConfig)):
    """`replay:`, the staleness bound of the decoupled modes (`eta`, admission control) and the dual
    replay cycle of `reflow` mode (the fields of `reflow.policy.dual_cycle.CycleConfig`)."""

    eta: int = Field(
        1, description="async/reflow: rollouts run at most eta policy versions ahead of the engines"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return renamed_replay_keys(data) if isinstance(data, dict) else data

    @field_validator("eta")
    @classmethod
    def _eta_not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"eta (max staleness in policy versions) must be >= 0, got {value}")
        return value

    def cycle(self) -> CycleConfig:
        """The dual cycle's settings alone (every field but `eta`)."""
        return self._settings()


class RolePlacement(_Section):
    """Where a role's slots go on a Ray cluster: one placement group per role, a bundle per slot."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray's placement strategy for the role's bundles (SPREAD: across nodes)"
    )
    node_resource: str | None = Field(
        None,
        description="a custom resource that only the nodes for this role declare (`ray start "
        "--resources`); each bundle reserves a sliver of it, which pins the role's slots to those nodes",
    )


class ResourcesSection(_Section):
    ray_address: str | None = Field(None, description="a Ray cluster address; None starts Ray locally")
    slots: list[Literal["rollout", "train"]] = Field(
        default_factory=lambda: ["rollout", "train"], description="one role per device slot"
    )
    device: Literal["cpu", "cuda"] = "cpu"
    gpus_per_slot: float = Field(
        1.0, gt=0, description="GPUs a slot reserves with device cuda (0.5: two slots share one GPU)"
    )
    threads_per_slot: int | None = Field(
        None, gt=0, description="torch threads per actor (None: all cores in sync mode, as phases alternate)"
    )
    placement: dict[Literal["rollout", "train"], RolePlacement] = Field(
        default_factory=dict,
        description="per role, a placement group (strategy, node resource); empty: no placement groups, "
        "Ray places each slot's actor where a CPU (GPU) is free. A slot keeps its bundle when its role "
        "changes (the elastic pool moves roles, not devices)",
    )

    @field_validator("slots")
    @classmethod
    def _both_roles(cls, value: list[str]) -> list[str]:
        for role in ("rollout", "train"):
            if role not in value:
                raise ValueError(f"slots need at least one {role!r} slot, got {value}")
        return value


class EngineSection(_Section):
    """The rollout workers' inference engine (`reflow.runtime.engines`)."""

    kind: Literal["torch", "sglang"] = Field("torch", description="torch: in-process; sglang: SGLang servers")
    urls: list[str] = Field(default_factory=list, description="running SGLang servers, shared by all workers")
    launch_port: int | None = Field(
        None, gt=0, lt=65536, description="launch one SGLang server per rollout worker at this port + index"
    )
    launch_args: list[str] = Field(default_factory=list, description="extra sglang.launch_server arguments")
    weights_dir: str | None = Field(
        None, description="where workers write each policy for their servers (default: <run>/engine-weights)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> EngineSection:
        if self.kind == "torch" and (self.urls or self.launch_port is not None or self.launch_args):
            raise ValueError("engine.urls, launch_port and launch_args apply to engine.kind: sglang only")
        if self.kind == "sglang" and bool(self.urls) == (self.launch_port is not None):
            raise ValueError("engine.kind sglang needs exactly one of engine.urls or engine.launch_port")
        return self


class _PolicySection(_DataclassSection):
    """A scheduler policy's section: `enabled` and the fields of the policy's config dataclass."""

    enabled: bool | None = Field(
        None,
        description="None: on in mode reflow, off in sync and async; true switches it on (the elastic pool "
        "in async; the tail in async and sync), false off for an ablation. `agent-train` applies it in its "
        "loops (`reflow.runtime`); the cluster simulator drives the same policy object",
    )

    def policy_config(self) -> Any:
        """The policy's config dataclass with this section's values."""
        return self._settings()

    def active(self, mode: str) -> bool:
        return policy_active(self.enabled, mode)


def policy_active(enabled: bool | None, mode: str) -> bool:
    """Whether a scheduler policy runs: `enabled` when set, else on in mode reflow only."""
    return bool(enabled) if enabled is not None else mode == "reflow"


class ElasticSection(_fields_of(ElasticConfig, base=_PolicySection)):
    """The elastic pool's policy (`reflow.policy.elastic`)."""


class TailSection(_fields_of(TailConfig, base=_PolicySection)):
    """The long-tail scheduler's policy (`reflow.policy.tail`). In sync mode (`reflow.recipes.sync_tail`):
    over-provisioning, partial rollouts paused through the train step, and with more than one rollout
    worker migration (and, with `set_concurrency`, concurrency limits) as in the decoupled modes."""


class TasksSection(_fields_of(LearnabilityConfig)):
    """Which training tasks a round samples (`reflow.policy.task_selection`): fresh seeds only, or with
    `learnability` a share of revisits of tasks whose recent pass rate is strictly between 0 and 1."""

    learnability: bool = Field(False, description="revisit learnable tasks (sync mode)")

    def policy_config(self) -> LearnabilityConfig:
        return self._settings()


class WandbSection(_fields_of(WandbConfig)):
    """`log.wandb:`, a Weights & Biases run beside metrics.jsonl (the fields of
    `reflow.wandb_sink.WandbConfig`)."""

    def settings(self) -> WandbConfig:
        return self._settings()


class LogSection(_Section):
    """Where a run's records go besides metrics.jsonl and TensorBoard (`reflow.recipes.run_log`)."""

    wandb: WandbSection | None = Field(
        None,
        description="set (e.g. {project: reflow}, or the override log.wandb.project=reflow) to send the "
        "same records to a W&B run; needs the wandb extra",
    )


class LoraSection(_fields_of(LoraSettings)):
    """`model.lora:`, LoRA adapters on the frozen policy (the fields of
    `reflow.train.settings.LoraSettings`)."""

    def settings(self) -> LoraSettings:
        return self._settings()


SHORTHANDS = {"model": "name"}
"""Sections that may be given as one value: `model: tiny` is `model: {name: tiny}`."""


class ModelSection(_Section):
    """`model:`, the policy: a name (`model: tiny` is short for `model: {name: tiny}`) and LoRA."""

    name: str = Field("tiny", description="a preset (tiny, smollm2-135m) or a local HF folder")
    lora: LoraSection | None = Field(
        None,
        description="LoRA adapters (r, alpha, dropout, target_modules) trained on the frozen model, which "
        "the engines receive alone; None (the default): every weight trains",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    def lora_settings(self) -> LoraSettings | None:
        return self.lora.settings() if self.lora is not None else None


class RunConfig(_Section):
    run_name: str = "run"
    mode: Literal["sync", "async", "reflow"] = Field(
        "sync", description="sync: generate then train; async: bounded staleness; reflow: async + replay"
    )
    seed: int = 0
    out_dir: str = "runs"
    model: ModelSection = Field(default_factory=ModelSection, description="the policy and its LoRA adapters")
    model_overrides: dict[str, Any] = Field(
        default_factory=dict, description="config overrides for a preset, e.g. {num_hidden_layers: 3}"
    )
    env: EnvSection
    warmstart: WarmstartSection = Field(default_factory=WarmstartSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    replay: ReplaySection = Field(default_factory=ReplaySection)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    elastic: ElasticSection = Field(default_factory=ElasticSection)
    tail: TailSection = Field(default_factory=TailSection)
    tasks: TasksSection = Field(default_factory=TasksSection)
    log: LogSection = Field(default_factory=LogSection)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.rollout.max_new_tokens > self.rollout.max_context_tokens:
            raise ValueError("rollout.max_new_tokens cannot exceed rollout.max_context_tokens")
        if self.rollout.top_p < 1.0 or self.rollout.top_k > 0:
            # Engines record log-probs of the untruncated tempered distribution, which the trainer
            # recomputes; under a top-p/top-k filter tokens are drawn from another distribution, and
            # every importance weight would be off by the nucleus mass.
            raise ValueError(
                "rollout.top_p must be 1 and rollout.top_k 0 for training: the behaviour log-probs are "
                "of the untruncated distribution (use temperature to sharpen sampling)"
            )
        if self.tasks.learnability and self.mode != "sync":
            # the decoupled loops draw one task seed per group: a share of one seed is no revisit
            raise ValueError("tasks.learnability applies to mode sync only (rounds of several task seeds)")
        if self.mode == "sync" and self.tail.enabled and self.tasks.learnability:
            # its rounds draw one task seed per group
            raise ValueError("tasks.learnability does not combine with tail.enabled in sync mode")
        if self.mode == "sync" and self.elastic.enabled:
            # sync generates and trains in turn on every slot: no role to move (its tail handling,
            # `tail.enabled`, is `reflow.recipes.sync_tail`)
            raise ValueError("elastic.enabled applies to the decoupled modes (async, reflow), not sync")
        if self.elastic.lend:
            self._check_lending()
        return self

    def _check_lending(self) -> None:
        """`elastic.lend`: an engine beside each trainer rank, given work by the elastic pool."""
        if not self.elastic.active(self.mode):
            raise ValueError(
                "elastic.lend needs the elastic pool (mode reflow, or elastic.enabled: true in async)"
            )
        if self.engine.kind != "torch" or self.resources.device != "cpu":
            # on a GPU the lent engine would need the trainer rank's device and its memory handed
            # over through every step (offload, sleep): not built; CPU threads share by themselves
            raise ValueError(
                "elastic.lend needs engine.kind torch on resources.device cpu (the lent engine shares "
                "its slot; lending a GPU is not supported yet)"
            )
        if len(self.resources.slots) > 2:
            # moving a slot whose engine is lent (its paused groups) is not built yet: on two slots no
            # move is possible and lending is the pool's only action
            raise ValueError(
                f"elastic.lend needs two slots (resources.slots has {len(self.resources.slots)}): a role "
                "move beside lending is not supported yet"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run_name

    @property
    def held_out_env_kwargs(self) -> dict[str, Any]:
        """The env kwargs held-out evaluation plays: `eval.env_kwargs` when set, else the env's."""
        return self.env.kwargs if self.eval.env_kwargs is None else self.eval.env_kwargs


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (creating sections as needed)."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if node is data and part in SHORTHANDS and isinstance(child, str):
                child = node[part] = {SHORTHANDS[part]: child}  # `model: tiny`, then `model.lora.r=8`
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        key = path[-1]
        if (
            node is data
            and key in SHORTHANDS
            and isinstance(node.get(key), dict)
            and not isinstance(value, dict)
        ):
            node[key][SHORTHANDS[key]] = value  # `model=x` names the model, keeping its other keys
        else:
            node[key] = value
    return data


def _describe(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif err["type"] == "missing":
            lines.append(f"  {key}: missing (required)")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def validate_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config:\n{_describe(e)}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or start empty when `path` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    return validate_config(apply_overrides(data, list(overrides or [])))


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
