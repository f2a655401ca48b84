"""Which constructor kwargs a client may set, per env, and the values each may take.

The operator declares each one: `--allow-client-kwarg ENV_ID:NAME=TYPE`, TYPE one of `int:LO..HI`,
`float:LO..HI`, `bool`, `choice:A,B,...` or `tasks`. There is no free string, so a client never names a
host path; `tasks` (the `tasks` kwarg only) is a list of task objects, data and never a file to read;
`sandbox` (where model code runs) is the operator's alone. Every distinct value opens its own pool of
idle envs, so the server also caps idle envs in all (`EnvPool`).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

from reflow.env.registration import spec_kwargs
from reflow.server.schemas import ApiError

FORMAT = "ENV_ID:NAME=TYPE, TYPE one of int:LO..HI, float:LO..HI, bool, choice:A,B,... or tasks"
OPERATOR_ONLY = frozenset({"sandbox"})
"""Kwargs no client sets, whatever the flags say: where model code runs."""
MAX_TASKS = 1024


@dataclass(frozen=True)
class KwargRule:
    """The values one client kwarg may take."""

    type: str
    low: float = -math.inf
    high: float = math.inf
    choices: tuple[str, ...] = ()

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused, or None."""
        if self.type == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if self.type == "choice":
            return (
                None if value in self.choices and isinstance(value, str) else f"must be one of {self.choices}"
            )
        if self.type == "tasks":
            ok = isinstance(value, list) and 0 < len(value) <= MAX_TASKS
            if ok and all(isinstance(task, dict) for task in value):
                return None
            return f"must be a list of 1 to {MAX_TASKS} task objects (data, never a path)"
        number = (int,) if self.type == "int" else (int, float)
        if isinstance(value, number) and not isinstance(value, bool) and self.low <= value <= self.high:
            return None
        return (
            f"must be {'an integer' if self.type == 'int' else 'a number'} in [{self.low:g}, {self.high:g}]"
        )


def parse_rule(text: str) -> tuple[str, str, KwargRule]:
    """`ENV_ID:NAME=TYPE` as (env id, kwarg name, rule); ValueError says what is wrong."""
    env_id, _, rest = text.partition(":")
    name, _, spec = rest.partition("=")
    if not (env_id and name and spec):
        raise ValueError(f"--allow-client-kwarg {text!r}: expected {FORMAT}")
    if name in OPERATOR_ONLY:
        raise ValueError(f"--allow-client-kwarg {text!r}: {name} is the operator's to set (--env-kwargs)")
    kind, _, arg = spec.partition(":")
    if (name == "tasks") != (kind == "tasks"):
        raise ValueError(
            f"--allow-client-kwarg {text!r}: tasks are data, declared as tasks=tasks (type tasks is only "
            "for the tasks kwarg)"
        )
    if kind in ("bool", "tasks") and not arg:
        return env_id, name, KwargRule(kind)
    if kind == "choice" and arg:
        return env_id, name, KwargRule(kind, choices=tuple(arg.split(",")))
    if kind in ("int", "float"):
        low, sep, high = arg.partition("..")
        try:
            bounds = (int(low), int(high)) if kind == "int" else (float(low), float(high))
        except ValueError:
            bounds = None
        if not sep or bounds is None or not all(map(math.isfinite, bounds)) or bounds[0] > bounds[1]:
            raise ValueError(f"--allow-client-kwarg {text!r}: {kind} needs a range, {kind}:LO..HI, LO <= HI")
        return env_id, name, KwargRule(kind, *bounds)
    raise ValueError(f"--allow-client-kwarg {text!r}: unknown type {spec!r}; expected {FORMAT}")


def _takes(env_id: str, name: str) -> bool:
    """Whether the env's constructor has a parameter `name` (or takes any keyword)."""
    module, _, attr = spec_kwargs(env_id)["env_entry_point"].partition(":")
    parameters = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def parse_rules(texts: list[str], served: list[str]) -> dict[str, dict[str, KwargRule]]:
    """The rules of the flags, by env id and kwarg name; each env must be served and take the kwarg."""
    rules: dict[str, dict[str, KwargRule]] = {}
    for text in texts:
        env_id, name, rule = parse_rule(text)
        if env_id not in served:
            raise ValueError(f"--allow-client-kwarg {text!r}: {env_id} is not served (--env)")
        try:
            takes = _takes(env_id, name)
        except (KeyError, ImportError, AttributeError) as e:  # not registered, or its module is broken
            raise ValueError(f"--allow-client-kwarg {text!r}: {env_id} cannot be looked up ({e})") from None
        if not takes:
            raise ValueError(f"--allow-client-kwarg {text!r}: {env_id} has no parameter {name!r}")
        rules.setdefault(env_id, {})[name] = rule
    return rules


def check_client_kwargs(rules: dict[str, KwargRule], kwargs: dict[str, Any]) -> None:
    """ApiError 403 for a kwarg clients may not set (here, for this env), 422 for a value out of its rule."""
    refused = sorted(set(kwargs) - set(rules))
    if refused:
        raise ApiError(403, "agent", "env_kwargs_refused", f"this server does not let clients set {refused}")
    problems = [
        f"{name} {problem}"
        for name, value in kwargs.items()
        if (problem := rules[name].problem(value)) is not None
    ]
    if problems:
        raise ApiError(422, "agent", "bad_env_kwargs", "; ".join(problems))
