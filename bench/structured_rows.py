"""Structured rows: decode tok/s of B constrained rows vs B free rows, and the mask time.

  decode   mlxnb.Engine(max_batch=B, prefix_cache=None) on a random-weight model of the
           chosen shape (default SmolLM2-135M's) with the tokenizer's vocabulary. Each
           pass submits B rows of one kind at once: free rows, or constrained rows.
           With --mix json+regex (default) half take a JSON schema (an array of 32
           small objects) and half a regex (capitalized words); json or regex gives
           all rows one of them. Neither needs to end within max_tokens, so the rows
           run to it as free rows do. tok/s = tokens / summed step time over the
           decode-only steps with all B rows in the batch. Passes alternate free,
           constrained (--repeat rounds): the best of each and the median per-round
           ratio. --fill-threads 1,4 repeats it per Engine(fill_threads=N).
  mask     per step at batch B, outside the engine: llguidance filling B bitmasks one
           matcher at a time on one thread, consuming one token per row, and masking
           [B, V] logits on the device (timed to mx.eval). Rows advance by a random
           allowed token; a finished grammar restarts. mean / p50 / p90 ms per step.

--profile adds the host ms per decode step of each part of the engine's tick
(Engine.trace), the mask parts included: mask.wait (reading step N's tokens),
mask.start (handing them to the fill threads), mask.launch (launching step N+1's
forward while they fill), mask.join (waiting for the masks after that).
--tokenizer: a tokenizer.json or model directory, "default" (the bundled model's,
falling back to "synthetic"), or "synthetic" (a byte-level BPE trained here, ~30 s).

  python -m bench structured-rows                   # B=32; masks at 32 and 128
  python -m bench structured-rows --dtype float32 --repeat 3 --new 64 --save
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxnb
from mlxnb.core.constrain import Constraints
from mlxnb.core.rows import SamplingParams
from mlxnb.core.worker.masks import default_fill_threads, fill as fill_masks, masked

from . import common
from .common import log, pc

NAME, RESULT, TITLE = "structured-rows", "structured-rows", "Structured rows vs free rows"

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "mood", "ok"], "additionalProperties": False}
# The schema needs more tokens than a row may take (>= 20 per item) and the regex
# never has to end (the end-of-sequence token is one of thousands allowed), so rows
# run to max_tokens as the free rows do: the batches compared keep one shape.
SCHEMA = {"type": "array", "items": ITEM, "minItems": 32, "maxItems": 32}
REGEX = r"([A-Z][a-z]{2,8} )+"
CONSTRAINTS = [dict(json_schema=SCHEMA), dict(regex=REGEX)]
# --mix: which constraints the constrained rows take, in turn. A regex of words allows
# most of a vocabulary at most steps, so its masks cost ~10x a JSON row's.
MIXES = {"json+regex": CONSTRAINTS, "json": CONSTRAINTS[:1], "regex": CONSTRAINTS[1:]}
MASK_KINDS = CONSTRAINTS + [
    dict(json_schema=ITEM), dict(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    dict(choices=("alpha", "beta", "gamma")),
    dict(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n')]


# -- tokenizer and model -------------------------------------------------------------
def _synthetic_tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
             for _ in range(20000)]

    def lines():
        for _ in range(60000):
            d = {rng.choice(words): rng.choice([rng.randint(-999, 9999),
                                                " ".join(rng.choices(words, k=4))])
                 for _ in range(3)}
            yield json.dumps(d) + " " + " ".join(rng.choices(words, k=12)).capitalize() + "."

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False)
    tok.train_from_iterator(lines(), tr)
    return tok.to_str()


def load_tokenizer(spec: str):
    """An mlx-lm TokenizerWrapper and a line saying what it is."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    if spec == "default":
        try:
            from mlxnb.models.loading import default_model_path
            from mlx_lm.utils import load_tokenizer as mlx_load

            path = default_model_path()
            return mlx_load(path), f"default model's ({path.name})"
        except Exception as e:
            log(f"(no default model here: {type(e).__name__}: {e}; using 'synthetic')")
            spec = "synthetic"
    if spec == "synthetic":
        t = pc()
        from tokenizers import Tokenizer

        obj = Tokenizer.from_str(_synthetic_tokenizer_json(49152))
        what = f"synthetic byte-level BPE, trained in {pc() - t:.0f} s"
    else:
        p = Path(spec)
        if p.is_dir():
            from mlx_lm.utils import load_tokenizer as mlx_load

            return mlx_load(p), f"from {p}"
        from tokenizers import Tokenizer

        obj, what = Tokenizer.from_file(str(p)), f"from {p}"
    eos = "<|endoftext|>" if obj.token_to_id("<|endoftext|>") is not None else None
    hf = PreTrainedTokenizerFast(tokenizer_object=obj, eos_token=eos)
    ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=ids), what


