"""Task files: load and write tasks as JSONL (one JSON object per line, each with an "id")."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Task = dict[str, Any]
"""One task: a JSON-serialisable dict with at least an "id". Hidden fields (answers, tests) stay in it."""


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file; a bad line is reported with its line number."""
    tasks: list[Task] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(task, dict) or "id" not in task:
                raise ValueError(f'{path}:{lineno}: each line must be a JSON object with an "id"')
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def write_tasks(path: str | Path, tasks: Iterable[Task]) -> int:
    """Write tasks as JSONL; returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task, sort_keys=True) + "\n")
            n += 1
    return n
