"""Packaging and dependency rules from DESIGN.md."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_no_generic_top_level_names_and_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert {p.split(".")[0] for p in listed} == {"reflow", "reflow_envs", "reflow_tools"}
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, "pyproject's package list is out of date"


def test_env_api_imports_no_heavy_or_forbidden_modules():
    code = (
        "import sys, reflow, reflow.env, reflow.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray', 'sglang', 'fastapi')"
        " or m.startswith(('reflow.engine', 'reflow.train', 'reflow.replay', 'reflow.rollout'))]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_builtin_envs_import_only_the_public_env_api():
    for path in (ROOT / "envs").rglob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import reflow", "from reflow")) and not line.startswith(
                ("from reflow_", "import reflow_")
            ):
                assert line.startswith(("from reflow.env import", "from reflow.env.answers import")), (
                    f"{path}: {line}"
                )


@pytest.mark.slow
def test_wheel_installs_only_reflow_top_level_names(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("reflow_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"reflow", "reflow_envs", "reflow_tools"}
    assert "reflow_envs/calc/env.py" in names and "reflow_tools/python_exec.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[reflow.envs]" in text and "calc = reflow_envs.calc:register_envs" in text
