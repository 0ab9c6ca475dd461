// Pure helpers for the mlxnb widget: state from traits, delta messages, step history,
// chart scaling, formatting. No DOM here, so `node --test` can exercise all of it.
// mlxnb/_frontend.py inlines this file into the widget's ESM bundle (anywidget loads
// one module).
import { staleNote } from "./views.js";

export const MAX_POINTS = 2000; // per step-history array (same bound as mlxnb/_stepchart.py)
export const MAX_SNAP_NUMBERS = 20000;
// tk: tokens emitted per step (a state saved before it has none: nulls)
export const STEP_KEYS = ["s", "t", "dt", "b", "pf", "kv", "tk"];

// ---------------------------------------------------------------- state
export function emptyHist() {
  const h = { snap: [] };
  for (const k of STEP_KEYS) h[k] = [];
  return h;
}

export function emptyState() {
  return { seq: -1, rows: new Map(), hist: emptyHist(), header: {}, recvAt: 0 };
}

/** Rebuild the whole view state from the synced traits (a new view, a resync). */
export function stateFromTraits({ rows, steps, header, seq }) {
  const st = emptyState();
  st.seq = seq ?? 0;
  for (const r of rows || []) st.rows.set(r.id, { text: "", ...r });
  const h = emptyHist();
  const n = (steps && steps.s) ? steps.s.length : 0;
  for (const k of STEP_KEYS) h[k] = (steps && steps[k]) ? steps[k].slice() : new Array(n).fill(null);
  h.snap = (steps && steps.snap) ? steps.snap.slice() : [];
  st.hist = h;
  st.header = { ...(header || {}) };
  return st;
}

/** Traits replace the view state unless the view already holds newer deltas. */
export function shouldTakeTraits(st, traitSeq) {
  return st.seq < 0 || (traitSeq ?? 0) >= st.seq;
}

/** Fold one row delta into a row object: "d" appends text, "text" replaces it. */
export function applyRowDelta(row, delta) {
  const r = row || { id: delta.id, text: "", state: "queued", ntok: 0 };
  for (const k in delta) {
    if (k === "d") r.text = (r.text || "") + delta.d;
    else r[k] = delta[k];
  }
  return r;
}

/**
 * Apply a {"type":"delta"} message. Returns {applied, gap, changed:Set<id>, steps, header}.
 * A message older than the state is ignored; a gap (a message this view never got,
 * e.g. sent before the view existed) means the caller must ask for a resync.
 */
export function applyMessage(st, msg, now = 0) {
  const out = { applied: false, gap: false, changed: new Set(), steps: false, header: false };
  if (!msg || msg.type !== "delta") return out;
  if (msg.seq <= st.seq) return out;
  if (msg.seq !== st.seq + 1) { out.gap = true; return out; }
  st.seq = msg.seq;
  for (const d of msg.rows || []) {
    st.rows.set(d.id, applyRowDelta(st.rows.get(d.id), d));
    out.changed.add(d.id);
  }
  if (msg.steps) { appendSteps(st.hist, msg.steps); out.steps = true; }
  if (msg.header) { Object.assign(st.header, msg.header); out.header = true; }
  st.recvAt = now;
  out.applied = true;
  if (pruneRows(st, st.header.max_rows).length) out.pruned = true;
  return out;
}

/** Dashboard bound: drop the oldest finished rows beyond maxRows. Returns dropped ids. */
export function pruneRows(st, maxRows) {
  const dropped = [];
  if (!maxRows || st.rows.size <= maxRows) return dropped;
  for (const [id, r] of st.rows) {
    if (st.rows.size <= maxRows) break;
    if (r.state === "done") { st.rows.delete(id); dropped.push(id); }
  }
  return dropped;
}

// ---------------------------------------------------------------- step history
/** Merge neighbouring pairs: later step kept, dt = max (spikes stay), prefill summed. */
export function halveSteps(h) {
  const n = Math.floor(h.s.length / 2) * 2;
  for (const k of STEP_KEYS) {
    const a = h[k], m = [];
    for (let i = 0; i < n; i += 2) {
      m.push(k === "dt" ? Math.max(a[i], a[i + 1]) : k === "pf" ? a[i] + a[i + 1] : a[i + 1]);
    }
    for (let i = n; i < a.length; i++) m.push(a[i]);
    h[k] = m;
  }
  return h;
}

