"""A fixed, generic text corpus built in code, for training the `tiny` preset's tokenizer offline.

It mixes what agent episodes are made of: English prose, digits and arithmetic, JSON (tool calls and
schemas), Python code, and the chat-template markup words. It is generated from a seeded RNG, so the
same text (and therefore the same tokenizer) comes out on every machine. Special tokens themselves are
left out: they are added to the vocabulary whole, so BPE merges spent on their pieces would be wasted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

_WORDS_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had
by not word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who
may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true during
hundred five remember step early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry
dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane stead dry
wonder laugh thousand ago ran check game shape equal hot miss brought heat snow tire bring yes distant
fill east paint language among result value compute calculate function tool call argument return error
message user assistant response reasoning expression answer guess higher lower secret range integer sum
product difference total step solve
"""
WORDS = _WORDS_TEXT.split()

_PY_KEYWORDS_TEXT = """
False None True and as assert async await break class continue def del elif else except finally for from
global if import in is lambda nonlocal not or pass raise return try while with yield print len range int
str float list dict set tuple sorted enumerate zip map filter sum min max abs self
"""
PY_KEYWORDS = _PY_KEYWORDS_TEXT.split()

PUNCT = list(".,;:!?-'\"()[]{}<>/\\|@#$%^&*_+=~`")
TOOL_NAMES = [
    "calculator",
    "run_python",
    "guess",
    "search",
    "read_file",
    "write_file",
    "shell",
    "get_weather",
]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 16))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
    if rng.random() < 0.2:
        i = rng.randrange(len(words))
        words[i] = words[i] + ","
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":"])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op = rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 4)}[op]
    form = rng.choice(["{a} {op} {b} = {v}", "{a}{op}{b}={v}", "({a} {op} {b})", "\\boxed{{{v}}}", "{v}"])
    return form.format(a=a, op=op, b=b, v=value)


def _json_blob(rng: random.Random) -> str:
    name = rng.choice(TOOL_NAMES)
    if rng.random() < 0.5:
        args = {rng.choice(["expression", "code", "n", "query", "path", "x"]): _arithmetic(rng)}
        return json.dumps({"name": name, "arguments": args})
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": _sentence(rng),
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": rng.choice(["string", "integer", "number", "boolean"])}},
                "required": ["x"],
            },
        },
    }
    return json.dumps(schema)


def _python(rng: random.Random) -> str:
    name = rng.choice(WORDS)
    arg = rng.choice(WORDS)
    body = [
        f"def {name}_{rng.randint(0, 9)}({arg}, n={rng.randint(0, 99)}):",
        f"    for i in range(len({arg})):",
        f"        if {arg}[i] {rng.choice(['==', '!=', '<', '>=', 'in'])} n:",
        f"            return {arg}[i] {rng.choice('+-*%')} {rng.randint(1, 9)}",
        f"    {rng.choice(PY_KEYWORDS)} {rng.choice(PY_KEYWORDS)}",
        "    return None",
    ]
    return "\n".join(body[: rng.randint(2, len(body))])


def _chat(rng: random.Random) -> str:
    # The template's words between the (excluded) special tokens.
    parts = []
    for role in ["system", "user", "assistant", "user", "assistant"]:
        parts.append(f"{role}\n{_sentence(rng)}")
    parts.append("assistant\n\n" + _json_blob(rng) + "\n\n")
    parts.append("user\n\n" + _arithmetic(rng) + "\n\n")
    parts.append("# Tools\n\nYou may call one or more functions to assist with the user query.")
    return "\n".join(parts)


def generic_corpus(n_docs: int = 4000, seed: int = 0) -> Iterator[str]:
    """Yield `n_docs` short documents of mixed text; the same ones for the same `seed`."""
    rng = random.Random(seed)
    makers = [_sentence, _sentence, _sentence, _arithmetic, _json_blob, _python, _chat]
    for _ in range(n_docs):
        doc = [rng.choice(makers)(rng) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.1:
            doc.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 8))))
        yield rng.choice(["\n", " ", "\n\n"]).join(doc)
