"""`reflow replay inspect | export` through reflow.cli.main, and the exported files read back with
pyarrow, pandas and DuckDB (each skipped when not installed)."""

import json

import pytest
from replay_helpers import make_group

from reflow.cli import main
from reflow.records import EpisodeRecord
from reflow.replay import ReplayStore

N_EPISODES = 2 + 3 + 2 + 4


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """runs/exp1/replay.sqlite with 4 groups over 3 versions, 2 consumed, 1 in flight; cwd = tmp_path."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "exp1"
    with ReplayStore(run / "replay.sqlite", run="exp1") as s:
        s.add_group(*make_group("a", [0.0, 1.0], version=0))
        s.add_group(*make_group("b", [1.0, 1.0, 0.0], version=1, n_turns=3))
        episodes, advantages = make_group("c", [0.0, 0.0], version=1, status="timeout")
        s.add_group(episodes, advantages)
        s.add_group(*make_group("d", [1.0, 0.0, 1.0, 1.0], version=2, n_turns=1))
        s.mark_consumed(["a", "b"], step=1)
        s.begin_group("e", 3)
    return run


def test_inspect_accepts_a_run_dir_a_file_or_a_name(run_dir, capsys):
    for arg in (str(run_dir), str(run_dir / "replay.sqlite"), "exp1"):
        assert main(["replay", "inspect", arg, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert (stats["run"], stats["groups"], stats["episodes"]) == ("exp1", 4, N_EPISODES)
        assert (stats["groups_consumed"], stats["in_flight"]) == (2, 1)
        assert [v["policy_version"] for v in stats["by_version"]] == [0, 1, 2]


def test_inspect_prints_tables(run_dir, capsys):
    assert main(["replay", "inspect", "exp1"]) == 0
    out = capsys.readouterr().out
    for text in ("4 (2 consumed, 2 fresh)", "by policy version", "timeout=2", "reuse", "in flight"):
        assert text in out


def test_inspect_errors(run_dir, tmp_path, capsys):
    assert main(["replay", "inspect", "nope"]) == 2
    assert "no replay store" in capsys.readouterr().err
    (tmp_path / "junk.sqlite").write_text("not a database")
    assert main(["replay", "inspect", str(tmp_path / "junk.sqlite")]) == 2
    assert "not a replay store" in capsys.readouterr().err
    for name in ("x", "y"):
        with ReplayStore(tmp_path / "multi" / "replay.sqlite", run=name) as s:
            s.add_group(*make_group("z", [1.0]))
    assert main(["replay", "inspect", str(tmp_path / "multi"), "--json"]) == 2  # two runs, neither "multi"
    assert "--run-name" in capsys.readouterr().err
    assert main(["replay", "inspect", str(tmp_path / "multi"), "--run-name", "y", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "y"
    with ReplayStore(run_dir / "replay.sqlite", run="exp2") as s:
        s.add_group(*make_group("z", [1.0]))
    assert main(["replay", "inspect", "exp1", "--json"]) == 0  # the run named like its directory
    assert json.loads(capsys.readouterr().out)["groups"] == 4
    assert main(["replay", "inspect", str(run_dir), "--run-name", "exp2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == 1
    assert main(["replay", "inspect", "exp1", "--run-name", "nope"]) == 2


def _originals(run_dir):
    with ReplayStore(run_dir / "replay.sqlite", run="exp1") as s:
        return {e.episode_id: e for e in s.episodes()}


FLAT = {"episode_id", "group_id", "run", "env_id", "policy_version_start", "policy_version_end", "status"}
FLAT |= {"reward", "success", "n_turns", "n_generated_tokens", "advantage", "consumed", "record_json"}


def test_export_parquet_reads_back_with_pyarrow_pandas_and_duckdb(run_dir, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    assert main(["replay", "export", "exp1"]) == 0
    out = run_dir / "replay-exp1.parquet"  # the default: beside the store
    table = pq.read_table(out)
    assert table.num_rows == N_EPISODES and FLAT | {"turns", "created_at"} <= set(table.column_names)
    rows = table.to_pylist()
    originals = _originals(run_dir)
    for row in rows:  # the full record survives; the flat columns agree with it
        rec = EpisodeRecord.from_dict(json.loads(row["record_json"]))
        assert rec == originals[row["episode_id"]]
        assert (row["n_turns"], row["status"], row["reward"]) == (rec.n_turns, rec.status, rec.reward)
        assert [t["completion_ids"] for t in row["turns"]] == [t.completion_ids for t in rec.turns]
        assert json.loads(row["turns"][0]["tool_results_json"]) == rec.turns[0].tool_results
    by_id = {r["episode_id"]: r for r in rows}
    assert by_id["a-e1"]["advantage"] == 0.5 and by_id["a-e1"]["consumed"] == 1
    assert by_id["d-e0"]["consumed"] == 0 and by_id["d-e0"]["last_step"] is None

    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(out)
    assert len(df) == N_EPISODES and set(df.columns) >= FLAT
    assert df.groupby("policy_version_start").size().to_dict() == {0: 2, 1: 5, 2: 4}

    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    got = con.execute(
        "SELECT count(*), sum(n_turns), max(len(turns)) FROM read_parquet(?) WHERE status = 'ok'", [str(out)]
    ).fetchone()
    assert got == (N_EPISODES - 2, 2 * 2 + 3 * 3 + 4 * 1, 3)


def test_export_jsonl_and_an_empty_store(run_dir, tmp_path, capsys):
    out = tmp_path / "exports" / "all.jsonl"
    assert main(["replay", "export", "exp1", "--format", "jsonl", "--out", str(out)]) == 0
    assert f"exported {N_EPISODES} episodes" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == N_EPISODES and FLAT - {"record_json"} <= set(lines[0])
    originals = _originals(run_dir)
    assert all(EpisodeRecord.from_dict(r["record"]) == originals[r["episode_id"]] for r in lines)
    assert [r["group_id"] for r in lines] == ["a"] * 2 + ["b"] * 3 + ["c"] * 2 + ["d"] * 4  # arrival order

    pq = pytest.importorskip("pyarrow.parquet")
    with ReplayStore(tmp_path / "empty" / "replay.sqlite", run="empty") as s:
        path = s.export(tmp_path / "empty.parquet")
    table = pq.read_table(path)
    assert table.num_rows == 0 and "record_json" in table.column_names
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind
