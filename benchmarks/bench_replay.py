"""The replay actor under a cluster's load: add / plan / read latency with 8 rollout workers writing
and 4 trainer ranks reading each batch, before and after the ranks fetch only their own share.

    python benchmarks/bench_replay.py [--writers 8] [--ranks 4] [--groups 40] [--tokens 64]

Every writer is a Ray actor adding whole groups (8 episodes of 3 turns, `--tokens` sampled tokens a
turn) to the one replay actor as fast as it can; the driver plans batches of B groups as they come
(`plan_and_consume`, fresh first) and hands each batch to the ranks, which read it:

- `full, 1 thread`: what the runtime did before: every rank fetches every group of the batch (one
  call per group) and keeps its share of the rows; the replay actor serves one call at a time.
- `shard, 8 threads`: what it does now: every rank asks for the batch's group sizes, computes the
  same balanced split (`reflow.train.batch.shard_groups`) and fetches only its groups in one call;
  the actor serves up to `REPLAY_THREADS` calls at once (SQL under one lock, decoding outside it).

Prints p50 / p99 latency in milliseconds per operation and the bytes the ranks received per step.

Then the planner at scale (`--plan-window N`, 0 skips it): a store with N groups in the replay window
(consumed once, with reward spread, within tau_max) and fewer fresh groups than a batch, the state of
every loop wake-up while the trainer waits; `plan_and_consume` with a replay share is timed over
repeated wake-ups, once per replay selection (`--selections`, default spread and scored: "scored"
reads up to 1024 candidates' index columns and scores them in Python, the others take the store's
first n). Planning reads index columns only, so its time grows with the window's index scan, not with
the records. `--plan-only` skips the actor part.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import ray

from reflow.policy.dual_cycle import CycleConfig
from reflow.records import EpisodeRecord, Segment, TurnRecord
from reflow.runtime.replay_service import REPLAY_THREADS, ReplayService
from reflow.train.batch import shard_groups


def synthetic_group(group_id: str, rng: random.Random, tokens: int, episodes: int = 8, turns: int = 3):
    """A group shaped like a rollout worker's: multi-turn records with per-token log-probs."""
    records = []
    for i in range(episodes):
        rec = EpisodeRecord(
            episode_id=f"{group_id}-{i}", group_id=group_id, env_id="bench/Replay-v0", task_id=i,
            task_hash=str(i), seed=i, reward=float(i % 2), success=bool(i % 2),
        )  # fmt: skip
        seg = Segment(0)
        seg.extend_prompt([rng.randrange(50_000) for _ in range(64)])
        for t in range(turns):
            ids = [rng.randrange(50_000) for _ in range(tokens)]
            logprobs = [-rng.random() for _ in range(tokens)]
            seg.extend_sampled(ids, logprobs, [0] * tokens)
            delta = [rng.randrange(50_000) for _ in range(8)]
            rec.turns.append(
                TurnRecord(
                    turn_index=t, segment_id=0, obs_messages=[{"role": "tool", "content": "ok"}],
                    prompt_delta_ids=delta, completion_ids=ids, completion_logprobs=logprobs,
                    finish_reason="stop", policy_version=0, token_versions=[0] * tokens, sampling_params={},
                )
            )  # fmt: skip
            seg.extend_prompt(delta)
        rec.segments.append(seg)
        records.append(rec)
    return records, [float(i % 2) - 0.5 for i in range(episodes)]


@ray.remote(num_cpus=0)
class Writer:
    def __init__(self, replay, seed: int, tokens: int) -> None:
        self.replay, self.rng, self.tokens = replay, random.Random(seed), tokens

    def write(self, n: int) -> list[float]:
        latencies = []
        for _ in range(n):
            records, advantages = synthetic_group(uuid.uuid4().hex, self.rng, self.tokens)
            start = time.perf_counter()
            ray.get(self.replay.add_group.remote(records, advantages))
            latencies.append(time.perf_counter() - start)
        return latencies


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, replay, rank: int, world: int) -> None:
        self.replay, self.rank, self.world = replay, rank, world

    def read(self, group_ids: list[str], shard: bool) -> tuple[float, int]:
        start = time.perf_counter()
        if shard:
            sizes = ray.get(self.replay.group_sizes.remote(group_ids))
            mine = [group_ids[i] for i in shard_groups([sizes[g] for g in group_ids], self.world)[self.rank]]
            groups = ray.get(self.replay.groups.remote(mine)) if mine else []
        else:
            groups = ray.get([self.replay.group.remote(g) for g in group_ids])
        return time.perf_counter() - start, len(pickle.dumps(groups))


