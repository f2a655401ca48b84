"""The PyCode task bank: problem families, each parametrised by a seeded random stream.

A family turns an `rng` into a `Problem`: the function to write, a reference solution (source), one or
two plausible wrong versions, a reference implementation in this process (`ref`, which computes the
expected values, so the source and `ref` check each other in the tests) and the test inputs, where
fixed edge cases make sure every wrong version fails at least one test.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Problem:
    name: str
    signature: str
    description: str
    solution: str
    buggy: list[str]
    ref: Callable[..., Any]
    inputs: list[list[Any]]


def _src(signature: str, body: str) -> str:
    """A function's source from its signature line and its body (lines without indentation)."""
    return signature + ":\n" + "".join(f"    {line}\n" for line in body.strip("\n").splitlines())


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng: random.Random, alphabet: str = string.ascii_lowercase, lo: int = 2, hi: int = 6) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def add_k(rng: random.Random) -> Problem:
    k = rng.randint(2, 99)
    sig = "def add_k(x: int) -> int"
    return Problem(
        "add_k",
        sig,
        f"Return x plus {k}.",
        _src(sig, f"return x + {k}"),
        [_src(sig, f"return x + {k - 1}"), _src(sig, f"return x - {k}")],
        lambda x: x + k,
        [[x] for x in [0, 1, -k, *_ints(rng, 5, -500, 500)]],
    )


def clamp(rng: random.Random) -> Problem:
    lo = rng.randint(-50, 10)
    hi = lo + rng.randint(5, 60)
    sig = "def clamp(x: int) -> int"
    return Problem(
        "clamp",
        sig,
        f"Clamp x to the closed interval [{lo}, {hi}].",
        _src(sig, f"return max({lo}, min({hi}, x))"),
        [_src(sig, f"return max({lo}, x)"), _src(sig, f"return min({hi - 1}, max({lo}, x))")],
        lambda x: max(lo, min(hi, x)),
        [[x] for x in [lo - 5, lo, hi, hi + 7, *_ints(rng, 4, lo - 30, hi + 30)]],
    )


def count_char(rng: random.Random) -> Problem:
    c = rng.choice(string.ascii_lowercase)
    sig = "def count_char(s: str) -> int"
    alphabet = c * 3 + c.upper() + "xyz "
    inputs = [[c + "ab" + c.upper()], [""], *[[_word(rng, alphabet, 0, 12)] for _ in range(5)]]
    return Problem(
        "count_char",
        sig,
        f"Return how many times the character {c!r} occurs in s (case-sensitive).",
        _src(sig, f"return s.count({c!r})"),
        [_src(sig, f"return s.lower().count({c!r})"), _src(sig, f"return s[1:].count({c!r})")],
        lambda s: s.count(c),
        inputs,
    )


def sum_above(rng: random.Random) -> Problem:
    t = rng.choice([-5, -4, -3, -2, -1, 1, 2, 3, 5, 8, 10])  # not 0: x >= 0 and x > 0 give equal sums
    sig = "def sum_above(xs: list[int]) -> int"
    inputs = [[[t, t, t + 1]], [[]], *[[_ints(rng, rng.randint(1, 8), t - 10, t + 10)] for _ in range(5)]]
    return Problem(
        "sum_above",
        sig,
        f"Return the sum of the elements of xs that are strictly greater than {t}.",
        _src(sig, f"return sum(x for x in xs if x > {t})"),
        [_src(sig, f"return sum(x for x in xs if x >= {t})")],
        lambda xs: sum(x for x in xs if x > t),
        inputs,
    )


def reverse_fields(rng: random.Random) -> Problem:
    sep = rng.choice([" ", ",", "-", "|", ";"])
    sig = "def reverse_fields(s: str) -> str"
    inputs = [[sep.join(["ab", "cd", "a"])]]
    inputs += [[sep.join(_word(rng) for _ in range(rng.randint(1, 5)))] for _ in range(5)]
    return Problem(
        "reverse_fields",
        sig,
        f"s is made of fields separated by {sep!r}. Return the fields in reverse order, joined by {sep!r}.",
        _src(sig, f"return {sep!r}.join(reversed(s.split({sep!r})))"),
        [
            _src(sig, "return s[::-1]"),
            _src(sig, f"return {sep!r}.join(sorted(s.split({sep!r}), reverse=True))"),
        ],
        lambda s: sep.join(s.split(sep)[::-1]),
        inputs,
    )


