"""Speculative decoding (prompt lookup): decode tok/s with speculation off vs on.

The real default model (or --model), greedy, chat prompts. Two prompt sets, both in
bench/prompts_speculate.py: copy-heavy (extraction, fix the typos, summarise and
quote, reformat) where the answer copies long spans of the prompt, and free-form
(stories, explanations, lists) where it copies little. Per set and batch size B
(--batch, default 1,8): the same rows, B at a time, each wave with speculate=None and
with speculate="lookup", in an order that alternates wave by wave (a busy host's drift
hits both alike), --repeat rounds, after one untimed wave of each at that B. Outputs are
token-identical (greedy), so both runs decode the same tokens.

  decode tok/s   tokens read back in decode-only steps (no prefill beside them) /
                 the summed time of those steps
  accept         accepted drafts / drafts verified
  tok/step       tokens each row took per decode-only step (lookup run)
  pipelined      verifying steps launched without reading the step in flight

--way wide|sync: verify only one way (default: the policy picks by measured speed).

--profile B: after the runs, one more pass of the copy-heavy prompts at batch B, with
speculation and without, one step per tick (streak_s 0) under the engine's timing
hooks: host ms per part of a step, for plain steps and for each kind of verifying
step (read back at once; pipelined launch; the plain step that reads a pipelined one).

--quick: the tiny random-weight model, a few tokens: a smoke run in seconds.

--layer-skip 6,10,15,20: instead, how well would drafts from the target's own first
L layers and head (layer-skip self-speculation), or from a random-weight small model
with the same tokenizer, do? Each is measured offline, teacher-forced along the
target's greedy output for both prompt sets: q = how often the draft's next token
is the target's; tokens/step = 1 + q + ... + q^k for k = 4 drafts (each accepted
only after the ones before it; independence assumed); est. speedup = tokens/step /
(1 + k L / layers), drafting costing its share of the layers per token.

  python -m bench speculate                          # B=1,8; both prompt sets
  python -m bench speculate --save --hardware 2026-12-02-cpu2
"""

from __future__ import annotations

import asyncio
import statistics
import sys

from . import common
from .common import log, pc
from .prompts_speculate import COPY, FREE

NAME, RESULT, TITLE = "speculate", "speculate", "Speculative decoding: prompt lookup"


async def _wave(eng, prompts, n, spec):
    t0 = pc()
    rows = [eng.submit(p, max_tokens=n, speculate=spec) for p in prompts]
    res = [await r for r in rows]
    return rows, res, pc() - t0


