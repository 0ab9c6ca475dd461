"""What the benchmarks share: model shapes, a tokenizer of plain ids, the two baselines
(a bare MLX decode loop and mlx-lm's BatchGenerator), the engine's decode window,
small statistics, and result files."""

from __future__ import annotations

import mlxnb  # noqa: F401  (first: it puts OpenBLAS under MLX on Linux CPU)

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

pc = time.perf_counter
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # SmolLM2-135M's depth at tiny width: on a CPU its steps are host-bound, as the
    # real shapes' are on a GPU (a local proxy for per-step host overhead)
    "thin": dict(hidden_size=64, num_hidden_layers=30, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # head dim 64, so its KV quantizes at group size 64
    "tiny-kv": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    vocab_size=512),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0),
    # Llama-3.2-1B (plain rope: the llama3 scaling changes no cost)
    "llama1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    head_dim=64, rope_theta=500000.0),
}
DTYPES = ["bfloat16", "float16", "float32", "4bit"]


def log(*a):
    print(*a, flush=True)


def fmt(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def median(xs):
    xs = [x for x in xs if x]
    return statistics.median(xs) if xs else None


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


# -- model and tokenizer ----------------------------------------------------------------
class _IdDetok:
    """Streaming detokenizer with the interface the engine uses; text is ' <id>'."""

    def __init__(self):
        self._seg = ""

    def reset(self):
        self._seg = ""

    def add_token(self, tok):
        self._seg += " " + str(tok)

    def finalize(self):
        pass

    @property
    def last_segment(self):
        s, self._seg = self._seg, ""
        return s


class IdTokenizer:
    """A prompt is its token ids written as decimal numbers. No EOS, so every row runs
    to max_tokens and all methods do the same work; no chat template."""

    chat_template = None

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eos_token_ids = []

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    @property
    def detokenizer(self):
        return _IdDetok()


def build_model(shape, dtype, seed=0, vocab=None):
    """(model, tokenizer, vocab size): random weights of a llama shape (`vocab`: a real
    tokenizer's size instead of the shape's), or the bundled model's real weights for
    shape "default". The same seed gives the same weights, so a second call makes a
    twin for the engine, which fuses its projections in place."""
    if shape == "default":
        model, tok = mlxnb.load_model("default")
        tok.eos_token_ids = []  # random prompts: no early stop (decode speed only)
        return model, tok, model.args.vocab_size
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True,
                     max_position_embeddings=16384,
                     **dict(SHAPES[shape], **({"vocab_size": vocab} if vocab else {})))
    mx.random.seed(seed)
    model = Model(args)
    if dtype == "4bit":
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=64, bits=4)
    else:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    model.eval()
    return model, IdTokenizer(args.vocab_size), args.vocab_size


def make_prompts(rng, n, length, vocab):
    # ids >= 2 keep clear of 0/1 (BOS/EOS in many vocabularies)
    return rng.integers(2, vocab, size=(n, length)).tolist()


def as_text(ids):
    return " ".join(map(str, ids))


# -- baseline: a bare decode loop -------------------------------------------------------
def run_raw(model, prompts, n, prof=None, batch_cache=False, views=False):
    """Forward + argmax, step N+1 launched (mx.async_eval) before step N is read.
    batch_cache: on mlx-lm's BatchKVCache (per-row offsets, an array mask) with no
    padding; views: on the engine's unpadded cache views."""
    B = len(prompts)
    if batch_cache:
        cache = [BatchKVCache([0] * B) for _ in model.layers]
    elif views:
        from mlxnb.core.worker.caches import AlignedView, LeanBatchKVCache

        cache = [AlignedView(LeanBatchKVCache([0] * B)) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)
    ids = mx.array(prompts, dtype=mx.uint32)
    t0 = pc()
    model(ids[:, :-1], cache=cache)
    mx.eval([(c.c if views else c).state for c in cache])
    y = ids[:, -1]
    mx.eval(y)
    t1 = pc()
    out, prev = [], None
    tb = ta = tw = 0.0
    for _ in range(n):
        s = pc()
        logits = model(y[:, None], cache=cache)
        s1 = pc()
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(y)
        s2 = pc()
        if prev is not None:
            out.append(prev.tolist())
        s3 = pc()
        tb, ta, tw = tb + s1 - s, ta + s2 - s1, tw + s3 - s2
        prev = y
    out.append(prev.tolist())
    t2 = pc()
    assert len(out) == n and all(len(r) == B for r in out)
    if prof is not None:
        prof.update(step_ms=1e3 * (t2 - t1) / n, build_ms=1e3 * tb / n,
                    argmax_async_eval_ms=1e3 * ta / n, wait_tolist_ms=1e3 * tw / n)
    return dict(decode_tps=B * n / (t2 - t1), e2e_tps=B * n / (t2 - t0),
                prefill_s=t1 - t0, decode_s=t2 - t1, tokens=B * n, ok=True)


