"""Every cache kind in one batch: hybrid-model decode and quantized-KV capacity.

Decode: random-weight models shaped like Qwen3.5-0.8B (gated delta-net + full
attention, 3:1), LFM2-1.2B (short conv + attention, 10:6), Gemma-3-1B (sliding
windows + full attention, 5:1) and, to check that nothing regressed there,
Llama-3.2-1B (plain attention). At each batch size B,
`decode`'s raw, BG and engine methods run on the same random prompts (prompt 64,
128 new, greedy, no EOS), interleaved per round, each warmed up once in round 0:
decode tok/s (medians over rounds) and the medians of the per-round ratios.

Quantized KV (--no-kv skips it): a Llama-3.2-1B-shaped model.
  admitted  rows of a 2k-token context (prompt + new) that Engine(kv_budget=1GB)
            admits at once with kv_bits None / 8 / 4 (more rows submitted than fit)
  decode    tok/s of B rows at that context (--kv-batch 8,32,128), kv_bits 8 and 4
            vs full-precision KV, rounds interleaved, median of per-round ratios

  python -m bench cache-kinds --quick       # tiny shapes, seconds
  python -m bench cache-kinds --rounds 3 --save
  python -m bench cache-kinds --no-kv --shapes lfm2-1.2b --batch 128 --profile 128
                                            # and where the engine's step goes (host)
  python -m bench cache-kinds --proxy --ops --gpu-like --no-decode --no-kv --batch 1,8
                                            # graph nodes per step, counted as on a GPU
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

import mlxnb

from . import common
from .common import fmt, log, median, pc
from .decode import VARIANTS, do_profile, measure

NAME, RESULT, TITLE = "cache-kinds", "cache-kinds", "Every cache kind in one batch"

# The real configs' sizes (text model only); random weights.
SHAPES = {
    # Qwen3.5-0.8B: 24 layers, every 4th full attention (18 gated delta-net + 6)
    "qwen3_5-0.8b": ("qwen3_5", dict(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=248320, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_parameters=dict(type="default", rope_theta=10_000_000,
                             partial_rotary_factor=0.25, mrope_section=[11, 11, 10]))),
    # LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14 (10 short-conv + 6)
    "lfm2-1.2b": ("lfm2", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, block_dim=2048, block_ff_dim=12288,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], vocab_size=65536,
        max_position_embeddings=128000, rope_theta=1_000_000.0)),
    # Gemma-3-1B: 26 layers, sliding windows of 512 with every 6th full attention
    "gemma3-1b": ("gemma3_text", dict(
        hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768)),
    # Llama-3.2-1B: plain attention, the same run's check that nothing regressed there
    "llama-1b": ("llama", dict(common.SHAPES["llama1b"], rms_norm_eps=1e-5,
                               tie_word_embeddings=True, max_position_embeddings=16384)),
}
# --quick: the same layer patterns at toy width, float32 (CPU)
QUICK = {
    "qwen3_5-0.8b": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         full_attention_interval=2, vocab_size=512),
    "lfm2-1.2b": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, block_dim=64, block_ff_dim=128,
                      block_multiple_of=16, full_attn_idxs=[1, 3], vocab_size=512),
    # windows of 8: the quick run's rows (16 + 16 tokens) wrap them
    "gemma3-1b": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                      sliding_window=8, sliding_window_pattern=2, vocab_size=512),
    "llama-1b": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=512),
}


# --proxy: the real layer counts and patterns at toy width: on a CPU the host's share
# of a step (graph building) is then about what it is on a GPU at the real width
PROXY = {
    "qwen3_5-0.8b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=16, vocab_size=512),
    "lfm2-1.2b": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      block_dim=64, block_ff_dim=128, block_multiple_of=16, vocab_size=512),
    "gemma3-1b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                      vocab_size=512),
    "llama-1b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512),
}


def build_hybrid(name, dtype, quick, seed=0):
    family, cfg = SHAPES[name]
    small = {"quick": QUICK, "proxy": PROXY}.get(quick) or (QUICK if quick is True else {})
    cfg = dict(cfg, model_type=family, **small.get(name, {}))
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.set_dtype(getattr(mx, dtype))
    model.eval()
    mx.eval(model.parameters())
    return model, common.IdTokenizer(cfg["vocab_size"]), cfg["vocab_size"]


# -- decode, hybrid models --------------------------------------------------------------
async def decode_part(args, rng):
    variants = tuple(args.variants) + (("engineg",) if args.gathered else ())
    methods = ("raw", "bg", "engine") + variants
    margs = SimpleNamespace(new=args.new, warm_new=args.warm_new, no_long=True,
                            no_warmup=False, no_fuse=False, streak_s=None)
    rows = []
    for name in args.shapes:
        t = pc()
        model, tok, vocab = build_hybrid(name, args.dtype, args.size)
        twin = build_hybrid(name, args.dtype, args.size)[0]
        log(f"## {name} {args.dtype}: built twice in {pc() - t:.1f}s")
        probe = mlxnb.Engine((twin, tok), warmup=False, kv_budget=None)  # its load checks
        kinds = probe.cache_kinds
        probe.close()
        log(f"   engine: {kinds}; sampling kernels on disk after "
            f"{common.settle_compiles(vocab):.1f} s")
        for B in args.batch:
            warm = common.make_prompts(rng, B, args.prompt, vocab)
            per = {m: [] for m in methods}
            steps = []  # per round: the engine's (join ticks, mean step split in ms)
            for rep in range(args.rounds):
                p1 = common.make_prompts(rng, B, args.prompt, vocab)
                p2 = common.make_prompts(rng, B, args.prompt, vocab)
                for meth in common.in_turn(methods, rep):
                    try:
                        r = await measure(meth, rep, model, twin, tok, margs, B, warm, p1, p2)
                    except Exception as e:  # one method failing still reports the rest
                        r = dict(decode_tps=None, ok=False,
                                 error=f"{type(e).__name__}: {e}"[:200])
                    if not r.get("ok"):
                        log(f"  WARNING {name} B={B} {meth}: "
                            f"{r.get('error') or 'not every row ran to max_tokens'}")
                    per[meth].append(r.get("decode_tps"))
                    if meth == "engine":
                        steps.append((r.get("join_ticks"), r.get("split_ms") or ()))
                    gc.collect()
                    mx.clear_cache()
                log(f"  {name} B={B} round {rep}: "
                    + ", ".join(f"{m} {fmt(per[m][-1])}" for m in methods)
                    + f"; engine {split_text(*steps[-1])}")
            ratio = {o: median([e / x for e, x in zip(per["engine"], per[o]) if e and x])
                     for o in ("bg", "raw")}
            for v in variants:
                ratio.update({(v, o): median([g / x for g, x in zip(per[v], per[o]) if g and x])
                              for o in ("bg", "raw", "engine")})
            rows.append(dict(shape=name, B=B, kinds=kinds,
                             **{m: median(per[m]) for m in methods},
                             rounds=per, steps=steps, eng_bg=ratio["bg"],
                             eng_raw=ratio["raw"],
                             vs={k: v for k, v in ratio.items() if isinstance(k, tuple)}))
        if args.profile:
            p = await do_profile(model, twin, tok, rng, SimpleNamespace(
                **vars(margs), prompt=args.prompt), args.profile, vocab)
            rows[-1]["profile"] = p.get("text") or f"profile ERROR {p.get('error')}"
        del model, twin
        gc.collect()
        mx.clear_cache()
    return rows


def split_text(joins, split_ms) -> str:
    return f"{joins} join, " + "/".join(f"{x:.2f}" for x in split_ms)


def decode_table(rows, args):
    out = [f"## Decode: hybrid, sliding-window and plain-attention models ({args.dtype}, "
           f"prompt {args.prompt}, {args.new} new "
           f"tokens, greedy; medians of {args.rounds} interleaved rounds)", "",
           "| shape | B | raw | BG | engine | engine/BG | engine/raw |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['B']} | {fmt(r['raw'])} | {fmt(r['bg'])} | "
                   f"{fmt(r['engine'])} | {fmt(r['eng_bg'], 2)} | {fmt(r['eng_raw'], 2)} |")
    out += [""] + sorted({f"Engine on {r['shape']}: {r['kinds']}" for r in rows})
    out += ["", "Per round (tok/s: raw / BG / engine):", "", "```"]
    out += [f"{r['shape']} B={r['B']}: " + ", ".join(
        " / ".join(fmt(r["rounds"][m][i]) for m in ("raw", "bg", "engine"))
        for i in range(len(r["rounds"]["raw"]))) for r in rows]
    out.append("```")
    out += ["", "The engine per round: ticks that prefilled prompts (1: all in one tick, so "
            "the rows joined together, unpadded), then its mean full-batch step in ms "
            f"({common.SPLIT}; `StepRecord.split`):", "", "```"]
    out += [f"{r['shape']} B={r['B']}: " + ", ".join(split_text(*s) for s in r["steps"])
            for r in rows]
    out.append("```")
    for v in VARIANTS:
        if not any(v in r["rounds"] for r in rows):
            continue
        var, value, what = VARIANTS[v]
        out += ["", f"The engine with {what} (`{var}={value}`), another method of the same "
                "rounds:", "", f"| shape | B | {v} | / BG | / raw | / engine | per round |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['shape']} | {r['B']} | {fmt(r[v])} | {fmt(r['vs'][v, 'bg'], 2)} | "
                f"{fmt(r['vs'][v, 'raw'], 2)} | {fmt(r['vs'][v, 'engine'], 2)} | "
                + ", ".join(fmt(x) for x in r["rounds"][v]) + " |"
                for r in rows if v in r["rounds"]]
    for r in rows:
        if r.get("profile"):
            out += ["", f"### {r['shape']}: where a decode step goes", "", r["profile"]]
    return "\n".join(out)


def ops_table(args, rng) -> str:
    import contextlib
    from . import step_ops
    rows = []
    with step_ops.gpu_like() if args.gpu_like else contextlib.nullcontext():
        _count_ops(args, rng, rows)
    how = "as a GPU builds them (step_ops.gpu_like)" if args.gpu_like else "as built here"
    return (f"## Graph nodes per decode step ({args.dtype}, {how}; non-view: nodes that "
            f"launch work on a GPU; build ms: the raw loop's forward, graph construction "
            f"only)\n\n" + step_ops.table(rows))


def _count_ops(args, rng, rows):
    from . import step_ops
    for name in args.shapes:
        model, tok, vocab = build_hybrid(name, args.dtype, args.size)
        twin = build_hybrid(name, args.dtype, args.size)[0]
        for B in args.batch:
            prompts = common.make_prompts(rng, B, args.prompt, vocab)
            nodes, ms = step_ops.raw(model, prompts)
            rows.append(dict(shape=name, B=B, method="raw", nodes=nodes, build_ms=ms))
            rows.append(dict(shape=name, B=B, method="BG",
                             nodes=step_ops.batch_generator(model, prompts)))
            rows.append(dict(shape=name, B=B, method="engine",
                             nodes=asyncio.run(step_ops.engine(twin, tok, prompts))))
        del model, twin
        gc.collect()


# -- quantized KV -----------------------------------------------------------------------
async def admitted(model, tok, vocab, rng, bits, budget, prompt, new, submit):
    """Rows of `prompt + new` tokens the Engine admits at once under `budget`."""
    eng = mlxnb.Engine((model, tok), max_batch=submit, kv_budget=budget,
                       kv_bits=bits, warmup=False)
    try:
        per_row = eng.scheduler.row_bytes(prompt, new)
        mode = eng.cache_kinds.split(", ", 1)[-1]  # e.g. 'KV 4-bit (decode attention: ...)'

        rows = [eng.submit(common.as_text(p), chat=False, max_tokens=new)
                for p in common.make_prompts(rng, submit, prompt, vocab)]
        while eng.running == 0 and not all(r.done for r in rows):
            await asyncio.sleep(0.001)
        n = eng.running  # admission happens at once, before the first tick runs
        errs = [r.error for r in rows if r.error]
        if errs:
            raise RuntimeError(errs[0])
        return n, per_row, mode
    finally:
        await eng.aclose()


async def kv_decode(eng, prompts, new):
    """Decode tok/s of len(prompts) rows, all decoding and no prefill, over `new`
    steps on `eng` (rows that joined first decode on while the last ones prefill:
    their contexts pass prompt + new by that ramp)."""
    w, ok = await common.full_batch_decode(eng, prompts, new, limit=64 * new)
    return (w["tps"] if w else None), ok


async def kv_part(args, rng):
    name = "tiny-kv" if args.quick else "llama1b"
    model, tok, vocab = common.build_model(name, "float32" if args.quick else "bfloat16")
    ctx, new = args.kv_context, args.kv_new
    prompt = ctx - new
    bits_list = [None, 8, 4]
    full = "float32" if args.quick else "bf16"  # the unquantized KV's dtype
    cap, lines = [], []
    kv_mode = "-"
    for bits in bits_list:
        n, per_row, mode = await admitted(model, tok, vocab, rng, bits, args.kv_budget,
                                          prompt, new, args.kv_submit)
        if bits:
            kv_mode = mode
        cap.append(dict(bits=bits, rows=n, per_row=per_row))
        lines.append(f"kv_bits={bits}: {n} rows admitted under {args.kv_budget} "
                     f"({per_row / 2**20:.1f} MiB per row)")
        log("  " + lines[-1])
    sizes = args.kv_batch or [max(1, cap[0]["rows"])]
    base = cap[0]["rows"]
    out = [f"## Quantized KV: {name} shape, context {ctx} tokens ({prompt} prompt + {new} "
           f"new), kv_budget {args.kv_budget}, group size 64", "",
           f"| KV | MiB/row (budget) | rows admitted | x {full} |", "|---|---|---|---|"]
    for c in cap:
        kind = f"{c['bits']}-bit" if c["bits"] else full
        out.append(f"| {kind} | "
                   f"{c['per_row'] / 2**20:.1f} | {c['rows']} | "
                   f"{c['rows'] / base if base else 0:.2f} |")
    out += ["", f"Decode tok/s at {ctx}-token contexts, over {new} steps with all B rows "
            f"decoding (the rows that joined first decode on while the last ones prefill; "
            f"x {full}: median of per-round ratios over {args.rounds} interleaved rounds)",
            "",
            "| B | " + " | ".join(f"{b or full}" for b in bits_list) + " | "
            + " | ".join(f"{b}-bit x {full}" for b in bits_list if b) + " |",
            "|---|" + "---|" * (2 * len(bits_list) - 1)]
    # one engine per KV kind for every batch size and round (an engine's load and
    # warm-up cost seconds); the warm-up compiles the decode step at each B, its
    # context need not be long
    engines = {b: mlxnb.Engine((model, tok), max_batch=max(sizes), kv_budget=None,
                               kv_bits=b) for b in bits_list}
    log(f"  sampling kernels on disk after {common.settle_compiles(vocab):.1f} s")
    try:
        return await _kv_rounds(engines, sizes, args, rng, vocab, prompt, new, bits_list,
                                full, out, lines, kv_mode)
    finally:
        for eng in engines.values():
            await eng.aclose()


async def _kv_rounds(engines, sizes, args, rng, vocab, prompt, new, bits_list, full, out,
                     lines, kv_mode):
    for B in sizes:
        for eng in engines.values():
            await common.engine_run(eng, common.make_prompts(rng, B, 32, vocab), 4)
        per = {b: [] for b in bits_list}
        for rep in range(args.rounds):
            ps = common.make_prompts(rng, B, prompt, vocab)
            for bits in common.in_turn(bits_list, rep):
                tps, ok = await kv_decode(engines[bits], ps, new)
                if not ok:
                    log(f"  WARNING kv_bits={bits}: fewer than {new} steps with all "
                        f"{B} rows decoding")
                per[bits].append(tps)
                gc.collect()
                mx.clear_cache()
            lines.append(f"kv decode B={B} round {rep}: " + ", ".join(
                f"{b or full} {fmt(per[b][-1])}" for b in bits_list))
            log("  " + lines[-1])
        ratios = [median([x / y for x, y in zip(per[b], per[None]) if x and y])
                  for b in bits_list if b]
        out.append(f"| {B} | " + " | ".join(fmt(median(per[b])) for b in bits_list)
                   + " | " + " | ".join(fmt(r, 2) for r in ratios) + " |")
    full_kinds = engines[None].cache_kinds
    return "\n".join(out + ["", f"Attention on the quantized KV: {kv_mode}; full precision: "
                             f"{full_kinds}", "", "```"] + lines + ["```"])


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shapes", default=list(SHAPES), type=common.names(list(SHAPES)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", default=[1, 8, 32, 128], type=common.counts)
    ap.add_argument("--prompt", type=common.count, default=64)
    ap.add_argument("--new", type=common.count, default=128)
    ap.add_argument("--warm-new", type=common.count, default=16)
    ap.add_argument("--rounds", type=common.count, default=3)
    ap.add_argument("--no-decode", action="store_true", help="skip the hybrid decode part")
    ap.add_argument("--variants", default=[], type=common.names(list(VARIANTS)),
                    help="engine variants as more methods of the same rounds: "
                         + ", ".join(f"{k} ({w})" for k, (_, _, w) in VARIANTS.items()))
    ap.add_argument("--gathered", action="store_true",
                    help="the same as --variants engineg")
    ap.add_argument("--no-kv", action="store_true", help="skip the quantized-KV part")
    ap.add_argument("--kv-budget", default="1GB", type=common.size)
    ap.add_argument("--kv-context", type=common.count, default=2048)
    ap.add_argument("--kv-new", type=common.count, default=64)
    ap.add_argument("--kv-submit", type=common.count, default=256, help="rows submitted at once")
    ap.add_argument("--kv-batch", default=None, type=common.counts,
                    help="batch sizes of the kv decode runs, e.g. 8,32,128 (default: the "
                         "rows full precision admits)")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="after each shape's rounds: where the engine's decode step at "
                         "batch B goes (host timers), beside the bare loop's")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, seconds")
    ap.add_argument("--proxy", action="store_true",
                    help="the real layer patterns at toy width, float32 (a CPU's stand-in "
                         "for a GPU's host-bound decode)")
    ap.add_argument("--ops", action="store_true",
                    help="also count the graph nodes of one decode step per method")
    ap.add_argument("--gpu-like", action="store_true",
                    help="with --ops: count fast ops (norms, RoPE, attention) and the "
                         "engine's gated delta rule as one node each, as on a GPU")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.profile < 0:
        ap.error("argument --profile: takes a batch size, or 0 for no profile")
    if args.quick:
        given = common.quick(ap, args, argv, dtype="float32", batch=[1, 4], prompt=16, new=16,
                             warm_new=4, rounds=2, kv_budget="4MB", kv_context=512,
                             kv_new=16, kv_submit=64)
        if "kv_new" not in given:  # quick's sizes fit the ones given
            args.kv_new = max(1, min(args.kv_new, args.kv_context - 1))
    if args.kv_new >= args.kv_context:
        ap.error(f"argument --kv-new: takes fewer tokens than --kv-context "
                 f"({args.kv_context}: the prompt is the rest); got {args.kv_new}")
    args.size = "quick" if args.quick else "proxy" if args.proxy else None
    if args.proxy:
        args.dtype = "float32"
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"# cache-kinds  {report.env}")
    rng = np.random.default_rng(1234)
    parts = []
    if args.ops:
        parts.append(ops_table(args, rng))
        log(parts[-1])
    if not args.no_decode:
        parts.append(decode_table(asyncio.run(decode_part(args, rng)), args))
        report.write("\n\n".join(parts))
    if not args.no_kv:
        parts.append(asyncio.run(kv_part(args, rng)))
    text = "\n\n".join(parts)
    log("\n" + text)
    report.write(text)
    return 0