export function snapNumbers(snaps) {
  let n = 0;
  for (const s of snaps) n += s[2].length;
  return n;
}

/** Every second snapshot (keeping the latest), the same rule as mlxnb/_stepchart.py. */
export function halveSnaps(snaps) {
  const out = [];
  for (let i = 1; i < snaps.length; i += 2) out.push(snaps[i]);
  if (snaps.length % 2) out.push(snaps[snaps.length - 1]);
  return out;
}

export function appendSteps(h, steps, max = MAX_POINTS) {
  const n = steps.s ? steps.s.length : 0; // a key a sender does not know: nulls, aligned
  for (const k of STEP_KEYS) for (let i = 0; i < n; i++) h[k].push(steps[k] ? steps[k][i] : null);
  while (h.s.length > max) halveSteps(h);
  if (steps.snap) for (const s of steps.snap) h.snap.push(s);
  while (h.snap.length > max || (h.snap.length > 2 && snapNumbers(h.snap) > MAX_SNAP_NUMBERS)) {
    h.snap = halveSnaps(h.snap);
  }
  return h;
}

/**
 * Stack per-row KV bytes of each snapshot [step, total, [id, bytes, ...]].
 * Returns {ids (ascending), tops: Map id -> cumulative top per snapshot, mine, totals}:
 * the band of row `id` at snapshot i spans [tops of the previous id, tops(id)][i].
 */
export function stackSnaps(snaps) {
  const idset = new Set();
  for (const s of snaps) for (let j = 0; j < s[2].length; j += 2) idset.add(s[2][j]);
  const ids = [...idset].sort((a, b) => a - b);
  const tops = new Map(ids.map((id) => [id, new Array(snaps.length).fill(0)]));
  const mine = new Array(snaps.length).fill(0);
  const totals = snaps.map((s) => s[1]);
  snaps.forEach((s, i) => {
    const by = new Map();
    for (let j = 0; j < s[2].length; j += 2) by.set(s[2][j], s[2][j + 1]);
    let acc = 0;
    for (const id of ids) { acc += by.get(id) || 0; tops.get(id)[i] = acc; }
    mine[i] = acc;
  });
  return { ids, tops, mine, totals };
}

// ---------------------------------------------------------------- scales
function niceNum(x) {
  const e = Math.floor(Math.log10(x)), f = x / 10 ** e;
  const nf = f <= 1.0000001 ? 1 : f <= 2.0000001 ? 2 : f <= 5.0000001 ? 5 : 10;
  return nf * 10 ** e;
}

/** Round axis bounds and about `count` ticks covering [lo, hi]. */
export function niceTicks(lo, hi, count = 4) {
  if (!isFinite(lo) || !isFinite(hi)) { lo = 0; hi = 1; }
  if (hi < lo) [lo, hi] = [hi, lo];
  if (hi === lo) { hi = lo === 0 ? 1 : lo + Math.abs(lo) * 0.5; }
  // A 1/2/5 step no smaller than range/count: the axis overshoots the data by < 1 step.
  const step = niceNum((hi - lo) / Math.max(1, count));
  const min = Math.floor(lo / step) * step, max = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let v = min; v <= max + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return { min, max, step, ticks };
}

/** Linear map from [d0, d1] to [r0, r1]; a zero-width domain maps to its middle. */
export function scaleLinear(d0, d1, r0, r1) {
  const w = d1 - d0;
  const f = !w ? () => (r0 + r1) / 2 : (v) => r0 + ((v - d0) / w) * (r1 - r0);
  f.invert = (p) => (r1 === r0 ? d0 : d0 + ((p - r0) / (r1 - r0)) * w);
  return f;
}

/** Bytes ticks that land on 1/2/5 × 1024^k boundaries read well in binary units. */
export function bytesTicks(hi, count = 3) {
  if (!(hi > 0)) return niceTicks(0, 1024, count);
  const unit = 1024 ** Math.min(3, Math.max(0, Math.floor(Math.log(hi) / Math.log(1024))));
  const t = niceTicks(0, hi / unit, count);
  return { min: 0, max: t.max * unit, step: t.step * unit, ticks: t.ticks.map((v) => v * unit) };
}

