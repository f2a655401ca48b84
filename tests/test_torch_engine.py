"""TorchEngine: logprobs, greedy equivalence, continuous batching, stops, seeds, weight updates."""

from __future__ import annotations

import asyncio
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reflow.engine import Engine, EngineError, SamplingParams  # noqa: E402
from reflow.engine.torch_engine import TorchEngine  # noqa: E402
from reflow.models import build_tiny  # noqa: E402

# A larger init than the preset's 0.02: with tied embeddings a small random model just repeats its input
# token, and a constant output would hide position or cache mix-ups; this one writes varied,
# context-dependent text.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "initializer_range": 0.2,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), **SMALL)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, model, tokenizer


@pytest.fixture
async def engine(tiny):
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=8)
    yield eng
    await eng.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(n)]  # ordinary (non-special) ids


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def reference_logprobs(model, ids: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one full forward pass over prompt+output."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    logp = (logits / (temperature or 1.0)).log_softmax(-1)
    return logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


async def solo(tiny, ids: list[int], params: SamplingParams) -> list[int]:
    """The same request through a fresh engine that serves nothing else."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=1)
    try:
        return (await eng.generate(ids, params)).output_ids
    finally:
        await eng.close()


async def test_implements_the_engine_protocol(engine):
    assert isinstance(engine, Engine)
    health = await engine.health()
    assert health["ok"] and health["weight_version"] == 0 and health["running"] == 0


@pytest.mark.parametrize(
    "params",
    [
        greedy(24),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=50, seed=3),
        SamplingParams(max_new_tokens=24, temperature=1.6, seed=4),
    ],
    ids=["greedy", "T0.7-top_p-top_k", "T1.6"],
)
async def test_logprobs_match_a_full_forward_pass(engine, tiny, params):
    _, model, _ = tiny
    prompts = [prompt(n, seed=n) for n in (3, 17, 40, 64)]  # different lengths share the batch
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for ids, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == len(res.logprobs) > 0 and res.prompt_tokens == len(ids)
        ref = reference_logprobs(model, ids, res.output_ids, params.temperature)
        assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4


async def test_greedy_equals_model_generate(engine, tiny):
    _, model, _ = tiny
    ids = prompt(21, seed=1)
    res = await engine.generate(ids, greedy(30))
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids) :].tolist()
    eos = set(model.generation_config.eos_token_id)
    cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))  # generate pads after EOS
    assert res.output_ids == ref[:cut]
    assert res.finish_reason == ("stop" if cut < 30 or ref[-1] in eos else "length")


async def test_a_request_joins_a_running_batch_and_matches_running_alone(engine, tiny):
    long_ids, short_ids = prompt(30, seed=2), prompt(9, seed=3)
    long_task = asyncio.create_task(engine.generate(long_ids, greedy(120), request_id="long"))
    while (await engine.health())["steps"] < 10:  # the long request is decoding
        await asyncio.sleep(0.005)
    short = await engine.generate(short_ids, greedy(12), request_id="short")
    assert not long_task.done()  # it joined the running batch instead of waiting for it to drain
    long = await long_task
    assert short.output_ids == await solo(tiny, short_ids, greedy(12))
    assert long.output_ids == await solo(tiny, long_ids, greedy(120))
    assert short.meta["request_id"] == "short"


async def test_concurrent_requests_of_different_lengths_reuse_rows(tiny):
    """12 requests on 3 rows: rows are freed, reused and compacted, and every result equals the request
    run alone."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=3)
    rng = random.Random(0)
    reqs = [(prompt(rng.randint(1, 200), seed=i), greedy(rng.randint(1, 90))) for i in range(12)]
    try:
        results = await asyncio.gather(*(eng.generate(ids, p) for ids, p in reqs))
    finally:
        await eng.close()
    for (ids, params), res in zip(reqs, results, strict=True):
        assert res.output_ids == await solo(tiny, ids, params)


async def test_cache_growth_keeps_sequences_exact(tiny):
    """Running sequences survive the cache being copied into bigger buffers: when the right edge is
    reached, and when a joining prompt is longer than the window (room is made on the left)."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=2, kv_headroom=16)  # grow in small steps
    first_ids, joining_ids = prompt(5, seed=8), prompt(300, seed=9)
    try:
        first = asyncio.create_task(eng.generate(first_ids, greedy(200)))
        while (await eng.health())["steps"] < 10:
            await asyncio.sleep(0.002)
        joining = await eng.generate(joining_ids, greedy(20))
        assert not first.done()
        result = await first
        assert (await eng.health())["kv_rebases"] >= 3  # first allocation, right edge, left room
    finally:
        await eng.close()
    assert result.output_ids == await solo(tiny, first_ids, greedy(200))
    assert joining.output_ids == await solo(tiny, joining_ids, greedy(20))


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
        with eng._wake:  # hold the worker so that both requests join the same prefill batch
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
        with eng._wake:  # one admission batch
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


async def test_finish_reasons(engine):
    ids = prompt(12, seed=5)
    free = await engine.generate(ids, greedy(40))
    assert free.finish_reason == "length" and len(free.output_ids) == 40 and free.matched_stop is None
    # A stop id: generation ends on that token's first appearance, which is kept.
    stop_id = free.output_ids[7]
    first = free.output_ids.index(stop_id)
    res = await engine.generate(ids, greedy(40, stop_token_ids=[stop_id]))
    assert (res.finish_reason, res.matched_stop) == ("stop", stop_id)
    assert res.output_ids == free.output_ids[: first + 1]
    # A stop string ends generation at the first token after which the text (whole characters only)
    # contains it; the tokens are not cut. The oracle decodes every prefix from scratch.
    tok = engine.tokenizer
    texts = [tok.decode(free.output_ids[:j]) for j in range(41)]
    stop = next(t[-3:] for t in texts[20:] if len(t) >= 3 and "\ufffd" not in t[-3:])
    expected = next(j for j, t in enumerate(texts) if stop in t and not t.endswith("\ufffd"))
    res = await engine.generate(ids, greedy(40, stop=[stop, "never-generated-text"]))
    assert (res.finish_reason, res.matched_stop) == ("stop", stop)
    assert res.output_ids == free.output_ids[:expected]
    # EOS ids always stop: make the engine treat the 4th greedy token as an EOS.
    eos_engine = TorchEngine(engine.model, tok, eos_token_ids=[free.output_ids[3]])
    try:
        res = await eos_engine.generate(ids, greedy(40))
    finally:
        await eos_engine.close()
    assert res.finish_reason == "stop" and res.output_ids[-1] == free.output_ids[3]


async def test_abort_running_and_waiting_requests(tiny):
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=1)
    try:
        running = asyncio.create_task(eng.generate(prompt(10, 1), greedy(3000), request_id="run"))
        waiting = asyncio.create_task(eng.generate(prompt(10, 2), greedy(5), request_id="wait"))
        while (await eng.health())["steps"] < 5:
            await asyncio.sleep(0.005)
        await eng.abort("wait")
        res = await waiting
        assert res.finish_reason == "abort" and res.output_ids == []
        await eng.abort("run")
        res = await running
        assert res.finish_reason == "abort" and 5 <= len(res.output_ids) < 3000
        assert len(res.logprobs) == len(res.output_ids)
        await eng.abort("no-such-request")  # ignored
        # Cancelling the awaiting task aborts the request and frees its row.
        task = asyncio.create_task(eng.generate(prompt(10, 3), greedy(3000)))
        while (await eng.health())["running"] == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while (await eng.health())["running"]:
            await asyncio.sleep(0.005)
    finally:
        await eng.close()


async def test_sampling_follows_temperature_top_k_and_top_p(tiny):
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=64)
    ids = prompt(10, seed=11)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    try:
        for temperature in (1.0, 0.5):
            # 800 one-token draws (seeded, so the test is deterministic): the frequency of the likeliest
            # token matches its probability under softmax(logits / T) to within ~4 standard deviations.
            params = [SamplingParams(max_new_tokens=1, temperature=temperature, seed=s) for s in range(800)]
            results = await asyncio.gather(*(eng.generate(ids, p) for p in params))
            p_top, top = (logits / temperature).softmax(-1).max(-1)
            freq = sum(r.output_ids[0] == top.item() for r in results) / len(results)
            assert (
                abs(freq - p_top.item())
                < 4 * (p_top.item() * (1 - p_top.item()) / len(results)) ** 0.5 + 0.01
            )
        # top-k keeps the k likeliest tokens; a tiny top-p keeps only the best one.
        top5 = set(logits.topk(5).indices.tolist())
        params = [SamplingParams(max_new_tokens=1, temperature=2.0, top_k=5, seed=s) for s in range(200)]
        drawn = {r.output_ids[0] for r in await asyncio.gather(*(eng.generate(ids, p) for p in params))}
        assert drawn <= top5 and len(drawn) > 1
        params = [SamplingParams(max_new_tokens=1, temperature=2.0, top_p=1e-6, seed=s) for s in range(50)]
        drawn = {r.output_ids[0] for r in await asyncio.gather(*(eng.generate(ids, p) for p in params))}
        assert drawn == {int(logits.argmax())}
    finally:
        await eng.close()


async def test_seeded_sampling_is_reproducible(engine):
    ids = prompt(15, seed=6)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.95, seed=123)
    first = await engine.generate(ids, params)
    # Same seed, now sharing the batch with other (unseeded) requests: same tokens.
    others = [engine.generate(prompt(20, s), SamplingParams(max_new_tokens=30)) for s in range(3)]
    again, *_ = await asyncio.gather(engine.generate(ids, params), *others)
    assert again.output_ids == first.output_ids
    other_seed = await engine.generate(
        ids, SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.95, seed=7)
    )
    assert other_seed.output_ids != first.output_ids


async def test_update_weights_changes_outputs_and_versions(tiny, tmp_path):
    path, _, tokenizer = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # own copy: we change it
    eng = TorchEngine(model, tokenizer, max_batch_size=4)
    ids = prompt(16, seed=7)
    try:
        before = await eng.generate(ids, greedy(20))
        assert before.weight_version == 0
        gen = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
        assert await eng.update_weights(state_dict=new) == 1
        after = await eng.generate(ids, greedy(20))
        assert after.weight_version == 1 and after.output_ids != before.output_ids
        # The same weights from an HF folder on disk, with an explicit version.
        other = transformers.AutoModelForCausalLM.from_pretrained(path)
        other.load_state_dict(new)
        other.save_pretrained(tmp_path / "ckpt")
        assert await eng.update_weights(state_dict=model.state_dict() | {}, version=4) == 4  # no-op copy
        assert await eng.update_weights(path=str(tmp_path / "ckpt")) == 5
        res = await eng.generate(ids, greedy(20))
        assert res.output_ids == after.output_ids and res.weight_version == 5
        with pytest.raises(KeyError):
            await eng.update_weights(state_dict={"no.such.weight": torch.zeros(1)})
        with pytest.raises(ValueError):
            await eng.update_weights(state_dict={"lm_head.weight": torch.zeros(3, 3)})
        # An update in the middle of a request: per-token versions tell which tokens came from which.
        generated = (await eng.health())["generated_tokens"]
        task = asyncio.create_task(eng.generate(ids, greedy(400)))
        while (await eng.health())["generated_tokens"] < generated + 5:
            await asyncio.sleep(0.002)
        await eng.update_weights(state_dict=new)
        res = await task
        versions = res.meta["token_versions"]
        assert len(versions) == len(res.output_ids) and versions[0] == 5 and versions[-1] == 6
        assert versions == sorted(versions) and res.weight_version == 6
    finally:
        await eng.close()


async def test_bad_requests_and_failures(engine, tiny):
    with pytest.raises(ValueError):
        await engine.generate([], greedy(3))
    with pytest.raises(ValueError):
        await engine.generate([engine.vocab_size], greedy(3))
    with pytest.raises(ValueError):
        await engine.generate([1] * engine.max_context, greedy(3))
    _, model, _ = tiny
    no_tok = TorchEngine(model)
    with pytest.raises(ValueError, match="tokenizer"):
        await no_tok.generate([1, 2], greedy(3, stop=["x"]))
    await no_tok.close()
    with pytest.raises(EngineError):
        await no_tok.generate([1, 2], greedy(3))
    # A failing model step fails its requests with EngineError; the engine then serves the next ones.
    real = engine._forward

    def broken(*args, **kwargs):
        engine._forward = real
        raise RuntimeError("boom")

    engine._forward = broken
    with pytest.raises(EngineError, match="boom"):
        await engine.generate(prompt(5, 1), greedy(3))
    assert len((await engine.generate(prompt(5, 1), greedy(3))).output_ids) == 3
    assert (await engine.health())["errors"] == 1
