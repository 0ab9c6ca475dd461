"""The batched low-rank layer: one base product for the whole batch, each row's own
LoRA/DoRA update added on top.

The update is mlx-lm's, row by row:

    LoRALinear:  y + (scale * ((x @ A) @ B)).astype(x.dtype)
    DoRALinear:  (m / ||W + scale B^T A^T||_row).astype(x.dtype) * (x @ W^T + ...) + bias

`Stacked` computes it for every row at once with no gather: each loaded adapter's
A side by side, A_all [in, C] (C = the adapters' ranks summed), and their B below
each other, B_all [C, out]:

    z = (x @ A_all) * mask      mask [B, C]: 1 on the columns of the row's adapter
    y + (scale_row * (z @ B_all)).astype(x.dtype)

A row's masked z holds its own adapter's x @ A and zeros, so z @ B_all is its own
(x @ A) @ B plus zero products (BLAS may sum them in another order: the last bits
can differ from mlx-lm's). Where the engine fuses q/k/v (or gate/up) into one matmul
(fuse.py) one `Stacked` serves the whole group: A_all holds every part's A (one
product of the shared input), B_all is block-diagonal onto the fused output.

A decode step on a GPU is host-bound (a cost per MLX op, matmuls the dearest), so
ops are what this layout saves. With `fold` (AdapterSet's default for this
formulation) a plain linear's A_all^T sits under its own weight rows, W' [out + C,
in], the linear keeping a view of its rows: the base matmul yields x @ A_all too,
each row's scale rides in the mask, and one addmm adds z @ B_all. A decode step
then adds, per distinct input, a mask multiply, an addmm and slices, no matmul.
On a GPU with a kernel API, one kernel (lowrank_kernels.py, checked on the device
first) takes W''s whole product and writes each row's base product plus its own
adapter's update: per adapted linear the ops are those of the base linear, for
decode steps and prefill chunks alike.
`gathered.py` keeps the per-row `gather_mm` formulation, whose products do not grow
with the adapters loaded (and whose row alone is bit for bit mlx-lm's).

An `AdaptedLinear` stands in for one of the model's linears (nn.Linear,
nn.QuantizedLinear, or a part of a fused projection left unshared) over the one copy
of its weights. A batch whose rows use no adapter runs the base linear alone
(`Selection` None): such rows pay one attribute read per layer.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["AdaptedLinear", "FusedUpdate", "Selection", "Stacked", "base_weight",
           "linear_dims"]

Layout = Tuple[Tuple[str, int], ...]  # (adapter name, columns) per block of A_all


class Selection:
    """Which adapter each row of the next forward uses (built per batch makeup)."""

    def __init__(self, adapters: Sequence[Optional[str]], names: List[str],
                 scales: Dict[str, float], dora: bool, layouts: List[tuple],
                 groups: Optional[dict] = None, fold: bool = False):
        self.rows = len(adapters)  # B
        # [B] uint32: each row's adapter slot; rows without one: len(names)
        slots = np.array([names.index(a) if a is not None else len(names)
                          for a in adapters], np.uint32)
        self.slots = mx.array(slots)
        self.slot_col = mx.array(slots[:, None])  # [B, 1]: [n + 1, out] -> [B, 1, out]
        self.dora = dora  # some row uses a DoRA adapter
        # [B, 1, 1] each row's adapter's scale (0 for base rows), by dtype
        s = np.array([scales.get(a, 0.0) for a in adapters], np.float32)
        self.scale_rows = mx.array(s)  # [B] float32: the update kernel's
        self._scales = {mx.float32: mx.array(s[:, None, None])}
        # per layout id: [B, C] 1 on the columns of the row's adapter, else 0
        # `fold`: also the masks times each row's scale (`folded`), for the decode
        # update that adds with one addmm
        self.masks, self.folded = [], ([] if fold else None)
        for layout, dtype in layouts:
            m = np.stack([np.concatenate([np.full(w, float(n == a), np.float32)
                                          for n, w in layout]) for a in adapters])
            self.masks.append(mx.array(m).astype(dtype))
            if fold:
                s = np.array([scales.get(a, 0.0) for a in adapters], np.float32)
                self.folded.append(mx.array(m * s[:, None]).astype(dtype))
        self.groups = groups  # gathered.py's: key -> (slot [B] uint32, scale [B, 1, 1])

    def scale(self, dtype) -> mx.array:
        s = self._scales.get(dtype)
        if s is None:  # the scale as mlx-lm's `scale * z` rounds it: in z's dtype
            s = self._scales[dtype] = self._scales[mx.float32].astype(dtype)
        return s


def _low(x, a, mask, b, scale):
    """[B, L, out]: each row's scale * ((x @ A) @ B), in x's dtype (x [B, L, in], a
    [in, C], mask [B, C], b [C, out], scale [B, 1, 1] float32)."""
    u = ((x @ a) * mask[:, None, :]) @ b
    return (scale.astype(u.dtype) * u).astype(x.dtype)


def _update(x, a, mask, b, y, scale):
    # prefill chunks and verify steps: shapes vary too much to compile for
    return y + _low(x, a, mask, b, scale)


@mx.compile
def _decode_update(x, a, mask, b, y, scale):
    # L == 1: two plain 2-D matmuls (no per-matmul flatten around them), the mask
    # without a broadcast, and the scale, cast and add in one kernel; each MLX op
    # costs host time on a GPU, where a decode step is host-bound
    z = (x.reshape(x.shape[0], -1) @ a) * mask  # [B, C]
    u = (z @ b).reshape(y.shape)  # [B, 1, out]
    return y + (scale.astype(u.dtype) * u).astype(x.dtype)


def _folded_update(x, a, mask, b, y):
    # L == 1, `mask` times each row's scale: y + z @ B in one addmm. The scale
    # multiplies before the B product and the add happens inside it, so the last
    # bits differ from mlx-lm's order; one kernel fewer than _decode_update
    n = x.shape[0]
    z = (x.reshape(n, -1) @ a) * mask  # [B, C]
    return mx.addmm(y.reshape(n, -1), z, b).reshape(y.shape).astype(y.dtype)


_KERNEL_STEPS: Dict[object, object] = {}


def _kernel_step(launch):
    """A decode step's folded product and update kernel as one compiled function
    (per kernel launcher): MLX builds a custom kernel's whole source string at every
    call in a graph, host time on the critical path of a host-bound step, where a
    compiled function replays the primitive it traced once per shape."""
    step = _KERNEL_STEPS.get(launch)
    if step is None:
        def fold_and_update(x, wt, bpad, tab, bounds, slots, scale, *bias):
            # x [B, 1, in], wt [in, out + C], bpad [C, out + C] -> [B, 1, out]
            n = x.shape[0]
            x2 = x.reshape(n, -1)
            y2 = mx.addmm(bias[0], x2, wt) if bias else x2 @ wt  # [B, out + C]
            c = bpad.shape[0]
            return launch(y2, bpad, tab, bounds, slots, scale, n, 1, bpad.shape[1] - c)

        step = _KERNEL_STEPS[launch] = mx.compile(fold_and_update)
    return step


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


class Stacked:
    """Every adapter's low-rank weights for one input's linear(s), side by side.

    `parts`: (path, out columns) of each linear whose output this update adds to, in
    output order (one for a plain linear; the parts of a fused group). `blocks`:
    (path, adapter name, A [in, r], B [r, out_part]) for each adapter covering a
    part. DoRA: `mag` [n_adapters + 1, out] m / ||adapted W|| per slot (1 where the
    slot is LoRA, does not cover the column, or is "no adapter"); `dora_cols` [same]
    bool: the slot is a DoRA adapter covering that column."""

    def __init__(self, parts, blocks, dtype, layout_id, layout: Layout,
                 mag=None, dora_cols=None, base=None, bias=None, lin=None):
        offsets, o = {}, 0
        for path, width in parts:
            offsets[path] = (o, o + width)
            o += width
        self.offsets = offsets  # path -> its output columns (o0, o1)
        self.blocks: Dict[Tuple[str, str], Tuple[int, int]] = {}  # -> A_all columns
        a_cols, b_rows, c = [], [], 0
        for path, name, a, b in blocks:
            o0, o1 = offsets[path]
            r = a.shape[1]
            self.blocks[(path, name)] = (c, c + r)
            c += r
            a_cols.append(a.astype(dtype))
            # a B row block: this adapter's B in its part's columns, zeros elsewhere
            pad = [(0, 0), (o0, o - o1)]
            b_rows.append(mx.pad(b.astype(dtype), pad) if len(parts) > 1 else
                          b.astype(dtype))
        self.a = mx.concatenate(a_cols, axis=1)  # [in, C]
        self.b = mx.concatenate(b_rows, axis=0)  # [C, out]
        self.layout_id, self.layout = layout_id, layout
        self.mag, self.dora_cols = mag, dora_cols
        self.base = base  # DoRA on a quantized linear: the layer, to dequantize
        self.bias = bias  # [out] or None
        self.lin = self.wcat = self.bcat = None
        self.kernel = self.tab = self.bounds = None  # set by use_kernel
        if lin is not None and lin.weight.dtype == dtype:
            self._merge(lin, o)

    def _merge(self, lin, out: int):
        """Hold A_all^T below the plain linear's rows, W' [out + C, in]: one matmul
        gives the base product and x @ A_all together. The linear keeps a view of
        its rows of W' (no second copy of the model's weights)."""
        c = self.a.shape[1]
        self.wcat = mx.concatenate([lin.weight, self.a.T], axis=0)  # [out + C, in]
        self.wt = self.wcat.T  # held evaluated (a view): no transpose op per forward
        lin.weight = self.wcat[:out]
        if "bias" in lin:
            self.bcat = mx.concatenate([lin.bias, mx.zeros((c,), lin.bias.dtype)])
            lin.bias = self.bcat[:out]
        self.a = self.wcat[out:].T  # [in, C]
        # B with zero columns under W's A rows: addmm onto the whole [B, out + C]
        self.bpad = mx.pad(self.b, [(0, 0), (0, c)])  # [C, out + C]
        self.b = self.bpad[:, :out]
        self.lin, self.out = lin, out

    def unmerge(self):
        """Give the linear its rows back as an array of their own (W' goes)."""
        if self.lin is not None:
            self.lin.weight = mx.array(self.lin.weight)
            if self.bcat is not None:
                self.lin.bias = mx.array(self.lin.bias)
            mx.eval(self.lin.parameters())
            self.lin = None

    def arrays(self) -> List[mx.array]:
        own = [self.a, self.b, self.mag, self.dora_cols]
        if self.lin is not None:  # the linear's views too: no slice left in its graph
            own += [self.wcat, self.wt, self.bcat, self.bpad, self.lin.weight,
                    self.lin.get("bias"), self.tab, self.bounds]
        return [x for x in own if x is not None]

    @property
    def nbytes(self) -> int:
        """The adapters' bytes (a merged linear's own rows of W' not counted)."""
        b = self.bpad if self.lin is not None else self.b
        return self.a.size * self.a.itemsize + b.nbytes + sum(
            x.nbytes for x in (self.mag, self.dora_cols) if x is not None)

    def use_kernel(self, launch, names: List[str]) -> None:
        """Run the folded update through lowrank_kernels' `launch` (a merged linear
        only), its column table made for the slots `names`."""
        from .lowrank_kernels import table

        if self.lin is not None:
            parts = [(p, o1 - o0) for p, (o0, o1) in self.offsets.items()]
            self.tab, self.bounds = table(self.blocks, parts, names)
            self.kernel = launch

    def apply(self, x, sel: Selection, base, wide: bool = False):
        """base(x) plus each row's update. A merged linear without a DoRA row: one
        matmul for the base product and x @ A_all, then the update kernel ([B, L,
        out]), or for a decode step the masked z and one addmm: [B, 1, out]
        (`wide`: [B, 1, out + C], for a fused group's parts to slice)."""
        n, length = x.shape[0], x.shape[1]
        if (self.lin is None or sel.folded is None or (length != 1 and self.kernel is None)
                or (sel.dora and self.mag is not None)):
            return self(x, base(x), sel)
        if self.kernel is not None and length == 1:
            bias = () if self.bcat is None else (self.bcat,)
            return _kernel_step(self.kernel)(x, self.wt, self.bpad, self.tab, self.bounds,
                                             sel.slots, sel.scale_rows, *bias)
        x2 = x.reshape(n * length, -1)
        y2 = (x2 @ self.wt if self.bcat is None else
              mx.addmm(self.bcat, x2, self.wt))  # [B * L, out + C]: y and x @ A_all
        if self.kernel is not None:
            return self.kernel(y2, self.bpad, self.tab, self.bounds, sel.slots,
                               sel.scale_rows, n, length, self.out)
        z = y2[:, self.out:] * sel.folded[self.layout_id]  # [B, C]
        y2 = mx.addmm(y2, z, self.bpad)
        return (y2 if wide else y2[:, :self.out]).reshape(n, 1, -1)

    def weights(self, path: str, name: str):
        """(A, B) of adapter `name` on `path` out of the stacks, or None."""
        cols = self.blocks.get((path, name))
        if cols is None:
            return None
        (c0, c1), (o0, o1) = cols, self.offsets[path]
        return self.a[:, c0:c1], self.b[c0:c1, o0:o1]

    def mag_row(self, path: str, slot: int) -> mx.array:
        o0, o1 = self.offsets[path]
        return self.mag[slot, o0:o1]

    def _plus_low(self, x, y, sel: Selection):
        """y + each row's low-rank update."""
        mask, scale = sel.masks[self.layout_id], sel.scale(mx.float32)
        if x.shape[1] > 1:
            return _update(x, self.a, mask, self.b, y, scale)
        if sel.folded is not None:
            return _folded_update(x, self.a, sel.folded[self.layout_id], self.b, y)
        return _decode_update(x, self.a, mask, self.b, y, scale)

    def __call__(self, x, y, sel: Selection):
        # x [B, L, in], y [B, L, out]: the base product (with its bias)
        if not (sel.dora and self.mag is not None):
            return self._plus_low(x, y, sel)
        mag = self.mag[sel.slot_col].astype(x.dtype)  # [B, 1, out]
        if self.base is None and self.bias is None:
            # LoRA and base rows: a magnitude of exactly 1
            return mag * self._plus_low(x, y, sel)
        low = _low(x, self.a, sel.masks[self.layout_id], self.b, sel.scale(mx.float32))
        # DoRA's base product has no bias, and is x @ dequantized(W)^T on a quantized
        # layer: computed for the batch only while a DoRA row is in it
        if self.base is not None:
            yd = x @ base_weight(self.base)[0].T
        else:
            yd = y - self.bias
        dora = mag * (yd + low)
        if self.bias is not None:
            dora = dora + self.bias
        return mx.where(self.dora_cols[sel.slot_col], dora, y + low)


def _check(x, sel: Selection):
    if x.ndim != 3 or x.shape[0] != sel.rows:
        raise ValueError(f"adapters need [batch, length, dims] inputs with one row "
                         f"per selected row; got shape {tuple(x.shape)}")


class AdaptedLinear:
    """A plain callable set on the owner module as an instance attribute: the base
    linear stays where it was in the parameter tree; unwrapping deletes the
    attribute (or puts back the fused part it shadowed)."""

    def __init__(self, base, owner):
        self.base = base
        self.owner = owner  # adapters.AdapterSet: holds `sel` for the forward
        self.dims = linear_dims(base)
        self.update = None  # Stacked or gathered.Gathered, set by the owner

    def __call__(self, x):  # x: [B, L, in] (prefill chunk or decode step)
        sel = self.owner.sel
        if sel is None or self.update is None:
            return self.base(x)  # [B, L, out]: the one base product
        _check(x, sel)
        if isinstance(self.update, Stacked):
            return self.update.apply(x, sel, self.base)
        return self.update(x, self.base(x), sel)


class FusedUpdate:
    """Set as a fused projection's `adapter` (fuse.py): one `Stacked` update of the
    fused product for all its parts."""

    def __init__(self, fused, owner, update: Stacked):
        self.fused, self.owner, self.update = fused, owner, update

    def __call__(self, x):
        """The fused product with each row's update ([B, L, sum of the parts' out],
        or wider: the parts slice theirs), or None for the plain product."""
        sel = self.owner.sel
        if sel is None:
            return None
        _check(x, sel)
        return self.update.apply(x, sel, self.fused.linear, wide=True)