// ---------------------------------------------------------------- timeline
/** [{kind: queued|prefill|decode, t0, t1}] for a row; open spans end at `now`. */
export function timelineSpans(r, now) {
  const out = [];
  const end = r.t_done ?? now;
  if (r.t_submit == null) return out;
  out.push({ kind: "queued", t0: r.t_submit, t1: r.t_admit ?? end });
  if (r.t_admit != null) out.push({ kind: "prefill", t0: r.t_admit, t1: r.t_first ?? end });
  if (r.t_first != null) out.push({ kind: "decode", t0: r.t_first, t1: end });
  return out.filter((s) => s.t1 >= s.t0);
}

/** Engine-clock "now" while live: last header time plus the wall time since it came
 *  (at most `cap` s: a silent kernel must not make the timeline run on forever). */
export function liveNow(header, recvAt, wallNow, cap = 5) {
  const base = header.now ?? 0;
  return header.live ? base + Math.min(cap, Math.max(0, (wallNow - recvAt) / 1000)) : base;
}

// ---------------------------------------------------------------- summaries
export function countStates(rows) {
  const c = { queued: 0, prefill: 0, decode: 0, done: 0 };
  for (const r of rows) c[r.state] = (c[r.state] || 0) + 1;
  return c;
}

/** Whole-run throughput from finished rows: tokens over first-admit..last-done. */
export function runStats(rows) {
  let tokens = 0, t0 = Infinity, t1 = -Infinity;
  for (const r of rows) {
    tokens += r.ntok || 0;
    if (r.t_admit != null) t0 = Math.min(t0, r.t_admit);
    if (r.t_done != null) t1 = Math.max(t1, r.t_done);
  }
  const span = t1 - t0;
  return { tokens, span: span > 0 ? span : 0, tok_s: span > 0 ? tokens / span : 0 };
}

/** A row's badge; `stale`: no kernel runs the rows any more (a saved or orphaned
 *  view), so a row that is not done is "unfinished", never "decoding". A structured
 *  row whose output breaks its constraint reads "invalid" (views.js `verdict` says why). */
export function badgeText(r, stale = false) {
  if (r.state === "done") return `${rowInvalid(r) ? "invalid" : "done"}: ${r.finish || "?"}`;
  if (stale) return "unfinished";
  if (r.state === "prefill") return `prefill ${Math.max(0, Math.min(100, r.pf ?? 0))}%`;
  if (r.state === "decode") return "decoding";
  return "queued";
}

// ---------------------------------------------------------------- formatting
export function formatBytes(n) {
  if (n == null || !isFinite(n)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0, v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  const s = i === 0 ? String(Math.round(v)) : v >= 100 ? v.toFixed(0) : v.toFixed(1);
  return `${n < 0 ? "-" : ""}${s} ${units[i]}`;
}

export function formatDuration(s) {
  if (s == null || !isFinite(s)) return "–";
  if (s < 0) return "-" + formatDuration(-s);
  if (s < 0.001) return `${(s * 1000).toFixed(2)} ms`;
  if (s < 1) return `${(s * 1000).toPrecision(3).replace(/\.0+$/, "")} ms`;
  if (s < 10) return `${s.toFixed(2)} s`;
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) {
    const m = Math.floor(s / 60);
    return `${m}m ${String(Math.floor(s - m * 60)).padStart(2, "0")}s`;
  }
  const h = Math.floor(s / 3600);
  return `${h}h ${String(Math.floor((s - h * 3600) / 60)).padStart(2, "0")}m`;
}

export function formatRate(x) {
  if (x == null || !isFinite(x)) return "–";
  return x >= 100 ? x.toFixed(0) : x.toFixed(1);
}

const insidePair = (s, i) => i > 0 && i < s.length && (s.charCodeAt(i) & 0xfc00) === 0xdc00;
/** The end of a text for a one-line view, newlines shown as ⏎; no cut splits an emoji. */
export function tailText(text, n = 240) {
  const from = text.length > n ? text.length - n + insidePair(text, text.length - n) : 0;
  return (from ? "…" + text.slice(from) : text).replace(/\r?\n/g, " ⏎ ");
}

export function oneLine(text, n = 240) {
  const t = text.replace(/\s+/g, " ").trim();
  return t.length > n ? t.slice(0, n - 1 - insidePair(t, n - 1)) + "…" : t;
}

