"""Episode migration (`reflow.rollout.routing`): an episode's generation moves to another
engine by aborting its request and resubmitting the exact token prefix, and its record comes out as an
unmigrated run's, token for token. First with a deterministic engine (migrate at a known token), then
the done-when test with TorchEngine and the tiny model: greedy ids equal, log-probs re-scored."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading

import pytest
import torch
from engine_helpers import build_tiny_engine_model
from fake_envs import EchoEnv
from migration_helpers import CountingEngine, FakeHandle, expected_ids, logprob_of

import reflow
from reflow.engine import SamplingParams
from reflow.rollout.concurrency import LimitedEngine
from reflow.rollout.episode import EpisodeRunner, RolloutConfig
from reflow.rollout.routing import Routes, first_stop

PROMPT = [5, 6, 7, 8]


def _routes(home: CountingEngine) -> Routes:
    return Routes(LimitedEngine(home, 8), "w0", decode=lambda ids: " ".join(map(str, ids)))


# -- with a deterministic engine ------------------------------------------------------------------


async def test_a_request_migrated_mid_generation_returns_every_token_and_counts_the_re_prefill():
    home, target = CountingEngine(version=3), CountingEngine(version=4)
    routes = _routes(home)
    route = routes.open("ep", "g")

    async def migrate_at_3(n: int, rid: str) -> None:
        if n == 3 and not home.aborted:
            result = await routes.migrate("ep", FakeHandle(target), "w1")
            assert result["applied"] and result["in_flight"]

    home.on_token = migrate_at_3
    out = await route.generate(PROMPT, SamplingParams(max_new_tokens=10), "req")
    assert out.output_ids == expected_ids(10, PROMPT) and out.finish_reason == "length"
    assert out.logprobs == [logprob_of(t) for t in out.output_ids]
    # 3 tokens from the source (version 3), 7 from the target (version 4)
    assert out.meta["token_versions"] == [3] * 3 + [4] * 7 and out.weight_version == 4
    # the target got the exact prefix: prompt + the 3 tokens; first one timed token, then the rest
    assert target.prompts == [PROMPT + expected_ids(3, PROMPT), PROMPT + expected_ids(4, PROMPT)]
    assert out.meta["reprefill_tokens"] == len(PROMPT) + 3
    (report,) = routes.take_measured()
    assert report["outcome"] == "ok" and report["in_flight"] is True
    assert (report["source"], report["target"], report["reprefill_tokens"]) == ("w0", "w1", 7)
    assert report["handoff_s"] is not None and report["first_token_s"] is not None
    assert route.counters["migrations"] == 1 and route.counters["reprefill_tokens"] == 7
    assert routes.progress()[0]["engine"] == "w1" and routes.progress()[0]["tokens"] == 14


async def test_between_turns_the_next_call_goes_to_the_target_and_can_come_back_home():
    home, target = CountingEngine(), CountingEngine(version=1)
    routes = _routes(home)
    route = routes.open("ep", "g")
    first = await route.generate(PROMPT, SamplingParams(max_new_tokens=4), "t0")
    assert (await routes.migrate("ep", FakeHandle(target), "w1"))["in_flight"] is False
    context = PROMPT + first.output_ids + [9, 9]  # the env's observation delta
    second = await route.generate(context, SamplingParams(max_new_tokens=5), "t1")
    assert second.output_ids == expected_ids(5, context) and second.weight_version == 1
    assert "token_versions" not in second.meta  # all from the target: one version
    # what the source held (the last context: prompt + completion) is what the target computes again
    assert second.meta["reprefill_tokens"] == len(PROMPT) + 4
    (report,) = routes.take_measured()
    assert report["target"] == "w1" and report["handoff_s"] is None  # no request to abort between turns
    assert (await routes.migrate("ep", None, "w0"))["applied"]  # back home: no handle needed
    third = await route.generate(context + second.output_ids, SamplingParams(max_new_tokens=3), "t2")
    assert home.prompts[-1][: len(context)] == context and third.weight_version == 0
    assert [r["target"] for r in routes.take_measured()] == ["w0"]  # each measurement reported once


async def test_a_failing_target_sends_the_episode_home_with_nothing_lost():
    home = CountingEngine()
    routes = _routes(home)
    route = routes.open("ep", "g")
    await routes.migrate("ep", FakeHandle(CountingEngine(fail=True)), "w1")
    out = await route.generate(PROMPT, SamplingParams(max_new_tokens=6), "req")
    assert out.output_ids == expected_ids(6, PROMPT) and out.finish_reason == "length"
    failed, back = routes.take_measured()
    assert failed["outcome"].startswith("fallback: EngineError") and failed["target"] == "w1"
    assert (back["source"], back["target"], back["outcome"]) == ("w1", "w0", "ok")
    assert routes.progress()[0]["engine"] == "w0"
    # the home engine failing is the episode's infra_error, as without migration
    home.fail = True
    with pytest.raises(Exception, match="died"):
        await route.generate(PROMPT, SamplingParams(max_new_tokens=2), "again")


async def test_a_stop_string_across_the_resubmission_cuts_the_output_as_the_engine_would():
    decode = functools.partial(str.join, "")  # ids -> text, for the check only
    ids = [1, 2, 3, 4]
    assert first_stop(lambda xs: decode(map(chr, [96 + x for x in xs])), ids, ["bc"], 1) == (3, "bc")
    assert first_stop(lambda xs: decode(map(chr, [96 + x for x in xs])), ids, ["zz"], 1) is None
    # in a route: the source has sampled up to the split, the target's part completes the stop
    home, target = CountingEngine(), CountingEngine()
    routes = Routes(LimitedEngine(home, 8), "w0", decode=lambda xs: " ".join(map(str, xs)) + " ")
    route = routes.open("ep", "g")
    want = expected_ids(8, PROMPT)
    stop = f"{want[2]} {want[3]} "  # straddles tokens 3 and 4: the split comes after token 3

    async def migrate_at_3(n: int, rid: str) -> None:
        if n == 3 and not home.aborted:
            await routes.migrate("ep", FakeHandle(target), "w1")

    home.on_token = migrate_at_3
    out = await route.generate(PROMPT, SamplingParams(max_new_tokens=8, stop=[stop]), "req")
    assert out.output_ids == want[:4] and out.finish_reason == "stop" and out.matched_stop == stop


async def test_the_runners_own_abort_is_not_resubmitted_and_unknown_episodes_are_refused():
    home = CountingEngine()
    routes = _routes(home)
    route = routes.open("ep", "g")

    async def abort_at_2(n: int, rid: str) -> None:
        if n == 2:
            await route.abort("req")

    home.on_token = abort_at_2
    out = await route.generate(PROMPT, SamplingParams(max_new_tokens=6), "req")
    assert out.finish_reason == "abort" and len(out.output_ids) == 2
    refused = await routes.migrate("nope", None, "w1")
    assert refused["applied"] is False and "not running here" in refused["error"]
    assert (await routes.migrate("ep", None, "w0"))["applied"] is False  # already there
    routes.close(route)
    assert routes.progress() == [] and routes.take_measured() == []


async def test_an_episode_runner_with_routes_counts_its_migrations_in_the_record(tmp_path):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    tok = AutoTokenizer.from_pretrained(build_tiny(tmp_path))
    home, target = CountingEngine(stop_every=5), CountingEngine(stop_every=5)
    routes = _routes(home)
    runner = EpisodeRunner(routes.home, tok, RolloutConfig(SamplingParams(max_new_tokens=6)), routes=routes)

    async def migrate_once(n: int, rid: str) -> None:
        if n == 2 and not home.aborted:
            (ep,) = routes.progress()
            await routes.migrate(ep["id"], FakeHandle(target), "w1")

    home.on_token = migrate_once
    rec = await runner.run(reflow.make("test/Echo-v0", max_turns=3), seed=0)
    assert rec.status == "truncated" and rec.n_turns == 3
    assert rec.timings["migrations"] == 1 and rec.timings["reprefill_tokens"] > 0
    # home served turn 0 up to the migration; the target its rest and turns 1 and 2
    assert len(home.prompts) == 1 and len(target.prompts) >= 3
    assert routes.progress() == []  # the route closed with the episode


async def test_a_group_migrated_onto_older_weights_is_as_old_as_its_oldest_token(tmp_path):
    """Engines at v5 and v3: an episode started on v5 and migrated to v3 holds v3 tokens, so its
    stored group is version 3 and leaves the replay window (tau_max 2) at v6, not at v8."""
    from transformers import AutoTokenizer

    from reflow.models import build_tiny
    from reflow.replay import ReplayStore
    from reflow.train.advantages import group_advantages

    tok = AutoTokenizer.from_pretrained(build_tiny(tmp_path))
    home, target = CountingEngine(version=5, stop_every=5), CountingEngine(version=3, stop_every=5)
    routes = _routes(home)
    runner = EpisodeRunner(routes.home, tok, RolloutConfig(SamplingParams(max_new_tokens=6)), routes=routes)

    async def migrate_once(n: int, rid: str) -> None:
        if n == 2 and not home.aborted:
            (ep,) = routes.progress()
            assert ep["version"] == 5  # the newest token so far, for the tail policy
            await routes.migrate(ep["id"], FakeHandle(target), "w1")

    home.on_token = migrate_once
    migrated = await runner.run(reflow.make("test/Echo-v0", max_turns=3), seed=0, group_id="g")
    assert migrated.policy_version_start == 5 and migrated.oldest_version == 3
    stay = copy.deepcopy(migrated)
    stay.episode_id, stay.reward = "other", migrated.reward + 1.0
    for turn in stay.turns:
        turn.token_versions = [5] * len(turn.token_versions)
    with ReplayStore(tmp_path / "replay.sqlite", "r") as store:
        stored = store.add_group([migrated, stay], group_advantages([migrated.reward, stay.reward]))
        assert (stored.policy_version, stored.newest_version) == (3, 5)
        store.mark_consumed(["g"], 1)
        window = {
            v: [g.group_id for g in store.replayable(current_version=v, tau_max=2, max_reuse=3)]
            for v in (5, 6)
        }
        assert window == {5: ["g"], 6: []}


# -- the done-when test: TorchEngine, the tiny model -----------------------------------------------


class HeldForward:
    """Holds the engine's worker thread before its `at`-th forward pass until `release` is set, so the
    test migrates while a known number of tokens of the turn has been sampled."""

    def __init__(self, model: torch.nn.Module, at: int) -> None:
        self.calls, self.at = 0, at
        self.reached, self.release = threading.Event(), threading.Event()
        inner = model.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                self.reached.set()
                self.release.wait(timeout=60)
            return inner(*args, **kwargs)

        model.forward = forward


GREEDY = RolloutConfig(
    SamplingParams(max_new_tokens=24, temperature=0.0), max_context_tokens=2048, max_turns=4
)


async def _play(model, tok, config=GREEDY, migrate=None):
    """One Echo episode on `model`'s engine; `migrate(routes, episode_id)` runs alongside (it may
    migrate). Returns the record and the measured migrations."""
    from reflow.engine.torch_engine import TorchEngine

    engine = TorchEngine(model, tok, max_batch_size=4)
    routes = Routes(LimitedEngine(engine, 4), "w0", decode=tok.decode)
    runner = EpisodeRunner(routes.home, tok, config, routes=routes)
    try:
        task = asyncio.ensure_future(runner.run(reflow.make("test/Echo-v0", max_turns=4), seed=3))
        if migrate is not None:
            while not routes.progress():
                await asyncio.sleep(0)
            await migrate(routes, routes.progress()[0]["id"])
        rec = await task
    finally:
        await engine.close()
    return rec, routes.take_measured()


def _sampled(rec):
    (seg,) = rec.segments
    return [(i, v) for i, m, v in zip(seg.token_ids, seg.loss_mask, seg.versions, strict=True) if m]


@pytest.mark.slow
async def test_a_migrated_episode_equals_an_unmigrated_run_token_for_token(tmp_path):
    from reflow.engine.torch_engine import TorchEngine
    from reflow.train.logprobs import token_logprobs

    _, model, tok = build_tiny_engine_model(tmp_path)
    twin = copy.deepcopy(model)  # the target engine's copy of the same weights
    ref, _ = await _play(model, tok)
    lengths = [len(t.completion_ids) for t in ref.turns]
    turn = next(i for i, n in enumerate(lengths) if n >= 8)  # a turn long enough to split
    held = HeldForward(model, at=sum(lengths[:turn]) + 4)  # the pass that samples its 4th token
    target = TorchEngine(twin, tok, max_batch_size=4)
    handle = FakeHandle(LimitedEngine(target, 4))

    async def mid_turn(routes, episode):
        await asyncio.to_thread(held.reached.wait, 60)
        assert (await routes.migrate(episode, handle, "w1"))["in_flight"]
        held.release.set()

    try:
        rec, measured = await _play(model, tok, migrate=mid_turn)
    finally:
        held.release.set()
        await target.close()
    # the same episode, token for token: turns, sampled ids, masks, versions, finish reasons
    assert rec.status == ref.status and rec.n_turns == ref.n_turns
    assert [t.completion_ids for t in rec.turns] == [t.completion_ids for t in ref.turns]
    assert [t.finish_reason for t in rec.turns] == [t.finish_reason for t in ref.turns]
    assert rec.segments[0].token_ids == ref.segments[0].token_ids
    assert rec.segments[0].loss_mask == ref.segments[0].loss_mask and _sampled(rec) == _sampled(ref)
    # log-probs: as the unmigrated run's, and as the model re-scores them, within tolerance
    got, want = torch.tensor(rec.segments[0].logprobs), torch.tensor(ref.segments[0].logprobs)
    assert torch.allclose(got, want, atol=1e-4)
    ids = torch.tensor([rec.segments[0].token_ids])
    with torch.no_grad():
        rescored, _ = token_logprobs(twin, ids, torch.ones_like(ids), entropy="none")
    mask = torch.tensor(rec.segments[0].loss_mask, dtype=torch.bool)
    assert torch.allclose(rescored[0][mask], got[mask], atol=1e-4)
    # the split happened inside the turn, and the re-prefill is counted: the turn's prompt + its tokens
    (report,) = measured
    prompt = sum(len(t.prompt_delta_ids) + len(t.completion_ids) for t in ref.turns[:turn])
    prompt += len(ref.turns[turn].prompt_delta_ids)
    partial = report["reprefill_tokens"] - prompt
    assert report["outcome"] == "ok" and report["in_flight"] and 0 < partial < lengths[turn]
    assert rec.timings["migrations"] == 1 and rec.timings["reprefill_tokens"] == report["reprefill_tokens"]


class MigratingEcho(EchoEnv):
    """Echo that calls `hook()` in its step after the first turn: a migration between turns."""

    def __init__(self, hook) -> None:
        super().__init__()
        self.hook, self.steps = hook, 0

    async def step(self, turn):
        self.steps += 1
        if self.steps == 1:
            await self.hook()
        return await super().step(turn)


@pytest.mark.slow
async def test_a_sampled_migrated_episode_keeps_log_probs_that_re_score(tmp_path):
    """Sampling: a seeded generator would restart on the target, so the ids are not the unmigrated
    run's; what must hold is that every recorded log-prob is the policy's for the token sampled."""
    from reflow.engine.torch_engine import TorchEngine
    from reflow.train.logprobs import token_logprobs

    _, model, tok = build_tiny_engine_model(tmp_path)
    twin = copy.deepcopy(model)
    home, target = TorchEngine(model, tok, max_batch_size=4), TorchEngine(twin, tok, max_batch_size=4)
    routes = Routes(LimitedEngine(home, 4), "w0", decode=tok.decode)
    params = SamplingParams(max_new_tokens=24, stop=["e"], seed=0)  # seeded: the same run every time
    sampled = RolloutConfig(params, max_context_tokens=2048, max_turns=4)
    runner = EpisodeRunner(routes.home, tok, sampled, routes=routes)
    handle = FakeHandle(LimitedEngine(target, 4))

    async def migrate() -> None:
        (ep,) = routes.progress()
        assert (await routes.migrate(ep["id"], handle, "w1"))["in_flight"] is False

    try:
        rec = await runner.run(MigratingEcho(migrate), seed=3)
    finally:
        await home.close()
        await target.close()
    measured = routes.take_measured()
    assert rec.n_turns >= 2 and [m["outcome"] for m in measured] == ["ok"]
    assert measured[0]["reprefill_tokens"] == len(rec.turns[0].prompt_delta_ids) + len(
        rec.turns[0].completion_ids
    )
    seg = rec.segments[0]
    ids = torch.tensor([seg.token_ids])
    with torch.no_grad():
        rescored, _ = token_logprobs(twin, ids, torch.ones_like(ids), entropy="none")
    mask = torch.tensor(seg.loss_mask, dtype=torch.bool)
    assert torch.allclose(rescored[0][mask], torch.tensor(seg.logprobs)[mask], atol=1e-4)


def _started_at_token(engine, n: int) -> asyncio.Event:
    """Set once `engine` (a `CountingEngine`) has decoded `n` tokens of a request; each token is
    slowed a little so a test can act while the request is in flight."""
    started = asyncio.Event()

    async def at_token(i: int, rid: str) -> None:
        if i == n:
            started.set()
        await asyncio.sleep(0.001)

    engine.on_token = at_token
    return started


async def test_a_handed_over_episode_goes_on_on_the_target_through_its_workers_pause():
    """A lent engine's yield with room on a rollout engine (`Routes.hand_over`): the moved episode
    generates on the target while the worker is paused, the other one waits for the resume; back home
    (a migration), it waits for this worker's resumes again."""
    home, target = CountingEngine(version=3), CountingEngine(version=4)
    routes = _routes(home)
    moved, stays = routes.open("a", "g"), routes.open("b", "g")
    started = _started_at_token(home, 2)
    params = SamplingParams(max_new_tokens=40)
    calls = [asyncio.ensure_future(r.generate(PROMPT, params, r.episode)) for r in (moved, stays)]
    await started.wait()
    assert await routes.hand_over(FakeHandle(target), "w1", 1) == {"g": 1}
    assert await routes.pause() == 1  # only the episode left at home pauses
    out = await asyncio.wait_for(calls[0], 5)  # finished on the target while the worker was paused
    assert out.output_ids == expected_ids(40, PROMPT) and set(out.meta["token_versions"]) == {3, 4}
    assert not calls[1].done() and routes.at_home() == {"g": 1}
    routes.resume()
    rest = await asyncio.wait_for(calls[1], 5)
    assert rest.output_ids == expected_ids(40, PROMPT)
    # back home by a migration: it waits for this worker's pauses again
    assert (await routes.migrate("a", None, "w0"))["applied"] and moved.gate is routes.gate
    await routes.pause()
    again = asyncio.ensure_future(moved.generate(PROMPT, SamplingParams(max_new_tokens=3), "a2"))
    await asyncio.sleep(0.05)
    assert not again.done()  # held at the gate
    routes.resume()
    assert (await asyncio.wait_for(again, 5)).output_ids == expected_ids(3, PROMPT)


