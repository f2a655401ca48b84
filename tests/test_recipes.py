"""`reflow rollout` and `reflow warmstart`, run as a user runs them (small budgets)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REFLOW = str(Path(sys.executable).parent / "reflow")


def run(*args, timeout=600):
    out = subprocess.run([REFLOW, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from reflow.models import build_tiny

    return str(
        build_tiny(
            tmp_path_factory.mktemp("model"), num_hidden_layers=2, hidden_size=128, intermediate_size=256
        )
    )


@pytest.mark.slow
def test_rollout_writes_parquet_and_prints_the_summary(small_model, tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "calc.parquet"
    out, summary = run(
        "rollout",
        "--env",
        "reflow/Calc-v0",
        "--model",
        small_model,
        "--episodes",
        "8",
        "--group-size",
        "4",
        "--max-new-tokens",
        "24",
        "--out",
        str(path),
    )
    assert summary["episodes"] == 8 and summary["generated_tokens"] > 0
    assert summary["turns_p50"] <= summary["turns_p90"] <= summary["turns_max"]
    assert "generated tokens/s" in out.stdout
    table = pq.read_table(path).to_pylist()
    assert len(table) == 8 and len({row["group_id"] for row in table}) == 2
    first = table[0]
    seg = first["segments"][0]
    assert len(seg["token_ids"]) == len(seg["loss_mask"]) == len(seg["logprobs"])
    assert sum(seg["loss_mask"]) == sum(
        len(t["completion_ids"]) for t in first["turns"] if t["segment_id"] == 0
    )


@pytest.mark.slow
def test_rollout_pass_at_k_reports_the_rl_headroom_on_the_held_out_tasks(small_model, tmp_path):
    path = tmp_path / "eval.jsonl"
    common = ["--env", "reflow/Calc-v0", "--model", small_model, "--max-new-tokens", "16"]
    out, summary = run("rollout", *common, "--eval", "--episodes", "3", "--pass-at", "2", "--out", str(path))
    room = summary["rl_headroom"]
    assert room["tasks"] == 3 and room["samples_per_task"] == 2
    assert 0.0 <= room["headroom"] <= room["pass_at_k"] <= 1.0
    assert "RL headroom" in out.stdout
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # 3 greedy episodes, then 2 sampled ones on each of the same 3 held-out tasks
    assert len(rows) == 9
    assert sorted(r["seed"] for r in rows[3:]) == sorted(2 * [r["seed"] for r in rows[:3]])
    assert all(r["turns"][0]["sampling_params"]["temperature"] == 0.0 for r in rows[:3])
    assert all(r["turns"][0]["sampling_params"]["temperature"] == 1.0 for r in rows[3:])
    # greedy episodes of a group would be identical: --eval refuses a group size
    grouped = subprocess.run(
        [REFLOW, "rollout", *common, "--eval", "--episodes", "4", "--group-size", "2"],
        capture_output=True,
        text=True,
    )
    assert grouped.returncode == 2 and "one greedy episode per held-out task" in grouped.stderr
    bad = subprocess.run([REFLOW, "rollout", *common, "--pass-at", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("reflow: error: --pass-at K needs --eval")
    assert "Traceback" not in bad.stderr and len(bad.stderr.splitlines()) == 1


@pytest.mark.slow
def test_warmstart_trains_on_demos_saves_a_model_and_evaluates(small_model, tmp_path):
    out_dir = tmp_path / "warm"
    _, summary = run(
        "warmstart",
        "--env",
        "reflow/Math-v0",
        "--model",
        small_model,
        "--out",
        str(out_dir),
        "--demos",
        "40",
        "--seconds",
        "600",  # the step count ends it; a busy machine must not make it stop early
        "--max-steps",
        "15",
        "--eval-episodes",
        "8",
    )
    assert summary["sft_steps"] == 15 and summary["demo_rows"] == 40
    assert sum(summary["heldout_statuses"].values()) == 8
    assert json.loads((out_dir / "warmstart.json").read_text()) == summary
    from reflow.models import load_model

    model, tok = load_model(str(out_dir))
    before, _ = load_model(small_model)
    changed = [n for n, p in model.named_parameters() if not (p == dict(before.named_parameters())[n]).all()]
    assert changed, "SFT did not change the weights"
    assert tok.chat_template


def test_sft_loss_covers_only_sampled_tokens():
    import torch

    from reflow.models import load_model
    from reflow.records import Segment
    from reflow.train.sft import masked_nll

    model, tok = load_model("tiny", num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    row = Segment(0)
    row.extend_prompt([5, 6, 7, 8])
    row.extend_sampled([9, 10], [0.0, 0.0], [0, 0])
    loss, n = masked_nll(model, [row], tok.pad_token_id)
    assert n == 2
    logits = model(input_ids=torch.tensor([row.token_ids])).logits[0].float()
    expected = torch.nn.functional.cross_entropy(logits[3:5], torch.tensor([9, 10]))
    assert torch.allclose(loss, expected, atol=1e-5)


@pytest.mark.slow
def test_warmstart_flags_reach_the_model_and_the_demos(tmp_path):
    out_dir = tmp_path / "warm-tiny"
    config = '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}'
    _, summary = run(
        "warmstart",
        "--env",
        "reflow/Math-v0",
        "--model",
        "tiny",
        "--model-config",
        config,
        "--out",
        str(out_dir),
        "--demos",
        "20",
        "--seconds",
        "600",
        "--max-steps",
        "3",
        "--eval-episodes",
        "4",
    )
    saved = json.loads((out_dir / "config.json").read_text())
    assert (saved["num_hidden_layers"], saved["hidden_size"]) == (1, 64) and summary["sft_steps"] == 3


async def test_demo_rows_follow_the_demo_env_kwargs(small_model):
    from transformers import AutoTokenizer

    from reflow.recipes.warmstart import demo_rows

    tok = AutoTokenizer.from_pretrained(small_model)
    short = await demo_rows("reflow/Calc-v0", tok, 12, 0.0, env_kwargs={"max_steps": 1})
    sampled_turn_ends = [
        sum(1 for t, m in zip(row.token_ids, row.loss_mask, strict=True) if m and t == tok.eos_token_id)
        for row in short
    ]
    assert sampled_turn_ends == [2] * 12  # one calculator call, then the answer


async def test_demonstrations_never_share_task_seeds_with_rl_or_held_out_tasks(small_model, monkeypatch):
    from transformers import AutoTokenizer

    import reflow.recipes.warmstart as warmstart_mod
    from reflow.rollout.collect import DEMO_SEED_BASE, EVAL_SEED_BASE

    seeds = []
    real = warmstart_mod.scripted_policy

    def spy(env, error_rate, seed):
        seeds.append(seed)
        return real(env, error_rate, seed)

    monkeypatch.setattr(warmstart_mod, "scripted_policy", spy)
    tok = AutoTokenizer.from_pretrained(small_model)
    await warmstart_mod.demo_rows("reflow/Calc-v0", tok, 5, 0.0, seed=3)
    assert seeds == [DEMO_SEED_BASE + 3 + i for i in range(5)]
    # training seeds stop below EVAL_SEED_BASE (next_seeds raises there); held-out ones start at it
    assert EVAL_SEED_BASE + 100_000 <= DEMO_SEED_BASE


def test_warmstart_cache_key_follows_the_env_curriculum(monkeypatch):
    from reflow_envs.calc.env import CalcEnv

    from reflow.config import RunConfig
    from reflow.recipes.initial_model import warmstart_key

    default = RunConfig(env={"id": "reflow/Calc-v0"})
    explicit = RunConfig(env={"id": "reflow/Calc-v0"}, warmstart={"demo_env_kwargs": {"max_steps": 2}})
    before = warmstart_key(default), warmstart_key(explicit)
    monkeypatch.setattr(CalcEnv, "demo_kwargs", {"max_steps": 3})
    assert warmstart_key(default) != before[0]  # the env's own curriculum changed: a new warm start
    assert warmstart_key(explicit) == before[1]  # the config's curriculum wins over the env's


@pytest.mark.slow
def test_a_warm_start_cut_short_by_its_time_cap_is_not_reused(small_model, tmp_path, monkeypatch):
    from reflow.config import RunConfig
    from reflow.recipes.initial_model import run_warmstart
    from reflow.recipes.run_log import RunLog

    monkeypatch.setenv("REFLOW_CACHE_DIR", str(tmp_path / "cache"))

    def warm(seconds, name):
        ws = {"demos": 8, "max_steps": 3, "seconds": seconds, "batch_tokens": 512}
        config = RunConfig(env={"id": "reflow/Math-v0"}, model=small_model, warmstart=ws)
        log = RunLog(tmp_path / name, live=False)
        path = run_warmstart(config, log)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        (row,) = [r for r in rows if r["kind"] == "warmstart"]
        return path, row

    # a 1 ms cap stops SFT after its first step (the cap is checked after each step): flagged, and
    # the next run trains again
    path, cut = warm(0.001, "a")
    assert (cut["sft_steps"], cut["sft_max_steps"], cut["stopped_by"], cut["cached"]) == (
        1,
        3,
        "seconds",
        False,
    )
    _, again = warm(0.001, "b")
    assert again["cached"] is False
    # the seconds cap is part of the key, so a roomy cap is its own warm start: complete, then reused
    _, full = warm(600.0, "c")
    assert (full["sft_steps"], full["stopped_by"], full["cached"]) == (3, "steps", False)
    reused_path, reused = warm(600.0, "d")
    assert reused["cached"] is True and reused["stopped_by"] == "steps"
    assert Path(reused_path).is_dir() and Path(path).parent == Path(reused_path).parent
    assert full["model"] == reused["model"] == reused_path  # the folder, not where it was built
    assert not list(Path(reused_path).parent.glob(".*"))  # no staging folder left beside it


@pytest.mark.slow
def test_the_warm_start_trains_in_a_process_of_its_own_and_its_log_reaches_the_run(small_model, tmp_path):
    """Run in the driver, SFT's memory (the model, optimizer, allocator caches) stayed with the driver
    for the whole RL run: a clean interpreter runs `run_warmstart` and has not trained anything."""
    script = f"""
