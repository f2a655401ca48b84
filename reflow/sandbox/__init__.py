"""Tool sandboxes: Docker containers (and a weaker process sandbox) that run model-written code.

- `Sandbox` (protocol): exec, run_tool, upload, download, close, is_alive; `ToolOutput` results.
- `ToolSandbox`: the one sandbox class (time limits, serialised calls, the tool calls), holding a backend
  (`SandboxBackend`): `DockerSandbox`, a container with the in-sandbox tool server as PID 1, or
  `ProcessSandbox`, bubblewrap. Their `create()` returns the `ToolSandbox`.
- `SandboxPool`: warm sandboxes for episodes, reset between them, with a live cap and a start rate.
- `SandboxSession`: an env's per-episode lease; `sandbox_tools(session)`: the tools as `reflow.env.Tool`s;
  `shared_pool`, `make_sandbox`, `best_backend`.
- `code_runner(kind)`: how an env that runs model-written Python asks for a sandbox (a `CodeRunner`), or
  a host subprocess with rlimits (`SubprocessRunner`, `host_subprocess`: no sandbox); `describe_run`: the
  text the model sees of a run.
- The server these sandboxes run is `reflow_tools.in_sandbox` (standard library only); `channel` is the
  host's end of its protocol.
- `build_image` (sandbox images from a Dockerfile or debootstrap), `reap` (orphan containers).

Nothing here imports torch, transformers or ray; the Docker SDK is imported only when used.
"""

from reflow.sandbox.agent_tools import describe_run, sandbox_tools
from reflow.sandbox.base import (
    TOOLS,
    Sandbox,
    SandboxBackend,
    SandboxDied,
    SandboxError,
    SandboxLimits,
    ToolOutput,
    ToolSandbox,
)
from reflow.sandbox.code_runner import (
    CodeRunner,
    RunnerError,
    SandboxCodeRunner,
    SubprocessRunner,
    code_runner,
)
from reflow.sandbox.docker_sandbox import DockerSandbox
from reflow.sandbox.factory import (
    backend_problem,
    best_backend,
    close_shared_pools,
    make_sandbox,
    shared_pool,
)
from reflow.sandbox.host_subprocess import ExecResult
from reflow.sandbox.images import DEFAULT_IMAGE, BuildError, ImageRecipe, build_image
from reflow.sandbox.pool import PoolExhausted, SandboxPool
from reflow.sandbox.process_sandbox import ProcessSandbox
from reflow.sandbox.reaper import reap
from reflow.sandbox.session import SandboxSession

__all__ = [
    "DEFAULT_IMAGE",
    "TOOLS",
    "BuildError",
    "CodeRunner",
    "DockerSandbox",
    "ExecResult",
    "ImageRecipe",
    "PoolExhausted",
    "ProcessSandbox",
    "RunnerError",
    "Sandbox",
    "SandboxBackend",
    "SandboxCodeRunner",
    "SandboxDied",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxSession",
    "SubprocessRunner",
    "ToolOutput",
    "ToolSandbox",
    "backend_problem",
    "best_backend",
    "build_image",
    "close_shared_pools",
    "code_runner",
    "describe_run",
    "make_sandbox",
    "reap",
    "sandbox_tools",
    "shared_pool",
]
