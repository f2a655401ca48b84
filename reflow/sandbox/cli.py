"""`reflow sandbox ...`: build the image, list and reap containers, check the backends, benchmark.

`reflow/cli.py` registers this group with `add_sandbox_commands(sub)`; everything else lives here.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from reflow.errors import CommandError


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 150)


def cmd_build(args: argparse.Namespace) -> int:
    from reflow.sandbox.images import BuildError, build_image

    console = _console()
    try:
        result = build_image(args.method, suite=args.suite, mirror=args.mirror, force=args.force)
    except BuildError as e:
        raise CommandError(f"sandbox build failed: {e}") from None
    verb = "cached" if result.cached else f"built with {result.method}"
    console.print(
        f"{result.image} ({verb}, recipe {result.recipe_hash}, {result.size_mb:.0f} MB, {result.seconds:.1f}s)"
    )
    if args.verbose:
        for line in result.log:
            console.print(line, markup=False, highlight=False)
    return 0


def cmd_dockerfile(args: argparse.Namespace) -> int:
    from reflow.sandbox.images import ImageRecipe

    sys.stdout.write(ImageRecipe().dockerfile())
    return 0


def _docker() -> Any:
    """The Docker client, or a CommandError that says no engine answers."""
    from reflow.sandbox.base import SandboxError
    from reflow.sandbox.docker_sandbox import shared_client

    try:
        return shared_client()
    except SandboxError as e:
        raise CommandError(f"no Docker engine to talk to: {e}") from None


def cmd_ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from reflow.sandbox.reaper import PID_LABEL, POOL_LABEL, list_sandboxes, owner_status

    table = Table(title="ReFlow sandbox containers")
    for col in ("id", "status", "owner pid", "owner", "pool", "image"):
        table.add_column(col)
    for c in list_sandboxes(_docker()):
        labels = c.labels or {}
        image = ",".join(c.image.tags) if c.image else "?"
        table.add_row(
            c.id[:12],
            c.status,
            labels.get(PID_LABEL, "?"),
            owner_status(labels),
            labels.get(POOL_LABEL, ""),
            image,
        )
    _console().print(table)
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    from reflow.sandbox.reaper import reap

    reaped = reap(
        _docker(),
        everything=args.all,
        other_hosts=args.other_hosts,
        older_than_s=args.older_than,
        dry_run=args.dry_run,
    )
    console = _console()
    for item in reaped:
        state = "would remove" if args.dry_run else ("removed" if item.removed else f"FAILED ({item.error})")
        console.print(f"{state} {item.id[:12]} (owner pid {item.owner_pid}: {item.reason})")
    console.print(f"{len(reaped)} container(s)" + (" to remove" if args.dry_run else " reaped"))
    return 1 if any(not r.removed and not args.dry_run for r in reaped) else 0


def cmd_check(args: argparse.Namespace) -> int:
    from reflow.sandbox.factory import KINDS, backend_problem, best_backend

    console = _console()
    for kind in KINDS:
        problem = backend_problem(kind)
        console.print(
            f"{kind:10} " + ("[green]available[/green]" if problem is None else f"[red]no[/red]: {problem}")
        )
    console.print(f"best available: {best_backend()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from reflow.sandbox.bench import run_benchmark

    concurrency = [int(x) for x in args.concurrency.split(",")]
    report = run_benchmark(concurrency, calls=args.calls, acquires=args.acquires, print_fn=_console().print)
    if args.json:
        print(json.dumps(report))
    return 0


def add_sandbox_commands(sub: Any) -> None:
    """Add the `sandbox` command group to the `reflow` parser's subparsers."""
    group = sub.add_parser("sandbox", help="build sandbox images, list and reap containers, benchmark")
    commands = group.add_subparsers(dest="sandbox_command", required=True)

    p = commands.add_parser("build", help="build the sandbox image (skipped when the recipe hash is cached)")
    p.add_argument("--method", choices=["auto", "dockerfile", "debootstrap"], default="auto")
    p.add_argument("--suite", help="debootstrap suite (default: this machine's release, from apt)")
    p.add_argument("--mirror", help="debootstrap mirror (default: from this machine's apt sources)")
    p.add_argument("--force", action="store_true", help="build even when a cached image exists")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(fn=cmd_build)

    p = commands.add_parser("dockerfile", help="print the Dockerfile rendered from the recipe")
    p.set_defaults(fn=cmd_dockerfile)

    p = commands.add_parser("ls", help="list sandbox containers and whether their owner lives")
    p.set_defaults(fn=cmd_ls)

    p = commands.add_parser("reap", help="remove sandbox containers whose owning process is dead")
    p.add_argument("--all", action="store_true", help="remove every ReFlow sandbox container")
    p.add_argument("--other-hosts", action="store_true", help="also those made on other hosts")
    p.add_argument("--older-than", type=float, metavar="S", help="also those older than S seconds")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(fn=cmd_reap)

    p = commands.add_parser("check", help="which sandbox backends work here")
    p.set_defaults(fn=cmd_check)

    p = commands.add_parser("bench", help="tool-call and acquire latency: tool server vs docker exec/run")
    p.add_argument("--concurrency", default="1,16", help="concurrent episodes, comma-separated")
    p.add_argument("--calls", type=int, default=200, help="tool calls per configuration")
    p.add_argument("--acquires", type=int, default=64, help="pool acquires per configuration")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.set_defaults(fn=cmd_bench)
