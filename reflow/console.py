"""The one rich console the command-line tools print to (tables, progress lines, one-line errors).

Recipes and CLI modules import it from here, never from `reflow.cli` (which imports them).
"""

from __future__ import annotations

import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 150)
