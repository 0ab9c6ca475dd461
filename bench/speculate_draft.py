"""Draft-model speculation: decode with speculate=None vs speculate="draft", per draft.

The real default model (or --model) is the target, greedy, chat prompts: half
copy-heavy, half free-form (bench/prompts_speculate.py). Each draft in --draft gets
an engine of its own (`Engine(model, draft_model=...)`); per batch size B the same
rows run B at a time without speculation and with speculate="draft", in an order
that alternates wave by wave, --repeat rounds after one untimed pair of waves at
that B. Greedy outputs are token-identical, so both runs decode
the same tokens.

Drafts: `layers:N` (the target's own first N layers with its norm and head:
layer-skip self-speculation, no second model), `random` (a random-weight 2-layer
model with the target's tokenizer: a useless draft, whose rows must switch drafting
off and cost at most a few probes), or a model name/path sharing the tokenizer.

  decode tok/s   tokens read back in decode-only steps / the summed time of those
                 steps (a row's draft prefill runs in such a step: it counts)
  wall tok/s     all tokens / the rows' wall time (prefill included)
  accept         drafts kept / drafts verified
  tok/step       tokens each row took per decode-only step (draft run)
  drafting       share of the draft run's decode steps that verified drafts

  python -m bench speculate-draft --draft layers:8,random --batch 1,8
  python -m bench speculate-draft --quick          # the tiny model: a smoke run
"""

from __future__ import annotations

import statistics
import sys

from . import common
from .common import log, pc
from .prompts_speculate import COPY, FREE
from .speculate import eng_loop

NAME, RESULT, TITLE = "speculate-draft", "speculate-draft", "Speculative decoding: a draft model"