async def test_an_episode_paused_at_its_gate_is_woken_by_a_hand_over():
    """Back-to-back train steps: the lent engine is still paused at the next step's start, its episodes
    waiting at the gate; handed over, they wake and generate on the target while the worker stays
    paused (they must not sleep on the old gate through the step, nor wait at a gate they left)."""
    home, target = CountingEngine(version=3), CountingEngine(version=4)
    routes = _routes(home)
    route = routes.open("a", "g")
    started = _started_at_token(home, 2)
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=30), "a"))
    await started.wait()
    assert await routes.pause() == 1  # the first step: it pauses
    await asyncio.sleep(0.05)
    assert route.waiting and not call.done()
    assert await routes.hand_over(FakeHandle(target), "w1", 4) == {"g": 1}  # the next step's start
    out = await asyncio.wait_for(call, 5)  # the worker never resumed
    assert out.output_ids == expected_ids(30, PROMPT) and out.meta["token_versions"][-1] == 4
    assert route.paused_total_s > 0  # its wait at the gate, left out of its age


async def test_a_handed_over_episode_whose_target_dies_goes_home_and_waits_for_the_resume():
    """The rollout worker serving a handed-over episode fails (its actor stopped by a role change): the
    episode falls back to its home engine and obeys its worker's gate again, so a paused lent engine
    does not start generating beside the train step."""
    home = CountingEngine(version=3)
    routes = _routes(home)
    route = routes.open("a", "g")
    assert await routes.hand_over(FakeHandle(CountingEngine(fail=True)), "w1", 1) == {"g": 1}
    await routes.pause()  # the lent engine yields to a step; the episode was not at home
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=5), "a"))
    await asyncio.sleep(0.05)
    assert not call.done() and home.prompts == []  # fell back home, and waits at the gate
    assert route.gate is routes.gate and route.engine_name == "w0"
    routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(5, PROMPT) and home.prompts
    (report,) = [m for m in routes.take_measured() if m["outcome"].startswith("fallback")]
    assert report["target"] == "w1"  # the hand-over, undone: home from there