async def _paired(eng, prompts, B, n, rnd=0):
    """All prompts, B at a time, each wave run without speculation and with it, in an
    order that alternates wave by wave and round by round (so a busy host's drift
    and the first meeting of a shape hit both alike): per setting, decode tok/s,
    proposed and accepted drafts, tokens per step, token lists."""
    sp = eng._exec.spec
    acc = {s: dict(prop=0, acc=0, steps=[], toks=[], errors=[], wide=0, sync=0)
           for s in (None, "lookup")}
    for i in range(0, len(prompts), B):
        for spec in common.in_turn([None, "lookup"], rnd + i // B):
            a = acc[spec]
            before, wide0, sync0 = len(eng.steps), sp.wide, sp.sync
            rows, res, _ = await _wave(eng, prompts[i:i + B], n, spec)
            a["errors"] += [r.error for r in rows if r.finish_reason == "error"]
            a["prop"] += sum(r.draft_proposed for r in rows)
            a["acc"] += sum(r.draft_accepted for r in rows)
            a["toks"] += [r.tokens for r in rows]
            # decode-only steps: what they emitted over the time they took
            a["steps"] += [s for s in eng.steps[before:]
                           if s.batch_size and not s.prefill_tokens]
            a["wide"] += sp.wide - wide0
            a["sync"] += sp.sync - sync0
    out = []
    for spec in (None, "lookup"):
        a = acc[spec]
        steps, errors, wide, sync = a["steps"], a["errors"], a["wide"], a["sync"]
        ntok, secs = sum(s.tokens for s in steps), sum(s.dt_s for s in steps)
        per_row = sum(s.tokens / s.batch_size for s in steps)
        out.append(dict(
            tok_s=ntok / secs if secs else 0.0, tokens=ntok, proposed=a["prop"],
            accepted=a["acc"], tok_per_step=per_row / max(len(steps), 1), toks=a["toks"],
            pipelined=wide / (wide + sync) if wide + sync else 0.0,
            policy=_policy(sp, B, steps, wide, sync) + (
                f"; ROWS FAILED: {len(errors)}, e.g. {errors[0]}" if errors else "")))
    return out


def _policy(sp, B, steps, wide, sync) -> str:
    """What the speculation policy saw and chose in a pass (one line)."""
    t = sp.times
    ms = lambda x: f"{x * 1e3:.1f}" if x else "-"  # noqa: E731
    verify = " ".join(f"W{w}:{ms(x)}" for w, x in sorted(t.verify.get(B, {}).items()))
    ways = " ".join(f"{k}:{v[0]:.0f}tok/s/{v[1]}" for k, v in t._ways.get(B, {}).items()
                    if v[0] is not None)
    plain = [s.dt_s for s in steps if not s.drafted]
    spec = [s.dt_s for s in steps if s.drafted]
    return (f"steps {len(steps)}, with drafts read {len(spec)} (mean {ms(sum(spec) / len(spec)) if spec else '-'} ms, "
            f"others {ms(sum(plain) / len(plain)) if plain else '-'} ms); verifications "
            f"pipelined {wide}, read back {sync}; guard holds so far {t.holds}; "
            f"policy's times at B={B}: plain {ms(t.plain.get(B))} ms, verify {verify or '-'} "
            f"ms; ways {ways or '-'}")


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", default=[1, 8], type=common.counts,
                    help="batch sizes (default 1,8)")
    ap.add_argument("--new", type=common.count, default=128, help="max tokens per row")
    ap.add_argument("--repeat", type=common.count, default=2, help="rounds (best of each)")
    ap.add_argument("--sets", default=["copy", "free"], type=common.names(["copy", "free"]))
    ap.add_argument("--layer-skip", metavar="L,L", default=None, type=common.counts,
                    help="measure layer-skip and random drafts offline instead")
    ap.add_argument("--quick", action="store_true",
                    help="tiny random-weight model, few tokens: a smoke run")
    ap.add_argument("--way", choices=("wide", "sync"), default=None,
                    help="verify only pipelined (wide) or read back at once (sync); "
                         "default: the policy's choice by measured speed")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="then where a step's host time goes at batch B (copy prompts)")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    import mlxnb

    if args.quick:
        from mlxnb.models.tiny import tiny_model

        model = tiny_model()
        common.quick(ap, args, argv, new=24, repeat=1, batch=[1, 4])
    else:
        model = args.model
    # speculating by default: on CUDA the engine then compiles the verification
    # attention kernel at load (rows still say speculate=None or "lookup" each)
    eng = mlxnb.Engine(model, kv_budget=None, prefix_cache=None, speculate="lookup")
    eng._exec.spec.times.only = args.way
    sets = {"copy": COPY, "free": FREE}
    if args.layer_skip:
        return layer_skip(eng, sets, args, argv)
    batches = args.batch
    report = common.Report(NAME, RESULT, TITLE, args, argv or [])
    lines = ["| prompts | B | off tok/s | lookup tok/s | speedup | per round | accept | "
             "tok/step | pipelined | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    data, policy = [], ["", f"Engine: {eng.cache_kinds}", "",
                        "What the policy saw (lookup runs):", ""]
    log(policy[1])
    for name in args.sets:
        prompts = sets[name]
        for B in batches:
            eng_run(eng, prompts[:B], B, args.new)  # untimed: both settings meet B first
            rounds = []
            for rnd in range(args.repeat):
                off, on = eng_run(eng, prompts, B, args.new, rnd)
                rounds.append((off, on))
            best_off = max(r[0]["tok_s"] for r in rounds)
            best_on = max(r[1]["tok_s"] for r in rounds)
            ratios = [r[1]["tok_s"] / r[0]["tok_s"] for r in rounds if r[0]["tok_s"]]
            ratio = statistics.median(ratios) if ratios else float("nan")
            on = rounds[-1][1]
            rate = on["accepted"] / on["proposed"] if on["proposed"] else 0.0
            same = all(r[0]["toks"] == r[1]["toks"] for r in rounds)
            row = dict(prompts=name, B=B, off=best_off, on=best_on, speedup=ratio,
                       ratios=ratios, accept=rate, tok_per_step=on["tok_per_step"],
                       pipelined=on["pipelined"], same=same)
            data.append(row)
            each = ", ".join(f"{x:.2f}" for x in ratios)
            line = (f"| {name} | {B} | {best_off:.1f} | {best_on:.1f} | {ratio:.2f}x | "
                    f"{each} | {rate:.0%} | {on['tok_per_step']:.2f} | {on['pipelined']:.0%} | "
                    f"{same} |")
            lines.append(line)
            log(line)
            policy.append(f"- {name} B={B} (last round): {on['policy']}")
            log(policy[-1])
            report.write("\n".join(lines) + NOTE + "\n".join(policy) + "\n",
                         dict(rows=data))
    prof = []
    if args.profile:
        prof = ["", f"## Where a step goes at B={args.profile} (copy prompts, host ms)", "",
                profile(eng, COPY, args.profile, args.new)]
        log(prof[-1])
        report.write("\n".join(lines) + NOTE + "\n".join(policy + prof) + "\n",
                     dict(rows=data))
    eng.close()
    print("\n".join(lines + policy + prof))
    return 0


def eng_run(eng, prompts, B, n, rnd=0):
    return eng_loop().run_until_complete(_paired(eng, prompts, B, n, rnd))


_LOOP = None


def eng_loop():
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_LOOP)
    return _LOOP


