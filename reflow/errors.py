"""How the `reflow` command fails: one line on stderr, `reflow: error: ...`, and an exit code; no traceback.

Commands raise; `report` (called by `reflow.cli.main`, and by `python -m reflow.server.cli`) is the one
place that turns an exception into the line and the code:

- exit 2, a usage error: the command line or the config must change. `UsageError`, and
  `ConfigError` (a bad config file, override or run folder) are these; so are the argument errors
  `Parser` reports.
- exit 1, a runtime failure: the command was right, the work failed (a port in use, a failed build).
  `CommandError`, and any other exception: its type and message, and the traceback only when
  $REFLOW_TRACEBACK is set (a bug report wants it; a user reading an error does not).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

TRACEBACK_ENV_VAR = "REFLOW_TRACEBACK"


class CommandError(Exception):
    """A command that was given right but could not do its work (exit code 1)."""

    exit_code = 1


class UsageError(CommandError):
    """A command given wrong: a bad argument, a missing file it names, a bad token (exit code 2)."""

    exit_code = 2


class ConfigError(ValueError):
    """A configuration problem (`reflow.config`, the simulator's scenarios), with every offending key in
    the message (exit code 2)."""


def one_line(message: str) -> str:
    """`message` on one line: a multi-line one (a config error lists a key a line) joined with '; '."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return "failed"
    return lines[0] + (" " + "; ".join(lines[1:]) if len(lines) > 1 else "")


def error_line(message: str) -> None:
    sys.stderr.write(f"reflow: error: {one_line(message)}\n")
    sys.stderr.flush()


def report(e: BaseException) -> int:
    """Print `e` as the one error line and return the exit code it calls for."""
    if isinstance(e, KeyboardInterrupt):
        sys.stderr.write("reflow: interrupted\n")
        return 130
    if isinstance(e, ConfigError):
        error_line(str(e))
        return 2
    if isinstance(e, CommandError):
        error_line(str(e))
        return e.exit_code
    if os.environ.get(TRACEBACK_ENV_VAR):
        traceback.print_exception(e)
    error_line(
        f"{type(e).__name__}: {e}"
        + ("" if os.environ.get(TRACEBACK_ENV_VAR) else f" (set {TRACEBACK_ENV_VAR}=1 to see where)")
    )
    return 1


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one line and exit code 2 (not the usage block; --help has it).
    Subcommand parsers are made of the same class, so every `reflow ...` command gets it."""

    def error(self, message: str) -> NoReturn:
        error_line(f"{message} (see '{self.prog} --help')")
        self.exit(2)
