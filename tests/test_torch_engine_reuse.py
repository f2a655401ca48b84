"""TorchEngine prefix reuse (multi-turn continuations, GRPO groups) and a randomized mixed workload."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_helpers import build_tiny_engine_model, greedy, prompt, reference_logprobs, solo  # noqa: E402

from reflow.engine import SamplingParams  # noqa: E402
from reflow.engine.torch_engine import TorchEngine  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_engine_model(tmp_path_factory.mktemp("tiny"))


async def test_next_turn_reuses_the_previous_turns_cache(tiny):
    """Multi-turn: a prompt that extends a finished request's prompt + completion copies that prefix's
    keys/values instead of recomputing them; outputs and logprobs are those of a full computation. A
    continuation and a fresh prompt are prefilled together (suffix lengths differ)."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=3)
    sampled = SamplingParams(max_new_tokens=25, temperature=0.8, seed=5)
    first_ids = prompt(40, seed=10)
    try:
        first = await eng.generate(first_ids, greedy(30))
        turn2 = first_ids + first.output_ids + prompt(7, seed=11)
        fresh = prompt(90, seed=12)
        with eng._decoder._wake:  # hold the worker so that both requests join the same prefill batch
            tasks = [asyncio.create_task(eng.generate(ids, sampled)) for ids in (turn2, fresh)]
            await asyncio.sleep(0.01)
        second, other = await asyncio.gather(*tasks)
        health = await eng.health()
        assert health["prefix_hits"] == 1
        assert health["prefix_hit_tokens"] == len(first_ids) + len(first.output_ids) - 1
        turn3 = turn2 + second.output_ids + prompt(3, seed=13)
        third = await eng.generate(turn3, greedy(20))
        assert (await eng.health())["prefix_hits"] == 2
    finally:
        await eng.close()
    for ids, res, params in ((turn2, second, sampled), (fresh, other, sampled), (turn3, third, greedy(20))):
        ref = reference_logprobs(model, ids, res.output_ids, params.temperature)
        assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4
        assert res.output_ids == await solo(tiny, ids, params)


@pytest.mark.parametrize("rows", [8, 3])
async def test_many_episodes_share_the_prefix_cache_correctly(tiny, rows):
    """8 three-turn episodes: on 8 rows every later turn takes over its previous turn's row; on 3 rows
    parked rows are also evicted by other episodes' turns. Every turn equals the same request on an
    engine without prefix reuse."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=rows)
    plain = TorchEngine(model, tokenizer, max_batch_size=3, prefix_cache=False)

    async def episode(seed: int) -> list[tuple[list[int], list[int]]]:
        rng = random.Random(seed)
        ids, turns = prompt(rng.randint(5, 60), seed=seed), []
        for turn in range(3):
            res = await eng.generate(ids, greedy(rng.randint(1, 30)))
            turns.append((ids, res.output_ids))
            ids = ids + res.output_ids + prompt(rng.randint(1, 10), seed=100 * seed + turn)
        return turns

    try:
        episodes = await asyncio.gather(*(episode(s) for s in range(8)))
        if rows == 8:
            assert (await eng.health())["prefix_hits"] == 16
        for turns in episodes:
            for ids, out in turns:
                assert (await plain.generate(ids, greedy(len(out)))).output_ids[: len(out)] == out
    finally:
        await eng.close()
        await plain.close()


async def test_identical_prompts_are_prefilled_once(tiny):
    """A GRPO group's first turn: G copies of one prompt in the same prefill batch share one computation;
    each still samples on its own (seeds) and gets exact logprobs."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=8)
    ids, other = prompt(50, seed=15), prompt(20, seed=16)
    params = [SamplingParams(max_new_tokens=15, temperature=1.0, seed=s) for s in range(4)]
    try:
        with eng._decoder._wake:  # one admission batch
            tasks = [asyncio.create_task(eng.generate(ids, p)) for p in params]
            tasks.append(asyncio.create_task(eng.generate(other, greedy(15))))
            await asyncio.sleep(0.01)
        *group, alone = await asyncio.gather(*tasks)
        health = await eng.health()
    finally:
        await eng.close()
    assert health["prefix_hit_tokens"] == 3 * len(ids) and health["prefill_tokens"] == len(ids) + len(other)
    assert len({tuple(r.output_ids) for r in group}) > 1  # different seeds, different samples
    for res, p in zip(group, params, strict=True):
        ref = reference_logprobs(model, ids, res.output_ids, 1.0)
        assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4
        assert res.output_ids == await solo(tiny, ids, p)
    assert alone.output_ids == await solo(tiny, other, greedy(15))


