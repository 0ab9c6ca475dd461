"""Rows with different LoRA adapters in one batch: decode tok/s and memory.

One Engine, one model, the same random prompts (ids; no EOS, every row runs to
max_tokens) in every pass. Rank-R LoRA adapters (random weights, as mlx_lm.lora
writes them) on every projection of every layer (q, k, v, o, gate, up, down).
Passes, interleaved in --repeat rounds:

  none     no adapter loaded: B base rows (the engine as it is without adapters)
  base     A adapters loaded, B rows using none of them
  mixed    A adapters loaded, B rows split evenly over them (B/A rows each)

tok/s = tokens / summed step time over the steps with all B rows decoding and no
prefill (common.decode_window); "ratio" is each round's mixed/none (and base/none),
median over rounds. "forward": the model's decode forward alone at batch B on a
fixed-length cache, steps without and with the mixed selection alternating (--forward
steps pairs; a loaded machine disturbs adjacent steps least), median of per-pair
ratios, of wall time and of the process's CPU time (which other processes move
less), with the MLX ops in each forward's graph, and which path the folded update
took (lowrank_kernels' GPU kernel after its self-check, or MLX ops, and why);
`--update ab` runs the forward comparison again with the kernel off. Memory: the
device bytes the adapters' stacked weights take (Engine.adapter_bytes), MLX's active
memory before and after loading them, against the model's own bytes (what a copy of
the model per adapter would cost).

  python -m bench adapters                       # default model, 2-core CPU scale
  python -m bench adapters --shape llama1b --dtype bfloat16 --batch 32 --rank 16 \\
      --new 128 --repeat 5 --save                # a GPU (H200)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxnb  # noqa: I001  (first: it puts OpenBLAS under MLX on Linux CPU)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import common
from .common import fmt, log

NAME, RESULT, TITLE = "adapters", "adapters", "LoRA adapters in one batch: decode and memory"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_adapters(model, root: Path, count: int, rank: int, scale: float, dtype: str):
    """`count` random LoRA adapter directories for every projection of `model`."""
    import mlx.nn as nn

    dirs = []
    layers = model.layers
    for k in range(count):
        key = mx.random.key(100 + k)
        weights = {}
        for i, layer in enumerate(layers):
            for p in PROJECTIONS:
                mod = layer
                for part in p.split("."):
                    mod = mod[part]
                out, inp = mod.weight.shape
                if isinstance(mod, nn.QuantizedLinear):
                    inp = inp * 32 // mod.bits
                key, ka, kb = mx.random.split(key, 3)
                name = f"model.layers.{i}.{p}"
                weights[f"{name}.lora_a"] = (mx.random.normal((inp, rank), key=ka)
                                             * inp ** -0.5).astype(getattr(mx, dtype))
                weights[f"{name}.lora_b"] = (mx.random.normal((rank, out), key=kb)
                                             * 0.01).astype(getattr(mx, dtype))
        d = root / f"ad{k}"
        d.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(d / "adapters.safetensors"), weights)
        (d / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(layers),
             "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                                 "keys": list(PROJECTIONS)}}))
        dirs.append(d)
    return dirs


async def one_pass(eng, prompts, n, adapters):
    s0 = len(eng.steps)
    rows = [eng.submit(common.as_text(p), chat=False, max_tokens=n, adapter=a)
            for p, a in zip(prompts, adapters)]
    res = await asyncio.gather(*rows)
    ok = all(r.finish_reason == "length" and len(r.tokens) == n for r in res)
    w = common.decode_window(eng.steps[s0:], len(prompts))
    return (w["tps"] if w else None), ok


async def run(args, model, V, dirs):
    rng = np.random.default_rng(0)
    B, A = args.batch, args.adapters
    names = [f"ad{k}" for k in range(A)]
    eng = mlxnb.Engine((model, common.IdTokenizer(V)), max_batch=B, kv_budget=None,
                       prefix_cache=None)
    out = dict(rounds=[])
    try:
        warm = common.make_prompts(rng, B, args.prompt, V)
        t = common.pc()
        await one_pass(eng, warm, args.warm_new, [None] * B)
        log(f"warm-up pass {common.pc() - t:.1f} s")
        mem0 = mx.get_active_memory()
        t = common.pc()
        for n, d in zip(names, dirs):
            eng.load_adapter(n, d)
        log(f"{A} adapters loaded in {common.pc() - t:.1f} s")
        out["adapter_bytes"] = eng.adapter_bytes
        out["active_memory_added"] = mx.get_active_memory() - mem0
        out["file_bytes"] = sum(a.nbytes for a in eng.adapters.values())
        mixed = [names[i * A // B] for i in range(B)]
        t = common.pc()
        await one_pass(eng, warm, args.warm_new, mixed)  # the shapes' first use
        log(f"warm-up pass with adapters {common.pc() - t:.1f} s")
        for r in range(args.repeat):
            rnd = {}
            prompts = common.make_prompts(rng, B, args.prompt, V)
            # none: the adapters unloaded (no wrapper left in the model)
            for n in names:
                eng.unload_adapter(n)
            rnd["none"], ok0 = await one_pass(eng, prompts, args.new, [None] * B)
            for n, d in zip(names, dirs):
                eng.load_adapter(n, d)
            rnd["base"], ok1 = await one_pass(eng, prompts, args.new, [None] * B)
            rnd["mixed"], ok2 = await one_pass(eng, prompts, args.new, mixed)
            rnd["ok"] = ok0 and ok1 and ok2
            out["rounds"].append(rnd)
            log(f"round {r + 1}: none {fmt(rnd['none'], 1)}  base {fmt(rnd['base'], 1)}  "
                f"mixed {fmt(rnd['mixed'], 1)} tok/s"
                + ("" if rnd["ok"] else "  (some row ended early!)"))
    finally:
        await eng.aclose()
    return out


def count_ops(outputs) -> collections.Counter:
    """The primitives in the graph of `outputs` (not evaluated), by name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.dot"
        mx.export_to_dot(str(path), *outputs)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle',
                                              path.read_text()))


