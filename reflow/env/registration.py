"""Registration on top of Gymnasium's registry, and discovery of env packages by entry point.

`register("reflow/Calc-v0", entry_point="pkg.module:EnvClass", ...)` adds a Gymnasium spec whose entry
point is the Gymnasium facade, with the ReFlow env's own entry point and settings in the spec's kwargs.
So there is one registry: `gymnasium.make(id)` gives the synchronous facade and `reflow.make(id)` the
async env with the standard wrappers, both built from the same spec.

Third-party packages declare a function in the `reflow.envs` entry-point group that calls `register`;
`discover()` loads them all (the built-in envs come in the same way).

`register_namespace("openenv", "reflow/OpenEnv-v0", "name")` makes a whole id namespace out of one
registered env: `make("openenv/echo")` is `make("reflow/OpenEnv-v0", name="echo")`, recorded as
`openenv/echo`. Registered ids come first; a namespace answers only ids nobody registered.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import gymnasium

from reflow.env.core import Env
from reflow.env.wrappers import ContainErrors, EpisodeDeadline, OrderEnforcing, TurnLimit

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "reflow.envs"
FACADE_ENTRY_POINT = "reflow.env.gym_facade:GymFacade"
_WRAPPER_KEYS = ("max_turns", "deadline_s")


@dataclass
class DiscoveryError:
    entry_point: str
    error: str


@dataclass(frozen=True)
class Namespace:
    env_id: str
    """The registered env every id of the namespace is made from."""
    name_kwarg: str
    """The constructor kwarg that gets the part of the id after the namespace."""


_namespaces: dict[str, Namespace] = {}
_discovered = False
_deferred = False  # an entry point was skipped because its module was mid-import; retry later
_loaded: set[str] = set()
discovery_errors: list[DiscoveryError] = []


def register(
    id: str,
    entry_point: str,
    *,
    max_turns: int | None = None,
    deadline_s: float | None = None,
    kwargs: dict[str, Any] | None = None,
    nondeterministic: bool = False,
) -> None:
    """Register an env under a Gymnasium-style id ("namespace/Name-vN").

    Args:
        id: the env id, e.g. "acme/Maze-v0".
        entry_point: "module.path:ClassOrFactory" returning a `reflow.env.Env`.
        max_turns: assistant turns before the episode is truncated (None: no limit).
        deadline_s: wall-clock budget of one episode in seconds, reset included (None: no limit).
        kwargs: default keyword arguments for the env constructor.
        nondeterministic: True if a seeded reset/step does not reproduce (tells Gymnasium's checker).
    """
    if ":" not in entry_point:
        raise ValueError(f"entry_point must look like 'module.path:Name', got {entry_point!r}")
    gymnasium.register(
        id=id,
        entry_point=FACADE_ENTRY_POINT,
        nondeterministic=nondeterministic,
        kwargs={
            "env_entry_point": entry_point,
            "env_kwargs": dict(kwargs or {}),
            "max_turns": max_turns,
            "deadline_s": deadline_s,
        },
    )


def register_namespace(namespace: str, env_id: str, name_kwarg: str) -> None:
    """Make every id `<namespace>/<name>` that is not registered itself resolve to `env_id`, with
    `<name>` as its constructor kwarg `name_kwarg` (e.g. the env an adapter plays on a remote server).
    `env_id` is looked up when such an id is made, so it may be registered after this call."""
    if not namespace or "/" in namespace:
        raise ValueError(f"a namespace is one id segment without '/', got {namespace!r}")
    _namespaces[namespace] = Namespace(env_id, name_kwarg)


def namespaces() -> dict[str, Namespace]:
    """The registered id namespaces, by name."""
    return dict(_namespaces)


def _spec(id: str) -> gymnasium.envs.registration.EnvSpec:
    discover()
    spec = gymnasium.registry.get(id)
    if spec is None or spec.entry_point != FACADE_ENTRY_POINT:
        known = ", ".join(env_ids()) or "none"
        spaces = "".join(f"; or {ns}/<name>" for ns in sorted(_namespaces))
        raise KeyError(f"no ReFlow env registered as {id!r}; registered: {known}{spaces}")
    return spec


def _resolve(id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The registered settings of `id` and the constructor kwargs its id itself sets (a namespace's name)."""
    discover()
    registered = gymnasium.registry.get(id)
    namespace, _, name = id.partition("/")
    space = _namespaces.get(namespace) if name else None
    if (registered is not None and registered.entry_point == FACADE_ENTRY_POINT) or space is None:
        return dict(_spec(id).kwargs), {}
    if not name.strip() or name != name.strip():
        raise KeyError(
            f"{id!r}: the name after {namespace}/ must be a non-empty name without spaces at its ends"
        )
    return dict(_spec(space.env_id).kwargs), {space.name_kwarg: name}


def env_ids() -> list[str]:
    """Ids of every registered ReFlow env, sorted."""
    discover()
    return sorted(k for k, s in gymnasium.registry.items() if s.entry_point == FACADE_ENTRY_POINT)


def spec_kwargs(id: str) -> dict[str, Any]:
    """The registered settings of an env: entry point, constructor kwargs, max_turns, deadline_s (for an
    id of a namespace, those of its env with the name among the constructor kwargs)."""
    settings, named = _resolve(id)
    return {**settings, "env_kwargs": {**settings["env_kwargs"], **named}}


def build_env(
    env_entry_point: str,
    env_kwargs: dict[str, Any],
    max_turns: int | None,
    deadline_s: float | None,
    env_id: str | None = None,
) -> Env:
    """Instantiate an env from its entry point and put the standard wrappers around it."""
    module, _, attr = env_entry_point.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    env = factory(**env_kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"{env_entry_point} returned {type(env).__name__}, not a reflow.env.Env")
    if env.spec_id is None:  # a proxy names the env it plays (records say what was played, not how)
        env.spec_id = env_id
    env = ContainErrors(env)
    if max_turns is not None:
        env = TurnLimit(env, max_turns)
    if deadline_s is not None:
        env = EpisodeDeadline(env, deadline_s)
    return OrderEnforcing(env)


def make(id: str, **kwargs: Any) -> Env:
    """Make the async env registered as `id` (or named by a registered namespace, `openenv/echo`);
    `max_turns`/`deadline_s` and constructor kwargs override the registered ones."""
    settings, named = _resolve(id)
    for key, value in named.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"{id!r} already sets {key}={value!r}; it cannot also be {kwargs[key]!r}")
    given = {k: v for k, v in kwargs.items() if k not in _WRAPPER_KEYS}
    env_kwargs = {**settings["env_kwargs"], **named, **given}
    limits = {k: kwargs.get(k, settings[k]) for k in _WRAPPER_KEYS}
    return build_env(settings["env_entry_point"], env_kwargs, env_id=id, **limits)


