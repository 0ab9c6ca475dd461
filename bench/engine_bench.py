"""Decode throughput: bare MLX loop vs mlx-lm's BatchGenerator vs mlxnb's Engine.

One process, one model, the same random prompts for all three:

  raw     model forward on a plain mlx-lm KV cache (batch B, no padding) + argmax +
          mx.async_eval pipelining (launch step N+1, then read step N to the host).
          decode tok/s = B * new_tokens / decode time (prefill excluded).
  rawb    the same loop on mlx-lm's BatchKVCache (what BatchGenerator and the engine
          decode on: per-row offsets, an array attention mask), zero padding; the
          gap raw -> rawb is the batch cache's cost, rawb -> engine the engine's own.
  rawv    (diagnostic) the raw loop on the engine's unpadded cache views
  rawt, rawvt  (diagnostic) raw / rawv run on a worker thread, as the engine's steps are
  rawtc   (diagnostic, run it last) rawt after re-making the weights on that thread
  engine0 (diagnostic) the engine with decode streaks off (one step per tick)
  enginenf (diagnostic) the engine on the model as loaded, unfused (Engine(fuse=False))
  bgd     (diagnostic) BatchGenerator with its own default batch sizes (completion 32,
          prefill 8): what `BatchGenerator(model)` gives; at B > 32 rows wait their turn
  bg      mlx_lm.generate.BatchGenerator, greedy, all B prompts inserted at once
          (completion_batch_size = prefill_batch_size = B). tok/s = its own
          stats().generation_tps (wall minus prompt time); decode_tps kept in JSON.
  engine  mlxnb.Engine(max_batch=B, kv_budget=None), on a twin of the model (same
          weights) that it fuses (mlxnb/fuse.py; --no-fuse: as loaded). Two runs per B:
          natural  every row max_tokens = N, submitted at once (the same work as
                   raw and bg). engine = sum(tokens) / sum(dt_s) over the steps with
                   all B rows decoding and no prefill (eng.steps with
                   prefill_tokens == 0 and batch_size == B); eng_span = the same
                   tokens over the wall time between those steps' records (includes
                   the loop side of every step); e2e = B * N / wall.
          steady   every row max_tokens = N + B (longer caches: past 256 tokens MLX's
                   CUDA backend switches decode attention to cuDNN), reported
                   beside the others as eng-long.

Weights are random (llama shapes), prompts are random token ids of one length, and
no token stops a row (no EOS), so every row runs to max_tokens; this is checked.
Each (method, B) is warmed up once on other prompts before it is measured.

  --mixed    continuous run: rows with prompt lengths 16..512 submitted in waves
             (engine, and BatchGenerator driven the same way): aggregate tok/s and
             time-to-first-token, all rows and joiners (waves after the first).
             Passes alternate engine, BG, engine, BG (--mixed-passes, default 2) on
             the same workload; the last of each is reported (MLX CUDA JIT-compiles
             kernels per new shape, so a first pass measures compilation).
  --profile-mixed  one more engine pass of the mixed run with per-tick timers:
             _prefill (group building, forward build, blocked eval; tokens, groups),
             _launch, _read, _join, _filter, _align, the loop-side gap; mean /
             median / p90 / total per part, over all ticks and by tick kind.
  --profile  B: where the engine's time goes per decode step at batch B (timers
             wrapped around BatchExecutor / Engine methods; mlxnb is not edited),
             next to the raw loop's own per-step split.

Examples:
  python bench/engine_bench.py --quick
  python bench/engine_bench.py --shape smollm2 --dtype float32 --batch 1,8,32 --new 32
  python bench/engine_bench.py --plan "smollm2:bfloat16:1,8,32,128 llama1b:bfloat16:8,128" \
      --mixed --profile-mixed --profile 128 --out results/
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
try:  # an mlxnb on PYTHONPATH (e.g. a snapshot on the device) wins over this checkout
    import mlxnb  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_ROOT))

import mlxnb  # noqa: E402  (first: it puts OpenBLAS under MLX on Linux CPU)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

pc = time.perf_counter

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # SmolLM2-135M's depth at tiny width: on a CPU its steps are host-bound, as the
    # real shapes' are on a GPU (a local proxy for per-step host overhead)
    "thin": dict(hidden_size=64, num_hidden_layers=30, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # SmolLM2-135M
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0),
    # Llama-3.2-1B (plain rope: the llama3 scaling changes no cost)
    "llama1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    head_dim=64, rope_theta=500000.0),
}


ENGINE_KW = {}  # --no-warmup, --no-fuse
# The engine fuses its model's projections in place (mlxnb/fuse.py), so it gets a
# twin (same seed, same weights) and raw / BG keep mlx-lm's model as loaded.
TWINS = {}


def for_engine(model):
    return TWINS.get(id(model), model)


def log(*a):
    print(*a, flush=True)


# -- model and tokenizer --------------------------------------------------------------
class _IdDetok:
    """Streaming detokenizer with the interface BatchExecutor uses; text is ' <id>'."""

    def __init__(self):
        self._seg = ""

    def reset(self):
        self._seg = ""

    def add_token(self, tok):
        self._seg += " " + str(tok)

    def finalize(self):
        pass

    @property
    def last_segment(self):
        s, self._seg = self._seg, ""
        return s


class IdTokenizer:
    """A prompt is its token ids written as decimal numbers; no EOS, no chat template."""

    chat_template = None

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eos_token_ids = []  # nothing stops a row: all run to max_tokens

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    @property
    def detokenizer(self):
        return _IdDetok()


def build_model(shape, dtype, seed=0):
    if shape == "default":
        model, tok = mlxnb.load_model("default")
        tok.eos_token_ids = []  # random prompts: no early stop (decode speed only)
        return model, tok, model.args.vocab_size
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True,
                     max_position_embeddings=16384, **SHAPES[shape])
    mx.random.seed(seed)
    model = Model(args)
    if dtype == "4bit":
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=64, bits=4)
    else:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    model.eval()
    return model, IdTokenizer(args.vocab_size), args.vocab_size


def make_prompts(rng, n, length, vocab):
    # ids >= 2 avoid 0/1 (BOS/EOS in many vocabs; harmless here, but keeps it clean)
    return rng.integers(2, vocab, size=(n, length)).tolist()


# -- (a) raw loop ----------------------------------------------------------------------
def run_raw(model, prompts, n, prof=None, batch_cache=False, views=False):
    B = len(prompts)
    if batch_cache:  # mlx-lm's BatchKVCache (no padding here): array mask, offsets [B]
        cache = [BatchKVCache([0] * B) for _ in model.layers]
    elif views:  # what the engine decodes on when no row is padded
        from mlxnb.core.worker.caches import AlignedView, LeanBatchKVCache

        cache = [AlignedView(LeanBatchKVCache([0] * B)) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)
    ids = mx.array(prompts, dtype=mx.uint32)
    t0 = pc()
    model(ids[:, :-1], cache=cache)
    mx.eval([(c.c if views else c).state for c in cache])
    y = ids[:, -1]
    mx.eval(y)
    t1 = pc()
    out = []
    prev = None
    tb = ta = tw = 0.0
    for _ in range(n):
        s = pc()
        logits = model(y[:, None], cache=cache)
        s1 = pc()
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(y)
        s2 = pc()
        if prev is not None:
            out.append(prev.tolist())
        s3 = pc()
        tb += s1 - s
        ta += s2 - s1
        tw += s3 - s2
        prev = y
    out.append(prev.tolist())
    t2 = pc()
    assert len(out) == n and all(len(r) == B for r in out)
    res = dict(decode_tps=B * n / (t2 - t1), e2e_tps=B * n / (t2 - t0),
               prefill_s=t1 - t0, decode_s=t2 - t1, tokens=B * n, ok=True)
    if prof is not None:
        prof.update(step_ms=1e3 * (t2 - t1) / n, build_ms=1e3 * tb / n,
                    argmax_async_eval_ms=1e3 * ta / n, wait_tolist_ms=1e3 * tw / n)
    del cache
    return res


def run_raw_sync(model, prompts, n):
    """Same loop with a full sync per step (no overlap): build + launch + device."""
    cache = make_prompt_cache(model)
    ids = mx.array(prompts, dtype=mx.uint32)
    model(ids[:, :-1], cache=cache)
    y = ids[:, -1]
    mx.eval([c.state for c in cache], y)
    tb = 0.0
    t1 = pc()
    for _ in range(n):
        s = pc()
        logits = model(y[:, None], cache=cache)
        tb += pc() - s
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        y.tolist()
    t2 = pc()
    return dict(sync_step_ms=1e3 * (t2 - t1) / n, sync_build_ms=1e3 * tb / n)


RAW_VARIANTS = {"raw": {}, "rawb": dict(batch_cache=True), "rawv": dict(views=True)}


# -- (b) BatchGenerator ----------------------------------------------------------------
def run_bg(model, prompts, n, defaults=False):
    """defaults: BatchGenerator's own batch sizes (completion 32, prefill 8), what
    `BatchGenerator(model)` gives a user; else both = B."""
    B = len(prompts)
    sizes = {} if defaults else dict(completion_batch_size=B, prefill_batch_size=B)
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None, **sizes)
    counts = {}
    reasons = {}
    try:
        uids = gen.insert(prompts, [n] * B)
        with gen.stats() as st:
            while responses := gen.next_generated():
                for r in responses:
                    counts[r.uid] = counts.get(r.uid, 0) + 1
                    if r.finish_reason is not None:
                        reasons[r.uid] = r.finish_reason
    finally:
        gen.close()
    ok = all(counts.get(u) == n and reasons.get(u) == "length" for u in uids)
    return dict(decode_tps=st.generation_tps, decode_step_tps=st.decode_tps,
                e2e_tps=st.generation_tokens / st.wall_time if st.wall_time else 0.0,
                prefill_s=st.prompt_time, wall_s=st.wall_time,
                tokens=st.generation_tokens, ok=ok)


# -- (c) Engine ----------------------------------------------------------------------
def _text(ids):
    return " ".join(map(str, ids))


async def engine_run(eng, prompts, n):
    """All prompts at once, max_tokens=n each. Returns (results, steps of this run, wall)."""
    s0 = len(eng.steps)
    t0 = pc()
    run = eng.generate([_text(p) for p in prompts], max_tokens=n, chat=False)
    res = await run
    wall = pc() - t0
    ok = all(r.finish_reason == "length" and len(r.tokens) == n for r in res)
    return res, eng.steps[s0:], wall, ok


def decode_window(steps, B):
    """Steps with all B rows decoding and no prefill: (tokens, sum dt, span tokens, span s, n)."""
    idx = [i for i, s in enumerate(steps) if s.prefill_tokens == 0 and s.batch_size == B]
    if not idx:
        return None
    tok = sum(steps[i].tokens for i in idx)
    dt = sum(steps[i].dt_s for i in idx)
    # contiguous span: tokens read in steps after the first window step, over the wall
    # time between the first and the last window step's records
    i0, i1 = idx[0], idx[-1]
    span_tok = sum(s.tokens for s in steps[i0 + 1:i1 + 1])
    span_s = steps[i1].t - steps[i0].t
    return dict(tokens=tok, dt_s=dt, tps=tok / dt if dt > 0 else 0.0,
                span_tps=span_tok / span_s if span_s > 0 else 0.0, nsteps=len(idx))


async def run_engine(model, tok, prompts_nat, prompts_steady, n, B, warm_prompts, warm_n,
                     prof_hook=None, long=True, fuse=True):
    kw = ENGINE_KW if fuse else dict(ENGINE_KW, fuse=False)
    eng = mlxnb.Engine((for_engine(model) if fuse else model, tok), max_batch=B,
                       kv_budget=None, **kw)
    try:
        await engine_run(eng, warm_prompts, warm_n)
        if prof_hook is not None:
            prof_hook.attach(eng)
        res, steps, wall, ok_nat = await engine_run(eng, prompts_nat, n)
        if prof_hook is not None:
            prof_hook.detach(eng)
        nat = decode_window(steps, B)
        ok_st, st = True, None
        if long:
            res2, steps2, wall2, ok_st = await engine_run(eng, prompts_steady, n + B)
            st = decode_window(steps2, B)
        ttft = [r.ttft_s for r in res]
        out = dict(
            decode_tps=nat["tps"] if nat else 0.0, span_tps=nat["span_tps"] if nat else 0.0,
            natural_full_steps=nat["nsteps"] if nat else 0, natural_steps=len(steps),
            e2e_tps=B * n / wall, wall_s=wall, ok=ok_nat and ok_st,
            steady_decode_tps=st["tps"] if st else None,
            steady_steps=st["nsteps"] if st else 0,
            ttft_mean_s=statistics.mean(ttft), ttft_max_s=max(ttft),
        )
        if prof_hook is not None:
            prof_hook.summarize(steps, B)
        return out
    finally:
        await eng.aclose()


# -- profile ---------------------------------------------------------------------------
class GcTimer:
    """Milliseconds the cyclic garbage collector ran inside the `with` block."""

    def __enter__(self):
        self.ms, self._t = 0.0, None
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t = pc()
        elif self._t is not None:
            self.ms += 1e3 * (pc() - self._t)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)


class EngineProfiler:
    """Per-tick host timers from the engine's own timing hooks (`Engine.trace`).

    Every tick gets a dict: seconds per part, plus counts ("n.*": decoded rows,
    prefill tokens, groups started, rows in them). `_read` is split into the wait
    for the device (`tokens.tolist()` of the step in flight) and the Python after
    it (`accept` per row, within read.py). `Prefill.run` is split into `next_group`
    (group building, cache allocation), forward graph build and `mx.eval` (blocked
    on the device: the prefill chunk and the decode step launched just before it).
    `_align` runs inside `_filter` and `_join` (nested, not additive).
    """

    KEYS = ["tick", "filter", "join", "align", "launch", "launch.fwd_build",
            "launch.sample", "launch.async_eval", "prefill", "prefill.group",
            "prefill.fwd_build", "prefill.eval", "read.wait", "read.py", "read.accept",
            "kv_report", "tick.rest", "apply", "gap", "gap.rest", "period"]
    COUNTS = ["n.decoded", "n.prefill_tokens", "n.groups", "n.group_rows", "n.emitted"]

    def __init__(self):
        self.ticks = []
        self.cur = {}
        self.summary = None

    def add(self, key, dt):
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def attach(self, eng):
        """Take the engine's timing hooks (Engine.trace); one decode step per tick."""
        import mlxnb.core.engine as me

        self._streak, me._STREAK_S = me._STREAK_S, 0.0
        self.cur = {}
        eng.trace(self._on)

    def _on(self, name, value):
        if name == "tick":  # the tick's parts came first: this one closes it
            self.cur["t0"], self.cur["tick"] = pc() - value, value
            self.ticks.append(self.cur)
            self.cur = {}
        elif name == "apply":  # the loop side, after its tick
            if self.ticks:
                self.ticks[-1]["apply"] = value
        else:
            self.add(name, value)

    def detach(self, eng):
        import mlxnb.core.engine as me

        me._STREAK_S = self._streak
        eng.trace(None)
        self._derive(self.ticks)

    @staticmethod
    def _derive(ticks):
        """Per tick: loop-side gap to the next tick, period, unattributed tick time."""
        for i, t in enumerate(ticks):
            nxt = ticks[i + 1]["t0"] if i + 1 < len(ticks) else None
            t["gap"] = nxt - (t["t0"] + t["tick"]) if nxt is not None else t.get("apply", 0.0)
            t["period"] = t["tick"] + t["gap"]
            t["gap.rest"] = t["gap"] - t.get("apply", 0.0)
            t["tick.rest"] = t["tick"] - sum(t.get(k, 0.0) for k in (
                "filter", "join", "launch", "prefill", "read.wait", "read.py", "kv_report"))

    def summarize(self, steps, B):
        """Steady decode ticks (all B rows decoding, no prefill) of the run in `steps`."""
        ticks = self.ticks
        if len(ticks) != len(steps):
            log(f"  [profile] {len(ticks)} ticks vs {len(steps)} steps; aligning by tail")
            ticks = ticks[-len(steps):]
        win = [t for t, s in zip(ticks[:-1], steps[:-1])
               if s.prefill_tokens == 0 and s.batch_size == B]
        if not win:
            self.summary = None
            return
        keys = self.KEYS + ["launch.eval", "read.eval"]
        mean = {k: 1e3 * statistics.mean(t.get(k, 0.0) for t in win) for k in keys}
        med = {k: 1e3 * statistics.median(t.get(k, 0.0) for t in win) for k in keys}
        self.summary = dict(B=B, nticks=len(win), mean_ms=mean, median_ms=med)

    # -- mixed run: every tick, by kind ----------------------------------------------
    KINDS = [("all", lambda t: True),
             ("prefill+decode", lambda t: t.get("n.prefill_tokens", 0) > 0
              and t.get("n.decoded", 0) > 0),
             ("prefill only", lambda t: t.get("n.prefill_tokens", 0) > 0
              and not t.get("n.decoded", 0)),
             ("decode only", lambda t: not t.get("n.prefill_tokens", 0)
              and t.get("n.decoded", 0) > 0),
             ("neither (drain)", lambda t: not t.get("n.prefill_tokens", 0)
              and not t.get("n.decoded", 0))]

    def summarize_all(self, t_start, wall):
        """Every tick of a run that started (first submit) at `t_start` and took `wall`."""
        ticks = self.ticks
        out = dict(wall_s=wall, nticks=len(ticks),
                   before_first_tick_s=(ticks[0]["t0"] - t_start) if ticks else wall,
                   kinds={})

        def p90(xs):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]

        for name, pred in self.KINDS:
            sel = [t for t in ticks if pred(t)]
            if not sel:
                continue
            st = {}
            for k in self.KEYS + self.COUNTS:
                xs = [t.get(k, 0.0) for t in sel]
                st[k] = dict(mean=statistics.mean(xs), median=statistics.median(xs),
                             p90=p90(xs), total=sum(xs))
            out["kinds"][name] = dict(n=len(sel), stats=st)
        out["ticks"] = [{k: (round(v, 7) if isinstance(v, float) else v)
                         for k, v in t.items() if k != "t0"}
                        | {"t": round(t["t0"] - t_start, 6)} for t in ticks]
        return out