# -- decode tok/s --------------------------------------------------------------------
async def one_pass(eng, B: int, new: int, constrained: bool, seed: int,
                   mix: str = "json+regex") -> dict:
    rng = random.Random(seed)
    words = ["river", "stone", "quiet", "orange", "market", "seven", "cloud", "paper"]
    rows, steps0 = [], len(eng.steps)
    for i in range(B):
        kinds = MIXES[mix]
        kw = kinds[i % len(kinds)] if constrained else {}
        text = f"Record {i}: " + " ".join(rng.choices(words, k=40))
        rows.append(eng.submit(text, chat=False, max_tokens=new, **kw))
    await eng.wait()
    steps = [s for s in eng.steps[steps0:] if s.batch_size == B and s.prefill_tokens == 0]
    toks, secs = sum(s.tokens for s in steps), sum(s.dt_s for s in steps)
    fin = {}
    for r in rows:
        why = getattr(r.finish_reason, "value", r.finish_reason)
        fin[why] = fin.get(why, 0) + 1
    return dict(tok_s=toks / secs if secs else float("nan"), steps=len(steps),
                ms_step=1000 * secs / max(len(steps), 1), finish=fin)


class Parts:
    """Host ms per decode step by part (Engine.trace), for --profile. A tick runs
    several steps (a streak); "tick" is its whole time, spread over its steps."""

    def __init__(self):
        self.sums, self.steps = {}, 0

    def __call__(self, name, value):
        if name == "launch":
            self.steps += 1
        if not name.startswith("n."):
            self.sums[name] = self.sums.get(name, 0.0) + value

    def line(self) -> str:
        n = max(self.steps, 1)
        return "  ".join(f"{k} {1000 * v / n:.2f}" for k, v in sorted(self.sums.items()))


async def profiled(eng, profile: bool, *a, **k) -> dict:
    parts = Parts() if profile else None
    eng.trace(parts)
    try:
        res = await one_pass(eng, *a, **k)
    finally:
        eng.trace(None)
    if parts is not None:
        res["parts"] = parts.line()
    return res


async def decode(model, tok, args, fill_threads) -> dict:
    B = args.batch
    # No prefix reuse: a constrained pass would reuse the prompt KV of the free pass
    # before it (the same prompts) and join its rows in a step with no prompt tokens,
    # which counts as a decode step here; both passes must prefill the same way.
    eng = mlxnb.Engine((model, tok), max_batch=B, kv_budget=None, prefix_cache=None,
                       fill_threads=fill_threads)
    for c in (False, True):  # warm-up: kernels and shapes of both kinds
        await one_pass(eng, B, min(args.new, 16), c, seed=99, mix=args.mix)
    free, cons, ratios, lines = [], [], [], []
    for k in range(args.repeat):
        f = await profiled(eng, args.profile, B, args.new, False, seed=k)
        c = await profiled(eng, args.profile, B, args.new, True, seed=k, mix=args.mix)
        free.append(f)
        cons.append(c)
        ratios.append(c["tok_s"] / f["tok_s"])
        lines.append(f"  round {k + 1}: free {f['tok_s']:8.1f} tok/s ({f['ms_step']:.2f} "
                     f"ms/step, {f['steps']} steps)   constrained {c['tok_s']:8.1f} tok/s "
                     f"({c['ms_step']:.2f} ms/step, {c['steps']} steps, {c['finish']})  "
                     f"ratio {ratios[-1]:.3f}")
        if args.profile:
            lines.append(f"    free ms/step:        {f['parts']}\n"
                         f"    constrained ms/step: {c['parts']}")
        log("\n".join(lines[-2 if args.profile else -1:]))
    await eng.aclose()
    best_f, best_c = max(x["tok_s"] for x in free), max(x["tok_s"] for x in cons)
    return dict(B=B, free_tok_s=best_f, constrained_tok_s=best_c, lines=lines,
                ratio_best=best_c / best_f, ratio_median=statistics.median(ratios))


# -- mask time per step -----------------------------------------------------------------
def _allowed_token(row_words: np.ndarray, rng: np.random.Generator, vocab: int) -> int:
    bits = np.unpackbits(row_words.view(np.uint8), bitorder="little")[:vocab]
    ids = np.flatnonzero(bits)
    return int(ids[rng.integers(len(ids))]) if len(ids) else -1


