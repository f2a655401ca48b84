"""Which rows `reflow bench modes` runs: the modes, the ablations (`--ablations`: one part switched on
or off each), the rows of one's own (`--rows NAME=KEY=VALUE[,KEY=VALUE...]`) and a selection of them
(`--only`). A row is (name, mode, config overrides)."""

from __future__ import annotations

import re

from reflow.errors import UsageError

MODES = ("sync", "async", "reflow")
PLAIN = ["elastic.enabled=null", "tail.enabled=null"]
"""Overrides of the sync and async rows (and the sync pilot): the mode as it is, the elastic pool and
tail scheduler at their defaults (off outside reflow), whatever the config file switches on."""
ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "sync-tail": ("sync", ["elastic.enabled=null", "tail.enabled=true"]),
    "reflow-static": ("reflow", ["elastic.enabled=false", "tail.enabled=false"]),
    "reflow-no-tail": ("reflow", ["tail.enabled=false"]),
    "reflow-lend": ("reflow", ["elastic.lend=true"]),
}
"""Rows with one part switched on or off: row name -> (mode, config overrides)."""
ROWS = (*MODES, *ABLATIONS)
"""Every built-in row, in the table's order."""
PILOT = "pilot"
"""The row name of the sync pilot run that fixes the targets (never a measured row)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")


def variants(
    ablations: bool, rows: list[tuple[str, str, list[str]]] | None = None
) -> list[tuple[str, str, list[str]]]:
    """(row name, mode, overrides) of each run per seed: the built-in rows, then `rows` (`parse_rows`)."""
    out = [(mode, mode, [] if mode == "reflow" else PLAIN) for mode in MODES]
    if ablations:
        out += [(name, mode, extra) for name, (mode, extra) in ABLATIONS.items()]
    return out + list(rows or [])


def parse_rows(items: list[str]) -> list[tuple[str, str, list[str]]]:
    """`--rows` items, each NAME=KEY=VALUE[,KEY=VALUE...], as (name, mode, overrides); UsageError
    naming the item when one is malformed, names a built-in row or repeats a name."""
    out: list[tuple[str, str, list[str]]] = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not _NAME.fullmatch(name) or not sep or not _KEY.match(rest):
            raise UsageError(
                f"--rows {item!r}: expected NAME=KEY=VALUE[,KEY=VALUE...] (a name of letters, digits, "
                "'.', '_', '-'; overrides for every row go before --rows)"
            )
        if name in ROWS or name == PILOT or name in [n for n, _, _ in out]:
            raise UsageError(f"--rows {item!r}: the row name {name!r} is taken")
        overrides: list[str] = []
        for piece in rest.split(","):
            if _KEY.match(piece) or not overrides:
                overrides.append(piece)
            else:  # a comma inside a value
                overrides[-1] += "," + piece
        modes = [o.partition("=")[2] for o in overrides if o.startswith("mode=")]
        mode = modes[-1] if modes else "reflow"
        if mode not in MODES:
            raise UsageError(f"--rows {item!r}: mode {mode!r} is not one of {', '.join(MODES)}")
        rest_overrides = [o for o in overrides if not o.startswith("mode=")]
        out.append((name, mode, [*PLAIN, *rest_overrides] if mode != "reflow" else rest_overrides))
    return out


def select_rows(rows: list[tuple[str, str, list[str]]], only: list[str]) -> list[tuple[str, str, list[str]]]:
    """The rows named in `only` (`--only`; empty: all), in the table's order; UsageError naming a row
    that is not among them."""
    if not only:
        return rows
    names = [name for name, _, _ in rows]
    unknown = [name for name in only if name not in names]
    if unknown:
        hint = "; overrides for every row go before --only" if any("=" in n for n in unknown) else ""
        raise UsageError(
            f"--only {' '.join(unknown)}: not a row of this command (rows: {', '.join(names)}){hint}"
        )
    return [row for row in rows if row[0] in only]
