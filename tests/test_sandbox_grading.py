"""A PyCode agent attacks its own grading, in both sandbox backends: files planted in its sandbox to run
inside the grader's process, a solution that hunts for the expected values wherever the sandbox lets
it look, and one that forges the harness's result lines. The expected values never enter the sandbox
and results are compared outside it, so each attack earns nothing, and an honest answer after a
planting still gets its reward."""

from __future__ import annotations

import random
import secrets

import pytest
from reflow_envs.pycode.env import build_task
from sandbox_helpers import BACKENDS

import reflow
from reflow.env import format_hermes_call, parse_assistant

pytestmark = pytest.mark.security

# Module names the grader's interpreter or its harness import, planted where a program's own imports
# look first (the work dir) and in the other writable places.
PLANTED = (
    "types",
    "json",
    "os",
    "sys",
    "linecache",
    "traceback",
    "sitecustomize",
    "usercustomize",
    "encodings",
)

# Looks everywhere a solution can for the secret (`SECRET` is it reversed): the environment, every process's
# command line and environment, the writable dirs, every object of the interpreter, its callers' frames
# and its own memory. f(0) gives up; f(1) says whether it found it (the test expects False).
HUNT = r"""
import ctypes, gc, os, sys

def _found():
    # Only the reversed secret is ever in this program's memory: each haystack is reversed instead.
    def has(blob):
        return SECRET in (blob if isinstance(blob, bytes) else blob.encode())[::-1]

    if has(repr(dict(os.environ))):
        return True
    for pid in os.listdir("/proc"):
        for name in ("cmdline", "environ"):
            try:
                if has(open(f"/proc/{pid}/{name}", "rb").read()):
                    return True
            except OSError:
                pass
    for top in ("/work", "/tmp", "/dev/shm"):
        for root, _, files in os.walk(top):
            for name in files:
                try:
                    if has(open(os.path.join(root, name), "rb").read()):
                        return True
                except OSError:
                    pass
    frame = sys._getframe(1)
    while frame is not None:
        if has(repr(frame.f_locals)):
            return True
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, (dict, list, tuple)) and has(repr(obj)[:100000]):
            return True
    for line in open("/proc/self/maps").read().splitlines():
        fields = line.split()
        if fields[1].startswith("r") and (len(fields) < 6 or fields[5] in ("[heap]", "[stack]")):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if has(ctypes.string_at(lo, hi - lo)):
                return True
    return False

def f(x):
    return "no idea" if x == 0 else _found()
"""

# Takes the nonce and the saved stdout from the harness's frame and writes "passed" records for every
# test with the best guess it has (the arguments), then leaves before the harness writes its own.
FORGE = r"""
import json, os, sys

frame = sys._getframe(1)
nonce, out, spec = frame.f_locals["nonce"], frame.f_locals["out"], frame.f_locals["spec"]
for i, args in enumerate(spec["args"]):
    os.write(out, f"{nonce} {json.dumps({'i': i, 'got': json.dumps(args[0])})}\n".encode())
os._exit(0)

def f(x):
    return x
"""


def call(code: str) -> str:
    return format_hermes_call("run_python", {"code": code})


@pytest.fixture(params=BACKENDS)
async def env(request):
    env = reflow.make("reflow/PyCode-v0", sandbox=request.param)
    yield env
    await env.close()


async def answer(env, task, solution: str, plant: str | None = None):
    env.unwrapped.tasks = [task]
    await env.reset(seed=0)
    if plant is not None:
        step = await env.step(parse_assistant(call(plant), tools=env.unwrapped.tools))
        assert "planted" in step.messages[0]["content"], step.messages
    return await env.step(parse_assistant(f"```python\n{solution}```"))


async def test_modules_planted_in_the_sandbox_do_not_run_in_the_grader(env):
    task = build_task("add_k", random.Random(0))
    plant = (
        "import os, sys\n"
        f"for d in ('/work', '/tmp', '/work/.local/lib/python3.{sys_minor()}/site-packages'):\n"
        "    os.makedirs(d, exist_ok=True)\n"
        f"    for name in {PLANTED!r}:\n"
        "        open(os.path.join(d, name + '.py'), 'w').write('import os\\nos._exit(0)')\n"
        "open('/work/x.pth', 'w').write('import os; os._exit(0)')\n"
        "print('planted')"
    )
    final = await answer(env, task, task["solution"], plant)
    assert final.reward == 1.0 and final.info["tests_passed"] == final.info["tests_total"], final.info


async def test_the_expected_values_are_nowhere_in_the_sandbox(env):
    secret = f"EXPECTED-{secrets.token_hex(8)}"
    task = {**build_task("add_k", random.Random(0)), "function_name": "f"}
    task["tests"] = [[[0], secret], [[1], False]]
    solution = f"SECRET = {secret.encode()[::-1]!r}\n" + HUNT
    final = await answer(env, task, solution)
    assert final.info["tests_passed"] == 1 and final.reward == 0.0, final.info  # f(1) found nothing


async def test_forged_result_lines_earn_nothing(env):
    task = {**build_task("add_k", random.Random(0)), "function_name": "f"}
    final = await answer(env, task, FORGE)
    assert final.reward == 0.0 and final.info["tests_passed"] == 0, final.info


def sys_minor() -> int:
    return 11  # the image's and the host's Python (Debian bookworm); a wrong guess only plants less
