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


# The layers of `reflow`, lowest first (docs/architecture.md): a module imports only from layers
# below its own, never from its own layer's other packages or from above. Every import counts: at the
# top, inside a function, or for type checking only.
LAYERS = [
    {"errors", "metrics", "console", "folders"},  # definitions and helpers the whole tree shares
    {"env", "policy"},  # the env API; the scheduling policies (pure)
    {"records", "interop", "sandbox", "models", "wandb_sink"},  # wandb_sink: the W&B settings and run
    {"server", "engine", "replay"},
    {"rollout", "train"},
    {"config"},  # the run configuration: its sections hold the lower layers' settings
    {"runtime", "sim"},  # the two drivers of the policies: Ray, and simulated time
    {"recipes"},  # the jobs
    {"cli", "__init__"},  # the command line; the package root (`import reflow` registers the envs)
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# What each layer must not import beyond the order above (siblings kept apart).
FORBIDDEN = {
    "env": {"engine", "rollout", "replay", "train", "sandbox", "server", "recipes", "models", "runtime"},
    "engine": {"env", "rollout", "replay", "train", "recipes", "sandbox", "server", "runtime"},
    "replay": {"train", "engine", "recipes", "runtime"},
    "server": {"engine", "rollout", "replay", "train", "recipes", "models", "runtime"},
    "sandbox": {"engine", "rollout", "replay", "train", "recipes", "models", "server", "runtime"},
    "rollout": {"train", "replay", "recipes", "server", "runtime"},
    "train": {"env", "engine", "recipes", "server", "sandbox", "runtime"},
    "runtime": {"recipes", "sim"},
    # the adapters to OpenEnv and verifiers envs are envs: they lean on the env API only
    "interop": {"engine", "rollout", "replay", "train", "recipes", "models", "sandbox", "server", "runtime"},
    # the cluster simulator drives the pure policies (reflow.policy, the batch planning of
    # reflow.replay) and nothing that needs a device, a model, an environment or Ray
    "sim": {"env", "engine", "rollout", "train", "recipes", "sandbox", "server", "models", "runtime"},
}


def _imports(path: Path, *, type_only: bool = True) -> set[str]:
    """Every module name `path` imports (absolute imports), wherever the import statement is; with
    type_only=False, not those under `if TYPE_CHECKING:` (what the module runs)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _reflow_imports(path: Path) -> set[str]:
    return {n.split(".")[1] for n in _imports(path) if n.startswith("reflow.")}


def _layer(path: Path) -> str:
    return path.relative_to(ROOT / "reflow").parts[0].removesuffix(".py")


def test_every_package_has_a_layer_and_nothing_imports_upward():
    packages = {_layer(p) for p in (ROOT / "reflow").rglob("*.py")}
    assert packages == set(RANK), "a package is missing from LAYERS, or LAYERS names one gone"
    upward = []
    for path in (ROOT / "reflow").rglob("*.py"):
        src = _layer(path)
        for dst in sorted(_reflow_imports(path) - {src}):
            if RANK[dst] < RANK[src]:
                continue
            upward.append(f"{path.relative_to(ROOT)} imports reflow.{dst}: layer {RANK[dst]} >= {RANK[src]}")
    assert not upward, "\n".join(upward)


def test_layers_respect_the_dependency_rules():
    # The trajectory record is shared by rollout, replay and train: it may lean on the env API only.
    assert _reflow_imports(ROOT / "reflow" / "records.py") <= {"env"}
    for layer, forbidden in FORBIDDEN.items():
        for path in (ROOT / "reflow" / layer).rglob("*.py"):
            bad = _reflow_imports(path) & forbidden
            assert not bad, f"{path.relative_to(ROOT)} imports reflow.{sorted(bad)}"


# The policies are plain objects and functions: no Ray, no clock, no event loop, no threads or
# processes, no sockets, no files, no randomness of their own (a generator is passed in); the drivers
# (the Ray runtime, the simulator) bring those. One rule for the whole folder.
NOT_IN_POLICIES = {
    *("ray", "time", "datetime", "asyncio", "threading", "multiprocessing", "concurrent", "sched"),
    *("subprocess", "signal", "socket", "selectors", "ssl", "http", "urllib", "requests", "httpx"),
    *("os", "sys", "io", "pathlib", "shutil", "tempfile", "glob", "sqlite3", "pickle", "shelve"),
    *("logging", "random", "secrets", "uuid", "torch", "numpy"),
}


def test_the_policy_folder_is_pure():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    files = sorted((ROOT / "reflow" / "policy").glob("*.py"))
    assert {p.name for p in files} >= {"elastic.py", "tail.py", "dual_cycle.py", "actuator.py"}
    for path in files:
        rel = path.relative_to(ROOT)
        tops = {n.split(".")[0] for n in _imports(path)}
        assert tops <= stdlib | {"reflow"}, f"{rel} imports {sorted(tops - stdlib - {'reflow'})}"
        assert _reflow_imports(path) <= {"metrics", "policy"}, f"{rel} imports {_reflow_imports(path)}"
        runs = {n.split(".")[0] for n in _imports(path, type_only=False)}
        assert not runs & NOT_IN_POLICIES, f"{rel} imports {sorted(runs & NOT_IN_POLICIES)}"
        calls = {
            n.func.id
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not calls & {"open", "print", "input"}, (
            f"{rel} calls {sorted(calls & {'open', 'print', 'input'})}"
        )
    assert {n.split(".")[0] for n in _imports(ROOT / "reflow" / "metrics.py")} <= stdlib
    # the batch planning queries a store passed in; the file itself imports no clock or I/O
    planning = {n.split(".")[0] for n in _imports(ROOT / "reflow" / "replay" / "planning.py")}
    assert not planning & NOT_IN_POLICIES, sorted(planning & NOT_IN_POLICIES)


def test_the_ray_runtime_and_the_simulator_implement_the_actuator():
    """One seam between the policies and what applies their decisions: both implementations have every
    method of the protocol with its exact parameters and types, so changing the seam changes both."""
    import inspect
    import typing

    from reflow.policy.actuator import Actuator
    from reflow.runtime.actuator import RayActuator
    from reflow.sim.policies import SimActuator

    def shape(fn: object) -> tuple:
        sig, hints = inspect.signature(fn), typing.get_type_hints(fn)
        params = [(p.name, p.kind, hints.get(p.name), p.default) for p in sig.parameters.values()]
        return params, hints.get("return")

    methods = {n for n, v in vars(Actuator).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == {"move_slot", "lend", "migrate", "free_engine", "set_concurrency"}
    for cls in (RayActuator, SimActuator):
        for name in sorted(methods):
            assert name in vars(cls), f"{cls.__name__} does not implement Actuator.{name}"
            assert shape(vars(cls)[name]) == shape(vars(Actuator)[name]), f"{cls.__name__}.{name}"


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
    # What a class may inherit from at all: `test_no_mixins`.
    for rel, name in (
        ("reflow/engine/torch_engine.py", "TorchEngine"),
        ("reflow/engine/sglang_engine.py", "SGLangEngine"),
    ):
        (cls,) = [c for c in _classes(ROOT / rel) if c.name == name]
        assert not cls.bases, f"{name} inherits behaviour: {[ast.unparse(b) for b in cls.bases]}"


# The bases a class may inherit from: the env API (Env, its wrappers, ToolEnv; Gymnasium's Env and
# spaces for the facade), exceptions, Protocols, pydantic models and the config's sections (made by
# `reflow.config._fields_of`), Enum, NamedTuple and TypedDict, and a library's extension point that the
# library itself calls back (asyncio's and uvicorn's protocols, httpx's transport, argparse's parser).
# Any other base is a mixin: behaviour that reads state the subclass must set. A dataclass may extend
# a dataclass when both are records (fields, no methods): the subclass adds fields, no behaviour.
ALLOWED_BASES = {
    *("Env", "Wrapper", "ToolEnv", "gymnasium.Env", "spaces.Text", "spaces.Space"),
    *("Protocol", "BaseModel", "Enum", "IntEnum", "StrEnum", "NamedTuple", "TypedDict"),
    *(
        "asyncio.SubprocessProtocol",
        "AutoHTTPProtocol",
        "httpx.AsyncBaseTransport",
        "argparse.ArgumentParser",
    ),
}


def test_no_mixins():
    import builtins

    exceptions = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    classes: dict[str, list[ast.ClassDef]] = {}
    for folder in ("reflow", "tools", "envs"):
        for path in (ROOT / folder).rglob("*.py"):
            for cls in _classes(path):
                classes.setdefault(cls.name, []).append(cls)

    def is_record(cls: ast.ClassDef) -> bool:
        dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
        return dataclass and not any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in cls.body)

    def allowed(base: ast.expr, sub: ast.ClassDef, seen: frozenset[str] = frozenset()) -> bool:
        if isinstance(base, ast.Call):  # a section model made from a lower layer's config dataclass
            return ast.unparse(base.func) == "_fields_of"
        if isinstance(base, ast.Subscript):  # Space[list], Generic[T]
            base = base.value
        name = ast.unparse(base)
        short = name.rsplit(".", 1)[-1]
        if name in ALLOWED_BASES or short in ALLOWED_BASES or short in exceptions:
            return True
        if short not in classes or short in seen:
            return False
        return all(
            (is_record(own) and is_record(sub))
            or (bool(own.bases) and all(allowed(b, own, seen | {short}) for b in own.bases))
            for own in classes[short]
        )

    mixed = {}
    for name, defs in sorted(classes.items()):
        for cls in defs:
            bad = [ast.unparse(b) for b in cls.bases if not allowed(b, cls)]
            if bad:
                mixed[name] = ", ".join(bad)
    assert not mixed, f"classes that inherit behaviour (make it a component they hold): {mixed}"


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


def test_builtin_envs_import_only_the_public_env_and_sandbox_apis():
    # An env that runs model-written code asks `reflow.sandbox` for a runner; nothing else of reflow.
    public = {"reflow.env", "reflow.env.answers", "reflow.sandbox"}
    for path in (ROOT / "envs").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top != "reflow_tools", f"{path.relative_to(ROOT)} imports {name}: it runs in the sandbox"
            if top == "reflow":
                assert name in public, f"{path.relative_to(ROOT)} imports {name}"


def test_the_in_sandbox_tool_server_imports_only_the_standard_library():
    """`tools/` runs in the sandbox's own Python, sent as the text of `python3 -c`: no reflow, no
    third-party package, at the top of a file or inside a function."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    files = sorted((ROOT / "tools").rglob("*.py"))
    assert {p.relative_to(ROOT).as_posix() for p in files} >= {
        "tools/in_sandbox/server.py",
        "tools/in_sandbox/procs.py",
    }
    for path in files:
        tops = {n.split(".")[0] for n in _imports(path)}
        assert tops <= stdlib | {"reflow_tools"}, f"{path.relative_to(ROOT)} imports {sorted(tops - stdlib)}"
        assert not {n for n in _imports(path) if n.startswith("reflow_tools.") and "in_sandbox" not in n}
    for path in [*(ROOT / "reflow").rglob("*.py"), *(ROOT / "envs").rglob("*.py")]:
        assert not {n for n in _imports(path) if n.split(".")[0] == "reflow_tools"}, path.relative_to(ROOT)


def _module_files() -> dict[str, Path]:
    """Every module of the three installed packages, by its import name (a package by its __init__)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for name, folder in cfg["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (every import statement, wherever it is;
    `from package import submodule` is an edge to the submodule, other names an edge to the package)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != module}
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules():
    """No two modules of reflow, reflow_envs and reflow_tools import each other, directly or around a
    loop, counting imports inside functions and for type checking only: a circle works only as long as
    nobody reorders the imports, and it makes two modules one unit to read."""
    graph = _import_graph()
    assert {"reflow.sandbox.code_runner", "reflow_envs.pycode.env", "reflow_tools.in_sandbox.server"} <= set(
        graph
    )
    assert "reflow.sandbox.session" in graph["reflow.sandbox.code_runner"]
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_one_meaning_per_name():
    """A reader who meets a name twice meets one concept: no module beside its own plural or beside a
    near-twin (`checkpoint`/`checkpoints`), and "pool" only for a set of reusable objects handed out
    and taken back (sandboxes, env instances); the run's device slots are its `Cluster`."""
    modules = _module_files()
    stems: dict[str, set[str]] = {}
    for module in modules:
        package, _, stem = module.rpartition(".")
        stems.setdefault(package, set()).add(stem)
    for package, names in stems.items():
        twins = sorted(n for n in names if f"{n}s" in names)
        assert not twins, f"{package}: {twins} beside their plurals"
    pool_homes = ("reflow.sandbox", "reflow.server")
    for module, path in modules.items():
        if module.startswith(pool_homes):
            continue
        assert "pool" not in module.rpartition(".")[2], f"{module}: a pool outside {pool_homes}"
        pools = [c.name for c in _classes(path) if c.name.endswith("Pool")]
        assert not pools, f"{module}: {pools}"


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
    assert "reflow_envs/calc/env.py" in names and "reflow_tools/in_sandbox/server.py" in names
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
