"""MLX graph nodes in one decode step: a bare loop, BatchGenerator, the Engine.

On a GPU a decode step at these model sizes is host-bound (MLX builds the graph node
by node), so the nodes a step builds, and how long building them takes, are the
engine's overhead to watch. Counted with mx.export_to_dot on the arrays a step
evaluates (the nodes not evaluated yet); the build time is the forward's graph
construction alone (no evaluation), median over steps.

On a CPU, MLX's fast ops (RMS norm, RoPE, attention) build their fallback graphs of
ten-odd nodes each, and the engine's compiled gated delta-net steps run mlx-lm's
ops; on a GPU each is one node. `gpu_like()` counts them as a GPU would: each one
node (a stand-in of the right shape and inputs, not the right values: for counting
only), and the engine's gated delta rule, short convs and one-token q/k norms with
RoPE as their CUDA kernels' one node each.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import re
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlxnb
from mlxnb.core.worker import batch as batch_module
from mlxnb.core.worker import gated_delta, qk_rope, recurrent, setup, short_conv

# nodes that launch no kernel on a GPU (views of their input)
VIEWS = {"Broadcast", "Reshape", "Transpose", "ExpandDims", "Squeeze", "Flatten",
         "Unflatten", "Slice", "Split", "AsStrided", "StopGradient"}


def _one_node(out, *deps):
    return mx.depends([out], [d for d in deps if isinstance(d, mx.array)])[0]


_GPU_LIKE = [False]


def _nodes(outs, deps):
    """One node giving `outs` (views of the inputs: the shapes a kernel returns)."""
    return tuple(mx.depends(list(outs), [d for d in deps if isinstance(d, mx.array)]))


@contextlib.contextmanager
def gpu_like():
    """Count graphs as a GPU builds them (module docstring); values are wrong."""
    gd, sc = gated_delta, short_conv
    compile_recurrent, tracing = recurrent.compile_recurrent, gd.tracing
    patches = [
        (mx.fast, "rms_norm", lambda x, w, eps: _one_node(x, w)),
        (mx.fast, "rope", lambda x, dims, **kw: _one_node(x, kw.get("offset"))),
        (mx.fast, "scaled_dot_product_attention",
         lambda q, k, v, **kw: _one_node(q, k, v, kw.get("mask"))),
        (gd, "decode_step", lambda q, k, v, *a: _nodes([v, a[-1]], [q, k, *a])),
        (gd, "decode_step_ab", lambda q, k, v, *a: _nodes([v, a[-1]], [q, k, *a])),
        (gd, "decode_step_normed", lambda q, k, v, *a: _nodes([v, a[-3]], [q, k, *a])),
        (gd, "tracing", lambda mode: tracing("gates")),  # the CUDA default: gates inside
        (setup, "decode_steps_agree", lambda *a: ""),  # stand-ins agree with nothing
        # a short conv kernel: its output (its input's shape) and new state
        (sc, "gated_step", lambda x, st, w: _nodes([x[..., :w.shape[0]], st], [w])),
        (sc, "silu_step", lambda x, st, w: _nodes([x[..., :w.shape[0]], st], [w])),
        (sc, "KERNEL_MODES", ("gates", "kernel", "ops")),  # (the compile's mode: "ops")
        (recurrent, "compile_recurrent", lambda model, cache, enabled, mode="ops",
         convs=False: compile_recurrent(model, cache, enabled, mode, True)),
        (qk_rope, "wanted", lambda: True),
        (qk_rope, "self_check", lambda model: ""),
        (qk_rope, "norm_rope", lambda q, k, *a: _nodes(
            [q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)], a)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    _GPU_LIKE[0] = True
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        _GPU_LIKE[0] = False


from . import common


def count(*outs) -> collections.Counter:
    """Primitive name -> nodes in the graph that evaluating `outs` runs."""
    f = io.StringIO()
    mx.export_to_dot(f, *outs)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))


class _Capture:
    """Stands in for `mlx.core` in a module, counting the graph of the n-th
    async_eval it makes (each step's one launch)."""

    def __init__(self, real, nth):
        self.real, self.nth, self.got = real, nth, None

    def __getattr__(self, name):
        return getattr(self.real, name)

    def async_eval(self, *a):
        self.nth -= 1
        if self.nth == 0:
            self.got = count(*a)
        return self.real.async_eval(*a)


def raw(model, prompts, steps=8):
    """(nodes, median build ms) of the bare loop's decode step."""
    cache = make_prompt_cache(model)
    ids = mx.array(prompts, dtype=mx.uint32)
    model(ids[:, :-1], cache=cache)
    y = ids[:, -1]
    mx.eval(y, [c.state for c in cache])
    build = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y[:, None], cache=cache)
        build.append(time.perf_counter() - t)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
    nodes = count(mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1))
    return nodes, 1e3 * statistics.median(build[2:])


def batch_generator(model, prompts, nth=6):
    """Nodes of BatchGenerator's nth decode step (all rows inserted at once)."""
    gen_module = _generate_module()
    cap = _Capture(gen_module.mx, nth)
    gen_module.mx = cap
    try:
        from mlx_lm.generate import BatchGenerator
        B = len(prompts)
        gen = BatchGenerator(model, max_tokens=nth + 4, stop_tokens=None,
                             completion_batch_size=B, prefill_batch_size=B)
        gen.insert(prompts, [nth + 4] * B)
        while gen.next_generated():
            pass
        gen.close()
    finally:
        gen_module.mx = cap.real
    return cap.got


def _generate_module():
    import mlx_lm.generate  # noqa: F401  (mlx_lm.generate, the attribute, is a function)
    return sys.modules["mlx_lm.generate"]


async def engine(model, tok, prompts, nth=6, **kw):
    """Nodes of the Engine's nth decode step with all rows decoding."""
    B = len(prompts)
    if _GPU_LIKE[0]:
        gated_delta.install()  # (as a CUDA load does, once the model's module is in)
    eng = mlxnb.Engine((model, tok), max_batch=B, kv_budget=None, warmup=False,
                       streak_s=0.0, **kw)
    cap = _Capture(batch_module.mx, 10 ** 9)
    batch_module.mx = cap
    try:
        run = eng.generate([common.as_text(p) for p in prompts], max_tokens=nth + 8,
                           chat=False)
        while not any(s.batch_size == B and s.prefill_tokens == 0 for s in eng.steps):
            await asyncio.sleep(0.0005)
        cap.nth = nth
        await run
    finally:
        batch_module.mx = cap.real
        await eng.aclose()
    return cap.got


def kernels(c) -> int:
    """Nodes that launch work on a GPU (all but views)."""
    return sum(v for k, v in c.items() if k not in VIEWS)


def table(rows) -> str:
    out = ["| shape | B | method | nodes | non-view | build ms | top primitives |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["nodes"]
        top = ", ".join(f"{k} {v}" for k, v in c.most_common(6)) if c else "-"
        ms = r.get("build_ms")
        out.append(f"| {r['shape']} | {r['B']} | {r['method']} | "
                   f"{sum(c.values()) if c else '-'} | {kernels(c) if c else '-'} | "
                   f"{'-' if ms is None else f'{ms:.2f}'} | {top} |")
    return "\n".join(out)