// Row colours: golden-angle hues with three lightness levels, so neighbouring ids are
// far apart and colours do not repeat every ten rows (ten fixed hues did). Rows that
// still look alike can be picked out by highlighting (hover a row, click a chart).
export function rowColor(id) {
  const i = Math.abs(Math.trunc(id || 0));
  const hue = Math.round((i * 137.508 + 210) % 360);
  const light = [50, 64, 38][i % 3];
  return `hsl(${hue}, 62%, ${light}%)`;
}

// ---------------------------------------------------------------- layout
// The generated text is what a reader needs; badge, prompt and numbers give way to it.
// wide: one line per row; medium: the numbers move under the text; narrow: the text
// gets a line of its own under badge and prompt (widget.css, [data-layout]).
export const LAYOUT_WIDE = 900, LAYOUT_MEDIUM = 520;
export function layoutFor(width) {
  if (!(width > 0)) return "wide"; // not measured yet (hidden): the default
  return width >= LAYOUT_WIDE ? "wide" : width >= LAYOUT_MEDIUM ? "medium" : "narrow";
}

/** Rows shown when a widget holds more than `limit`: a run shows its first rows, a
 *  dashboard its newest; the rest sit behind a visible "N more rows" control. */
export function visibleRows(n, limit, expanded, newest = false) {
  if (expanded || n <= limit) return { start: 0, end: n, hidden: 0 };
  return newest ? { start: n - limit, end: n, hidden: n - limit }
    : { start: 0, end: limit, hidden: n - limit };
}

export function moreLabel(hidden, expanded, newest = false) {
  if (expanded) return "show fewer rows";
  const what = newest ? "earlier row" : "more row";
  return `${hidden} ${what}${hidden === 1 ? "" : "s"}`;
}

// ---------------------------------------------------------------- labels
export const CHART_TITLES = {
  kv: "KV memory per row, by step · budget",
  step: "step time ms, by step · batch size (right)",
  timeline: "rows over time (s): queued ─ · prefill (outlined) · decode",
};
export const X_AXIS = { kv: "step", step: "step", timeline: "seconds" };

/**
 * The header's numbers, each saying what it counts: "this run" (the widget's own
 * rows) apart from "engine" (every cell's rows, the engine's aggregate rate).
 */
export function headerParts(hd, rows, hist, stale = false) {
  const n = countStates(rows), parts = [];
  const live = hd.live && !stale;
  const dash = hd.mode === "dashboard";
  if (!dash) {
    let p = `this run: ${n.done}/${rows.length} done`;
    if (live) p += ` · ${n.prefill + n.decode} running · ${n.queued} queued`;
    else if (n.done < rows.length) p += ` · ${rows.length - n.done} unfinished`;
    parts.push(p);
  } else if (rows.length) {
    const rest = rows.length - n.done;
    parts.push(`showing ${rows.length} row${rows.length === 1 ? "" : "s"}: ` +
      (rest ? `${n.done} done` : "all done"));
  }
  if (live) {
    parts.push(`engine: ${hd.running ?? 0} running · ${hd.queued ?? 0} queued · ` +
      `${formatRate(hd.tok_s ?? 0)} tok/s`);
  } else if (rows.length) {
    const rs = runStats(rows);
    if (rs.span > 0) {
      parts.push(`${rs.tokens} tok in ${formatDuration(rs.span)} = ` +
        `${formatRate(rs.tok_s)} tok/s, all rows`);
    }
  }
  const kv = live ? hd.kv : Math.max(0, ...(hist ? hist.kv : []));
  // A server engine reports KV as a fraction of its cache (kv_unit), or not at all.
  if (hd.kv_unit === null) parts.push("KV: not reported by this server");
  else if (hd.kv_unit === "fraction") {
    parts.push(`server KV ${live ? "now" : "peak"} ${Math.round(100 * (kv || 0))}%`);
  } else {
    parts.push(`KV ${live ? "now" : "peak"} ${formatBytes(kv || 0)}` +
      (hd.kv_budget ? ` / ${formatBytes(hd.kv_budget)}` : ""));
  }
  if (hd.cache_kinds) parts.push(hd.cache_kinds);
  if (stale) parts.push(staleNote(stale));
  return parts;
}

/** A view that asked the kernel for its state and heard nothing for `wait` ms is not
 *  live, whatever its saved header says (a reopened notebook, an HTML export). */
