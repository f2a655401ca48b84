"""The episode runner: token-in-token-out records, segments, masks, statuses, budgets, groups."""

import asyncio
import random

import pytest
from scripted_engine import ScriptedEngine

import reflow
from reflow.engine import SamplingParams
from reflow.env import play_episode, scripted_policy
from reflow.rollout.episode import EpisodeRunner, RolloutConfig, run_group

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


def _calc_task(min_steps: int = 5) -> dict:
    env = reflow.make("reflow/Calc-v0")
    for s in range(1000):
        task = env.generate_task(random.Random(s))
        if len(task["steps"]) >= min_steps:
            return task
    raise AssertionError("no long task")


async def _demo_texts(env_id: str, task: dict, error_rate: float = 0.0, seed: int = 0) -> list[str]:
    env = reflow.make(env_id)
    result = await play_episode(env, scripted_policy(env, error_rate, seed), task=task, seed=seed)
    return [r.raw_text for r in result.records]


async def test_token_in_token_out_round_trip_over_many_tool_turns(tiny_tokenizer):
    task = _calc_task(5)
    texts = await _demo_texts("reflow/Calc-v0", task)
    engine = ScriptedEngine(tiny_tokenizer, texts)
    runner = EpisodeRunner(engine, tiny_tokenizer)
    rec = await runner.run(reflow.make("reflow/Calc-v0"), task=task, seed=0)
    assert (rec.status, rec.reward, rec.success) == ("ok", 1.0, True)
    assert rec.n_turns == len(texts) >= 6
    (seg,) = rec.segments
    # the row is exactly prompt deltas and sampled ids, in order
    rebuilt = [i for t in rec.turns for i in (*t.prompt_delta_ids, *t.completion_ids)]
    assert seg.token_ids == rebuilt
    # sampled ids and logprobs sit under mask 1, exactly as the engine returned them
    sampled = [i for i, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert sampled == [i for r in engine.results for i in r.output_ids]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m] == [
        lp for r in engine.results for lp in r.logprobs
    ]
    assert all(v == -1 for v, m in zip(seg.versions, seg.loss_mask, strict=True) if not m)
    # every prompt the engine saw is a prefix of the row, ending where its completion starts
    pos = 0
    for turn, prompt in zip(rec.turns, engine.prompts, strict=True):
        pos += len(turn.prompt_delta_ids)
        assert prompt == seg.token_ids[:pos]
        pos += len(turn.completion_ids)
    # tool results come back as mask-0 tokens of the observation
    later = rec.turns[1]
    assert later.obs_messages[0]["role"] == "tool"
    assert "<tool_response>" in tiny_tokenizer.decode(later.prompt_delta_ids)
    assert rec.turns[0].tool_calls[0]["name"] == "calculator"
    assert rec.turns[0].tool_results[0]["ok"] is True


async def test_template_that_rewrites_history_starts_a_new_segment(tiny_tokenizer):
    # Qwen3-style: reasoning of earlier assistant turns is dropped when history is re-rendered.
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1].lstrip() }}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    task = _calc_task(3)
    texts = ["<think>step</think>\n" + t for t in await _demo_texts("reflow/Calc-v0", task)]
    engine = ScriptedEngine(tok, texts)
    rec = await EpisodeRunner(engine, tok).run(reflow.make("reflow/Calc-v0"), task=task, seed=0)
    assert rec.status == "ok"
    assert len(rec.segments) == rec.n_turns
    for seg, turn, prompt in zip(rec.segments, rec.turns, engine.prompts, strict=True):
        assert seg.token_ids == prompt + turn.completion_ids
        assert sum(seg.loss_mask) == len(turn.completion_ids)
        assert turn.segment_id == seg.segment_id
    assert "<think>" not in tok.decode(rec.segments[-1].token_ids[: -len(rec.turns[-1].completion_ids)])


async def test_engine_failure_mid_episode_is_infra_error_not_zero_reward(tiny_tokenizer):
    task = _calc_task(4)
    engine = ScriptedEngine(tiny_tokenizer, await _demo_texts("reflow/Calc-v0", task), fail_on_call=2)
    rec = await EpisodeRunner(engine, tiny_tokenizer).run(reflow.make("reflow/Calc-v0"), task=task, seed=0)
    assert rec.status == "infra_error" and "engine process died" in rec.error
    assert rec.n_turns == 2 and not rec.success


