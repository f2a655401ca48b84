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
import time
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
        self._unreported = 0.0  # paused seconds the remote session has not heard of yet
        self._reported_at = time.monotonic()

    @property
    def waiting(self) -> bool:
        """Whether the episode's generation waits paused now."""
        return self.route is not None and self.route.waiting

    @property
    def keepalive_s(self) -> float | None:
        """How often a running generation reports to the env's server (None: no server to tell)."""
        return getattr(self.env.unwrapped, "keepalive_s", None) if self._extend is not None else None

    async def take(self, *, flush: bool = False) -> float:
        """The seconds paused since the last call (a wait in progress included); the runner's deadline
        and the env's wrappers move by them at once. A remote session hears every `keepalive_s` (of
        the pause so far, or only that it is in use) and, with `flush` (before the env's next step),
        of any pause it has not heard of."""
        paused = self.route.take_paused_s() if self.route is not None else 0.0
        if paused:
            if self.deadline is not None:
                self.deadline += paused
            extend_deadlines(self.env, paused)
        keepalive = self.keepalive_s
        if keepalive is None:
            return paused
        self._unreported += paused
        now = time.monotonic()
        if (flush and self._unreported) or (not flush and now - self._reported_at >= keepalive):
            seconds, self._unreported, self._reported_at = self._unreported, 0.0, now
            try:
                await self._extend(seconds)  # type: ignore[misc]  (keepalive_s is None without it)
            except Exception:  # a report that failed must not end the episode: its next step tells
                log.warning("reporting a pause to %r failed", self.env.unwrapped, exc_info=True)
        return paused
