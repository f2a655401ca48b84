"""The session manager: one env per session, its limits, the idempotent step cache, the reaper, shutdown.

- A session is created with `reflow.env.make` (standard wrappers included) and reset at once; its
  deadline starts then, so a slow sandbox start counts against it.
- Step `k` runs once: a retry of `k` (same turn) while it runs waits for the same result, and after it
  ran gets the stored result (`replayed`); a different turn under a used index is refused (409).
- A step runs in its own task, so a client that disconnects does not cancel the env half-way.
- When an episode ends its env is released at once: back to the env pool when it ended "ok" (see
  `envpool`), else closed (its sandbox goes back to the sandbox pool). The session record stays with
  its final result, for a retry of the last step, until it is deleted, expires (`ended_ttl_s`), or is
  pushed out by newer ones (`ended_kept`); a client need not delete a finished session.
- The reaper closes sessions idle longer than `idle_timeout_s` or past their deadline. A client whose
  episode waits without using its env (its generation paused while the trainer runs a step) says so
  with `extend`: the deadline moves that much later (`max_extend_s` in all) and the session counts as
  active; `extend` with 0 seconds only keeps it from the idle reaper. A client reports a pause as it
  goes (`RemoteEnv.keepalive_s`), so the reaper gives a session past its deadline `DEADLINE_GRACE_S`
  to hear of one; a step past the deadline is a timeout at once.
- Results are kept as JSON text, so a replayed answer costs no encoding.
- A reset that fails, or a step that ends in an env or infrastructure error, answers a generic message
  and an error id; the cause (which may name host paths) goes to the server's log (`failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from reflow.env import AssistantTurn, Env, Observation, StepResult
from reflow.server.client_kwargs import check_client_kwargs
from reflow.server.envpool import EnvPool, close_env
from reflow.server.failures import crashed_step, redact_step, reset_error, timed_out_step
from reflow.server.schemas import LIVE_STATES, ApiError, CreateSession, check_transition
from reflow.server.settings import BUILTIN_ENVS, ServerSettings

log = logging.getLogger(__name__)

RESULTS_KEPT = 4
"""Per session, the last results kept for retries (a client retries only its latest step)."""
DEADLINE_GRACE_S = 60.0
"""How long past its deadline a ready session is kept for its client's report of a pause (`extend`),
which comes every `RemoteEnv.keepalive_s` (30 s by default) while the pause lasts; capped by the idle
timeout."""
TOMBSTONES_KEPT = 16384
"""Ids of closed sessions remembered, so a late request gets 410 and a reason instead of 404."""


def served_env_ids(settings: ServerSettings) -> list[str]:
    """What the server offers: the listed ids, else the built-in envs (an allowlist, never "all that is
    registered": an installed plugin's env, or a proxy, is served only when listed)."""
    return list(settings.env_ids if settings.env_ids is not None else BUILTIN_ENVS)


def json_text(obj: Observation | StepResult) -> str:
    """An observation or step result as JSON text (their messages and info are plain data already)."""
    return json.dumps(vars(obj), default=str)


def turn_hash(turn: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(turn, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass(eq=False)
class Session:
    id: str
    env_id: str
    deadline: float
    last_active: float
    kwargs: dict[str, Any] = field(default_factory=dict)
    state: str = "creating"
    env: Env | None = None
    turns: int = 0
    extended_s: float = 0.0
    status: str | None = None
    ended_at: float = 0.0
    results: OrderedDict[int, tuple[str, str]] = field(
        default_factory=OrderedDict
    )  # index: (turn digest, JSON)
    inflight: tuple[int, str, asyncio.Task[str]] | None = None


class SessionManager:
    def __init__(self, settings: ServerSettings, served: list[str]) -> None:
        self.settings = settings
        self.served = set(served)
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()  # ended sessions still held, oldest first
        self.tombstones: OrderedDict[str, str] = OrderedDict()  # closed id -> reason
        self.counts: Counter[str] = Counter()
        self.steps_in_flight = 0
        self.draining = False
        self.envs = EnvPool(settings.env_pool_size, settings.idle_timeout_s, settings.max_idle_envs)
        self._reaper: asyncio.Task[None] | None = None

    # ---- state ---------------------------------------------------------------------------------------
    def _move(self, s: Session, new: str) -> None:
        check_transition(s.state, new)
        self.counts[s.state] -= 1
        if new != "closed":  # closed sessions are not kept, only their tombstones
            self.counts[new] += 1
        s.state = new

    @property
    def live(self) -> int:
        return sum(self.counts[state] for state in LIVE_STATES)

    def capacity(self) -> dict[str, Any]:
        live = self.live
        return {
            "max_sessions": self.settings.max_sessions,
            "live_sessions": live,
            "available": max(0, self.settings.max_sessions - live) if not self.draining else 0,
            "states": {k: v for k, v in self.counts.items() if v and k != "closed"},
            "steps_in_flight": self.steps_in_flight,
            "idle_envs": len(self.envs),
            "draining": self.draining,
        }

    def describe(self, s: Session) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "session_id": s.id,
            "env_id": s.env_id,
            "state": s.state,
            "turns": s.turns,
            "deadline_left_s": round(max(0.0, s.deadline - now), 3),
            "idle_s": round(now - s.last_active, 3),
            "status": s.status,
            "extended_s": round(s.extended_s, 3),
            "idle_timeout_s": self.settings.idle_timeout_s,
        }

    def lookup(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is not None:
            return s
        reason = self.tombstones.get(session_id)
        if reason is None:
            raise ApiError(404, "agent", "session_not_found", f"no session {session_id!r}")
        raise self.closed_error(session_id, reason)

    @staticmethod
    def closed_error(session_id: str, reason: str) -> ApiError:
        code = "session_expired" if reason == "deadline" else "session_closed"
        kind = "infra" if reason == "shutdown" else "agent"
        return ApiError(410, kind, code, f"session {session_id!r} was closed ({reason})")

    # ---- create --------------------------------------------------------------------------------------
    async def create(self, req: CreateSession) -> tuple[Session, str]:
        """A new session, reset, and its observation as JSON text."""
        cfg = self.settings
        if self.draining:
            raise ApiError(503, "infra", "draining", "the server is shutting down", self._retry_after())
        if req.env_id not in self.served:
            known = ", ".join(sorted(self.served))
            raise ApiError(404, "agent", "env_not_found", f"no env {req.env_id!r} here; served: {known}")
        check_client_kwargs(cfg.client_env_kwargs.get(req.env_id, {}), req.env_kwargs)
        if self.live >= cfg.max_sessions:
            raise ApiError(
                429, "infra", "at_capacity", f"{cfg.max_sessions} sessions are live", self._retry_after()
            )
        now = time.monotonic()
        budget = min(req.deadline_s or cfg.default_deadline_s, cfg.max_deadline_s)
        kwargs = {**cfg.env_kwargs.get(req.env_id, {}), **req.env_kwargs}
        s = Session(secrets.token_urlsafe(12), req.env_id, now + budget, now, kwargs)
        self.sessions[s.id] = s
        self.counts["creating"] += 1
        try:
            s.env = self.envs.take(req.env_id, kwargs)
            obs = await asyncio.wait_for(s.env.reset(task=req.task, seed=req.seed), budget)
        except BaseException as e:
            if s.state == "creating":
                self._move(s, "failed")
                self._forget(s, "reset_failed")
            await self._release(s)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise reset_error(e, req.env_id, req.task is not None) from e
        if s.state == "closed":  # deleted or shut down while the env was starting
            await self._release(s)
            raise self.closed_error(s.id, self.tombstones.get(s.id, "closed"))
        self._move(s, "ready")
        s.last_active = time.monotonic()
        return s, json_text(obs)

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}

    # ---- step ----------------------------------------------------------------------------------------
    async def step(
        self, session_id: str, turn_index: int, turn: dict[str, Any], parsed: AssistantTurn
    ) -> tuple[str, bool]:
        """The result of step `turn_index` (JSON text) and whether it was replayed from the store."""
        s = self.lookup(session_id)
        s.last_active = time.monotonic()
        digest = turn_hash(turn)
        stored = s.results.get(turn_index)
        if stored is not None:
            self._same_turn(stored[0], digest, turn_index)
            return stored[1], True
        if s.inflight is not None and s.inflight[0] == turn_index:
            self._same_turn(s.inflight[1], digest, turn_index)
            return await asyncio.shield(s.inflight[2]), True
        if s.state != "ready":
            what = {"stepping": f"turn {s.turns} is still running", "creating": "the env is still starting"}
            raise ApiError(
                409, "agent", "not_ready", what.get(s.state, f"the episode has ended ({s.status})")
            )
        if turn_index != s.turns:
            why = "older results are not kept" if turn_index < s.turns else "turns go one at a time"
            raise ApiError(
                409, "agent", "turn_index", f"expected turn_index {s.turns}, got {turn_index} ({why})"
            )
        self._move(s, "stepping")
        task = asyncio.create_task(self._run_step(s, parsed, turn_index, digest))
        s.inflight = (turn_index, digest, task)
        return await asyncio.shield(task), False

    @staticmethod
    def _same_turn(stored: str, digest: str, turn_index: int) -> None:
        if stored != digest:
            raise ApiError(
                409, "agent", "turn_mismatch", f"turn_index {turn_index} was already used for another turn"
            )

    async def _run_step(self, s: Session, turn: AssistantTurn, index: int, digest: str) -> str:
        assert s.env is not None
        self.steps_in_flight += 1
        try:
            result = redact_step(await self._step_env(s, s.env, turn), s.id, s.env_id)
        except asyncio.CancelledError:  # a shutdown past its grace period
            if s.state == "closed":
                await self._release(s)
            raise
        finally:
            self.steps_in_flight -= 1
            s.inflight = None
            s.last_active = time.monotonic()
        body = json_text(result)
        if s.state == "closed":  # deleted (or shut down) while it ran: the env is released here
            await self._release(s)
            raise self.closed_error(s.id, self.tombstones.get(s.id, "closed"))
        s.turns += 1
        s.results[index] = (digest, body)
        while len(s.results) > RESULTS_KEPT:
            s.results.popitem(last=False)
        if result.done:
            s.status = str(result.info.get("status", "ok" if result.terminated else "truncated"))
            self._move(s, "done")
            s.ended_at = time.monotonic()
            while len(s.results) > 1:  # only the final step can still be retried
                s.results.popitem(last=False)
            self._remember_ended(s)
            await self._release(s, reuse=s.status == "ok")
        else:
            self._move(s, "ready")
        return body

    async def _step_env(self, s: Session, env: Env, turn: AssistantTurn) -> StepResult:
        """The env's step under the step timeout and the session deadline; never raises."""
        step_timeout = self.settings.step_timeout_s
        left = s.deadline - time.monotonic()
        if left <= 0:
            return timed_out_step(True, step_timeout)
        try:
            return await asyncio.wait_for(env.step(turn), min(step_timeout, left))
        except asyncio.TimeoutError:
            return timed_out_step(left <= step_timeout, step_timeout)
        except Exception as e:  # ContainErrors catches env errors; this is whatever got past it
            log.exception("step of session %s failed", s.id)
            return crashed_step(e)

    # ---- extend ---------------------------------------------------------------------------------------
    def extend(self, session_id: str, seconds: float) -> Session:
        """Move a live session's deadline `seconds` later (up to `max_extend_s` in all) and mark it
        active. The client's pause counts from when it began, so a session whose deadline passed during
        it, not yet reaped, gets the time back; a finished one has no deadline left to move."""
        s = self.lookup(session_id)
        s.last_active = time.monotonic()
        if s.state in LIVE_STATES:
            granted = max(0.0, min(seconds, self.settings.max_extend_s - s.extended_s))
            s.deadline += granted
            s.extended_s += granted
        return s

    # ---- ending --------------------------------------------------------------------------------------
    def _remember_ended(self, s: Session) -> None:
        self.ended[s.id] = None
        while len(self.ended) > self.settings.ended_kept:
            oldest = self.sessions.get(next(iter(self.ended)))
            if oldest is None:
                self.ended.popitem(last=False)
            else:
                self._forget(oldest, "evicted")

    def _forget(self, s: Session, reason: str) -> None:
        """Close a session's record (its env is released separately): it answers 410 from now on."""
        if s.state != "closed":
            self._move(s, "closed")
        self.sessions.pop(s.id, None)
        self.ended.pop(s.id, None)
        self.tombstones[s.id] = reason
        while len(self.tombstones) > TOMBSTONES_KEPT:
            self.tombstones.popitem(last=False)

    async def _release(self, s: Session, reuse: bool = False) -> None:
        """Hand the session's env back to the env pool (`reuse`) or close it."""
        env, s.env = s.env, None
        if env is None:
            return
        if reuse and not self.draining:
            await self.envs.give_back(s.env_id, s.kwargs, env)
        else:
            await close_env(env)

    async def _end(self, s: Session, reason: str) -> None:
        """Close a session now; a running step or reset releases the env itself when it returns."""
        busy = s.state in ("stepping", "creating")
        self._forget(s, reason)
        if not busy:
            await self._release(s)

    async def delete(self, session_id: str) -> str:
        """Close a session (idempotent: an already-closed one answers with its reason)."""
        s = self.sessions.get(session_id)
        if s is None:
            reason = self.tombstones.get(session_id)
            if reason is None:
                raise ApiError(404, "agent", "session_not_found", f"no session {session_id!r}")
            return reason
        await self._end(s, "deleted")
        return "deleted"

    # ---- reaper and shutdown -------------------------------------------------------------------------
    async def reap_once(self) -> int:
        """Close idle sessions, those past their deadline and expired finished ones; returns how many."""
        now, idle, ttl = time.monotonic(), self.settings.idle_timeout_s, self.settings.ended_ttl_s
        doomed = []
        for s in list(self.sessions.values()):
            if s.state in ("stepping", "creating"):  # bounded by the step timeout and the deadline
                continue
            if now - s.last_active > idle:
                doomed.append((s, "idle"))
            elif s.state == "ready" and now > s.deadline + min(DEADLINE_GRACE_S, idle):
                doomed.append((s, "deadline"))
            elif s.state == "done" and now - s.ended_at > ttl:
                doomed.append((s, "ended"))
        for s, reason in doomed:
            if reason != "ended":
                log.info("reaping session %s (%s, %s)", s.id, s.env_id, reason)
            await self._end(s, reason)
        await self.envs.reap()
        return len(doomed)

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                await self.reap_once()
            except Exception:
                log.exception("the session reaper failed; it goes on")

    async def shutdown(self) -> None:
        """Stop taking sessions, let in-flight steps finish (up to the grace period), close everything."""
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        running = [s.inflight[2] for s in self.sessions.values() if s.inflight is not None]
        pending: set[asyncio.Task[str]] = set()
        if running:
            _, pending = await asyncio.wait(running, timeout=self.settings.shutdown_grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        live = sum(s.env is not None for s in self.sessions.values())
        for s in list(self.sessions.values()):
            self._forget(s, "shutdown")
            await self._release(s)
        await self.envs.close()
        log.info(
            "shutdown: released %d live sessions; %d in-flight steps finished, %d cancelled",
            live,
            len(running) - len(pending),
            len(pending),
        )
