"""Export of a replay store, one row per episode, to Parquet (pandas, DuckDB, Spark) or JSONL.

Parquet columns: the flat episode and group fields (ids, env, versions, status, reward, success, lengths,
advantage, reward spread, consumption), `turns` as a nested list of structs (token ids, logprobs and
versions as typed lists; the free-form dicts of a turn, such as tool calls and results, as JSON text
because their keys vary from env to env), and the full record as JSON text in `record_json`.
JSONL lines carry the same flat fields and the full record as a nested object under `record`.

The schema is fixed, not inferred, so every export has the same column types whatever the data; rows
are written in batches so a large store never has to fit in memory; the file appears under its final
name only once complete. pyarrow (the `train` extra) is needed for Parquet only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

_BATCH = 512

# (column, pyarrow type name); "record_json" and "turns" are added by the Parquet writer.
FLAT_COLUMNS: list[tuple[str, str]] = [
    ("episode_id", "string"),
    ("group_id", "string"),
    ("run", "string"),
    ("seq", "int64"),
    ("index_in_group", "int32"),
    ("env_id", "string"),
    ("task_id", "string"),
    ("task_hash", "string"),
    ("seed", "int64"),
    ("policy_version_start", "int64"),
    ("policy_version_end", "int64"),
    ("group_policy_version", "int64"),
    ("status", "string"),
    ("termination", "string"),
    ("error", "string"),
    ("reward", "float64"),
    ("success", "bool"),
    ("n_turns", "int32"),
    ("n_generated_tokens", "int64"),
    ("n_segments", "int32"),
    ("advantage", "float64"),
    ("reward_spread", "float64"),
    ("consumed", "int32"),
    ("last_step", "int64"),
    ("created_at", "timestamp"),
]

_TURN_LISTS = {
    "prompt_delta_ids": "int64",
    "completion_ids": "int64",
    "completion_logprobs": "float64",
    "token_versions": "int64",
}
_TURN_SCALARS = {
    "turn_index": "int32",
    "segment_id": "int32",
    "finish_reason": "string",
    "policy_version": "int64",
    "raw_text": "string",
    "reward": "float64",
    "generation_s": "float64",
    "env_s": "float64",
}
_TURN_JSON = ("obs_messages", "tool_calls", "tool_results", "sampling_params")


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """The flat columns of one `ReplayStore.rows()` item (created_at stays epoch seconds)."""
    rec = row["record"]
    task_id = rec.get("task_id")
    return {
        "episode_id": rec["episode_id"],
        "group_id": row["group_id"],
        "run": row["run"],
        "seq": row["seq"],
        "index_in_group": row["index_in_group"],
        "env_id": rec["env_id"],
        "task_id": None if task_id is None else task_id if isinstance(task_id, str) else json.dumps(task_id),
        "task_hash": rec.get("task_hash"),
        "seed": rec.get("seed"),
        "policy_version_start": rec["policy_version_start"],
        "policy_version_end": rec["policy_version_end"],
        "group_policy_version": row["group_policy_version"],
        "status": rec["status"],
        "termination": rec.get("termination"),
        "error": rec.get("error"),
        "reward": float(rec["reward"]),
        "success": bool(rec["success"]),
        "n_turns": len(rec.get("turns", [])),
        "n_generated_tokens": sum(len(t["completion_ids"]) for t in rec.get("turns", [])),
        "n_segments": len(rec.get("segments", [])),
        "advantage": row["advantage"],
        "reward_spread": row["reward_spread"],
        "consumed": row["consumed"],
        "last_step": row["last_step"],
        "created_at": row["created_at"],
    }


def _turn(t: dict[str, Any]) -> dict[str, Any]:
    out = {k: t.get(k) for k in (*_TURN_SCALARS, *_TURN_LISTS)}
    out.update({f"{k}_json": json.dumps(t.get(k), ensure_ascii=False) for k in _TURN_JSON})
    return out


def parquet_schema() -> Any:
    import pyarrow as pa

    def typ(name: str) -> Any:
        if name == "timestamp":
            return pa.timestamp("us", tz="UTC")
        return getattr(pa, {"bool": "bool_"}.get(name, name))()

    turn = pa.struct(
        [(k, typ(v)) for k, v in _TURN_SCALARS.items()]
        + [(k, pa.list_(typ(v))) for k, v in _TURN_LISTS.items()]
        + [(f"{k}_json", pa.string()) for k in _TURN_JSON]
    )
    return pa.schema(
        [(name, typ(t)) for name, t in FLAT_COLUMNS]
        + [("turns", pa.list_(turn)), ("record_json", pa.string())]
    )


def _batches(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_parquet(rows: Iterable[dict[str, Any]], tmp: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # the core install has no pyarrow
        raise RuntimeError(
            "Parquet export needs pyarrow (pip install 'reflow-rl[train]'); or use jsonl"
        ) from e
    schema = parquet_schema()
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        wrote = False
        for batch in _batches(rows):
            cols: dict[str, list[Any]] = {name: [] for name in schema.names}
            for row in batch:
                flat = flat_row(row)
                flat["created_at"] = datetime.fromtimestamp(flat["created_at"], tz=timezone.utc)
                for name, _ in FLAT_COLUMNS:
                    cols[name].append(flat[name])
                cols["turns"].append([_turn(t) for t in row["record"].get("turns", [])])
                cols["record_json"].append(json.dumps(row["record"], ensure_ascii=False))
            writer.write_table(pa.Table.from_pydict(cols, schema=schema))
            wrote = True
        if not wrote:  # an empty store still gives a readable file with the full schema
            writer.write_table(schema.empty_table())


def _write_jsonl(rows: Iterable[dict[str, Any]], tmp: Path) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({**flat_row(row), "record": row["record"]}, ensure_ascii=False) + "\n")


def export_rows(
    rows: Iterable[dict[str, Any]], out: str | Path, fmt: Literal["parquet", "jsonl"] = "parquet"
) -> Path:
    """Write `ReplayStore.rows()` to `out` (parents created); returns the path."""
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"unknown export format {fmt!r} (parquet or jsonl)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        (_write_parquet if fmt == "parquet" else _write_jsonl)(rows, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