_PART_LABELS = [
    ("period", "tick + loop gap (wall per tick)"),
    ("tick", "worker: tick total"),
    ("filter", "  _filter"),
    ("join", "  _join"),
    ("align", "    _align (inside _filter/_join)"),
    ("launch", "  _launch (decode step N+1)"),
    ("launch.fwd_build", "    model forward (graph build)"),
    ("launch.sample", "    sampler.sample (graph build)"),
    ("launch.async_eval", "    mx.async_eval"),
    ("prefill", "  _prefill"),
    ("prefill.group", "    next_group (group, cache alloc)"),
    ("prefill.fwd_build", "    model forward (graph build)"),
    ("prefill.eval", "    mx.eval (blocked: decode N+1 + prefill on device)"),
    ("read.wait", "  _read: blocked waiting for device"),
    ("read.py", "  _read: tolist + per-row Python"),
    ("read.accept", "    of which _accept (all rows)"),
    ("kv_report", "  _kv_report"),
    ("tick.rest", "  rest of tick"),
    ("gap", "loop side: gap to next tick"),
    ("apply", "  Engine._apply"),
    ("gap.rest", "  rest (handoff, _serve, admit, idle waits)"),
]
_COUNT_LABELS = [("n.prefill_tokens", "prefill tokens"), ("n.groups", "prefill groups started"),
                 ("n.group_rows", "rows in those groups"), ("n.decoded", "rows decoded"),
                 ("n.emitted", "tokens emitted")]


