"""Reliability figures: what a stalled load, repeated model loads and many finished
rows cost the rows and the memory of a long-lived kernel.

  python -m bench reliability stall    # decode rate of a running engine during (a) a
                                       # load stalled on the hub, (b) a second
                                       # Engine('default') built beside it (and its
                                       # rows' longest wait for a token then)
  python -m bench reliability cycles   # RSS of a real kernel over 5 x (%mlxnb load ->
                                       # %%generate -> await -> %mlxnb unload -> gc)
  python -m bench reliability rows     # bytes kept per finished row, handles dropped
  python -m bench reliability detok    # decode tok/s at B=32, tiny model with the
                                       # SmolLM2 tokenizer (what detokenizing every
                                       # row on the worker costs)

Prints one JSON line per figure (--save: results/reliability-<figure>-<hardware>.md).
`stall` and `cycles` use the default model.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import sys
import threading
import time

from . import common

NAME, TITLE = "reliability", "Reliability figures"

FIGURES = []  # the JSON lines printed, for the result file


def figure(out: dict) -> None:
    FIGURES.append(json.dumps(out))
    print(FIGURES[-1], flush=True)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def stalling_hub() -> str:
    """An endpoint that answers `HEAD /` (so it looks reachable) and nothing else:
    every hub API call stalls."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []

    def answer(c):
        try:
            if c.recv(65536).startswith(b"HEAD / "):
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
                          b"Connection: close\r\n\r\n")
        except OSError:
            pass

    def serve():
        while True:
            c = srv.accept()[0]
            held.append(c)
            threading.Thread(target=answer, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


async def rate(rows, seconds: float) -> float:
    n = sum(r.ntok for r in rows)
    t = time.perf_counter()
    await asyncio.sleep(seconds)
    return (sum(r.ntok for r in rows) - n) / (time.perf_counter() - t)


async def stall(args):
    import huggingface_hub.constants as hf

    from mlxnb import Engine

    url = stalling_hub()
    os.environ["HF_ENDPOINT"] = hf.ENDPOINT = url
    loop = asyncio.get_running_loop()
    eng = Engine("default", kv_budget=None)
    rows = [eng.submit(f"Tell a long story number {i}.", max_tokens=2000, temperature=0.8)
            for i in range(args.batch)]
    while not all(r.ntok > 2 for r in rows):
        await asyncio.sleep(0.05)
    out = {"figure": "decode tok/s of a running engine", "batch": args.batch,
           "before": round(await rate(rows, 3.0), 1)}
    t = time.perf_counter()
    task = asyncio.create_task(asyncio.to_thread(
        Engine, "someone/stalled-model", loop=loop, load_timeout=args.stall_s))
    out["during_stalled_load"] = round(await rate(rows, min(args.stall_s, 3.0)), 1)
    try:
        await task
    except Exception as e:
        out["stalled_load_error"] = " ".join(str(e).split())[:160]
    out["stalled_load_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    task = asyncio.create_task(asyncio.to_thread(Engine, "default", loop=loop,
                                                 kv_budget=None))
    # the running rows' rate, and the longest time none of them got a token: the new
    # engine's set-up runs as separate jobs on the shared worker, each one a pause
    n_start = n0 = sum(r.ntok for r in rows)
    last, gap = time.perf_counter(), 0.0
    while not task.done():
        await asyncio.sleep(0.005)
        n, now = sum(r.ntok for r in rows), time.perf_counter()
        if n != n0:
            n0, gap, last = n, max(gap, now - last), now
    gap = max(gap, time.perf_counter() - last)
    second = await task
    took = time.perf_counter() - t
    out["second_engine_load_s"] = round(took, 2)
    out["during_second_engine_load"] = round((n0 - n_start) / took, 1)
    out["longest_gap_s_during_second_engine_load"] = round(gap, 3)
    out["after"] = round(await rate(rows, 3.0), 1)
    eng.cancel_all()
    await second.aclose()
    await eng.aclose()
    figure(out)


