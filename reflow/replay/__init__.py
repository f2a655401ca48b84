"""Replay: the durable, trajectory-level store of episode groups.

`ReplayStore` keeps every accepted group with its full per-turn records in one SQLite file per run and
answers the queries of the dual replay cycle (fresh groups in arrival order, replayable groups within
a staleness window and reuse limit) plus admission control and a checkpoint cursor. `reflow replay
inspect | export` (reflow/replay/cli.py) read it from the command line. This package imports only
`reflow.records` and `reflow.env`: never the trainer or the engines.
"""

from reflow.replay.cycle import AdmissionControl, BatchPlan, CycleConfig, ReplayShare, consume, plan_batch
from reflow.replay.store import GroupInfo, ReplayStore, StoredGroup

__all__ = [
    "AdmissionControl",
    "BatchPlan",
    "CycleConfig",
    "GroupInfo",
    "ReplayShare",
    "ReplayStore",
    "StoredGroup",
    "consume",
    "plan_batch",
]
