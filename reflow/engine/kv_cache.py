"""The slot KV cache behind TorchEngine's continuous batching.

One pair of buffers per layer, `[max_rows, kv_heads, capacity, head_dim]`. Each running sequence owns a
row ("slot"). All rows share one write column `end`: a decode step writes every row's new key/value at
`end`, and each row's tokens sit right-aligned before it, in `[start[row], end)`. A boolean `mask`
`[max_rows, capacity]` says which columns each row may attend to. So:

- a new request joins by writing its prefilled keys/values into a free row at `[end - L, end)`: no other
  row is touched (no re-padding or stacking of the batch, which would copy the whole cache per join);
- a finished request just frees its row; the next request reuses it at once;
- attention runs over the window `[lo, end]` only, where `lo` is the earliest start of a live row, so
  columns that only finished rows used cost nothing once those rows are gone;
- when the buffers run out of room on the right (or a new prompt needs room on the left) the live window
  is copied into fresh buffers (`rebase`): amortised, like a growing list.

The object is handed to a Hugging Face model as its `cache`: the attention layers call `update(k, v,
layer_idx)`. In decode mode `update` writes column `end` and returns the window; in prefill mode it
writes the new rows' blocks and returns the new keys/values unchanged, since a new prompt attends only to
itself. Positions and masks are passed to the model explicitly, so nothing else of the HF Cache API is
needed. Buffers start zeroed and only ever hold finite values: a masked NaN would still poison softmax
@ V (0 * NaN = NaN).
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
        headroom: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.dtype = dtype
        self.headroom = headroom  # minimum free columns added on the right when the buffers grow
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.mask = torch.zeros(max_rows, 0, dtype=torch.bool, device=self.device)
        self.end = 0  # the shared write column
        self.start: list[int] = [0] * max_rows  # first column of each row's tokens
        self.live: set[int] = set()  # rows holding a running sequence
        self.n_rows = 0  # rows [0, n_rows) take part in a decode step
        self.rebases = 0  # how often the live window was copied into new buffers
        self._shape: tuple[int, int] | None = None  # (kv_heads, head_dim), known after the first write
        # Set by the engine around each forward call.
        self._mode = "decode"
        self._prefill_rows: torch.Tensor | None = None
        self._prefill_len = 0

    # -- bookkeeping ------------------------------------------------------------------------------------
    @property
    def lo(self) -> int:
        """First column of the attention window: the earliest start among live rows."""
        return min((self.start[r] for r in self.live), default=self.end)

    def free_rows(self) -> list[int]:
        return [r for r in range(self.max_rows) if r not in self.live]

    def length(self, row: int) -> int:
        """Tokens held for `row` (its next position id)."""
        return self.end - self.start[row]

    def release(self, row: int) -> None:
        self.live.discard(row)
        self.n_rows = max(self.live) + 1 if self.live else 0

    def reset(self) -> None:
        """Drop every sequence (after a failed step); buffers are kept."""
        self.live.clear()
        self.n_rows = 0
        if self.capacity:
            self.mask.zero_()

    # -- room management --------------------------------------------------------------------------------
    def ensure_room(self, left: int = 0, right: int = 1) -> None:
        """Make sure `left` columns exist before `end` and `right` columns from `end` on."""
        if self.end - left >= 0 and self.end + right <= self.capacity:
            return
        lo = self.lo
        width = self.end - lo
        new_lo = max(0, left - width)  # room for a new block of `left` columns ending at `end`
        new_end = new_lo + width
        # Grow geometrically so rebases stay rare: at least double the live window.
        step = self.headroom
        new_cap = -(-(new_end + max(right, width, step)) // step) * step
        self._reallocate(new_cap, lo, new_lo, width)
        self.rebases += 1
        shift = new_lo - lo
        self.start = [s + shift for s in self.start]
        self.end = new_end

    def _reallocate(self, new_cap: int, lo: int, new_lo: int, width: int) -> None:
        n = self.n_rows
        mask = torch.zeros(self.max_rows, new_cap, dtype=torch.bool, device=self.device)
        if n and width:
            mask[:n, new_lo : new_lo + width] = self.mask[:n, lo : lo + width]
        self.mask = mask
        if self._shape is not None:
            heads, dim = self._shape
            for i in range(self.num_layers):
                for bufs in (self.keys, self.values):
                    new = torch.zeros(
                        self.max_rows, heads, new_cap, dim, dtype=self.dtype, device=self.device
                    )
                    if n and width:
                        new[:n, :, new_lo : new_lo + width] = bufs[i][:n, :, lo : lo + width]
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
        """Copy live row `src` into free row `dst` (to keep the live rows packed at the top)."""
        lo, end = self.lo, self.end
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[dst, :, lo:end] = buf[src, :, lo:end]
        self.mask[dst] = self.mask[src]
        self.start[dst] = self.start[src]
        self.live.discard(src)
        self.live.add(dst)
        self.n_rows = max(self.live) + 1

    # -- forward-pass set-up ----------------------------------------------------------------------------
    def begin_prefill(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """Claim `rows` for new prompts of `lengths` (left-padded to the longest, `L`); returns the
        `[m, 1, L, L]` attention mask for their prefill pass. Call `ensure_room(left=L)` first."""
        width = max(lengths)
        end = self.end
        for row, n in zip(rows, lengths, strict=True):
            self.mask[row] = False
            self.mask[row, end - n : end] = True
            self.start[row] = end - n
            self.live.add(row)
        self.n_rows = max(self.live) + 1
        self._mode = "prefill"
        self._prefill_rows = torch.tensor(rows, device=self.device)
        self._prefill_len = width
        keys_ok = self.mask[self._prefill_rows, end - width : end]  # [m, L]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = causal[None] & keys_ok[:, None, :]
        # Pad queries see only themselves: a fully masked row would make softmax produce NaN.
        mask |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
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
        if self._mode == "prefill":
            rows, width = self._prefill_rows, self._prefill_len
            k_buf[rows, :, self.end - width : self.end] = key_states.to(self.dtype)
            v_buf[rows, :, self.end - width : self.end] = value_states.to(self.dtype)
            return key_states, value_states
        n, end = key_states.shape[0], self.end
        k_buf[:n, :, end : end + 1] = key_states
        v_buf[:n, :, end : end + 1] = value_states
        return k_buf[:n, :, self._lo : end + 1], v_buf[:n, :, self._lo : end + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - self.lo
