"""The elastic pool's cold-start cost: seconds per part of a slot's role change (prints figures only).

    .venv/bin/python benchmarks/bench_role_change.py [--config configs/calc-tiny.yaml] [--rounds 3]
        [--slots rollout,rollout,train]

A local Ray cluster of the config's model is started with `--slots`; then `--rounds` round trips: one
group starts on the last rollout worker, that slot moves to training while the group is in flight
(drain, state gather, actor stop + TrainerRank start, FSDP2 group re-form, state load), the group of
m + 1 ranks takes a train step, and the last train slot moves back to rollout (state gather, ranks
leave, actor swap, group re-form, trainer state and engine weights load). Each part is printed per
direction (median and range over the rounds) with the machine's load average, which on a shared
machine moves the figures more than anything else: the actor start (a new Python process importing
torch and building the model) dominates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory

import ray

from reflow.config import load_config
from reflow.models.presets import resolve_model_path
from reflow.runtime.cluster import Cluster

PARTS = ("drain_s", "actor_start_s", "weight_load_s", "group_reform_s", "cost_s", "wall_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/calc-tiny.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", default="rollout,rollout,train")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    slots = args.slots.split(",")
    with TemporaryDirectory() as tmp:
        config = load_config(
            args.config,
            [
                f"out_dir={tmp}",
                "mode=async",
                f"resources.slots=[{', '.join(slots)}]",
                "resources.threads_per_slot=1",
            ],
        )
        model_path = str(resolve_model_path(config.model.name, **config.model_overrides))
        ray.init(num_cpus=len(slots) + 1, include_dashboard=False, log_to_driver=False)
        cluster = Cluster(config, model_path, Path(tmp))
        events: dict[str, list[dict]] = {"to_train": [], "to_rollout": []}
        try:
            for i in range(args.rounds):
                gid = uuid.uuid4().hex
                ray.get(cluster.replay.begin_group.remote(gid, cluster.version()))
                ref = cluster.rollout[-1].generate.remote([i], [gid])
                change = cluster.move("rollout", "train", {ref: [gid]})
                events["to_train"].append(change.event())
                ids = [r.group_id for r in change.drained]
                if ids:
                    cluster.train_step(ids, i + 1)
                events["to_rollout"].append(cluster.move("train", "rollout").event())
        finally:
            cluster.shutdown()
            ray.shutdown()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"model {config.model.name} ({args.config}), slots {args.slots}, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, load average {load}")  # fmt: skip
    for direction, rows in events.items():
        cells = []
        for part in PARTS:
            values = [r[part] for r in rows]
            cells.append(f"{part} {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        print(f"{direction:<11} " + "  ".join(cells))


if __name__ == "__main__":
    main()
