"""Widget traffic: messages/s, bytes per streamed token, kernel time spent on the widget.

Drives a GenerationWidget from the fake engine of tests/test_widget.py (the same
listener events and Row/StepRecord types as mlxnb.Engine, no model), captures every
comm message the widget would put on the wire (custom deltas and trait updates,
JSON-sized as ipykernel would serialize them) and times the widget's own code on the
loop. One JSON line per case.

  python -m bench widget-traffic              # fake engine, 10 ms steps; and a row
                                              # view open on the tiny model (details.py)
  python -m bench widget-traffic --real       # also mlxnb.Engine on the tiny model:
                                              # aggregate tok/s with vs without a widget
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
import time

from mlxnb.notebook.widget import GenerationWidget

from . import common

NAME, RESULT, TITLE = "widget-traffic", "widget-traffic", "Widget traffic"


def fake_engine_class():
    """tests/test_widget.py's FakeEngine, loaded from its file (tests/ is no package)."""
    path = common.ROOT / "tests" / "test_widget.py"
    spec = importlib.util.spec_from_file_location("_bench_test_widget", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakeEngine


LINES = []  # the JSON lines printed, for the result file


class TimedWidget(GenerationWidget):
    """Accumulates the seconds the widget's own code runs on the loop."""

    busy = 0.0

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.busy += time.perf_counter() - t0

    def _on_event(self, kind, obj):
        return self._timed(super()._on_event, kind, obj)

    def _flush(self, send=True):
        return self._timed(super()._flush, send)

    def _write_traits(self):
        return self._timed(super()._write_traits)


def capture(w):
    sent = []

    def publish(msg_type, data=None, metadata=None, buffers=None, **k):
        sent.append((data.get("method"), len(json.dumps(data, separators=(",", ":")))))

    w.comm.publish_msg = publish
    return sent


async def fake_case(nrows, ntok, step_s, max_batch):
    eng = fake_engine_class()(max_batch=max_batch, step_s=step_s, kv_budget=1 << 30)
    rows = [eng.submit(f"prompt number {i}: tell me something", max_tokens=ntok,
                       prompt_len=64) for i in range(nrows)]
    w = TimedWidget(eng, rows)
    sent = capture(w)
    t0 = time.perf_counter()
    await eng.wait()
    while w._flusher is not None:
        await asyncio.sleep(0.01)
    wall = time.perf_counter() - t0
    return report(f"fake {nrows} rows x {ntok} tok, {step_s * 1e3:.0f} ms steps",
                  sent, sum(r.ntok for r in rows), wall, w.busy, len(eng.steps))


def report(name, sent, ntok, wall, busy, nsteps):
    cust = [n for m, n in sent if m == "custom"]
    upd = [n for m, n in sent if m == "update"]
    r = {
        "case": name, "wall_s": round(wall, 2), "tokens": ntok, "steps": nsteps,
        "msgs": len(cust), "msgs_per_s": round(len(cust) / wall, 1),
        "delta_bytes": sum(cust), "bytes_per_token": round(sum(cust) / max(ntok, 1), 1),
        "max_msg_bytes": max(cust, default=0),
        "trait_updates": len(upd), "trait_bytes": sum(upd), "max_trait_bytes": max(upd, default=0),
        "widget_cpu_pct": round(100 * busy / wall, 2),
    }
    LINES.append(json.dumps(r))
    print(LINES[-1], flush=True)
    return r


async def real_case(nrows, ntok, with_widget):
    from mlxnb import Engine
    from mlxnb.models.tiny import tiny_model

    eng = Engine(tiny_model(), max_batch=max(nrows, 1), kv_budget=None)
    warm = eng.generate(["warm up"], max_tokens=4)
    await warm
    w = sent = None
    t0 = time.perf_counter()
    run = eng.generate([f"row {i} says" for i in range(nrows)], max_tokens=ntok)
    if with_widget:
        w = TimedWidget(eng, run.rows)
        sent = capture(w)
    await run
    wall = time.perf_counter() - t0
    toks = sum(r.ntok for r in run.rows)
    if w is not None:
        while w._flusher is not None:
            await asyncio.sleep(0.01)
        report(f"real tiny {nrows} rows x {ntok} tok, widget", sent, toks, wall, w.busy,
               len(eng.steps))
    await eng.aclose()
    return toks / wall


async def detail_case(nrows, ntok):
    """A row view kept open while `nrows` rows decode (the front end asks for the open
    row's detail once a second while it runs): the answer's size and the loop time it
    takes, and a trivial task's latency on the loop meanwhile."""
    from mlxnb import Engine
    from mlxnb.models.tiny import tiny_model

    eng = Engine(tiny_model(), max_batch=nrows, kv_budget=None)
    await eng.generate(["warm up"], max_tokens=4)
    run = eng.generate([f"row {i} says" for i in range(nrows)], max_tokens=ntok,
                       logprobs=5, temperature=0.8)
    w = GenerationWidget(eng, run.rows)
    sent = capture(w)
    loop = asyncio.get_running_loop()
    costs, lat = [], []
    while not run.done:
        t0 = time.perf_counter()
        w._on_front_msg(w, {"type": "row_detail", "id": run.rows[0].id}, [])
        costs.append(time.perf_counter() - t0)
        for _ in range(10):  # a trivial "cell": how long until the loop runs it
            t1 = time.perf_counter()
            await loop.run_in_executor(None, lambda: None)
            lat.append(time.perf_counter() - t1)
            await asyncio.sleep(0.1)
    details = [n for m, n in sent if m == "custom"]
    r = {"case": f"row view open, tiny {nrows} rows x {ntok} tok, logprobs 5",
         "answers": len(costs), "answer_ms_median": round(1e3 * statistics.median(costs), 2),
         "answer_ms_max": round(1e3 * max(costs), 2),
         "answer_bytes_max": max(details, default=0),
         "loop_latency_ms_median": round(1e3 * statistics.median(lat), 2),
         "loop_latency_ms_p95": round(1e3 * sorted(lat)[int(0.95 * (len(lat) - 1))], 2)}
    LINES.append(json.dumps(r))
    print(LINES[-1], flush=True)
    w.close()
    await eng.aclose()


def main(argv=None, prog=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__, prog)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=common.count, default=256, help="--real: tokens per row")
    ap.add_argument("--repeat", type=common.count, default=3, help="--real: plain/widget pairs")
    common.add_output_args(ap)
    a = ap.parse_args(argv)
    report = common.Report(NAME, RESULT, TITLE, a, argv)
    for nrows, ntok in [(1, 200), (8, 200), (32, 200), (64, 200)]:
        asyncio.run(fake_case(nrows, ntok, a.step_ms / 1000, 64))
    asyncio.run(fake_case(8, 2000, 0.001, 64))  # fast steps: bucketing in one flush
    asyncio.run(detail_case(32, a.tokens))
    if a.real:
        asyncio.run(real_case(8, 32, False))  # warm-up: imports, first compile
        for nrows in (8, 32):
            ratios = []
            for _ in range(a.repeat):  # alternate plain / widget runs to spread noise
                base = asyncio.run(real_case(nrows, a.tokens, False))
                wid = asyncio.run(real_case(nrows, a.tokens, True))
                ratios.append(wid / base)
                LINES.append(json.dumps({"case": f"real tiny {nrows} rows",
                                         "tok_s_plain": round(base),
                                         "tok_s_widget": round(wid),
                                         "ratio": round(wid / base, 3)}))
                print(LINES[-1], flush=True)
            LINES.append(json.dumps({"case": f"real tiny {nrows} rows", "median_ratio":
                                     round(statistics.median(ratios), 3)}))
            print(LINES[-1], flush=True)
    report.write("```\n" + "\n".join(LINES) + "\n```")
    return 0
