"""From stored trajectory groups to training rows (`TrainRow`), and the rows' split over FSDP ranks
(`shard_groups`) and into the same number of micro-batches on every rank (`equalize_micro_batches`).

Each episode contributes one row per segment, carrying the episode's group-relative advantage (fixed
when the group was stored, so a replayed group trains with the same advantages). Infra-error episodes
are masked out: an engine or sandbox failure says nothing about the policy, so it is never scored 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reflow.records import Segment
from reflow.replay import StoredGroup
from reflow.train.advantages import valid_for_training


@dataclass
class TrainRow:
    """One training row: a segment of an episode and that episode's (group-relative) advantage."""

    segment: Segment
    advantage: float
    group_id: str = ""
    version: int = 0
    """The oldest policy version among the row's sampled tokens (its staleness; `batch.oldest_version`)."""
    replayed: bool = False
    """The row's group was trained on by an earlier step (for `LossConfig.replay_clip`)."""


def trained_before(group: StoredGroup, step: int) -> bool:
    """Whether a step before `step` trained on the group. Modes differ in when they mark a step's
    groups consumed: sync after the update, the decoupled modes when they plan it (so a fresh group
    may already show this step's use). A use by `step` itself does not count."""
    return group.consumed - (group.last_step == step) > 0


def rows_from_groups(groups: Iterable[StoredGroup], step: int | None = None) -> list[TrainRow]:
    """The rows of `groups`, for the update of `step` (None: every row counts as fresh)."""
    rows: list[TrainRow] = []
    for group in groups:
        replayed = step is not None and trained_before(group, step)
        for episode, advantage in zip(group.episodes, group.advantages, strict=True):
            if not valid_for_training(episode.status):
                continue
            rows += [
                TrainRow(segment, advantage, group.group_id, oldest_version(segment), replayed)
                for segment in episode.segments
                if segment.n_sampled > 0
            ]
    return rows


def oldest_version(segment: Segment) -> int:
    """The oldest policy version among a segment's sampled tokens (its row's staleness)."""
    return min(v for v, m in zip(segment.versions, segment.loss_mask, strict=True) if m)


def shard_groups(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Indexes of the items (groups of a batch, or rows) each rank trains on, balanced by size (largest
    first, to the lightest rank; ties by position), so that each rank fetches only its own groups from
    the replay store. Deterministic: every rank computes the same split from the same sizes."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = load.index(min(load))
        shards[rank].append(i)
        load[rank] += sizes[i]
    return [sorted(s) for s in shards]


def equalize_micro_batches(batches: list[list[TrainRow]], target: int, pad_id: int) -> list[list[TrainRow]]:
    """`target` micro-batches from `batches`: under FSDP2 every forward and backward gathers the
    sharded parameters collectively, so every rank must run the same number of them, whatever its
    share of the rows. Splits the largest micro-batches first, then adds dummy rows that carry no loss
    token (a rank with fewer rows than the others, or none)."""
    out = [list(b) for b in batches if b]
    while len(out) < target:
        big = max(range(len(out)), key=lambda i: len(out[i]), default=None)
        if big is not None and len(out[big]) > 1:
            rows = out.pop(big)
            out += [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        else:
            dummy = Segment(0)
            dummy.extend_prompt([pad_id, pad_id])  # prompt tokens only: loss mask 0 everywhere
            out.append([TrainRow(dummy, 0.0)])
    return out
