"""Episode routes: an episode keeps its env and record on its rollout worker while its generation moves
to another worker's engine (the tail scheduler's `Migrate`).

Each episode a worker runs gets an `EpisodeRoute`, the `Engine` its runner generates through: the
worker's own engine (home) until a migration points it at another worker's (`RemoteEngine`, over that
worker's Ray handle). `Routes.migrate` switches the route and, when a request is in flight, aborts it
on the source engine; the route's `generate` gets the tokens sampled so far back (finish_reason
"abort") and resubmits the exact token prefix (prompt + those tokens) on the target, as
`SGLangEngine` does for its own resubmits. One generate call therefore returns what an unmigrated
call would: every sampled id with its log-prob and per-token version (`meta["token_versions"]` when
mixed), `meta["reprefill_tokens"]` for the prefix the target computed again.

Measured, per migration (`Migration`): the tokens re-prefilled (the prefix the source had computed:
prompt + tokens so far for an aborted request, the last context for an episode between turns), the
handoff (migrate call to resubmission) and the first token's seconds on the target, its re-prefill:
the first request after a migration asks for one token and is timed, the rest of the turn follows
(the target's prefix cache holds the prefix by then). The episode's record counts them in
`timings` (`migrations`, `reprefill_tokens`, `reprefill_s`).

Paused (`Routes.pause`, sync mode's partial rollouts): every request in flight is aborted, its tokens
kept, and no episode generates until `Routes.resume`; each then resubmits its exact prefix to its
engine, which by then may hold newer weights (per-token versions; the prefix counts as re-prefilled).
A request migrated to an engine that pauses comes back the same way (`meta["paused"]`, from
`WorkerTail.pause_served`) and waits at that engine's gate. The time an episode waits paused, here or
there, is left out of its age (`active_s`, the tail's quantiles) and counted in `timings["paused_s"]`.

Handed over (`Routes.hand_over`, a lent engine's yield at a train step's start): an episode moves to
another worker's engine for good, as a migration, and waits for none of its own worker's resumes
(its route's gate is set to None; an episode waiting at the gate then is woken and goes there). Back
home, by a migration or a fallback, it waits at its worker's gate again.

Failures are contained: a target that fails (its actor died, its engine raised) sends the episode
back to its home engine, which resubmits the prefix (outcome "fallback: ..."); the home engine failing
is the episode's `infra_error`, as without migration. A stop string that straddles a resubmission is
found on the joined text and the output cut after the token that completed it, as the engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from reflow.engine import Engine, GenerateResult, SamplingParams


class RemoteEngine:
    """Another rollout worker's engine through its actor handle (`engine_generate`, `engine_abort`)."""

    def __init__(self, handle: Any, name: str, version: int) -> None:
        self.handle, self.name, self._version = handle, name, version

    @property
    def weight_version(self) -> int:
        """The version of the last result it returned (the home engine's until then)."""
        return self._version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        result = await self.handle.engine_generate.remote(list(input_ids), params, request_id)
        self._version = result.weight_version
        return result

    async def abort(self, request_id: str) -> None:
        await self.handle.engine_abort.remote(request_id)


@dataclass
class Migration:
    """One migration of an episode's generation and what it cost."""

    episode: str
    group: str
    source: str
    target: str
    started: float
    tokens: int
    """Tokens the target re-prefills (set when the aborted request's tokens are back)."""
    in_flight: bool
    """A request was generating on the source and was aborted (its tokens kept)."""
    handoff_s: float | None = None
    """For an aborted request, from the migrate call to its resubmission on the target (the abort's
    round trip); between turns the episode waits for nothing: None."""
    first_token_s: float | None = None
    """The resubmission's first token on the target: its re-prefill (and queueing) seconds."""
    outcome: str = "pending"
    """ok, fallback: <error> (back on the home engine), superseded (migrated again first), ended (the
    episode ended before it generated again)."""
    resubmitted: bool = False
    """The target was sent the prefix (else nothing was re-prefilled)."""
    paused_before: float = 0.0
    """The episode's paused seconds when it was decided: a pause after it is left out of `handoff_s`."""

    def report(self) -> dict[str, Any]:
        """The measured effect; `reprefill_tokens` 0 when nothing was resubmitted (it ended first)."""
        out = asdict(self)
        del out["started"], out["resubmitted"], out["paused_before"]
        tokens = out.pop("tokens")
        out["reprefill_tokens"] = tokens if self.resubmitted else 0
        return out