def format_mixed_profile(s, label=""):
    L = []
    kinds = s["kinds"]
    wall = s["wall_s"]
    L.append(f"Mixed-run engine profile{label}: {s['nticks']} ticks, wall {wall:.3f} s "
             f"(first tick {s['before_first_tick_s'] * 1e3:.1f} ms after the first submit). "
             "Ticks by kind: " + ", ".join(f"{k} {v['n']}" for k, v in kinds.items()
                                           if k != "all") + ".")
    L.append("")
    a = kinds.get("all")
    if a:
        L.append("All ticks, ms per tick (counts per tick for the last rows):")
        L.append("")
        L.append("| part | mean | median | p90 | total s | % of wall |")
        L.append("|---|---|---|---|---|---|")
        for k, lab in _PART_LABELS:
            x = a["stats"][k]
            L.append(f"| {lab} | {1e3 * x['mean']:.3f} | {1e3 * x['median']:.3f} | "
                     f"{1e3 * x['p90']:.3f} | {x['total']:.3f} | "
                     f"{100 * x['total'] / wall:.1f} |")
        for k, lab in _COUNT_LABELS:
            x = a["stats"][k]
            L.append(f"| {lab} (count) | {x['mean']:.1f} | {x['median']:.0f} | "
                     f"{x['p90']:.0f} | {x['total']:.0f} | |")
    L.append("")
    names = [k for k in kinds if k != "all"]
    L.append("By tick kind: mean ms per tick (total s):")
    L.append("")
    L.append("| part | " + " | ".join(f"{k} (n={kinds[k]['n']})" for k in names) + " |")
    L.append("|---|" + "---|" * len(names))
    for k, lab in _PART_LABELS:
        L.append(f"| {lab} | " + " | ".join(
            f"{1e3 * kinds[n]['stats'][k]['mean']:.3f} ({kinds[n]['stats'][k]['total']:.3f})"
            for n in names) + " |")
    for k, lab in _COUNT_LABELS:
        L.append(f"| {lab} (mean, total) | " + " | ".join(
            f"{kinds[n]['stats'][k]['mean']:.1f} ({kinds[n]['stats'][k]['total']:.0f})"
            for n in names) + " |")
    ticks = s.get("ticks") or []
    if ticks:
        slow = sorted(range(len(ticks)), key=lambda i: -ticks[i].get("period", 0))[:12]
        L.append("")
        L.append("Slowest ticks (ms; new shapes pay one-off setup here):")
        L.append("")
        L.append("| tick | period | _launch | _prefill | prefill tokens | groups | rows "
                 "in groups | rows decoded |")
        L.append("|---|---|---|---|---|---|---|---|")
        for i in sorted(slow):
            t = ticks[i]
            L.append(f"| {i} | {1e3 * t.get('period', 0):.1f} | "
                     f"{1e3 * t.get('launch', 0):.1f} | {1e3 * t.get('prefill', 0):.1f} | "
                     f"{t.get('n.prefill_tokens', 0)} | {t.get('n.groups', 0)} | "
                     f"{t.get('n.group_rows', 0)} | {t.get('n.decoded', 0)} |")
    return "\n".join(L)