def run_raw_sync(model, prompts, n):
    """The same loop with a full sync per step (no overlap): build + launch + device."""
    cache = make_prompt_cache(model)
    ids = mx.array(prompts, dtype=mx.uint32)
    model(ids[:, :-1], cache=cache)
    y = ids[:, -1]
    mx.eval([c.state for c in cache], y)
    tb = 0.0
    t1 = pc()
    for _ in range(n):
        s = pc()
        logits = model(y[:, None], cache=cache)
        tb += pc() - s
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        y.tolist()
    t2 = pc()
    return dict(sync_step_ms=1e3 * (t2 - t1) / n, sync_build_ms=1e3 * tb / n)


# -- baseline: mlx-lm's BatchGenerator --------------------------------------------------
def run_bg(model, prompts, n, defaults=False):
    """All prompts inserted at once, greedy. defaults: BatchGenerator's own batch sizes
    (completion 32, prefill 8), what `BatchGenerator(model)` gives a user; else both B.
    decode_tps is its own stats().generation_tps (wall minus prompt time)."""
    B = len(prompts)
    sizes = {} if defaults else dict(completion_batch_size=B, prefill_batch_size=B)
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None, **sizes)
    counts, reasons = {}, {}
    try:
        uids = gen.insert(prompts, [n] * B)
        with gen.stats() as st:
            while responses := gen.next_generated():
                for r in responses:
                    counts[r.uid] = counts.get(r.uid, 0) + 1
                    if r.finish_reason is not None:
                        reasons[r.uid] = r.finish_reason
    finally:
        gen.close()
    ok = all(counts.get(u) == n and reasons.get(u) == "length" for u in uids)
    return dict(decode_tps=st.generation_tps, decode_step_tps=st.decode_tps,
                e2e_tps=st.generation_tokens / st.wall_time if st.wall_time else 0.0,
                prefill_s=st.prompt_time, wall_s=st.wall_time,
                tokens=st.generation_tokens, ok=ok)


# -- the engine -------------------------------------------------------------------------
async def engine_run(eng, prompts, n):
    """All prompts at once, max_tokens=n each: (results, this run's steps, wall, ok)."""
    s0 = len(eng.steps)
    t0 = pc()
    res = await eng.generate([as_text(p) for p in prompts], max_tokens=n, chat=False)
    wall = pc() - t0
    ok = all(r.finish_reason == "length" and len(r.tokens) == n for r in res)
    return res, eng.steps[s0:], wall, ok


async def full_batch_decode(eng, prompts, n: int, limit: int):
    """Decode tok/s of all len(prompts) rows decoding together, for `n` steps.

    With long prompts, a batch's first rows would end before its last ones finish
    their prefill (continuous batching), leaving no step with every row decoding; so
    each row may take up to `limit` tokens, the run stops once n steps with all rows
    decoding and no prefill are recorded, and the rows are cancelled. Returns
    (decode_window of those steps or None, whether n such steps were recorded)."""
    B, s0 = len(prompts), len(eng.steps)
    rows = [eng.submit(as_text(p), max_tokens=limit, chat=False) for p in prompts]
    seen = full = 0  # steps looked at (after s0), and those with every row decoding
    while full < n and not all(r.done for r in rows):
        await asyncio.sleep(0.005)
        new = eng.steps[s0 + seen:]
        seen += len(new)
        full += sum(1 for s in new if s.prefill_tokens == 0 and s.batch_size == B)
    eng.cancel(rows)
    for r in rows:
        await r
    steps = [s for s in eng.steps[s0:] if s.batch_size == B and s.prefill_tokens == 0]
    return decode_window(steps[:n], B), len(steps) >= n


