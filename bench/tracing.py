"""Per-tick host timers of the engine, from its own timing hooks (`Engine.trace`):
`decode --profile B` (where a decode step's time goes, beside the bare loop's) and
`mixed --profile` (every tick of a continuous run, by kind)."""

from __future__ import annotations

import gc
import statistics

from .common import log, p90, pc


class GcTimer:
    """Milliseconds the cyclic garbage collector ran inside the `with` block."""

    def __enter__(self):
        self.ms, self._t = 0.0, None
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t = pc()
        elif self._t is not None:
            self.ms += 1e3 * (pc() - self._t)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)


class EngineProfiler:
    """Per-tick host timers from the engine's own timing hooks (`Engine.trace`).

    Every tick gets a dict: seconds per part, plus counts ("n.*": decoded rows,
    prefill tokens, groups started, rows in them). `_read` is split into the wait
    for the device (`tokens.tolist()` of the step in flight) and the Python after
    it (`accept` per row, within read.py). `Prefill.run` is split into `next_group`
    (group building, cache allocation), forward graph build and `mx.eval` (blocked
    on the device: the prefill chunk and the decode step launched just before it).
    `_align` runs inside `_filter` and `_join` (nested, not additive).
    """

    KEYS = ["tick", "filter", "join", "align", "launch", "launch.fwd_build",
            "launch.sample", "launch.async_eval", "prefill", "prefill.group",
            "prefill.fwd_build", "prefill.eval", "read.wait", "read.py", "read.accept",
            "kv_report", "tick.rest", "apply", "gap", "gap.rest", "period"]
    COUNTS = ["n.decoded", "n.prefill_tokens", "n.groups", "n.group_rows", "n.emitted"]

    def __init__(self):
        self.ticks = []
        self.cur = {}
        self.summary = None

    def add(self, key, dt):
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def attach(self, eng):
        """Take the engine's timing hooks (Engine.trace). Build the engine with
        streak_s=0 so that each tick is one decode step and per-tick is per-step."""
        self.cur = {}
        eng.trace(self._on)

    def _on(self, name, value):
        if name == "tick":  # the tick's parts came first: this one closes it
            self.cur["t0"], self.cur["tick"] = pc() - value, value
            self.ticks.append(self.cur)
            self.cur = {}
        elif name == "apply":  # the loop side, after its tick
            if self.ticks:
                self.ticks[-1]["apply"] = value
        else:
            self.add(name, value)

    def detach(self, eng):
        eng.trace(None)
        self._derive(self.ticks)

    @staticmethod
    def _derive(ticks):
        """Per tick: loop-side gap to the next tick, period, unattributed tick time."""
        for i, t in enumerate(ticks):
            nxt = ticks[i + 1]["t0"] if i + 1 < len(ticks) else None
            t["gap"] = nxt - (t["t0"] + t["tick"]) if nxt is not None else t.get("apply", 0.0)
            t["period"] = t["tick"] + t["gap"]
            t["gap.rest"] = t["gap"] - t.get("apply", 0.0)
            t["tick.rest"] = t["tick"] - sum(t.get(k, 0.0) for k in (
                "filter", "join", "launch", "prefill", "read.wait", "read.py", "kv_report"))

    def summarize(self, steps, B):
        """Steady decode ticks (all B rows decoding, no prefill) of the run in `steps`."""
        ticks = self.ticks
        if len(ticks) != len(steps):
            log(f"  [profile] {len(ticks)} ticks vs {len(steps)} steps; aligning by tail")
            ticks = ticks[-len(steps):]
        win = [t for t, s in zip(ticks[:-1], steps[:-1])
               if s.prefill_tokens == 0 and s.batch_size == B]
        if not win:
            self.summary = None
            return
        keys = self.KEYS + ["launch.eval", "read.eval"]
        mean = {k: 1e3 * statistics.mean(t.get(k, 0.0) for t in win) for k in keys}
        med = {k: 1e3 * statistics.median(t.get(k, 0.0) for t in win) for k in keys}
        self.summary = dict(B=B, nticks=len(win), mean_ms=mean, median_ms=med)

    # -- mixed run: every tick, by kind ----------------------------------------------
    KINDS = [("all", lambda t: True),
             ("prefill+decode", lambda t: t.get("n.prefill_tokens", 0) > 0
              and t.get("n.decoded", 0) > 0),
             ("prefill only", lambda t: t.get("n.prefill_tokens", 0) > 0
              and not t.get("n.decoded", 0)),
             ("decode only", lambda t: not t.get("n.prefill_tokens", 0)
              and t.get("n.decoded", 0) > 0),
             ("neither (drain)", lambda t: not t.get("n.prefill_tokens", 0)
              and not t.get("n.decoded", 0))]

    def summarize_all(self, t_start, wall):
        """Every tick of a run that started (first submit) at `t_start` and took `wall`."""
        ticks = self.ticks
        out = dict(wall_s=wall, nticks=len(ticks),
                   before_first_tick_s=(ticks[0]["t0"] - t_start) if ticks else wall,
                   kinds={})

        for name, pred in self.KINDS:
            sel = [t for t in ticks if pred(t)]
            if not sel:
                continue
            st = {}
            for k in self.KEYS + self.COUNTS:
                xs = [t.get(k, 0.0) for t in sel]
                st[k] = dict(mean=statistics.mean(xs), median=statistics.median(xs),
                             p90=p90(xs), total=sum(xs))
            out["kinds"][name] = dict(n=len(sel), stats=st)
        out["ticks"] = [{k: (round(v, 7) if isinstance(v, float) else v)
                         for k, v in t.items() if k != "t0"}
                        | {"t": round(t["t0"] - t_start, 6)} for t in ticks]
        return out


