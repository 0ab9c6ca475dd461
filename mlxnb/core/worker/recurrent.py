"""Recurrent layers' decode steps as one compiled call each.

A decode step is host-bound on GPUs at these model sizes: MLX builds the graph op by
op from Python (~8-15 us a node on an H200), and a gated delta-net or short-conv
decoder layer is 50-130 nodes. Unlike an attention layer, whose KV grows every step,
a recurrent layer decodes the same computation on the same shapes every step (its
state has a fixed size), so `mx.compile` traces it once per batch size and replays
the trace from C++ after that, with its elementwise chains fused: measured at toy
width on a CPU, building one Qwen3.5 gated delta-net layer's step took 30 us instead
of 233, an LFM2 short-conv layer's 13 instead of 49-132.

`compile_recurrent` gives each decoder layer whose cache is an ArraysCache a subclass
(in place, on this model instance) whose decode calls -- one token, no mask, a state
that is not padded or mid-prefill -- go to the compiled step; everything else (prefill
chunks, padded groups, speculative verify steps) runs mlx-lm's code as before. A
compiled trace holds the weights it saw: each engine's `enabled()` (no adapter
selected for this forward) keeps it to the weights it was traced with. A load-time probe
compares compiled and plain decode steps and puts the layers back if they differ.

The attention layers of such a hybrid model keep mlx-lm's code (their KV grows every
step), but their MLP (`mlp` / `feed_forward`: plain linears and elementwise ops on a
[B, 1, hidden] input) is the same computation every step too, so it gets a compiled
one-token call the same way, behind the same gates and probe.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from . import gated_delta, short_conv
from .rows_gemv import RowsLinear

__all__ = ["compile_recurrent", "uncompile", "register", "carry", "Gated"]

_SUBCLASSES = {}


def _signature(cls) -> Optional[tuple]:
    """(input name, mask name or None) if `cls.__call__(x, [mask,] cache)` is how the
    layer is called (mlx-lm's decoder layers), else None."""
    try:
        params = list(inspect.signature(cls.__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    if len(names) == 3 and names[1:] == ["mask", "cache"]:
        return names[0], "mask"
    if len(names) == 2 and names[1] == "cache":
        return names[0], None
    return None


def _subclass(cls):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        def __call__(self, x, *args, **kwargs):
            st = self._mlxnb_decode
            mask, cache = st.bind(args, kwargs)
            if (mask is None and type(cache) is ArraysCache and x.shape[1] == 1
                    and cache.lengths is None and cache.left_padding is None
                    and st.allowed()
                    and all(s is not None for s in cache.cache)):
                out = st.step(x, *cache.cache)
                cache.cache = list(out[1:])
                return out[0]
            return cls.__call__(self, x, *args, **kwargs)

        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__,
            "__doc__": cls.__doc__, "_mlxnb_base": cls})
    return sub


class Gated:
    """Every engine on this model instance adds its gate; all must allow a replay."""

    def __init__(self, enabled: Callable[[], bool]):
        self.gates = []
        self.add_gate(enabled)

    def add_gate(self, enabled: Callable[[], bool]) -> None:
        self.gates = [r for r in self.gates if r() is not None]
        self.gates.append(_weak(enabled))

    def allowed(self) -> bool:
        """Every live engine allows a replay, and one at least does: once the
        engines are gone the model is mlx-lm's own again."""
        live = False
        for ref in self.gates:
            gate = ref()
            if gate is not None:
                if not gate():
                    return False
                live = True
        return live

    def carry(self, refs: list) -> None:
        """Add other engines' gates (weak references, as `register` gives them)."""
        have = {_gate_key(r()) for r in self.gates if r() is not None}
        self.gates += [r for r in refs if r() is not None and _gate_key(r()) not in have]


def _weak(enabled: Callable[[], bool]):
    """A bound method is held weakly (a closed engine's gate goes with it)."""
    return (weakref.WeakMethod(enabled) if inspect.ismethod(enabled)
            else (lambda f=enabled: f))


def _gate_key(gate) -> tuple:
    return (id(gate.__self__), gate.__func__) if inspect.ismethod(gate) else (id(gate),)


def register(model, enabled: Callable[[], bool]) -> list:
    """Record an engine's gate on `model` (weakly, outside its module tree) whether or
    not that engine compiles anything; the other live engines' gates, for `carry`.
    An engine loading on a model re-makes the compiled steps for its own settings,
    and every live engine's gate must still hold them shut while its adapter rows
    run -- an engine that compiled nothing included."""
    held = [r for r in model.__dict__.get("_mlxnb_gates", ()) if r() is not None]
    model.__dict__["_mlxnb_gates"] = held + [_weak(enabled)]
    return held


def carry(model, refs: list) -> None:
    """Every compiled step and MLP on `model.layers` takes `refs` too."""
    for layer in getattr(model, "layers", None) or []:
        if isinstance(layer, nn.Module):
            for m in (layer, *layer.children().values()):
                g = getattr(m, "_mlxnb_decode", None) if isinstance(m, nn.Module) else None
                if isinstance(g, Gated):
                    g.carry(refs)


class _Decode(Gated):
    """A layer's compiled decode step and how its calls name mask and cache."""

    def __init__(self, layer, cls, x_name: str, mask_name: Optional[str], nstate: int,
                 enabled: Callable[[], bool], recurrence: str):
        super().__init__(enabled)
        self.mask_name = mask_name
        order = ("mask", "cache") if mask_name else ("cache",)
        self.order = order

        def step(x, *state):  # x [B, 1, hidden]; state: the cache's arrays, [B, ...] each
            c = ArraysCache(nstate)
            c.cache = list(state)
            kw = {x_name: x, "cache": c}
            if mask_name:
                kw[mask_name] = None
            with gated_delta.tracing(recurrence):  # (runs while tracing only)
                y = cls.__call__(layer, **kw)
            return (y, *c.cache)

        self.step = mx.compile(step)

    def bind(self, args, kwargs):
        if len(args) == 1 and len(kwargs) == 1 and len(self.order) == 2:
            cache = kwargs.get("cache", False)  # mlx-lm's `layer(h, mask, cache=c)`
            if cache is not False:
                return args[0], cache
        got = dict(zip(self.order, args))
        got.update(kwargs)
        if len(got) > len(self.order) or any(k not in self.order for k in got):
            return True, None  # called some other way: the plain path
        return got.get("mask"), got.get("cache")


_MLP_NAMES = ("mlp", "feed_forward")
_LINEARS = (nn.Linear, nn.QuantizedLinear, RowsLinear)


def _mlp_subclass(cls):
    sub = _SUBCLASSES.get(("mlp", cls))
    if sub is None:
        def __call__(self, x):
            st = self._mlxnb_decode
            if x.ndim == 3 and x.shape[1] == 1 and st.allowed():
                return st.step(x)
            return cls.__call__(self, x)

        sub = _SUBCLASSES[("mlp", cls)] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__,
            "__doc__": cls.__doc__, "_mlxnb_base": cls})
    return sub


