"""What each piece of a decode step costs the first time a process uses it.

MLX compiles kernels on first use (on CUDA: NVRTC, cached as PTX on disk under
MLX_PTX_CACHE_DIR, default <tmp>/mlx/<version>/ptx); point MLX_PTX_CACHE_DIR at an
empty folder to see a fresh machine. Prints first-call and second-call seconds per
piece, on SmolLM2-shaped random weights.

  MLX_PTX_CACHE_DIR=$(mktemp -d) python bench/first_use.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxnb  # noqa: F401,E402
import mlx.core as mx  # noqa: E402
from engine_bench import build_model  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p,  # noqa: E402
                                 make_logits_processors)
from mlxnb.core.worker.sampling import (_M2, BatchSampler, _gumbel_argmax, _u32,  # noqa: E402
                            gumbel_noise, top_logprobs)


def gumbel_eager(logits, temp, seeds, counters, vocab_ids):
    """The sampler's Gumbel-max step without mx.compile (~15 separate kernels)."""
    t = mx.where(temp > 0, temp, 1.0)[:, None]
    return mx.argmax(logits / t + gumbel_noise(seeds, counters, vocab_ids), axis=-1)


def gumbel_args(B, V):
    return (mx.random.normal((B, V)), mx.full((B,), 0.8), mx.arange(B).astype(mx.uint32),
            mx.zeros((B,), mx.uint32), mx.arange(V, dtype=mx.uint32) * _u32(_M2))


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    t = time.perf_counter()
    model, _, V = build_model(shape, "bfloat16")
    print(f"{mx.default_device()} mlx {mx.__version__}; {shape} built in "
          f"{time.perf_counter() - t:.2f} s", flush=True)
    B = 8
    cache = make_prompt_cache(model)
    prompts = mx.random.randint(2, V, (B, 32))
    logits = mx.random.normal((B, V))
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    hist = mx.random.randint(0, V, (1, 20))
    mx.eval(prompts, logits, lp, hist)

    def greedy_sampler():
        s = BatchSampler()
        s.extend([0.0] * B, [(0, 1.0, 0.0)] * B, [0] * B, [0] * B)
        return s

    def temp_sampler():
        s = BatchSampler()
        s.extend([0.8] * B, [(0, 1.0, 0.0)] * B, list(range(B)), [0] * B)
        return s

    g8 = gumbel_args(B, V)
    mx.eval(g8)
    pieces = [
        ("prefill forward (B=8, 32 tokens)", lambda: model(prompts, cache=cache)),
        ("Gumbel step, eager (no mx.compile)", lambda: gumbel_eager(*g8)),
        ("decode forward (B=8)", lambda: model(prompts[:, :1], cache=cache)),
        ("greedy sample (argmax)", lambda: greedy_sampler().sample(logits)),
        ("temperature sample (Gumbel)", lambda: temp_sampler().sample(logits)),
        ("top-k 20", lambda: apply_top_k(lp, 20)),
        ("top-p 0.9", lambda: apply_top_p(lp, 0.9)),
        ("min-p 0.1", lambda: apply_min_p(lp, 0.1)),
        ("logprobs k=5", lambda: top_logprobs(logits, mx.argmax(logits, -1), 5)),
        ("repetition penalty", lambda: make_logits_processors(
            repetition_penalty=1.1)[0](hist, logits[:1])),
    ]
    for name, fn in pieces:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t)
        print(f"{name:36s} first {times[0]:8.3f} s   second {times[1]:8.4f} s", flush=True)
    # steady state: what the compiled kernel saves per sampled step
    for b in (8, 128):
        args = gumbel_args(b, V)
        mx.eval(args)
        for name, fn in (("compiled", _gumbel_argmax), ("eager", gumbel_eager)):
            for _ in range(3):
                mx.eval(fn(*args))
            t = time.perf_counter()
            for _ in range(50):
                mx.eval(fn(*args))
            ms = (time.perf_counter() - t) / 50 * 1e3
            print(f"Gumbel step B={b:<4d} {name:9s} {ms:7.3f} ms per call (eval each)",
                  flush=True)


if __name__ == "__main__":
    main()
