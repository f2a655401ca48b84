"""Summary figures of a replay store (what `reflow replay inspect` shows and `ReplayStore.stats` returns).

Computed from the indexed columns only, never from the record blobs, so inspecting a large store is
quick. Success rate, mean reward, turn percentiles and status counts come from `episode_stats`, the one
definition the envs and rollout summaries use too.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from reflow.env.play import episode_stats

GroupRow = tuple[int, int, float, int, float]
"""policy_version, n_episodes, reward_spread, consumed, created_at"""
EpisodeRow = tuple[int, str, float, int, int, int]
"""policy_version_start, status, reward, success, n_turns, n_generated_tokens"""


def _percentiles(values: list[int]) -> dict[str, float]:
    arr = np.array(values or [0])
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)), "max": int(arr.max())}


def summarize(groups: list[GroupRow], episodes: list[EpisodeRow], in_flight: int) -> dict[str, Any]:
    """Counts (groups, episodes, consumed/unconsumed, in flight, zero-spread), success/reward/turns/statuses
    overall and by policy version, generated tokens, the reuse histogram and the age range."""
    overall = episode_stats(
        [bool(e[3]) for e in episodes],
        [e[2] for e in episodes],
        [e[4] for e in episodes],
        [e[1] for e in episodes],
    )
    tokens = [e[5] for e in episodes]
    by_version: dict[int, list[EpisodeRow]] = defaultdict(list)
    for e in episodes:
        by_version[e[0]].append(e)
    groups_by_version = Counter(g[0] for g in groups)
    versions = []
    for v in sorted(by_version):
        rows = by_version[v]
        s = episode_stats(
            [bool(e[3]) for e in rows], [e[2] for e in rows], [e[4] for e in rows], [e[1] for e in rows]
        )
        versions.append(
            {
                "policy_version": v,
                "groups": groups_by_version.get(v, 0),
                **s,
                "generated_tokens": int(sum(e[5] for e in rows)),
            }
        )
    consumed = [g[3] for g in groups]
    created = [g[4] for g in groups]
    return {
        "groups": len(groups),
        "groups_consumed": sum(c > 0 for c in consumed),
        "groups_unconsumed": sum(c == 0 for c in consumed),
        "groups_zero_spread": sum(g[2] == 0 for g in groups),
        "in_flight": in_flight,
        **overall,
        "generated_tokens": int(sum(tokens)),
        "generated_tokens_per_episode": _percentiles(tokens),
        "policy_versions": [min(g[0] for g in groups), max(g[0] for g in groups)] if groups else [],
        "by_version": versions,
        "reuse_histogram": {int(k): v for k, v in sorted(Counter(consumed).items())},
        "consumptions": int(sum(consumed)),
        "oldest_created_at": min(created) if created else None,
        "newest_created_at": max(created) if created else None,
    }
