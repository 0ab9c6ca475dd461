"""One matmul where mlx-lm's models do two or three on the same input.

Attention blocks call `q_proj(x), k_proj(x), v_proj(x)` and MLPs `gate_proj(x)`,
`up_proj(x)` (LFM2's `w1(x)`, `w3(x)`): separate matmuls on one input, as are a gated
delta-net's input projections (Qwen3.5's `in_proj_qkv`, `_z`, `_b`, `_a`; Qwen3-Next's
`in_proj_qkvz`, `_ba`): 18 of Qwen3.5-0.8B's 24 layers make four of them a token. A decode step is host-bound on GPUs
(MLX's per-node cost), so fewer
nodes is faster steps; serving engines fuse these weights at load for the same reason (vLLM's
QKVParallelLinear, MergedColumnParallelLinear). Here the weights of each such group
are concatenated once and each old projection becomes a `_Part` returning its
columns of the one product -- a view: the model's `reshape` to heads does not copy
it. The model code is mlx-lm's, untouched.

Only plain `nn.Linear` groups are fused. Quantized matmuls cost more device time per
node, so removing nodes saves little, and on the H200 the engine with fused 4-bit
projections ran at 0.94 / 0.99 / 0.99 of the unfused one (medians at batch 8 / 32 /
128, bench/results/engine-decode-2026-11-29-h200.md): not worth a second
copy at load.

A group is fused only if a probe forward shows its parts called on one input each
time (else each part would compute the whole product); otherwise it is put back.
"""

from __future__ import annotations

import copy
from typing import List

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
          ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
          ("in_proj_qkvz", "in_proj_ba"))


def _key(names) -> str:
    """The fused linear's name in the module tree: q_k_v_fused, gate_up_fused,
    w1_w3_fused, in_proj_fused."""
    stem = names[0][:names[0].rfind("_") + 1]
    if stem and all(n.startswith(stem) for n in names):
        return stem + "fused"
    return "_".join(n.split("_")[0] for n in names) + "_fused"


class _Fused:
    """The concatenated projection (kept in the model tree under `key`)."""

    def __init__(self, owner: nn.Module, key: str, names, linears):
        self.owner, self.key, self.names, self.originals = owner, key, names, linears
        lin = copy.copy(linears[0])
        for k in linears[0].keys():
            lin[k] = mx.concatenate([m[k] for m in linears], axis=0)
        self.linear = lin
        dims = [m["weight"].shape[0] for m in linears]
        self.bounds = [(sum(dims[:i]), sum(dims[:i + 1])) for i in range(len(dims))]
        self._x = self._y = None
        # x -> the fused product with each row's LoRA/DoRA update, or None for the
        # plain one (adapters.py sets it while an adapter covers a part of this group)
        self.adapter = None
        self.products = 0  # fused products computed (the probe's count)

    def part(self, i: int, x: mx.array) -> mx.array:
        if self._x is not x:
            y = self.adapter(x) if self.adapter is not None else None
            if y is None:
                y = self.linear(x)  # [B, L, sum of the parts' out]
            self._x, self._y = x, y
            self.products += 1
        a, b = self.bounds[i]
        y = self._y[..., a:b]
        if i == len(self.bounds) - 1:  # the last part: don't hold the product
            self._x = self._y = None
        return y


class _Part:
    __slots__ = ("fused", "i")

    def __init__(self, fused: _Fused, i: int):
        self.fused, self.i = fused, i

    def __call__(self, x):
        return self.fused.part(self.i, x)


def _fusable(linears) -> bool:
    first = linears[0]
    return all(type(m) is nn.Linear and m.keys() == first.keys()
               and m["weight"].shape[1:] == first["weight"].shape[1:]
               and m["weight"].dtype == first["weight"].dtype
               for m in linears)


def fuse_projections(model: nn.Module, probe) -> int:
    """Fuse every group in GROUPS found in `model`, in place; `probe()` runs one
    forward. Returns how many groups stayed fused."""
    fused: List[_Fused] = []
    for mod in [m for _, m in model.named_modules()]:
        for names in GROUPS:
            linears = [mod.get(n) for n in names]
            if any(m is None for m in linears) or not _fusable(linears):
                continue
            key = _key(names)
            f = _Fused(mod, key, names, linears)
            mod[key] = f.linear
            for i, n in enumerate(names):
                setattr(mod, n, _Part(f, i))  # a plain attribute: not a parameter
            fused.append(f)
    if not fused:
        return 0
    mx.eval([f.linear.parameters() for f in fused])
    probe()
    kept = 0
    for f in fused:
        if f.products == 1:
            kept += 1
            f.originals = None  # their memory goes
            continue
        # called on different inputs (or not at all): the original matmuls
        for n, m in zip(f.names, f.originals):
            setattr(f.owner, n, m)
        del f.owner[f.key]
    return kept