async def test_weight_updates_drop_reusable_prefixes(tiny):
    path, _, tokenizer = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    eng = TorchEngine(model, tokenizer)
    ids = prompt(30, seed=14)
    try:
        first = await eng.generate(ids, greedy(10))
        new = {k: v * 1.1 for k, v in model.state_dict().items()}
        await eng.update_weights(state_dict=new)
        turn2 = ids + first.output_ids + [5, 6]
        res = await eng.generate(turn2, greedy(10))
        assert (await eng.health())["prefix_hits"] == 0  # the parked keys/values were stale
    finally:
        await eng.close()
    ref = reference_logprobs(model, turn2, res.output_ids, 0.0)
    assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("seed", [0, 5])
async def test_randomized_mixed_workload_keeps_exact_logprobs(tiny, seed):
    """Episodes of 1-4 turns with random lengths, temperatures, filters, seeds and stop strings, some
    requests cancelled, some repeated, on few rows and small cache growth steps: every result's
    logprobs equal a full forward pass over its prompt and output, and no step fails."""
    _, model, tokenizer = tiny
    rng = random.Random(seed)
    eng = TorchEngine(
        model,
        tokenizer,
        max_batch_size=rng.choice([2, 4, 8]),
        kv_headroom=16,
        max_prefill_tokens=rng.choice([64, 8192]),
    )
    results = []

    async def client(i: int) -> None:
        rng = random.Random(1000 * seed + i)  # own stream: the same requests whatever the interleaving
        ids = prompt(rng.randint(1, 80), seed=rng.randrange(10**6))
        for _ in range(rng.randint(1, 4)):
            temperature = rng.choice([0.0, 0.7, 1.0, 1.5])
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 40),
                temperature=temperature,
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 20]),
                seed=rng.choice([None, 1]),
                stop=rng.choice([[], ["ab", "\n"]]),
            )
            task = asyncio.create_task(eng.generate(ids, params))
            if rng.random() < 0.1:
                await asyncio.sleep(0.005)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                continue
            res = await task
            results.append((ids, res, temperature))
            ids = ids + res.output_ids + prompt(rng.randint(0, 10), seed=rng.randrange(10**6))
            if rng.random() < 0.3:  # the same prompt again (a retry, or a group sibling)
                results.append((ids, await eng.generate(ids, greedy(5)), 0.0))

    try:
        await asyncio.gather(*(client(i) for i in range(12)))
        health = await eng.health()
    finally:
        await eng.close()
    assert health["errors"] == 0 and len(results) > 12
    for ids, res, temperature in results:
        ref = reference_logprobs(model, ids, res.output_ids, temperature)
        assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4


async def test_an_idle_engine_hands_its_kv_memory_back(tiny):
    """`release_cache` frees the buffers when nothing runs (a sync trainer's step comes next) and is
    a no-op under a running request, which finishes exactly as it would have."""
    path, _, tokenizer = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    eng = TorchEngine(model, tokenizer)
    ids = prompt(30, seed=15)
    try:
        first = await eng.generate(ids, greedy(20))
        assert (await eng.health())["kv_capacity"] > 0
        assert await eng.release_cache() is True
        assert (await eng.health())["kv_capacity"] == 0
        task = asyncio.create_task(eng.generate(ids, greedy(400)))
        while (await eng.health())["generated_tokens"] < len(first.output_ids) + 5:
            await asyncio.sleep(0.002)
        assert await eng.release_cache() is False  # under a running request: kept
        again = await task
        assert len(again.output_ids) > 5 and again.output_ids == await solo(tiny, ids, greedy(400))
        health = await eng.health()
        assert health["kv_capacity"] > 0 and health["errors"] == 0
    finally:
        await eng.close()
