"""python -m bench <name> [options]   (python -m bench <name> --help for its options)"""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures); the modules load only when run, so that the
# listing needs no MLX
BENCHMARKS = {
    "decode": ("decode", "decode tok/s: mlxnb's Engine vs mlx-lm's BatchGenerator vs a "
                         "bare MLX loop, per batch size (--profile B: per-step host time)"),
    "mixed": ("mixed", "rows joining in waves: aggregate tok/s and time to first token, "
                       "Engine vs BatchGenerator"),
    "cache-kinds": ("cache_kinds", "hybrid models (recurrent + attention layers) decode, "
                                   "and quantized-KV capacity and decode"),
    "kv-attention": ("kv_attention", "one layer's decode attention over a quantized KV "
                                     "cache: fused kernel vs dequantize vs bf16, us/call"),
    "recurrent-step": ("recurrent_step", "one recurrent layer's decode step: mlx-lm's code vs "
                                         "the compiled step; the gated delta rule's paths"),
    "structured-rows": ("structured_rows", "constrained rows (JSON schema, regex) vs free "
                                           "rows, and the token-mask time per step"),
    "cold-start": ("cold_start", "first vs second use of each piece of a step (MLX "
                                 "compiling kernels on first use)"),
    "first-token": ("first_token", "a new process's Engine() and first tokens, with an "
                                   "empty or a shared cache (--fresh)"),
    "remote": ("remote", "mlxnb.connect vs a plain httpx client against one mlx_lm.server"),
    "widget-traffic": ("widget_traffic", "the live widget's messages/s, bytes per token "
                                         "and time on the kernel's loop"),
    "browser-latency": ("browser_latency", "a trivial cell's latency from a real browser "
                                           "while 32 rows stream into an open token view"),
    "speculate": ("speculate", "speculative decoding (prompt lookup) off vs on: decode "
                               "tok/s, acceptance and tokens per step, copy-heavy and "
                               "free-form prompts (--quick: a smoke run)"),
    "verify-cost": ("verify_cost", "a verification forward's cost by width, synchronous: "
                                   "matmuls by rows, the model's forward at W positions"),
    "speculate-draft": ("speculate_draft", "speculative decoding with a draft model "
                                           "(layer-skip layers:N, a random model, or a "
                                           "model): decode tok/s, acceptance, tok/step"),
    "token-probs": ("token_probs", "decode tok/s with rows keeping no logprobs, the "
                                   "chosen token's, the top 5 (the token view's cost)"),
    "adapters": ("adapters", "rows under different LoRA adapters in one batch vs base "
                             "rows: decode tok/s, and the adapters' memory"),
    "reliability": ("reliability", "a stalled load, load/unload cycles, memory per "
                                   "finished row, detokenizing cost"),
}


def usage() -> str:
    w = max(map(len, BENCHMARKS))
    return "\n".join([__doc__.strip(), "", "benchmarks:"]
                     + [f"  {k:<{w}}  {v[1]}" for k, v in BENCHMARKS.items()]
                     + ["", "Results: --save writes bench/results/<result>-<date>-<hardware>.md "
                        "(see bench/README.md)."])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f".{BENCHMARKS[name][0]}", __package__)
    return mod.main(rest, prog=f"python -m bench {name}") or 0


if __name__ == "__main__":
    sys.exit(main())