def format_profile(eng_prof, raw_prof, B, new):
    m = eng_prof["mean_ms"]
    md = eng_prof["median_ms"]
    r = raw_prof

    def row(name, key, note=""):
        return f"| {name} | {m.get(key, 0):.3f} | {md.get(key, 0):.3f} | {note} |"

    launch_rest = m["launch"] - m["launch.fwd_build"] - m["launch.sample"] - m["launch.async_eval"]
    read_rest = m["read.py"] - m["read.accept"]
    host = m["period"] - m["read.wait"]
    lines = [
        f"Engine per decode step at B={B} ({eng_prof['nticks']} steady ticks, all rows "
        f"decoding, no prefill); ms per step:",
        "",
        "| where | mean ms | median ms | note |",
        "|---|---|---|---|",
        row("step period (tick start to tick start)", "period",
            f"= {B / m['period'] * 1e3:,.0f} tok/s"),
        row("worker: tick total", "tick"),
        row("  _filter", "filter"),
        row("  _join", "join"),
        row("    _align (inside _filter/_join)", "align"),
        row("  _launch", "launch"),
        row("    model forward (graph build)", "launch.fwd_build"),
        row("    sampler.sample (graph build)", "launch.sample"),
        row("    mx.async_eval (launch)", "launch.async_eval"),
        f"|     rest of _launch (per-row Python) | {launch_rest:.3f} | | |",
        row("  _prefill", "prefill"),
        row("  _read: blocked waiting for device", "read.wait",
            "device still busy with step N"),
        row("  _read: tolist + per-row Python", "read.py"),
        row("    of which _accept (all rows)", "read.accept",
            f"{1e3 * m['read.accept'] / B:.2f} us/row"),
        f"|     rest of _read | {read_rest:.3f} | | |",
        row("  _kv_report", "kv_report"),
        row("  rest of tick (TickReport, RowUpdates, mx.clear_cache...)", "tick.rest"),
        row("loop side: gap between ticks", "gap"),
        row("  Engine._apply", "apply"),
        row("  rest of gap (thread handoff, _serve, scheduler.admit)", "gap.rest"),
        f"| **host busy per step (period - wait)** | {host:.3f} | | |",
        "",
        f"Raw loop at B={B}: step {r['step_ms']:.3f} ms (= {B / r['step_ms'] * 1e3:,.0f} "
        f"tok/s): forward graph build {r['build_ms']:.3f}, argmax+async_eval "
        f"{r['argmax_async_eval_ms']:.3f}, blocked in tolist {r['wait_tolist_ms']:.3f}; "
        f"host busy {r['step_ms'] - r['wait_tolist_ms']:.3f} ms/step.",
    ]
    if "sync_step_ms" in r:
        lines.append(
            f"Raw loop fully synchronous (mx.eval every step, no overlap): "
            f"{r['sync_step_ms']:.3f} ms/step, of which graph build {r['sync_build_ms']:.3f}"
            f" -> launch + device ~ {r['sync_step_ms'] - r['sync_build_ms']:.3f} ms/step.")
    v = r.get("views_on_worker")
    if v:
        lines.append(
            f"Raw loop on the engine's cache views, on the engine's MLX thread: step "
            f"{v['step_ms']:.3f} ms (= {B / v['step_ms'] * 1e3:,.0f} tok/s): graph build "
            f"{v['build_ms']:.3f}, argmax+async_eval {v['argmax_async_eval_ms']:.3f}, "
            f"blocked in tolist {v['wait_tolist_ms']:.3f}; Python GC {v['gc_ms']:.1f} ms "
            f"in the whole run.")
    return "\n".join(lines)