def decode_window(steps, B):
    """Over the steps with all B rows decoding and no prefill: tokens / summed step
    time (tps), and the same tokens over the wall time between those steps' records
    (span_tps, which adds the loop side of every step); split_ms: their mean
    StepRecord.split in ms (SPLIT names the parts)."""
    idx = [i for i, s in enumerate(steps) if s.prefill_tokens == 0 and s.batch_size == B]
    if not idx:
        return None
    # Tokens computed in these steps' time. A step launches a token per row and reads
    # the previous step's: counting its reads would leave out the window's last launch
    # (read by a step outside it) and count nothing for its first (which reads
    # nothing: the prefill tick before it launched no decode). With drafts a step
    # reads more.
    tok = sum(max(steps[i].batch_size, steps[i].tokens) for i in idx)
    dt = sum(steps[i].dt_s for i in idx)
    i0, i1 = idx[0], idx[-1]
    span_tok = sum(s.tokens for s in steps[i0 + 1:i1 + 1])
    span_s = steps[i1].t - steps[i0].t
    splits = [steps[i].split for i in idx if steps[i].split]
    return dict(tokens=tok, dt_s=dt, tps=tok / dt if dt > 0 else 0.0,
                span_tps=span_tok / span_s if span_s > 0 else 0.0, nsteps=len(idx),
                split_ms=tuple(1e3 * statistics.fmean(p) for p in zip(*splits))
                if splits else ())



def settle_compiles(vocab: int, timeout: float = 600.0) -> float:
    """Let the process's background compile of the engine's sampling kernels finish
    before any round (a fresh CUDA host: 30-45 s of NVRTC in helper processes, which
    would run beside the first rounds only). Seconds waited (0 elsewhere)."""
    from mlxnb.core.worker import precompile

    p = precompile.for_vocab(vocab)
    t = pc()
    if p.start():
        p.wait(timeout)
    return pc() - t


def in_turn(methods, rep: int) -> list:
    """Round `rep`'s order of the methods: rotated each round, so that no method
    always runs first, or always after the same one (a host's or device's state
    that drifts within a round then biases no method's ratio)."""
    k = rep % len(methods) if methods else 0
    return list(methods[k:]) + list(methods[:k])


SPLIT = "build / launch / device / worker / loop"  # StepRecord.split's parts


def join_ticks(steps) -> int:
    """How many steps prefilled prompt tokens: 1 when every prompt of a batch
    submitted at once was prefilled in one tick (its rows join together, unpadded).
    More means chunks or groups, which may leave rows joining at different lengths."""
    return sum(1 for s in steps if s.prefill_tokens)