async def test_env_error_is_recorded(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["hello"])
    rec = await EpisodeRunner(engine, tiny_tokenizer).run(reflow.make("test/Crashy-v0", crash_on=2), seed=0)
    assert rec.status == "env_error" and "ZeroDivisionError" in rec.error and rec.n_turns == 2


async def test_reset_failures_env_error_vs_infra_error(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["hello"])
    runner = EpisodeRunner(engine, tiny_tokenizer)
    rec = await runner.run(reflow.make("test/Crashy-v0", crash_reset=True), seed=0)
    assert (rec.status, rec.termination) == ("env_error", "reset_failed") and "KeyError" in rec.error
    # a sandbox or env server that fails at reset is infrastructure: masked in training, not scored
    rec = await runner.run(reflow.make("test/Crashy-v0", crash_reset="infra"), seed=0)
    assert (rec.status, rec.termination) == ("infra_error", "reset_failed") and "sandbox failed" in rec.error


async def test_turn_limit_and_token_budgets(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["talking"])
    rec = await EpisodeRunner(engine, tiny_tokenizer).run(reflow.make("test/Echo-v0", max_turns=3), seed=0)
    assert (rec.status, rec.termination, rec.n_turns) == ("truncated", "max_turns", 3)

    prompt_len = len(rec.turns[0].prompt_delta_ids)
    small = RolloutConfig(max_context_tokens=prompt_len + 40)
    rec = await EpisodeRunner(engine, tiny_tokenizer, small).run(
        reflow.make("test/Echo-v0", max_turns=50), seed=0
    )
    assert (rec.status, rec.termination) == ("truncated", "token_budget")
    assert 1 <= rec.n_turns < 10
    assert all(len(s.token_ids) <= prompt_len + 40 for s in rec.segments)
    tiny = RolloutConfig(max_context_tokens=prompt_len)
    rec = await EpisodeRunner(engine, tiny_tokenizer, tiny).run(reflow.make("test/Echo-v0"), seed=0)
    assert (rec.status, rec.termination, rec.n_turns) == ("truncated", "token_budget", 0)

    capped = RolloutConfig(max_generated_tokens=10)
    rec = await EpisodeRunner(engine, tiny_tokenizer, capped).run(
        reflow.make("test/Echo-v0", max_turns=50), seed=0
    )
    assert rec.status == "truncated" and rec.n_generated_tokens <= 10


async def test_length_cut_turn_stops_the_episode_without_stepping_the_env(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["word " * 50])
    config = RolloutConfig(sampling=SamplingParams(max_new_tokens=8))
    env = reflow.make("test/Echo-v0")
    rec = await EpisodeRunner(engine, tiny_tokenizer, config).run(env, seed=0)
    assert (rec.status, rec.termination, rec.n_turns) == ("truncated", "turn_length", 1)
    assert rec.turns[0].finish_reason == "length" and len(rec.turns[0].completion_ids) == 8
    assert rec.turns[0].env_s == 0.0 and rec.turns[0].tool_results == []


async def test_deadline_aborts_a_slow_generation(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["hi"], delay_s=30)
    config = RolloutConfig(deadline_s=0.3)
    rec = await asyncio.wait_for(
        EpisodeRunner(engine, tiny_tokenizer, config).run(reflow.make("test/Echo-v0"), seed=0), 10
    )
    assert rec.status == "timeout" and len(engine.aborted) == 1


async def test_aborted_request_is_infra_error(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["hi"], finish_override={0: "abort"})
    rec = await EpisodeRunner(engine, tiny_tokenizer).run(reflow.make("test/Echo-v0"), seed=0)
    assert rec.status == "infra_error" and rec.termination == "aborted"


async def test_group_runs_concurrently_on_one_engine(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["a \\boxed{1}"], delay_s=0.05)
    runner = EpisodeRunner(engine, tiny_tokenizer)
    recs = await run_group(runner, lambda: reflow.make("reflow/Math-v0"), 8, seed=3)
    assert engine.max_in_flight == 8  # in flight together, not one after another
    assert len({r.group_id for r in recs}) == 1 and len({r.episode_id for r in recs}) == 8
    assert len({r.task_hash for r in recs}) == 1 and all(r.status == "ok" for r in recs)


