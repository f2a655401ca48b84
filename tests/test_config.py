"""Run configs: every shipped config validates; bad keys, types and envs are clear errors."""

from pathlib import Path

import pytest

from reflow.config import ConfigError, apply_overrides, dump_config, load_config, validate_config

CONFIGS = sorted(Path(__file__).parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    config = load_config(path)
    assert config.env.id.startswith("reflow/")
    assert load_config(path).model_dump() == config.model_dump()


def test_one_config_per_builtin_env():
    envs = {load_config(p).env.id for p in CONFIGS}
    assert {"reflow/Calc-v0", "reflow/PyCode-v0", "reflow/Guess-v0", "reflow/Math-v0"} <= envs


def test_overrides_parse_yaml_scalars_and_sections():
    config = load_config(
        None,
        ["env.id=reflow/Calc-v0", "train.lr=3e-4", "warmstart.enabled=false", "env.kwargs={max_steps: 2}"],
    )
    assert config.train.lr == pytest.approx(3e-4)
    assert config.warmstart.enabled is False
    assert config.env.kwargs == {"max_steps": 2}


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["env.id=reflow/Guess-v0", "rollout.group_size=4"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_model_is_a_name_or_a_section_with_lora_off_by_default(tmp_path):
    plain = load_config(None, ["env.id=reflow/Calc-v0", "model=smollm2-135m"])
    assert (plain.model.name, plain.model.lora, plain.model.lora_settings()) == ("smollm2-135m", None, None)
    lora = load_config(
        None, ["env.id=reflow/Calc-v0", "model.lora.r=4", "model.lora.target_modules=[q_proj]"]
    )
    assert lora.model.name == "tiny"
    settings = lora.model.lora_settings()
    assert (settings.r, settings.alpha, settings.target_modules) == (4, 32.0, ["q_proj"])
    trainer = lora.train.trainer_config(behaviour_is_prox=True, temperature=1.0, seed=0, lora=settings)
    assert trainer.lora == settings
    # a file's `model: tiny` takes LoRA keys from overrides, and `model=x` keeps a file's LoRA
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: reflow/Calc-v0}\nmodel: tiny\n")
    assert load_config(path, ["model.lora.r=2"]).model.lora.r == 2
    path.write_text(dump_config(lora))
    renamed = load_config(path, ["model=smollm2-135m"])
    assert (renamed.model.name, renamed.model.lora.r) == ("smollm2-135m", 4)
    assert load_config(path) == lora


def test_an_env_id_of_a_namespace_is_accepted():
    config = load_config(None, ["env.id=openenv/echo", "env.kwargs={url: http://127.0.0.1:1}"])
    assert config.env.id == "openenv/echo"
    with pytest.raises(ConfigError, match="openenv/<name>"):
        load_config(None, ["env.id=nowhere/echo"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env.id=reflow/Calc-v0", "train.lrr=1"], "train.lrr: unknown key"),
        (["env.id=reflow/Calc-v0", "bogus=1"], "bogus: unknown key"),
        (["env.id=reflow/Calc-v0", "train.steps=many"], "train.steps: Input should be a valid integer"),
        (["env.id=reflow/Calc-v0", "rollout.group_size=1"], "rollout.group_size"),
        (["env.id=reflow/Calc-v0", "resources.slots=[train]"], "at least one 'rollout' slot"),
        (["train.lr=1e-4"], "env: missing (required)"),
        (["env.id=reflow/Nope-v0"], "'reflow/Nope-v0' is not registered"),
        (["env.id=reflow/Calc-v0", "env.plugins=[no_such_module_xyz]"], "no_such_module_xyz"),
        (["env.id=reflow/Calc-v0", "mode=turbo"], "mode"),
        (["env.id=reflow/Calc-v0", "engine.kind=sglang"], "exactly one of engine.urls or engine.launch_port"),
        (
            [
                "env.id=reflow/Calc-v0",
                "engine.kind=sglang",
                "engine.urls=[http://a:1]",
                "engine.launch_port=30000",
            ],
            "exactly one of engine.urls or engine.launch_port",
        ),
        (["env.id=reflow/Calc-v0", "engine.urls=[http://a:1]"], "apply to engine.kind: sglang only"),
        (["env.id=reflow/Calc-v0", "engine.kind=vllm"], "engine.kind"),
        (["env.id=reflow/Calc-v0", "eval.samples=4"], "samples > 1 needs temperature > 0"),
        (["env.id=reflow/Calc-v0", "rollout.top_p=0.9"], "rollout.top_p must be 1"),
        (["env.id=reflow/Calc-v0", "rollout.top_k=20"], "rollout.top_k 0 for training"),
        (["env.id=reflow/Calc-v0", "replay.ess_min=1.5"], "ess_min must be within [0, 1]"),
        (["env.id=reflow/Calc-v0", "replay.bogus=1"], "replay.bogus: unknown key"),
        (["env.id=reflow/Calc-v0", "replay.eta=-1"], "eta (max staleness"),
        (
            ["env.id=reflow/Calc-v0", "train.loss.agg=seq_mean_token_mean", "train.loss.nope=1"],
            "train.loss.nope: unknown key",
        ),
        (["env.id=reflow/Calc-v0", "train.loss.clip_eps=1.5"], "clip_eps"),
        (["env.id=reflow/Calc-v0", "train.loss.m2_tau=-0.04"], "m2_tau must be finite and >= 0"),
        (
            ["env.id=reflow/Calc-v0", "train.prox_logp=loglinear", "train.loss.m2_tau=0.04"],
            "m2_tau > 0 needs the exact prox log-probs",
        ),
        (["env.id=reflow/Calc-v0", "mode=sync", "elastic.enabled=true"], "elastic.enabled applies to the"),
        (
            ["env.id=reflow/Calc-v0", "mode=sync", "tail.enabled=true", "tasks.learnability=true"],
            "tasks.learnability does not combine with tail.enabled",
        ),
        (["env.id=reflow/Calc-v0", "mode=async", "elastic.lend=true"], "elastic.lend needs the elastic pool"),
        (
            [
                "env.id=reflow/Calc-v0",
                "mode=reflow",
                "elastic.lend=true",
                "engine.kind=sglang",
                "engine.launch_port=30000",
            ],
            "elastic.lend needs engine.kind torch on resources.device cpu",
        ),
        (
            ["env.id=reflow/Calc-v0", "mode=reflow", "elastic.lend=true", "resources.device=cuda"],
            "lending a GPU is not supported yet",
        ),
        (
            [
                "env.id=reflow/Calc-v0",
                "mode=reflow",
                "elastic.lend=true",
                "resources.slots=[rollout, rollout, train]",
            ],
            "elastic.lend needs two slots",
        ),
        (["env.id=reflow/Calc-v0", "elastic.lend_overhead=1"], "lend_overhead is a share in [0, 1)"),
        (["env.id=reflow/Calc-v0", "model.lora.r=0"], "r must be >= 1"),
        (["env.id=reflow/Calc-v0", "model.lora.dropout=1"], "dropout must be in [0, 1)"),
        (["env.id=reflow/Calc-v0", "model.lora.target_modules=[]"], "target_modules must be a non-empty"),
        (["env.id=reflow/Calc-v0", "model.lora.rank=8"], "model.lora.rank: unknown key"),
        (["env.id=reflow/Calc-v0", "model.lora={r: 8, alpha: -1}"], "alpha must be > 0"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [["mode=sync", "tail.enabled=true"], ["mode=reflow", "elastic.lend=true"]],
)
def test_a_runner_deadline_combines_with_paused_episodes(overrides):
    """Sync's partial rollouts and lending pause episodes; the runner's deadline moves with the pause."""
    config = load_config(None, ["env.id=reflow/Calc-v0", "rollout.episode_deadline_s=60", *overrides])
    assert config.rollout.episode_deadline_s == 60


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="not key=value"):
        apply_overrides({}, ["train.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="is not a section"):
        apply_overrides({"train": 3}, ["train.lr=1"])


def test_plugins_register_envs_before_the_id_is_checked():
    config = validate_config({"env": {"plugins": ["fake_envs:register_test_envs"], "id": "test/Parity-v0"}})
    assert config.env.id == "test/Parity-v0"


def test_agent_train_refuses_to_clobber_an_existing_run(tmp_path, capsys):
    from reflow.cli import main

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    args = ["agent-train", "env.id=reflow/Calc-v0", f"out_dir={tmp_path}", "run_name=r"]
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert (run / "metrics.jsonl").exists()
    assert main(["agent-train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no run to resume" in capsys.readouterr().err
    assert main(["agent-train", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_a_section_over_a_lower_layers_dataclass_is_checked_and_built_by_it():
    # the trainer's own settings: checked by TrainerConfig itself, so a trainer built without a run
    # config refuses them too; the error names the section and the field
    from reflow.train.settings import LossConfig, TrainerConfig

    for override, message in [("train.lr=0", "lr must be > 0"), ("train.epochs=0", "epochs must be >= 1")]:
        with pytest.raises(ConfigError, match=rf"train: .*{message}"):
            load_config(None, ["env.id=reflow/Calc-v0", override])
    with pytest.raises(ValueError, match="grad_clip must be > 0"):
        TrainerConfig(grad_clip=0.0)
    overrides = ["train.lr=3e-4", "train.loss.kind=tis", "train.loss.m2_tau=0.04", "seed=7"]
    config = load_config(None, ["env.id=reflow/Calc-v0", *overrides])
    built = config.train.trainer_config(behaviour_is_prox=False, temperature=0.8, seed=config.seed)
    assert built == TrainerConfig(
        lr=3e-4, loss=LossConfig(kind="tis", m2_tau=0.04), behaviour_is_prox=False, temperature=0.8, seed=7
    )


@pytest.mark.parametrize(
    ("section", "key", "bad"),
    [
        ("train", "lr", -1.0),
        ("train", "minibatches", 0),
        ("tasks", "window", 0),
        ("elastic", "min_train", -1),
        ("eval", "samples", 4),  # refused by the section's own check: samples > 1 needs a temperature
    ],
)
def test_a_refused_assignment_leaves_the_section_as_it_was(section, key, bad):
    # a value refused by a whole-section check (a dataclass built from the section, or the section's
    # own): pydantic assigns before that check runs, so the refused value must be taken back
    from pydantic import ValidationError

    config = load_config(None, ["env.id=reflow/Calc-v0"])
    part = getattr(config, section)
    before = getattr(part, key)
    with pytest.raises(ValidationError):
        setattr(part, key, bad)
    assert getattr(part, key) == before


def test_every_setting_has_a_description():
    # a section built from a lower layer's dataclass takes each field's doc from there (its metadata,
    # or the docstring under the field), so `reflow agent-train --help`-style listings keep them
    from reflow.config import RunConfig

    def missing(model: type, prefix: str) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            sub = info.annotation if isinstance(info.annotation, type) else None
            if sub is not None and hasattr(sub, "model_fields"):
                out += missing(sub, f"{prefix}{name}.")
            elif not info.description and prefix in ("train.", "train.loss."):
                out.append(prefix + name)
        return out

    assert missing(RunConfig, "") == []


def test_a_malformed_call_penalty_wraps_the_training_rollouts_env():
    from types import SimpleNamespace

    from reflow.env.wrappers import MalformedCallPenalty
    from reflow.runtime.workers import RolloutWorker

    plain = load_config(None, ["env.id=reflow/Calc-v0"])
    assert plain.env.malformed_call_penalty == 0.0
    assert not isinstance(RolloutWorker._make_env(SimpleNamespace(config=plain)), MalformedCallPenalty)
    config = load_config(None, ["env.id=reflow/Calc-v0", "env.malformed_call_penalty=0.1"])
    env = RolloutWorker._make_env(SimpleNamespace(config=config))
    assert isinstance(env, MalformedCallPenalty) and env.penalty == 0.1
    for bad in ("-0.1", ".nan", ".inf"):
        with pytest.raises(ValueError, match="malformed_call_penalty"):
            load_config(None, ["env.id=reflow/Calc-v0", f"env.malformed_call_penalty={bad}"])
