"""Verifiable final answers: pull `\\boxed{...}` out of a reply and compare numbers."""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def parse_number(text: str | None) -> float | None:
    """A number written plainly ("1,234", "-3.5", "$12"), or None."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    return float(cleaned) if _NUMBER.match(cleaned) else None


def numbers_equal(a: float | None, b: float | None, rel_tol: float = 1e-6) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)


def format_number(x: float) -> str:
    """Integers without a trailing .0; other values to at most 6 decimals."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")