def running_extreme(rng: random.Random) -> Problem:
    kind = rng.choice(["max", "min"])
    name = f"running_{kind}"
    sig = f"def {name}(xs: list[int]) -> list[int]"
    body = f"out = []\nfor x in xs:\n    out.append(x if not out else {kind}(out[-1], x))\nreturn out"
    wrong_start = f"out, cur = [], 0\nfor x in xs:\n    cur = {kind}(cur, x)\n    out.append(cur)\nreturn out"
    edge = [-3, -5, -1] if kind == "max" else [3, 5, 1]

    def ref(xs: list[int]) -> list[int]:
        return [(max if kind == "max" else min)(xs[: i + 1]) for i in range(len(xs))]

    return Problem(
        name,
        sig,
        f"Return the list whose i-th element is the {kind}imum of xs[0], ..., xs[i].",
        _src(sig, body),
        [_src(sig, wrong_start)],
        ref,
        [[edge], [[]], *[[_ints(rng, rng.randint(1, 8))] for _ in range(5)]],
    )


def fizzbuzz(rng: random.Random) -> Problem:
    a, b = rng.sample([2, 3, 5, 7], 2)  # coprime, so a * b is the least common multiple
    sig = "def fizzbuzz(n: int) -> str"
    body = (
        f'if n % {a * b} == 0:\n    return "FizzBuzz"\nif n % {a} == 0:\n    return "Fizz"\n'
        f'if n % {b} == 0:\n    return "Buzz"\nreturn str(n)'
    )
    wrong_order = body.replace(f"n % {a * b} == 0", f"n % {a} == 0", 1)
    return Problem(
        "fizzbuzz",
        sig,
        f'Return "FizzBuzz" if n is divisible by both {a} and {b}, "Fizz" if only by {a}, '
        f'"Buzz" if only by {b}, and otherwise n as a decimal string.',
        _src(sig, body),
        [_src(sig, wrong_order), _src(sig, body.replace("return str(n)", "return n"))],
        lambda n: (
            "FizzBuzz" if n % (a * b) == 0 else "Fizz" if n % a == 0 else "Buzz" if n % b == 0 else str(n)
        ),
        [[n] for n in [a * b, a, b, 1, *_ints(rng, 4, 1, 100)]],
    )


def fib_mod(rng: random.Random) -> Problem:
    m = rng.choice([7, 10, 97, 100, 1000, 10007])
    sig = "def fib_mod(n: int) -> int"
    body = f"a, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % {m}\nreturn a"

    def ref(n: int) -> int:
        fib = [0, 1]
        while len(fib) <= n:
            fib.append(fib[-1] + fib[-2])
        return fib[n] % m

    return Problem(
        "fib_mod",
        sig,
        f"Return the n-th Fibonacci number modulo {m}, where F(0) = 0 and F(1) = 1.",
        _src(sig, body),
        [_src(sig, body.replace("return a", "return b")), _src(sig, body.replace(f" % {m}", ""))],
        ref,
        [[n] for n in [0, 1, 2, 40, *_ints(rng, 3, 3, 90)]],
    )


def is_palindrome(rng: random.Random) -> Problem:
    ignored = rng.choice([" ", " ,", " -.", " ,.!?"])
    sig = "def is_palindrome(s: str) -> bool"
    keep = f"t = [c.lower() for c in s if c not in {ignored!r}]\nreturn t == t[::-1]"
    base = [_word(rng, "abcAB", 1, 4) for _ in range(3)]
    inputs = [["Ab" + ignored[-1] + "Ba" + ignored[-1]], ["abc"], [""]]
    inputs += [[w + ignored[-1] + w[::-1].swapcase()] for w in base] + [[w + "x" + w] for w in base[:2]]
    return Problem(
        "is_palindrome",
        sig,
        f"Return True if s reads the same backwards, ignoring case and the characters {ignored!r}.",
        _src(sig, keep),
        [
            _src(sig, f"t = [c for c in s if c not in {ignored!r}]\nreturn t == t[::-1]"),
            _src(sig, "t = s.lower()\nreturn t == t[::-1]"),
        ],
        lambda s: (
            [c.lower() for c in s if c not in ignored] == [c.lower() for c in s[::-1] if c not in ignored]
        ),
        inputs,
    )