def _mid_import(module_name: str) -> bool:
    """True while `module_name` is being imported (it imported reflow, which runs discovery)."""
    module = sys.modules.get(module_name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def load_env_plugin(spec: str) -> None:
    """Import a module that registers envs, and call its registration function when `spec` names one
    ("my_pkg.envs:register_envs", the same form as a `reflow.envs` entry point). For envs registered
    by code that is not an installed entry point: a run config lists them so every worker loads them."""
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        target = getattr(module, attr, None)
        if not callable(target):
            raise ValueError(f"{spec!r}: {module_name} has no callable {attr!r}")
        with warnings.catch_warnings():  # loading a plugin twice re-registers the same ids
            warnings.filterwarnings("ignore", message=".*Overriding environment.*")
            target()


def discover(force: bool = False) -> list[DiscoveryError]:
    """Load every `reflow.envs` entry point once. A broken plugin is reported, never fatal."""
    global _discovered, _deferred
    if _discovered and not _deferred and not force:
        return discovery_errors
    if force:
        _loaded.clear()
        discovery_errors.clear()
    _discovered, _deferred = True, False
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value in _loaded:  # the same distribution can be visible twice (e.g. editable + sys.path)
            continue
        if _mid_import(ep.module):
            # `import reflow_envs.calc.env` imports reflow before reflow_envs.calc has finished.
            _deferred = True
            continue
        _loaded.add(ep.value)
        try:
            target = ep.load()
            if callable(target):
                with warnings.catch_warnings():  # re-registering on force=True is expected
                    warnings.filterwarnings("ignore", message=".*Overriding environment.*")
                    target()
        except Exception as e:
            err = DiscoveryError(f"{ep.name} = {ep.value}", f"{type(e).__name__}: {e}")
            discovery_errors.append(err)
            warnings.warn(f"reflow: env plugin {err.entry_point} failed to load: {err.error}", stacklevel=2)
    return discovery_errors


# The interop adapter's namespace: `make("openenv/<name>", url=...)` plays env <name> of an OpenEnv server
# through reflow/OpenEnv-v0 (registered by the `openenv` entry point, envs/openenv).
register_namespace("openenv", "reflow/OpenEnv-v0", "name")