def mask_time(tok, B: int, steps: int, V: int) -> dict:
    cons = Constraints(tok)
    llt = cons.lltokenizer()
    ms = [cons.compile(SamplingParams(**MASK_KINDS[i % len(MASK_KINDS)])) for i in range(B)]
    rng = np.random.default_rng(0)
    shifts = mx.arange(32, dtype=mx.uint32)
    logits = mx.random.normal((B, V)).astype(mx.bfloat16)
    mx.eval(logits)
    fill, consume, apply = [], [], []
    for step in range(steps + 3):  # 3 warm-up steps
        t0 = pc()
        buf = cons.bitmask(B)
        fill_masks([(k, m, -1) for k, m in enumerate(ms)], buf)  # one thread, one at a time
        t1 = pc()
        out = masked(logits, mx.array(buf), shifts)
        mx.eval(out)
        t2 = pc()
        picks = [_allowed_token(buf[i], rng, llt.vocab_size) for i in range(B)]
        t3 = pc()
        for m, t in zip(ms, picks):
            if t in llt.eos_tokens or t < 0 or m.is_stopped():
                m.reset()
            else:
                m.consume_token(t)
        t4 = pc()
        if step >= 3:
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            consume.append(t4 - t3)
    errors = sum(m.is_error() for m in ms)

    def stats(xs):
        xs = sorted(1000 * x for x in xs)
        return dict(mean=statistics.fmean(xs), p50=xs[len(xs) // 2],
                    p90=xs[int(0.9 * (len(xs) - 1))])

    return dict(B=B, fill_ms=stats(fill), consume_ms=stats(consume), apply_ms=stats(apply),
                matcher_errors=errors)


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--batch", type=common.count, default=32, help="decode batch size B")
    ap.add_argument("--new", type=common.count, default=128, help="max tokens per row")
    ap.add_argument("--repeat", type=common.count, default=2, help="free/constrained rounds")
    ap.add_argument("--mask-batches", default=[32, 128], type=common.counts)
    ap.add_argument("--mask-steps", type=common.count, default=50)
    ap.add_argument("--shape", default="smollm2", choices=["tiny", "smollm2", "llama1b"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", default="default",
                    help="tokenizer.json | model directory | default | synthetic")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="host ms per decode step by part (Engine.trace) for each pass")
    ap.add_argument("--mix", default="json+regex", choices=list(MIXES),
                    help="the constrained rows' constraints, in turn")
    ap.add_argument("--fill-threads", default=None, type=common.counts,
                    help="comma list of Engine(fill_threads=N) to compare (default: the "
                         "engine's own, a quarter of the CPUs, 1 to 4)")
    ap.add_argument("--json", help="also write the numbers here")
    common.add_output_args(ap)
    args = ap.parse_args(argv)

    import llguidance

    report = common.Report(NAME, RESULT, TITLE, args, argv)
    log(f"device {mx.default_device()} | mlx {mx.__version__} | llguidance "
        f"{llguidance.__version__} | {platform.machine()} | python {platform.python_version()}"
        f" | {os.cpu_count()} CPUs")
    tok, what = load_tokenizer(args.tokenizer)
    V = len(tok._tokenizer)
    text = [f"llguidance {llguidance.__version__}; tokenizer: {what}, {V} tokens"]
    log(text[0])
    out = dict(device=str(mx.default_device()), tokenizer=what, vocab=V)
    if not args.skip_decode:
        model = common.build_model(args.shape, args.dtype, vocab=V)[0]
        counts = (args.fill_threads if args.fill_threads
                  else [None])  # None: the engine's own count
        out["decode"] = []
        for n in counts:
            text.append(f"\n## decode: {args.shape} {args.dtype}, B={args.batch}, "
                        f"max_tokens={args.new}, {args.mix} rows, "
                        f"{n or default_fill_threads()} fill thread(s)\n")
            log(text[-1])
            d = asyncio.run(decode(model, tok, args, n))
            d.update(fill_threads=n or default_fill_threads(), mix=args.mix)
            out["decode"].append(d)
            text += ["```"] + d.pop("lines") + ["```", "",
                f"decode tok/s at B={d['B']}: free {d['free_tok_s']:.1f}  constrained "
                f"{d['constrained_tok_s']:.1f}  ratio (best) {d['ratio_best']:.3f}  "
                f"ratio (median of rounds) {d['ratio_median']:.3f}"]
            log(text[-1])
            report.write("\n".join(text))
    text += [f"\n## mask time per step (ms; {args.mask_steps} steps; rows cycle through: "
             f"array-of-objects schema, words regex, object schema, date regex, choices, "
             f"Lark grammar)\n", "```",
             f"{'B':>5} {'fill mean':>10} {'p50':>7} {'p90':>7} | {'consume':>8} | "
             f"{'apply mean':>10} {'p50':>7} {'p90':>7}"]
    log("\n".join(text[-3:]))
    out["mask"] = []
    for B in args.mask_batches:
        m = mask_time(tok, B, args.mask_steps, V)
        out["mask"].append(m)
        f, c, a = m["fill_ms"], m["consume_ms"], m["apply_ms"]
        text.append(f"{B:>5} {f['mean']:>10.3f} {f['p50']:>7.3f} {f['p90']:>7.3f} | "
                    f"{c['mean']:>8.3f} | {a['mean']:>10.3f} {a['p50']:>7.3f} "
                    f"{a['p90']:>7.3f}" + (f"  ({m['matcher_errors']} matcher errors)"
                                            if m["matcher_errors"] else ""))
        log(text[-1])
    text.append("```")
    report.write("\n".join(text), out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