def dedupe(rng: random.Random) -> Problem:
    which = rng.choice(["first", "last"])
    sig = "def dedupe(xs: list[int]) -> list[int]"
    if which == "first":
        body = "seen, out = set(), []\nfor x in xs:\n    if x not in seen:\n        seen.add(x)\n        out.append(x)\nreturn out"
    else:
        body = "out = []\nfor i, x in enumerate(xs):\n    if x not in xs[i + 1:]:\n        out.append(x)\nreturn out"

    def ref(xs: list[int]) -> list[int]:
        keep = {x: i for i, x in (enumerate(xs) if which == "last" else reversed(list(enumerate(xs))))}
        return [x for i, x in enumerate(xs) if keep[x] == i]

    wrong_which = "list(dict.fromkeys(xs))" if which == "last" else "list(dict.fromkeys(xs[::-1]))[::-1]"
    return Problem(
        "dedupe",
        sig,
        f"Return xs without duplicates, keeping the {which} occurrence of each value, in order.",
        _src(sig, body),
        [_src(sig, "return sorted(set(xs))"), _src(sig, f"return {wrong_which}")],
        ref,
        [[[3, 1, 3, 2, 1]], [[]], *[[_ints(rng, rng.randint(2, 9), 0, 5)] for _ in range(4)]],
    )


def digit_sum(rng: random.Random) -> Problem:
    base = rng.randint(2, 10)
    sig = "def digit_sum(n: int) -> int"
    body = f"n, total = abs(n), 0\nwhile n > 0:\n    total += n % {base}\n    n //= {base}\nreturn total"
    return Problem(
        "digit_sum",
        sig,
        f"Return the sum of the digits of |n| written in base {base}.",
        _src(sig, body),
        [
            _src(sig, body.replace("abs(n)", "n")),
            _src(sig, body.replace("while n > 0", f"while n >= {base}")),
        ],
        lambda n: sum(int(d, 36) for d in _to_base(abs(n), base)),
        [[n] for n in [-base - 1, base + 1, 0, 1, *_ints(rng, 3, 2, 10**6)]],
    )


def _to_base(n: int, base: int) -> str:
    digits = ""
    while n:
        digits = string.digits[n % base] + digits
        n //= base
    return digits or "0"


def caesar(rng: random.Random) -> Problem:
    k = rng.randint(1, 25)
    sig = "def caesar(s: str) -> str"
    body = (
        "out = []\nfor c in s:\n    if c.isalpha() and c.isascii():\n        a = ord('a') if c.islower() else ord('A')\n"
        f"        c = chr((ord(c) - a + {k}) % 26 + a)\n    out.append(c)\nreturn ''.join(out)"
    )

    def ref(s: str) -> str:
        low, up = string.ascii_lowercase, string.ascii_uppercase
        return s.translate(str.maketrans(low + up, low[k:] + low[:k] + up[k:] + up[:k]))

    return Problem(
        "caesar",
        sig,
        f"Shift every ASCII letter of s forward by {k} places in the alphabet, wrapping around "
        "and keeping its case; leave other characters unchanged.",
        _src(sig, body),
        [_src(sig, body.replace(" % 26", "")), _src(sig, body.replace("ord('a') if c.islower() else ", ""))],
        ref,
        [
            ["Hello, World!"],
            ["xyz"],
            [""],
            *[[_word(rng, string.ascii_letters + " .", 1, 10)] for _ in range(4)],
        ],
    )


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    f.__name__: f
    for f in (
        add_k,
        clamp,
        count_char,
        sum_above,
        reverse_fields,
        running_extreme,
        fizzbuzz,
        fib_mod,
        is_palindrome,
        dedupe,
        digit_sum,
        caesar,
    )
}