_PART_LABELS = [
    ("period", "tick + loop gap (wall per tick)"),
    ("tick", "worker: tick total"),
    ("filter", "  _filter"),
    ("join", "  _join"),
    ("align", "    _align (inside _filter/_join)"),
    ("launch", "  _launch (decode step N+1)"),
    ("launch.fwd_build", "    model forward (graph build)"),
    ("launch.sample", "    sampler.sample (graph build)"),
    ("launch.async_eval", "    mx.async_eval"),
    ("prefill", "  _prefill"),
    ("prefill.group", "    next_group (group, cache alloc)"),
    ("prefill.fwd_build", "    model forward (graph build)"),
    ("prefill.eval", "    mx.eval (blocked: decode N+1 + prefill on device)"),
    ("read.wait", "  _read: blocked waiting for device"),
    ("read.py", "  _read: tolist + per-row Python"),
    ("read.accept", "    of which _accept (all rows)"),
    ("kv_report", "  _kv_report"),
    ("tick.rest", "  rest of tick"),
    ("gap", "loop side: gap to next tick"),
    ("apply", "  Engine._apply"),
    ("gap.rest", "  rest (handoff, _serve, admit, idle waits)"),
]
_COUNT_LABELS = [("n.prefill_tokens", "prefill tokens"), ("n.groups", "prefill groups started"),
                 ("n.group_rows", "rows in those groups"), ("n.decoded", "rows decoded"),
                 ("n.emitted", "tokens emitted")]


def format_mixed_profile(s, label=""):
    L = []
    kinds = s["kinds"]
    wall = s["wall_s"]
    L.append(f"Mixed-run engine profile{label}: {s['nticks']} ticks, wall {wall:.3f} s "
             f"(first tick {s['before_first_tick_s'] * 1e3:.1f} ms after the first submit). "
             "Ticks by kind: " + ", ".join(f"{k} {v['n']}" for k, v in kinds.items()
                                           if k != "all") + ".")
    L.append("")
    a = kinds.get("all")
    if a:
        L.append("All ticks, ms per tick (counts per tick for the last rows):")
        L.append("")
        L.append("| part | mean | median | p90 | total s | % of wall |")
        L.append("|---|---|---|---|---|---|")
        for k, lab in _PART_LABELS:
            x = a["stats"][k]
            L.append(f"| {lab} | {1e3 * x['mean']:.3f} | {1e3 * x['median']:.3f} | "
                     f"{1e3 * x['p90']:.3f} | {x['total']:.3f} | "
                     f"{100 * x['total'] / wall:.1f} |")
        for k, lab in _COUNT_LABELS:
            x = a["stats"][k]
            L.append(f"| {lab} (count) | {x['mean']:.1f} | {x['median']:.0f} | "
                     f"{x['p90']:.0f} | {x['total']:.0f} | |")
    L.append("")
    names = [k for k in kinds if k != "all"]
    L.append("By tick kind: mean ms per tick (total s):")
    L.append("")
    L.append("| part | " + " | ".join(f"{k} (n={kinds[k]['n']})" for k in names) + " |")
    L.append("|---|" + "---|" * len(names))
    for k, lab in _PART_LABELS:
        L.append(f"| {lab} | " + " | ".join(
            f"{1e3 * kinds[n]['stats'][k]['mean']:.3f} ({kinds[n]['stats'][k]['total']:.3f})"
            for n in names) + " |")
    for k, lab in _COUNT_LABELS:
        L.append(f"| {lab} (mean, total) | " + " | ".join(
            f"{kinds[n]['stats'][k]['mean']:.1f} ({kinds[n]['stats'][k]['total']:.0f})"
            for n in names) + " |")
    ticks = s.get("ticks") or []
    if ticks:
        slow = sorted(range(len(ticks)), key=lambda i: -ticks[i].get("period", 0))[:12]
        L.append("")
        L.append("Slowest ticks (ms; new shapes pay one-off setup here):")
        L.append("")
        L.append("| tick | period | _launch | _prefill | prefill tokens | groups | rows "
                 "in groups | rows decoded |")
        L.append("|---|---|---|---|---|---|---|---|")
        for i in sorted(slow):
            t = ticks[i]
            L.append(f"| {i} | {1e3 * t.get('period', 0):.1f} | "
                     f"{1e3 * t.get('launch', 0):.1f} | {1e3 * t.get('prefill', 0):.1f} | "
                     f"{t.get('n.prefill_tokens', 0)} | {t.get('n.groups', 0)} | "
                     f"{t.get('n.group_rows', 0)} | {t.get('n.decoded', 0)} |")
    return "\n".join(L)


