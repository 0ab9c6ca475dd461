"""KV-cache pieces of batch execution: prefill groups and two thin adaptations of
mlx-lm's `BatchKVCache` (see each class for why)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class PrefillGroup:
    """Rows prefilling together on one cache: a fresh batch (prompts right-padded,
    mlx-lm's prepare/finalize turn that into left padding), or one row continuing
    from a reused prefix on its own single-row cache."""

    def __init__(self, admits: list, cache: list, start: int, batched: bool,
                 width: Optional[int] = None):
        self.admits, self.cache, self.pos, self.batched = admits, cache, start, batched
        self.lengths = [len(a.ids) - 1 for a in admits]  # all but the last token
        self.width = width or max(self.lengths)
        self.step = 1  # chunk widths are multiples of this
        self.cancelled: set = set()
        self.views = cache
        if batched:
            pad = [self.width - n for n in self.lengths]
            self.tokens = mx.array([a.ids[:-1] + [0] * p for a, p in zip(admits, pad)]
                                   if self.width else [[0]] * len(admits))
            if max(pad) > 0:
                for c in cache:
                    c.prepare(lengths=self.lengths, right_padding=pad)
            self.padded = max(pad) > 0
            if all(isinstance(c, BatchKVCache) for c in cache):
                # Right padding sits after every real token, so causal masking alone
                # keeps real tokens from seeing it.
                self.views = [AlignedView(c) for c in cache]
        else:
            self.tokens = mx.array([admits[0].ids[:-1]])

    def row_ids(self):
        return [a.row_id for a in self.admits]


class LeanBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache with `offset` derived (= _idx - left_padding, an
    invariant of every method) instead of stored: its per-layer `offset + 1` update
    each decode step becomes a node nobody evaluates.

    It also grows its buffers 255 tokens at a time, not 256. MLX's CUDA backend sends
    single-token attention over a buffer whose length is a multiple of 256 to cuDNN
    (mlx/backend/cuda/scaled_dot_product_attention.cpp, use_cudnn_for_decoding),
    which builds a graph per (batch size, buffer length): measured ~100 ms each time
    a row leaves or joins, and ~2 ms slower per step than the vector kernel at batch
    64 (bench/shape_costs.py). Any other length keeps decode on the vector kernel;
    other backends don't care."""

    step = 255

    @property
    def offset(self):
        return self._idx - self.left_padding

    @offset.setter
    def offset(self, value):
        pass


def merge_lean(layers: list) -> list:
    """mlx-lm's merge of single-row caches, per layer ([[row caches] per layer]), into
    batch caches; each BatchKVCache becomes a LeanBatchKVCache, as the decode batch
    that takes these buffers over needs."""
    out = [type(rows[0]).merge(rows) for rows in layers]
    for c in out:
        if type(c) is BatchKVCache:
            c.__class__ = LeanBatchKVCache
    return out


class AlignedView:
    """Stand-in for a batch cache none of whose rows is left-padded (a decode batch
    that joined together, or a fresh prefill group, right-padded): a plain KVCache
    to the model -- scalar RoPE offset and no mask array ("causal" for a chunk), so
    attention takes the same fused path as an unbatched loop. Mask arrays also cost
    a per-shape setup on some backends (measured ~80 ms per prefill on CUDA)."""

    __slots__ = ("c",)

    def __init__(self, c):
        self.c = c

    @property
    def offset(self):
        return self.c._idx

    def update_and_fetch(self, keys, values):
        c, prev = self.c, self.c._idx
        n = keys.shape[2]
        if c.keys is None or prev + n > c.keys.shape[2]:
            return c.update_and_fetch(keys, values)  # growth: mlx-lm's path
        # mlx-lm's write without its `offset += n`: on this cache that builds two
        # array ops per layer per step (offset is derived) that nothing evaluates
        c._idx = prev + n
        c.keys[..., prev:c._idx, :] = keys
        c.values[..., prev:c._idx, :] = values
        return c.keys[..., :c._idx, :], c.values[..., :c._idx, :]

    def make_mask(self, N, **kwargs):
        return None if N == 1 else "causal"
