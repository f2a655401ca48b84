"""Kill and resume: SIGKILL `reflow agent-train` at random points, resume until it ends, audit the store.

    .venv/bin/python benchmarks/kill_resume.py [--modes sync,async,reflow] [--kills 10] [--seed 0]
        [--steps 30] [--checkpoint-every 3] [--out runs/kill_resume]

Per mode, a tiny run (the tiny model on test/Parity-v0 from tests/fake_envs, whose reward has spread
without a warm start: an untrained model never solves reflow/Calc-v0, so no group there would have
spread and the async trainer would never step) is killed with SIGKILL to its whole session (driver and
every Ray process) at `--kills` points, each resumed with `--resume`, and the last resume runs to the
end. Each incarnation first trains 1-3 steps of its own, then the kill aims at one phase:
- random: a uniform time within about one step;
- rollout / train / weight_sync: from the phase times of the latest step record (sync: rollout_s,
  train_s, sync_s; async and reflow: trainer_wait_s, train_s; there the weights are pushed without
  waiting just before the step is logged, so weight_sync kills right when a step record appears);
- checkpoint: as soon as a `.tmp-step-*` folder (a checkpoint being written) appears.
The timed phases are aimed, not observed; a checkpoint kill counts as hit when the folder was still
there after the kill.

Then the audit reads the replay file directly (read-only SQL: not through the code it audits):
- acknowledged: groups in the store (all of them survived: checked against each kill's snapshot);
- stale log rows: consumptions written by an incarnation for a step after the checkpoint its successor
  resumed from (that step never reached the surviving weights): must be 0 at the end, and they do
  not count as trainings below;
- trained: groups with reward spread consumed by a surviving step (the final log, less stale rows:
  what the final weights were trained on); retired: zero-spread groups consumed without training;
- fresh at end: groups with spread never consumed (generated ahead of the trainer, or, in sync, by
  weights lost in a crash or spares of a step: sync trains only on groups of the current weights);
- lost: groups with spread the planner will not hand out again as fresh (consumed > 0) that no
  surviving step trained, or whose consumed count differs from their surviving trainings: must be 0;
- over-trained: groups trained more often than the mode allows (sync, async: 1; reflow:
  replay.max_reuse): must be 0; replays: trainings beyond a group's first;
- bad steps: steps 1..N in the final log not consuming B trained groups (async, reflow: exactly B;
  sync: at most B, each generated with the weights of the step before);
- dead: groups made by weights that died, worked out here from the kill log, not read from the
  store's marks: a group an incarnation stored whose newest token (read from its records) is newer
  than a checkpoint some later resume started from (those weights are no ancestor of the final ones);
  dead trained: dead groups a surviving step consumed: must be 0; quarantine mismatch: dead groups the
  store did not quarantine plus quarantined ones that are not dead: must be 0.
Exits 1 when lost, over-trained, stale rows, bad steps, missing groups, dead trained or quarantine
mismatches are not all 0, or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import zlib
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("random", "rollout", "train", "weight_sync", "checkpoint")
GROUPS_PER_STEP = 2
MAX_REUSE = 2
TINY = (
    "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, head_dim: 16}"
)


def overrides(mode: str, out: Path, steps: int, checkpoint_every: int) -> list[str]:
    return [
        "env.plugins=[fake_envs:register_test_envs]",
        "env.id=test/Parity-v0",
        "model=tiny",
        f"model_overrides={TINY}",
        "warmstart.enabled=false",
        f"mode={mode}",
        f"out_dir={out}",
        f"run_name={mode}",
        "rollout.group_size=4",
        f"rollout.groups_per_step={GROUPS_PER_STEP}",
        "rollout.max_new_tokens=8",
        "rollout.stop=[e, a, o]",  # an untrained model's replies end early, at varied lengths
        "rollout.max_batch_size=4",  # one group at a time per engine: the trainer outpaces rollout and
        # reflow mode replays
        "train.lr=1e-2",
        f"train.steps={steps}",
        f"train.checkpoint_every={checkpoint_every}",
        "eval.episodes=0",
        "resources.threads_per_slot=1",
        "replay.eta=1",
        f"replay.max_reuse={MAX_REUSE}",
        "replay.share_init=0.5",
        "replay.share_max=0.75",
    ]


# ---- watching a run


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if row.get("kind") == "step":
            rows.append(row)
    return rows


def checkpoint_step(run_dir: Path, key: str = "step") -> int:
    """The step (or `key="version"`: the weights' version) of the latest finished checkpoint (what
    --resume restores), 0 if none."""
    done = sorted((run_dir / "checkpoints").glob("step-*/state.json"))
    return json.loads(done[-1].read_text())[key] if done else 0


def writing_checkpoint(run_dir: Path, since: float) -> bool:
    """Whether a checkpoint written since `since` is unfinished (a killed save leaves its `.tmp-step-*`
    folder behind until the step is saved again: an older one is not this incarnation's)."""
    for tmp in (run_dir / "checkpoints").glob(".tmp-step-*"):
        with suppress(FileNotFoundError):  # renamed into place meanwhile
            if tmp.stat().st_mtime >= since:
                return True
    return False


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [pid for pid, s in (map(int, line.split()) for line in out.splitlines()) if s == sid]


def kill_session(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGKILL the driver's process group, then anything else left in its session (Ray actors run in
    groups of their own), and wait until every one is gone: a process killed inside a syscall (the
    store's fsync) finishes it first, and a resume must not start while one could still commit."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout
    while (left := session_pids(proc.pid)) and time.monotonic() < deadline:
        for pid in left:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


class Incarnation:
    """One `reflow agent-train` process (a first start or a resume)."""

    def __init__(self, cmd: list[str], env: dict[str, str], run_dir: Path, log: Path) -> None:
        self.run_dir, self.start = run_dir, time.time()
        self.steps_before = len(step_records(run_dir))
        self.resumed_from = checkpoint_step(run_dir)
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT
        )

    def new_steps(self) -> list[dict[str, Any]]:
        return step_records(self.run_dir)[self.steps_before :]

    def wait_steps(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.new_steps()) >= n:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise TimeoutError(f"no step {n} within {timeout:.0f}s")

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()


def aim(inc: Incarnation, phase: str, mode: str, rng: random.Random, timeout: float) -> dict[str, Any]:
    """Wait for the moment to kill in `phase`; returns what was aimed at (the caller kills)."""
    seen = len(inc.new_steps())
    if phase == "checkpoint":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and inc.proc.poll() is None:
            if writing_checkpoint(inc.run_dir, inc.start):
                return {"phase": phase}
            time.sleep(0.002)
        return {"phase": phase, "missed": True}
    if not inc.wait_steps(seen + 1, timeout):  # a fresh step record: its times, and a known moment
        return {"phase": phase, "missed": True}
    last = inc.new_steps()[-1]
    train_s = last.get("train_s", 0.0)
    if mode == "sync":
        rollout_s, sync_s = last.get("rollout_s", 0.0), last.get("sync_s", 0.0)
        offsets = {
            "random": rng.uniform(0.0, rollout_s + train_s + sync_s),
            "rollout": 0.5 * rollout_s,
            "train": rollout_s + 0.5 * train_s,
            "weight_sync": rollout_s + train_s + 0.5 * sync_s,
        }
    else:
        wait_s = last.get("trainer_wait_s", 0.0)
        offsets = {
            "random": rng.uniform(0.0, wait_s + train_s),
            "rollout": 0.5 * wait_s,  # the trainer waits on rollouts
            "train": wait_s + 0.5 * train_s,
            "weight_sync": 0.0,  # pushed, not awaited, just before the step record
        }
    time.sleep(offsets[phase])
    return {"phase": phase, "offset_s": round(offsets[phase], 3)}


# ---- the audit


def read_store(db: Path, run: str) -> tuple[dict[str, dict[str, Any]], list[tuple[str, int, float]]]:
    if not db.exists():  # the run died before it opened its store
        return {}, []
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        groups = {
            gid: {
                "spread": spread > 0,
                "consumed": consumed,
                "version": version,
                "created": created,
                "quarantined": bool(quarantined),
                "newest": -1,
            }
            for gid, spread, consumed, version, created, quarantined in conn.execute(
                "SELECT group_id, reward_spread, consumed, policy_version, created_at, quarantined "
                "FROM groups WHERE run = ?",
                (run,),
            )
        }
        records = conn.execute(
            "SELECT g.group_id, e.codec, e.record FROM episodes e JOIN groups g ON g.seq = e.group_seq "
            "WHERE g.run = ?",
            (run,),
        )
        for gid, codec, blob in records:  # the newest token of each group, from its records
            record = json.loads(zlib.decompress(blob) if codec == "zlib" else blob)
            versions = [v for turn in record["turns"] for v in turn["token_versions"]]
            newest = max(versions, default=record["policy_version_end"])
            groups[gid]["newest"] = max(groups[gid]["newest"], newest)
        log = conn.execute(
            "SELECT group_id, step, consumed_at FROM consumptions WHERE run = ?", (run,)
        ).fetchall()
    return groups, log


def audit(
    mode: str, run_dir: Path, kills: list[dict[str, Any]], steps: int, acknowledged: set[str]
) -> dict[str, Any]:
    groups, log = read_store(run_dir / "replay.sqlite", mode)

    # A row written by a killed incarnation for a step after the checkpoint its successor resumed
    # from never reached the surviving weights: the resume must have undone it.
    def stale(step: int, at: float) -> bool:
        return any(k["start"] <= at < k["time"] and step > k["checkpoint"] for k in kills)

    n_stale = sum(stale(step, at) for _, step, at in log)
    uses: dict[str, int] = {}  # trainings by surviving steps
    by_step: dict[int, list[str]] = {}
    for gid, step, at in log:
        if not stale(step, at):
            uses[gid] = uses.get(gid, 0) + 1
            by_step.setdefault(step, []).append(gid)
    spread = {g for g, v in groups.items() if v["spread"]}
    dead = {g for g, v in groups.items() if made_by_lost_weights(v, kills)}
    quarantined = {g for g, v in groups.items() if v["quarantined"]}
    allowed = MAX_REUSE if mode == "reflow" else 1
    bad_steps = []
    for step in range(1, steps + 1):
        trained = [g for g in by_step.get(step, []) if g in spread]
        if mode == "sync":
            ok = len(trained) <= GROUPS_PER_STEP and all(groups[g]["version"] == step - 1 for g in trained)
        else:
            ok = len(trained) == GROUPS_PER_STEP
        if not ok:
            bad_steps.append(step)
    return {
        "mode": mode,
        "kills": len(kills),
        "phases": {p: sum(k["phase"] == p and not k.get("missed") for k in kills) for p in PHASES},
        "checkpoint_writes_hit": sum(k.get("tmp_checkpoint_left", False) for k in kills),
        "acknowledged": len(groups),
        "with_spread": len(spread),
        "missing_groups": len(acknowledged - set(groups)),
        "trained": sum(uses.get(g, 0) > 0 for g in spread),
        "retired_zero_spread": sum(uses.get(g, 0) > 0 for g in groups if g not in spread),
        "fresh_at_end": sum(groups[g]["consumed"] == 0 for g in spread),
        "lost": sum(
            (groups[g]["consumed"] > 0 and uses.get(g, 0) == 0) or groups[g]["consumed"] != uses.get(g, 0)
            for g in spread
        ),
        "over_trained": sum(uses.get(g, 0) > allowed for g in spread),
        "replayed": sum(max(0, uses.get(g, 0) - 1) for g in spread),
        "stale_log_rows": n_stale,
        "bad_steps": bad_steps,
        "dead": len(dead),
        "quarantined": len(quarantined),
        "dead_trained": sum(uses.get(g, 0) > 0 for g in dead),
        "quarantine_mismatch": len(dead ^ quarantined),
        "steps_in_log": max(by_step, default=0),
    }


def made_by_lost_weights(group: dict[str, Any], kills: list[dict[str, Any]]) -> bool:
    """Whether the weights that made `group` died: an incarnation stored it (before its kill) with a
    token newer than the checkpoint version a later resume started from. Weights of version v made
    in one incarnation survive only while every later resume starts at v or beyond."""
    for i, kill in enumerate(kills):
        if kill["start"] <= group["created"] < kill["time"]:
            return group["newest"] > min(k["checkpoint_version"] for k in kills[i:])
    return False


# ---- one mode


def run_mode(mode: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    import shutil

    out = Path(args.out).resolve()
    run_dir = out / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": "local",  # a cluster of our own, even while someone's `ray start` one is up
    }
    cli = [sys.executable, "-m", "reflow.cli", "agent-train"]
    first = [*cli, *overrides(mode, out, args.steps, args.checkpoint_every)]
    resume = [*cli, "--resume", str(run_dir)]
    log_file = out / f"{mode}.log"
    log_file.unlink(missing_ok=True)
    phases = [PHASES[i % len(PHASES)] for i in range(args.kills)]
    rng.shuffle(phases)
    kills: list[dict[str, Any]] = []
    acknowledged: set[str] = set()
    started = time.monotonic()
    completed = False
    for i in range(args.kills + 1):
        inc = Incarnation(first if i == 0 else resume, env, run_dir, log_file)
        if i == args.kills:  # the last one runs to the end
            completed = inc.finish(args.timeout) == 0
            break
        own = rng.randint(1, 3)  # steps of its own before aiming, so every incarnation makes progress
        if not inc.wait_steps(own, args.timeout):
            completed = inc.finish(args.timeout) == 0  # the run ended before this kill
            break
        aimed = aim(inc, phases[i], mode, rng, args.timeout)
        if inc.proc.poll() is not None:
            completed = inc.finish(args.timeout) == 0
            break
        kill_session(inc.proc)
        inc.finish(args.timeout)
        kill = {
            **aimed,
            "start": inc.start,
            "time": time.time(),
            "step": max((r["step"] for r in step_records(run_dir)), default=0),
            "checkpoint": checkpoint_step(run_dir),
            "checkpoint_version": checkpoint_step(run_dir, "version"),
            "tmp_checkpoint_left": writing_checkpoint(run_dir, inc.start),
        }
        kills.append(kill)
        groups, _ = read_store(run_dir / "replay.sqlite", mode)
        acknowledged |= set(groups)
        print(
            f"  {mode} kill {i + 1}/{args.kills}: {kill['phase']}{' (missed)' if kill.get('missed') else ''}"
            f" at step {kill['step']}, resuming from checkpoint {kill['checkpoint']}",
            flush=True,
        )
    result = audit(mode, run_dir, kills, args.steps, acknowledged)
    result["completed"] = completed
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["kill_log"] = kills
    return result


COLUMNS = (
    ("mode", "mode"),
    ("kills", "kills"),
    ("acknowledged", "acknowledged"),
    ("with spread", "with_spread"),
    ("trained", "trained"),
    ("retired", "retired_zero_spread"),
    ("fresh at end", "fresh_at_end"),
    ("lost", "lost"),
    ("over-trained", "over_trained"),
    ("replays", "replayed"),
    ("stale rows", "stale_log_rows"),
    ("bad steps", "bad_steps"),
    ("dead", "dead"),
    ("quarantined", "quarantined"),
    ("dead trained", "dead_trained"),
    ("q. mismatch", "quarantine_mismatch"),
    ("wall s", "wall_s"),
)


def table(results: list[dict[str, Any]]) -> str:
    rows = [[name for name, _ in COLUMNS]]
    for r in results:
        rows.append([str(len(r[k]) if isinstance(r[k], list) else r[k]) for _, k in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    for r in results:
        hits = ", ".join(f"{p} {n}" for p, n in r["phases"].items())
        lines.append(
            f"{r['mode']}: kills aimed at {hits}; checkpoint writes interrupted {r['checkpoint_writes_hit']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="sync,async,reflow")
    p.add_argument("--kills", type=int, default=10, help="kills per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30, help="train.steps of each run")
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one event")
    p.add_argument("--out", default="runs/kill_resume", help="run folders, logs and kill_resume.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"sync", "async", "reflow"} or args.kills < 0 or args.checkpoint_every < 2:
        print("--modes takes sync,async,reflow; --kills >= 0; --checkpoint-every >= 2", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    for mode in modes:
        results.append(run_mode(mode, args, rng))
        (Path(args.out) / "kill_resume.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    failed = [
        r["mode"]
        for r in results
        if not r["completed"]
        or r["lost"]
        or r["over_trained"]
        or r["stale_log_rows"]
        or r["bad_steps"]
        or r["missing_groups"]
        or r["dead_trained"]
        or r["quarantine_mismatch"]
    ]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
