"""Probe: the raw decode loop (engine_bench's `raw`) on mlx-lm's model as loaded vs
on a twin with fused q/k/v and gate/up projections (mlxnb/fuse.py). Same weights,
same prompts; methods alternate per round; decode tok/s per round and the median
ratio.

  python bench/fuse_probe.py --plan "smollm2:bfloat16:8,32,128 llama1b:bfloat16:8,128"
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxnb  # noqa: F401,E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from engine_bench import build_model, make_prompts, run_raw  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlxnb.core.worker.fuse import fuse_projections  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="smollm2:bfloat16:8,32,128")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    print(mx.default_device(), mx.__version__, flush=True)
    rng = np.random.default_rng(0)
    for item in a.plan.split():
        shape, dtype, bs = item.split(":")
        plain, _, V = build_model(shape, dtype)
        fused, _, _ = build_model(shape, dtype)
        n = fuse_projections(fused, lambda: fused(mx.array([[0]]),
                                                  cache=make_prompt_cache(fused)))
        for B in map(int, bs.split(",")):
            warm = make_prompts(rng, B, 64, V)
            run_raw(plain, warm, 16), run_raw(fused, warm, 16)
            tps = {"plain": [], "fused": []}
            for _ in range(a.rounds):
                p = make_prompts(rng, B, 64, V)
                tps["plain"].append(run_raw(plain, p, a.new)["decode_tps"])
                tps["fused"].append(run_raw(fused, p, a.new)["decode_tps"])
            ratio = statistics.median(f / p for f, p in zip(tps["fused"], tps["plain"]))
            print(f"{shape} {dtype} B={B} ({n} groups fused): plain "
                  f"{[round(x) for x in tps['plain']]} fused {[round(x) for x in tps['fused']]}"
                  f" -> fused/plain median {ratio:.2f}", flush=True)
        del plain, fused
        mx.clear_cache()


if __name__ == "__main__":
    main()
