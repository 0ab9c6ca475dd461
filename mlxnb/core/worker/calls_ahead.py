"""The model's compiled functions, found in forwards that never run and compiled in
helper processes, one per function and argument dtypes, before the load's first
forward.

On a fresh CUDA machine a hybrid model's first forwards were mostly NVRTC compiling
the fused kernels of `mx.compile`d functions one after another, 5-8 s each on an H100
host: mlx-lm's gated delta rule (`compute_g`, `_gated_delta_step_ops`, with and
without a padding mask), MLX's activations (`nn.silu`), mlx-lm's `swiglu`. A
Qwen3.5-0.8B shape's cache probes and padding check took 56 s for 9 such kernels
(bench/results/first-token-2026-12-06-h100.md).

MLX names a fused kernel by its ops, the input dtypes, which inputs are scalars and
the constants' values (mlx/backend/common/compiled.cpp `build_lib_name`), never by
the sizes, so the same call on zeros of the same shapes in another process writes
the same file. `survey` builds the load's probe forwards lazily (MLX computes
nothing until an eval, and none is asked) with every compiled function that the
model's code reaches through MLX's and mlx-lm's modules replaced by a recorder;
`replay` (a helper process, kernels_ahead.py starts one per function and argument
dtypes) calls the recorded function on zeros, and another calls it inside a
compiled function of fixed shapes, as the engine's compiled decode steps do: there
it fuses into other kernels (a shapeless function's kernels carry broadcasts that a
fixed-shape trace leaves out). A call nested in another recorded call is left to
the outer one, whose fused kernels are the ones the model runs.

What is not recorded (a function bound elsewhere, arguments other than arrays,
numbers and None, in lists or tuples) is compiled by the engine as before: the
helpers only move work earlier, they decide nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, List

import mlx.core as mx

__all__ = ["done_names", "pieces", "replay", "run_piece", "survey"]

PREFIXES = ("mlx.nn", "mlx_lm.models")  # where the model's compiled functions live
_COMPILED = type(mx.compile(lambda x: x))


def encode(x):
    """A JSON form of a compiled function's argument, or raises TypeError."""
    if isinstance(x, mx.array):
        return {"a": list(x.shape), "d": str(x.dtype).rsplit(".", 1)[-1]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"v": x}
    if isinstance(x, (list, tuple)):
        return {"l" if isinstance(x, list) else "t": [encode(v) for v in x]}
    raise TypeError(type(x).__name__)


def decode(x):
    if "a" in x:
        return mx.zeros(x["a"], getattr(mx, x["d"], None) or getattr(mx, x["d"] + "_"))
    if "v" in x:
        return x["v"]
    items = [decode(v) for v in x.get("l", x.get("t", []))]
    return items if "l" in x else tuple(items)


def _pattern(x, sizes: bool = True):
    """What of a call decides its kernels' names and fusion: dtypes, the sizes that
    are 1 (broadcasts, scalars) and constants' values, not the other sizes; without
    `sizes`, the dtypes and constants alone."""
    if "a" in x:
        return [x["d"], [1 if n == 1 else 0 for n in x["a"]]] if sizes else x["d"]
    if "v" in x:
        return x["v"]
    return [_pattern(v, sizes) for v in x.get("l", x.get("t", []))]


def _what(call: dict, sizes: bool = True) -> list:
    return [call["module"], call["name"], _pattern({"l": call["args"]}, sizes),
            sorted((k, _pattern(v, sizes)) for k, v in call["kwargs"].items())]


def key(call: dict, inline: bool) -> str:
    """A short name of what `call` compiles, plain or `inline`, with mlx-lm's version
    (a new one may change a function's body, not its name)."""
    what = [_what(call), inline, _mlx_lm_version()]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _mlx_lm_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return ""


def grouped(calls: List[dict]) -> List[List[dict]]:
    """`calls` by function and argument dtypes: the calls of a group differ only in
    sizes, so they mostly compile the same kernels, one helper's work (the later
    ones find them in its memory)."""
    groups = {}
    for c in calls:
        groups.setdefault(json.dumps(_what(c, sizes=False)), []).append(c)
    return list(groups.values())


def _bindings():
    """(module, attribute name, compiled function) for every compiled function bound
    in a loaded module of MLX's nn or mlx-lm's models."""
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(PREFIXES):
            continue
        for attr, v in list(vars(mod).items()):
            if isinstance(v, _COMPILED):
                out.append((mod, attr, v))
    return out


