"""One rank of the FSDP2 tests: train one step on its shard, write the full weights (rank 0).

    fsdp_worker.py RANK WORLD PORT OUT [N_ROWS MICRO_BATCH_TOKENS [AGG ROWS]]

ROWS is "plain" (`_rows`, sync mode), "lora" (`_rows` with LoRA adapters, two steps; "lora-bf16" on a
bf16 base), "capped" (`_capped_rows`, off-policy, some tokens capped) or
"m2" (`_capped_rows(moderate=True)` with the M2 trust region).
"""

import os
import sys

import torch
from test_trainer import _capped_rows, _capture_grads, _config, _model, _rows

from reflow.train.batch import shard_groups
from reflow.train.distributed import init_distributed, shutdown_distributed
from reflow.train.trainer import PolicyTrainer


def main(
    rank: int,
    world: int,
    port: int,
    out: str,
    n_rows: int = 8,
    micro_batch_tokens: int = 16384,
    agg: str = "token_mean",
    kind: str = "plain",
) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "gloo")
    model = _model().to(torch.bfloat16) if kind == "lora-bf16" else _model()
    trainer = PolicyTrainer(model, 0, _config(micro_batch_tokens, agg, kind))
    if kind in ("capped", "m2"):
        rows = _capped_rows(n_rows, moderate=kind == "m2")
    else:
        rows = _rows(n_rows + n_rows % 2)[:n_rows]
    rows = [rows[i] for i in shard_groups([len(r.segment.token_ids) for r in rows], world)[rank]]
    grads = _capture_grads(trainer)  # the reduced gradient, unsharded (a collective on every rank)
    for _ in range(2 if kind.startswith("lora") else 1):  # LoRA's B starts at 0: A's gradient is 0 at first
        metrics = trainer.train_step(rows)
    state = trainer.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "grads": grads}, out)
    shutdown_distributed()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], *map(int, a[4:6]), *a[6:])
    # gloo's threads outlive the group (see shutdown_distributed): end without finalizing the interpreter
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
