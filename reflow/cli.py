"""The `reflow` command line: `reflow envs list | check | play`, `reflow rollout`, `reflow eval`, `reflow
export`, `reflow warmstart`, `reflow agent-train` and the commands the subsystems add."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.table import Table

from reflow.console import console
from reflow.env import env_ids, make, play_episode, scripted_policy
from reflow.env.checker import check_env
from reflow.env.play import EpisodeResult, Policy, episode_stats, has_demo
from reflow.env.registration import discovery_errors, spec_kwargs
from reflow.errors import Parser, UsageError, report

# Piped output (CI logs, files) gets a fixed wide layout instead of the 80-column default.


def cmd_envs_list(args: argparse.Namespace) -> int:
    table = Table(title="Registered ReFlow environments")
    for col in ("id", "entry point", "max turns", "deadline s", "tools"):
        table.add_column(col)
    for env_id in env_ids():
        spec = spec_kwargs(env_id)
        env = make(env_id)
        tools = ", ".join(t.name for t in env.unwrapped.tools) or "-"
        asyncio.run(env.close())
        table.add_row(env_id, spec["env_entry_point"], str(spec["max_turns"]), str(spec["deadline_s"]), tools)
    console.print(table)
    for err in discovery_errors:
        console.print(f"[red]plugin failed to load:[/red] {err.entry_point}: {err.error}")
    return 0


def local_env_ids() -> list[str]:
    """What `--all` plays: every registered env but clients of an env server (reflow/Remote-v0) and the
    adapters to other ecosystems' envs (reflow/OpenEnv-v0, reflow/Verifiers-v0): they need a target."""
    proxies = ("reflow.server.", "reflow.interop.")
    return [e for e in env_ids() if not spec_kwargs(e)["env_entry_point"].startswith(proxies)]


def cmd_envs_check(args: argparse.Namespace) -> int:
    ids = local_env_ids() if args.all else args.env_ids
    if not ids:
        raise UsageError("give env ids or --all")
    failed = 0
    for env_id in ids:
        checks = asyncio.run(check_env(env_id, seed=args.seed))
        table = Table(title=f"reflow envs check {env_id}")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail", overflow="fold")
        for c in checks:
            table.add_row(c.name, "[green]pass[/green]" if c.passed else "[red]FAIL[/red]", c.detail)
        console.print(table)
        failed += sum(not c.passed for c in checks)
    console.print(
        "[green]all checks passed[/green]" if not failed else f"[red]{failed} check(s) failed[/red]"
    )
    return 1 if failed else 0


def stdin_policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """A person plays the agent: print what is new, read one line ("\\n" for a newline)."""
    for m in messages[stdin_policy.shown :]:
        console.print(f"[bold]{m['role']}[/bold]: {m.get('content', '')}")
        for call in m.get("tool_calls", []):
            console.print(f"  -> {call['function']['name']}({call['function']['arguments']})")
    stdin_policy.shown = len(messages)
    if tools and len(messages) <= 2:
        names = ", ".join(t["function"]["name"] for t in tools)
        console.print(
            f'[dim]tools: {names}; call one as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>[/dim]'
        )
    line = sys.stdin.readline()
    if not line:
        raise EOFError("stdin closed")
    return line.rstrip("\n").replace("\\n", "\n")


stdin_policy.shown = 0


def summarize(env_id: str, results: list[EpisodeResult]) -> dict[str, Any]:
    stats = episode_stats(
        [r.success for r in results],
        [r.reward for r in results],
        [r.turns for r in results],
        [r.status for r in results],
    )
    return {"env_id": env_id, **stats, "seconds": float(sum(r.seconds for r in results))}


