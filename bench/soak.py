"""Soak test: the engine on the default model for N minutes under mixed traffic.

Waves of rows are submitted whenever the engine runs low on work: short questions,
long pasted contexts, shared system prompts (prefix reuse), greedy and seeded
sampling, stop strings, logprobs; a few rows are cancelled mid-flight and a few bad
submissions are made (they must raise ValueError). At the end every row must carry a
finish reason.

Reports: throughput (generated tok/s over the wall time, and decode tok/s over step
time), peak reported KV (max StepRecord.kv_bytes) against the budget, peak process
RSS, mx.get_peak_memory(), RSS drift between the first and last quarter, TTFT
percentiles, and rows by finish reason.

Exit status: 0 ok; 1 if any row is left without a finish reason; 2 if a row ended
with an unexpected 'error', a bad submission was accepted, or reported KV exceeded
the budget.

    python bench/soak.py                      # 3 minutes
    python bench/soak.py --minutes 1 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import mlxnb  # noqa: E402  (first: it puts OpenBLAS under MLX on Linux CPU)

QUESTIONS = [
    "What is the capital of France?", "Name five fruits.", "Why is the sky blue?",
    "Write one sentence about cats.", "Explain recursion to a child.",
    "List three uses of a paperclip.", "What is 17 times 23?",
    "Translate 'good morning' into Spanish.", "Give me a haiku about rain.",
    "Summarize the plot of Hamlet in two sentences.",
]
SYSTEMS = [None, None, "You are a concise assistant. Answer in one sentence.",
           "You are a pirate. Stay in character."]
PARAGRAPH = ("The committee met on Tuesday to review the quarterly figures. Revenue rose "
             "slightly, costs fell, and the new warehouse opened two weeks ahead of plan. ")
BAD = [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(logprobs=99),
       dict(max_tokens="ten")]


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mb(n):
    return None if n is None else round(n / 2**20, 1)


def make_row(rng: random.Random) -> tuple:
    kind = rng.random()
    if kind < 0.6:
        prompt = rng.choice(QUESTIONS)
    elif kind < 0.85:
        prompt = PARAGRAPH * rng.randint(2, 12) + "\n\nWhat happened to costs?"
    else:
        prompt = f"Continue this list: {', '.join(rng.sample(QUESTIONS, 3))}"
    kw = dict(max_tokens=rng.choice([8, 16, 32, 64, 96, 128]),
              system=rng.choice(SYSTEMS))
    if rng.random() < 0.4:
        kw.update(temperature=rng.choice([0.5, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]),
                  seed=rng.randrange(1 << 30))
    if rng.random() < 0.15:
        kw["stop"] = [rng.choice([".", "\n", " the "])]
    if rng.random() < 0.1:
        kw["logprobs"] = rng.choice([1, 3])
    return prompt, kw


async def soak(args) -> dict:
    import mlx.core as mx

    from mlxnb import Engine

    rng = random.Random(args.seed)
    t_load = time.perf_counter()
    eng = Engine(model=args.model, kv_budget=args.kv_budget, max_batch=args.max_batch,
                 prefill_chunk=args.prefill_chunk)
    load_s = time.perf_counter() - t_load
    mx.reset_peak_memory()
    rss0 = rss_bytes()
    rows, cancels, bad_accepted, bad_refused = [], [], 0, 0
    rss_samples = []  # (t, rss)
    stop_at = time.perf_counter() + args.minutes * 60
    t0 = time.perf_counter()
    next_report = t0 + args.report_every

    def line():
        el = time.perf_counter() - t0
        toks = sum(len(r.tokens) for r in rows)
        kv = max((s.kv_bytes for s in eng.steps), default=0)
        print(f"[{el:6.1f}s] rows {len(rows):5d} done {sum(r.done for r in rows):5d} "
              f"running {eng.running:3d} queued {eng.queued:3d} | {toks / max(el, 1e-9):7.1f} "
              f"tok/s | peak KV {mb(kv)} MB | RSS {mb(rss_bytes())} MB", flush=True)

    while time.perf_counter() < stop_at:
        if eng.queued + eng.running < 2 * args.max_batch:
            for _ in range(rng.randint(args.wave_min, args.wave_max)):
                prompt, kw = make_row(rng)
                row = eng.submit(prompt, **kw)
                rows.append(row)
                if rng.random() < args.cancel_rate:
                    cancels.append((row, time.perf_counter() + rng.uniform(0, 2.0)))
            if rng.random() < 0.2:  # a bad submission now and then: must be refused
                try:
                    rows.append(eng.submit("bad row", **rng.choice(BAD)))
                    bad_accepted += 1
                except ValueError:
                    bad_refused += 1
        now = time.perf_counter()
        for item in [c for c in cancels if c[1] <= now]:
            item[0].cancel()
            cancels.remove(item)
        rss_samples.append((now - t0, rss_bytes()))
        if now >= next_report:
            line()
            next_report += args.report_every
        await asyncio.sleep(0.05)

    submit_wall = time.perf_counter() - t0
    try:  # drain: no new rows; everything in flight must end
        await asyncio.wait_for(eng.wait(), args.drain_timeout)
        drained = True
    except asyncio.TimeoutError:
        drained = False
    wall = time.perf_counter() - t0
    line()
    unfinished = [r for r in rows if r.finish_reason is None]
    reasons = Counter(r.finish_reason for r in rows if r.finish_reason)
    errors = Counter((r.error or "")[:120] for r in rows if r.finish_reason == "error")
    gen_tokens = sum(len(r.tokens) for r in rows)
    steps = eng.steps
    decode_dt = sum(s.dt_s for s in steps if s.tokens)
    peak_kv = max((s.kv_bytes for s in steps), default=0)
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    q = max(1, len(rss_samples) // 4)
    rss_first = statistics.median(x for _, x in rss_samples[:q]) if rss_samples else None
    rss_last = statistics.median(x for _, x in rss_samples[-q:]) if rss_samples else None
    peak_rss_proc = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KB
    report = {
        "model": eng.model_name, "minutes": args.minutes, "load_s": round(load_s, 1),
        "kv_budget": eng.kv_budget, "max_batch": args.max_batch,
        "rows": len(rows), "finished_by_reason": dict(reasons), "unfinished": len(unfinished),
        "errors": dict(errors), "bad_refused": bad_refused, "bad_accepted": bad_accepted,
        "drained": drained, "wall_s": round(wall, 1), "submit_wall_s": round(submit_wall, 1),
        "generated_tokens": gen_tokens,
        "throughput_tok_s": round(gen_tokens / wall, 1),
        "decode_tok_s": round(sum(s.tokens for s in steps) / decode_dt, 1) if decode_dt else None,
        "steps": len(steps), "max_batch_seen": max((s.batch_size for s in steps), default=0),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "cached_prompt_tokens": sum(r.cached_tokens for r in rows),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "peak_kv_mb": mb(peak_kv), "kv_within_budget": eng.kv_budget is None or peak_kv <= eng.kv_budget,
        "rss_start_mb": mb(rss0), "rss_first_quarter_mb": mb(rss_first),
        "rss_last_quarter_mb": mb(rss_last), "peak_rss_mb": mb(max([peak_rss_proc] + [x for _, x in rss_samples])),
        "mx_peak_memory_mb": mb(mx.get_peak_memory()), "mx_active_after_mb": None,
    }
    await eng.aclose()
    report["mx_active_after_mb"] = mb(mx.get_active_memory())
    report["unfinished_rows"] = [repr(r) for r in unfinished[:10]]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-budget", default="512MB")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--wave-min", type=int, default=4)
    ap.add_argument("--wave-max", type=int, default=24)
    ap.add_argument("--cancel-rate", type=float, default=0.05)
    ap.add_argument("--drain-timeout", type=float, default=300.0)
    ap.add_argument("--report-every", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    report = asyncio.run(soak(args))
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if report["unfinished"]:
        print(f"FAIL: {report['unfinished']} rows without a finish reason", file=sys.stderr)
        return 1
    if report["errors"] or report["bad_accepted"] or not report["kv_within_budget"]:
        print("FAIL: unexpected errors, accepted bad input, or KV over budget", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: MLX's thread-local destructors on the engine's worker
    # thread can abort a finalizing interpreter (rc 134), which would hide our status.
    os._exit(code)
