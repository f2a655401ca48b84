"""`reflow replay inspect RUN` and `reflow replay export RUN`: read a run's replay store.

RUN is a run directory holding `replay.sqlite`, a path to the .sqlite file itself, or a run name looked
up as `./runs/<RUN>/replay.sqlite`. A file holds one run's groups as a rule; when it holds several,
`--run-name` picks one (a name equal to RUN is picked by itself). `reflow/cli.py` registers the group
with `add_parser(sub)`; everything else lives here.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

from reflow.errors import CommandError, UsageError

STORE_FILE = "replay.sqlite"


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 150)


class RunNotFound(UsageError):
    """RUN names no replay store, or not one run of it (`reflow.cli.main` reports it, exit code 2)."""


def resolve_store(run: str) -> Path:
    """The .sqlite file RUN names (see the module docstring)."""
    path = Path(run)
    for candidate in (path, path / STORE_FILE, Path("runs") / run / STORE_FILE):
        if candidate.is_file():
            return candidate
    raise RunNotFound(f"no replay store at {run} (a run directory, a .sqlite file or a name under ./runs/)")


def _run_names(path: Path) -> list[str]:
    # A plain read, so that a file that is not a replay store is never given the replay schema.
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        try:
            return [r[0] for r in db.execute("SELECT DISTINCT run FROM groups ORDER BY run")]
        except sqlite3.DatabaseError as e:
            raise RunNotFound(f"{path} is not a replay store ({e})") from None


def open_store(run: str, run_name: str | None) -> Any:
    from reflow.replay.store import ReplayStore

    path = resolve_store(run)
    names = _run_names(path)
    if run_name is None:
        guess = Path(run).name if Path(run).name != STORE_FILE else path.parent.name
        if len(names) == 1:
            run_name = names[0]
        elif guess in names:
            run_name = guess
        elif names:
            raise RunNotFound(f"{path} holds runs {', '.join(names)}: pick one with --run-name")
        else:
            run_name = "default"
    elif names and run_name not in names:
        raise RunNotFound(f"{path} has no run {run_name!r} (it holds {', '.join(names)})")
    return ReplayStore(path, run=run_name)


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def print_stats(stats: dict[str, Any]) -> None:
    from rich.table import Table

    console = _console()
    s = stats
    summary = Table(title=f"replay store {s['path']} (run {s['run']})", show_header=False)
    summary.add_column("figure")
    summary.add_column("value")
    tokens = s["generated_tokens_per_episode"]
    rows = [
        ("groups", f"{s['groups']} ({s['groups_consumed']} consumed, {s['groups_unconsumed']} fresh)"),
        (
            "zero-spread groups",
            f"{s['groups_zero_spread']} ({s['groups_zero_spread'] / max(1, s['groups']):.1%})",
        ),
        ("in flight", str(s["in_flight"])),
        ("episodes", str(s["episodes"])),
        ("policy versions", "-".join(map(str, s["policy_versions"])) or "-"),
        ("reward mean", f"{s['reward_mean']:.3f}"),
        ("success rate", f"{s['success_rate']:.1%}"),
        ("statuses", _statuses(s["statuses"])),
        ("turns p50 / p90 / max", f"{s['turns_p50']:g} / {s['turns_p90']:g} / {s['turns_max']}"),
        (
            "generated tokens",
            f"{s['generated_tokens']} (per episode p50 {tokens['p50']:g}, max {tokens['max']})",
        ),
        ("consumptions", str(s["consumptions"])),
        ("stored from / to", f"{_when(s['oldest_created_at'])} / {_when(s['newest_created_at'])}"),
    ]
    for row in rows:
        summary.add_row(*row)
    console.print(summary)

    by_version = Table(title="by policy version")
    for col in (
        "version",
        "groups",
        "episodes",
        "reward",
        "success",
        "turns p50",
        "turns max",
        "tokens",
        "statuses",
    ):
        by_version.add_column(col)
    for v in s["by_version"]:
        by_version.add_row(
            str(v["policy_version"]),
            str(v["groups"]),
            str(v["episodes"]),
            f"{v['reward_mean']:.3f}",
            f"{v['success_rate']:.1%}",
            f"{v['turns_p50']:g}",
            str(v["turns_max"]),
            str(v["generated_tokens"]),
            _statuses(v["statuses"]),
        )
    console.print(by_version)

    reuse = Table(title="reuse")
    reuse.add_column("times consumed")
    reuse.add_column("groups")
    for times, n in s["reuse_histogram"].items():
        reuse.add_row(str(times), str(n))
    console.print(reuse)


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args.run, args.run_name)
    with store:
        stats = store.stats()
    if args.json:
        print(json.dumps(stats))
    else:
        print_stats(stats)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    console = _console()
    store = open_store(args.run, args.run_name)
    out = Path(args.out) if args.out else store.path.parent / f"replay-{store.run}.{args.format}"
    with store:
        try:
            path = store.export(out, args.format)
        except RuntimeError as e:  # no pyarrow
            raise CommandError(str(e)) from None
        n = store.stats()["episodes"]
    console.print(f"exported {n} episodes of run {store.run} to {path}")
    return 0


def add_parser(sub: Any) -> None:
    """Register `reflow replay inspect | export` on the top-level subparsers."""
    replay = sub.add_parser("replay", help="inspect and export a run's replay store")
    replay_sub = replay.add_subparsers(dest="replay_command", required=True)
    run_help = "a run directory, its replay.sqlite, or a run name under ./runs/"

    p = replay_sub.add_parser("inspect", help="counts, reward by version, statuses, lengths, reuse")
    p.add_argument("run", metavar="RUN", help=run_help)
    p.add_argument("--run-name", help="which run, when the file holds several")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(fn=cmd_inspect)

    p = replay_sub.add_parser("export", help="one row per episode, to Parquet or JSONL")
    p.add_argument("run", metavar="RUN", help=run_help)
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument("--out", help="output file (default: replay-<run>.<format> beside the store)")
    p.add_argument("--run-name", help="which run, when the file holds several")
    p.set_defaults(fn=cmd_export)