# -- result files -----------------------------------------------------------------------
def hardware() -> str:
    """The hardware part of a result file's name: h200, cpu-2core, apple-m2-max, ..."""
    if mx.default_device() == mx.gpu:
        name = ""
        if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            try:
                name = subprocess.run(
                    ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
            except (OSError, IndexError, subprocess.SubprocessError):
                name = "cuda"
            name = name.replace("NVIDIA", "")
        elif getattr(mx, "metal", None) is not None and mx.metal.is_available():
            name = mx.metal.device_info().get("device_name", "metal")
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
    return f"cpu-{os.cpu_count()}core"


def stamp(hw: str) -> str:
    """A result file's name after the result: `<date>-<hardware>` (the date of the
    run), or `hw` as given where it starts with a date."""
    if re.match(r"\d{4}-\d{2}-\d{2}-", hw):
        return hw
    return f"{datetime.date.today().isoformat()}-{hw}"


def env_info() -> dict:
    env = dict(device=str(mx.default_device()), mlx=mx.__version__,
               python=platform.python_version(), machine=platform.machine(),
               cpus=os.cpu_count())
    try:
        import mlx_lm

        env["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    try:
        env["commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def parser(doc: str, prog=None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring's first line as the description,
    the rest as the epilog, laid out as written. Options are spelled whole (no
    abbreviations), so `quick` can tell which ones the command line gave."""
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n", 1)[1], allow_abbrev=False)


# argparse types: a bad value ends the run in one line (`error: argument --batch: ...`)
# before anything is built or measured
def _whole_number(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise argparse.ArgumentTypeError(f"takes a whole number >= {least}, got {text!r}")
    return n


def count(text: str) -> int:
    """A whole number >= 1."""
    return _whole_number(text, 1)


def whole(text: str) -> int:
    """A whole number >= 0."""
    return _whole_number(text, 0)


def counts(text: str) -> List[int]:
    """Whole numbers >= 1, comma-separated: 1,8,32."""
    try:
        return [count(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"takes whole numbers >= 1, comma-separated (as 1,8,32), got {text!r}") from None


def size(text: str) -> str:
    """A memory size as Engine(kv_budget=...) reads it: 1GB, 512MB."""
    from mlxnb._text import parse_bytes

    try:
        if parse_bytes(text) is None:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a size such as 1GB or 512MB, got {text!r}")
    return text


def names(options):
    """A type: names from `options`, comma-separated."""
    def parse(text: str) -> List[str]:
        out = text.split(",")
        bad = [x for x in out if x not in options]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad))} is not one of {', '.join(options)}")
        return out
    return parse


def quick(ap: argparse.ArgumentParser, args, argv, **values) -> set:
    """--quick's sizes, for each option the command line did not give: a smoke run
    that still measures what was asked, and a results file whose command is true.
    Returns the options given (a caller fits its other quick sizes to them)."""
    given = {a.dest for a in ap._actions for o in a.option_strings
             if any(x == o or x.startswith(o + "=") for x in argv)}
    for k, v in values.items():
        if k not in given:
            setattr(args, k, v)
    return given


def _out_dir(text: str) -> Path:
    d = Path(text).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make folder {text!r} ({e.strerror}); "
                                         "name a folder you can write to")
    if not os.access(d, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}; "
                                         "name a folder you can write to")
    return d


def _hardware(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", text):
        raise argparse.ArgumentTypeError(
            f"takes lower-case letters, digits and dashes (as h200 or 2026-12-04-h200), "
            f"got {text!r}")
    return text


def add_output_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("results")
    g.add_argument("--save", action="store_true",
                   help="write bench/results/<result>-<date>-<hardware>.md (a new run "
                        "that day overwrites it; git keeps the history)")
    g.add_argument("--out", metavar="DIR", type=_out_dir,
                   help="write <result>-<date>-<hardware>.md (and, where the benchmark "
                        "keeps them, its numbers as .json) into DIR instead")
    g.add_argument("--hardware", type=_hardware,
                   help="the file name's hardware part (default: detected; one that "
                        "starts with a date replaces the date too)")


class Report:
    """One benchmark run's result file. `write` rewrites it whole each time, so a run
    cut short (a device budget) still leaves what it had measured."""

    def __init__(self, name: str, result: str, title: str, args, argv):
        self.dir = Path(args.out) if args.out else (RESULTS if args.save else None)
        self.hw = stamp(args.hardware or hardware())
        self.env = env_info()
        self.path = self.dir / f"{result}-{self.hw}.md" if self.dir else None
        e = self.env
        self.head = (
            f"# {title} ({self.hw})\n\n"
            f"Measured {datetime.date.today().isoformat()}: {e['device']}, mlx {e['mlx']}, "
            f"mlx-lm {e.get('mlx_lm')}, python {e['python']}, {e['machine']}, "
            f"{e['cpus']} CPUs; mlxnb at {e.get('commit') or 'an unknown commit'}.\n\n"
            f"`python -m bench {' '.join([name] + list(argv))}`\n\n")

    def write(self, text: str, data=None) -> None:
        if self.path is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.head + text.rstrip() + "\n")
        if data is not None and self.dir != RESULTS:
            self.path.with_suffix(".json").write_text(
                json.dumps(dict(env=self.env, **data), indent=1, default=str))

