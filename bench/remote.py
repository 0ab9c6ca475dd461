"""mlxnb's overhead as a client: N rows against one mlx_lm.server, sent through
`mlxnb.connect` and by a plain async httpx client, alternating.

Both send the same request bodies (streaming chat completions, greedy, the same
max_tokens) with the same number of requests open at once, and count tokens the same
way (the server's usage count). Aggregate tok/s = completion tokens / wall time from
the first request to the last row's end. After an untimed pass of each, passes run
in pairs whose order alternates (plain, mlxnb; mlxnb, plain; ...) so machine drift
and warm state hit both alike; the table gives each pass and the median ratio, and the
client process's CPU time per token (the overhead itself, which the server's speed
does not blur; the client's connection pool and the server share the machine).

  python -m bench remote                       # tiny random model, 256 rows
  python -m bench remote --model default --rows 64 --max-tokens 64
  python -m bench remote --url http://host:8000/v1   # a server already running
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import httpx

import mlxnb
from mlxnb.models.blas import blas_env

from . import common

NAME, RESULT, TITLE = "remote", "remote-client", "mlxnb.connect vs a plain httpx client"


@contextlib.contextmanager
def server(model_dir: str, concurrency: int):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="mlx_lm_server_", suffix=".log", delete=False)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.update(blas_env(env))  # OpenBLAS under the server's MLX too (Linux CPU)
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                             "--port", str(port), "--decode-concurrency", str(concurrency),
                             "--prompt-concurrency", str(concurrency), "--log-level", "WARNING"],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"mlx_lm.server exited; see {log.name}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield url + "/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


RETRIES = {"plain": 0, "mlxnb": 0}


def prompts(n):
    return [f"Row {i}: write a short note about the number {i}." for i in range(n)]


async def plain(url, model, rows, max_tokens, concurrency):
    """The baseline: what a user would write with httpx and a semaphore."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:

        async def one(p):
            body = {"stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": p}]}
            if model:
                body["model"] = model
            async with sem:
                for attempt in range(6):
                    n, text = 0, []
                    try:
                        async with http.stream("POST", url + "/chat/completions",
                                               json=body) as r:
                            r.raise_for_status()
                            async for line in r.aiter_lines():
                                if not line.startswith("data:") or line.endswith("[DONE]"):
                                    continue
                                obj = json.loads(line[5:])
                                for ch in obj.get("choices") or ():
                                    text.append((ch.get("delta") or {}).get("content") or "")
                                if obj.get("usage"):
                                    n = obj["usage"]["completion_tokens"]
                        return n
                    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                        if text:
                            raise
                        # the same policy as mlxnb's: a burst of new connections gets
                        # some reset by mlx_lm.server (a listen backlog of 5)
                        RETRIES["plain"] += 1
                        await asyncio.sleep(min(8.0, 0.1 * 2 ** attempt)
                                            * (0.5 + random.random() / 2))
                raise RuntimeError("a request failed 6 times")

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts(rows)))
        return sum(counts), time.perf_counter() - t0


async def through_mlxnb(url, model, rows, max_tokens, concurrency):
    eng = mlxnb.connect(url, model=model, max_concurrency=concurrency)
    t0 = time.perf_counter()
    run = eng.generate(prompts(rows), max_tokens=max_tokens)
    res = await run
    wall = time.perf_counter() - t0
    bad = [r for r in res if r.finish_reason not in ("stop", "length")]
    assert not bad, bad[0]
    n = sum(r.ntok for r in run.rows)
    RETRIES["mlxnb"] += eng.client.retried
    await eng.aclose()
    return n, wall


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--url", help="an OpenAI-compatible server already running")
    ap.add_argument("--model", default="tiny",
                    help="tiny (random weights, built here), default, or an mlx-lm dir")
    ap.add_argument("--rows", type=common.count, default=256)
    ap.add_argument("--max-tokens", type=common.count, default=64)
    ap.add_argument("--concurrency", type=common.count, default=32)
    ap.add_argument("--passes", type=common.count, default=5, help="pairs of passes (plain, mlxnb)")
    common.add_output_args(ap)
    a = ap.parse_args(argv)
    report = common.Report(NAME, RESULT, TITLE, a, argv)

    with contextlib.ExitStack() as stack:
        if a.url:
            url, model = a.url, None
        else:
            if a.model == "tiny":
                from mlxnb.models.tiny import save_tiny_model

                d = str(save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory())
                                        + "/tiny"))
            elif a.model == "default":
                from mlxnb.models.loading import default_model_path

                d = str(default_model_path())
            else:
                d = a.model
            url = stack.enter_context(server(d, a.concurrency))
            model = None
        args = (url, model, a.rows, a.max_tokens, a.concurrency)
        # warm-up, both clients: the server's first requests, and each client's imports
        # and first connection, land in no timed pass
        for fn in (plain, through_mlxnb):
            asyncio.run(fn(url, model, min(a.rows, a.concurrency), 8, a.concurrency))
        res = {"plain": [], "mlxnb": []}
        for i in range(a.passes):  # in an order that alternates: neither always goes first
            for name, fn in common.in_turn([("plain", plain), ("mlxnb", through_mlxnb)], i):
                c0 = time.process_time()
                n, wall = asyncio.run(fn(*args))
                cpu = time.process_time() - c0
                res[name].append((n, wall, cpu))
                print(f"{name:6s} {n:7d} tokens {wall:7.2f} s {n / wall:9.1f} tok/s, client CPU "
                      f"{1000 * cpu / n:.3f} ms per token", flush=True)
    ratios = [(m[0] / m[1]) / (p[0] / p[1]) for p, m in zip(res["plain"], res["mlxnb"])]
    L = [f"rows {a.rows}, max_tokens {a.max_tokens}, concurrency {a.concurrency}, "
         f"model {a.model if not a.url else a.url}", "",
         "| pass | plain tok/s | mlxnb tok/s | mlxnb / plain | client CPU ms per token: "
         "plain | mlxnb |", "|---|---|---|---|---|---|"]
    for i, (p, m, r) in enumerate(zip(res["plain"], res["mlxnb"], ratios)):
        L.append(f"| {i + 1} | {p[0] / p[1]:.1f} | {m[0] / m[1]:.1f} | {r:.3f} | "
                 f"{1000 * p[2] / p[0]:.3f} | {1000 * m[2] / m[0]:.3f} |")
    L += ["", f"median mlxnb / plain: {statistics.median(ratios):.3f} (goal >= 0.95); "
          f"connection retries: plain {RETRIES['plain']}, mlxnb {RETRIES['mlxnb']}"]
    print("\n" + "\n".join(L))
    report.write("\n".join(L))
    return 0
