"""Tail handling in sync mode: a worker's episodes pause (requests aborted, tokens kept) and resume on
the engine's newer weights, first on a deterministic engine (pause at a known token), then a real
`agent-train` run in mode sync with `tail.enabled` that over-provisions, carries unfinished groups over
the train step and trains them with their per-token versions, losing no group; and one with two rollout
workers whose tail migrates episodes between them, starts the next round's groups on the engine freed
and sets a concurrency limit, losing no group."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from migration_helpers import CountingEngine, ScriptedTail, expected_ids
from run_helpers import LONG_TAIL_RUN, SMALL_ROLLOUT, TINY_MODEL, train_and_read

from reflow.engine import SamplingParams
from reflow.rollout.concurrency import LimitedEngine
from reflow.rollout.routing import Routes

TESTS = Path(__file__).parent
PROMPT = [5, 6, 7, 8]


async def _ticks(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_paused_request_keeps_its_tokens_and_resumes_on_the_weights_the_engine_has_then():
    engine = CountingEngine(version=3)
    routes = Routes(LimitedEngine(engine, 8), "w0", decode=lambda ids: " ".join(map(str, ids)))
    route = routes.open("ep", "g")
    paused: list[int] = []

    async def pause_at_3(n: int, rid: str) -> None:
        if n == 3 and not paused:
            paused.append(await routes.pause())

    engine.on_token = pause_at_3
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=10), "req"))
    await _ticks()
    # paused: the request was aborted after 3 tokens and nothing was resubmitted
    assert paused == [1] and not call.done() and len(engine.prompts) == 1 and engine.in_flight == 0
    engine._version = 4  # the weight update the sync loop makes while its episodes are paused
    routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(10, PROMPT) and out.finish_reason == "length"
    assert out.meta["token_versions"] == [3] * 3 + [4] * 7 and out.weight_version == 4
    # resubmitted on the same engine with the exact prefix, which it computed again
    assert engine.prompts == [PROMPT, PROMPT + expected_ids(3, PROMPT)]
    assert out.meta["reprefill_tokens"] == len(PROMPT) + 3
    assert routes.take_measured() == []  # a pause is no migration


async def test_an_episode_between_turns_at_a_pause_waits_for_the_resume_before_it_generates():
    engine = CountingEngine()
    routes = Routes(LimitedEngine(engine, 8), "w0")
    route = routes.open("ep", "g")
    assert await routes.pause() == 1
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=4), "t1"))
    await _ticks()
    assert not call.done() and engine.prompts == []
    routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(4, PROMPT) and "reprefill_tokens" not in out.meta


async def test_a_resume_undone_before_the_episode_ran_keeps_it_paused():
    """resume then pause before the waiting episode gets the event loop: it must not start generating."""
    engine = CountingEngine()
    routes = Routes(LimitedEngine(engine, 8), "w0")
    route = routes.open("ep", "g")
    await routes.pause()
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=4), "t1"))
    await _ticks()
    routes.resume()
    await routes.pause()
    await _ticks()
    assert not call.done() and engine.prompts == []
    routes.resume()
    assert (await asyncio.wait_for(call, 5)).output_ids == expected_ids(4, PROMPT)


async def test_the_time_an_episode_waits_paused_does_not_count_against_its_envs_deadline(tmp_path):
    """A carried episode waits out the train step: the env's deadline moves by the seconds paused, so
    the episode is not cut short as a timeout (a reward it did not earn)."""
    from transformers import AutoTokenizer

    import reflow
    from reflow.models import build_tiny
    from reflow.rollout.episode import EpisodeRunner, RolloutConfig

    tok = AutoTokenizer.from_pretrained(build_tiny(tmp_path))
    engine = CountingEngine(stop_every=5)
    routes = Routes(LimitedEngine(engine, 8), "w0")
    runner = EpisodeRunner(routes.home, tok, RolloutConfig(SamplingParams(max_new_tokens=6)), routes=routes)

    async def pause_at_2(n: int, rid: str) -> None:
        if n == 2 and len(engine.prompts) == 1:
            await routes.pause()
            asyncio.get_running_loop().call_later(1.0, routes.resume)  # the train step and weight sync

    engine.on_token = pause_at_2
    rec = await runner.run(reflow.make("test/Echo-v0", max_turns=3, deadline_s=0.8), seed=0)
    assert rec.status == "truncated" and rec.n_turns == 3  # the turn limit ended it, not the deadline
    assert rec.timings["total_s"] > 1.0
    # the second left out of its decoding time too (the turn's and the episode's generation_s)
    assert rec.timings["paused_s"] >= 0.95 and rec.timings["generation_s"] < 0.5
    assert max(t.generation_s for t in rec.turns) < 0.5


async def test_a_turns_generation_time_is_never_negative_when_its_pause_fills_it(tmp_path, monkeypatch):
    """The paused seconds come from the route's clock, the turn's from the runner's: a turn paused
    almost throughout may read a hair more pause than elapsed time; its generation time floors at 0."""
    from transformers import AutoTokenizer

    import reflow
    from reflow.models import build_tiny
    from reflow.rollout.episode import EpisodeRunner, RolloutConfig
    from reflow.rollout.routing import EpisodeRoute

    tok = AutoTokenizer.from_pretrained(build_tiny(tmp_path))
    routes = Routes(LimitedEngine(CountingEngine(stop_every=5), 8), "w0")
    runner = EpisodeRunner(routes.home, tok, RolloutConfig(SamplingParams(max_new_tokens=6)), routes=routes)
    # every call reads as paused, for a full second: more than the turn's elapsed time
    monkeypatch.setattr(
        EpisodeRoute, "paused_s", property(lambda self: 1.0, lambda self, v: None), raising=False
    )
    monkeypatch.setattr(EpisodeRoute, "take_paused_s", lambda self: 1.0)
    rec = await runner.run(reflow.make("test/Echo-v0", max_turns=2, deadline_s=None), seed=0)
    assert rec.n_turns == 2
    assert all(t.generation_s == 0.0 for t in rec.turns) and rec.timings["generation_s"] == 0.0


def test_sync_run_with_tail_handling_carries_groups_over_and_loses_none(tmp_path, monkeypatch):
    from reflow.replay import ReplayStore

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    summary, rows = train_and_read(
        [
            *TINY_MODEL,
            *SMALL_ROLLOUT,
            *LONG_TAIL_RUN,
            f"out_dir={tmp_path}",
            "run_name=sync-tail",
            "mode=sync",
            "train.steps=6",
            "tail.enabled=true",
            "tail.min_samples=2",  # over-provision from the third group on
            "tail.over_provision_max=1",
            # env steps shorter than the pause (a train step and a weight sync, >= 20 ms): an episode
            # carried over the step reaches the gate while it is closed, whatever it did at the pause
            # (with 0.3-s steps one could sleep through the whole pause in its env and never wait)
            "env.kwargs={step_s: 0.01}",
        ]
    )
    run_dir = tmp_path / "sync-tail"
    steps = [r for r in rows if r["kind"] == "step"]
    assert summary["steps"] == 6
    assert summary["tail_over_provisioned"] >= 1 and summary["tail_carried_over"] >= 1
    assert any(t["what"] == "over_provision" for t in rows if t["kind"] == "tail")
    # carried groups trained one version stale, weighed by their own behaviour log-probs (w != 1)
    stale = [s for s in steps if s["staleness_max"] == 1]
    assert stale and all(s["staleness_max"] <= 1 for s in steps)
    assert any(abs(s["w_mean"] - 1.0) > 1e-4 for s in stale)
    # nothing lost: every group that arrived is stored whole, once; the carried ones hold tokens of two
    # versions (paused on one, resumed on the next)
    with ReplayStore(run_dir / "replay.sqlite", "sync-tail") as store:
        assert store.integrity_check() == "ok"
        arrived = sum(r["groups_generated"] for r in rows if r["kind"] in ("step", "no_signal"))
        # at the end, the unfinished groups are cancelled; one that finished first is stored, and said
        ended = [t for t in rows if t["kind"] == "tail" and t["what"] == "run_end"]
        assert store.count() == arrived + sum(t["stored"] for t in ended)
        records = list(store.episodes())
    by_group: dict[str, list] = {}
    for r in records:
        by_group.setdefault(r.group_id, []).append(r)
    assert all(len(eps) == 4 for eps in by_group.values())
    assert all(r.status != "infra_error" for r in records)
    carried = [r for r in records if r.policy_version_start < r.policy_version_end]
    assert carried
    # carried episodes waited paused through the step; the time is in their records, apart from their
    # duration for the tail's quantiles
    assert all(r.timings.get("paused_s", 0.0) > 0.0 for r in carried)
    assert all(r.timings.get("paused_s", 0.0) < r.timings["total_s"] for r in records)
    # ... and out of its generation time: decoding and env time fit in the time it was not paused
    for r in records:
        active = r.timings["total_s"] - r.timings.get("paused_s", 0.0)
        assert r.timings["generation_s"] + r.timings["env_s"] <= active + 1e-3
        assert sum(t.generation_s for t in r.turns) == pytest.approx(r.timings["generation_s"])


@pytest.mark.slow
def test_sync_run_with_two_rollout_workers_migrates_its_stragglers_and_loses_no_group(tmp_path, monkeypatch):
    import reflow.recipes.sync_tail as sync_tail
    from reflow.replay import ReplayStore

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(sync_tail, "TailPolicy", ScriptedTail)
    overrides = [
        *TINY_MODEL,
        *SMALL_ROLLOUT,
        *LONG_TAIL_RUN,
        f"out_dir={tmp_path}",
        "run_name=sync-migrate",
        "mode=sync",
        "resources.slots=[rollout, rollout, train]",
        "tail.enabled=true",
        "tail.set_concurrency=true",  # opt-in: the test sees a limit set
    ]
    summary, rows = train_and_read([*overrides, "train.steps=5"])
    run_dir = tmp_path / "sync-migrate"
    assert summary["steps"] == 5
    tail = [r for r in rows if r["kind"] == "tail"]
    decided = [t for t in tail if t["what"] == "migrate" and t["applied"] and "tokens" in t]
    assert summary["tail_migrations"] >= 1 and len(decided) == summary["tail_migrations"]
    assert all(m["source"] != m["target"] for m in decided)
    assert any(t["what"] == "free_slot" and t["applied"] and t["use"] == "next_batch" for t in tail)
    assert any(t["what"] == "set_concurrency" and t["applied"] and t["limit"] == 12 for t in tail)
    steps = [r for r in rows if r["kind"] == "step"]
    assert all(s["staleness_max"] <= 1 for s in steps)  # a round's early groups pause with its stragglers
    with ReplayStore(run_dir / "replay.sqlite", "sync-migrate") as store:
        assert store.integrity_check() == "ok"
        arrived = sum(r["groups_generated"] for r in rows if r["kind"] in ("step", "no_signal"))
        ended = [t for t in tail if t["what"] == "run_end"]
        assert store.count() == arrived + sum(t["stored"] for t in ended)
        records = {r.episode_id: r for r in store.episodes()}
    by_group: dict[str, int] = {}
    for r in records.values():
        by_group[r.group_id] = by_group.get(r.group_id, 0) + 1
    assert all(n == 4 for n in by_group.values())
    assert all(r.status != "infra_error" for r in records.values())
    moved = [records[m["episode"]] for m in decided if m["episode"] in records]
    assert moved and all(r.timings.get("migrations", 0) >= 1 for r in moved)

    # the run's last checkpoint holds each engine's concurrency limit and the durations; a resume
    # restores the limits (the scripted w0 limit of 12, or what the policy set after it)
    from reflow.train.trainer_state import STATE_FILE, latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    saved = json.loads((ckpt / STATE_FILE).read_text())["extra"]["run_state"]["scheduler"]
    assert set(saved["tail"]["limits"]) == {"w0", "w1"} and saved["durations"]["group_s"]
    _, resumed = train_and_read([*overrides, "train.steps=6"], resume=True)
    why = "restored from the checkpoint"
    restored = {r["engine"]: r["limit"] for r in resumed if r["kind"] == "tail" and r.get("why") == why}
    assert restored == saved["tail"]["limits"]
    # resumed once more with the tail off: its checkpoints carry no tail state a later resume would take
    train_and_read([*overrides[:-1], "tail.enabled=false", "train.steps=7"], resume=True)
    last = json.loads((latest_checkpoint(run_dir / "checkpoints") / STATE_FILE).read_text())
    assert last["extra"]["run_state"]["scheduler"] == {}


@pytest.mark.parametrize("mode", ["sync", "reflow"])
async def test_only_a_sync_worker_hands_its_kv_memory_back_when_its_last_call_ends(tmp_path, mode):
    """In sync mode the trainer's step comes next on the same memory; the decoupled modes' rollouts run
    on, and freeing after every group would only rebuild the buffers."""
    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    config = load_config(
        None, ["env.id=reflow/Calc-v0", f"out_dir={tmp_path}", "eval.max_new_tokens=6", f"mode={mode}"]
    )
    worker = RolloutWorker(config, model_dir, replay=None)
    try:
        await worker.held_out(3, 1_000_000, 1.0, 2)
        capacity = (await worker.engine.health())["kv_capacity"]
        assert capacity == 0 if mode == "sync" else capacity > 0
    finally:
        await worker.close()