async def _wave(eng, prompts, n, spec):
    """One wave of rows together: its decode-only steps' (tokens, seconds, per-row
    tokens per step, steps, drafting steps), wall seconds, tokens, drafts, outputs."""
    before = len(eng.steps)
    t0 = pc()
    rows = [eng.submit(p, max_tokens=n, speculate=spec) for p in prompts]
    res = [await r for r in rows]
    wall = pc() - t0
    steps = [s for s in eng.steps[before:] if s.batch_size and not s.prefill_tokens]
    plain = sorted(s.dt_s for s in steps if not s.drafted)
    # the same tokens at this wave's own plain-step time (the load drifts; a wave's
    # plain steps share its drafting steps' conditions): estimated time without drafts
    # / the time taken
    secs = sum(s.dt_s for s in steps)
    in_run = (sum(s.tokens / s.batch_size for s in steps) * plain[len(plain) // 2] / secs
              if plain and secs else None)
    return dict(in_run=in_run, tokens=sum(s.tokens for s in steps), secs=sum(s.dt_s for s in steps),
                per_row=sum(s.tokens / s.batch_size for s in steps), steps=len(steps),
                drafting=sum(1 for s in steps if s.drafted), wall=wall,
                total=sum(len(r.tokens) for r in res),
                proposed=sum(r.draft_proposed for r in res),
                accepted=sum(r.draft_accepted for r in res), toks=[r.tokens for r in res])


async def _pairs(eng, prompts, B, n, rnd=0):
    """Each wave of B rows without speculation and at once with it, in an order that
    alternates wave by wave and round by round (the machine's load drifts: a pair
    shares it, and neither always goes first): [(off, on)] per wave."""
    out = []
    for i in range(0, len(prompts), B):
        ps = prompts[i:i + B]
        got = {spec: await _wave(eng, ps, n, spec)
               for spec in common.in_turn([None, "draft"], rnd + i // B)}
        out.append((got[None], got["draft"]))
    return out


def _ratio(pairs, key) -> float:
    """The median over wave pairs of on / off (robust to the load drifting between
    pairs); NaN where no pair measured both."""
    rs = [_sum([on])[key] / _sum([off])[key] for off, on in pairs if _sum([off])[key]]
    return statistics.median(rs) if rs else float("nan")


def _sum(waves) -> dict:
    t = {k: sum(w[k] for w in waves) for k in ("tokens", "secs", "per_row", "steps",
                                                  "drafting", "wall", "total", "proposed",
                                                  "accepted")}
    return dict(tok_s=t["tokens"] / t["secs"] if t["secs"] else 0.0,
                wall_tok_s=t["total"] / t["wall"] if t["wall"] else 0.0,
                tok_per_step=t["per_row"] / max(t["steps"], 1),
                drafting=t["drafting"] / max(t["steps"], 1),
                proposed=t["proposed"], accepted=t["accepted"])


def _x(r: float) -> str:
    return "-" if r != r else f"{r:.2f}x"


def _draft(spec: str, quick: bool):
    if spec == "random":
        from mlxnb.models.tiny import tiny_model

        return tiny_model("bytes" if quick else "smollm2", seed=7)
    return spec


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=["layers:8", "random"], type=lambda t: t.split(","),
                    help="drafts, comma-separated: layers:N, random, or a model")
    ap.add_argument("--batch", default=[1, 8], type=common.counts,
                    help="batch sizes (default 1,8)")
    ap.add_argument("--new", type=common.count, default=96, help="max tokens per row")
    ap.add_argument("--rows", type=common.count, default=8,
                    help="prompts per batch size (half copy-heavy, half free-form; "
                         "B=1 runs half as many)")
    ap.add_argument("--repeat", type=common.count, default=2, help="rounds over the prompts")
    ap.add_argument("--quick", action="store_true",
                    help="tiny random-weight model, few tokens: a smoke run")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    import mlxnb

    if args.quick:
        from mlxnb.models.tiny import tiny_model

        model = tiny_model(layers=4)
        common.quick(ap, args, argv, new=24, batch=[1, 4], draft=["layers:2", "random"])
    else:
        model = args.model
    half = max(args.rows // 2, 1)
    prompts = [p for pair in zip(COPY[:half], FREE[:half]) for p in pair]
    report = common.Report(NAME, RESULT, TITLE, args, argv or [])
    lines = ["| draft | B | off tok/s | draft tok/s | speedup | in-run | wall speedup | "
             "accept | tok/step | drafting | same tokens |", "|---|" * 1 + "---|" * 10]
    data = []
    for spec in args.draft:
        t0 = pc()
        eng = mlxnb.Engine(model, kv_budget=None, prefix_cache=None,
                           draft_model=_draft(spec, args.quick))
        log(f"engine with draft {spec}: {pc() - t0:.1f} s")
        for B in args.batch:
            ps = prompts if B > 1 else prompts[:max(len(prompts) // 2, 1)]
            # untimed: both settings meet this B's shapes first
            eng_loop().run_until_complete(_pairs(eng, ps[:B], B, args.new))
            pairs = []
            for rnd in range(args.repeat):
                pairs += eng_loop().run_until_complete(_pairs(eng, ps, B, args.new, rnd))
            off, on = _sum([p[0] for p in pairs]), _sum([p[1] for p in pairs])
            ratio, wall = _ratio(pairs, "tok_s"), _ratio(pairs, "wall_tok_s")
            best_off, best_on = off["tok_s"], on["tok_s"]
            rate = on["accepted"] / on["proposed"] if on["proposed"] else 0.0
            same = all(p[0]["toks"] == p[1]["toks"] for p in pairs)
            # the off wave's own value is its baseline: its first steps (a join, cold
            # shapes) are slower than its median step too
            ins = [p[1]["in_run"] / p[0]["in_run"] for p in pairs
                   if p[1]["in_run"] and p[0]["in_run"]]
            in_run = statistics.median(ins) if ins else float("nan")
            data.append(dict(draft=spec, B=B, off=best_off, on=best_on, speedup=ratio,
                             wall=wall, accept=rate, tok_per_step=on["tok_per_step"],
                             drafting=on["drafting"], same=same, in_run=in_run))
            line = (f"| {spec} | {B} | {best_off:.1f} | {best_on:.1f} | {_x(ratio)} | "
                    f"{_x(in_run)} | {_x(wall)} | {rate:.0%} of {on['proposed']} | "
                    f"{on['tok_per_step']:.2f} | {on['drafting']:.0%} | {same} |")
            lines.append(line)
            log(line)
            report.write("\n".join(lines) + NOTE, dict(rows=data))
        log(eng.status())
        eng.close()
    print("\n".join(lines))
    return 0


NOTE = """

speedup: the median over wave pairs (each wave of B rows runs without speculation,
then at once with it: the shared machine's load drifts, a pair shares it) of draft
tok/s / off tok/s in decode-only steps; wall speedup: the same for tokens / wall
time of the rows (prefill included). in-run: within each wave, the time its tokens
would take at that wave's median plain (non-verifying) step / the time they took,
the draft wave's over the off wave's (median over pairs): the draft's cost measured
under each wave's own load, which the paired runs on a machine shared with other
work cannot promise. tok/s columns: all
waves together. accept: drafts kept / drafts verified (and
how many were verified). tok/step: tokens each row took per decode step (draft run;
1.00 without speculation). drafting: share of the draft run's decode steps that
verified drafts (a row whose acceptance collapses stops drafting). same tokens: the
two runs' outputs are identical (greedy).
"""
