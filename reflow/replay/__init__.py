"""Replay: the durable, trajectory-level store of episode groups.

`ReplayStore` keeps every accepted group with its full per-turn records in one SQLite file per run and
answers the queries of the dual replay cycle (fresh groups in arrival order, replayable groups within
a staleness window and reuse limit) plus admission control and a checkpoint cursor; `planning` plans
a train step's batch over them. `reflow replay inspect | export` (reflow/replay/cli.py) read it from
the command line. This package imports only `reflow.records`, `reflow.env` and the cycle's policies
(`reflow.policy.dual_cycle`): never the trainer or the engines.
"""

from reflow.replay.planning import BatchPlan, consume, plan_batch
from reflow.replay.store import GroupInfo, ReplayStore, StoredGroup, UseStats

__all__ = [
    "BatchPlan",
    "GroupInfo",
    "ReplayStore",
    "StoredGroup",
    "UseStats",
    "consume",
    "plan_batch",
]
