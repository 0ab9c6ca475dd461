"""The batched low-rank layer: one base product for the whole batch, each row's own
LoRA/DoRA update added on top, gathered per row.

An `AdaptedLinear` stands in for one of the model's linears (nn.Linear,
nn.QuantizedLinear, or a part of a fused projection: fuse.py) over the one copy of
its weights. For each group of adapters of one rank and dtype it holds the stacked
low-rank weights A [n, in, r] and B [n, r, out]; before each forward the worker sets
the batch's `Selection` (adapters.py): per group, each row's slot and scale (0 for
rows that use no adapter of that group). The update is mlx-lm's, row by row:

    LoRALinear:  y + (scale * ((x @ A) @ B)).astype(x.dtype)
    DoRALinear:  (m / ||W + scale B^T A^T||_row).astype(x.dtype) * (x @ W^T + ...) + bias

with the same operations in the same order, so a row's tokens match mlx-lm's own
generation with that adapter. `mx.gather_mm` multiplies each row by its own slot's
matrices without copying them per row. A batch whose rows use no adapter runs the
base linear alone (`Selection` None): such rows pay one attribute read per layer.
Groups never pad ranks: zero columns change how BLAS splits the sum over r, and so
the last bits of the update.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

__all__ = ["AdaptedLinear", "Selection", "GroupWeights", "base_weight", "linear_dims"]

GroupKey = Tuple[int, str]  # (rank, dtype name)


class Selection(NamedTuple):
    """Which adapter each row of the next forward uses (built per batch shape)."""

    groups: Dict[GroupKey, tuple]  # key -> (slot [B] uint32, scale [B, 1, 1] float32)
    slots: mx.array  # [B] uint32: each row's adapter slot; rows without one: n_adapters
    dora: bool  # some row uses a DoRA adapter
    rows: int  # B


class GroupWeights(NamedTuple):
    a: mx.array  # [n, in, r]
    b: mx.array  # [n, r, out]


def linear_dims(layer) -> Optional[Tuple[int, int]]:
    """(in, out) of a linear the adapters can wrap, or None."""
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer.weight.shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, inp = layer.weight.shape
        return inp, out
    fused = getattr(layer, "fused", None)  # fuse.py's _Part
    if fused is not None and isinstance(fused.linear, nn.Linear):
        a, b = fused.bounds[layer.i]
        return fused.linear.weight.shape[1], b - a
    return None


def base_weight(layer):
    """(W [out, in] as mlx-lm's DoRALinear sees it: dequantized; bias or None)."""
    fused = getattr(layer, "fused", None)
    if fused is not None:
        a, b = fused.bounds[layer.i]
        lin = fused.linear
        return lin.weight[a:b], (lin.bias[a:b] if "bias" in lin else None)
    w = layer.weight
    if isinstance(layer, nn.QuantizedLinear):
        w = mx.dequantize(w, layer.scales, layer.biases, group_size=layer.group_size,
                          bits=layer.bits, mode=layer.mode)
    return w, (layer.bias if "bias" in layer else None)


class AdaptedLinear:
    """A plain callable set on the owner module as an instance attribute: the base
    linear stays where it was in the parameter tree; unwrapping deletes the
    attribute (or puts back the fused part it shadowed)."""

    def __init__(self, base, owner):
        self.base = base
        self.owner = owner  # adapters.AdapterSet: holds `sel` for the forward
        self.dims = linear_dims(base)
        self.quantized = isinstance(base, nn.QuantizedLinear)
        self.bias = ((base.bias if "bias" in base else None) if self.quantized
                     else base_weight(base)[1])
        self.groups: Dict[GroupKey, GroupWeights] = {}
        # DoRA only: m / ||adapted W|| per slot [n_adapters + 1, out] (1 where the slot
        # is LoRA, does not cover this layer, or is "no adapter"), and which slots are
        # DoRA adapters covering this layer [n_adapters + 1]
        self.mag: Optional[mx.array] = None
        self.dora_slots: Optional[mx.array] = None

    def __call__(self, x):  # x: [B, L, in] (prefill chunk or decode step)
        y = self.base(x)  # [B, L, out]: the one base product
        sel = self.owner.sel
        if sel is None:
            return y
        if x.ndim != 3 or x.shape[0] != sel.rows:
            raise ValueError(f"adapters need [batch, length, dims] inputs with one row "
                             f"per selected row; got shape {tuple(x.shape)}")
        low = None
        for key, w in self.groups.items():
            g = sel.groups.get(key)
            if g is None:  # no row of this batch uses an adapter of this group
                continue
            slot, scale = g
            z = mx.gather_mm(mx.gather_mm(x, w.a, rhs_indices=slot), w.b,
                             rhs_indices=slot)  # [B, L, r] then [B, L, out]
            z = (scale.astype(z.dtype) * z).astype(x.dtype)
            low = z if low is None else low + z
        if low is None:
            return y
        if not (sel.dora and self.mag is not None):
            return y + low
        mag = self.mag[sel.slots][:, None, :].astype(x.dtype)  # [B, 1, out]
        if not self.quantized and self.bias is None:
            # LoRA and base rows: a magnitude of exactly 1
            return mag * (y + low)
        # DoRA's base product has no bias, and is x @ dequantized(W)^T on a quantized
        # layer: computed for the batch only while a DoRA row is in it
        if self.quantized:
            w, _ = base_weight(self.base)
            yd = x @ w.T
        else:
            yd = y - self.bias
        dora = mag * (yd + low)
        if self.bias is not None:
            dora = dora + self.bias
        is_dora = self.dora_slots[sel.slots][:, None, None]  # [B, 1, 1]
        return mx.where(is_dora, dora, y + low)
