"""Sliding windows in a decode batch of unpadded rows: one-token writes without
mlx-lm's per-row bookkeeping nodes.

mlx-lm's BatchRotatingKVCache keeps each row's position (`offset`) and padding
(`left_padding`) as arrays, updates them on every write and ties them to the keys
with `mx.depends` so that their chains get evaluated: per window per step an add,
a subtract once the window has wrapped, and a depends node. On a GPU, where a
decode step at these sizes is bound by the host building and launching nodes,
that is 44-66 of the ~735 nodes of a Gemma-3-1B step (22 windows). When a KV
layer shows the rows unpadded (`caches.AlignedView`) they all sit at one position,
so an `AlignedWindow` gives the model that position as a scalar RoPE offset, as a
single row's RotatingKVCache does, and a one-token write counts the bookkeeping in
host ints (`LeanBatchRotatingKVCache.write_one`), folded into the arrays (a node
each) when something reads them: the step's mask, a join, a filter, a rollback.

The mask stays mlx-lm's. Without one, MLX's CUDA backend sends single-token
attention (head dims up to 128) over a window whose length is a multiple of 256 to
cuDNN (`use_cudnn_for_decoding`), which builds a graph per batch size.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache

__all__ = ["AlignedWindow", "LeanBatchRotatingKVCache", "PrefillOneWide", "fit_windows"]


def fit_windows(leaves: list) -> None:
    """Cut a prefilled group's sliding windows to their window before the group joins
    the decode batch. A prefill chunk leaves window - 1 + chunk positions (its queries
    each needed a full window); the next one-token write would trim them to the
    window (mlx-lm's `_update_in_place`), but a join first pads every row of the
    batch to the longer side, so decoding rows would hold the chunk too. Copied, so
    the chunk's buffer is freed, not kept alive under a view."""
    for c in leaves:
        if (isinstance(c, BatchRotatingKVCache) and c.keys is not None
                and c.keys.shape[2] > c.max_size):
            c._temporal_order()
            n = c.keys.shape[2] - c.max_size
            c.keys = mx.contiguous(c.keys[..., n:, :])
            c.values = mx.contiguous(c.values[..., n:, :])
            c._idx = c.max_size
            c.left_padding = c.left_padding - n


class PrefillOneWide:
    """mlx-lm's BatchRotatingKVCache takes any one-token update as a decode step,
    written in place, which it refuses while a right-padded prefill group's lengths
    are set. A padded group's prefill chunk can be one token wide (prompts of 1 and 2
    tokens; a small step budget): that is still prefill, so it takes the concatenating
    path, which keeps the padding behind each row's real tokens."""

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1 and self._lengths is not None:
            return self._update_concat(keys, values)
        return super().update_and_fetch(keys, values)


class LeanBatchRotatingKVCache(PrefillOneWide, BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache whose `offset` and `left_padding` take the
    one-token writes of `write_one` when next read. Everything else is mlx-lm's."""

    _lag = 0  # one-token writes not yet added to `offset`
    _lag_pad = 0  # of those, the ones past the wrap: not yet taken from `left_padding`

    @classmethod
    def lean(cls, c: BatchRotatingKVCache) -> "LeanBatchRotatingKVCache":
        """Make mlx-lm's cache `c` this class, in place (its arrays move behind the
        properties)."""
        d = c.__dict__
        d["_offset_rows"], d["_padding_rows"] = d.pop("offset"), d.pop("left_padding")
        c.__class__ = cls
        return c

    @property
    def offset(self):
        if self._lag:
            self._offset_rows = self._offset_rows + self._lag
            self._lag = 0
        return self._offset_rows

    @offset.setter
    def offset(self, value):
        self._offset_rows, self._lag = value, 0

    @property
    def left_padding(self):
        if self._lag_pad:
            self._padding_rows = self._padding_rows - self._lag_pad
            self._lag_pad = 0
        return self._padding_rows

    @left_padding.setter
    def left_padding(self, value):
        self._padding_rows, self._lag_pad = value, 0

    def write_one(self, keys, values):
        """mlx-lm's one-token write (`_update_in_place`), its position and padding
        updates counted on the host. Growing or trimming the buffer (the first
        steps, and the first after a prefill chunk) takes mlx-lm's own path."""
        size = self.keys.shape[2] if self.keys is not None else 0
        grows = self.keys is None or (self._offset >= size and size < self.max_size)
        if self._lengths is not None or grows or size > self.max_size:
            return self._update_in_place(keys, values)
        if self._idx == self.max_size:
            self.rotated, self._idx = True, 0
        if self.rotated:
            self._lag_pad += 1
        i = self._idx
        self.keys[..., i:i + 1, :] = keys
        self.values[..., i:i + 1, :] = values
        self._offset += 1
        self._idx += 1
        self._lag += 1
        return self.keys_and_values()


class AlignedWindow:
    """Stand-in for a decode batch's LeanBatchRotatingKVCache while its rows are
    unpadded: RoPE at `pos`, the rows' one position (a KV layer's length when the
    view was made, then advanced by each write), one-token writes by `write_one`.
    Its mask and everything else are the batch cache's."""

    __slots__ = ("c", "pos")

    def __init__(self, c: LeanBatchRotatingKVCache, pos: int):
        self.c, self.pos = c, pos

    @property
    def offset(self) -> int:
        return self.pos

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        out = self.c.write_one(keys, values) if n == 1 else self.c.update_and_fetch(keys, values)
        self.pos += n
        return out

    def __getattr__(self, name):
        return getattr(self.c, name)
