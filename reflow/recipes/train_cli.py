"""`reflow agent-train` on the command line: config file, overrides, `--resume`. The loop itself is
`reflow.recipes.agent_train.train` (imported only when the command runs: it needs Ray and torch)."""

from __future__ import annotations

import argparse
import shutil
import signal
from pathlib import Path

from reflow.config import load_config
from reflow.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent-train", help="warm-start then RL-train an agent on an env (Ray)")
    p.add_argument("--config", help="a YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.lr=3e-4")
    p.add_argument("--resume", metavar="RUN", help="a run folder (or a name under runs/) to continue")
    p.add_argument(
        "--overwrite", action="store_true", help="delete an existing run folder of the same name first"
    )
    p.set_defaults(fn=cmd_agent_train)


def resolve_run(run: str) -> Path:
    path = Path(run)
    if (path / "config.yaml").is_file():
        return path
    if (Path("runs") / run / "config.yaml").is_file():
        return Path("runs") / run
    raise ConfigError(f"no run to resume at {run!r} (expected a folder with config.yaml)")


def cmd_agent_train(args: argparse.Namespace) -> int:
    from reflow.console import console

    # A ConfigError here is reported by `reflow.cli.main` as one line with exit code 2.
    if args.resume:
        run_dir = resolve_run(args.resume)
        config = load_config(run_dir / "config.yaml", args.overrides)
        config.out_dir, config.run_name = str(run_dir.parent), run_dir.name
    else:
        config = load_config(args.config, args.overrides)  # no file: overrides alone (env.id=...)
        if config.run_dir.exists() and any(config.run_dir.iterdir()):
            if not args.overwrite:
                raise ConfigError(
                    f"run folder {config.run_dir} exists: continue it with --resume {config.run_dir}, "
                    "start over with --overwrite, or pick another run_name=..."
                )
            shutil.rmtree(config.run_dir)
    if config.log.wandb is not None:  # a missing package is a one-line error now, not after Ray starts
        from reflow.wandb_sink import import_wandb

        import_wandb()
    from reflow.sandbox.env_backend import host_code_warning

    host_code = host_code_warning(config.env.id, config.env.kwargs)
    if host_code:  # the run goes on (the operator of a local run is its user), but never silently
        console.print(host_code, style="yellow", markup=False, highlight=False, soft_wrap=True)
    from reflow.recipes.agent_train import train
    from reflow.runtime.cluster import start_ray

    # A SIGTERM (a scheduler, `kill`) stops the run as Ctrl-C does, through the same cleanup (the
    # workers' sandboxes removed), instead of ending the driver where it stands. After Ray starts:
    # ray.init installs a SIGTERM handler of its own, which aborts.
    start_ray(config)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        train(config, resume=bool(args.resume), console=console)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
