"""The slot KV cache behind TorchEngine's continuous batching and prefix reuse.

One pair of buffers per layer, `[max_rows, kv_heads, capacity, head_dim]`. Each running sequence owns a
row ("slot"). All rows share one write column `end`: a decode step writes every row's new key/value at
`end`, and each row's tokens sit right-aligned before it, in `[start[row], end)`. A boolean `mask`
`[max_rows, capacity]` says which columns each row may attend to. So:

- a new request joins by writing its keys/values into a free row at `[end - L, end)`: no other row is
  touched (no re-padding or stacking of the batch, which would copy the whole cache per join);
- a finished request frees its row; the next request reuses it at once;
- attention runs over the window `[lo, end]` only, where `lo` is the earliest start of a live row;
- when the buffers run out of room on the right (or a new prompt needs room on the left) the kept
  columns are copied into fresh buffers (`rebase`): amortised, like a growing list.

Prefix reuse: a finished row is "parked" with the tokens its keys/values cover (prompt + output minus
the last token, which was never fed back). A later request whose prompt starts with those tokens (the
next turn of a multi-turn episode: previous prompt + completion + new messages) copies that prefix into
its new row and computes only the rest. Parked rows are free rows: they are overwritten when rows run
short (least recently parked first) and dropped at a rebase once they are `park_window` steps old.

The object is handed to a Hugging Face model as its `cache`: attention layers call `update(k, v,
layer_idx)`. In decode mode `update` writes column `end` and returns the window; in prefill mode it
writes the new rows' suffix columns and returns the rows' whole new blocks. Positions and masks are passed
to the model explicitly, so nothing else of the HF Cache API is needed. Buffers start zeroed and only
ever hold finite values: a masked NaN would still poison softmax @ V (0 * NaN = NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Parked:
    tokens: list[int]  # the tokens whose keys/values the row holds, in order from `start`
    finished_at: int  # `end` when the row was parked
    stamp: int  # parking order, for least-recently-parked eviction


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
        headroom: int = 256,
        park_window: int = 2048,
    ) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.dtype = dtype
        self.headroom = headroom  # minimum free columns added on the right when the buffers grow
        self.park_window = park_window
        self.live: set[int] = set()  # rows holding a running sequence
        self.parked: dict[int, Parked] = {}
        self.rebases = 0  # how often the kept columns were copied into new buffers
        self._stamp = 0
        self._empty()
        # Set around each forward call.
        self._mode = "decode"
        self._lo = 0
        self._rows: torch.Tensor | None = None
        self._suffix = 0  # prefill: query columns [end - _suffix, end)
        self._width = 0  # prefill: the new blocks span [end - _width, end)
        self._suffix_ok: torch.Tensor | None = None  # prefill: which query columns hold real tokens

    # -- bookkeeping ------------------------------------------------------------------------------------
    @property
    def lo(self) -> int:
        """First column of the attention window: the earliest start among live rows."""
        return min((self.start[r] for r in self.live), default=self.end)

    def free_rows(self) -> list[int]:
        """Rows a new sequence may take: never-used or released ones first, then parked ones (oldest
        parked first)."""
        idle = [r for r in range(self.max_rows) if r not in self.live and r not in self.parked]
        return idle + sorted(self.parked, key=lambda r: self.parked[r].stamp)

    def length(self, row: int) -> int:
        """Tokens held for `row` (its next position id)."""
        return self.end - self.start[row]

    def release(self, row: int, tokens: list[int] | None = None) -> None:
        """End `row`'s sequence; with `tokens` (exactly the ones its cache holds) park it for reuse."""
        self.live.discard(row)
        if tokens is not None and len(tokens) == self.length(row):
            self._stamp += 1
            self.parked[row] = Parked(tokens, self.end, self._stamp)
        self.n_rows = max(self.live) + 1 if self.live else 0

    def drop_parked(self) -> None:
        """Forget every parked prefix (their keys/values came from weights that were just replaced)."""
        self.parked.clear()

    def find_prefix(self, ids: list[int]) -> tuple[int, int]:
        """The parked row holding the longest proper prefix of `ids`, and that prefix's length; (-1, 0)
        when none. At least one token must be left to compute, for the logits of the next one."""
        best, best_len = -1, 0
        for row, park in self.parked.items():
            n = len(park.tokens)
            if best_len < n < len(ids) and ids[:n] == park.tokens:
                best, best_len = row, n
        return best, best_len

    def free(self) -> None:
        """Give the buffers' memory back (no live row; parked ones are dropped): the next request
        allocates them anew. They grow to the run's peak (gigabytes with dozens of long rows) and would
        otherwise stay that size while the engine waits, e.g. through a sync trainer's step."""
        if self.live:
            raise RuntimeError(f"{len(self.live)} live rows: the cache cannot be freed under them")
        self.parked.clear()
        self._empty()

    def _empty(self) -> None:
        """No buffers, no rows: the state a new cache starts in and `free` returns to."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.mask = torch.zeros(self.max_rows, 0, dtype=torch.bool, device=self.device)
        self.end = 0  # the shared write column
        self.start: list[int] = [0] * self.max_rows  # first column of each row's tokens
        self.n_rows = 0  # rows [0, n_rows) take part in a decode step
        self._shape: tuple[int, int] | None = None  # (kv_heads, head_dim), known after the first write

    def reset(self) -> None:
        """Drop every sequence (after a failed step); buffers are kept."""
        self.live.clear()
        self.parked.clear()
        self.n_rows = 0
        if self.capacity:
            self.mask.zero_()

    # -- room management --------------------------------------------------------------------------------
    def ensure_room(self, left: int = 0, right: int = 1) -> None:
        """Make sure `left` columns exist before `end` and `right` columns from `end` on."""
        if self.end - left >= 0 and self.end + right <= self.capacity:
            return
        for row in [r for r, p in self.parked.items() if self.end - p.finished_at > self.park_window]:
            del self.parked[row]
        lo = min([self.lo, *(self.start[r] for r in self.parked)])
        width = self.end - lo
        new_lo = max(0, left - width)  # room for a new block of `left` columns ending at `end`
        new_end = new_lo + width
        # Grow geometrically so rebases stay rare: at least double the kept window.
        step = self.headroom
        new_cap = -(-(new_end + max(right, width, step)) // step) * step
        self._reallocate(new_cap, lo, new_lo, width)
        self.rebases += 1
        shift = new_lo - lo
        self.start = [s + shift for s in self.start]
        for park in self.parked.values():
            park.finished_at += shift
        self.end = new_end

    def _reallocate(self, new_cap: int, lo: int, new_lo: int, width: int) -> None:
        n = max([*self.live, *self.parked], default=-1) + 1  # rows holding data worth keeping
        mask = torch.zeros(self.max_rows, new_cap, dtype=torch.bool, device=self.device)
        if n and width:
            mask[:n, new_lo : new_lo + width] = self.mask[:n, lo : lo + width]
        self.mask = mask
        if self._shape is not None:
            heads, dim = self._shape
            for bufs in (self.keys, self.values):
                for i, old in enumerate(bufs):
                    new = torch.zeros(
                        self.max_rows, heads, new_cap, dim, dtype=self.dtype, device=self.device
                    )
                    if n and width:
                        new[:n, :, new_lo : new_lo + width] = old[:n, :, lo : lo + width]
                    bufs[i] = new
        self.capacity = new_cap

    def _allocate_layers(self, heads: int, dim: int) -> None:
        self._shape = (heads, dim)
        shape = (self.max_rows, heads, self.capacity, dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.values = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]

    def move_row(self, src: int, dst: int) -> None:
        """Copy live row `src` into row `dst` (free or parked) to keep the live rows packed at the top."""
        self.parked.pop(dst, None)
        lo, end = self.lo, self.end
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[dst, :, lo:end] = buf[src, :, lo:end]
        self.mask[dst] = self.mask[src]
        self.start[dst] = self.start[src]
        self.live.discard(src)
        self.live.add(dst)
        self.n_rows = max(self.live) + 1

    def clone_block(self, src: int, dst: int, n: int) -> None:
        """Give row `dst` a copy of the `n`-token block that row `src` just prefilled (same prompt)."""
        end = self.end
        for buf in (*self.keys, *self.values):
            buf[dst, :, end - n : end] = buf[src, :, end - n : end]
        self.parked.pop(dst, None)
        self.mask[dst] = False
        self.mask[dst, end - n : end] = True
        self.start[dst] = end - n
        self.live.add(dst)
        self.n_rows = max(self.live) + 1

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two rows (e.g. a live one and a parked one, so that parked rows sit above the live
        ones and cost no decode work, yet keep their keys/values)."""
        c0 = min(self.start[a], self.start[b])
        ab, ba = torch.tensor([a, b], device=self.device), torch.tensor([b, a], device=self.device)
        for buf in (*self.keys, *self.values):
            buf[ab, :, c0 : self.end] = buf[ba, :, c0 : self.end]
        self.mask[ab] = self.mask[ba]
        self.start[a], self.start[b] = self.start[b], self.start[a]
        park_a, park_b = self.parked.pop(a, None), self.parked.pop(b, None)
        if park_a is not None:
            self.parked[b] = park_a
        if park_b is not None:
            self.parked[a] = park_b
        live_a, live_b = a in self.live, b in self.live
        self.live -= {a, b}
        self.live |= {r for r, was_live in ((b, live_a), (a, live_b)) if was_live}
        self.n_rows = max(self.live) + 1 if self.live else 0

    # -- forward-pass set-up ----------------------------------------------------------------------------
    def begin_prefill(
        self, rows: list[int], lengths: list[int], reuse: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Claim `rows` for new sequences of `lengths` tokens, the first `reuse[i] = (src_row, n)` of
        which are copied from a parked row (n = 0: none); returns the `[m, 1, S, W]` attention mask of
        the prefill pass over the uncomputed suffixes (left-padded to the longest, S), whose keys span the
        new blocks (W = the longest length). Call `ensure_room(left=W)` first."""
        end, width = self.end, max(lengths)
        suffix = max(n - p for n, (_, p) in zip(lengths, reuse, strict=True))
        if self._shape is not None:
            # Read every reused prefix before writing any: a source row may also be a destination.
            pending = []
            for row, n, (src, p) in zip(rows, lengths, reuse, strict=True):
                if p:
                    a = self.start[src]
                    pieces = [buf[src, :, a : a + p].clone() for buf in (*self.keys, *self.values)]
                    pending.append((row, end - n, pieces))
            for row, col, pieces in pending:
                for buf, piece in zip((*self.keys, *self.values), pieces, strict=True):
                    buf[row, :, col : col + piece.shape[1]] = piece
        for row, n in zip(rows, lengths, strict=True):
            self.parked.pop(row, None)
            self.mask[row] = False
            self.mask[row, end - n : end] = True
            self.start[row] = end - n
            self.live.add(row)
        self.n_rows = max(self.live) + 1
        self._mode = "prefill"
        self._rows = torch.tensor(rows, device=self.device)
        self._suffix, self._width = suffix, width
        cols = torch.arange(suffix, device=self.device)
        todo = torch.tensor([n - p for n, (_, p) in zip(lengths, reuse, strict=True)], device=self.device)
        self._suffix_ok = None
        if any(p for _, p in reuse):
            self._suffix_ok = (cols[None] >= suffix - todo[:, None])[:, None, :, None]  # [m, 1, S, 1]
        keys_ok = self.mask[self._rows, end - width : end]  # [m, W]
        q_col = cols + (width - suffix)  # each query's column, counted from end - W
        causal = torch.arange(width, device=self.device)[None] <= q_col[:, None]  # [S, W]
        mask = causal[None] & keys_ok[:, None, :]
        # Pad queries see themselves: a fully masked row would make softmax produce NaN.
        mask[:, cols, q_col] = True
        return mask[:, None]

    def begin_decode(self) -> torch.Tensor:
        """Open column `end` for every stepped row; returns the `[n, 1, 1, W]` decode mask."""
        self._mode = "decode"
        n, lo, end = self.n_rows, self.lo, self.end
        self.mask[:n, end] = True
        self._lo = lo
        return self.mask[:n, lo : end + 1][:, None, None, :]

    def end_decode(self) -> None:
        self.end += 1

    # -- the HF cache hook ------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ):
        if self._shape is None:
            self._allocate_layers(key_states.shape[1], key_states.shape[3])
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "decode":
            n, end = key_states.shape[0], self.end
            k_buf[:n, :, end : end + 1] = key_states
            v_buf[:n, :, end : end + 1] = value_states
            return k_buf[:n, :, self._lo : end + 1], v_buf[:n, :, self._lo : end + 1]
        rows, end, s = self._rows, self.end, self._suffix
        if self._suffix_ok is None:  # nothing reused: the new keys are the whole blocks
            k_buf[rows, :, end - s : end] = key_states.to(self.dtype)
            v_buf[rows, :, end - s : end] = value_states.to(self.dtype)
            return key_states, value_states
        # Pad columns of a short suffix overlap its row's copied prefix: write real tokens only.
        for buf, new in ((k_buf, key_states), (v_buf, value_states)):
            buf[rows, :, end - s : end] = torch.where(
                self._suffix_ok, new.to(self.dtype), buf[rows, :, end - s : end]
            )
        w = self._width
        return k_buf[rows, :, end - w : end], v_buf[rows, :, end - w : end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - self.lo
