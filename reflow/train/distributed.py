"""The trainer ranks' process group: joining it, sharding the model over it with FSDP2, the
collectives the trainer needs beyond FSDP's own, and leaving it."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F


def all_gather(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, concatenated in rank order (ranks may hold different counts); `values`
    itself outside a group of several ranks. A collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    world = dist.get_world_size()
    values = values.detach().cpu()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([values.numel()], dtype=torch.int64))
    longest = int(max(counts).item())
    parts = [torch.zeros(longest, dtype=values.dtype) for _ in range(world)]
    dist.all_gather(parts, F.pad(values, (0, longest - values.numel())))
    return torch.cat([part[: int(n.item())] for part, n in zip(parts, counts, strict=True)])


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer is one unit, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
        )


LEAVE_TIMEOUT_S = 120.0
"""How long a rank leaving its group waits for the others at the barrier (gloo) before it fails."""


def shutdown_distributed() -> None:
    """Leave the process group at the end of this rank's part in it; every rank calls it (a collective).

    A barrier first: once it returns every rank has finished every collective, so none closes its
    connections under a peer still working on one. Then the group is destroyed. Under FSDP2 that does
    not stop gloo's threads: DTensor's caches keep the device mesh, and through it the group, alive
    until the process ends. A process that ends after this should therefore end without the
    interpreter's finalization (`os._exit`, as `ray.kill` ends the actors): a C++ thread that takes the
    GIL while CPython finalizes is ended from inside C++ code, which aborts the process ("terminate
    called without an active exception")."""
    if dist.is_initialized():
        if dist.get_backend() == "gloo":  # bounded: a dead peer fails the barrier, not 30 minutes later
            dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
        else:
            dist.barrier()
        dist.destroy_process_group()
