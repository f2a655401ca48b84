"""`reflow simulate --predict / --sweep / --plot`: the standard five-mode comparison, the same at each
value of one key, and the bar chart; every shipped prediction scenario validates."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from reflow.sim.config import load_scenario

ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    "name": "small",
    "gpus": 8,
    "gpu": {"name": "G", "hbm_gb_s": 3000, "bf16_tflops": 400, "memory_gb": 80},
    "model": {"name": "M", "params_b": 1.5, "kv_bytes_per_token": 28672},
    "workload": {"response_tokens": {"median": 500, "sigma": 0.8}, "max_response_tokens": 4000},
    "batch": {"groups": 8, "samples_per_group": 4},
    "train": {"mfu": 0.3, "fixed_s": 1.0},
    "mode": {"mode": "reflow", "rollout_gpus": 2, "eta": 1, "cycle": {"max_reuse": 2, "share_max": 0.5}},
    "run": {"steps": 5, "warmup_steps": 1, "seed": 3},
}


def _write(tmp_path: Path, file: str = "s.yaml", **over) -> Path:
    data = copy.deepcopy(SMALL)
    data.update(over)
    path = tmp_path / file
    path.write_text(yaml.safe_dump(data))
    return path


def test_sweep_of_the_reuse_cap_changes_only_replay_and_names_each_value(tmp_path, capsys):
    from reflow.cli import main
    from reflow.sim.predict import sweep

    path = _write(tmp_path)
    rows = sweep(str(path), [], "mode.cycle.max_reuse", ["1", "2"])
    assert list(rows) == ["1", "2"]
    assert list(rows["1"]) == ["sync", "async eta=1", "async eta=2", "reflow static", "reflow full"]
    assert rows["1"]["reflow static"]["replay_fraction"] == 0.0  # K = 1: every group is trained once
    assert rows["2"]["reflow static"]["replay_fraction"] > 0.0
    # the key does not touch the modes without replay
    assert rows["1"]["async eta=1"] == rows["2"]["async eta=1"]
    assert main(["simulate", "--config", str(path), "--sweep", "mode.cycle.max_reuse=1,2"]) == 0
    out = capsys.readouterr().out
    assert "(simulated)" in out and out.count("| 2 | ") == 5
    assert main(["simulate", "--config", str(path), "--sweep", "mode.cycle.max_reuse"]) == 2
    assert "expected KEY=V1,V2" in capsys.readouterr().err


def test_predict_several_scenarios_and_plot(tmp_path, capsys):
    from reflow.cli import main

    a = _write(tmp_path, "a.yaml", name="a")
    b = _write(tmp_path, "b.yaml", name="b", gpus=16)
    png = tmp_path / "p.png"
    assert main(["simulate", "--config", str(a), str(b), "--predict", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("(simulated)") == 2 and "| reflow full |" in out
    # new work headlines, and each ratio names the rate it divides
    assert (
        "| new tok/s | vs sync (new tok/s) | trained tok/s (with replays) | vs sync (with replays) |" in out
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--config", str(a), str(b)]) == 2  # several files need --predict
    assert "need --predict" in capsys.readouterr().err


def test_every_prediction_scenario_of_the_issue_exists_and_validates():
    folder = ROOT / "configs" / "sim" / "predict"
    for size, gpus in (("4b", 8), ("8b", 32), ("32b", 128)):
        for work in ("reasoning", "agentic"):
            s = load_scenario(folder / f"qwen3-{size}-{gpus}-{work}.yaml")
            assert s.gpus == gpus and s.model.name.lower() == f"qwen3-{size}"
            assert (s.workload.max_turns > 1) == (work == "agentic")
