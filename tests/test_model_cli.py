"""`reflow eval` and `reflow export`, run as a user runs them: a config's env kwargs reach the held-out
episodes, a run folder means its latest checkpoint, and an exported folder loads in plain
`transformers` and generates what the checkpoint generates in TorchEngine."""

import asyncio
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REFLOW = str(Path(sys.executable).parent / "reflow")


def ok(*args):
    out = subprocess.run([REFLOW, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def run(*args):
    out = ok(*args)
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def fails(*args):
    out = subprocess.run([REFLOW, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from reflow.models import build_tiny

    return build_tiny(
        tmp_path_factory.mktemp("model"), num_hidden_layers=2, hidden_size=128, intermediate_size=256
    )


def _trained_checkpoint(model_dir, root: Path, lora=None, lr: float = 5e-2) -> Path:
    """A real trainer checkpoint one RL step away from `model_dir` (weights or LoRA adapters,
    optimizer, RNG, state)."""
    from reflow.models import load_model
    from reflow.records import Segment
    from reflow.train.settings import TrainerConfig
    from reflow.train.trainer import PolicyTrainer, TrainRow
    from reflow.train.trainer_state import save_checkpoint

    model, tokenizer = load_model(model_dir)
    trainer = PolicyTrainer(model, tokenizer.pad_token_id, TrainerConfig(lr=lr, bf16=False, lora=lora))
    rng = random.Random(0)
    rows = []
    for adv in (1.0, -1.0, 1.0, -1.0):
        seg = Segment(0)
        seg.extend_prompt([rng.randrange(10, 500) for _ in range(6)])
        seg.extend_sampled([rng.randrange(10, 500) for _ in range(5)], [-6.0] * 5, [0] * 5)
        rows.append(TrainRow(seg, adv))
    trainer.train_step(rows)
    return save_checkpoint(root, trainer, tokenizer)


@pytest.fixture(scope="module")
def checkpoint(small_model, tmp_path_factory):
    return _trained_checkpoint(small_model, tmp_path_factory.mktemp("run") / "checkpoints")


def _config(tmp_path: Path, model: str, **env_kwargs) -> Path:
    import yaml

    path = tmp_path / "run.yaml"
    config = {
        "model": model,
        "env": {"id": "reflow/Calc-v0", "kwargs": env_kwargs},
        "eval": {"max_new_tokens": 16, "end_episodes": 3, "pass_at": 2},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _first_prompts(env_kwargs: dict, seeds: list[int]) -> list[str]:
    from reflow.env import make

    async def one(seed: int) -> str:
        env = make("reflow/Calc-v0", **env_kwargs)
        try:
            obs = await env.reset(seed=seed)
            return obs.messages[-1]["content"]
        finally:
            await env.close()

    return [asyncio.run(one(s)) for s in seeds]


@pytest.mark.slow
def test_eval_plays_the_configs_env_kwargs_on_the_held_out_tasks(checkpoint, tmp_path):
    from reflow.rollout.collect import EVAL_SEED_BASE

    config = _config(tmp_path, str(checkpoint), max_steps=1, min_steps=1)
    episodes = tmp_path / "episodes.jsonl"
    summary_file = tmp_path / "eval.json"
    out, summary = run(
        "eval",
        "--config",
        str(config),
        "--model",
        str(checkpoint),
        "--out",
        str(episodes),
        "--json",
        str(summary_file),
    )
    assert summary == json.loads(summary_file.read_text())
    assert summary["episodes"] == 3 and summary["env_kwargs"] == {"max_steps": 1, "min_steps": 1}
    room = summary["rl_headroom"]  # the config's pass_at: 2 sampled episodes on each greedy task
    assert room["tasks"] == 3 and room["samples_per_task"] == 2
    assert "greedy success" in out.stdout and "pass@2" in out.stdout
    # a long evaluation says how far it is: here a line once all 3 tasks are done, for each half
    assert "greedy: 3/3 tasks (100%)" in out.stdout
    assert "2 samples per task at temperature 1: 3/3 tasks (100%)" in out.stdout
    # the greedy figure comes before the sampled half starts (a cut evaluation keeps it)
    greedy_line = out.stdout.index(f"greedy done: success {summary['success_rate']:.1%}")
    assert greedy_line < out.stdout.index("2 samples per task at temperature 1:")
    rows = [json.loads(line) for line in episodes.read_text().splitlines()]
    seeds = [EVAL_SEED_BASE + i for i in range(3)]
    assert [r["seed"] for r in rows[:3]] == seeds
    played = [r["messages"][1]["content"] for r in rows[:3]]
    assert played == _first_prompts({"max_steps": 1, "min_steps": 1}, seeds)
    assert played != _first_prompts({}, seeds)  # the registered kwargs would have given other tasks
    # an override changes what is played, as in `agent-train`
    _, greedy_only = run("eval", "--config", str(config), "--model", str(checkpoint), "eval.pass_at=0")
    assert "rl_headroom" not in greedy_only and greedy_only["success_rate"] == summary["success_rate"]


@pytest.mark.slow
def test_eval_in_parts_plays_the_episodes_of_one_whole_evaluation(checkpoint, tmp_path):
    """Tasks 1-2 on their own (`--first-task 1`) are tasks 1-2 of a 3-task evaluation: the same tasks
    and the same tokens, the sampled episodes' included, so parts of a long pass@k add up exactly."""
    config = _config(tmp_path, str(checkpoint), max_steps=1, min_steps=1)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    model = ["--config", str(config), "--model", str(checkpoint)]
    _, summary = run("eval", *model, "--episodes", "3", "--out", str(whole))
    _, part_summary = run("eval", *model, "--episodes", "2", "--first-task", "1", "--out", str(part))
    assert summary["first_task"] == 0 and part_summary["first_task"] == 1
    assert part_summary["episodes"] == 2 and part_summary["rl_headroom"]["tasks"] == 2

    def played(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [(r["seed"], [t["completion_ids"] for t in r["turns"]]) for r in rows]

    greedy, sampled = played(whole)[:3], played(whole)[3:]  # 3 greedy, then 2 samples of each task
    assert played(part) == greedy[1:] + sampled[2:]
    assert len({tuple(map(tuple, ids)) for _, ids in sampled}) > 1  # sampled, not greedy again
    assert "--first-task" in fails("eval", *model, "--first-task", "-1")


def test_eval_says_when_episodes_hit_their_deadline(checkpoint, tmp_path):
    """A wall-clock deadline makes the figure depend on the machine: the evaluation counts and says it."""
    config = str(_config(tmp_path, str(checkpoint), max_steps=1, min_steps=1, deadline_s=1e-6))
    stop = "rollout.stop=[e, a, o]"  # an untrained model's reply ends before its token budget: the env steps
    out, summary = run("eval", "--config", config, "--model", str(checkpoint), stop)
    # every sampled reply stopped early, so its env step came after the deadline; greedy replies may
    # run to their token budget instead (no step, no deadline): counted as their statuses say
    assert summary["timeouts"] == {"greedy": summary["statuses"].get("timeout", 0), "sampled": 6}
    text = " ".join(out.stdout.split())
    assert "6 of 6 sampled episodes hit their deadline" in text
    assert "raise env.kwargs.deadline_s (now 1e-06 s) to measure the model alone" in text
    plain_config = str(_config(tmp_path, str(checkpoint), max_steps=1, min_steps=1))
    _, plain = run("eval", "--config", plain_config, "--model", str(checkpoint), stop, "eval.pass_at=0")
    assert plain["timeouts"] == {"greedy": 0, "sampled": 0}


def test_progress_lines_come_at_every_tenth_of_the_tasks_and_once_at_the_end():
    from reflow.rollout.collect import ProgressLines

    lines: list[str] = []
    progress = ProgressLines(lines.append, "greedy")
    for done in range(1, 201):
        progress(done, 200)
    assert [line.split(",")[0] for line in lines] == [
        f"greedy: {20 * k}/200 tasks ({10 * k}%)" for k in range(1, 11)
    ]
    few: list[str] = []
    progress = ProgressLines(few.append, "greedy")
    for done in range(1, 4):  # fewer tasks than tenths: a line per task
        progress(done, 3)
    assert [line.split(",")[0] for line in few] == [f"greedy: {k}/3 tasks ({k / 3:.0%})" for k in (1, 2, 3)]


@pytest.mark.slow
def test_eval_of_a_run_folder_takes_its_latest_checkpoint_and_its_config(checkpoint, tmp_path):
    from reflow.config import dump_config, load_config

    run_dir = tmp_path / "runs" / "calc"
    for step in (1, 3):
        shutil.copytree(checkpoint, run_dir / "checkpoints" / f"step-{step:06d}")
    (run_dir / "config.yaml").write_text(dump_config(load_config(_config(tmp_path, str(checkpoint)))))
    _, summary = run("eval", "--model", str(run_dir), "--episodes", "2", "--pass-at", "0")
    assert Path(summary["model"]).name == "step-000003" and summary["episodes"] == 2
    empty = tmp_path / "runs" / "fresh"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    assert "has no finished checkpoint" in fails("eval", "--model", str(empty))
    assert "give --config" in fails("eval", "--model", str(checkpoint))


GENERATE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = tok.apply_chat_template(
    [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=True
)
ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
assert not any(m == "reflow" or m.startswith("reflow.") for m in sys.modules), "reflow was imported"
print(json.dumps({"prompt": list(ids), "completion": out[0, len(ids):].tolist()}))
"""


@pytest.mark.slow
def test_export_writes_a_folder_plain_transformers_loads_and_that_generates_the_checkpoints_tokens(
    checkpoint, small_model, tmp_path
):
    import torch
    from safetensors.torch import load_file

    from reflow.models import load_model

    out_dir = tmp_path / "exported"
    ok("export", str(checkpoint.parent.parent), str(out_dir))  # the run folder: its latest checkpoint
    names = {p.name for p in out_dir.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not names & {"optimizer.pt", "rng.pt", "state.json"}
    info = json.loads((out_dir / "reflow_export.json").read_text())
    assert info["step"] == 1 and Path(info["source"]).name == checkpoint.name
    exported = load_file(out_dir / "model.safetensors")
    trained = load_file(checkpoint / "model.safetensors")
    base = load_file(Path(small_model) / "model.safetensors")
    assert exported.keys() <= trained.keys()  # a tied lm_head is stored once
    assert all((exported[k] == trained[k]).all() for k in exported)
    assert any(not (exported[k] == base[k]).all() for k in exported)  # the trained weights, not the base

    model, tokenizer = load_model(checkpoint)
    _generates_as_in_torch_engine(out_dir, model, tokenizer)

    # a non-empty target is refused in one line unless --overwrite
    assert "pass --overwrite" in fails("export", str(checkpoint), str(out_dir))
    ok("export", str(checkpoint), str(out_dir), "--overwrite")
    assert (out_dir / "model.safetensors").is_file() and not (tmp_path / ".exported.tmp").exists()

    # half the size, as servers run it: the trained weights rounded to bfloat16, and said so in the config
    ok("export", str(checkpoint), str(out_dir), "--overwrite", "--dtype", "bfloat16")
    half = load_file(out_dir / "model.safetensors")
    assert half.keys() == exported.keys() and all(v.dtype == torch.bfloat16 for v in half.values())
    assert all((half[k] == exported[k].to(torch.bfloat16)).all() for k in half)
    assert json.loads((out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out_dir / "reflow_export.json").read_text())["dtype"] == "bfloat16"
    assert "invalid choice" in fails(
        "export", str(checkpoint), str(out_dir), "--overwrite", "--dtype", "int8"
    )


def _generates_as_in_torch_engine(out_dir: Path, model, tokenizer) -> None:
    """A fresh interpreter with transformers alone (no reflow import, no hub) loads `out_dir` and its
    greedy tokens for a chat prompt are what TorchEngine generates with `model`."""
    from reflow.engine import SamplingParams
    from reflow.engine.torch_engine import TorchEngine

    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", GENERATE, str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=out_dir.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert served["prompt"] == list(prompt)  # the chat template travelled with the tokenizer

    async def greedy() -> list[int]:
        engine = TorchEngine(model, tokenizer, max_batch_size=1)
        try:
            res = await engine.generate(list(prompt), SamplingParams(max_new_tokens=24, temperature=0.0))
        finally:
            await engine.close()
        return res.output_ids

    ours = asyncio.run(greedy())
    assert ours and served["completion"][: len(ours)] == ours


@pytest.mark.slow
def test_export_of_a_lora_checkpoint_is_the_merged_model_generating_as_the_runs_engine(small_model, tmp_path):
    """A `model.lora` checkpoint holds adapters only; its export is base + adapters merged, which plain
    transformers runs and which generates what a rollout engine of that run (base + live adapters)
    generates."""
    from safetensors.torch import load_file

    from reflow.train.lora import load_lora_model
    from reflow.train.settings import LoraSettings

    lora = LoraSettings(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    ckpt = _trained_checkpoint(small_model, tmp_path / "checkpoints", lora=lora, lr=0.2)
    assert not list(ckpt.glob("model*.safetensors"))  # adapters only
    out_dir = tmp_path / "exported"
    ok("export", str(ckpt), str(out_dir))
    names = {p.name for p in out_dir.iterdir()}
    assert "model.safetensors" in names and not any(n.startswith("adapter") for n in names)
    exported = load_file(out_dir / "model.safetensors")
    base = load_file(Path(small_model) / "model.safetensors")
    assert not any("lora" in k for k in exported) and exported.keys() <= base.keys()
    assert any(not (exported[k] == base[k]).all() for k in exported)  # the adapters are merged in
    engine_model, tokenizer = load_lora_model(ckpt, lora)  # how the run's engines hold it
    _generates_as_in_torch_engine(out_dir, engine_model, tokenizer)


def test_eval_of_a_lora_checkpoint_on_sglang_servers_plays_the_checkpoints_adapters(
    small_model, tmp_path, monkeypatch
):
    """SGLang servers under `model.lora` start from the base: an evaluation hands them the checkpoint's
    adapters before its first episode, and every request names them."""
    import httpx

    from reflow.config import load_config
    from reflow.engine import sglang_engine
    from reflow.recipes.model_cli import play_held_out
    from reflow.train.settings import LoraSettings

    lora = LoraSettings(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    ckpt = _trained_checkpoint(small_model, tmp_path / "checkpoints", lora=lora)
    loaded, named = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/load_lora_adapter":
            loaded.append((body["lora_name"], body["lora_path"]))
        elif request.url.path == "/generate":
            named.append(body.get("lora_path"))
            meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 5, None]]}
            return httpx.Response(200, json={"output_ids": [5], "meta_info": meta})
        return httpx.Response(200, json={"success": True})

    client = httpx.AsyncClient  # the engine's client answers in process, as the servers would
    monkeypatch.setattr(
        sglang_engine.httpx,
        "AsyncClient",
        lambda **kw: client(**{**kw, "transport": httpx.MockTransport(handler)}),
    )
    config = load_config(
        None,
        [
            "env.id=reflow/Calc-v0",
            "engine.kind=sglang",
            "engine.urls=[http://gpu-a:30000]",
            f"model={small_model}",
            "model.lora={r: 4, alpha: 8.0, target_modules: [q_proj, v_proj]}",
            "eval.max_new_tokens=1",
            "rollout.max_turns=1",
        ],
    )
    greedy, _, _ = asyncio.run(play_held_out(config, str(ckpt), 2, 0))
    assert len(greedy) == 2
    assert [path for _, path in loaded] == [str(ckpt.resolve())]
    assert named and set(named) == {loaded[0][0]}
