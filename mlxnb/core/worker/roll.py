"""Per-row rolls of batch KV buffers along their positions.

A batch cache moves rows' positions twice: a prefill group's right padding becomes
left padding (`finalize`), and a verification's rejected positions do too
(rollback.py). mlx-lm's `dynamic_roll` does it as an element gather
(`mx.take_along_axis`, an index per element); gathering whole [D] vectors by one
flat index, shared by every layer and tensor of a shape, moves the same bytes with
D times fewer indices: 37 ms against 148 ms for 8 rows of 300 tokens of SmolLM2's KV
on a 2-core CPU (bench/results/verify-cost-2026-12-03-cpu2.md).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

__all__ = ["RowRoll", "finalize_padding", "roll_cache"]


class RowRoll:
    """Rolls row b of [B, H, S, D] buffers right by shift[b] ([B] int32) within
    their first n positions (all S when n is None; the rest, a buffer's room to
    grow, stays): x[b, h, s] <- x[b, h, (s - shift[b]) % n] for s < n. One flat
    index per (shape, n), made once and shared by every buffer with them."""

    def __init__(self, shift: mx.array):
        self.shift, self._idx = shift, {}

    def __call__(self, x: mx.array, n: Optional[int] = None) -> mx.array:
        B, H, S, D = x.shape
        n = S if n is None else n
        idx = self._idx.get((B, H, S, n))
        if idx is None:
            pos = mx.arange(S)[None, :]
            src = mx.where(pos < n, (pos - self.shift[:, None]) % n, pos)  # [B, S]
            base = mx.arange(B * H).reshape(B, H, 1) * S
            idx = self._idx[(B, H, S, n)] = (base + src[:, None, :]).reshape(-1)  # [B*H*S]
        return mx.take(x.reshape(B * H * S, D), idx, axis=0).reshape(B, H, S, D)


def roll_cache(c, roll: RowRoll, n: Optional[int] = None) -> None:
    """Roll a KV layer's keys and values (or their quantized triplets) by `roll`."""
    if isinstance(c.keys, tuple):
        c.keys = tuple(roll(x, n) for x in c.keys)
        c.values = tuple(roll(x, n) for x in c.values)
    else:
        c.keys, c.values = roll(c.keys, n), roll(c.values, n)


def finalize_padding(c) -> None:
    """A prefill group's right padding becomes left padding (mlx-lm's `finalize`
    rule for its batch caches, rolled as above)."""
    if c._right_padding is not None:
        roll_cache(c, RowRoll(c._right_padding))
        c.left_padding = c.left_padding + c._right_padding
        c._right_padding = None
