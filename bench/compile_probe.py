"""Probe: does mx.compile of the whole decode step pay on this device?

Per (shape, B): ms per decode step (pipelined async_eval loop, greedy, bf16) of
  raw        mlx-lm forward on plain KVCaches (eager; slices grow each step)
  fixedE     forward on fixed-capacity caches (dynamic slice_update at an array
             position, attention over the whole buffer with a bool mask), eager
  fixedC     the same step under mx.compile (retraced when B or capacity changes)
  concatC    caches grown by concatenate (no mask), mx.compile(shapeless=True)
plus graph nodes per step (export_to_dot) and token agreement with raw.
"""
import argparse, collections, re, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxnb  # noqa
import mlx.core as mx
from engine_bench import build_model
from mlx_lm.models.cache import make_prompt_cache


class FixedCache:
    def __init__(self, k, v, pos, left):
        self.keys, self.values, self.pos, self.left = k, v, pos, left

    @property
    def offset(self):
        return self.pos - self.left

    def update_and_fetch(self, k, v):
        self.keys = mx.slice_update(self.keys, k, self.pos, axes=(2,))
        self.values = mx.slice_update(self.values, v, self.pos, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        r = mx.arange(self.keys.shape[2])
        return ((r[None] >= self.left[:, None]) & (r[None] <= self.pos))[:, None, None, :]


class ConcatCache(FixedCache):
    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        return self.keys, self.values

    def make_mask(self, N, **_):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="smollm2:bfloat16:8,32,128")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--methods", default="raw,fixedE,fixedC,concatC")
    a = ap.parse_args()
    print(mx.default_device(), mx.__version__, flush=True)
    for item in a.plan.split():
        shape, dtype, bs = item.split(":")
        model, _, V = build_model(shape, dtype)
        for B in map(int, bs.split(",")):
            run_config(model, V, shape, dtype, B, a)


def run_config(model, V, shape, dtype, B, a):
    P, N = a.prompt, a.new
    prompts = mx.random.randint(2, V, (B, P))

    def step(y, pos, left, kv, kind):
        C = FixedCache if kind == "fixed" else ConcatCache
        caches = [C(k, v, pos, left) for k, v in kv]
        logits = model(y[:, None], cache=caches).squeeze(1)
        return mx.argmax(logits, -1), pos + 1, [(c.keys, c.values) for c in caches]

    fixedC = mx.compile(lambda y, p, l, kv: step(y, p, l, kv, "fixed"))
    concatC = mx.compile(lambda y, p, l, kv: step(y, p, l, kv, "concat"), shapeless=True)

    def prefill():
        cache = make_prompt_cache(model)
        y = mx.argmax(model(prompts, cache=cache)[:, -1], -1)
        mx.eval(y, [c.keys for c in cache], [c.values for c in cache])
        return y, cache

    def loop(first, advance):
        y, state = first
        out, prev = [], None
        t = time.perf_counter()
        for _ in range(N):
            y, state = advance(y, state)
            mx.async_eval(y, state)
            if prev is not None:
                out.append(prev.tolist())
            prev = y
        out.append(prev.tolist())
        return (time.perf_counter() - t) / N * 1e3, out

    def raw():
        y, cache = prefill()
        def adv(y, cache):
            return mx.argmax(model(y[:, None], cache=cache)[:, -1], -1), [c.keys for c in cache] + [c.values for c in cache]
        return loop((y, None), lambda y, s: (adv(y, cache)))

    def fixed(kind, fn):
        y, cache = prefill()
        cap = P + N + 63 if kind == "fixed" else P
        kv = [tuple(mx.pad(t[..., :P, :], [(0, 0), (0, 0), (0, cap - P), (0, 0)])
                    for t in (c.keys, c.values)) for c in cache]
        pos, left = mx.array(P, dtype=mx.int32), mx.zeros((B,), mx.int32)
        mx.eval(kv, pos)

        def adv(y, s):
            pos, kv = s
            y, pos, kv = fn(y, pos, left, kv)
            return y, (pos, kv)
        return loop((y, (pos, kv)), adv)

    methods = {"raw": raw,
               "fixedE": lambda: fixed("fixed", lambda *x: step(*x, "fixed")),
               "fixedC": lambda: fixed("fixed", fixedC),
               "concatC": lambda: fixed("concat", concatC)}
    res, ref = {}, None
    for rnd in range(2):
        for m in a.methods.split(","):
            try:
                ms, out = methods[m]()
            except Exception as e:
                res[m] = f"error {type(e).__name__}: {str(e)[:120]}"
                continue
            if m == "raw":
                ref = out
            agree = (sum(x == y for r1, r2 in zip(out, ref) for x, y in zip(r1, r2))
                     / (len(out) * B)) if ref else float("nan")
            if rnd == 1 or m not in res:
                res[m] = (ms, agree)
    nodes = count_nodes(model, prompts, step, fixedC, concatC, P, B)
    line = " | ".join(f"{m} {v[0]:.3f} ms ({B / v[0] * 1e3:,.0f} tok/s, agree {v[1]:.2f})"
                      if isinstance(v, tuple) else f"{m} {v}" for m, v in res.items())
    print(f"{shape} {dtype} B={B}: {line}\n    nodes/step {nodes}", flush=True)


def count_nodes(model, prompts, step, fixedC, concatC, P, B):
    out = {}
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompts, cache=cache)[:, -1], -1)
    mx.eval(y, [c.keys for c in cache], [c.values for c in cache])
    kv = [(c.keys, c.values) for c in cache]
    pos, left = mx.array(P, dtype=mx.int32), mx.zeros((B,), mx.int32)
    graphs = {"raw": lambda: [mx.argmax(model(y[:, None], cache=cache)[:, -1], -1)],
              "fixedC": lambda: flat(fixedC(y, pos, left, kv)),
              "concatC": lambda: flat(concatC(y, pos, left, [(k[..., :P, :], v[..., :P, :]) for k, v in kv]))}
    for name, g in graphs.items():
        try:
            mx.export_to_dot("/tmp/_g.dot", *g())
            ops = re.findall(r'label ="([A-Za-z0-9]+)', open("/tmp/_g.dot").read())
            c = collections.Counter(ops)
            out[name] = f"{sum(c.values())} ({', '.join(f'{k} {v}' for k, v in c.most_common(6))})"
        except Exception as e:
            out[name] = f"error {e}"
    return out


def flat(r):
    y, pos, kv = r
    return [y, pos] + [t for p in kv for t in p]


if __name__ == "__main__":
    main()
