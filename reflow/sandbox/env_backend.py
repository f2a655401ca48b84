"""Where an env runs model-written code, asked of its registration before any env is made.

An env that runs model code takes a `sandbox` constructor kwarg, the convention of
`reflow.sandbox.code_runner` (PyCode-v0 follows it): "docker", "process", "subprocess" or "auto" (the
strongest that works here). `env_backend` resolves that kwarg as the env will, so the env server can
refuse, and `agent-train` warn about, an env that would run model code on the host: "auto" becomes
"subprocess" when neither Docker nor bubblewrap works, and nothing else would say so but the `sandbox`
field of each observation's info. `uncapped_reason` says when an env's code would run in bubblewrap
sandboxes with no cgroup (their processes and tmpfs charged to no memory or pids limit), which the
server also refuses unless told otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from reflow.env.registration import spec_kwargs
from reflow.sandbox.factory import resolve_kind

HOST = "subprocess"
PROCESS = "process"
"""The bubblewrap sandbox: bounded by a cgroup only where one can be made (`cgroup_problem`)."""
"""The kind that is no sandbox: a host subprocess with rlimits, as the user running the process."""
KWARG = "sandbox"
FORCE_ENV_VAR = "REFLOW_SANDBOX"
"""What `best_backend` obeys instead of probing."""


_ABSENT = object()


def _sandbox_kwarg(env_id: str, kwargs: dict[str, Any] | None) -> Any:
    """The `sandbox` value the env will be made with (its default when nobody sets it), or `_ABSENT`."""
    spec = spec_kwargs(env_id)
    given = {**spec["env_kwargs"], **(kwargs or {})}
    if KWARG in given:
        return given[KWARG]
    module, _, name = spec["env_entry_point"].partition(":")
    parameter = inspect.signature(getattr(importlib.import_module(module), name)).parameters.get(KWARG)
    if parameter is None:
        return _ABSENT
    return None if parameter.default is inspect.Parameter.empty else parameter.default


def _resolve(value: Any) -> str | None:
    if value is _ABSENT:
        return None
    if value is None or isinstance(value, str):
        return resolve_kind(value)
    return getattr(value, "kind", None)  # a runner object passed in


def env_backend(env_id: str, kwargs: dict[str, Any] | None = None) -> str | None:
    """The kind env `env_id` made with `kwargs` runs model code in ("docker", "process" or `HOST`), or
    None when its constructor takes no `sandbox` kwarg (it runs no model code)."""
    return _resolve(_sandbox_kwarg(env_id, kwargs))


def host_code_reason(env_id: str, kwargs: dict[str, Any] | None = None) -> str | None:
    """Why `env_id` would run model code on the host, in a few words; None when it would not."""
    value = _sandbox_kwarg(env_id, kwargs)
    if _resolve(value) != HOST:
        return None
    if value == HOST:
        return f"it is configured with {KWARG}={HOST}"
    if os.environ.get(FORCE_ENV_VAR, "").strip().lower() == HOST:
        return f"${FORCE_ENV_VAR}={HOST}"
    return "no sandbox works here: no Docker engine with the image (`reflow sandbox build`), no bubblewrap"


def uncapped_reason(env_id: str, kwargs: dict[str, Any] | None = None) -> str | None:
    """Why `env_id` would run model code in process sandboxes that no cgroup bounds; None when its
    sandboxes are another kind or each gets its own cgroup."""
    if env_backend(env_id, kwargs) != PROCESS:
        return None
    from reflow.sandbox import cgroup  # read at call time: the probe is cached there, once a process

    return cgroup.cgroup_problem()


def host_code_warning(env_id: str, kwargs: dict[str, Any] | None = None) -> str | None:
    """One line when `env_id` would run model code on the host, else None."""
    reason = host_code_reason(env_id, kwargs)
    if reason is None:
        return None
    return f"warning: {env_id} runs model-written code on this host, unsandboxed ({reason})"