import json, sys
from reflow.config import RunConfig
from reflow.recipes.initial_model import run_warmstart
from reflow.recipes.run_log import RunLog

ws = {{"demos": 8, "max_steps": 2, "batch_tokens": 512}}
config = RunConfig(env={{"id": "reflow/Math-v0"}}, model={small_model!r}, warmstart=ws)
path = run_warmstart(config, RunLog({str(tmp_path / "run")!r}, live=False))
# warmstart() imports its engine for the dev and held-out evaluations; nothing else here does
print("RESULT", json.dumps({{"path": path, "trained_here": "reflow.engine.torch_engine" in sys.modules}}))
"""
    env = {**os.environ, "REFLOW_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["trained_here"] is False
    assert (Path(result["path"]) / "config.json").is_file()
    assert "demo rows" in out.stdout  # the SFT process's log lines, relayed to the run's console


@pytest.mark.slow
def test_a_lora_runs_checkpoints_name_a_base_of_its_own_that_outlives_the_warm_start_cache(
    small_model, tmp_path, monkeypatch
):
    """A `model.lora` checkpoint holds adapters alone and names its base folder. A warm start in the
    cache is reflow's to replace (a run with the same key trains a time-capped one again) or clear:
    the base a run trains on is its own, so its resume and export read the model its adapters fit."""
    import shutil

    import torch

    from reflow.config import RunConfig
    from reflow.models.adapters import base_model_path
    from reflow.recipes.initial_model import prepare_model, resumed_model
    from reflow.recipes.run_log import RunLog
    from reflow.train.lora import load_lora_model
    from reflow.train.settings import TrainerConfig
    from reflow.train.trainer import PolicyTrainer
    from reflow.train.trainer_state import save_checkpoint

    monkeypatch.setenv("REFLOW_CACHE_DIR", str(tmp_path / "cache"))
    ws = {"demos": 8, "max_steps": 3, "seconds": 0.001, "batch_tokens": 512}  # cut short: trained again
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}

    def start(name: str) -> tuple[RunConfig, str]:
        config = RunConfig(
            env={"id": "reflow/Math-v0"},
            model={"name": small_model, "lora": lora},
            warmstart=ws,
            out_dir=str(tmp_path / "runs"),
            run_name=name,
        )
        path, _, _ = prepare_model(config, config.run_dir, RunLog(config.run_dir, live=False), resume=False)
        return config, path

    config, path = start("a")
    settings = config.model.lora_settings()
    model, tokenizer = load_lora_model(path, settings)
    trainer = PolicyTrainer(model, tokenizer.pad_token_id, TrainerConfig(bf16=False, lora=settings))
    ckpt = save_checkpoint(config.run_dir / "checkpoints", trainer, tokenizer)
    assert base_model_path(ckpt).is_relative_to(config.run_dir)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
    start("b")  # the same warm-start key: the cut-short warm start is trained again, its folder replaced
    shutil.rmtree(tmp_path / "cache")
    resumed, _ = load_lora_model(resumed_model(ckpt, config.run_dir), settings)
    with torch.no_grad():
        assert torch.equal(resumed(ids).logits, before)


def test_a_full_weight_run_reads_the_model_it_started_from_after_the_cache_is_trained_again(
    small_model, tmp_path, monkeypatch
):
    """Actors started mid-run (an elastic role change) load the run's model path then: a warm start in
    the cache that another run with the same key trains again, or that is cleared, must not change or
    remove the model of a run already going."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from reflow.config import RunConfig
    from reflow.recipes.initial_model import prepare_model
    from reflow.recipes.run_log import RunLog

    monkeypatch.setenv("REFLOW_CACHE_DIR", str(tmp_path / "cache"))
    ws = {"demos": 8, "max_steps": 3, "seconds": 0.001, "batch_tokens": 512, "lr": 0.5}  # cut short

    def start(name: str) -> Path:
        config = RunConfig(
            env={"id": "reflow/Math-v0"}, model={"name": small_model}, warmstart=ws,
            out_dir=str(tmp_path / "runs"), run_name=name,
        )  # fmt: skip
        path, _, _ = prepare_model(config, config.run_dir, RunLog(config.run_dir, live=False), resume=False)
        return Path(path)

    path = start("a")
    assert path.is_relative_to(tmp_path / "runs" / "a")
    before = load_file(path / "model.safetensors")
    start("b")  # the same warm-start key: the cut-short warm start is trained again, its folder replaced
    shutil.rmtree(tmp_path / "cache")
    after = load_file(path / "model.safetensors")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_lora_run_on_another_runs_checkpoint_keeps_its_base_when_that_run_rotates_it(small_model, tmp_path):
    """LoRA on top of a full-weights RL checkpoint: that run's rotation (`train.keep_checkpoints`)
    removes the folder, so the run links it as its own base first."""
    import shutil

    import torch

    from reflow.config import RunConfig
    from reflow.models import load_model
    from reflow.recipes.initial_model import prepare_model
    from reflow.recipes.run_log import RunLog
    from reflow.train.lora import load_lora_model
    from reflow.train.settings import TrainerConfig
    from reflow.train.trainer import PolicyTrainer
    from reflow.train.trainer_state import save_checkpoint

    model, tokenizer = load_model(small_model)
    ckpt = save_checkpoint(
        tmp_path / "full" / "checkpoints", PolicyTrainer(model, 0, TrainerConfig()), tokenizer
    )
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    config = RunConfig(
        env={"id": "reflow/Math-v0"},
        model={"name": str(ckpt), "lora": lora},
        warmstart={"enabled": False},
        out_dir=str(tmp_path / "runs"),
    )
    path, _, _ = prepare_model(config, config.run_dir, RunLog(config.run_dir, live=False), resume=False)
    assert Path(path).is_relative_to(config.run_dir)
    shutil.rmtree(ckpt)  # the other run rotated it away
    based, _ = load_lora_model(path, config.model.lora_settings())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(based(ids).logits, model(ids).logits)  # fresh adapters: the base's outputs
