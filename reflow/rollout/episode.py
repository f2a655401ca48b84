"""The episode runner: an env played by an engine, token-in-token-out.

The tokens a segment holds are exactly the ones the engine saw and sampled: sampled ids are appended as
returned, and each new observation is appended as the token delta between the template's rendering
of the conversation and the text already held. When the template renders history differently from what
is held (not a prefix), a new segment starts from the template's rendering; each segment is one
training row. Statuses: ok, truncated (turn limit, token budget, a length-cut turn), timeout,
env_error, infra_error (the engine failed: masked by the trainer, never scored 0).

With `routes` (a rollout worker's `reflow.rollout.routing.Routes`) each episode generates through its
own route, which the tail scheduler can point at another worker's engine mid-episode (a migration):
the env and the record stay here, the record's `timings` count the migrations and re-prefilled tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from reflow.engine import Engine, GenerateResult, SamplingParams
from reflow.env import Env, EnvError, InfraError, Message, Task, parse_assistant
from reflow.env.play import Policy
from reflow.records import EpisodeRecord, Segment, TurnRecord
from reflow.rollout.chat import ChatRenderer
from reflow.rollout.pauses import EpisodePauses
from reflow.rollout.routing import Routes


@dataclass
class RolloutConfig:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    parser: str = "hermes"
    max_context_tokens: int = 4096
    """A segment never grows past this; the episode is truncated when the next turn cannot fit."""
    max_generated_tokens: int = 8192
    """Total sampled tokens over the episode."""
    deadline_s: float | None = None
    """Wall-clock budget of the whole episode, generation included, time waited paused not (the env's
    own deadline also holds)."""
    max_turns: int = 64
    """A guard on top of the env's own turn limit."""


WAITING_CHECK_S = 0.1
"""While a generation waits paused, how often at most the runner moves its deadline on."""


class _Stop(Exception):
    def __init__(self, status: str, termination: str, error: str | None = None) -> None:
        super().__init__(termination)
        self.status, self.termination, self.error = status, termination, error


