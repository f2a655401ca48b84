"""The replay store: every accepted trajectory group, durable on disk with its full per-turn records.

Why SQLite, in WAL mode with synchronous=FULL:
- one file per run (`runs/<name>/replay.sqlite`), Python's standard library only, nothing to deploy;
- a group and all its episodes are written in one transaction, so a reader, or a run restarted after a
  crash, sees the whole group or none of it: never a half-written one;
- with synchronous=FULL a commit returns only once the write-ahead log is fsynced, so `add_group`
  returning (the acknowledgement) means the group survives kill -9 and power loss; WAL also lets
  `reflow replay inspect` read while the run writes;
- indexed queries by run, policy version, group and consumption count, which the dual replay cycle
  needs, without reading the record blobs.

What it keeps for the replay cycle (the planning lives in reflow/replay/planning.py, the policies in
reflow/policy/dual_cycle.py; this module only answers queries): arrival order (`seq`), the oldest
and newest policy versions among a group's sampled tokens, its reward spread, how often trainer steps
consumed it and which step last did, wall-clock creation time, the GRPO advantages fixed at creation,
the groups in flight (for admission control) and a small cursor table saved with checkpoints. Planning reads the index columns only (`GroupInfo`: `fresh`,
`replayable`); records are decoded only for the groups a step trains (`groups`).

Lineage: each run epoch (a run started, or resumed from a checkpoint) is a lineage; every group carries
the one whose weights made it. A resumed run starts a new lineage forked from its checkpoint's
(`start_lineage`), so no (lineage, version) pair names two weight sets, and quarantines every group not
made by an ancestor of its weights (`quarantine`: a version newer than the checkpoint in the crashed
lineage, or a dead branch): quarantined groups are never trained, replayed or counted as accepted.

Consumption is part of a run's checkpointed state: every mark is logged per (group, step), and a run
resumed from the checkpoint of step S undoes the marks of steps after S (`rollback_consumption`), which
the restored weights never trained on: their groups are fresh, or replayable, again.
The table layout, the record codec and the migrations are in reflow/replay/schema.py.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from reflow.records import EpisodeRecord
from reflow.replay.schema import (
    EPISODE_COLS,
    GROUP_INSERT,
    INFO_COLS,
    RECOUNT,
    SCHEMA_VERSION,
    decode_record,
    dumps,
    encode_record,
    episode_columns,
    migrate,
    pass_rate,
    reward_spread,
    statements,
)

_PAGE = 256  # episodes decoded per lock hold when iterating, so other threads are not starved


@dataclass
class GroupInfo:
    """A group's index columns: what planning and admission read, no record decoded."""

    group_id: str
    seq: int
    """Arrival order (monotonic, never reused)."""
    policy_version: int
    """The group's age: the oldest policy version among its episodes' sampled tokens
    (`EpisodeRecord.oldest_version`). Every staleness bound (tau_max, eta) and metric reads it."""
    reward_spread: float
    """max - min reward over the group's episodes, infra_error episodes left out (they are masked);
    0.0 within `records.SPREAD_TOL`."""
    consumed: int
    """How many trainer steps consumed the group."""
    last_step: int | None
    meta: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    created_at: float = 0.0
    """Wall-clock seconds (time.time()) when the group was stored, for age in seconds."""
    newest_version: int = 0
    """The newest policy version among its sampled tokens: which weights it needs as ancestors."""
    lineage: int = 0
    """The run epoch whose weights made it (see the module docstring)."""
    quarantined: bool = False
    """Made by weights a resumed run lost: never trained."""
    n_episodes: int = 0
    pass_rate: float = 0.0
    """The share of its trained (not masked) episodes that succeeded."""
    last_use: UseStats | None = None
    """The importance-weight statistics of its last use, as the trainer wrote them back; None before."""


