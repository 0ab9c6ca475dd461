"""The adapters an engine serves over its one base model, on the worker.

`AdapterSet` fits adapters read by models/adapters.py to the model's linears. Each
linear some adapter targets gets one update (lowrank.py) holding every adapter's
weights for it: a `lowrank.AdaptedLinear` wraps the linear, or, where the engine
fused q/k/v or gate/up into one matmul (fuse.py), one update of the fused product
serves the whole group. Adding or removing an adapter rebuilds those updates
(slots are positions in `names`) and bumps `version`, so the executor rebuilds its
per-batch `Selection`s. With no adapter loaded the model is untouched; when the
last one goes, so do the wrappers.

The executor brackets every forward with `using(selection)`: the wrappers read
`sel` while the forward builds its graph (on this thread only).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

import mlx.nn as nn

from . import lowrank_kernels
from .gathered import Gathered
from .lowrank import (AdaptedLinear, FusedUpdate, Selection, Stacked, base_weight,
                      linear_dims)

__all__ = ["AdapterSet", "DEFAULTS", "FORMULATIONS"]

FORMULATIONS = ("stacked", "gather")
# the options of the AdapterSet an engine's worker builds (bench/adapters.py sets
# them to compare formulations; cast, fold None: on with the stacked formulation;
# kernel None: lowrank_kernels' update where its self-check passes, False: never)
DEFAULTS = dict(formulation="stacked", share=True, cast=None, fold=None, kernel=None)


_SERVING = "_mlxnb_adapters"  # the model's attribute: the AdapterSet whose hooks it holds


def _serving(model) -> Optional["AdapterSet"]:
    return model.__dict__.get(_SERVING)


def _resolve(model, path: str):
    """(owner module, attribute name, current layer) for a dotted parameter path."""
    parts = path.split(".")
    obj = model
    for p in parts[:-1]:
        if isinstance(obj, (list, tuple)):
            if not p.isdigit() or int(p) >= len(obj):
                return None
            obj = obj[int(p)]
        elif isinstance(obj, dict) and p in obj:
            obj = obj[p]
        else:
            return None
    leaf = parts[-1]
    layer = getattr(obj, leaf, None) if isinstance(obj, dict) else None
    return (obj, leaf, layer) if layer is not None else None


class AdapterSet:
    """`formulation`: "stacked" (lowrank.Stacked; `share`: one update per fused
    q/k/v or gate/up group) or "gather" (gathered.Gathered). `cast`: hold the adapters in the base weights' dtype
    (bfloat16 on a bfloat16 model) instead of their own, as mlx-lm's fused models
    do; mlx-lm's LoRALinear computes in theirs. `fold`: stacked decode steps scale
    before the B product and add with one addmm. Either changes the last bits of a
    row's update against mlx-lm's LoRALinear, for fewer or cheaper ops. `kernel`
    False: folded updates stay on MLX ops even where lowrank_kernels' kernel runs
    (`update_path` says which one the last build took)."""

    def __init__(self, model, formulation: Optional[str] = None,
                 share: Optional[bool] = None, cast: Optional[bool] = None,
                 fold: Optional[bool] = None, kernel: Optional[bool] = None, owner=None):
        formulation = DEFAULTS["formulation"] if formulation is None else formulation
        share = DEFAULTS["share"] if share is None else share
        cast = DEFAULTS["cast"] if cast is None else cast
        fold = DEFAULTS["fold"] if fold is None else fold
        kernel = DEFAULTS["kernel"] if kernel is None else kernel
        if formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {', '.join(FORMULATIONS)}; "
                             f"got {formulation!r}")
        cast = formulation == "stacked" if cast is None else cast
        fold = formulation == "stacked" if fold is None else fold
        self.model = model
        self._owner = weakref.ref(owner) if owner is not None else None  # (see owned)
        self.formulation, self.cast = formulation, cast
        self.share = share and formulation == "stacked"
        self.fold = fold and formulation == "stacked"
        self.kernel = kernel is not False
        # "kernel", or "ops" with why not: how the last build's folded updates run
        self.update_path = "ops"
        self.adapters: Dict[str, object] = {}  # name -> AdapterFiles, in slot order
        self.units: Dict[tuple, object] = {}  # unit key -> AdaptedLinear / FusedUpdate
        self.wrapped: Dict[str, tuple] = {}  # path -> (owner, leaf, AdaptedLinear, shadowed)
        self.sel: Optional[Selection] = None  # set around each forward (using)
        self.version = 0
        self.nbytes = 0  # the stacked weights' bytes
        self._selections: Dict[tuple, Optional[Selection]] = {}  # select's, this version
        self._keys: Dict[str, tuple] = {}  # name -> its (rank, dtype name) group
        self._updates: Dict[str, object] = {}  # path -> the update holding its weights
        self._layouts: Dict[tuple, int] = {}  # (Stacked layout, dtype) -> id
        self._built_names: List[str] = []  # the slot order of the last build

    @property
    def names(self) -> List[str]:
        return list(self.adapters)

    # -- membership ------------------------------------------------------------------
    def check(self, files) -> None:
        """ValueError (one line) unless every layer `files` adapts is a linear of this
        model with matching shapes, and no other engine serves adapters on it."""
        other = _serving(self.model)
        if other is not None and other is not self:
            if other.owned():
                gc.collect()  # an engine dropped without close() may only await collection
            if other.owned():
                # The hooks sit on the shared modules and read one engine's selection:
                # two engines' adapters there would each change the other's rows.
                raise ValueError("this model object already serves adapters in another "
                                 "Engine; give each Engine with adapters its own copy of "
                                 "the model (load it again), or close the other Engine "
                                 "first")
            other.close()  # its engine is gone: its hooks go
        for path, d in files.layers.items():
            hit = _resolve(self.model, path)
            if hit is None:
                raise ValueError(f"the adapter at {files.path} adapts {path!r}, which "
                                 "this model does not have; was it trained on another "
                                 "model?")
            layer = hit[2]
            if isinstance(layer, AdaptedLinear):
                layer = layer.base
            dims = linear_dims(layer)
            if dims is None:
                raise ValueError(f"the adapter at {files.path} adapts {path!r}, a "
                                 f"{type(layer).__name__}; mlxnb serves adapters on "
                                 "linear layers (Linear, QuantizedLinear) only")
            want = (dims[0], d["lora_a"].shape[1]), (d["lora_b"].shape[0], dims[1])
            if (tuple(d["lora_a"].shape), tuple(d["lora_b"].shape)) != want:
                raise ValueError(
                    f"the adapter at {files.path} does not fit this model: {path} is "
                    f"{dims[0]} -> {dims[1]} but lora_a is {tuple(d['lora_a'].shape)} "
                    f"and lora_b {tuple(d['lora_b'].shape)}; was it trained on another "
                    "model?")

    def add(self, name: str, files) -> int:
        """Serve `files` as `name` (checked first); returns the stacked bytes."""
        self.check(files)
        a = next(iter(files.layers.values()))["lora_a"]
        self._keys[name] = (files.rank, str(a.dtype).split(".")[-1])
        self.adapters[name] = files
        try:
            self._rebuild()
        except Exception:
            del self.adapters[name]
            self._rebuild()
            raise
        return self.nbytes

    def owned(self) -> bool:
        """Is the engine whose adapters these are still there? (An engine dropped
        without close() leaves its hooks on the model; the next engine to load an
        adapter on it takes them off.)"""
        return self._owner is None or self._owner() is not None

    def close(self) -> None:
        """Take every adapter's hooks off the model: it is as it was before any."""
        self.adapters.clear()
        self._rebuild()
        self._keys.clear()

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._rebuild()
        self._keys.pop(name, None)

    def _rebuild(self):
        targets = {p for f in self.adapters.values() for p in f.layers}
        plan: Dict[tuple, list] = {}  # unit key -> [(path, layer)] in output order
        for path in sorted(targets):
            owner, leaf, layer = _resolve(self.model, path)
            if isinstance(layer, AdaptedLinear):
                layer = layer.base
            fused = getattr(layer, "fused", None)  # fuse.py's part of a fused group
            if self.share and fused is not None:
                prefix = path.rsplit(".", 1)[0]
                plan[("fused", id(fused))] = [(f"{prefix}.{n}", getattr(owner, n))
                                              for n in fused.names]
            else:
                plan[("linear", path)] = [(path, layer)]
        old = self._updates
        for key in [k for k in self.units if k not in plan]:
            self._unwrap(key)
        for key, parts in plan.items():
            if key not in self.units:
                self._wrap(key, parts)
        names = self.names
        self._layouts = {}
        self._updates = {}
        total = 0
        paths = set()
        for key, parts in plan.items():
            upd = self._build(parts, names, old)
            if isinstance(upd, Stacked) and upd.lin is not None:
                paths.add(self._kernel(upd, names))
            for path, _ in parts:
                self._updates[path] = upd
            hook = self.units[key]
            hook.update = upd
            arrays = upd.arrays()
            mx.eval(arrays)
            total += upd.nbytes if isinstance(upd, Stacked) else sum(
                x.nbytes for x in arrays)
        # The stacks hold every adapter's weights now: drop the arrays as read, so
        # the adapters cost the stacks' bytes only.
        for f in self.adapters.values():
            for d in f.layers.values():
                d["lora_a"] = d["lora_b"] = None
                d.pop("m", None)
        self._built_names = names
        if self.units:
            object.__setattr__(self.model, _SERVING, self)
        elif _serving(self.model) is self:
            object.__delattr__(self.model, _SERVING)
        self.update_path = (", ".join(sorted(paths)) if paths else
                            "ops (no folded linear)")
        self.nbytes = total
        self.version += 1
        self._selections.clear()

    def _kernel(self, upd: Stacked, names: List[str]) -> str:
        """Give a folded update lowrank_kernels' kernel where it runs here; returns
        the path taken ("kernel" or "ops (why)")."""
        if not self.kernel:
            return "ops (kernel off)"
        launch, why = lowrank_kernels.kernel_for(upd.wcat.dtype)
        if launch is None:
            return f"ops ({why})"
        upd.use_kernel(launch, names)
        return "kernel"

    def _wrap(self, key, parts):
        if key[0] == "fused":
            fused = parts[0][1].fused
            hook = FusedUpdate(fused, self, None)
            fused.adapter = hook
        else:
            path = key[1]
            owner, leaf, layer = _resolve(self.model, path)
            # An instance attribute: the base linear stays in the parameter tree
            # (nn.Module.__setattr__ would drop it from there).
            shadowed = owner.__dict__.get(leaf)  # a fused part, or None
            hook = AdaptedLinear(layer, self)
            object.__setattr__(owner, leaf, hook)
            self.wrapped[path] = (owner, leaf, hook, shadowed)
        self.units[key] = hook

    def _unwrap(self, key):
        hook = self.units.pop(key)
        if isinstance(hook.update, Stacked):
            hook.update.unmerge()
        if key[0] == "fused":
            hook.fused.adapter = None
            return
        owner, leaf, _, shadowed = self.wrapped.pop(key[1])
        if shadowed is None:
            object.__delattr__(owner, leaf)  # the module child shows again
        else:
            object.__setattr__(owner, leaf, shadowed)

    def _own(self, n: str, path: str, old: dict):
        """Adapter n's (A, B, m or None) for `path`, or None: as read, or out of the
        update the previous build made (it keeps no copy of its own)."""
        d = self.adapters[n].layers.get(path)
        if d is None:
            return None
        if d.get("lora_a") is not None:
            return d["lora_a"], d["lora_b"], d.get("m")
        a, b = old[path].weights(path, n)
        return a, b, None

    def _build(self, parts, names: List[str], old: dict):
        """The update over `parts` [(path, layer)] for the adapters `names`."""
        inp = linear_dims(parts[0][1])[0]
        first = parts[0][1]
        own = {(p, n): self._own(n, p, old) for p, _ in parts for n in names}
        # DoRA: m / ||adapted W|| per slot and output column
        dora = {(p, n) for (p, n), w in own.items()
                if w is not None and self.adapters[n].kind == "dora"}
        mag = cols = None
        if dora:
            mags, flags = [], []
            for p, layer in parts:
                out = linear_dims(layer)[1]
                W = None
                rows, fl = [], []
                for slot, n in enumerate(names + [None]):
                    fl.append(mx.full((out,), (p, n) in dora))
                    if (p, n) not in dora:
                        rows.append(mx.ones((out,), mx.float32))
                    elif own[(p, n)][2] is None:  # computed by an earlier build
                        rows.append(old[p].mag_row(p, self._built_names.index(n)))
                    else:
                        # mlx-lm's DoRALinear.__call__, term for term (it depends on
                        # the adapter only, so once here instead of every step)
                        a, b, m = own[(p, n)]
                        if W is None:
                            W, _ = base_weight(layer)
                        adapted = W + (self.adapters[n].scale * b.T) @ a.T
                        rows.append((m / mx.linalg.norm(adapted, axis=1)).astype(mx.float32))
                mags.append(mx.stack(rows))
                flags.append(mx.stack(fl))
            mag = mx.concatenate(mags, axis=1)  # [n_adapters + 1, out]
            cols = mx.concatenate(flags, axis=1)  # [n_adapters + 1, out] bool
        quantized = isinstance(first, nn.QuantizedLinear)
        fused = getattr(first, "fused", None)
        if len(parts) > 1:
            lin = fused.linear
            bias = lin.bias if "bias" in lin else None
        else:
            bias = base_weight(first)[1]
        base = first if quantized else None
        if self.formulation == "gather":
            return self._gathered(parts[0], inp, own, names, mag, cols, base, bias)
        blocks = [(p, n) + own[(p, n)][:2] for p, _ in parts for n in names
                  if own[(p, n)] is not None]
        if self.cast:
            dtype = (first.scales.dtype if quantized else
                     fused.linear.weight.dtype if fused is not None else first.weight.dtype)
            if mag is not None:  # as mlx-lm's `(m / denom).astype(x.dtype)` rounds it
                mag = mag.astype(dtype)
        else:
            dts = {x.dtype for blk in blocks for x in blk[2:]}
            dtype = dts.pop() if len(dts) == 1 else mx.float32
        layout = tuple((n, a.shape[1]) for _, n, a, _ in blocks)
        lid = self._layouts.setdefault((layout, dtype), len(self._layouts))
        widths = [(p, linear_dims(layer)[1]) for p, layer in parts]
        # a plain linear (or fused group): A_all goes under its rows (Stacked._merge)
        lin = (fused.linear if len(parts) > 1 else
               first if isinstance(first, nn.Linear) else None)
        return Stacked(widths, blocks, dtype, lid, layout, mag, cols, base, bias,
                       lin if self.fold else None)

    def _gathered(self, part, inp, own, names, mag, cols, base, bias):
        path, layer = part
        out = linear_dims(layer)[1]
        groups, members = {}, {}
        for key, ns in self._groups().items():
            if not any(own[(path, n)] is not None for n in ns):
                continue
            r, dt = key
            dtype = getattr(mx, dt)
            ws = [own[(path, n)] for n in ns]
            a = mx.stack([w[0] if w else mx.zeros((inp, r), dtype) for w in ws])
            b = mx.stack([w[1] if w else mx.zeros((r, out), dtype) for w in ws])
            groups[key], members[key] = (a, b), ns  # [n, in, r], [n, r, out]
        g = Gathered(path, groups, members, mag, cols, base, bias)
        g.covered = {n for n in names if own[(path, n)] is not None}
        return g

    def _groups(self) -> Dict[tuple, List[str]]:
        """(rank, dtype name) -> adapter names in slot order."""
        out: Dict[tuple, List[str]] = {}
        for n in self.adapters:
            out.setdefault(self._keys[n], []).append(n)
        return out

    # -- per forward -------------------------------------------------------------------
    def select(self, adapters: Sequence[Optional[str]]) -> Optional[Selection]:
        """The Selection for a batch whose rows use `adapters` (None: no adapter);
        None when no row uses one (the forward skips the low-rank path)."""
        if not self.adapters:
            return None
        key = tuple(adapters)
        if key in self._selections:
            return self._selections[key]
        if len(self._selections) > 64:
            self._selections.clear()
        sel = self._selections[key] = self._select(key)
        return sel

    def _select(self, adapters: tuple) -> Optional[Selection]:
        if all(a is None for a in adapters):
            return None
        missing = sorted({a for a in adapters if a is not None and a not in self.adapters})
        if missing:
            raise ValueError(f"adapter {missing[0]!r} is not loaded")
        groups = None
        if self.formulation == "gather":
            groups = {}
            for key, members in self._groups().items():
                local = {n: i for i, n in enumerate(members)}
                if not any(a in local for a in adapters):
                    continue
                slot = mx.array([local.get(a, 0) for a in adapters], mx.uint32)
                scale = mx.array([self.adapters[a].scale if a in local else 0.0
                                  for a in adapters], mx.float32)[:, None, None]
                groups[key] = (slot, scale)
        dora = any(a is not None and self.adapters[a].kind == "dora" for a in adapters)
        scales = {n: f.scale for n, f in self.adapters.items()}
        layouts = sorted(self._layouts, key=self._layouts.get)
        return Selection(adapters, self.names, scales, dora, layouts, groups, self.fold)

    @contextlib.contextmanager
    def using(self, sel: Optional[Selection]):
        self.sel = sel
        try:
            yield
        finally:
            self.sel = None