class EpisodeRunner:
    """Plays episodes of any env with one engine; many episodes can run concurrently."""

    def __init__(
        self,
        engine: Engine | None,
        tokenizer: Any,
        config: RolloutConfig | None = None,
        routes: Routes | None = None,
    ) -> None:
        """`engine` may be None when every episode is played by a demo policy; `routes`: generate each
        episode through a migratable route (see the module docstring)."""
        self.engine = engine
        self.chat = ChatRenderer(tokenizer)
        self.config = config or RolloutConfig()
        self.routes = routes

    async def run(
        self,
        env: Env,
        *,
        task: Task | None = None,
        seed: int | None = None,
        group_id: str | None = None,
        sampling: SamplingParams | None = None,
        demo_policy: Policy | None = None,
    ) -> EpisodeRecord:
        """Play one episode. With `demo_policy` (a text policy such as an env's scripted one), its
        turns are encoded in place of sampling: the same token layout, for warm-start data."""
        cfg = self.config
        start = time.monotonic()
        deadline = start + cfg.deadline_s if cfg.deadline_s else None
        episode_id, group_id = uuid.uuid4().hex, group_id or uuid.uuid4().hex
        route = None
        if self.routes is not None and demo_policy is None and self.engine is not None:
            route = self.routes.open(episode_id, group_id)
        engine = route or self.engine
        rec = EpisodeRecord(
            episode_id=episode_id,
            group_id=group_id,
            env_id=env.unwrapped.spec_id or type(env.unwrapped).__name__,
            task_id=None,
            task_hash="",
            seed=seed,
            policy_version_start=_version(engine),
            tokenizer_id=self.chat.tokenizer_id,
            chat_template_id=self.chat.chat_template_id,
        )
        timings = {"generation_s": 0.0, "env_s": 0.0}
        try:
            await self._play(
                env, rec, task, seed, sampling or cfg.sampling, deadline, timings, demo_policy, engine
            )
        except _Stop as stop:
            rec.status, rec.termination, rec.error = stop.status, stop.termination, stop.error
        finally:
            if route is not None and self.routes is not None:
                self.routes.close(route)
        rec.policy_version_end = _version(engine)
        rec.timings = {**timings, "total_s": time.monotonic() - start}
        if route is not None and route.counters["migrations"]:
            rec.timings.update(route.counters)
        if route is not None and route.paused_total_s:  # waited paused (sync's partial rollouts, lending)
            rec.timings["paused_s"] = route.paused_total_s
        return rec

    async def _play(
        self,
        env: Env,
        rec: EpisodeRecord,
        task: Task | None,
        seed: int | None,
        sampling: SamplingParams,
        deadline: float | None,
        timings: dict[str, float],
        demo_policy: Policy | None,
        engine: Engine | None,
    ) -> None:
        cfg, chat = self.config, self.chat
        t0 = time.monotonic()
        try:
            obs = await env.reset(task=task, seed=seed)
        except InfraError as e:  # the sandbox or env server under the env failed: masked in training
            raise _Stop("infra_error", "reset_failed", str(e)) from None
        except EnvError as e:
            raise _Stop("env_error", "reset_failed", str(e)) from None
        except TimeoutError as e:
            raise _Stop("timeout", "deadline", str(e)) from None
        timings["env_s"] += time.monotonic() - t0
        rec.task_id, rec.task_hash = obs.info.get("task_id"), obs.info.get("task_hash", "")
        rec.messages = list(obs.messages)
        rendered: list[Message] = list(obs.messages)  # assistant turns as the exact sampled text
        held_text = chat.render(rendered, obs.tools, generation_prompt=True)
        segment = Segment(0)
        segment.extend_prompt(chat.encode(held_text))
        rec.segments.append(segment)
        new_obs, delta = list(obs.messages), list(segment.token_ids)
        generated = 0
        pauses = EpisodePauses(env, engine, deadline)

        for turn_index in range(cfg.max_turns):
            max_new = min(
                sampling.max_new_tokens,
                cfg.max_context_tokens - len(segment.token_ids),
                cfg.max_generated_tokens - generated,
            )
            if max_new < 1:
                raise _Stop("truncated", "token_budget")
            params = replace(sampling.child(turn_index), max_new_tokens=max_new)
            t0 = time.monotonic()
            paused_s = 0.0  # waited paused (sync's partial rollouts, lending): the env's deadlines move
            if demo_policy is None:
                out, paused_s = await _generate(engine, segment.token_ids, params, pauses)
            else:
                out = self._encode_demo(await _call(demo_policy, rec.messages, obs.tools), max_new)
            paused_s += await pauses.take(flush=True)
            # decoding, not the wait for a resume (floored: a turn paused almost throughout could
            # round a hair below 0)
            gen_s = max(0.0, time.monotonic() - t0 - paused_s)
            timings["generation_s"] += gen_s
            generated += len(out.output_ids)
            versions = out.meta.get("token_versions") or [out.weight_version] * len(out.output_ids)
            segment.extend_sampled(out.output_ids, out.logprobs, versions)
            completion = chat.decode(out.output_ids)
            held_text += completion
            raw = chat.strip_eos(completion)
            turn_rec = TurnRecord(
                turn_index=turn_index,
                segment_id=segment.segment_id,
                obs_messages=new_obs,
                prompt_delta_ids=delta,
                completion_ids=list(out.output_ids),
                completion_logprobs=list(out.logprobs),
                finish_reason=out.finish_reason,
                policy_version=out.weight_version,
                token_versions=list(versions),
                sampling_params=asdict(params),
                raw_text=raw,
                generation_s=gen_s,
            )
            rec.turns.append(turn_rec)
            if out.finish_reason == "abort":
                raise _Stop("infra_error", "aborted", "the engine aborted the request")
            turn = parse_assistant(
                raw, parser=cfg.parser, finish_reason=out.finish_reason, tools=env.unwrapped.tools
            )
            turn_rec.tool_calls = [asdict(c) for c in turn.tool_calls]
            rec.messages.append(turn.to_message())
            if out.finish_reason == "length":  # a cut-off turn is not shown to the env
                raise _Stop(
                    "truncated", "turn_length" if max_new == sampling.max_new_tokens else "token_budget"
                )

            t0 = time.monotonic()
            step = await env.step(turn)
            turn_rec.env_s = time.monotonic() - t0
            timings["env_s"] += turn_rec.env_s
            turn_rec.reward = step.reward
            turn_rec.tool_results = list(step.info.get("tool_results", []))
            rec.reward += step.reward
            rec.messages += step.messages
            rendered += [{"role": "assistant", "content": raw}, *step.messages]
            if step.done:
                rec.success = bool(step.info.get("success", False))
                rec.reward_components = dict(step.info.get("reward_components", {}))
                raise _Stop(
                    step.info.get("status", "ok"), step.info.get("termination", ""), step.info.get("error")
                )

            canonical = chat.render(rendered, obs.tools, generation_prompt=True)
            same_row = canonical.startswith(held_text)
            # Otherwise the template rewrote history: the next turns are a new training row.
            delta = chat.encode(canonical[len(held_text) :] if same_row else canonical)
            if (len(segment.token_ids) if same_row else 0) + len(delta) >= cfg.max_context_tokens:
                raise _Stop("truncated", "token_budget")
            if not same_row:
                segment = Segment(segment.segment_id + 1)
                rec.segments.append(segment)
            segment.extend_prompt(delta)
            held_text = canonical
            new_obs = list(step.messages)
        raise _Stop("truncated", "max_turns")

    def _encode_demo(self, text: str, max_new: int) -> GenerateResult:
        ids = (self.chat.encode(text) + self.chat.eos_ids)[:max_new]
        finish = "stop" if len(ids) < max_new or ids[-1:] == self.chat.eos_ids else "length"
        return GenerateResult(ids, [0.0] * len(ids), finish, weight_version=-1, prompt_tokens=0)


