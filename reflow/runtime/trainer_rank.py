"""A run's trainer ranks, Ray actors: a trainer rank reads groups from the replay store, takes its share
of the rows and does one update (FSDP2 across ranks). A plain class, made remote by
`reflow.runtime.cluster` on a device slot, so it can also be used in-process (tests, debugging).
"""

from __future__ import annotations

from typing import Any

import ray

from reflow.config import RunConfig
from reflow.runtime.workers import torch_threads


class TrainerRank:
    """One trainer rank on one device slot; several ranks shard the model with FSDP2."""

    def __init__(
        self, config: RunConfig, model_path: str, replay: Any, rank: int = 0, world_size: int = 1
    ) -> None:
        self.config, self.model_path = config, model_path
        self.replay, self.rank, self.world_size = replay, rank, world_size

    def setup(self, master: tuple[str, int] | None = None) -> None:
        """Join the process group (several ranks), load the model, build the trainer. Separate from
        `__init__` because every rank must be created before rank 0 can publish its address."""
        import torch
        from transformers.utils import logging as hf_logging

        from reflow.models import load_model
        from reflow.train.distributed import init_distributed
        from reflow.train.lora import load_lora_model
        from reflow.train.trainer import PolicyTrainer

        hf_logging.disable_progress_bar()  # a progress bar per checkpoint save is noise in the run log
        config = self.config
        torch.set_num_threads(torch_threads(config))
        torch.manual_seed(config.seed)
        if self.world_size > 1:
            if master is None:
                raise ValueError("several trainer ranks need the rank-0 address")
            backend = "nccl" if config.resources.device == "cuda" else "gloo"
            init_distributed(self.rank, self.world_size, master[0], master[1], backend)
        lora = config.model.lora_settings()
        if lora is None:
            model, self.tokenizer = load_model(self.model_path, device=config.resources.device)
        else:  # the base with adapters (a resumed run's own; the checkpoint or `load_full_state` follows)
            model, self.tokenizer = load_lora_model(
                self.model_path, lora, device=config.resources.device, seed=config.seed
            )
        settings = config.train.trainer_config(
            behaviour_is_prox=config.mode == "sync" and not config.train.engine_correction,
            temperature=config.rollout.temperature or 1.0,
            seed=config.seed,
            lora=lora,
        )
        self.trainer = PolicyTrainer(model, self.tokenizer.pad_token_id, settings)

    def prepare(self) -> None:
        """Import what `setup` needs (torch, transformers, the trainer): a rank started by a role change
        is a ready process before the group forms, so its start is timed as actor start, not re-form."""
        import torch.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401

        import reflow.models
        import reflow.train.trainer  # noqa: F401

    def leave(self) -> None:
        """Leave the process group (every rank does, before a new group forms: `reform`, or before its
        slot goes to rollout). `shutdown_distributed`: a barrier, so no rank tears its connections down
        under a peer still in a collective, then the group goes. The actor process itself is ended by
        `ray.kill`, without the interpreter's finalization that gloo's threads do not survive."""
        from reflow.train.distributed import shutdown_distributed

        shutdown_distributed()

    def reform(self, rank: int, world_size: int, master: tuple[str, int] | None = None) -> None:
        """Join a new group as `rank` of `world_size` (the elastic pool's role change): leave the old one,
        rebuild the model from the model path and shard it anew (an FSDP2 module cannot be re-sharded
        in place). The current weights and optimizer state come after (`load_full_state`)."""
        self.leave()
        self.rank, self.world_size = rank, world_size
        self.trainer = None  # the old sharded model goes before the new one is built
        self.setup(master)

    def full_state(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(full weights, the rest: optimizer state, step, version, the trainer's RNG) on rank 0, (None,
        None) elsewhere; collective: call on every rank. The optimizer state is keyed by parameter
        name whatever the world size, so a group of another size loads it (`load_full_state`)."""
        t = self.trainer
        model, optim = t.full_state_dict(), t.optimizer_state()
        if self.rank != 0:
            return None, None
        rest = {"optimizer": optim, "step": t.step, "version": t.version, "rng": t.rng.getstate()}
        return model, rest

    def load_full_state(self, model: dict[str, Any], rest: dict[str, Any]) -> int:
        """Load what `full_state` returned (every rank gets the full state); returns the version."""
        t = self.trainer
        t.load_state(model, rest["optimizer"])
        t.step, t.version = rest["step"], rest["version"]
        t.rng.setstate(rest["rng"])  # as a checkpoint restores it: every rank takes rank 0's
        return t.version

    def train_step(self, group_ids: list[str], step: int) -> dict[str, float]:
        """One update on the batch `group_ids`. With several ranks each fetches only its share of the
        groups (balanced by generated tokens, the same split on every rank): the replay actor sends
        every record once per step, not once per rank. Each rank then writes back the importance-weight
        statistics of its groups (`ReplayStore.set_use_stats`), before the step counts as done, so
        the next plan after it ranks replay candidates by them."""
        from reflow.train.batch import rows_from_groups, shard_groups

        mine = group_ids
        if self.world_size > 1:
            sizes = ray.get(self.replay.group_sizes.remote(group_ids))
            shares = shard_groups([sizes[g] for g in group_ids], self.world_size)
            mine = [group_ids[i] for i in shares[self.rank]]
        groups = ray.get(self.replay.groups.remote(mine)) if mine else []
        metrics = self.trainer.train_step(rows_from_groups(groups, step), step=step)
        if self.trainer.group_stats:  # each rank writes back its own groups' (a group is on one rank)
            ray.get(self.replay.set_use_stats.remote(self.trainer.group_stats, step))
        return metrics

    def state_dict(self) -> dict[str, Any] | None:
        """Full weights on rank 0 (None on the others); collective: call on every rank."""
        state = self.trainer.full_state_dict()
        return state if self.rank == 0 else None

    def save_checkpoint(self, root: str, extra: dict[str, Any], keep: int) -> str | None:
        from reflow.train.trainer_state import save_checkpoint

        path = save_checkpoint(root, self.trainer, self.tokenizer, extra=extra, keep=keep)
        return str(path) if path else None

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from reflow.train.trainer_state import load_checkpoint

        return load_checkpoint(path, self.trainer)

    def version(self) -> int:
        return self.trainer.version

    def node_id(self) -> str:
        """The Ray node this rank runs on (a lent engine is placed beside it)."""
        return ray.get_runtime_context().get_node_id()

    def master_address(self) -> tuple[str, int]:
        """A free TCP port on this rank's node, for the process group rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]