# -- (d) mixed continuous run -----------------------------------------------------------
def mixed_workload(rng, rows, waves, lo, hi, vocab):
    lens = rng.integers(lo, hi + 1, size=rows).tolist()
    prompts = [rng.integers(2, vocab, size=L).tolist() for L in lens]
    per = -(-rows // waves)
    return [prompts[w * per:(w + 1) * per] for w in range(waves)]


def _ttft_stats(ttfts, joiners):
    def st(xs):
        xs = sorted(xs)
        if not xs:
            return None
        p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
        return dict(n=len(xs), mean_s=statistics.mean(xs), p90_s=p90, max_s=xs[-1])
    return dict(all=st(ttfts), joiners=st(joiners))


async def run_mixed_engine(model, tok, waves, n, gap, max_batch, prof=None):
    """One pass of the mixed workload on a fresh Engine (no warm-up of its own: the
    caller alternates passes, so kernels are compiled by an earlier pass)."""
    t = pc()
    eng = mlxnb.Engine((for_engine(model), tok), max_batch=max_batch, kv_budget=None,
                       **ENGINE_KW)
    construct_s = pc() - t
    try:
        if prof is not None:
            prof.attach(eng)
        s0 = len(eng.steps)
        t0 = pc()
        rows, late = [], {}
        for w, prompts in enumerate(waves):
            if w:
                await asyncio.sleep(max(0.0, t0 + w * gap - pc()))
            rows.append([eng.submit(_text(p), chat=False, max_tokens=n) for p in prompts])
            for r in rows[-1]:  # TTFT counts from the wave's due time (as for BG)
                late[r.id] = pc() - (t0 + w * gap)
        allrows = [r for ws in rows for r in ws]
        res = [await r for r in allrows]
        wall = pc() - t0
        if prof is not None:
            prof.detach(eng)
            prof.mixed = prof.summarize_all(t0, wall)
        ok = all(r.finish_reason == "length" and len(r.tokens) == n for r in res)
        tot = sum(len(r.tokens) for r in res)
        ttft = [r.ttft_s + late[r.id] for r in allrows]
        join = [r.ttft_s + late[r.id] for ws in rows[1:] for r in ws]
        steps = eng.steps[s0:]
        return dict(tps=tot / wall, wall_s=wall, tokens=tot, ok=ok, steps=len(steps),
                    construct_s=construct_s, warmup_s=eng.warmup_s,
                    prefill_steps=sum(1 for s in steps if s.prefill_tokens),
                    max_batch_seen=max(s.batch_size for s in steps),
                    ttft=_ttft_stats(ttft, join))
    finally:
        await eng.aclose()


def run_mixed_bg(model, waves, n, gap, max_batch):
    """One pass of the mixed workload on a fresh BatchGenerator (no warm-up of its own).
    Its loop is synchronous: a wave due during a `next()` call is inserted after it,
    and TTFT counts that wait too (from the wave's due time, as for the engine)."""
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None,
                         completion_batch_size=max_batch)
    t_ins, t_first, counts, wave_of = {}, {}, {}, {}
    pending = set()  # inserted and not finished
    steps = 0
    t0 = pc()
    w = 0
    try:
        while True:
            now = pc()
            while w < len(waves) and now >= t0 + w * gap:
                uids = gen.insert(waves[w], [n] * len(waves[w]))
                for u in uids:
                    t_ins[u], wave_of[u] = t0 + w * gap, w
                pending.update(uids)
                w += 1
            if not pending:
                if w >= len(waves):
                    break
                time.sleep(max(0.0, t0 + w * gap - pc()))
                continue
            _, gen_resp = gen.next()
            steps += 1
            tn = pc()
            for r in gen_resp:
                if r.uid not in t_first:
                    t_first[r.uid] = tn
                counts[r.uid] = counts.get(r.uid, 0) + 1
                if r.finish_reason is not None:
                    pending.discard(r.uid)
    finally:
        gen.close()
    wall = pc() - t0
    tot = sum(counts.values())
    ok = all(counts.get(u) == n for u in t_ins)
    ttft = [t_first[u] - t_ins[u] for u in t_ins]
    join = [t_first[u] - t_ins[u] for u in t_ins if wave_of[u] > 0]
    return dict(tps=tot / wall, wall_s=wall, tokens=tot, ok=ok, steps=steps,
                ttft=_ttft_stats(ttft, join))


async def do_mixed(model, tok, rng, args, vocab, shape, dtype, over):
    """Alternate engine, BG, engine, BG, ... (--mixed-passes each) on one workload;
    the last pass of each is the measurement (earlier ones compile the kernels: MLX
    CUDA JIT-compiles per new shape). --profile-mixed adds one profiled engine pass."""
    n = args.mixed_new or args.new
    mb = args.mixed_batch or args.mixed_rows
    waves = mixed_workload(rng, args.mixed_rows, args.mixed_waves, args.mixed_min,
                           args.mixed_max, vocab)
    mixed = dict(shape=shape, dtype=dtype, rows=args.mixed_rows, waves=args.mixed_waves,
                 gap_s=args.mixed_gap, new=n, max_batch=mb,
                 prompt_range=[args.mixed_min, args.mixed_max], passes={})
    kinds = ["engine"] + (["bg"] if args.mixed_bg else [])
    if args.mixed_bg_first:
        kinds.reverse()
    npass = max(1, args.mixed_passes)
    for p in range(npass):
        for k in kinds:
            if p and over():
                log(f"  mixed {k} pass {p + 1}: skipped (--budget)")
                continue
            cold = None
            if k == "engine" and p == 0 and args.profile_mixed_first:
                cold = EngineProfiler()
            try:
                if k == "engine":
                    r = await run_mixed_engine(model, tok, waves, n, args.mixed_gap, mb,
                                               prof=cold)
                    if cold is not None:
                        mixed["profile_first"] = cold.mixed
                        cold.mixed["text"] = format_mixed_profile(
                            cold.mixed, " (pass 1: kernels cold, timers on)")
                else:
                    r = run_mixed_bg(model, waves, n, args.mixed_gap, mb)
            except Exception as e:
                traceback.print_exc()
                r = dict(error=f"{type(e).__name__}: {e}")
            r["pass"] = p + 1
            mixed["passes"].setdefault(k, []).append(r)
            mixed[k] = r
            log(f"  mixed {k} pass {p + 1}/{npass}: " + _brief(r))
            gc.collect()
            mx.clear_cache()
    if args.profile_mixed and not over():
        prof = EngineProfiler()
        try:
            r = await run_mixed_engine(model, tok, waves, n, args.mixed_gap, mb, prof=prof)
            r["pass"] = "profiled"
            mixed["passes"].setdefault("engine", []).append(r)
            log("  mixed engine profiled pass: " + _brief(r))
            mixed["profile"] = prof.mixed
            mixed["profile"]["text"] = format_mixed_profile(
                prof.mixed, f" (pass {npass + 1}, timers on; unprofiled pass "
                f"{mixed['engine'].get('wall_s', 0):.3f} s)")
            log(mixed["profile"]["text"])
        except Exception as e:
            traceback.print_exc()
            mixed["profile"] = dict(error=f"{type(e).__name__}: {e}")
    return mixed


