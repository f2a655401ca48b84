"""Registration on Gymnasium's registry and discovery of env packages through entry points."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium
import pytest

import reflow
from reflow.env import env_ids


def test_make_registered_env_and_override_kwargs():
    env = reflow.make("test/Echo-v0", greeting="bonjour", max_turns=2)
    assert env.unwrapped.greeting == "bonjour"
    assert env.unwrapped.spec_id == "test/Echo-v0"
    assert "test/Echo-v0" in env_ids()


def test_same_spec_serves_gymnasium_make():
    env = gymnasium.make("test/Echo-v0", env_kwargs={"greeting": "salut"})
    obs, info = env.reset(seed=0)
    assert obs == [{"role": "user", "content": "salut"}]
    assert info["tools"][0]["function"]["name"] == "echo"
    obs, *_ = env.step('<tool_call>{"name": "echo", "arguments": {"text": "ab", "times": 2}}</tool_call>')
    assert obs[0]["content"] == "abab" and obs[0]["role"] == "tool"
    env.close()


def test_unknown_id_lists_the_known_ones():
    with pytest.raises(KeyError, match="reflow/Calc-v0"):
        reflow.make("reflow/Nope-v0")


def test_register_rejects_a_bad_entry_point():
    with pytest.raises(ValueError, match=r"module\.path:Name"):
        reflow.register("test/Bad-v0", entry_point="not_a_path")


def _write_package(root: Path, name: str, body: str, entry: str) -> Path:
    pkg = root / name
    (pkg / name).mkdir(parents=True)
    (pkg / name / "__init__.py").write_text(textwrap.dedent(body))
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{name.replace("_", "-")}"
            version = "0.0.1"

            [project.entry-points."reflow.envs"]
            {name} = "{entry}"
            """
        )
    )
    return pkg


@pytest.mark.slow
def test_pip_installed_env_package_is_discovered(tmp_path):
    """The path a user takes: pip install a package that declares a `reflow.envs` entry point."""
    good = _write_package(
        tmp_path,
        "acme_envs",
        """
        import random
        from reflow.env import Env, Observation, StepResult, register

        class CoinEnv(Env):
            def generate_task(self, rng):
                return {"id": "coin", "side": rng.choice(["heads", "tails"])}

            async def _reset(self, task):
                return Observation([{"role": "user", "content": "heads or tails?"}])

            async def step(self, turn):
                won = turn.content.strip() == self.task["side"]
                return StepResult([], reward=float(won), terminated=True, info={"success": won})

            def demo(self, task, messages, rng, error_rate=0.0):
                return task["side"]

        def register_envs():
            register("acme/Coin-v0", entry_point="acme_envs:CoinEnv", max_turns=1)
        """,
        "acme_envs:register_envs",
    )
    broken = _write_package(
        tmp_path,
        "broken_envs",
        "def register_envs():\n    raise RuntimeError('boom')\n",
        "broken_envs:register_envs",
    )
    site = tmp_path / "site"
    for pkg in (good, broken):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(site),
                str(pkg),
            ],
            check=True,
            capture_output=True,
        )
    env = {**os.environ, "PYTHONPATH": str(site)}
    script = textwrap.dedent(
        """
        import json, warnings, asyncio
        warnings.simplefilter("ignore")
        import gymnasium, reflow
        from reflow.env import play_episode, scripted_policy
        from reflow.env.registration import discovery_errors
        env = reflow.make("acme/Coin-v0")
        result = asyncio.run(play_episode(env, scripted_policy(env), seed=1))
        gym_env = gymnasium.make("acme/Coin-v0")
        gym_env.reset(seed=0)
        print(json.dumps({"ids": reflow.env_ids(), "status": result.status, "success": result.success,
                          "errors": [e.entry_point for e in discovery_errors]}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "acme/Coin-v0" in report["ids"] and "reflow/Calc-v0" in report["ids"]
    assert report["status"] == "ok" and report["success"] is True
    assert report["errors"] == ["broken_envs = broken_envs:register_envs"]
    # the CLI sees it too, and reports the broken plugin without failing
    listing = subprocess.run(
        [sys.executable, "-m", "reflow.cli", "envs", "list"], env=env, capture_output=True, text=True
    )
    assert listing.returncode == 0
    assert "acme/Coin-v0" in listing.stdout and "boom" in listing.stdout
    json.dumps(report)
