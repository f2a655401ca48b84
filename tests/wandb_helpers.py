"""W&B's offline mode for tests (every W&B folder inside the test's tmp_path, no network) and a reader
of an offline run: its `.wandb` transaction log, parsed with wandb's own protobuf record type."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

BLOCK = 32 * 1024
"""The `.wandb` file is a LevelDB-style log: 32 KiB blocks of records, each with a 7-byte header."""
FULL, LAST = 1, 4


def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The `wandb` module, its runs offline and its folders under `tmp_path` (a test fails without it)."""
    try:
        import wandb
    except ImportError:
        pytest.fail(
            "wandb is not installed: `make test` installs the wandb extra (pip install -e '.[wandb]')"
        )
    home = tmp_path / "wandb-home"
    for var, sub in (
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb


def wandb_records(path: Path) -> list[Any]:
    """Every record of a `.wandb` file, parsed as wandb's `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    records, parts, pos = [], [], 7  # the file header: magic, version
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _items(items) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline W&B run under `run_dir/wandb` (oldest first): its run record, history rows, summary,
    metric definitions and exit code."""
    import wandb

    # `finish` can return before W&B's service has written the run's log out; the service's end (at the
    # latest the process's exit) writes it
    wandb.teardown()
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out: dict[str, Any] = {"history": [], "summary": {}, "metrics": {}, "exit_code": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["run"] = record.run
                out["config"] = _items(record.run.config.update)
            elif kind == "history":
                out["history"].append(_items(record.history.item))
            elif kind == "summary":
                out["summary"].update(_items(record.summary.update))
            elif kind == "metric":
                out["metrics"][record.metric.glob_name] = record.metric.step_metric
            elif kind == "exit":
                out["exit_code"] = record.exit.exit_code
        runs.append(out)
    return runs
