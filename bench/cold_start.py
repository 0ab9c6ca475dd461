"""Cold start: what each piece of a decode step costs the first time a process uses it.

MLX compiles kernels on first use (on CUDA: NVRTC, cached as PTX on disk under
MLX_PTX_CACHE_DIR, default <tmp>/mlx/<version>/ptx); point MLX_PTX_CACHE_DIR at an
empty folder to see a fresh machine. Prints first-call and second-call seconds per
piece at B=8, on random weights of a llama shape (default SmolLM2-135M's, bf16).
The mixed workload as a process's first work is `python -m bench mixed --passes 1`.

  MLX_PTX_CACHE_DIR=$(mktemp -d) python -m bench cold-start
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_top_k, make_logits_processors
from mlxnb.core.worker.sampling import BatchSampler, min_p_filter, top_p_filter

from . import common
from .common import log, pc

NAME, RESULT, TITLE = "cold-start", "cold-start", "Cold start: first use of each piece of a step"


def sampler(B, temp):
    s = BatchSampler()
    s.extend([temp] * B, [(0, 1.0, 0.0)] * B, list(range(B)), [0] * B)
    return s


def logprobs(logits, k):
    """The ops of a row's top-k logprobs: log-softmax, top-k ids, their order."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--shape", default="smollm2", choices=list(common.SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=common.DTYPES)
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    t = pc()
    model, _, V = common.build_model(args.shape, args.dtype)
    lines = [f"{args.shape} {args.dtype} built in {pc() - t:.2f} s; B=8"]
    log(lines[0])
    B = 8
    cache = make_prompt_cache(model)
    prompts = mx.random.randint(2, V, (B, 32))
    logits = mx.random.normal((B, V))
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    hist = mx.random.randint(0, V, (1, 20))
    mx.eval(prompts, logits, lp, hist)
    pieces = [
        ("prefill forward (B=8, 32 tokens)", lambda: model(prompts, cache=cache)),
        ("decode forward (B=8)", lambda: model(prompts[:, :1], cache=cache)),
        ("greedy sample (argmax)", lambda: sampler(B, 0.0).sample(logits)),
        ("temperature sample (Gumbel)", lambda: sampler(B, 0.8).sample(logits)),
        ("top-k 20", lambda: apply_top_k(lp, 20)),
        ("top-p 0.9", lambda: top_p_filter(lp, mx.array(0.9, dtype=mx.float32))),
        ("min-p 0.1", lambda: min_p_filter(lp, 0.1)),
        ("logprobs k=5", lambda: logprobs(logits, 5)),
        ("repetition penalty", lambda: make_logits_processors(
            repetition_penalty=1.1)[0](hist, logits[:1])),
    ]
    for name, fn in pieces:
        times = []
        for _ in range(2):
            t = pc()
            mx.eval(fn())
            times.append(pc() - t)
        lines.append(f"{name:36s} first {times[0]:8.3f} s   second {times[1]:8.4f} s")
        log(lines[-1])
    report.write("```\n" + "\n".join(lines) + "\n```")
    return 0
