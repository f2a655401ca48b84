"""Packaging and dependency rules, and what the project's text may not refer to."""

import ast
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


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


HEAVY = ("torch", "transformers", "ray", "sglang", "fastapi", "docker")


def test_env_api_imports_no_heavy_or_forbidden_modules():
    mods = _imported_after("import reflow, reflow.env")
    assert not {m for m in mods if m.split(".")[0] in HEAVY}
    layers = (
        "reflow.engine",
        "reflow.train",
        "reflow.replay",
        "reflow.rollout",
        "reflow.sandbox",
        "reflow.server",
    )
    assert not {m for m in mods if m.startswith(layers)}


def test_cli_starts_without_heavy_imports():
    mods = _imported_after("import reflow.cli; reflow.cli.build_parser()")
    assert not {m for m in mods if m.split(".")[0] in HEAVY}


# The dependency rules (docs/architecture.md): what each layer must not import (the recipes and CLI join them all).
# `sched` (the Ray orchestration) knows every layer; no layer below it knows `sched`.
FORBIDDEN = {
    "env": {"engine", "rollout", "replay", "train", "sandbox", "server", "recipes", "models", "sched"},
    "engine": {"env", "rollout", "replay", "train", "recipes", "sandbox", "server", "sched"},
    "replay": {"train", "engine", "recipes", "sched"},
    "server": {"engine", "rollout", "replay", "train", "recipes", "models", "sched"},
    "sandbox": {"engine", "rollout", "replay", "train", "recipes", "models", "server", "sched"},
    "rollout": {"train", "replay", "recipes", "server", "sched"},
    "train": {"env", "engine", "recipes", "server", "sandbox", "sched"},
    "sched": {"recipes"},
    # the adapters to OpenEnv and verifiers envs are envs: they lean on the env API only
    "interop": {"engine", "rollout", "replay", "train", "recipes", "models", "sandbox", "server", "sched"},
    # the cluster simulator drives the pure policies (replay.cycle, sched.elastic / sched.tail) and
    # nothing that needs a device, a model or an environment
    "sim": {"env", "engine", "rollout", "train", "recipes", "sandbox", "server", "models"},
}


def _reflow_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n.split(".")[1] for n in names if n.startswith("reflow.")}


def test_layers_respect_the_dependency_rules():
    # The trajectory record is shared by rollout, replay and train: it may lean on the env API only.
    assert _reflow_imports(ROOT / "reflow" / "records.py") <= {"env"}
    for layer, forbidden in FORBIDDEN.items():
        for path in (ROOT / "reflow" / layer).rglob("*.py"):
            bad = _reflow_imports(path) & forbidden
            assert not bad, f"{path.relative_to(ROOT)} imports reflow.{sorted(bad)}"


# Policies are plain objects: no Ray, no clock,
# no event loop, no I/O, no randomness in the file itself; the drivers (Ray runtime, simulator) bring those.
POLICY_FILES = {
    "reflow/sched/elastic.py": {"ray", "time", "asyncio", "os", "socket", "random", "threading"},
    "reflow/sched/tail.py": {"ray", "time", "asyncio", "os", "socket", "random", "threading"},
    # cycle.py's functions query a ReplayStore passed in; the file itself imports no clock or I/O.
    "reflow/replay/cycle.py": {"ray", "time", "asyncio", "os", "socket"},
}


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_policies_import_no_runtime_clock_or_io():
    for rel, forbidden in POLICY_FILES.items():
        bad = _top_level_imports(ROOT / rel) & forbidden
        assert not bad, f"{rel} imports {sorted(bad)}"
    # the scheduler policies need nothing beyond the standard library and the metric definitions
    for rel in ("reflow/sched/elastic.py", "reflow/sched/tail.py"):
        assert _top_level_imports(ROOT / rel) <= set(sys.stdlib_module_names) | {"__future__", "reflow"}, rel
        assert _reflow_imports(ROOT / rel) <= {"metrics"}, rel
    assert _top_level_imports(ROOT / "reflow" / "metrics.py") <= set(sys.stdlib_module_names) | {"__future__"}


def test_only_the_entry_point_imports_the_cli():
    # `reflow.cli` imports the recipes to register their commands: a recipe importing it back (for the
    # console, say) closes an import circle. The shared console lives in `reflow.console`.
    for path in (ROOT / "reflow").rglob("*.py"):
        if path != ROOT / "reflow" / "cli.py":
            assert "cli" not in _reflow_imports(path), f"{path.relative_to(ROOT)} imports reflow.cli"


def _classes(path: Path) -> list[ast.ClassDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]


def test_classes_are_composed_not_mixed():
    # A class gets behaviour from the objects it holds, not from mixed-in bases whose attributes it
    # must set (TorchEngine holds its DecodeLoop; the engines implement the Engine protocol by shape).
    for path in (ROOT / "reflow").rglob("*.py"):
        for cls in _classes(path):
            assert len(cls.bases) <= 1, f"{path.relative_to(ROOT)}: {cls.name} has {len(cls.bases)} bases"
    for rel, name in (
        ("reflow/engine/torch_engine.py", "TorchEngine"),
        ("reflow/engine/sglang_engine.py", "SGLangEngine"),
    ):
        (cls,) = [c for c in _classes(ROOT / rel) if c.name == name]
        assert not cls.bases, f"{name} inherits behaviour: {[ast.unparse(b) for b in cls.bases]}"


def test_each_recipe_module_keeps_to_one_concern():
    # The loops' shared parts live in small modules by concern (run_state, checkpoints, evaluation,
    # run_log, weight_sync), not in one grab bag of public names a newcomer must read whole.
    for path in (ROOT / "reflow" / "recipes").glob("*.py"):
        tree = ast.parse(path.read_text())
        public = [
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not n.name.startswith("_")
        ]
        assert len(public) <= 10, (
            f"{path.relative_to(ROOT)} has {len(public)} public names: split it by concern"
        )


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


def test_the_project_text_names_no_tracker_codes_or_private_notes():
    """Users have neither the issue tracker nor the team's design notes: code, tests, configs and docs
    say the thing (or link docs/), never an issue code or a private document."""
    import re
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    forbidden = re.compile(r"DESIGN\.md|\.\./shared|\bissue F\d+|\(F\d+[ .;)]|\bF\d+ point")
    found = []
    for name in tracked.stdout.split():
        if not name.endswith((".py", ".md", ".yaml", ".yml", ".toml")) and name != "Makefile":
            continue
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if forbidden.search(line) and name != "tests/test_layout.py":
                found.append(f"{name}:{n}: {line.strip()[:80]}")
    assert not found, "\n".join(found)
