"""What the token view's probabilities cost: Engine decode tok/s with rows that keep
no logprobs, the chosen token's only (--logprobs 1 keeps it and the top one), and
the top 5, per batch size. Random-weight llama shapes (common.SHAPES), all rows at
once, no EOS; tok/s over the steps with every row decoding and no prefill, best of
--repeat interleaved rounds. One JSON line per (B, logprobs).

  python -m bench token-probs --quick
  python -m bench token-probs --shape smollm2 --dtype bfloat16 --batch 8,32,128 --save
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import mlxnb

from . import common

NAME, RESULT, TITLE = "token-probs", "token-probs", "Token view: the cost of probabilities"


async def one(model, tok, prompts, n, B, k):
    eng = mlxnb.Engine((model, tok), max_batch=B, kv_budget=None)
    try:
        await eng.generate([common.as_text(p) for p in prompts[:2]], max_tokens=8,
                           chat=False, logprobs=k)
        s0 = len(eng.steps)
        await eng.generate([common.as_text(p) for p in prompts], max_tokens=n, chat=False,
                           temperature=0.8, logprobs=k, seed=1)
        w = common.decode_window(eng.steps[s0:], B)
        return w["tps"] if w else 0.0
    finally:
        await eng.aclose()


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shape", default="smollm2", choices=list(common.SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=common.DTYPES)
    ap.add_argument("--batch", default=[8, 32], type=common.counts)
    ap.add_argument("--new", type=common.count, default=64)
    ap.add_argument("--repeat", type=common.count, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shape, seconds")
    common.add_output_args(ap)
    a = ap.parse_args(argv)
    if a.quick:
        common.quick(ap, a, argv, shape="tiny", dtype="float32", batch=[8], new=32, repeat=1)
    report = common.Report(NAME, RESULT, TITLE, a, argv)
    model, tok, vocab = common.build_model(a.shape, a.dtype)
    rng = np.random.default_rng(0)
    lines = []
    for B in a.batch:
        prompts = common.make_prompts(rng, B, 32, vocab)
        best = {}
        for _ in range(a.repeat):
            for k in (0, 1, 5):  # interleaved, so drift touches all alike
                tps = asyncio.run(one(model, tok, prompts, a.new, B, k))
                best[k] = max(best.get(k, 0.0), tps)
        for k in (0, 1, 5):
            lines.append(json.dumps({"shape": a.shape, "dtype": a.dtype, "B": B,
                                     "logprobs": k, "decode_tok_s": round(best[k], 1),
                                     "vs_none": round(best[k] / best[0], 3) if best[0] else None}))
            print(lines[-1], flush=True)
    report.write("```\n" + "\n".join(lines) + "\n```")
    return 0
