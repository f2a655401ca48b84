"""The `reflow` console script, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_envs import BUILTIN_ENVS

REFLOW = str(Path(sys.executable).parent / "reflow")


def run(*args, input=None):
    return subprocess.run([REFLOW, *args], capture_output=True, text=True, input=input, timeout=300)


def test_envs_list_shows_the_builtin_envs():
    out = run("envs", "list")
    assert out.returncode == 0, out.stderr
    for env_id in BUILTIN_ENVS:
        assert env_id in out.stdout
    assert "calculator" in out.stdout and "run_python" in out.stdout


@pytest.mark.slow
def test_envs_check_all_passes():
    out = run("envs", "check", "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    assert out.stdout.count("reflow envs check") == len(BUILTIN_ENVS)


def test_envs_check_reports_an_unknown_id_clearly():
    out = run("envs", "check", "reflow/NoSuch-v0")
    _one_error_line(out, 2, "no ReFlow env registered as 'reflow/NoSuch-v0'")


def _one_error_line(out: subprocess.CompletedProcess, code: int, text: str) -> str:
    """The command failed with `code` and said so in one line on stderr, containing `text`."""
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reflow: error: "), out.stderr
    assert text in lines[0], lines[0]
    assert out.returncode == code, (out.returncode, out.stderr)
    return lines[0]


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["serve-envs", "--token-file", "{short}"], 2, "at least 16 characters"),
        (["serve-envs", "--token-file", "{tmp}/missing"], 2, "No such file"),
        (["serve-envs", "--no-auth", "--env-kwargs", "{not json"], 2, "--env-kwargs is not valid JSON"),
        (["serve-envs", "--no-auth", "--max-sessions", "0"], 2, "max_sessions must be >= 1"),
        (["serve-envs", "--no-auth", "--host", "0.0.0.0"], 2, "only on a loopback host"),
        (["serve-envs", "--port", "eighty"], 2, "invalid int value"),
        (["agent-train", "--config", "{tmp}/missing.yaml"], 2, "does not exist"),
        (["agent-train", "env.id=reflow/Calc-v0", "train.lr=fast", "train.nope=1"], 2, "train.lr"),
        (["agent-train", "--resume", "{tmp}/no-run"], 2, "no run to resume"),
        (["replay", "inspect", "{tmp}/no-run"], 2, "no replay store"),
        (["envs", "play", "reflow/NoSuch-v0"], 2, "no ReFlow env registered"),
        (["envs", "frob"], 2, "invalid choice: 'frob'"),
    ],
)
def test_errors_are_one_line_on_stderr_with_the_exit_code(tmp_path, args, code, text):
    short = tmp_path / "token"
    short.write_text("short\n")
    short.chmod(0o600)
    argv = [a.format(tmp=tmp_path, short=short) if "{" in a and "}" in a else a for a in args]
    line = _one_error_line(run(*argv), code, text)
    if "train.lr" in text:  # a config error with two bad keys is still one line, naming both
        assert "train.nope" in line


def test_a_port_in_use_is_a_runtime_failure(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run("serve-envs", "--no-auth", "--port", str(port), "--env", "reflow/Calc-v0")
    _one_error_line(out, 1, f"cannot listen on 127.0.0.1:{port}")


def test_an_unexpected_failure_is_one_line_unless_asked_for_the_traceback(tmp_path, monkeypatch, capsys):
    from reflow import cli

    def crash(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "cmd_envs_list", crash)  # build_parser reads the name when main runs
    monkeypatch.delenv("REFLOW_TRACEBACK", raising=False)
    assert cli.main(["envs", "list"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "reflow: error: ZeroDivisionError: a bug (set REFLOW_TRACEBACK=1 to see where)"
    ]
    monkeypatch.setenv("REFLOW_TRACEBACK", "1")
    assert cli.main(["envs", "list"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "reflow: error: ZeroDivisionError: a bug"


def test_envs_check_fails_on_a_crashing_env(capsys):
    from reflow.cli import main

    assert main(["envs", "check", "test/Crashy-v0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "env_error" in out and "check(s) failed" in out


def test_envs_play_prints_success_and_length_distribution():
    out = run("envs", "play", "reflow/Calc-v0", "--episodes", "50", "--error-rate", "0.1", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])[0]
    assert summary["episodes"] == 50
    assert 0.4 < summary["success_rate"] < 1.0
    assert 1 <= summary["turns_p50"] <= summary["turns_p90"] <= summary["turns_max"] <= 12
    assert "success" in out.stdout and "turns p90" in out.stdout


def test_envs_play_from_stdin():
    moves = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>\nThe answer is \\boxed{42}.\n'
    out = run("envs", "play", "reflow/Calc-v0", "--policy", "stdin", "--episodes", "1", "--json", input=moves)
    assert out.returncode == 0, out.stderr
    assert "tool: 42" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])[0]
    assert summary["statuses"] == {"ok": 1} and summary["turns_max"] == 2


def test_envs_play_writes_episode_records(tmp_path):
    path = tmp_path / "episodes.jsonl"
    out = run("envs", "play", "reflow/Guess-v0", "--episodes", "3", "--out", str(path))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3 and all(r["status"] == "ok" and r["messages"] for r in records)