# a decode-only tick's kind, by the timing hooks it reported (first match)
KINDS = [("verify, read back", "verify.wait"), ("pipelined verify launch", "wide.fwd_build"),
         ("reads a pipelined one", "wide.read_wait"), ("plain", "launch")]


def profile(eng, prompts, B, n) -> str:
    """Mean host ms per part of decode-only steps, by kind of step (KINDS), over one
    pass of `prompts` at batch B with speculation off and one with it on."""
    from .tracing import EngineProfiler

    streak, eng.streak_s = eng.streak_s, 0.0
    by = {}
    try:
        for spec in (None, "lookup"):
            prof = EngineProfiler()
            prof.attach(eng)
            for i in range(0, len(prompts), B):
                eng_loop().run_until_complete(_wave(eng, prompts[i:i + B], n, spec))
            prof.detach(eng)
            for t in prof.ticks:
                if t.get("n.prefill_tokens") or not t.get("n.decoded"):
                    continue
                kind = next((k for k, key in KINDS if key in t), None)
                if kind is not None:
                    label = kind + (" (speculation off)" if spec is None else "")
                    by.setdefault(label, []).append(t)
    finally:
        eng.streak_s = streak
    labels = [k for k in by if "off" in k] + [k for k in by if "off" not in k]
    # tick.rest subtracts the plain step's parts only: not a verifying step's rest
    keys = sorted({k for ts in by.values() for t in ts for k in t
                   if k not in ("t0", "tick.rest")},
                  key=lambda k: (k.startswith("n."), k))
    out = ["| part | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|",
           "| ticks | " + " | ".join(str(len(by[k])) for k in labels) + " |"]
    for key in keys:
        cells = []
        for k in labels:
            xs = [t.get(key, 0.0) for t in by[k]]
            m, med = statistics.mean(xs), statistics.median(xs)
            cells.append(f"{m:.2f}" if key.startswith("n.") else
                         f"{1e3 * m:.2f} / {1e3 * med:.2f}")
        out.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(out) + (
        "\n\nn.*: counts per tick (n.width: positions per row verified), means; the "
        "rest ms per tick, mean / median (a shape's first verification may pay one-off "
        "setup: the median is the steady cost); parts nest (verify.read_inflight holds "
        "that read's read.*).")


NOTE = """

speedup: median over rounds of lookup tok/s / off tok/s (each round runs both); per
round: each round's ratio, in order (their spread is the host's drift); tok/s columns:
the best round. accept: accepted drafts / drafts verified. tok/step: tokens each row
took per decode step (lookup run; 1.00 without speculation).
pipelined: verifying steps launched without a read of the step in flight (the rest
read back at once). same tokens: the two runs' outputs are identical (greedy).
"""


def _agreement(model, seqs, starts, layers=None):
    """How often the model (or its first `layers` layers and head) predicts the
    next token of each sequence from `start` on, teacher-forced."""
    import mlx.core as mx

    inner = model.model
    full = inner.layers
    hit = total = 0
    try:
        if layers is not None:
            inner.layers = full[:layers]
        for ids, start in zip(seqs, starts):
            pred = mx.argmax(model(mx.array([ids]))[0], axis=-1).tolist()
            for t in range(start, len(ids) - 1):
                hit += pred[t] == ids[t + 1]
                total += 1
    finally:
        inner.layers = full
    return hit / max(total, 1)


async def _one(eng, prompt, n):
    return await eng.submit(prompt, max_tokens=n)


def layer_skip(eng, sets, args, argv):
    from mlxnb.models.tiny import tiny_model

    k = 4
    n_layers = len(eng.model.model.layers)
    report = common.Report(NAME, "speculate-drafts", "Drafts for speculation: layer-skip "
                           "and a random small model", args, argv or [])
    lines = ["| prompts | draft | q | tokens/step (k=4) | est. speedup |",
             "|---|---|---|---|---|"]
    rnd = tiny_model("smollm2")[0]
    for name, prompts in sets.items():
        seqs, starts = [], []
        for p in prompts:
            ids = eng.encode(p)
            out = eng_loop().run_until_complete(_one(eng, p, args.new))
            seqs.append(ids + list(out.tokens))
            starts.append(len(ids) - 1)
        check = _agreement(eng.model, seqs, starts)  # the target against itself
        cands = [(f"first {L} of {n_layers} layers", L, eng.model)
                 for L in args.layer_skip]
        cands.append(("random 2-layer model", None, rnd))
        for label, L, m in cands:
            q = _agreement(m, seqs, starts, L)
            toks = sum(q ** j for j in range(k + 1))
            share = (L / n_layers) if L else 0.02
            line = (f"| {name} | {label} | {q:.2f} | {toks:.2f} | "
                    f"{toks / (1 + k * share):.2f}x |")
            lines.append(line)
            log(line)
        lines.append(f"| {name} | (target itself: check) | {check:.2f} | | |")
        report.write("\n".join(lines))
    eng.close()
    print("\n".join(lines))
    return 0