def _brief(r):
    if "error" in r:
        return f"ERROR {r['error']}"
    t = r["ttft"]["all"]
    return (f"tok/s={r['tps']:.1f} wall={r['wall_s']:.3f}s steps={r.get('steps')} "
            f"ttft mean={t['mean_s']:.3f}s p90={t['p90_s']:.3f}s ok={r['ok']}"
            + (f" engine construct={r['construct_s']:.3f}s (warm-up {r['warmup_s']:.3f}s)"
               if "construct_s" in r else ""))


# -- driver -----------------------------------------------------------------------------
def parse_plan(args):
    if args.plan:
        plan = []
        for item in args.plan.split():
            shape, dtype, bs = item.split(":")
            plan.append((shape, dtype, [int(b) for b in bs.split(",")]))
        return plan
    return [(args.shape, args.dtype, [int(b) for b in args.batch.split(",")])]


def fmt(x, nd=0):
    if x is None:
        return "-"
    return f"{x:,.{nd}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES) + ["default"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16",
                                                             "float32", "4bit"])
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--plan", default=None,
                    help="space-separated shape:dtype:B1,B2 entries (overrides the three above)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (tokens)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--warm-new", type=int, default=16, help="new tokens in warm-up runs")
    ap.add_argument("--methods", default="raw,rawb,bg,engine")
    ap.add_argument("--repeat", type=int, default=1, help="measure each N times, keep best")
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--mixed-rows", type=int, default=64)
    ap.add_argument("--mixed-waves", type=int, default=8)
    ap.add_argument("--mixed-gap", type=float, default=0.2)
    ap.add_argument("--mixed-min", type=int, default=16)
    ap.add_argument("--mixed-max", type=int, default=512)
    ap.add_argument("--mixed-new", type=int, default=None, help="default: --new")
    ap.add_argument("--mixed-batch", type=int, default=None, help="default: --mixed-rows")
    ap.add_argument("--mixed-bg", action="store_true", default=True)
    ap.add_argument("--no-mixed-bg", dest="mixed_bg", action="store_false")
    ap.add_argument("--mixed-passes", type=int, default=2,
                    help="alternate engine, BG this many times; report the last of each")
    ap.add_argument("--mixed-first", action="store_true",
                    help="run the mixed workload before the decode runs (a cold process)")
    ap.add_argument("--mixed-bg-first", action="store_true",
                    help="alternate BG, engine, ... instead (who pays the process's "
                    "one-off kernel builds)")
    ap.add_argument("--no-fuse", action="store_true",
                    help="Engine(fuse=False): mlx-lm's projections as loaded")
    ap.add_argument("--no-warmup", action="store_true",
                    help="Engine(warmup=False): no warm-up workload at construction")
    ap.add_argument("--profile-mixed", action="store_true",
                    help="one more engine pass of the mixed run with per-tick timers")
    ap.add_argument("--profile-mixed-first", action="store_true",
                    help="profile the first (cold) engine pass of --mixed")
    ap.add_argument("--profile", type=int, default=0,
                    help="profile the engine at this batch size (first plan entry)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: past 60%% of it measure once, past it skip what is left")
    ap.add_argument("--quick", action="store_true", help="CI smoke: tiny shape, seconds")
    ap.add_argument("--no-long", action="store_true", help="skip the engine's eng-long run")
    ap.add_argument("--streak-s", type=float, default=None,
                    help="override mlxnb.core.engine._STREAK_S (decode streak per tick)")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = ap.parse_args()
    if args.quick:
        args.plan = None
        args.shape, args.dtype, args.batch = "tiny", "float32", "1,4"
        args.prompt, args.new, args.warm_new = 16, 16, 4
        args.mixed = True
        args.mixed_rows, args.mixed_waves, args.mixed_gap = 8, 4, 0.05
        args.mixed_min, args.mixed_max = 8, 64
        args.profile = args.profile or 4
        args.profile_mixed = True
    asyncio.run(amain(args))


