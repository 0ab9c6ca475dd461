"""The per-row gathered low-rank update: each row multiplied by its own slot's A and
B with `mx.gather_mm`, no product for adapters the row does not use.

The other formulation of lowrank.py's update (AdapterSet(formulation="gather")):
its A product costs one rank per row whatever the number of adapters loaded, where
`Stacked` computes every loaded adapter's columns for every row; but it is two
gathers per linear and per (rank, dtype) group, no sharing across a fused group,
and `gather_mm` is slow on some backends. Adapters are grouped by (rank, dtype):
ranks are never padded, as zero columns would change how BLAS splits the sum over r.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx

from .lowrank import Selection, base_weight

__all__ = ["Gathered", "GroupKey"]

GroupKey = Tuple[int, str]  # (rank, dtype name)


class Gathered:
    """One linear's update. `groups`: (rank, dtype name) -> (A [n, in, r], B [n, r,
    out]) over that group's adapters in slot order (zeros for one that does not cover
    this linear); `members`: the same keys -> adapter names; `mag` / `dora_cols` as
    in `Stacked`."""

    def __init__(self, path, groups: Dict[GroupKey, tuple], members: Dict[GroupKey, List[str]],
                 mag=None, dora_cols=None, base=None, bias=None):
        self.path, self.groups, self.members = path, groups, members
        self.covered = set()  # adapter names with weights here (set by the owner)
        self.mag, self.dora_cols, self.base, self.bias = mag, dora_cols, base, bias

    def arrays(self) -> List[mx.array]:
        return [x for g in self.groups.values() for x in g] + [
            x for x in (self.mag, self.dora_cols) if x is not None]

    def weights(self, path: str, name: str):
        if name not in self.covered:
            return None
        for key, names in self.members.items():
            if name in names:
                j = names.index(name)
                return self.groups[key][0][j], self.groups[key][1][j]
        return None

    def mag_row(self, path: str, slot: int) -> mx.array:
        return self.mag[slot]

    def __call__(self, x, y, sel: Selection):
        low = None
        for key, (a, b) in self.groups.items():
            g = sel.groups.get(key)
            if g is None:  # no row of this batch uses an adapter of this group
                continue
            slot, scale = g
            z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=slot), b,
                             rhs_indices=slot)  # [B, L, r] then [B, L, out]
            z = (scale.astype(z.dtype) * z).astype(x.dtype)
            low = z if low is None else low + z
        if low is None:
            return y
        if not (sel.dora and self.mag is not None):
            return y + low
        mag = self.mag[sel.slot_col].astype(x.dtype)  # [B, 1, out]
        if self.base is None and self.bias is None:
            return mag * (y + low)
        yd = x @ base_weight(self.base)[0].T if self.base is not None else y - self.bias
        dora = mag * (yd + low)
        if self.bias is not None:
            dora = dora + self.bias
        return mx.where(self.dora_cols[sel.slot_col], dora, y + low)
