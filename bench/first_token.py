"""A process's first engine: seconds from process start to `Engine()` ready and to the
first token of its first rows (greedy, sampled, top-p, in turn), each run in a new
process.

--fresh gives each process an empty `MLXNB_CACHE`: no converted model and no compiled
kernels (MLX's kernel folder lives under it unless MLX_PTX_CACHE_DIR is set, which
this benchmark unsets), as on a machine that never ran mlxnb. Without it the
processes share one cache, so the first pays the compiles and the rest find them.

  python -m bench first-token --shape default --fresh      # `make demo` on a new machine
  bash bench/gpu_run.sh first-token --shape smollm2 --fresh --runs 2
  bash bench/gpu_run.sh first-token --shape qwen3_5-0.8b --fresh --runs 2   # a hybrid

On CUDA each load part's line also says how many compiled kernels MLX's folder holds
after it, and the .json lists their names: `--size quick` (a hybrid's layer pattern
at toy width) beside a full-size run shows whether those names depend on the width,
that is, whether a toy model in a helper process could compile them ahead.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

NAME, RESULT, TITLE = "first-token", "first-token", "A process's first engine and first tokens"
KINDS = (("greedy", {}), ("sampled", {"temperature": 0.8}),
         ("top_p", {"temperature": 0.8, "top_p": 0.9}))


def _kernel_dir():
    from mlxnb.models.kernel_cache import ptx_dir

    return ptx_dir()


def _kernel_files(since=None) -> list:
    """The compiled kernels in MLX's kernel folder (CUDA; none elsewhere); with
    `since` (a wall-clock time), each as [name, seconds after it when written],
    in the order they were written. The engine's process compiles one after
    another, so there the gaps are each kernel's compile time; kernels from helper
    processes carry the time they were moved in."""
    d = _kernel_dir()
    files = list(d.rglob("*.ptx")) if d.is_dir() else []
    if since is None:
        return sorted(str(p.relative_to(d)) for p in files)
    timed = sorted((p.stat().st_mtime - since, str(p.relative_to(d))) for p in files)
    return [[name, round(t, 2)] for t, name in timed]


async def _child(shape: str, dtype: str, t_start: float, warmup: bool = True,
                 size=None) -> dict:
    """`t_start`: the wall-clock time the parent started this process."""
    import logging

    import mlxnb
    from . import common

    events = []  # (seconds since start, what): background compiles and first tokens
    by_part = {}  # load part -> the kernels that appeared during it (CUDA)

    def part_done(part: str) -> int:
        names = _kernel_files()
        seen = {n for new in by_part.values() for n in new}
        by_part[part] = [n for n in names if n not in seen]
        return len(names)

    class Events(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "kernel" in msg or msg.startswith("load: "):  # (not other chatter)
                if msg.startswith("load: ") and _kernel_dir().is_dir():  # (CUDA)
                    part = re.sub(r" [0-9.]+ s$", "", msg[len("load: "):])
                    msg += f" [{part_done(part)} kernel files]"  # after this part
                events.append((round(time.time() - t_start, 1), msg))

    logger = logging.getLogger("mlxnb")
    logger.addHandler(Events(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    out = {"import_s": time.time() - t_start}
    t = time.perf_counter()
    if shape == "default":
        eng = mlxnb.Engine("default", max_batch=32, warmup=warmup)
        prompts = ["Tell me about cats.", "Write a haiku about rain.",
                   "What is two plus two?", "Name three rivers."]
    else:
        if shape in common.SHAPES:
            model, tok, _ = common.build_model(shape, dtype)
        else:  # a hybrid shape (recurrent-state layers beside attention)
            from .cache_kinds import build_hybrid
            model, tok, _ = build_hybrid(shape, dtype, size)
        eng = mlxnb.Engine((model, tok), max_batch=32, kv_budget=None, warmup=warmup)
        prompts = [common.as_text([5 + i] * (20 + 7 * i)) for i in range(4)]
    out["engine_s"] = time.perf_counter() - t
    out["warmup_s"] = eng.warmup_s
    out["ready_since_start_s"] = time.time() - t_start
    events.append((round(out["ready_since_start_s"], 1), "engine ready"))
    part_done("warm-up")
    for name, kw in KINDS:
        t = time.perf_counter()
        run = eng.generate(prompts, chat=False, max_tokens=4, **kw)
        while not any(r.ntok for r in run):
            await asyncio.sleep(0.002)
        out[f"{name}_first_token_s"] = time.perf_counter() - t
        events.append((round(time.time() - t_start, 1), f"first {name} token"))
        if name == "greedy":
            out["first_token_since_start_s"] = time.time() - t_start
        while not run.done:
            await asyncio.sleep(0.01)
    eng.close()
    part_done("first rows")
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    out["events"] = [f"{t} s: {m}" for t, m in events]
    # (the .json: compare shapes and sizes; see which part compiles what, and how long)
    out["kernel_files"] = _kernel_files(t_start)
    out["kernels_by_part"] = by_part
    return out


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        t_start = float(argv[3])
        flags = argv[4:]
        size = next((f.split("=", 1)[1] for f in flags if f.startswith("--size=")), None)
        res = asyncio.run(_child(argv[1], argv[2], t_start, warmup="--no-warmup" not in flags,
                                 size=size))
        print("RESULT " + json.dumps(res))
        return 0
    from . import common

    ap = common.parser(__doc__, prog)
    from .cache_kinds import SHAPES as HYBRIDS
    ap.add_argument("--shape", default="default",
                    choices=["default"] + list(common.SHAPES) + list(HYBRIDS))
    ap.add_argument("--dtype", default="bfloat16", choices=common.DTYPES)
    ap.add_argument("--fresh", action="store_true", help="an empty MLXNB_CACHE per process")
    ap.add_argument("--runs", type=common.count, default=2)
    ap.add_argument("--between", type=float, default=0.0, metavar="S",
                    help="seconds between runs (background compiles finish, as on a used "
                    "machine)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="Engine(warmup=False): the first rows compile what they use")
    ap.add_argument("--size", choices=["quick", "proxy"],
                    help="a hybrid shape's layer pattern at toy width (cache-kinds' sizes): "
                         "do its kernels' names, and so a compile ahead, depend on width?")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.size and args.shape not in HYBRIDS:
        ap.error(f"argument --size: takes a hybrid shape ({', '.join(HYBRIDS)})")
    report = common.Report(NAME, RESULT, TITLE, args, argv)
    shared = tempfile.mkdtemp(prefix="mlxnb-first-token-")
    rows = []
    for i in range(args.runs):
        if i and args.between:
            time.sleep(args.between)
        env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
        env["MLXNB_CACHE"] = tempfile.mkdtemp(prefix="mlxnb-fresh-") if args.fresh else shared
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", "bench", NAME, "--child", args.shape, args.dtype]
        # the child measures from this moment (wall clock): its interpreter start counts
        extra = (["--no-warmup"] if args.no_warmup else []) + (
            [f"--size={args.size}"] if args.size else [])
        r = subprocess.run(cmd + [repr(time.time())] + extra, env=env,
                           capture_output=True, text=True, cwd=str(common.ROOT))
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            common.log(f"run {i}: failed\n{r.stderr[-2000:]}")
            return 1
        res = json.loads(line[0][7:])
        res["run"] = i
        rows.append(res)
        common.log(json.dumps({k: v for k, v in res.items() if k not in ("kernel_files", "kernels_by_part")})
                   + f" ({len(res.get('kernel_files') or [])} kernel files)")
    keys = ["run", "engine_s", "warmup_s", "ready_since_start_s", "first_token_since_start_s"] + [
        f"{k}_first_token_s" for k, _ in KINDS]
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r.get(k)) for k in keys) + " |" for r in rows]
    what = "each process with an empty MLXNB_CACHE" if args.fresh else "processes sharing one cache"
    what += ", Engine(warmup=False)" if args.no_warmup else ""
    what += f", at cache-kinds' {args.size} width" if args.size else ""
    # what the engine logged about its load's parts and its compiles, on one clock
    events = [f"- run {r['run']}:\n" + "\n".join(f"  - {e}" for e in r.get("events") or
                                                  ["none"]) for r in rows]
    report.write(f"{args.shape} {args.dtype}, {what}; seconds.\n\n" + "\n".join(table)
                 + "\n\nSeconds since the process started: the load's parts (each with "
                 "its own time), kernels and first tokens:\n\n" + "\n".join(events) + "\n",
                 {"rows": rows})
    print("\n".join(table))
    print("\n".join(events))
    return 0