async def amain(args):
    methods = args.methods.split(",")
    if args.no_warmup:
        ENGINE_KW["warmup"] = False
    if args.no_fuse:
        ENGINE_KW["fuse"] = False
    if args.streak_s is not None:
        from mlxnb.core import engine as engine_mod

        engine_mod._STREAK_S = args.streak_s
    plan = parse_plan(args)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(device=str(mx.default_device()), mlx=mx.__version__,
               python=platform.python_version(), machine=platform.machine(),
               cpus=os.cpu_count(), argv=sys.argv[1:], mlxnb=mlxnb.__file__)
    try:
        import mlx_lm

        env["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    log(f"# engine_bench  {env}")
    results = dict(env=env, args=vars(args), rows=[], mixed=None, profile=None)
    rng = np.random.default_rng(1234)
    t_start = pc()

    def over(frac=1.0):
        return args.budget > 0 and pc() - t_start > frac * args.budget

    def save():
        if out_dir:
            (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
            (out_dir / "results.md").write_text(render(results))

    for pi, (shape, dtype, batches) in enumerate(plan):
        if over():
            log(f"## {shape} {dtype}: skipped (--budget)")
            continue
        t = pc()
        model, tok, vocab = build_model(shape, dtype)
        log(f"## {shape} {dtype}: built in {pc() - t:.1f}s")
        TWINS.clear()
        if not args.no_fuse and (args.mixed or args.profile
                                 or any(m.startswith("engine") for m in methods)):
            TWINS[id(model)] = build_model(shape, dtype)[0]
        if args.mixed and args.mixed_first and pi == 0:
            results["mixed"] = await do_mixed(model, tok, rng, args, vocab, shape, dtype,
                                              over)
            save()
        for B in batches:
            row = dict(shape=shape, dtype=dtype, B=B, prompt=args.prompt, new=args.new)
            prof_here = args.profile == B and pi == 0
            # Repeats interleave the methods (raw, bg, engine, raw, bg, engine, ...) on
            # the same prompts per round, so drift of the machine (clocks, neighbours)
            # hits them alike; per-round ratios are kept beside the best of each.
            warm = make_prompts(rng, B, args.prompt, vocab)
            per = {m: [] for m in methods}
            errors = {}
            for rep in range(args.repeat):
                if rep and over(0.6):
                    break
                p1 = make_prompts(rng, B, args.prompt, vocab)
                p2 = make_prompts(rng, B, args.prompt, vocab)
                for meth in methods:
                    if meth in errors:
                        continue
                    if over():
                        errors[meth] = "skipped: --budget"
                        continue
                    t = pc()
                    try:
                        r = await measure(meth, rep, model, tok, args, B, warm, p1, p2)
                    except Exception as e:
                        traceback.print_exc()
                        errors[meth] = f"{type(e).__name__}: {e}"
                        continue
                    r["took_s"] = pc() - t
                    if not r["ok"]:
                        log(f"  WARNING {meth} B={B}: not every row ran to max_tokens")
                    per[meth].append(r)
                    gc.collect()
                    mx.clear_cache()
            for meth in methods:
                if per[meth]:
                    row[meth] = max(per[meth], key=lambda r: r["decode_tps"])
                    row[meth]["all_tps"] = [r["decode_tps"] for r in per[meth]]
                else:
                    row[meth] = dict(error=errors.get(meth, "no result"), decode_tps=None)
                log(f"  B={B:<4} {meth:<6} " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row[meth].items()))
            pairs = [("engine", o) for o in ("raw", "bg", "bgd")] + [
                (d, "raw") for d in ("rawt", "rawv", "rawvt", "engine0", "enginenf")]
            for mine, other in pairs:
                if mine in per and other in per:
                    rs = [e["decode_tps"] / o["decode_tps"]
                          for e, o in zip(per[mine], per[other]) if o["decode_tps"]]
                    if rs:
                        row[f"{mine}_over_{other}_median"] = statistics.median(rs)
            results["rows"].append(row)
            save()
            if prof_here and not over():
                await do_profile(model, tok, rng, args, B, vocab, results)
                save()
        if args.profile and pi == 0 and args.profile not in batches and not over():
            await do_profile(model, tok, rng, args, args.profile, vocab, results)
            save()
        if args.mixed and not args.mixed_first and pi == 0 and not over():
            results["mixed"] = await do_mixed(model, tok, rng, args, vocab, shape, dtype,
                                              over)
            save()
        del model
        TWINS.clear()
        gc.collect()
        mx.clear_cache()
    text = render(results)
    log("\n" + text)
    save()


async def measure(meth, rep, model, tok, args, B, warm, p1, p2):
    """One measurement of one method (warmed up on `warm` in round 0)."""
    if meth in RAW_VARIANTS:
        kw = RAW_VARIANTS[meth]
        if rep == 0:
            run_raw(model, warm, args.warm_new, **kw)
        return run_raw(model, p1, args.new, **kw)
    if meth in ("rawt", "rawvt", "rawtc"):  # on a worker thread
        kw = RAW_VARIANTS[meth[:-1]] if meth != "rawtc" else {}

        def both():
            if meth == "rawtc" and rep == 0:
                # weights re-made on this thread (its own stream); run it last: later
                # methods see these weights
                from mlx.utils import tree_map
                model.update(tree_map(lambda a: a * 1, model.parameters()))
                mx.eval(model.parameters())
            if rep == 0:
                run_raw(model, warm, args.warm_new, **kw)
            return run_raw(model, p1, args.new, **kw)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(both).result()
    if meth in ("bg", "bgd"):
        if rep == 0:
            run_bg(model, warm, args.warm_new, defaults=meth == "bgd")
        return run_bg(model, p1, args.new, defaults=meth == "bgd")
    if meth in ("engine", "engine0", "enginenf"):
        from mlxnb.core import engine as engine_mod

        keep = engine_mod._STREAK_S
        if meth == "engine0":  # diagnostic: no decode streaks
            engine_mod._STREAK_S = 0.0
        try:
            return await run_engine(model, tok, p1, p2, args.new, B, warm, args.warm_new,
                                    long=not args.no_long and meth == "engine",
                                    fuse=meth != "enginenf")
        finally:
            engine_mod._STREAK_S = keep
    raise ValueError(meth)


async def do_profile(model, tok, rng, args, B, vocab, results):
    log(f"## profile at B={B}")
    try:
        warm = make_prompts(rng, B, args.prompt, vocab)
        p1 = make_prompts(rng, B, args.prompt, vocab)
        raw_prof = {}
        run_raw(model, warm, args.warm_new)
        run_raw(model, p1, args.new, prof=raw_prof)
        raw_prof.update(run_raw_sync(model, p1, min(args.new, 32)))
        # the same loop on the engine's cache views, on the engine's own MLX thread
        from mlxnb.core._threads import mlx_worker

        views_prof = {}

        def on_worker():
            run_raw(model, warm, args.warm_new, views=True)
            with GcTimer() as g:
                run_raw(model, p1, args.new, prof=views_prof, views=True)
            views_prof["gc_ms"] = g.ms
        mlx_worker().submit(on_worker).result()
        raw_prof["views_on_worker"] = views_prof
        prof = EngineProfiler()
        p2 = make_prompts(rng, B, args.prompt, vocab)
        p3 = make_prompts(rng, B, args.prompt, vocab)
        with GcTimer() as g:
            eng = await run_engine(model, tok, p2, p3, args.new, B, warm, args.warm_new,
                                   prof_hook=prof)
        eng["gc_ms_all_runs"] = g.ms
        if prof.summary is None:
            raise RuntimeError("no steady ticks to profile")
        results["profile"] = dict(engine=prof.summary, raw=raw_prof, engine_run=eng,
                                  text=format_profile(prof.summary, raw_prof, B, args.new)
                                  + f"\nPython GC during the engine's three runs: "
                                  f"{eng['gc_ms_all_runs']:.1f} ms.")
        log(results["profile"]["text"])
    except Exception as e:
        traceback.print_exc()
        results["profile"] = dict(error=f"{type(e).__name__}: {e}")


def render(results):
    L = []
    env = results["env"]
    a = results["args"]
    L.append(f"device {env['device']}, mlx {env['mlx']}, mlx-lm {env.get('mlx_lm')}, "
             f"python {env['python']}; prompt {a['prompt']} tokens, {a['new']} new tokens, "
             f"greedy, random weights")
    L.append("")
    L.append("Decode tok/s (prefill excluded). engine = tokens / sum(dt_s) over steps with "
             "all B rows decoding and no prefill; eng-span = same over their wall span; "
             "e2e = B*new / wall of a plain run (prefill, ramp-up, loop included); eng-long = "
             "engine over B+new tokens per row (caches past 256 tokens). Columns are the "
             "best of --repeat rounds; 'med' = median over rounds of the per-round ratio "
             "(methods interleave within a round, on the same prompts).")
    L.append("")
    L.append("| shape | dtype | B | raw | raw-bkv | BG | engine | eng-span | engine/BG |"
             " engine/raw | eng-span/raw | raw e2e | BG e2e | engine e2e | eng-long |"
             " engine/BG med | engine/raw med |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        raw = (r.get("raw") or {}).get("decode_tps")
        bg = (r.get("bg") or {}).get("decode_tps")
        e = r.get("engine") or {}
        en, sp = e.get("decode_tps"), e.get("span_tps")

        def ratio(x, y):
            return f"{x / y:.2f}" if x and y else "-"
        rawb = (r.get("rawb") or {}).get("decode_tps")
        L.append(f"| {r['shape']} | {r['dtype']} | {r['B']} | {fmt(raw)} | {fmt(rawb)} | {fmt(bg)} | "
                 f"{fmt(en)} | {fmt(sp)} | {ratio(en, bg)} | {ratio(en, raw)} | "
                 f"{ratio(sp, raw)} | {fmt((r.get('raw') or {}).get('e2e_tps'))} | "
                 f"{fmt((r.get('bg') or {}).get('e2e_tps'))} | {fmt(e.get('e2e_tps'))} | "
                 f"{fmt(e.get('steady_decode_tps'))} | "
                 f"{fmt(r.get('engine_over_bg_median'), 2)} | "
                 f"{fmt(r.get('engine_over_raw_median'), 2)} |")
    for r in results["rows"]:
        diag = [m for m in ("bgd", "rawt", "rawv", "rawvt", "rawtc", "engine0", "enginenf")
                if (r.get(m) or {}).get("decode_tps")]
        if diag:
            base = ["raw"] + (["engine"] if (r.get("engine") or {}).get("decode_tps") else [])
            meds = [(k[:-len("_median")].replace("_over_", "/"), v) for k, v in r.items()
                    if k.endswith("_median") and not k.startswith("engine_over_")
                    or k == "engine_over_bgd_median"]
            L.append(f"\nDiagnostic variants, {r['shape']} {r['dtype']} B={r['B']}: " +
                     ", ".join(f"{m} {fmt(r[m]['decode_tps'])}" for m in base + diag) +
                     "".join(f"; {k} median {v:.2f}" for k, v in meds))
    errs = [(r["shape"], r["dtype"], r["B"], m, r[m]["error"]) for r in results["rows"]
            for m in ("raw", "rawb", "bg", "engine")
            if isinstance(r.get(m), dict) and "error" in r[m]]
    bad = [(r["shape"], r["dtype"], r["B"], m) for r in results["rows"]
           for m in ("raw", "rawb", "bg", "engine") if isinstance(r.get(m), dict)
           and r[m].get("ok") is False]
    for e in errs:
        L.append(f"\nERROR {e}")
    if bad:
        L.append(f"\nWARNING rows that did not run to max_tokens: {bad}")
    m = results.get("mixed")
    if m:
        L.append("")
        L.append(f"Mixed: {m['rows']} rows, prompts {m['prompt_range'][0]}..."
                 f"{m['prompt_range'][1]} tokens, {m['new']} new each, {m['waves']} waves "
                 f"{m['gap_s']} s apart, max_batch {m['max_batch']} ({m['shape']} {m['dtype']})")
        L.append("")
        first = "BG" if a.get("mixed_bg_first") else "engine"
        L.append(f"Passes alternate (first: {first}); the last of each (bold) is the "
                 "measurement, earlier ones warm the kernels (MLX CUDA compiles per shape). "
                 "TTFT counts from each wave's due time (BG's synchronous loop inserts "
                 "a wave after the step running when it is due: that wait counts). "
                 "construct s = Engine() incl. its warm-up (not in wall or TTFT)"
                 + (" -- warm-up off (--no-warmup)." if a.get("no_warmup") else "."))
        L.append("")
        L.append("| engine | pass | tok/s | wall s | steps | TTFT mean s | TTFT p90 s |"
                 " joiners TTFT mean s | joiners TTFT p90 s | ok | construct s |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        passes = m.get("passes") or {k: [m[k]] for k in ("engine", "bg") if m.get(k)}
        for k in ("engine", "bg"):
            name = "mlxnb" if k == "engine" else "BatchGenerator"
            for x in passes.get(k, []):
                if "error" in x:
                    L.append(f"| {name} | {x.get('pass')} | ERROR {x['error']} |||||||||")
                    continue
                ta, tj = x["ttft"]["all"], x["ttft"]["joiners"] or {}
                b = "**" if x is m.get(k) else ""
                L.append(f"| {name} | {x.get('pass')} | {b}{fmt(x['tps'])}{b} | "
                         f"{x['wall_s']:.2f} | {x.get('steps', '-')} | {ta['mean_s']:.3f} | "
                         f"{ta['p90_s']:.3f} | {tj.get('mean_s', 0):.3f} | "
                         f"{tj.get('p90_s', 0):.3f} | {x['ok']} | "
                         + (f"{x['construct_s']:.2f} |" if "construct_s" in x else "- |"))
        mf = m.get("profile_first")
        if mf:
            L.append("")
            L.append(mf.get("text") or "")
        mp = m.get("profile")
        if mp:
            L.append("")
            L.append(mp.get("text") or f"mixed profile ERROR {mp.get('error')}")
    p = results.get("profile")
    if p:
        L.append("")
        L.append(p.get("text") or f"profile ERROR {p.get('error')}")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