class EpisodeRoute:
    """One episode's engine: home, or another worker's after a migration (an `Engine`)."""

    def __init__(
        self,
        episode: str,
        group: str,
        home: Engine,
        home_name: str,
        *,
        decode: Callable[[list[int]], str] | None = None,
        done: Callable[[Migration], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.episode, self.group, self.home, self.home_name = episode, group, home, home_name
        self.gate = self.home_gate = gate  # set: requests may run (`Routes.pause` clears it)
        self._regated = asyncio.Event()  # the gate was switched (`set_gate`): a waiter looks again
        self.paused_s = 0.0
        """Seconds its generate calls waited for a resume since `take_paused_s` last took them."""
        self.paused_total_s = 0.0
        """Seconds its generate calls waited for a resume in all, its own engine's or a target's: left
        out of the episode's age (the tail's quantiles and remaining-time estimates)."""
        self._waiting_since: float | None = None  # waiting at the gate now, since then
        # a part on another worker's engine that may wait at that engine's gate: a pause there (or here,
        # which in sync mode is everywhere) while it ran; its wait is known only when it returns
        self._remote_paused = False
        self.engine: Engine = home
        self.engine_name = home_name
        self.decode, self.clock, self._done = decode, clock, done
        self.started = clock()
        self.turns = 0
        """Generate calls done (assistant turns)."""
        self.tokens = 0
        """Context tokens the current engine holds: prompt + output of the last call."""
        self.pending: Migration | None = None
        self.counters = {"migrations": 0, "reprefill_tokens": 0, "reprefill_s": 0.0}
        self._version = home.weight_version
        self.newest_version = -1
        """The newest policy version among the tokens sampled so far (-1: none yet)."""
        self._part: tuple[Engine, str] | None = None  # the request in flight: engine, its request id
        self._user_aborted: set[str] = set()
        self._paused: set[str] = set()  # requests a pause aborted: resubmitted on resume
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def weight_version(self) -> int:
        return self._version

    def progress(self) -> dict[str, Any]:
        return {
            "id": self.episode,
            "group": self.group,
            "owner": self.home_name,
            "engine": self.engine_name,
            "turns": self.turns,
            "tokens": self.tokens,
            "seconds": self.active_s(),
            "version": self.sampled_version,
        }

    @property
    def sampled_version(self) -> int:
        """The newest weights among its tokens so far, those of a request in flight included (they
        come from its engine's weights; an abort keeps them); -1: none yet."""
        return max(self.newest_version, self._part[0].weight_version if self._part else -1)

    def active_s(self) -> float:
        """Seconds since it opened, less the time it waited paused (a wait in progress included)."""
        now = self.clock()
        waiting = now - self._waiting_since if self._waiting_since is not None else 0.0
        return max(0.0, now - self.started - self.paused_total_s - waiting)

    def set_gate(self, gate: asyncio.Event | None) -> None:
        """The gate its requests wait at from now (None: none, a handed-over episode); a call waiting
        at the old one looks again."""
        self.gate = gate
        self._regated.set()

    async def _wait_gate(self) -> None:
        """Until the gate is set or gone (a pause's wait, or none)."""
        while self.gate is not None and not self.gate.is_set():
            self._regated.clear()
            waits = [asyncio.ensure_future(self.gate.wait()), asyncio.ensure_future(self._regated.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def _add_paused(self, seconds: float) -> None:
        self.paused_s += seconds
        self.paused_total_s += seconds

    async def migrate(self, target: Engine, name: str, gate: Any = ...) -> Migration:
        """Generate on `target` from now on; a request in flight is aborted and resubmitted there.
        `gate`: the gate it waits at from then (unchanged if not given), switched with the engine,
        before the abort: a woken call goes to the target."""
        if name == self.engine_name:
            raise ValueError(f"episode {self.episode} already generates on {name}")
        if self.pending is not None:
            self._finish(self.pending, "superseded")
        part = self._part
        mig = Migration(
            self.episode, self.group, self.engine_name, name, self.clock(), self.tokens, part is not None
        )
        mig.paused_before = self.paused_total_s
        self.pending, self.engine, self.engine_name = mig, target, name
        if gate is not ...:
            self.set_gate(gate)
        if part is not None:
            with contextlib.suppress(Exception):  # a source that cannot abort fails its call: handled there
                await part[0].abort(part[1])
        return mig

    @property
    def waiting(self) -> bool:
        """Whether a generate call waits paused now, or may: at this gate, or at another worker's with
        a part there since a pause (whose seconds come back with it, `meta["paused_s"]`)."""
        return self._waiting_since is not None or self._remote_paused

    def take_paused_s(self) -> float:
        """The seconds paused since the last call, a wait at the gate in progress included up to now:
        the episode runner moves the env's deadlines by them (a remote session's while it waits)."""
        if self._waiting_since is not None:
            now = self.clock()
            self._add_paused(now - self._waiting_since)
            self._waiting_since = now
        paused, self.paused_s = self.paused_s, 0.0
        return paused

    async def pause(self) -> None:
        """Abort the request in flight, if any (its tokens come back and wait for the gate)."""
        if self._part is not None and self._part[0] is not self.home:
            self._remote_paused = True
        if self._part is not None:
            self._paused.add(self._part[1])
            with contextlib.suppress(Exception):  # an engine that cannot abort fails its call: handled there
                await self._part[0].abort(self._part[1])

    async def abort(self, request_id: str) -> None:
        """The runner's abort (a deadline): finishes the call with "abort", never resubmitted."""
        self._user_aborted.add(request_id)
        if self._part is not None and self._part[1].split(".")[0] == request_id:
            await self._part[0].abort(self._part[1])

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        rid = request_id or uuid.uuid4().hex
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reprefill, parts, split_at = 0, 0, None
        self.tokens = len(input_ids)
        last: GenerateResult | None = None
        try:
            while True:
                if self.gate is not None and not self.gate.is_set():
                    self._waiting_since = self.clock()
                    try:  # paused: a resume may be undone before this runs, a hand-over lift the gate
                        await self._wait_gate()
                    finally:  # (`take_paused_s` may have taken the wait's start already)
                        self._add_paused(self.clock() - self._waiting_since)
                        self._waiting_since = None
                engine, mig = self.engine, self.pending
                probe = mig is not None and params.max_new_tokens - len(out) > 1
                part_rid = rid if parts == 0 else f"{rid}.{parts}"
                parts += 1
                n = 1 if probe else params.max_new_tokens - len(out)
                started = self.clock()
                if mig is not None:  # the pauses since the migration are no part of its handoff
                    mig.resubmitted = True
                    handoff = started - mig.started - (self.paused_total_s - mig.paused_before)
                    mig.handoff_s = handoff if mig.in_flight else None
                    reprefill += mig.tokens
                self._part = (engine, part_rid)
                try:
                    last = await engine.generate(
                        [*input_ids, *out], replace(params, max_new_tokens=n), part_rid
                    )
                except asyncio.CancelledError:
                    self._abort_later(engine, part_rid)
                    raise
                except Exception as e:
                    if engine is self.home:
                        raise
                    if self.engine is engine:  # the target failed: back home, resubmit the prefix there
                        self._fall_back(f"{type(e).__name__}: {e}", len(input_ids) + len(out))
                    continue
                finally:
                    self._part = None
                waited = float(last.meta.get("paused_s", 0.0))  # at a paused target's gate
                self._add_paused(waited)
                out += last.output_ids
                logprobs += last.logprobs
                versions += last.meta.get("token_versions") or [last.weight_version] * len(last.output_ids)
                self.newest_version = max([self.newest_version, *versions])
                reprefill += int(last.meta.get("reprefill_tokens", 0))  # the engine's own resubmits
                self._version = last.weight_version
                self.tokens = len(input_ids) + len(out)
                moved = self.engine is not engine and rid not in self._user_aborted
                # paused here, or by the target it was migrated to (`WorkerTail.pause_served`)
                paused = (part_rid in self._paused or bool(last.meta.get("paused"))) and (
                    rid not in self._user_aborted
                )
                # a target that paused may hold the resubmission at its gate too
                self._remote_paused = engine is not self.home and bool(last.meta.get("paused"))
                self._paused.discard(part_rid)
                probing = mig is not None and self.pending is mig
                if probing and not paused and (last.output_ids or last.finish_reason != "abort"):
                    assert mig is not None
                    mig.first_token_s = self.clock() - started - waited
                    self._finish(mig, "ok")
                elif probing:  # paused (or aborted) before its first token: timed at its next resubmission
                    assert mig is not None
                    mig.tokens = len(input_ids) + len(out)
                if last.finish_reason == "abort" and paused and not moved:
                    if len(out) >= params.max_new_tokens:  # paused at the very end of its token budget
                        last = replace(last, finish_reason="length")
                        break
                    if not probing:  # (a pending migration counts its re-prefill when resubmitted)
                        reprefill += len(input_ids) + len(out)  # its engine computes the prefix again
                    split_at = len(out) if split_at is None else split_at
                    continue
                if last.finish_reason == "abort" and moved:
                    if len(out) >= params.max_new_tokens:  # moved at the very end of its token budget
                        last = replace(last, finish_reason="length")
                        break
                    assert self.pending is not None  # set by the migration that moved it
                    self.pending.tokens = len(input_ids) + len(out)  # what the target computes again
                    split_at = len(out) if split_at is None else split_at
                    continue
                if probe and last.finish_reason == "length" and len(last.output_ids) == 1:
                    split_at = len(out) if split_at is None else split_at
                    continue  # the timed first token: the rest of the turn follows on the same engine
                break
        finally:
            self._user_aborted.discard(rid)
        self.turns += 1
        assert last is not None
        return self._joined(input_ids, params, out, logprobs, versions, reprefill, split_at, last)

    def _joined(
        self,
        input_ids: list[int],
        params: SamplingParams,
        out: list[int],
        logprobs: list[float],
        versions: list[int],
        reprefill: int,
        split_at: int | None,
        last: GenerateResult,
    ) -> GenerateResult:
        finish, matched = last.finish_reason, last.matched_stop
        if split_at is not None and params.stop and self.decode is not None:
            cut = first_stop(self.decode, out, params.stop, split_at)
            if cut is not None:
                n, matched = cut
                out, logprobs, versions, finish = out[:n], logprobs[:n], versions[:n], "stop"
        own = ("token_versions", "reprefill_tokens", "paused", "paused_s")  # this call's, set below
        meta = {k: v for k, v in last.meta.items() if k not in own}
        if versions and len(set(versions)) > 1:
            meta["token_versions"] = list(versions)
        if reprefill:
            meta["reprefill_tokens"] = reprefill
        self.counters["reprefill_tokens"] += reprefill
        return GenerateResult(
            out,
            logprobs,
            finish,
            versions[-1] if versions else last.weight_version,
            len(input_ids),
            matched,
            meta,
        )

    def close(self) -> None:
        """The episode ended: a migration that never generated again is reported as ended."""
        if self.pending is not None:
            self._finish(self.pending, "ended")

    def _fall_back(self, error: str, tokens: int) -> None:
        mig = self.pending
        if mig is not None:
            self._finish(mig, f"fallback: {error}")
        self.pending = Migration(
            self.episode, self.group, self.engine_name, self.home_name, self.clock(), tokens, True
        )
        self.engine, self.engine_name = self.home, self.home_name
        self.set_gate(self.home_gate)  # home again: its worker's pauses hold it

    def _finish(self, mig: Migration, outcome: str) -> None:
        mig.outcome = outcome
        if self.pending is mig:
            self.pending = None
        self.counters["migrations"] += 1
        if mig.first_token_s is not None:
            self.counters["reprefill_s"] += mig.first_token_s
        if self._done is not None:
            self._done(mig)

    def _abort_later(self, engine: Engine, request_id: str) -> None:
        """The caller was cancelled: the request must not run on, wherever it is."""

        async def abort() -> None:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)

        task = asyncio.ensure_future(abort())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def first_stop(
    decode: Callable[[list[int]], str], ids: list[int], stops: list[str], split_at: int
) -> tuple[int, str] | None:
    """(n, the stop string) where the text of `ids[:n]` first contains a stop string, looking only at
    n past `split_at` (before it the engine checked the text itself); None if no stop is there."""
    for n in range(split_at + 1, len(ids) + 1):
        text = decode(ids[:n])
        for stop in stops:
            if stop and stop in text:
                return n, stop
    return None


class Routes:
    """The routes of the episodes a worker runs; what `progress` and `migrate` see."""

    def __init__(
        self,
        home: Engine,
        home_name: str,
        decode: Callable[[list[int]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.home, self.home_name, self.decode, self.clock = home, home_name, decode, clock
        self._routes: dict[str, EpisodeRoute] = {}
        self._measured: list[Migration] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def open(self, episode: str, group: str) -> EpisodeRoute:
        if episode in self._routes:
            raise ValueError(f"episode {episode} already has a route")
        route = EpisodeRoute(
            episode,
            group,
            self.home,
            self.home_name,
            decode=self.decode,
            done=self._record,
            clock=self.clock,
            gate=self.gate,
        )
        self._routes[episode] = route
        return route

    def _record(self, migration: Migration) -> None:
        self._measured.append(migration)

    def close(self, route: EpisodeRoute) -> None:
        route.close()
        self._routes.pop(route.episode, None)

    def progress(self) -> list[dict[str, Any]]:
        return [r.progress() for r in self._routes.values()]

    async def migrate(self, episode: str, target: Any, target_name: str) -> dict[str, Any]:
        """Move `episode`'s generation to `target_name` (this worker's own name: back home; else
        `target` is that worker's actor handle). Never raises for a bad request: says why not."""
        route = self._routes.get(episode)
        if route is None:
            return {"applied": False, "error": f"episode {episode} is not running here (ended?)"}
        if target_name == route.engine_name:
            return {"applied": False, "error": f"episode {episode} already generates on {target_name}"}
        if target_name == self.home_name:  # home: its worker's gate again (a handed-over episode)
            mig = await route.migrate(self.home, target_name, gate=self.gate)
        else:
            mig = await route.migrate(RemoteEngine(target, target_name, route.weight_version), target_name)
        return {"applied": True, "tokens": mig.tokens, "in_flight": mig.in_flight, "source": mig.source}

    async def hand_over(
        self, target: Any, target_name: str, n: int, version: int | None = None
    ) -> dict[str, int]:
        """Move up to `n` of the episodes on this worker's own engine to `target_name`'s (`target`: that
        worker's actor handle), for good: as a migration (tokens kept, per-token versions), waiting for
        none of this worker's resumes, so a `pause` leaves them generating there (a lent engine's
        episodes at a train step's start, on a rollout engine with room). An episode waiting paused
        is woken and goes. Whole groups first, the smallest first (a group with nothing left here frees
        its lent engine). `version`: the target's weights; an episode with tokens of newer weights
        stays (its versions would go back). Returns the episodes moved per group."""
        by_group: dict[str, list[EpisodeRoute]] = {}
        for r in self._routes.values():
            if r.engine is self.home and (version is None or r.sampled_version <= version):
                by_group.setdefault(r.group, []).append(r)
        chosen = [r for _, rs in sorted(by_group.items(), key=lambda g: (len(g[1]), g[0])) for r in rs]
        chosen = chosen[: max(0, n)]
        await asyncio.gather(
            *(
                r.migrate(RemoteEngine(target, target_name, r.weight_version), target_name, gate=None)
                for r in chosen
            )
        )
        moved: dict[str, int] = {}
        for r in chosen:
            if self._routes.get(r.episode) is r:  # not ended in the meantime
                moved[r.group] = moved.get(r.group, 0) + 1
        return moved

    def away(self) -> dict[str, dict[str, int]]:
        """Handed-over episodes still running elsewhere: per group, per engine name."""
        out: dict[str, dict[str, int]] = {}
        for r in self._routes.values():
            if r.gate is None:
                per = out.setdefault(r.group, {})
                per[r.engine_name] = per.get(r.engine_name, 0) + 1
        return out

    def at_home(self) -> dict[str, int]:
        """Episodes per group on this worker's own engine (or waiting for it)."""
        home: dict[str, int] = {}
        for r in self._routes.values():
            if r.gate is not None:
                home[r.group] = home.get(r.group, 0) + 1
        return home

    async def pause(self) -> int:
        """No episode generates until `resume`: requests in flight are aborted (their tokens kept, the
        rest resubmitted on resume). Episodes in an env step finish it and wait. Episodes handed over
        (`hand_over`) go on. Returns the episodes paused."""
        self.gate.clear()
        paused = [route for route in list(self._routes.values()) if route.gate is not None]
        await asyncio.gather(*(route.pause() for route in paused))
        return len(paused)

    def resume(self) -> None:
        self.gate.set()

    def take_measured(self) -> list[dict[str, Any]]:
        """The migrations finished (measured) since the last call."""
        done, self._measured = self._measured, []
        return [m.report() for m in done]