async def test_a_hand_over_leaves_home_an_episode_with_tokens_of_newer_weights_than_the_targets():
    """The lent engine has sampled at version 5; a rollout engine still on 4 takes only the episode
    with no token yet (its tokens would otherwise go back a version: past what admission counted)."""
    home, target = CountingEngine(version=5), CountingEngine(version=4)
    routes = _routes(home)
    sampled, fresh = routes.open("a", "g1"), routes.open("b", "g2")
    await asyncio.wait_for(sampled.generate(PROMPT, SamplingParams(max_new_tokens=3), "a"), 5)
    assert sampled.newest_version == 5 and fresh.newest_version == -1
    assert await routes.hand_over(FakeHandle(target), "w1", 2, version=4) == {"g2": 1}
    assert routes.at_home() == {"g1": 1} and routes.away() == {"g2": {"w1": 1}}
    # a target on the same weights takes it
    assert await routes.hand_over(FakeHandle(CountingEngine(version=5)), "w2", 2, version=5) == {"g1": 1}


async def test_a_hand_over_counts_the_tokens_of_a_request_in_flight_in_an_episodes_weights():
    """No call has returned yet, but the request in flight samples on version 5: a target on 4 does
    not take the episode (its in-flight tokens, kept at the abort, would be newer than the target's)."""
    home = CountingEngine(version=5)
    routes = _routes(home)
    route = routes.open("a", "g")
    started = _started_at_token(home, 2)
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=40), "a"))
    await started.wait()
    assert route.newest_version == -1 and route.sampled_version == 5
    assert await routes.hand_over(FakeHandle(CountingEngine(version=4)), "w1", 1, version=4) == {}
    assert (await asyncio.wait_for(call, 5)).output_ids == expected_ids(40, PROMPT)
