"""The adapters an engine serves over its one base model, on the worker.

`AdapterSet` fits adapters read by models/adapters.py to the model's linears: each
linear some adapter targets is wrapped once by a `lowrank.AdaptedLinear`, which
holds every adapter's weights for it stacked by (rank, dtype) group. Adding or
removing an adapter rebuilds those stacks (slots are positions in `names`) and
bumps `version`, so the executor rebuilds its per-batch `Selection`s. With no
adapter loaded the model is untouched; when the last one goes, so do the wrappers.

The executor brackets every forward with `using(selection)`: the wrappers read
`sel` while the forward builds its graph (on this thread only).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from .lowrank import AdaptedLinear, GroupWeights, Selection, base_weight, linear_dims

__all__ = ["AdapterSet"]


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
    def __init__(self, model):
        self.model = model
        self.adapters: Dict[str, object] = {}  # name -> AdapterFiles, in slot order
        self.wrapped: Dict[str, tuple] = {}  # path -> (owner, leaf, AdaptedLinear, shadowed)
        self.sel: Optional[Selection] = None  # set around each forward (using)
        self.version = 0
        self.nbytes = 0  # the stacked weights' bytes
        self._selections: Dict[tuple, Optional[Selection]] = {}  # select's, this version
        self._keys: Dict[str, tuple] = {}  # name -> its (rank, dtype name) group
        # the slot layout the stacks were built with (a rebuild reads them back)
        self._built_names: List[str] = []
        self._built_layout: Dict[tuple, List[str]] = {}

    @property
    def names(self) -> List[str]:
        return list(self.adapters)

    # -- membership ------------------------------------------------------------------
    def check(self, files) -> None:
        """ValueError (one line) unless every layer `files` adapts is a linear of this
        model with matching shapes."""
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

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._rebuild()
        self._keys.pop(name, None)

    def _rebuild(self):
        targets = {p for f in self.adapters.values() for p in f.layers}
        for path in [p for p in self.wrapped if p not in targets]:
            owner, leaf, _, shadowed = self.wrapped.pop(path)
            if shadowed is None:
                object.__delattr__(owner, leaf)  # the module child shows again
            else:
                object.__setattr__(owner, leaf, shadowed)
        for path in sorted(targets - set(self.wrapped)):
            owner, leaf, layer = _resolve(self.model, path)
            # An instance attribute: the base linear stays in the parameter tree
            # (nn.Module.__setattr__ would drop it from there).
            shadowed = owner.__dict__.get(leaf)  # a fused part, or None
            w = AdaptedLinear(layer, self)
            object.__setattr__(owner, leaf, w)
            self.wrapped[path] = (owner, leaf, w, shadowed)
        names, layout = self.names, self._groups()
        total = 0
        for path, (_, _, w, _) in self.wrapped.items():
            old, old_mag = w.groups, w.mag
            w.groups, w.mag, w.dora_slots = {}, None, None
            inp, out = w.dims

            def own(n, leaf):
                """Adapter n's array for this layer: as read, or out of the stacks
                the previous build made (it keeps no copy of its own)."""
                d = self.adapters[n].layers.get(path)
                if d is None:
                    return None
                if d.get(leaf) is not None:
                    return d[leaf]
                if leaf == "mag":
                    return old_mag[self._built_names.index(n)]
                key = self._keys[n]
                g = old[key]
                j = self._built_layout[key].index(n)
                return g.a[j] if leaf == "lora_a" else g.b[j]

            for key, members in layout.items():
                if not any(path in self.adapters[n].layers for n in members):
                    continue
                r, dt = key
                dtype = getattr(mx, dt)
                a = [own(n, "lora_a") for n in members]
                b = [own(n, "lora_b") for n in members]
                a = mx.stack([x if x is not None else mx.zeros((inp, r), dtype) for x in a])
                b = mx.stack([x if x is not None else mx.zeros((r, out), dtype) for x in b])
                w.groups[key] = GroupWeights(a, b)  # [n, in, r], [n, r, out]
            dora = [n for n in names if self.adapters[n].kind == "dora"
                    and path in self.adapters[n].layers]
            if dora:
                W, _ = base_weight(w.base)
                rows = []
                for n in names + [None]:
                    if n not in dora:
                        rows.append(mx.ones((out,), mx.float32))
                        continue
                    d = self.adapters[n].layers[path]
                    if "m" not in d:  # computed by an earlier build
                        rows.append(own(n, "mag"))
                        continue
                    # mlx-lm's DoRALinear.__call__, term for term (it depends on the
                    # adapter only, so once here instead of every step)
                    adapted = W + (self.adapters[n].scale * d["lora_b"].T) @ d["lora_a"].T
                    rows.append((d["m"] / mx.linalg.norm(adapted, axis=1)).astype(mx.float32))
                w.mag = mx.stack(rows)  # [n_adapters + 1, out]
                w.dora_slots = mx.array([n in dora for n in names] + [False])
            arrays = [x for g in w.groups.values() for x in g] + (
                [w.mag] if w.mag is not None else [])
            mx.eval(arrays)
            total += sum(x.nbytes for x in arrays)
        # The stacks hold every adapter's weights now: drop the arrays as read, so
        # the adapters cost the stacks' bytes only.
        for f in self.adapters.values():
            for d in f.layers.values():
                d["lora_a"] = d["lora_b"] = None
                d.pop("m", None)
        self._built_names, self._built_layout = names, layout
        self.nbytes = total
        self.version += 1
        self._selections.clear()

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
        names = self.names
        missing = sorted({a for a in adapters if a is not None and a not in self.adapters})
        if missing:
            raise ValueError(f"adapter {missing[0]!r} is not loaded")
        groups = {}
        for key, members in self._groups().items():
            local = {n: i for i, n in enumerate(members)}
            if not any(a in local for a in adapters):
                continue
            slot = mx.array([local.get(a, 0) for a in adapters], mx.uint32)
            scale = mx.array([self.adapters[a].scale if a in local else 0.0
                              for a in adapters], mx.float32)[:, None, None]
            groups[key] = (slot, scale)
        slots = mx.array([names.index(a) if a is not None else len(names)
                          for a in adapters], mx.uint32)
        dora = any(a is not None and self.adapters[a].kind == "dora" for a in adapters)
        return Selection(groups, slots, dora, len(adapters))

    @contextlib.contextmanager
    def using(self, sel: Optional[Selection]):
        self.sel = sel
        try:
            yield
        finally:
            self.sel = None