async def test_a_seeded_group_gives_each_episode_and_each_turn_its_own_seed_the_same_every_run(
    tiny_tokenizer,
):
    """`SamplingParams.child`: a seeded measurement derives one seed per (task, sample, turn), so no two
    generate calls replay the same noise, and a second run sends exactly the same seeds; unseeded
    sampling stays unseeded."""
    task = _calc_task(2)
    call = (await _demo_texts("reflow/Calc-v0", task))[0]  # a tool call: the episode goes on

    async def seeds(sampling: SamplingParams, task_seed: int) -> list[int | None]:
        engine = ScriptedEngine(tiny_tokenizer, [call])
        runner = EpisodeRunner(engine, tiny_tokenizer, RolloutConfig(max_turns=3))
        recs = await run_group(
            runner, lambda: reflow.make("reflow/Calc-v0"), 3, task=task, seed=task_seed, sampling=sampling
        )
        assert [r.n_turns for r in recs] == [3, 3, 3]
        return engine.seeds

    seeded = SamplingParams(max_new_tokens=64, seed=1_000_000)
    first = await seeds(seeded, 7)
    assert len(set(first)) == len(first) == 9  # 3 episodes x 3 turns, all distinct
    assert all(0 <= s < 2**63 for s in first)
    assert await seeds(seeded, 7) == first
    assert not set(await seeds(seeded, 8)) & set(first)  # another task seed: other noise
    assert set(await seeds(SamplingParams(max_new_tokens=64), 7)) == {None}
    assert seeded.child(7, 0) == seeded.child(7, 0) != seeded.child(7, 1)
    assert SamplingParams().child(7, 0).seed is None


async def test_demo_policy_gives_the_same_layout_without_an_engine(tiny_tokenizer):
    runner = EpisodeRunner(None, tiny_tokenizer)
    env = reflow.make("reflow/Calc-v0")
    rec = await runner.run(env, seed=5, demo_policy=scripted_policy(env, 0.0, 5))
    assert rec.status == "ok" and rec.success
    (seg,) = rec.segments
    assert sum(seg.loss_mask) == rec.n_generated_tokens
    assert all(t.completion_ids[-1] == tiny_tokenizer.eos_token_id for t in rec.turns)


@pytest.mark.slow
async def test_real_engine_rows_reproduce_the_sampled_logprobs(tmp_path):
    """With the real TorchEngine and tiny model: each training row, fed to the model in one forward
    pass, gives back the logprobs the engine sampled with (so nothing was re-tokenized)."""
    import torch

    from reflow.engine.torch_engine import TorchEngine
    from reflow.models import load_model

    model, tok = load_model("tiny", num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    engine = TorchEngine(model, tok, max_batch_size=8)
    config = RolloutConfig(
        sampling=SamplingParams(max_new_tokens=24, temperature=1.0), max_context_tokens=1024
    )
    try:
        recs = await run_group(
            EpisodeRunner(engine, tok, config), lambda: reflow.make("reflow/Calc-v0"), 6, seed=1
        )
    finally:
        await engine.close()
    assert {r.status for r in recs} <= {"ok", "truncated"}
    for rec in recs:
        assert rec.n_turns >= 1 and rec.n_generated_tokens > 0
        for seg in rec.segments:
            ids = torch.tensor([seg.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            recomputed = logp.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(seg.loss_mask[1:], dtype=torch.bool)
            recorded = torch.tensor(seg.logprobs[1:])
            assert mask.any()
            assert torch.allclose(recomputed[mask], recorded[mask], atol=1e-4)


async def test_collect_gives_a_finished_episodes_place_to_the_next_group_while_stragglers_run_on():
    """Two groups whose first episodes straggle hold two places, not two groups' worth: with four
    places the third group starts as soon as the short episodes end; never more than four run."""
    import time

    from reflow.rollout.collect import collect

    loop_start, running, peak = time.monotonic(), 0, 0
    started: dict[int, float] = {}
    calls: dict[int, int] = {}
    closed: list[int] = []

    class Runner:
        config = RolloutConfig(sampling=SamplingParams(max_new_tokens=4))

        async def run(self, env, *, task, seed, group_id, sampling):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            started.setdefault(seed, time.monotonic() - loop_start)
            calls[seed] = calls.get(seed, 0) + 1
            straggler = seed in (0, 1) and calls[seed] == 1
            try:
                await asyncio.sleep(0.5 if straggler else 0.01)
            finally:
                running -= 1
            closed.append(seed)
            return (seed, straggler)

    records = await collect(Runner(), "reflow/Calc-v0", 8, group_size=2, concurrency=4, seed=0)
    assert sorted(s for s, _ in records) == [0, 0, 1, 1, 2, 2, 3, 3] and peak <= 4
    assert started[2] < 0.25 and started[3] < 0.25  # not held back by groups 0 and 1's stragglers
    assert sorted(closed[-2:]) == [0, 1]  # groups 2 and 3 ended while the stragglers ran on