def cycles(args):
    from jupyter_client import KernelManager

    # the kernel imports this checkout's mlxnb, installed or not
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(common.ROOT))
                                        if p)
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    said = []

    def run(code):
        said.clear()
        reply = kc.execute_interactive(
            code, timeout=600, output_hook=lambda m: said.append(
                m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(said)

    rss = "import gc, os; gc.collect(); print('RSS', int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20)"
    try:
        run("%load_ext mlxnb")
        base = float(run(rss).split()[-1])
        out = {"figure": "kernel RSS MB after load/generate/unload cycles",
               "before_first_load": round(base, 1), "after_cycle": [],
               "after_cycle_malloc_trim": []}
        for i in range(args.cycles):
            run("%mlxnb load default")
            run(f"%%generate -o run{i} --max-tokens 32\nWrite a haiku.\n"
                "Name three colours.\nCount to five.\nSay hello.")
            run(f"_ = await run{i}")
            run("%mlxnb unload")
            run("import mlxnb.notebook.magics; await mlxnb.notebook.magics.shutdown()")  # its aclose done
            out["after_cycle"].append(round(float(run(rss).split()[-1]), 1))
            # what of it is freed memory glibc has not handed back to the system
            run("import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)")
            out["after_cycle_malloc_trim"].append(round(float(run(rss).split()[-1]), 1))
        run("import mlxnb.core.engine as _e, gc as _g; gc_eng = sum(isinstance(o, _e.Engine) "
            "for o in _g.get_objects()); print('ENGINES', gc_eng)")
        out["engines_alive"] = int(said[-1].split()[-1]) if said else None
        out["growth_after_first"] = round(out["after_cycle"][-1] - out["after_cycle"][0], 1)
        figure(out)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


async def rows(args):
    import tracemalloc

    from mlxnb import Engine
    from mlxnb.models.tiny import tiny_model

    eng = Engine(tiny_model(), kv_budget=None, max_batch=64)
    await eng.generate(["warm"] * 64, chat=False, max_tokens=4)
    gc.collect()
    tracemalloc.start()
    points = []
    for k in range(args.thousands + 1):
        if k:
            for _ in range(10):
                await eng.generate([f"row {k}-{i}" for i in range(100)], chat=False,
                                   max_tokens=4)
        gc.collect()
        steps = len(eng.steps)
        points.append((tracemalloc.get_traced_memory()[0], rss_mb(), steps))
    tracemalloc.stop()
    heap = [b - a for (a, _, _), (b, _, _) in zip(points, points[1:])]
    steps = [b - a for (_, _, a), (_, _, b) in zip(points, points[1:])]
    figure({
        "figure": "memory kept per 1,000 finished rows, handles dropped",
        "heap_bytes_per_1000_rows": heap, "new_step_records_per_1000_rows": steps,
        "rss_mb": [round(r, 1) for _, r, _ in points], "rows_listed": len(eng.rows),
        "note": "step records are kept up to the engine's step history length"})
    await eng.aclose()


async def detok(args):
    from mlxnb import Engine
    from mlxnb.models.tiny import tiny_model

    eng = Engine(tiny_model(vocab="smollm2"), kv_budget=None, max_batch=args.batch)
    prompts = [f"prompt number {i}" for i in range(args.batch)]
    await eng.generate(prompts, chat=False, max_tokens=16)
    rates = []
    for _ in range(args.reps):
        t = time.perf_counter()
        res = await eng.generate(prompts, chat=False, max_tokens=args.tokens)
        rates.append(sum(len(r.tokens) for r in res) / (time.perf_counter() - t))
    figure({"figure": f"decode tok/s, tiny model + SmolLM2 tokenizer, B={args.batch}, "
                      f"{args.tokens} tokens",
            "tok_s_median": round(statistics.median(rates), 1),
            "tok_s_all": [round(r, 1) for r in rates]})
    await eng.aclose()


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("what", choices=["stall", "cycles", "rows", "detok"])
    ap.add_argument("--batch", type=common.count, default=8)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--cycles", type=common.count, default=5)
    ap.add_argument("--thousands", type=common.count, default=5)
    ap.add_argument("--tokens", type=common.count, default=256)
    ap.add_argument("--reps", type=common.count, default=5)
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    report = common.Report(NAME, f"reliability-{args.what}", TITLE, args, argv)
    if args.what == "cycles":
        cycles(args)
    else:
        asyncio.run({"stall": stall, "rows": rows, "detok": detok}[args.what](args))
    report.write("```\n" + "\n".join(FIGURES) + "\n```")
    return 0
