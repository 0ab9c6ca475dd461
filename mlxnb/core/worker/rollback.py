"""Per-row rollback of a batch cache after a verification forward.

A verification writes W positions for every row of the left-padded batch; row i
keeps the first W - r_i of them and rejects its last r_i. Every row shares one write
index (`_idx`), so the rollback is done in two parts:

* the rejections all rows share, m = min(r), by moving the write index back: free;
* each row's surplus e_i = r_i - m by rolling that row right by e_i along the
  sequence axis: its rejected tail wraps round to the front, where it becomes left
  padding (`left_padding += e_i`), and its RoPE offset (`_idx - left_padding`)
  shrinks by the same amount.

The roll copies the rows' KV once (all layers: [B, H, S, D] each), which costs
memory bandwidth, not host work: one gather of [D] vectors per layer and tensor,
whatever B is (roll.py). The alternatives cost more where decode is host-bound:
masking each row's holes needs a per-row position map in every attention call;
keeping rows unaligned needs a write index per row, which mlx-lm's batch caches and
masks do not have. A batch whose rows all rejected the same count (B = 1 always)
rolls nothing.

Sliding-window layers (mlx-lm's BatchRotatingKVCache and its quantized form) are in
temporal order after a multi-token write and hold max_size - 1 + W positions, so a
row keeps at least max_size positions after rejecting up to W - 1: enough for the
next query's window. Recurrent-state layers (ArraysCache) cannot give back a step;
models with them do not speculate (`unsupported_reason`).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache

from .caches import LeanBatchKVCache, leaves
from .quantized_kv import BatchQuantizedKVCache
from .roll import RowRoll, roll_cache

__all__ = ["before_verify", "roll_lazy", "rollback", "unsupported_reason"]


def unsupported_reason(row_cache: list) -> Optional[str]:
    """Why rows of a model with these cache kinds cannot speculate, or None."""
    if any(isinstance(c, ArraysCache) for c in leaves(row_cache)):
        return "off: recurrent-state layers cannot roll back rejected drafts"
    return None


def before_verify(caches: list) -> None:
    """Put sliding-window layers in temporal order before a multi-token forward.
    mlx-lm's BatchRotatingKVCache builds that forward's mask from its write index
    while its update first reorders a wrapped buffer (making the index its length):
    a wrapped buffer's left-padded rows would see their mask one column off."""
    for c in leaves(caches):
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()


def rollback(caches: list, rejected: List[int]) -> bool:
    """Drop each row's last rejected[i] positions from every layer of the batch
    cache. Returns whether any row gained left padding."""
    m = min(rejected)
    extra = [r - m for r in rejected]
    shift = mx.array(extra) if any(extra) else None
    roll = None if shift is None else RowRoll(shift)
    for c in leaves(caches):
        if isinstance(c, (LeanBatchKVCache, BatchQuantizedKVCache)):
            _flat(c, m, shift, roll)
        elif isinstance(c, BatchRotatingKVCache):
            _window(c, m, shift, roll)
        else:
            raise TypeError(f"{type(c).__name__} cannot roll back")
    return shift is not None


def _flat(c, m: int, shift, roll) -> None:
    c._idx -= m
    if shift is None:
        return
    # the whole buffer: its room to grow stays (and is copied as it is)
    roll_cache(c, roll, c._idx)
    c.left_padding = c.left_padding + shift


def _window(c, m: int, shift, roll) -> None:
    # after a multi-token write: temporal order, keys.shape[2] == _idx
    if m:
        c._idx -= m
        c._offset -= m
        c.offset = c.offset - m
        c.keys = c.keys[..., :c._idx, :]
        c.values = c.values[..., :c._idx, :]
    if shift is None:
        return
    roll_cache(c, roll)
    # a negative left padding counts positions already trimmed: none is padding now
    c.left_padding = mx.maximum(c.left_padding, 0) + shift
    c.offset = c.offset - shift


def roll_lazy(caches: list, rejected: mx.array) -> None:
    """Drop each row's last rejected[i] positions ([B], not yet computed) from every
    plain KV layer: each row rolled right by its count, the rejected tail becoming
    left padding. The write index stays: the host need not know the counts."""
    roll = RowRoll(rejected)
    for c in leaves(caches):
        roll_cache(c, roll, c._idx)
        c.left_padding = c.left_padding + rejected
