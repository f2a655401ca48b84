"""The tool server's protocol and tools, run as a plain child process (no sandbox, no sweep): these run
on any machine, with or without Docker or bubblewrap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reflow.sandbox.channel import PipeStream, ToolServerClient, server_program


@pytest.fixture
def server(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-s", "-c", server_program()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=tmp_path,
    )
    client = ToolServerClient(PipeStream(proc.stdin, proc.stdout), "test server")
    hello = client.request("hello", {"workdir": str(tmp_path), "env": {"PYTHONHASHSEED": "0"}}, 10)
    assert hello["ok"] and hello["data"]["protocol"] == 1

    def call(op: str, **args):
        return client.request(op, args, 30)

    yield call
    client.close()
    proc.kill()
    proc.wait()


def test_every_reply_has_the_same_fields(server):
    for reply in (server("ping"), server("run_shell", command="true"), server("list_dir")):
        assert {
            "id",
            "ok",
            "stdout",
            "stderr",
            "exit_code",
            "timed_out",
            "truncated",
            "latency_s",
            "error",
            "data",
        } <= set(reply)


def test_run_python_matches_a_python_process(server):
    ok = server("run_python", code="import sys\nprint('hello')\nprint(sys.stdin.read().upper())", stdin="abc")
    assert (ok["ok"], ok["stdout"], ok["stderr"], ok["exit_code"]) == (True, "hello\nABC\n", "", 0)
    failed = server("run_python", code="print('before')\nraise ValueError('boom')")
    assert failed["exit_code"] == 1 and failed["stdout"] == "before\n"
    assert failed["stderr"] == (
        'Traceback (most recent call last):\n  File "main.py", line 2, in <module>\n'
        "    raise ValueError('boom')\nValueError: boom\n"
    )
    syntax = server("run_python", code="def f(:\n    pass")
    assert (
        syntax["exit_code"] == 1
        and 'File "main.py", line 1' in syntax["stderr"]
        and "SyntaxError" in syntax["stderr"]
    )
    assert server("run_python", code="raise SystemExit('bye')")["stderr"] == "bye\n"
    assert server("run_python", code="import sys; sys.exit(7)")["exit_code"] == 7
    threads = server(
        "run_python",
        code="import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()",
    )
    assert threads["stdout"] == "joined\n"  # non-daemon threads finish, as at a normal interpreter exit
    hooks = server("run_python", code="import atexit\natexit.register(print, 'at exit')")
    assert hooks["stdout"] == "at exit\n"


def test_each_call_gets_a_fresh_main_module(server):
    server("run_python", code="x = 1")
    second = server("run_python", code="print('x' in globals(), __name__)")
    assert second["stdout"] == "False __main__\n"


def test_timeouts_caps_and_limits(server):
    loop = server("run_python", code="print('started', flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert loop["timed_out"] and not loop["ok"] and loop["exit_code"] == -9 and loop["stdout"] == "started\n"
    assert "timed out after 0.5s" in loop["error"]
    flood = server(
        "run_shell", command="head -c 5000000 /dev/zero | tr '\\0' y; echo done >&2", output_limit=100
    )
    assert (
        flood["truncated"]
        and flood["stdout"] == "y" * 100
        and flood["stderr"] == "done\n"
        and flood["exit_code"] == 0
    )
    memory = server("run_python", code="x = bytearray(4 * 1024**3)", memory_mb=256)
    assert memory["exit_code"] == 1 and "MemoryError" in memory["stderr"]


def test_files(server, tmp_path):
    assert server("write_file", path="sub/a.txt", content="hello")["data"]["bytes"] == 5
    assert (tmp_path / "sub" / "a.txt").read_text() == "hello"
    assert server("write_file", path="sub/a.txt", content=" world", append=True)["ok"]
    assert server("read_file", path="sub/a.txt")["stdout"] == "hello world"
    cut = server("read_file", path="sub/a.txt", max_bytes=5)
    assert cut["stdout"] == "hello" and cut["truncated"]
    assert server("read_file", path="sub/a.txt", encoding="base64")["data"] == "aGVsbG8gd29ybGQ="
    listing = server("list_dir", path=".", recursive=True)
    assert listing["data"] == [{"path": "sub", "type": "dir", "size": listing["data"][0]["size"]},
                               {"path": "sub/a.txt", "type": "file", "size": 11}]  # fmt: skip
    assert not server("list_dir", path="nope")["ok"]
    assert "not a regular file" in server("read_file", path="/dev/null")["error"]


def test_bad_requests_are_answered_not_fatal(server):
    assert "unknown op" in server("explode")["error"]
    assert "bad arguments for run_shell" in server("run_shell", cmd="true")["error"]
    assert server("run_shell", command="true", cwd="missing")["error"].startswith("no such directory")
    assert server("ping")["ok"]


def test_a_malformed_line_gets_an_error_reply(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-s", "-c", server_program()], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    out, _ = proc.communicate(
        b"this is not json\n" + json.dumps({"id": 1, "op": "shutdown"}).encode() + b"\n", timeout=30
    )
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["id"] is None and first["error"].startswith("bad request")
    assert second["id"] == 1 and second["ok"] and proc.returncode == 0
