"""`mlxnb demo` (or `python -m mlxnb demo`): batched generation on the bundled model,
no Jupyter needed.

`mlxnb install-kernel` writes a Jupyter kernel spec whose environment puts
OpenBLAS under MLX on Linux (for notebooks that import mlx before mlxnb).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import mlxnb  # first: it puts OpenBLAS in front of MLX's BLAS on Linux

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name five fruits.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "What is 12 + 7?",
    "Give me three tips for learning to code.",
]


# The live status line shows each row's state cut to four letters.
STATE_LEGEND = ("queu = queued (waiting for room in the batch), pref = prefill (reading "
                "its prompt), deco = decoding; then how it finished: stop (end of text), "
                "leng = length (hit --max-tokens), canc = cancelled, erro = error")


async def demo(args) -> int:
    from .models import blas as _blas

    print(f"mlxnb {mlxnb.__version__} | BLAS: {_blas.status}")
    print(f"loading {args.model} (the first load converts and warms up: up to a minute)")
    t = time.perf_counter()
    eng = mlxnb.Engine(args.model, max_batch=args.max_batch, kv_budget=args.kv_budget)
    print(f"loaded {eng.model_name} in {time.perf_counter() - t:.1f}s")
    prompts = args.prompt or DEMO_PROMPTS
    t = time.perf_counter()
    first = eng.generate(prompts[: len(prompts) // 2 or 1], max_tokens=args.max_tokens)
    await asyncio.sleep(0.5)  # the rest join the running batch
    second = eng.generate(prompts[len(prompts) // 2 or 1:], max_tokens=args.max_tokens)
    last = ""
    if sys.stdout.isatty():
        print(f"  one column per row, in submit order: {STATE_LEGEND}")
    while not (first.done and second.done):
        states = [r.finish_reason or r.state for r in eng.rows]
        line = (f"\r  step {len(eng.steps):4d}  batch {eng.running:2d}  "
                f"tokens {sum(r.ntok for r in eng.rows):5d}  rows "
                + " ".join(s[:4] for s in states))
        if line != last and sys.stdout.isatty():
            print(line, end="", flush=True)
            last = line
        await asyncio.sleep(0.1)
    wall = time.perf_counter() - t
    if last:
        print()
    rows = list(first) + list(second)
    for r in rows:
        text = "\n    ".join(r.text.strip().splitlines())  # every line under its prompt
        print(f"\n[{r.id}] {r.prompt}\n    {text}")
        tok_s = f"{r.tok_s:.1f}" if r.tok_s else "-"
        print(f"    -- {r.finish_reason}, {r.ntok} tokens, ttft {r.ttft_s:.2f}s, "
              f"{tok_s} tok/s, prompt {r.prompt_tokens} ({r.cached_tokens} cached)")
    total = sum(r.ntok for r in rows)
    peak = max(s.batch_size for s in eng.steps)
    print(f"\n{len(rows)} rows, {total} tokens in {wall:.1f}s = {total / wall:.1f} tok/s "
          f"aggregate; peak batch {peak}; {len(eng.steps)} steps")
    await eng.aclose()
    return 0 if all(r.finish_reason in ("stop", "length") for r in rows) else 1


def install_kernel(args) -> int:
    import tempfile

    from jupyter_client.kernelspec import KernelSpecManager

    from .models.blas import blas_env

    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": args.display_name,
        "language": "python",
        "env": blas_env(),
    }
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "kernel.json"), "w") as f:
            json.dump(spec, f, indent=1)
        dest = KernelSpecManager().install_kernel_spec(
            d, args.name, user=not args.sys_prefix, prefix=sys.prefix if args.sys_prefix else None)
    print(f"installed kernel spec {args.name!r} in {dest}")
    return 0


def main(argv=None) -> int:
    # The console script and `python -m mlxnb` run the same main(); usage names the one used.
    as_module = os.path.basename(sys.argv[0]) == "__main__.py"
    p = argparse.ArgumentParser(prog="python -m mlxnb" if as_module else "mlxnb")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate a few rows batched on the default model")
    d.add_argument("--model", default="default")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--max-batch", type=int, default=32)
    d.add_argument("--kv-budget", default="2GB")
    d.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    k = sub.add_parser("install-kernel", help="a Jupyter kernel spec with OpenBLAS env")
    k.add_argument("--name", default="mlxnb")
    k.add_argument("--display-name", default="Python 3 (mlxnb)")
    k.add_argument("--sys-prefix", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        try:
            return asyncio.run(demo(args))
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return install_kernel(args)


if __name__ == "__main__":
    sys.exit(main())