class _MLP(Gated):
    def __init__(self, mlp, cls, enabled: Callable[[], bool]):
        super().__init__(enabled)
        self.step = mx.compile(lambda x: cls.__call__(mlp, x))


def _plain_mlp(m) -> bool:
    """Linears (quantized, or fuse.py's fused ones, too) and elementwise code, called
    as m(x): no experts' routing."""
    if not isinstance(m, nn.Module) or hasattr(type(m), "_mlxnb_base"):
        return False
    try:
        params = list(inspect.signature(type(m).__call__).parameters)[1:]
    except (TypeError, ValueError):
        return False
    subs = [x for _, x in m.named_modules() if x is not m]
    return len(params) == 1 and bool(subs) and all(type(x) in _LINEARS for x in subs)


def _compile_mlps(layers, cache, enabled) -> None:
    for layer, c in zip(layers, cache):
        if type(c) is ArraysCache:
            continue
        for name in _MLP_NAMES:
            m = layer.get(name) if isinstance(layer, nn.Module) else None
            if hasattr(type(m), "_mlxnb_base"):
                m._mlxnb_decode.add_gate(enabled)  # compiled for another engine
            elif _plain_mlp(m):
                cls = type(m)
                m._mlxnb_decode = _MLP(m, cls, enabled)
                m.__class__ = _mlp_subclass(cls)


def compile_recurrent(model, cache: list, enabled: Callable[[], bool],
                      recurrence: str = "ops", convs: bool = False) -> int:
    """Give every layer of `model.layers` whose cache (in `cache`, the model's
    make_prompt_cache) is an ArraysCache a compiled decode step; returns how many.
    `recurrence`: what a gated delta rule inside runs as (gated_delta.MODES); `convs`:
    short convs inside run as short_conv.py's kernels (in a kernel mode)."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(cache):
        return 0
    n = 0
    for layer, c in zip(layers, cache):
        if type(c) is not ArraysCache:
            continue
        if hasattr(type(layer), "_mlxnb_base"):  # compiled for another engine already
            layer._mlxnb_decode.add_gate(enabled)
            n += 1
            continue
        cls = type(layer)
        sig = _signature(cls)
        if sig is None:
            continue
        layer._mlxnb_decode = _Decode(layer, cls, sig[0], sig[1], len(c.cache), enabled,
                                      recurrence)
        layer.__class__ = _subclass(cls)
        if convs and recurrence in short_conv.KERNEL_MODES:
            short_conv.adopt(layer)
        n += 1
    if n:
        _compile_mlps(layers, cache, enabled)
    return n


def uncompile(model) -> None:
    """Put every compiled layer (and MLP) back to its own class."""
    for layer in getattr(model, "layers", None) or []:
        short_conv.release(layer)
        mods = [layer] + [layer.get(n) for n in _MLP_NAMES if isinstance(layer, nn.Module)]
        for m in mods:
            base = getattr(type(m), "_mlxnb_base", None)
            if base is not None:
                m.__class__ = base
                del m._mlxnb_decode


def compiled_layers(model) -> List[int]:
    return [i for i, layer in enumerate(getattr(model, "layers", None) or [])
            if hasattr(type(layer), "_mlxnb_base")]


def compiled_mlps(model) -> List[int]:
    """Layers whose MLP has a compiled one-token call."""
    return [i for i, layer in enumerate(getattr(model, "layers", None) or [])
            if isinstance(layer, nn.Module) and any(
                hasattr(type(layer.get(n)), "_mlxnb_base") for n in _MLP_NAMES)]