async def _generate(
    engine: Engine | None, ids: list[int], params: SamplingParams, pauses: EpisodePauses
) -> tuple[GenerateResult, float]:
    """One turn's output, and the seconds it waited paused that `pauses` took while it ran: the
    runner's deadline moves by them, and a remote env's session hears every `keepalive_s`."""
    if engine is None:
        raise _Stop("infra_error", "no_engine", "this runner has no engine; pass a demo_policy")
    request_id = uuid.uuid4().hex
    if pauses.deadline is not None and pauses.deadline <= time.monotonic():
        raise _Stop("timeout", "deadline")
    call = asyncio.ensure_future(engine.generate(list(ids), params, request_id))
    paused = 0.0
    try:
        while True:
            keepalive, deadline = pauses.keepalive_s, pauses.deadline
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and pauses.waiting:  # the deadline moves with the wait: look now and then
                left = max(left, WAITING_CHECK_S)
            wait = left if keepalive is None else keepalive if left is None else min(left, keepalive)
            done, _ = await asyncio.wait({call}, timeout=wait)
            if done:
                break
            paused += await pauses.take()
            # (never while it may wait paused: the wait's seconds move the deadline when known)
            if pauses.deadline is not None and time.monotonic() >= pauses.deadline and not pauses.waiting:
                call.cancel()
                await asyncio.wait({call})
                await engine.abort(request_id)
                raise _Stop("timeout", "deadline", "the episode deadline passed during generation")
    finally:
        if not call.done():  # the runner was cancelled: so is the request
            call.cancel()
    try:
        return call.result(), paused
    except Exception as e:
        raise _Stop("infra_error", "engine_failed", f"{type(e).__name__}: {e}") from None


def _version(engine: Engine | None) -> int:
    return -1 if engine is None else engine.weight_version


async def _call(policy: Policy, messages: list[Message], tools: list[dict[str, Any]]) -> str:
    text = policy(messages, tools)
    return await text if inspect.isawaitable(text) else text


async def run_group(
    runner: EpisodeRunner,
    make_env: Callable[[], Env],
    group_size: int,
    *,
    task: Task | None = None,
    seed: int | None = None,
    group_id: str | None = None,
    sampling: SamplingParams | None = None,
) -> list[EpisodeRecord]:
    """G episodes of one task, in flight together on the runner's engine (a GRPO group). Each env is
    closed as its episode ends (a sandbox is not held while the group's stragglers run on)."""
    envs = [make_env() for _ in range(group_size)]
    group_id = group_id or uuid.uuid4().hex
    base = sampling or runner.config.sampling

    async def play(i: int, env: Env) -> EpisodeRecord:
        try:
            return await runner.run(
                env, task=task, seed=seed, group_id=group_id, sampling=base.child(seed, i)
            )
        finally:
            with contextlib.suppress(Exception):
                await env.close()

    try:
        if task is None:
            task = envs[0].pick_task(seed)
        return list(await asyncio.gather(*(play(i, env) for i, env in enumerate(envs))))
    except BaseException:  # an env that never played (pick_task failed, or cancelled first) closes too
        await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)
        raise
