"""One rank of the FSDP2 test: train one step on its shard, write the full weights (rank 0)."""

import sys

import torch
from test_trainer import _model, _rows

from reflow.train.batch import shard_groups
from reflow.train.trainer import PolicyTrainer, TrainerConfig, init_distributed


def main(
    rank: int, world: int, port: int, out: str, n_rows: int = 8, micro_batch_tokens: int = 16384
) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "gloo")
    config = TrainerConfig(lr=1e-2, bf16=False, micro_batch_tokens=micro_batch_tokens)
    trainer = PolicyTrainer(_model(), 0, config)
    rows = _rows(n_rows + n_rows % 2)[:n_rows]
    rows = [rows[i] for i in shard_groups([len(r.segment.token_ids) for r in rows], world)[rank]]
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):  # the reduced gradient, unsharded (a collective on every rank)
        grads.update({n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    metrics = trainer.train_step(rows)
    state = trainer.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "grads": grads}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:]))