@dataclass(frozen=True)
class UseStats:
    """How far a group's data was from the trainer's weights when a step last trained on it, over the
    group's loss-mask tokens, with w = pi_prox / pi_behav (the trainer's pre-update weights over the
    engine's sampling policy). Written back per group by the trainer (`ReplayStore.set_use_stats`);
    replay selection reads it (`reflow.policy.replay_selection`)."""

    ess: float
    """Normalised effective sample size of w: (sum w)^2 / (n sum w^2), 1 when every weight is equal."""
    clip_frac: float
    """The share of tokens whose w is already past PPO's clip range in its advantage's direction (w >
    1 + clip_eps_high with A > 0, w < 1 - clip_eps with A < 0): how much of the group the policy has
    moved past a trust region's width since it was sampled (with `loss.replay_clip` such tokens of a
    replayed row give no gradient; without it they still do)."""
    kl_behav: float
    """k3 estimate of KL(behaviour || prox): mean(w - 1 - log w)."""


@dataclass
class StoredGroup(GroupInfo):
    """A group with its records: what a trainer step reads (`ReplayStore.groups`)."""

    episodes: list[EpisodeRecord] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    """One per episode, fixed at creation (GRPO); replay reuses them."""


class ReplayStore:
    """Trajectory groups of one run in one SQLite file (several runs may share a file).

    Thread-safe: one connection guarded by a lock, so a Ray actor or asyncio code running calls in
    threads can share it; other processes may open the same file (WAL readers never block the writer).
    """

    def __init__(self, path: str | Path, run: str = "default", *, compress: bool = True) -> None:
        self.path = Path(path)
        self.run = run
        self.compress = compress
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # Autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE) and nothing is left
        # pending in a driver-managed transaction.
        self._db = sqlite3.connect(
            str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False
        )
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            self._db.close()
            raise RuntimeError(
                f"{self.path}: SQLite refused WAL mode ({mode}); is it on a network file system?"
            )
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        try:
            with self._write():
                for statement in statements():
                    self._db.execute(statement)
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise RuntimeError(
                        f"{self.path}: replay schema {version}, this ReFlow reads {SCHEMA_VERSION}"
                    )
                migrate(self._db, version)
                for statement in statements(indexes=True):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            self._db.close()
            raise
        self.lineage: int = self.latest_lineage()
        """The lineage the groups stored from now on carry (`start_lineage`)."""

    # ---- transactions

    @contextmanager
    def _write(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction. durable=False skips the fsync of this commit (the next durable
        commit fsyncs the log up to and including it): for in-flight bookkeeping only."""
        with self._lock:
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # also when COMMIT itself failed (disk full, I/O error)
                        self._db.execute("ROLLBACK")
                    raise
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every query inside sees the same snapshot."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    # ---- writing

    def add_group(
        self, episodes: list[EpisodeRecord], advantages: list[float], *, meta: dict[str, Any] | None = None
    ) -> StoredGroup:
        """Store a group; it is committed and fsynced before this returns. Also ends it in flight."""
        if not episodes:
            raise ValueError("a group needs at least one episode")
        group_ids = {e.group_id for e in episodes}
        if len(group_ids) != 1:
            raise ValueError(f"episodes of one group must share one group_id, got {sorted(group_ids)}")
        if len(advantages) != len(episodes):
            raise ValueError(f"{len(advantages)} advantages for {len(episodes)} episodes")
        episode_ids = [e.episode_id for e in episodes]
        if len(set(episode_ids)) != len(episode_ids):
            raise ValueError("duplicate episode_id within the group")
        (group_id,) = group_ids
        advantages = [float(a) for a in advantages]
        meta = dict(meta or {})
        version = min(e.oldest_version for e in episodes)
        newest = max(e.newest_version for e in episodes)
        spread, passed = reward_spread(episodes), pass_rate(episodes)
        blobs = [(e, encode_record(e, self.compress)) for e in episodes]  # CPU work outside the lock
        created_at = time.time()
        adv_json, meta_json = dumps(advantages), dumps(meta)
        group_row = (
            self.run, group_id, version, newest, self.lineage, len(episodes), spread, adv_json, created_at,
            meta_json, passed,
        )  # fmt: skip
        with self._write() as db:
            try:
                cur = db.execute(
                    f"INSERT INTO groups ({GROUP_INSERT}) VALUES ({', '.join('?' * len(group_row))})",
                    group_row,
                )
            except sqlite3.IntegrityError:
                raise ValueError(f"group {group_id!r} is already in the store") from None
            seq = cur.lastrowid
            rows = [
                (self.run, e.episode_id, seq, i, *episode_columns(e), *blob)
                for i, (e, blob) in enumerate(blobs)
            ]
            try:
                db.executemany(f"INSERT INTO episodes VALUES ({', '.join('?' * 14)})", rows)
            except sqlite3.IntegrityError:
                raise ValueError(f"group {group_id!r}: an episode_id is already in the store") from None
            db.execute("DELETE FROM in_flight WHERE run = ? AND group_id = ?", (self.run, group_id))
        assert seq is not None
        return StoredGroup(
            group_id, seq, version, spread, 0, None, meta, self.run, created_at, newest, self.lineage,
            False, len(episodes), passed, None, list(episodes), advantages,
        )  # fmt: skip

    def mark_consumed(self, group_ids: list[str], step: int) -> None:
        """One trainer step consumed these groups: consumed += 1 and last_step = step for each (a group
        listed twice counts once), logged per (group, step), in one transaction. An unknown id raises
        KeyError, a group this step already consumed ValueError; either way nothing changes."""
        now = time.time()
        with self._write() as db:
            for gid in dict.fromkeys(group_ids):
                cur = db.execute(
                    "UPDATE groups SET consumed = consumed + 1, last_step = max(coalesce(last_step, ?), ?) "
                    "WHERE run = ? AND group_id = ?",
                    (step, step, self.run, gid),
                )
                if cur.rowcount != 1:
                    raise KeyError(f"no group {gid!r} in run {self.run!r}")
                try:
                    db.execute("INSERT INTO consumptions VALUES (?, ?, ?, ?)", (self.run, gid, step, now))
                except sqlite3.IntegrityError:
                    raise ValueError(f"group {gid!r} was already consumed by step {step}") from None

    def set_use_stats(self, stats: dict[str, UseStats | None], step: int) -> None:
        """Write back what trainer step `step` measured on each group it trained (`UseStats`; None: it
        trained the group without measuring it), replacing the previous use's; unknown ids are
        ignored. A rollback past `step` forgets them (`rollback_consumption`). Not durable on its
        own: a crash loses at most the last step's statistics, which only rank replay candidates."""
        rows = [
            (*((s.ess, s.clip_frac, s.kl_behav) if s else (None, None, None)), step, self.run, gid)
            for gid, s in stats.items()
        ]
        if not rows:
            return
        with self._write(durable=False) as db:
            db.executemany(
                "UPDATE groups SET last_ess = ?, last_clip_frac = ?, last_kl_behav = ?, last_use_step = ? "
                "WHERE run = ? AND group_id = ?",
                rows,
            )

    def rollback_consumption(self, after_step: int) -> int:
        """Undo the consumptions by steps after `after_step` (a run resumed from that step's checkpoint,
        0: from the start; the restored weights never saw those steps), recounting consumed and
        last_step from the log in the same transaction, and forgets the use statistics those steps
        wrote back. Returns how many were undone. Zero-spread
        groups those steps retired are fresh again (the next plan retires them again); admission's
        `accepted_groups` counts groups stored, not consumed, and does not change."""
        if after_step < 0:
            raise ValueError(f"after_step must be >= 0, got {after_step}")
        with self._write() as db:
            undone = db.execute(
                "DELETE FROM consumptions WHERE run = ? AND step > ?", (self.run, after_step)
            ).rowcount
            db.execute(RECOUNT, (self.run,))
            # what those steps measured came from weights the resumed run never had
            db.execute(
                "UPDATE groups SET last_ess = NULL, last_clip_frac = NULL, last_kl_behav = NULL, "
                "last_use_step = NULL WHERE run = ? AND last_use_step > ?",
                (self.run, after_step),
            )
        return undone

    def consumptions(self) -> list[tuple[str, int, float]]:
        """The consumption log of this run: (group_id, step, consumed_at) per mark, by step."""
        with self._lock:
            return self._db.execute(
                "SELECT group_id, step, consumed_at FROM consumptions WHERE run = ? ORDER BY step, group_id",
                (self.run,),
            ).fetchall()

    # ---- admission control: groups handed to rollout and not yet stored

    def begin_group(self, group_id: str, policy_version: int) -> None:
        with self._write(durable=False) as db:
            db.execute(
                "INSERT OR REPLACE INTO in_flight VALUES (?, ?, ?, ?)",
                (self.run, group_id, policy_version, time.time()),
            )

    def end_group(self, group_id: str) -> None:
        """Forget an in-flight group (dropped or failed); `add_group` ends it by itself."""
        with self._write(durable=False) as db:
            db.execute("DELETE FROM in_flight WHERE run = ? AND group_id = ?", (self.run, group_id))

    def in_flight(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM in_flight WHERE run = ?", (self.run,)).fetchone()[0]

    def in_flight_groups(self) -> dict[str, int]:
        """group_id -> the policy version it was started with."""
        with self._lock:
            rows = self._db.execute(
                "SELECT group_id, policy_version FROM in_flight WHERE run = ?", (self.run,)
            )
            return dict(rows.fetchall())

    def clear_in_flight(self) -> int:
        """Forget every in-flight group of this run (a resumed run: the old process's groups never
        arrive). Returns how many there were. Not done on open, since readers open the file too."""
        with self._write(durable=False) as db:
            return db.execute("DELETE FROM in_flight WHERE run = ?", (self.run,)).rowcount

    # ---- lineage: which weights made a group, across resumes

    def start_lineage(self, fork_version: int, parent: int | None) -> int:
        """Start a run epoch: a run starting afresh (`parent` None) or resumed from a checkpoint made in
        lineage `parent` with weights of `fork_version`. Groups stored from now on carry the new id,
        which is returned; call `quarantine` next."""
        if fork_version < 0:
            raise ValueError(f"fork_version must be >= 0, got {fork_version}")
        with self._write() as db:
            if (
                parent is not None
                and not db.execute(
                    "SELECT 1 FROM lineages WHERE run = ? AND lineage = ?", (self.run, parent)
                ).fetchone()
            ):  # a store older than lineages: its groups are lineage 0, a root
                db.execute("INSERT INTO lineages VALUES (?, ?, NULL, 0, ?)", (self.run, parent, time.time()))
            (top,) = db.execute("SELECT MAX(lineage) FROM lineages WHERE run = ?", (self.run,)).fetchone()
            lineage = 0 if top is None else top + 1
            db.execute(
                "INSERT INTO lineages VALUES (?, ?, ?, ?, ?)",
                (self.run, lineage, parent, fork_version, time.time()),
            )
        self.lineage = lineage
        return lineage

    def ancestors(self) -> list[tuple[int, int | None]]:
        """(lineage, newest version whose weights are an ancestor of the current ones; None: any), from
        the current lineage up its resume chain."""
        return ancestors(self.lineage, self._links())

    def quarantine(self) -> int:
        """Mark every group not made by ancestors of the current lineage's weights as quarantined (a
        newer version than the checkpoint in a lineage that crashed, or a dead branch; `made_by_ancestor`).
        Returns how many groups this newly marked."""
        links = self._links()
        chain = dict(ancestors(self.lineage, links))
        with self._write() as db:
            rows = db.execute(
                "SELECT seq, lineage, newest_version FROM groups WHERE run = ? AND quarantined = 0",
                (self.run,),
            ).fetchall()
            dead = [
                (seq,) for seq, lineage, newest in rows if not made_by_ancestor(lineage, newest, links, chain)
            ]
            db.executemany("UPDATE groups SET quarantined = 1 WHERE seq = ?", dead)
        return len(dead)

    def _links(self) -> dict[int, tuple[int | None, int]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT lineage, parent, fork_version FROM lineages WHERE run = ?", (self.run,)
            ).fetchall()
        return {lineage: (parent, fork) for lineage, parent, fork in rows}

    def quarantined(self) -> list[str]:
        """The ids of the quarantined groups, in arrival order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT group_id FROM groups WHERE run = ? AND quarantined = 1 ORDER BY seq", (self.run,)
            )
            return [r[0] for r in rows.fetchall()]

    def latest_lineage(self) -> int:
        """The newest lineage of this run in the file (0 in a file with none)."""
        with self._lock:
            (top,) = self._db.execute(
                "SELECT MAX(lineage) FROM lineages WHERE run = ?", (self.run,)
            ).fetchone()
        return 0 if top is None else top

    # ---- cursor: small JSON values saved with checkpoints

    def set_cursor(self, key: str, value: Any) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO cursor VALUES (?, ?, ?)", (self.run, key, dumps(value)))

    def get_cursor(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM cursor WHERE run = ? AND key = ?", (self.run, key)
            ).fetchone()
        return json.loads(row[0]) if row else default

    # ---- queries

    def max_meta(self, key: str) -> Any:
        """The largest value of `meta[key]` over this run's groups (None: no group has it), e.g. the
        last task seed used."""
        if not key.isidentifier():
            raise ValueError(f"meta key must be an identifier, got {key!r}")
        with self._lock:
            return self._db.execute(
                "SELECT MAX(json_extract(meta, ?)) FROM groups WHERE run = ?", (f"$.{key}", self.run)
            ).fetchone()[0]

    def fresh(self, limit: int | None = None) -> list[GroupInfo]:
        """Groups no trainer step consumed yet (quarantined ones left out), in arrival order; index
        columns only (`groups` reads the records)."""
        return self._infos("quarantined = 0 AND consumed = 0", (), "seq", limit)

    def replayable(
        self,
        *,
        current_version: int,
        tau_max: int,
        max_reuse: int,
        limit: int | None = None,
        prefer_spread: bool = True,
        rank_by_spread: bool = False,
    ) -> list[GroupInfo]:
        """Groups consumed at least once and fewer than `max_reuse` times (max_reuse counts every
        consumption, the fresh one included), whose oldest token is at most `tau_max` versions before
        `current_version`, quarantined ones left out; index columns only. Groups with reward spread
        come first (with prefer_spread; rank_by_spread: the largest spread first), then the newest:
        latest policy version, then latest arrival."""
        order = "policy_version DESC, seq DESC"
        if rank_by_spread:
            order = "reward_spread DESC, " + order
        elif prefer_spread:
            order = "(reward_spread > 0) DESC, " + order
        where = "quarantined = 0 AND consumed >= 1 AND consumed < ? AND policy_version >= ?"
        return self._infos(where, (max_reuse, current_version - tau_max), order, limit)

    def group(self, group_id: str) -> StoredGroup:
        return self.groups([group_id])[0]

    def groups(self, group_ids: list[str]) -> list[StoredGroup]:
        """Several groups in one read, in the order asked; a missing one raises KeyError."""
        found: dict[str, StoredGroup] = {}
        unique = list(dict.fromkeys(group_ids))
        for i in range(0, len(unique), 500):
            chunk = unique[i : i + 500]
            marks = ",".join("?" * len(chunk))
            found.update(
                (g.group_id, g) for g in self._groups(f"group_id IN ({marks})", tuple(chunk), "seq", None)
            )
        missing = [g for g in unique if g not in found]
        if missing:
            raise KeyError(f"no group {missing[0]!r} in run {self.run!r}")
        return [found[g] for g in group_ids]

    def group_sizes(self, group_ids: list[str]) -> dict[str, int]:
        """Generated tokens per group, from the index columns (no record is decoded): what trainer
        ranks balance their shares of a batch by before each fetches only its own groups."""
        sizes: dict[str, int] = {}
        unique = list(dict.fromkeys(group_ids))
        with self._lock:
            for i in range(0, len(unique), 500):
                chunk = unique[i : i + 500]
                sizes.update(
                    self._db.execute(
                        "SELECT g.group_id, SUM(e.n_generated_tokens) FROM groups g JOIN episodes e "
                        f"ON e.group_seq = g.seq WHERE g.run = ? AND g.group_id IN ({','.join('?' * len(chunk))}) "
                        "GROUP BY g.seq",
                        (self.run, *chunk),
                    ).fetchall()
                )
        missing = [g for g in unique if g not in sizes]
        if missing:
            raise KeyError(f"no group {missing[0]!r} in run {self.run!r}")
        return sizes

    def count(self, *, consumed: bool | None = None) -> int:
        """Number of groups of this run; consumed=True/False: only those consumed at least once / never."""
        where = {None: "", True: " AND consumed > 0", False: " AND consumed = 0"}[consumed]
        with self._lock:
            return self._db.execute(
                f"SELECT COUNT(*) FROM groups WHERE run = ?{where}", (self.run,)
            ).fetchone()[0]

    def reuse_histogram(self, *, spread: bool | None = None) -> dict[int, int]:
        """Consumption count -> number of groups of this run (0: never consumed), from the group rows
        only, quarantined groups left out; spread=True/False: only groups with / without reward
        spread. For per-step metrics and for admission control, which counts groups with spread."""
        where = {None: "", True: " AND reward_spread > 0", False: " AND reward_spread = 0"}[spread]
        with self._lock:
            rows = self._db.execute(
                f"SELECT consumed, COUNT(*) FROM groups WHERE run = ? AND quarantined = 0{where} "
                "GROUP BY consumed ORDER BY consumed",
                (self.run,),
            ).fetchall()
        return dict(rows)

    def episodes(self, *, run: str | None = None, min_version: int | None = None) -> Iterator[EpisodeRecord]:
        """Every stored episode in arrival order (group by group). run=None: every run in the file, not
        just this store's; min_version filters on the episode's policy_version_start."""
        for _row, record in self._episode_rows(run, min_version):
            yield EpisodeRecord.from_dict(record)

    def rows(self, *, run: str | None = None) -> Iterator[dict[str, Any]]:
        """One dict per episode for export: the indexed and group columns, plus `record` (the full
        record as a dict). run=None means this store's run."""
        for row, record in self._episode_rows(run or self.run, None):
            run_, _eid, seq, idx, group_id, gversion, advantages, spread, consumed, last_step, created = row
            yield {
                "run": run_, "group_id": group_id, "seq": seq, "index_in_group": idx,
                "group_policy_version": gversion, "advantage": json.loads(advantages)[idx],
                "reward_spread": spread, "consumed": consumed, "last_step": last_step,
                "created_at": created, "record": record,
            }  # fmt: skip

    def runs(self) -> list[str]:
        """The run names with groups in this file."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT run FROM groups ORDER BY run")]

    def stats(self) -> dict[str, Any]:
        """Counts, reward/success by version, statuses, lengths, tokens and reuse: see replay.stats."""
        from reflow.replay.stats import summarize

        with self._read() as db:
            groups = db.execute(
                "SELECT policy_version, n_episodes, reward_spread, consumed, created_at FROM groups WHERE run = ?",
                (self.run,),
            ).fetchall()
            episodes = db.execute(
                "SELECT policy_version_start, status, reward, success, n_turns, n_generated_tokens "
                "FROM episodes WHERE run = ?",
                (self.run,),
            ).fetchall()
            in_flight = db.execute("SELECT COUNT(*) FROM in_flight WHERE run = ?", (self.run,)).fetchone()[0]
        return {"run": self.run, "path": str(self.path), **summarize(groups, episodes, in_flight)}

    def export(self, out: str | Path, fmt: Literal["parquet", "jsonl"] = "parquet") -> Path:
        """One row per episode (flat columns, the turns, and the full record): see replay.export."""
        from reflow.replay.export import export_rows

        return export_rows(self.rows(), out, fmt)

    def integrity_check(self) -> str:
        with self._lock:
            return self._db.execute("PRAGMA integrity_check").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplayStore({str(self.path)!r}, run={self.run!r})"

    # ---- internals

    def _infos(self, where: str, params: tuple, order: str, limit: int | None) -> list[GroupInfo]:
        sql = f"SELECT {INFO_COLS} FROM groups WHERE run = ? AND {where} ORDER BY {order} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (self.run, *params, -1 if limit is None else limit)).fetchall()
        return [_info(row) for row in rows]

    def _groups(self, where: str, params: tuple, order: str, limit: int | None) -> list[StoredGroup]:
        sql = f"SELECT {INFO_COLS}, advantages FROM groups WHERE run = ? AND {where} ORDER BY {order} LIMIT ?"
        blobs: list[tuple[int, str, bytes]] = []
        with self._read() as db:
            rows = db.execute(sql, (self.run, *params, -1 if limit is None else limit)).fetchall()
            seqs = [r[0] for r in rows]
            for i in range(0, len(seqs), 500):
                chunk = seqs[i : i + 500]
                blobs += db.execute(
                    f"SELECT group_seq, codec, record FROM episodes WHERE group_seq IN ({','.join('?' * len(chunk))}) "
                    "ORDER BY group_seq, idx",
                    chunk,
                ).fetchall()
        # Decoding (zlib + JSON) runs outside the lock: readers in other threads are not held up by it.
        by_seq: dict[int, list[EpisodeRecord]] = {seq: [] for seq in seqs}
        for seq, codec, blob in blobs:
            by_seq[seq].append(EpisodeRecord.from_dict(decode_record(codec, blob)))
        out = []
        for row in rows:
            info, seq = _info(row[:-1]), row[0]
            if len(by_seq[seq]) != info.n_episodes:  # cannot happen short of file corruption: fail loudly
                raise RuntimeError(
                    f"group {info.group_id!r} has {len(by_seq[seq])} of its {info.n_episodes} episodes"
                )
            out.append(StoredGroup(**vars(info), episodes=by_seq[seq], advantages=json.loads(row[-1])))
        return out

    def _episode_rows(
        self, run: str | None, min_version: int | None
    ) -> Iterator[tuple[tuple, dict[str, Any]]]:
        """Keyset pagination over (group_seq, idx): the lock is held per page, never across a yield."""
        where, params = ["(e.group_seq, e.idx) > (?, ?)"], []
        if run is not None:
            where.append("e.run = ?")
            params.append(run)
        if min_version is not None:
            where.append("e.policy_version_start >= ?")
            params.append(min_version)
        sql = (
            f"SELECT {EPISODE_COLS} FROM episodes e JOIN groups g ON g.seq = e.group_seq "
            f"WHERE {' AND '.join(where)} ORDER BY e.group_seq, e.idx LIMIT {_PAGE}"
        )
        last: tuple[int, int] = (-1, -1)
        while True:
            with self._lock:
                page = self._db.execute(sql, (*last, *params)).fetchall()
            for row in page:
                yield row[:-2], decode_record(row[-2], row[-1])
            if len(page) < _PAGE:
                return
            last = (page[-1][2], page[-1][3])


def _info(row: tuple) -> GroupInfo:
    """A `GroupInfo` from a row of `INFO_COLS`."""
    seq, run, gid, version, newest, lineage, quarantined, n, spread, consumed, last_step, created, meta = row[
        :13
    ]
    passed, ess, clip_frac, kl = row[13:]
    use = None if ess is None else UseStats(ess, clip_frac, kl)
    return GroupInfo(
        gid, seq, version, spread, consumed, last_step, json.loads(meta), run, created, newest, lineage,
        bool(quarantined), n, passed, use,
    )  # fmt: skip


def ancestors(lineage: int, links: dict[int, tuple[int | None, int]]) -> list[tuple[int, int | None]]:
    """(lineage, newest version whose weights are an ancestor of `lineage`'s current ones; None: any),
    up the resume chain; `links`: lineage -> (parent, fork version). A lineage without a link is a root."""
    out: list[tuple[int, int | None]] = []
    at: int | None = lineage
    bound: int | None = None
    while at is not None and at not in {a for a, _ in out}:
        out.append((at, bound))
        parent, fork = links.get(at, (None, 0))
        bound = fork if bound is None else min(bound, fork)
        at = parent
    return out


def made_by_ancestor(
    lineage: int, version: int, links: dict[int, tuple[int | None, int]], chain: dict[int, int | None]
) -> bool:
    """Whether the weights (`lineage`, `version`) are an ancestor of the current ones, `chain` being
    `dict(ancestors(current, links))`. A lineage's versions up to its fork are its parent's weights
    (it loaded them from the checkpoint): a dead branch's groups made before its first update are
    as good as the checkpoint's."""
    at: int | None = lineage
    seen: set[int] = set()
    while at is not None and at not in seen:
        if at in chain:
            bound = chain[at]
            return bound is None or version <= bound
        seen.add(at)
        parent, fork = links.get(at, (None, 0))
        if version > fork:
            return False
        at = parent
    return False