def _home(fn, mod, attr):
    """(module name, attribute) a helper imports `fn` from: where it was defined."""
    home, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if home and name and getattr(sys.modules.get(home), name, None) is fn:
        return home, name
    return mod.__name__, attr


@contextmanager
def recording():
    """Within it, this thread's calls of the bound compiled functions are noted (each
    pattern once, outermost calls only) in the list it yields. The functions are
    module attributes, so other threads (another engine's worker, a user's
    generate) see the recorder too: it passes their calls straight through."""
    calls, seen, depth = [], set(), threading.local()
    patched, me = [], threading.get_ident()

    def recorder(fn, where):
        def call(*args, **kwargs):
            if threading.get_ident() != me:
                return fn(*args, **kwargs)
            outer = getattr(depth, "n", 0) == 0
            depth.n = getattr(depth, "n", 0) + 1
            try:
                if outer:
                    try:
                        c = {"module": where[0], "name": where[1],
                             "args": [encode(a) for a in args],
                             "kwargs": {k: encode(v) for k, v in kwargs.items()}}
                        k = json.dumps(_what(c))
                        if k not in seen:
                            seen.add(k)
                            calls.append(c)
                    except TypeError:
                        pass  # (an argument a helper cannot make: left to the engine)
                return fn(*args, **kwargs)
            finally:
                depth.n -= 1
        return call

    wrapped = {}
    try:
        for mod, attr, fn in _bindings():
            if id(fn) not in wrapped:
                wrapped[id(fn)] = recorder(fn, _home(fn, mod, attr))
            setattr(mod, attr, wrapped[id(fn)])
            patched.append((mod, attr, fn))
        yield calls
    finally:
        for mod, attr, fn in patched:
            setattr(mod, attr, fn)


def survey(forwards: List[Callable[[], object]]) -> List[List[dict]]:
    """The compiled calls of `forwards` (each builds a lazy forward; none is
    evaluated), `grouped`; those before a forward that failed, since the engine's
    own probes then say why."""
    with recording() as calls:
        try:
            for f in forwards:
                f()
        except Exception:
            from ..._log import swallowed

            swallowed("surveying the model's compiled functions")
    return grouped(calls)


def pieces(groups: List[List[dict]], done: Callable[[str], bool] = lambda name: False
           ) -> List[str]:
    """Each group as it is and `inline`, a helper's work each (JSON), with only the
    calls whose marker file (`done_names`) `done` does not find: another model's
    load may have compiled some of them."""
    out = []
    for inline in (False, True):
        for g in groups:
            left = [c for c in g if not done(_marker(c, inline))]
            if left:
                out.append(json.dumps({"calls": left, "inline": inline}))
    return out


def _marker(call: dict, inline: bool) -> str:
    return f"mlxnb-model-call-{key(call, inline)}.done"


def is_piece(text: str) -> bool:
    return text.startswith("{")


def done_names(text: str) -> List[str]:
    """The files that mark a piece's calls compiled on this machine."""
    piece = json.loads(text)
    return [_marker(c, piece["inline"]) for c in piece["calls"]]


def run_piece(text: str) -> None:
    piece = json.loads(text)
    replay(piece["calls"], piece["inline"])


def _mlx_lm_models():
    """Lets `import mlx_lm.models.X` run without mlx_lm's package `__init__`, which
    imports transformers (seconds in every helper)."""
    import importlib.util
    import types

    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType("mlx_lm")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["mlx_lm"] = pkg


def replay(calls: List[dict], inline: bool = False) -> None:
    """Run the recorded calls on zeros of their shapes (a helper process); `inline`:
    each inside a compiled function of fixed shapes, as the engine's compiled decode
    steps (recurrent.py) run them, which fuses them into other kernels."""
    import importlib

    for call in calls:
        if call["module"].startswith("mlx_lm."):
            _mlx_lm_models()
        fn = getattr(importlib.import_module(call["module"]), call["name"])
        if inline:
            fn = mx.compile(lambda *a, _fn=fn, **kw: _fn(*a, **kw))
        mx.eval(fn(*[decode(a) for a in call["args"]],
                   **{k: decode(v) for k, v in call["kwargs"].items()}))
