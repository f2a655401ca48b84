"""Folders written whole: a reader (a resumed run, an engine, another process) sees the old folder or
the new one, never half of either.

    tmp = staging_dir(dest)          # an empty sibling of dest, a name no other writer uses
    ...write files into tmp...
    publish_dir(tmp, dest)           # dest is now tmp's content; what was at dest is removed

Checkpoints, warm starts, engine weights and exports are written this way.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def staging_dir(dest: Path) -> Path:
    """A new empty folder beside `dest` (same file system, so publishing is a rename), named for it
    and unique: two processes writing the same `dest` (two runs building one cached warm start) never
    write into one folder. A writer killed before publishing leaves it behind, hidden (a dot name)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))


def publish_dir(tmp: Path, dest: Path) -> Path:
    """Put the finished folder `tmp` at `dest`, replacing whatever is there. The old folder is renamed
    aside first and removed after, so `dest` is absent only between two renames, not for the time it
    takes to delete many files (a kill then would leave neither the old checkpoint nor the new)."""
    old = None
    if dest.is_dir() and not dest.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
        dest.rename(old / dest.name)
    elif dest.exists() or dest.is_symlink():
        dest.unlink()
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest
