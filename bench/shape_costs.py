"""What a new tensor shape costs MLX's backend, and what attention path a decode step takes.

MLX's CUDA backend builds a cuDNN attention graph per (q, k, v shape and strides,
mask shape) key, and picks a decode kernel by mask and cache length (see
mlx/backend/cuda/scaled_dot_product_attention.cpp). This script measures, on a
random-weight SmolLM2 shape:

  prefill   first vs repeated forward of a fresh [k, w] batch (causal, and with an
            array mask), and of a chunk continuing a cache at an offset
  decode    per-step time over a growing cache: plain cache (no mask) vs left-padded
            BatchKVCache (array mask), the largest step and where it happened, and
            the cost of a batch-size change once the cache is past 256 tokens

  python bench/shape_costs.py [--dtype bfloat16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import build_model  # noqa: E402  (also imports mlxnb first)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

pc = time.perf_counter


def timed(fn):
    mx.synchronize()
    t = pc()
    fn()
    mx.synchronize()
    return 1e3 * (pc() - t)


def fresh(model, kind, k, w, lengths=None):
    if kind == "plain":
        return [KVCache() for _ in model.layers]
    cache = [BatchKVCache([0] * k) for _ in model.layers]
    lengths = lengths or [w - i * (w // (2 * k)) for i in range(k)]
    for c in cache:
        c.prepare(lengths=lengths, right_padding=[w - n for n in lengths])
    return cache


def prefill_costs(model, vocab, rng):
    out = []
    for kind in ("plain", "mask"):
        for k in (1, 2, 4, 8):
            for w in (64, 128, 256, 512):
                if kind == "mask" and k == 1:
                    continue
                toks = mx.array(rng.integers(2, vocab, size=(k, w)).tolist())

                def run():
                    cache = fresh(model, kind, k, w)
                    model(toks, cache=cache)
                    mx.eval([c.state for c in cache])
                first, again = timed(run), min(timed(run) for _ in range(3))
                out.append(dict(part="prefill", kind=kind, k=k, w=w, first_ms=first,
                                again_ms=again))
    # a chunk of n continuing a plain cache at offset p
    for k, p, n in ((1, 256, 256), (1, 512, 256), (1, 300, 256), (4, 256, 128)):
        base = mx.array(rng.integers(2, vocab, size=(k, p)).tolist())
        toks = mx.array(rng.integers(2, vocab, size=(k, n)).tolist())

        def run():
            cache = fresh(model, "plain", k, p)
            model(base, cache=cache)
            mx.eval([c.state for c in cache])
            t = pc()
            model(toks, cache=cache)
            mx.eval([c.state for c in cache])
            return 1e3 * (pc() - t)
        first, again = run(), min(run() for _ in range(3))
        out.append(dict(part="chunk", kind="plain", k=k, w=f"{p}+{n}", first_ms=first,
                        again_ms=again))
    return out


def decode_costs(model, vocab, rng, B=64, prompt=64, steps=260, kind="plain"):
    """Synchronous per-step times over a growing cache (prompt .. prompt + steps)."""
    lengths = [prompt] * B if kind == "plain" else [prompt - (i % 32) for i in range(B)]
    toks = mx.array(rng.integers(2, vocab, size=(B, prompt)).tolist())
    if kind == "plain":
        cache = [KVCache() for _ in model.layers]
    else:
        cache = [BatchKVCache([prompt - n for n in lengths]) for _ in model.layers]
    model(toks, cache=cache)
    mx.eval([c.state for c in cache])
    y = toks[:, -1]
    times = []
    for _ in range(steps):
        t = pc()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        times.append(1e3 * (pc() - t))
    lo = [x for i, x in enumerate(times) if prompt + i < 256]
    hi = [x for i, x in enumerate(times) if prompt + i >= 258]
    worst = max(range(steps), key=times.__getitem__)
    return dict(part="decode", kind=kind, B=B, median_below_256_ms=statistics.median(lo),
                median_above_256_ms=statistics.median(hi) if hi else None,
                worst_ms=times[worst], worst_at_len=prompt + worst + 1,
                cache=cache, y=y)


def batch_change_cost(model, state):
    """Filter a past-256 plain batch to B-1 rows: the first steps at the new size."""
    cache, y = state["cache"], state["y"]
    keep = mx.arange(state["B"] - 1)  # a gather, like BatchKVCache.filter: a new buffer
    for c in cache:
        c.keys, c.values = c.keys[keep], c.values[keep]
    y = y[:-1]
    times = []
    for _ in range(4):
        t = pc()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        times.append(1e3 * (pc() - t))
    return dict(part="batch change", kind="plain", B=state["B"] - 1, steps_ms=times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np

    rng = np.random.default_rng(7)
    model, _, vocab = build_model(args.shape, args.dtype)
    rows = prefill_costs(model, vocab, rng)
    for r in rows:
        print(f"{r['part']:8} {r['kind']:5} k={r['k']} w={r['w']}: first "
              f"{r['first_ms']:.1f} ms, again {r['again_ms']:.1f} ms", flush=True)
    for kind in ("plain", "mask"):
        d = decode_costs(model, vocab, rng, kind=kind)
        if kind == "plain":
            bc = batch_change_cost(model, d)
            print(f"batch change -> B={bc['B']}: {[round(x, 2) for x in bc['steps_ms']]} ms")
            rows.append(bc)
        d.pop("cache"), d.pop("y")
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()},
              flush=True)
        rows.append(d)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "shape_costs.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
