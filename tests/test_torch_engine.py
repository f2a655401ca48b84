"""TorchEngine: logprobs, greedy equivalence, continuous batching, stops, seeds, weight updates.

Prefix reuse (multi-turn, GRPO groups) and a randomized mixed workload: test_torch_engine_reuse.py."""

from __future__ import annotations

import asyncio
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_helpers import build_tiny_engine_model, greedy, prompt, reference_logprobs, solo  # noqa: E402

from reflow.engine import Engine, EngineError, SamplingParams  # noqa: E402
from reflow.engine.torch_engine import TorchEngine  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_engine_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
async def engine(tiny):
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=8)
    yield eng
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
    decoder = engine._decoder  # the worker loop the engine holds: its model step is what fails here
    real = decoder._forward

    def broken(*args, **kwargs):
        decoder._forward = real
        raise RuntimeError("boom")

    decoder._forward = broken
    with pytest.raises(EngineError, match="boom"):
        await engine.generate(prompt(5, 1), greedy(3))
    assert len((await engine.generate(prompt(5, 1), greedy(3))).output_ids) == 3
    assert (await engine.health())["errors"] == 1


async def test_counters_tell_decode_steps_from_prefill_and_name_the_engine(tiny):
    """`counters()`, what a run's summary reads of an engine: two requests of 6 new tokens each (no
    EOS) give 12 generated tokens, of which each request's first comes from its prefill and the other
    5 from decode steps (10 decode tokens, at most two a step); the 2 x 20 prompt tokens are computed
    in prefill; the engine's start (`started_at`) stays the same across readings and its uptime grows."""
    _, model, tokenizer = tiny
    eng = TorchEngine(model, tokenizer, max_batch_size=8, eos_token_ids=[])
    try:
        first = eng.counters()
        await asyncio.gather(*(eng.generate(prompt(20, seed=i), greedy(6)) for i in range(2)))
        after = eng.counters()
    finally:
        await eng.close()
    grew = {k: after[k] - first[k] for k in after}
    assert grew["generated_tokens"] == 12 and grew["decode_tokens"] == 10
    assert 5 <= grew["steps"] <= 10
    assert grew["prefill_tokens"] + grew["prefix_hit_tokens"] == 40
    assert grew["decode_s"] > 0 and grew["prefill_s"] > 0
    assert grew["started_at"] == 0 and grew["uptime_s"] > 0