def forward_ratio(model, V, dirs, B, A, steps, prompt, options):
    """Median over `steps` adjacent pairs of (base forward s) / (mixed forward s): the
    decode forward at batch B, rows split evenly over the adapters (AdapterSet used
    directly, on this thread; no engine), on the model's projections fused as the
    engine fuses them; and the MLX ops in each forward's graph."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxnb.core.worker.adapters import AdapterSet
    from mlxnb.core.worker.fuse import fuse_projections
    from mlxnb.models.adapters import read_adapter

    fuse_projections(model, lambda: model(mx.array([[0]]), cache=make_prompt_cache(model)))
    aset = AdapterSet(model, **options)
    for k, d in enumerate(dirs):
        aset.add(f"ad{k}", read_adapter(d))
    mixed = aset.select([f"ad{i * A // B}" for i in range(B)])
    cache = make_prompt_cache(model)
    model(mx.random.randint(2, V, (B, prompt)), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.random.randint(2, V, (B, 1))

    def forward(sel):
        for c in cache:
            c.offset = prompt  # every step at the same length
        with aset.using(sel):
            return model(y, cache=cache)

    def step(sel):
        t, c = common.pc(), time.process_time()
        mx.eval(forward(sel))
        cpu.append(time.process_time() - c)
        return common.pc() - t

    cpu = []  # the process's CPU seconds per step (all threads): less moved by load

    ops = {}
    for k, s in (("base", None), ("mixed", mixed)):
        out = forward(s)
        ops[k] = count_ops([out])
        mx.eval(out)  # the cache's update: not in the next forward's graph
    step(None), step(mixed)
    pairs = [(step(None), step(mixed)) for _ in range(steps)]
    cpu = cpu[-2 * steps:]
    cpu_ratio = statistics.median(a / b for a, b in zip(cpu[::2], cpu[1::2]))
    path = aset.update_path
    for k in range(A):
        aset.remove(f"ad{k}")
    return (statistics.median(a / b for a, b in pairs),
            statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            ops, cpu_ratio, path)


def forward_line(fr) -> str:
    return (f"forward only ({fr[5]}): base {fr[1] * 1e3:.1f} ms, mixed {fr[2] * 1e3:.1f} ms, "
            f"ratio {fr[0]:.3f} (CPU time {fr[4]:.3f}); MLX ops per forward: base "
            f"{sum(fr[3]['base'].values())}, mixed {sum(fr[3]['mixed'].values())}")


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shape", default="default", choices=list(common.SHAPES) + ["default"])
    ap.add_argument("--dtype", default="float32", choices=common.DTYPES)
    ap.add_argument("--batch", type=common.count, default=32)
    ap.add_argument("--adapters", type=common.count, default=4)
    ap.add_argument("--rank", type=common.count, default=16)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--lowrank", default="stacked", choices=["stacked", "gather"],
                    help="the low-rank update: every adapter's A/B side by side, masked "
                         "per row (stacked, the engine's), or gather_mm per row (gather)")
    ap.add_argument("--no-share", action="store_true",
                    help="stacked: one update per projection, not one per fused q/k/v "
                         "or gate/up group")
    ap.add_argument("--cast", action=argparse.BooleanOptionalAction,
                    help="hold the adapters in the base weights' dtype (default: with "
                         "the stacked update)")
    ap.add_argument("--fold", action=argparse.BooleanOptionalAction,
                    help="stacked: decode steps scale before the B product and add "
                         "with one addmm (default: on)")
    ap.add_argument("--adapter-dtype", default="float32",
                    help="the adapters' weights (mlx_lm.lora trains float32)")
    ap.add_argument("--prompt", type=common.count, default=32, help="prompt length (tokens)")
    ap.add_argument("--new", type=common.count, default=48, help="new tokens per row")
    ap.add_argument("--warm-new", type=common.count, default=8)
    ap.add_argument("--repeat", type=common.count, default=3)
    ap.add_argument("--forward-steps", type=common.whole, default=10,
                    help="pairs of decode forwards in the forward-only comparison (0: skip)")
    ap.add_argument("--update", default="auto", choices=["auto", "ops", "ab"],
                    help="stacked, folded: the update kernel where its self-check passes "
                         "(auto), MLX ops only (ops), or auto with the forward-only "
                         "comparison run again on the ops (ab)")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.batch % args.adapters:
        ap.error("--batch must split evenly over --adapters")
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    from mlxnb.core.worker import adapters as worker_adapters

    for k in ("cast", "fold"):
        if getattr(args, k) is None:
            setattr(args, k, args.lowrank == "stacked")
    options = dict(formulation=args.lowrank, share=not args.no_share, cast=args.cast,
                   fold=args.fold, kernel=args.update != "ops")
    worker_adapters.DEFAULTS.update(options)  # the engine's AdapterSet too
    model, _, V = common.build_model(args.shape, args.dtype)
    from mlxnb.core.worker import lowrank_kernels

    kernel = ("off (--update ops)" if args.update == "ops" else
              f"{lowrank_kernels.backend() or 'none'}; self-check "
              f"{lowrank_kernels.status(getattr(mx, args.dtype, mx.bfloat16))}")
    log(f"update kernel API: {kernel}")
    model_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_adapters(model, Path(tmp), args.adapters, args.rank, args.scale,
                              args.adapter_dtype)
        if args.forward_steps:
            fr = forward_ratio(model, V, dirs, args.batch, args.adapters,
                               args.forward_steps, args.prompt, options)
            log(forward_line(fr))
            ab = None
            if args.update == "ab":
                ab = forward_ratio(model, V, dirs, args.batch, args.adapters,
                                   args.forward_steps, args.prompt,
                                   dict(options, kernel=False))
                log(forward_line(ab))
        res = asyncio.run(run(args, model, V, dirs)) if args.repeat else dict(
            rounds=[], adapter_bytes=0, active_memory_added=0, file_bytes=0)
        if args.forward_steps:
            res["forward"] = dict(ratio=fr[0], base_s=fr[1], mixed_s=fr[2], cpu_ratio=fr[4],
                                  ops={k: dict(v) for k, v in fr[3].items()}, path=fr[5])
            if ab is not None:
                res["forward_ops"] = dict(ratio=ab[0], base_s=ab[1], mixed_s=ab[2],
                                          cpu_ratio=ab[4], path=ab[5],
                                          ops={k: dict(v) for k, v in ab[3].items()})
    rounds = res["rounds"]

    def med(key):
        xs = [r[key] / r["none"] for r in rounds if r[key] and r["none"]]
        return statistics.median(xs) if xs else None

    best = {k: max(((r[k] or 0) for r in rounds), default=None)
            for k in ("none", "base", "mixed")}
    mb = 1 << 20
    lines = [
        f"{args.shape} {args.dtype}, B={args.batch} split evenly over {args.adapters} "
        f"rank-{args.rank} LoRA adapters ({args.adapter_dtype}) on every projection of "
        f"every layer; prompts {args.prompt} tokens, {args.new} new; {len(rounds)} rounds",
        f"update: {args.lowrank}" + ("" if args.lowrank != "stacked" else
                                     ", one per projection" if args.no_share else
                                     ", one per fused q/k/v and gate/up group")
        + (", adapters cast to the model's dtype" if args.cast else "")
        + (", scale folded into the mask, one addmm" if args.fold and
           args.lowrank == "stacked" else ""),
        f"update kernel API: {kernel}"
        + (f"; folded updates ran on: {res['forward']['path']}" if "forward" in res else ""),
        "", "| pass | tok/s (best round) | / none (median of rounds) |", "|---|---|---|",
        f"| none: no adapter loaded, {args.batch} rows | {fmt(best['none'], 1)} | 1 |",
        f"| base: {args.adapters} loaded, {args.batch} base rows | {fmt(best['base'], 1)} "
        f"| {fmt(med('base'), 3)} |",
        f"| mixed: {args.batch // args.adapters} rows per adapter | {fmt(best['mixed'], 1)} "
        f"| **{fmt(med('mixed'), 3)}** |",
    ]
    if "forward" in res:
        f = res["forward"]
        lines += [f"| forward only ({args.forward_steps} adjacent pairs): base "
                     f"{f['base_s'] * 1e3:.1f} ms, mixed {f['mixed_s'] * 1e3:.1f} ms per "
                     f"step | | **{f['ratio']:.3f}** |",
                     f"| forward only, the process's CPU time per step (all threads) | | "
                     f"{f['cpu_ratio']:.3f} |"]
        if "forward_ops" in res:
            g = res["forward_ops"]
            lines += [f"| forward only, {g['path']}: base {g['base_s'] * 1e3:.1f} ms, mixed "
                      f"{g['mixed_s'] * 1e3:.1f} ms per step (mixed ops "
                      f"{sum(g['ops']['mixed'].values())}) | | **{g['ratio']:.3f}** |"]
        ops = {k: sum(v.values()) for k, v in f["ops"].items()}
        added = collections.Counter(f["ops"]["mixed"])
        added.subtract(f["ops"]["base"])
        lines += ["", f"MLX ops per decode forward: base {ops['base']}, mixed "
                  f"{ops['mixed']} (+{ops['mixed'] - ops['base']}: "
                  + ", ".join(f"{k} {v:+d}" for k, v in added.most_common() if v) + ")"]
    lines += [
        "", "| memory | MB |", "|---|---|",
        f"| the model's weights | {model_bytes / mb:,.1f} |",
        f"| {args.adapters} adapters' files | {res['file_bytes'] / mb:,.1f} |",
        f"| {args.adapters} adapters on the device (Engine.adapter_bytes) | "
        f"{res['adapter_bytes'] / mb:,.1f} |",
        f"| MLX active memory added by loading them | {res['active_memory_added'] / mb:,.1f} |",
        f"| {args.adapters} copies of the model (one engine per adapter) | "
        f"{args.adapters * model_bytes / mb:,.1f} |",
    ]
    if not all(r["ok"] for r in rounds):
        lines.append("\nSome rows ended before max_tokens: the passes did unequal work.")
    text = "\n".join(lines)
    log("\n" + text)
    report.write(text, dict(res, model_bytes=model_bytes, args=vars(args)))
    return 0