def run(args: argparse.Namespace, shard: bool, threads: int, db: Path) -> dict[str, list[float]]:
    replay = (
        ray.remote(ReplayService)
        .options(num_cpus=0, max_concurrency=threads)
        .remote(str(db), "bench", CycleConfig())
    )
    writers = [Writer.remote(replay, seed, args.tokens) for seed in range(args.writers)]
    ranks = [Rank.remote(replay, r, args.ranks) for r in range(args.ranks)]
    ray.get([replay.in_flight.remote(), *(r.read.remote([], True) for r in ranks)])  # started, warm
    pending = [w.write.remote(args.groups) for w in writers]
    out: dict[str, list[float]] = {"add": [], "plan": [], "read": [], "bytes": []}
    total, planned, step = args.writers * args.groups, 0, 0
    while planned + args.batch <= total:
        start = time.perf_counter()
        plan = ray.get(replay.plan_and_consume.remote(args.batch, 0, 0.0, False, step + 1))
        out["plan"].append(time.perf_counter() - start)
        if plan is None:
            time.sleep(0.01)
            continue
        step, planned = step + 1, planned + len(plan.group_ids)
        for seconds, size in ray.get([r.read.remote(plan.group_ids, shard) for r in ranks]):
            out["read"].append(seconds)
            out["bytes"].append(size)
    out["add"] = [x for batch in ray.get(pending) for x in batch]
    for actor in [*writers, *ranks, replay]:
        ray.kill(actor)
    return out


def plan_scale(window: int, batch: int, wakeups: int, folder: Path, selection: str = "spread") -> list[float]:
    """Seconds of each `plan_and_consume` wake-up with `window` groups in the replay window."""
    cfg = CycleConfig(tau_max=4, max_reuse=4, share_max=0.5, selection=selection)
    service = ReplayService(str(folder / "plan.sqlite"), "bench", cfg)
    rng = random.Random(0)
    ids = []
    for i in range(window + batch // 2):
        service.add_group(*synthetic_group(f"g{i}", rng, tokens=4, episodes=2, turns=1))
        ids.append(f"g{i}")
    service.mark_consumed(ids[:window], 1)  # the window; the rest stay fresh (fewer than a batch)
    times = []
    for _ in range(wakeups):
        start = time.perf_counter()
        plan = service.plan_and_consume(batch, 4, 0.25, True, 99)  # a short batch: None, nothing consumed
        times.append(time.perf_counter() - start)
        assert plan is None
    service.close()
    return times


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--groups", type=int, default=40, help="groups each writer adds")
    p.add_argument("--batch", type=int, default=8, help="groups per train step")
    p.add_argument("--tokens", type=int, default=64, help="sampled tokens per turn")
    p.add_argument("--plan-window", type=int, default=10_000, help="groups in the replay window (0: skip)")
    p.add_argument(
        "--selections", default="spread,scored", help="replay selections the planner is timed with"
    )
    p.add_argument("--plan-only", action="store_true", help="time the planner only, not the replay actor")
    args = p.parse_args()
    if not args.plan_only:
        actor_figures(args)
    for selection in args.selections.split(",") if args.plan_window else ():
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
            t = plan_scale(args.plan_window, args.batch, 50, Path(tmp), selection)
        print(
            f"planning ({selection}), {args.plan_window} groups in the replay window, batch {args.batch}, "
            f"50 wake-ups: p50 {_ms(t, 0.5):.1f} ms, p99 {_ms(t, 0.99):.1f} ms"
        )


def actor_figures(args: argparse.Namespace) -> None:
    """The replay actor's latencies under 8 writers and the ranks' reads (the table)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False
    )
    print(
        f"{args.writers} writers x {args.groups} groups (8 episodes, 3 turns, {args.tokens} tokens/turn), "
        f"{args.ranks} ranks, batches of {args.batch}; latency p50 / p99 in ms"
    )
    print("| read path | add | plan | read (per rank) | MB received per step (all ranks) |")
    print("| --- | --- | --- | --- | --- |")
    for label, shard, threads in (
        ("full, 1 thread", False, 1),
        (f"shard, {REPLAY_THREADS} threads", True, REPLAY_THREADS),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            r = run(args, shard, threads, Path(tmp) / "replay.sqlite")
        per_step = statistics.fmean(r["bytes"]) * args.ranks / 1e6
        print(
            f"| {label} | {_ms(r['add'], 0.5):.1f} / {_ms(r['add'], 0.99):.1f} "
            f"| {_ms(r['plan'], 0.5):.1f} / {_ms(r['plan'], 0.99):.1f} "
            f"| {_ms(r['read'], 0.5):.1f} / {_ms(r['read'], 0.99):.1f} | {per_step:.2f} |"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