export function isStale(live, askedAt, heardAt, now, wait = 5000) {
  return Boolean(live) && askedAt != null && heardAt < askedAt && now - askedAt > wait;
}

// ---------------------------------------------------------------- hit tests
/** The row whose lane contains y (timeline), or null. */
export function laneAt(y, top, bottom, ids) {
  if (!ids.length || y < top || y >= bottom) return null;
  return ids[Math.min(ids.length - 1, Math.floor(((y - top) / (bottom - top)) * ids.length))];
}

/** The row whose stacked KV band at snapshot i contains value v (bytes), or null. */
export function bandAt(stack, i, v) {
  let lo = 0;
  for (const id of stack.ids) {
    const hi = stack.tops.get(id)[i];
    if (v >= lo && v < hi) return id;
    lo = hi;
  }
  return null;
}

// ---------------------------------------------------------------- colours
/** [r, g, b] (0-255) from #rgb, #rrggbb or rgb()/rgba(); null if unparsable. */
export function parseColor(s) {
  if (!s) return null;
  s = String(s).trim();
  let m = /^#([0-9a-f]{3})$/i.exec(s);
  if (m) return [...m[1]].map((c) => parseInt(c + c, 16));
  m = /^#([0-9a-f]{6})/i.exec(s);
  if (m) return [0, 2, 4].map((i) => parseInt(m[1].slice(i, i + 2), 16));
  m = /^rgba?\(\s*([\d.]+)[\s,]+([\d.]+)[\s,]+([\d.]+)(?:[\s,/]+([\d.]+%?))?/i.exec(s);
  if (m) {
    if (m[4] !== undefined && parseFloat(m[4]) === 0) return null; // transparent
    return [1, 2, 3].map((i) => Math.round(parseFloat(m[i])));
  }
  return null;
}

function lin(c) {
  c /= 255;
  return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
}
export function luminance(rgb) {
  return 0.2126 * lin(rgb[0]) + 0.7152 * lin(rgb[1]) + 0.0722 * lin(rgb[2]);
}
/** WCAG 2 contrast ratio of two colours (1..21). */
export function contrast(a, b) {
  const la = luminance(parseColor(a)), lb = luminance(parseColor(b));
  return (Math.max(la, lb) + 0.05) / (Math.min(la, lb) + 0.05);
}
export function isDark(background) {
  const rgb = parseColor(background);
  return rgb ? luminance(rgb) < 0.2 : false;
}

// Badge colours per theme: each pair is at least 4.5:1 (WCAG AA for small text);
// test/lib.test.js checks every pair. widget.js sets them as CSS variables.
export const BADGES = {
  light: {
    queued: ["#3d3d3d", "#ebebeb"], prefill: ["#6b3f00", "#fbecd3"],
    decode: ["#154a85", "#e0ebf8"], done: ["#17602a", "#dff1e3"],
    cancelled: ["#3d3d3d", "#ebebeb"], error: ["#9b1c1c", "#fbe2e2"],
    unfinished: ["#7a2a00", "#fde8d8"], invalid: ["#8a1457", "#fbe0ef"],
  },
  dark: {
    queued: ["#dddddd", "#3a3a3a"], prefill: ["#ffd596", "#4a3312"],
    decode: ["#b3d4ff", "#1c3454"], done: ["#a6e3b0", "#1b3f24"],
    cancelled: ["#dddddd", "#3a3a3a"], error: ["#ffbcbc", "#5c2020"],
    unfinished: ["#ffc9a3", "#55290d"], invalid: ["#ffb3dc", "#521a3a"],
  },
};

/** A structured row that ran to its end (not stopped, no error) with output that
 *  breaks its constraint, e.g. JSON cut by max_tokens. */
export function rowInvalid(r) {
  return r.state === "done" && r.finish !== "error" && r.finish !== "cancelled" &&
    Boolean(r.con) && Boolean(r.parse) && r.parse !== "ok" && r.parse !== "pending";
}

/** Which badge colour pair a row takes. */
export function badgeKind(r, stale = false) {
  if (r.state === "done") {
    if (r.finish === "error") return "error";
    return rowInvalid(r) ? "invalid" : r.finish === "cancelled" ? "cancelled" : "done";
  }
  if (stale) return "unfinished";
  return r.state === "prefill" ? "prefill" : r.state === "decode" ? "decode" : "queued";
}