async def _play(
    env_id: str, policy_name: str, episodes: int, error_rate: float, seed: int
) -> list[EpisodeResult]:
    env = make(env_id)
    if policy_name == "scripted" and not has_demo(env):
        raise UsageError(f"{env_id} has no scripted policy; use --policy stdin")
    results = []
    try:
        for i in range(episodes):
            stdin_policy.shown = 0
            policy: Policy = (
                scripted_policy(env, error_rate, seed + i) if policy_name == "scripted" else stdin_policy
            )
            result = await play_episode(env, policy, seed=seed + i)
            if policy_name == "stdin":
                console.print(f"[bold]episode {i}: {result.status}, reward {result.reward}[/bold]")
            results.append(result)
    finally:
        await env.close()
    return results


def cmd_envs_play(args: argparse.Namespace) -> int:
    ids = local_env_ids() if args.all else args.env_ids
    if not ids:
        raise UsageError("give env ids or --all")
    table = Table(
        title=f"{args.policy} policy, error rate {args.error_rate}, {args.episodes} episodes per env"
    )
    cols = ("env", "success", "reward", "turns p50", "turns p90", "turns max", "statuses", "s/episode")
    for col in cols:
        table.add_column(col)
    summaries = []
    for env_id in ids:
        results = asyncio.run(_play(env_id, args.policy, args.episodes, args.error_rate, args.seed))
        s = summarize(env_id, results)
        summaries.append(s)
        table.add_row(
            env_id,
            f"{s['success_rate']:.1%}",
            f"{s['reward_mean']:.3f}",
            f"{s['turns_p50']:g}",
            f"{s['turns_p90']:g}",
            str(s["turns_max"]),
            ", ".join(f"{k}={v}" for k, v in sorted(s["statuses"].items())),
            f"{s['seconds'] / max(1, s['episodes']):.3f}",
        )
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                for r in results:
                    f.write(json.dumps(r.to_dict(), default=str) + "\n")
    console.print(table)
    if args.json:
        print(json.dumps(summaries))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="reflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    envs = sub.add_parser("envs", help="list, check and play registered environments")
    envs_sub = envs.add_subparsers(dest="envs_command", required=True)
    p = envs_sub.add_parser("list", help="list registered envs")
    p.set_defaults(fn=cmd_envs_list)

    p = envs_sub.add_parser("check", help="run the env checker")
    p.add_argument("env_ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="check every registered env")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_envs_check)

    p = envs_sub.add_parser("play", help="play episodes with a scripted policy or from stdin")
    p.add_argument("env_ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="play every registered env")
    p.add_argument("--policy", choices=["scripted", "stdin"], default="scripted")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--error-rate", type=float, default=0.0, help="slip probability of the scripted policy")
    p.add_argument("--seed", type=int, default=0, help="episode i uses seed + i")
    p.add_argument("--out", help="append every episode record to this JSONL file")
    p.add_argument("--json", action="store_true", help="also print the summaries as one JSON line")
    p.set_defaults(fn=cmd_envs_play)

    from reflow.recipes import bench_modes, model_cli, rollout_cli, train_cli, warmstart

    rollout_cli.add_parser(sub)
    model_cli.add_parsers(sub)  # `reflow eval`, `reflow export`
    warmstart.add_parser(sub)
    train_cli.add_parser(sub)
    bench_modes.add_parser(sub)

    from reflow.sandbox.cli import add_sandbox_commands  # `reflow sandbox ...`

    add_sandbox_commands(sub)
    from reflow.replay.cli import add_parser as add_replay_commands  # `reflow replay ...`

    add_replay_commands(sub)
    from reflow.server import cli as server_cli  # `reflow serve-envs`

    server_cli.add_parser(sub)
    from reflow.sim import cli as sim_cli  # `reflow simulate`; imports the simulator lazily

    sim_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse stops collecting positionals at the first option: `KEY=VALUE --resume R KEY=VALUE`
        # leaves the later overrides here. Commands with overrides take them; anything else is an error.
        if hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except (Exception, KeyboardInterrupt) as e:  # one line and an exit code (reflow.errors), no traceback
        if isinstance(e, KeyError) and isinstance(e.args[0] if e.args else None, str) and " " in e.args[0]:
            e = UsageError(e.args[0])  # the registries' lookups say "no ReFlow env registered as ..."
        return report(e)


if __name__ == "__main__":
    sys.exit(main())
