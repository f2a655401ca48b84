"""What an episode's pauses move: its deadlines.

An episode whose generation waits paused (sync mode's partial rollouts, a lent engine yielding to its
trainer) neither generates nor uses its env meanwhile, so the wait is no part of its budget: the
episode runner takes the seconds from the episode's route and moves by them the runner's own deadline
(`rollout.episode_deadline_s`), the env's `EpisodeDeadline` wrappers (`extend_deadlines`) and, for an
env served by `reflow serve-envs` (`RemoteEnv`), the server's session deadline (`extend_session`). A
remote session hears from the runner every `keepalive_s` while one generation runs, paused or not, so
the server's idle reaper does not close it under a long wait.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from reflow.engine import Engine
from reflow.env import Env
from reflow.env.wrappers.episode_deadline import extend_deadlines
from reflow.rollout.routing import EpisodeRoute

log = logging.getLogger(__name__)


class EpisodePauses:
    """One episode's pauses, taken from its route and applied to its env's deadlines."""

    def __init__(self, env: Env, engine: Engine | None, deadline: float | None = None) -> None:
        """`deadline`: the runner's, on the monotonic clock (None: none)."""
        self.env, self.deadline = env, deadline
        self.route = engine if isinstance(engine, EpisodeRoute) else None
        self._extend: Callable[[float], Awaitable[None]] | None = getattr(
            env.unwrapped, "extend_session", None
        )

    @property
    def waiting(self) -> bool:
        """Whether the episode's generation waits paused now."""
        return self.route is not None and self.route.waiting

    @property
    def keepalive_s(self) -> float | None:
        """How often a running generation reports to the env's server (None: no server to tell)."""
        return getattr(self.env.unwrapped, "keepalive_s", None) if self._extend is not None else None

    async def take(self, *, keepalive: bool = False) -> float:
        """The seconds paused since the last call (a wait in progress included); every deadline of the
        episode moves by them. With `keepalive` a remote session hears even when nothing paused."""
        paused = self.route.take_paused_s() if self.route is not None else 0.0
        if paused:
            if self.deadline is not None:
                self.deadline += paused
            extend_deadlines(self.env, paused)
        if self._extend is not None and (paused or keepalive):
            try:
                await self._extend(paused)
            except Exception:  # a report that failed must not end the episode: its next step tells
                log.warning("reporting a pause to %r failed", self.env.unwrapped, exc_info=True)
        return paused