def format_profile(eng_prof, raw_prof, B, new):
    m = eng_prof["mean_ms"]
    md = eng_prof["median_ms"]
    r = raw_prof

    def row(name, key, note=""):
        return f"| {name} | {m.get(key, 0):.3f} | {md.get(key, 0):.3f} | {note} |"

    launch_rest = m["launch"] - m["launch.fwd_build"] - m["launch.sample"] - m["launch.async_eval"]
    read_rest = m["read.py"] - m["read.accept"]
    host = m["period"] - m["read.wait"]
    lines = [
        f"Engine per decode step at B={B} ({eng_prof['nticks']} steady ticks, all rows "
        f"decoding, no prefill); ms per step:",
        "",
        "| where | mean ms | median ms | note |",
        "|---|---|---|---|",
        row("step period (tick start to tick start)", "period",
            f"= {B / m['period'] * 1e3:,.0f} tok/s"),
        row("worker: tick total", "tick"),
        row("  _filter", "filter"),
        row("  _join", "join"),
        row("    _align (inside _filter/_join)", "align"),
        row("  _launch", "launch"),
        row("    model forward (graph build)", "launch.fwd_build"),
        row("    sampler.sample (graph build)", "launch.sample"),
        row("    mx.async_eval (launch)", "launch.async_eval"),
        f"|     rest of _launch (per-row Python) | {launch_rest:.3f} | | |",
        row("  _prefill", "prefill"),
        row("  _read: blocked waiting for device", "read.wait",
            "device still busy with step N"),
        row("  _read: tolist + per-row Python", "read.py"),
        row("    of which _accept (all rows)", "read.accept",
            f"{1e3 * m['read.accept'] / B:.2f} us/row"),
        f"|     rest of _read | {read_rest:.3f} | | |",
        row("  _kv_report", "kv_report"),
        row("  rest of tick (TickReport, RowUpdates, mx.clear_cache...)", "tick.rest"),
        row("loop side: gap between ticks", "gap"),
        row("  Engine._apply", "apply"),
        row("  rest of gap (thread handoff, _serve, scheduler.admit)", "gap.rest"),
        f"| **host busy per step (period - wait)** | {host:.3f} | | |",
        "",
        f"Raw loop at B={B}: step {r['step_ms']:.3f} ms (= {B / r['step_ms'] * 1e3:,.0f} "
        f"tok/s): forward graph build {r['build_ms']:.3f}, argmax+async_eval "
        f"{r['argmax_async_eval_ms']:.3f}, blocked in tolist {r['wait_tolist_ms']:.3f}; "
        f"host busy {r['step_ms'] - r['wait_tolist_ms']:.3f} ms/step.",
    ]
    if "sync_step_ms" in r:
        lines.append(
            f"Raw loop fully synchronous (mx.eval every step, no overlap): "
            f"{r['sync_step_ms']:.3f} ms/step, of which graph build {r['sync_build_ms']:.3f}"
            f" -> launch + device ~ {r['sync_step_ms'] - r['sync_build_ms']:.3f} ms/step.")
    return "\n".join(lines)
