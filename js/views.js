// Pure helpers for what the widget's rows and charts choose to show: which rows fit the
// window, the part of a templated prompt that differs, a structured row's verdict, the
// liveness of the kernel, the step chart's scale and step numbers. No DOM here.
// mlxnb/notebook/frontend.py inlines this file (after lib.js) into the widget's ESM.

// ---------------------------------------------------------------- row window
const ACTIVE = new Set(["prefill", "decode"]);

/**
 * Which rows a collapsed list shows: every running row first (a teacher must see
 * what moves), then the rows next in line (queued, in order), then the most recently
 * listed others. Returns {shown: boolean[], hidden}; `states[i]` is row i's state.
 * With `expanded`, or when all fit, everything is shown.
 */
export function pickVisible(states, limit, expanded = false, newest = false) {
  const n = states.length;
  const shown = new Array(n).fill(false);
  if (expanded || n <= limit) return { shown: shown.fill(true), hidden: 0 };
  let left = limit;
  const take = (i) => { if (left > 0 && !shown[i]) { shown[i] = true; left--; } };
  const order = [...Array(n).keys()];
  for (const i of order) if (ACTIVE.has(states[i])) take(i);
  const firstLive = states.findIndex((s) => s !== "done");
  if (firstLive < 0) { // all done: a run shows its first rows, a dashboard its newest
    for (const i of newest ? order.reverse() : order) take(i);
  } else {
    for (let i = firstLive; i < n; i++) if (states[i] === "queued") take(i);
    // then the rows just before the activity (finished last), nearest first
    for (let i = n - 1; i >= 0; i--) if (!shown[i] && (newest || i < firstLive)) take(i);
    for (const i of order) take(i);
  }
  return { shown, hidden: n - limit };
}

// ---------------------------------------------------------------- prompts
const MIN_COMMON = 12; // a shared head or tail shorter than this is left alone

/** Lengths of the head and tail every prompt shares, cut back to word boundaries, so
 *  rows made from one template show the part that differs. Fewer than two distinct
 *  prompts: nothing shared is elided. */
export function commonParts(prompts) {
  const ps = prompts.map((p) => (p || "").replace(/\s+/g, " ").trim());
  if (new Set(ps).size < 2) return { head: 0, tail: 0 };
  const shortest = Math.min(...ps.map((p) => p.length));
  let head = 0;
  while (head < shortest && ps.every((p) => p[head] === ps[0][head])) head++;
  while (head > 0 && !/\s/.test(ps[0][head - 1])) head--; // whole words only
  let tail = 0;
  const room = shortest - head;
  while (tail < room && ps.every((p) => p[p.length - 1 - tail] === ps[0][ps[0].length - 1 - tail])) tail++;
  while (tail > 0 && !/\s/.test(ps[0][ps[0].length - tail])) tail--;
  // keep one shared word on each side as context ("…student 07 wrote …"), where the
  // rest is still long enough to be worth eliding
  const p0 = ps[0];
  let h2 = head - 1;
  while (h2 > 0 && !/\s/.test(p0[h2 - 1])) h2--;
  if (h2 >= MIN_COMMON) head = h2;
  let t2 = tail - 1;
  while (t2 > 0 && !/\s/.test(p0[p0.length - t2])) t2--;
  if (t2 >= MIN_COMMON) tail = t2;
  return { head: head >= MIN_COMMON ? head : 0, tail: tail >= MIN_COMMON ? tail : 0 };
}

/** One prompt for its column: the shared head and tail shown as "…". */
export function promptLabel(prompt, parts) {
  let p = (prompt || "").replace(/\s+/g, " ").trim();
  if (!parts || (!parts.head && !parts.tail) || p.length <= parts.head + parts.tail) return p;
  p = p.slice(parts.head, p.length - parts.tail).trim();
  return (parts.head ? "…" : "") + p + (parts.tail ? " …" : "");
}

// ---------------------------------------------------------------- structured rows
/**
 * A structured row's verdict, shown on the row itself: {mark, text, valid} or null
 * (no constraint, or not finished). `r.con` is its kind, `r.parse` "ok", "pending"
 * or why its output breaks the constraint.
 */
export function verdict(r) {
  if (!r || !r.con || r.state !== "done" || !r.parse || r.parse === "pending") return null;
  if (r.parse === "ok") return { valid: true, mark: `${r.con} ✓`, text: `${r.con} ✓ valid` };
  // what to do about it first: "(cut by max_tokens: raise --max-tokens)" leads
  const m = /\s*\((cut by [^)]*)\)\s*$/.exec(r.parse);
  const why = m ? `${m[1]}: ${r.parse.slice(0, m.index)}` : r.parse;
  return { valid: false, mark: `${r.con} ✗`, text: `${r.con} ✗ ${why}` };
}

// ---------------------------------------------------------------- cut text
/** The mark of a row whose text the widget's state holds cut (`r.cut`: characters
 *  left out; mlxnb/notebook/textcap.py), "" for a whole one: a reader of a saved
 *  notebook must know the text stops short, and where the rest is. */
export function cutNote(r, dashboard = false) {
  if (!r || !(r.cut > 0)) return "";
  return `… [${r.cut} more characters: see ${dashboard ? "its run's " : "run."}texts]`;
}

const codePoints = (s) => { let n = 0; for (const _ of s) n++; return n; };

/** `next` (a state built from the traits) with each cut row's whole text put back
 *  where `prev` (this view's state) streamed all of it: the cut bounds what a notebook
 *  file holds, not what an open view already shows. The cut count is in characters as
 *  Python counts them (code points). Returns `next`. */
export function keepWholeText(prev, next) {
  if (!prev || !prev.rows) return next;
  for (const [id, r] of next.rows) {
    const old = r.cut > 0 ? prev.rows.get(id) : null;
    if (!old || old.cut || old.state !== "done" || typeof old.text !== "string") continue;
    const head = r.text || "";
    if (!old.text.startsWith(head) || codePoints(old.text) !== codePoints(head) + r.cut) continue;
    const { cut: _cut, ...whole } = r;
    whole.text = old.text;
    if (old.drafted_spans) whole.drafted_spans = old.drafted_spans;
    next.rows.set(id, whole);
  }
  return next;
}

// ---------------------------------------------------------------- liveness
/**
 * Whether the kernel behind a view is gone, from the widget manager anywidget hands
 * over (`model.widget_manager`; JupyterLab 4 and Notebook 7 give it a `kernel`
 * getter): true (shut down, dead, disposed), false (there), null (cannot tell:
 * another front end; the sync probe decides there).
 */
export function kernelGone(mgr) {
  if (!mgr || typeof mgr !== "object") return null;
  let k;
  try {
    if (!("kernel" in mgr)) return null;
    k = mgr.kernel;
  } catch (e) {
    return null; // a disposed manager may throw
  }
  if (k == null) return true; // the session has no kernel any more
  if (k.isDisposed) return true;
  return k.status === "dead" || k.status === "autorestarting" || k.status === "restarting";
}

/** The header's note for a view whose rows no kernel runs, by why it knows. */
export function staleNote(why) {
  if (why === "kernel") return "not live: the kernel shut down (rows not done are unfinished)";
  if (why === "comm") return "not live: the kernel restarted (rows not done are unfinished)";
  return "not live: no kernel answered (rows not done are unfinished)";
}

// ---------------------------------------------------------------- step chart
/** q-quantile (0..1) of numbers, by the nearest rank below. */
export function quantile(values, q) {
  if (!values.length) return 0;
  const s = [...values].sort((a, b) => a - b);
  return s[Math.max(0, Math.min(s.length - 1, Math.floor(q * (s.length - 1))))];
}

/**
 * The step-time axis's top: the largest value unless a few steps dwarf the rest (a
 * long prompt's prefill), then a little over the 90th percentile, and those steps are
 * drawn clipped at the top with their value written there. {top, clipped, max}.
 */
export function robustTop(values, ratio = 4) {
  const max = values.length ? Math.max(...values) : 0;
  if (values.length < 8) return { top: max, clipped: false, max };
  const q = quantile(values, 0.9);
  if (!(q > 0) || max <= ratio * q) return { top: max, clipped: false, max };
  return { top: 1.5 * q, clipped: true, max };
}

/** What the step axis counts: a run's steps from 1 (its first step is `step0` + 1), a
 *  dashboard's the engine's own numbers. */
export function stepAxis(header) {
  const base = header && header.mode === "run" && header.step0 != null ? header.step0 : 0;
  return { base, name: base ? "run step" : "step", label: (s) => String(Math.round(s - base)) };
}

/** The step chart's key: what each mark means. */
export const STEP_LEGEND = [
  { key: "dt", mark: "─", text: "step time (ms, left)" },
  { key: "b", mark: "▮", text: "batch size (right)" },
  { key: "pf", mark: "■", text: "step prefilled a prompt" },
  { key: "tk", mark: "┄", text: "tokens emitted per step (right; above the batch: accepted drafts)" },
  { key: "clip", mark: "▲", text: "off the scale (the largest written at the top)" },
];

/** The step chart's tokens-per-step series: points [index, tokens] (steps a saved
 *  state has no count for are skipped), its top, and how many points emitted more
 *  tokens than the batch had rows (speculative steps whose drafts held). */
export function tokenSeries(hist) {
  const { tk, b } = hist;
  const pts = [];
  let top = 0, gained = 0;
  for (let i = 0; i < (tk ? tk.length : 0); i++) {
    const v = tk[i];
    if (v == null || !Number.isFinite(v)) continue;
    pts.push([i, v]);
    top = Math.max(top, v);
    if (b && b[i] != null && v > b[i] + 1e-9) gained++;
  }
  return { pts, top, gained };
}

// ---------------------------------------------------------------- row life
/** A row's phases from the stamps every row carries (a view without the kernel's
 *  trace: a saved notebook whose row was never opened live). */
export function stampPhases(r) {
  const out = [];
  if (r.t_submit == null) return out;
  out.push({ phase: "queued", t0: r.t_submit, t1: r.t_admit ?? null, why: [] });
  if (r.t_admit != null) out.push({ phase: "prefill", t0: r.t_admit, t1: r.t_first ?? null, tokens: r.prompt_tokens });
  if (r.t_first != null) {
    out.push({ phase: "first token", t: r.t_first });
    out.push({ phase: "decode", t0: r.t_first, t1: r.t_done ?? null, tokens: Math.max(0, (r.ntok || 0) - 1), tok_s: r.tok_s });
  }
  if (r.state === "done") out.push({ phase: "finish", t: r.t_done, reason: r.finish });
  for (const p of out) if (p.t0 != null) p.s = p.t1 != null ? p.t1 - p.t0 : null;
  return out;
}

const fmtS = (s) => {
  if (s == null || !isFinite(s)) return "…";
  return s < 1 ? `${+(s * 1000).toPrecision(3)} ms` : `${s.toFixed(2)} s`;
};

/**
 * The waterfall of a row's phases: one bar per phase on the row's own time axis
 * (submit .. done, or `now` while it runs). [{phase, label, left, width (percent of
 * the axis), text}]; a point event (first token, prefix hit, finish) has width 0.
 */
export function waterfall(trace, now) {
  if (!trace || !trace.length) return [];
  const start = trace[0].t0 ?? trace[0].t ?? 0;
  let end = start;
  for (const p of trace) end = Math.max(end, p.t1 ?? p.t ?? p.t0 ?? start);
  if (trace.some((p) => p.t0 != null && p.t1 == null) && now != null) end = Math.max(end, now);
  const span = Math.max(end - start, 1e-6);
  const pos = (t) => Math.max(0, Math.min(100, (100 * (t - start)) / span));
  let chunk = 0;
  return trace.map((p) => {
    const t0 = p.t0 ?? p.t, t1 = p.t0 != null ? (p.t1 ?? now ?? end) : p.t;
    const left = pos(t0), width = Math.max(0, pos(t1) - left);
    let label = p.phase, text = "";
    if (p.phase === "queued") {
      text = fmtS(p.s ?? (p.t1 == null ? null : p.t1 - p.t0));
      if (p.why && p.why.length) text += ` (${p.why.join(", ")})`;
      else if ((p.s ?? 0) > 0) text += " (waiting for a step)";
    } else if (p.phase === "prefix hit") {
      text = `${p.tokens} prompt tokens reused`;
    } else if (p.phase === "prefill") {
      chunk += 1;
      label = p.step != null ? `prefill chunk ${chunk}` : "prefill";
      text = `${p.tokens ?? "?"} tokens · ${fmtS(p.s)}` + (p.step != null ? ` · step ${p.step}` : "");
    } else if (p.phase === "first token") {
      text = `at ${fmtS(p.t - start)}`;
    } else if (p.phase === "decode") {
      text = `${p.tokens} tokens · ${fmtS(p.s)}` + (p.tok_s ? ` · ${p.tok_s.toFixed(1)} tok/s` : "");
    } else if (p.phase === "finish") {
      text = `${p.reason || "?"} at ${fmtS(p.t - start)}`;
    }
    return { phase: p.phase, label, left, width, text };
  });
}

// ---------------------------------------------------------------- token view
/** Background alpha for a token of probability p: the less likely, the stronger
 *  (surprising tokens stand out); unknown p: none. */
export function tokenShade(p) {
  if (p == null || !isFinite(p)) return 0;
  return +(0.5 * (1 - Math.max(0, Math.min(1, p)))).toFixed(3);
}
export const SHADE_RGB = [228, 155, 38]; // the step chart's prefill orange

/** The colour a token's background blends to over `bg` ([r, g, b]). */
export function blend(bg, alpha, rgb = SHADE_RGB) {
  return bg.map((c, i) => Math.round(c * (1 - alpha) + rgb[i] * alpha));
}

/** A token's text made visible: spaces as "·", newlines as "⏎". */
export function showPiece(s) {
  if (s == null) return "";
  return s.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/^ | $/g, "·") || "∅";
}

const pct = (p) => (p == null ? "?" : p >= 0.995 ? "100%" : p < 0.001 ? "<0.1%" : `${(100 * p).toFixed(1)}%`);

/** The info line for a token: its probability, the alternatives, the sampling. */
export function tokenInfo(it, sampling) {
  const parts = [`token ${it.i + 1}: “${showPiece(it.s ?? `<${it.id}>`)}”`];
  if (it.p !== undefined) parts.push(`p = ${pct(it.p)}`);
  if (it.top && it.top.length) {
    parts.push("top: " + it.top.map((a) => `“${showPiece(a.s ?? `<${a.id}>`)}” ${pct(a.p)}`).join(", "));
  }
  if (it.allowed != null) parts.push(`${it.allowed} token${it.allowed === 1 ? "" : "s"} allowed by the constraint here`);
  if (it.draft) parts.push("from an accepted draft");
  if (sampling) parts.push(samplingText(sampling));
  return parts.join(" · ");
}

/** A speculating row's drafts, `draft` = [accepted, verified]: one line for the row's
 * detail and the token count's tooltip; "" for a row that verified none. */
export function draftText(draft, ntok) {
  if (!draft || !draft[1]) return "";
  const [acc, prop] = draft;
  const share = ntok ? ` · ${acc} of its ${ntok} tokens came from drafts` : "";
  return `speculation: ${acc} of ${prop} drafted tokens accepted (${pct(acc / prop)})${share}`;
}

export function samplingText(s) {
  if (!s) return "";
  const t = s.temperature ?? 0;
  const out = [t > 0 ? `temperature ${t}` : "greedy (temperature 0; p at T = 1)"];
  if (t > 0) {
    if (s.top_p != null && s.top_p < 1) out.push(`top-p ${s.top_p}`);
    if (s.top_k) out.push(`top-k ${s.top_k}`);
    if (s.min_p) out.push(`min-p ${s.min_p}`);
  }
  if (s.repetition_penalty) out.push(`repetition penalty ${s.repetition_penalty}`);
  if (s.constraint) out.push(`${s.constraint} constraint (masked tokens have p 0)`);
  return out.join(", ");
}

// ---------------------------------------------------------------- step inspector
/** The step inspector's lines for a `step_detail` answer; `base` numbers run steps. */
export function stepLines(d, base = 0) {
  if (!d) return [];
  const name = base ? `step ${d.step - base} of this run (engine step ${d.step})` : `step ${d.step}`;
  if (d.missing) return [`${name}: no longer kept by the engine`];
  const lab = (id) => `row ${id}` + (d.labels && d.labels[id] ? ` “${d.labels[id]}”` : "");
  const lines = [`${name} · ${fmtS(d.dt_s)} · batch ${d.batch_size} decoding`];
  const b = d.batch_ids || [];
  lines.push(b.length ? `decoding: ${b.map((i) => `row ${i}`).join(", ")}` : "decoding: none");
  const pf = Object.entries(d.prefill_rows || {});
  lines.push(pf.length ? "prefill: " + pf.map(([i, n]) => `${lab(i)} +${n} tokens`).join(", ")
    : `prefill: ${d.prefill_tokens ? `${d.prefill_tokens} tokens` : "none"}`);
  const ended = d.ended || [];
  lines.push(ended.length ? "ended: " + ended.map((i) => `${lab(i)} (${(d.finish || {})[i] || "?"})`).join(", ")
    : "ended: none");
  const sp = d.split || {};
  if (Object.keys(sp).length) {
    const names = { build: "graph build", launch: "launch", device: "waiting on the device",
      worker: "worker bookkeeping", loop: "engine loop" };
    lines.push("time: " + Object.entries(names).filter(([k]) => sp[k] != null)
      .map(([k, n]) => `${n} ${+sp[k].toFixed(2)} ms`).join(" · "));
  }
  const kb = (n) => formatKB(n);
  lines.push(`KV ${kb(d.kv_bytes)}` + (d.kv_budget ? ` of ${kb(d.kv_budget)} budget` : " (no budget)"));
  return lines;
}

/** The step inspector's line for a step it has no record of: still asking the
 *  kernel, or none answered (a saved notebook keeps the steps inspected live only). */
export function stepNote(n, asking) {
  return asking ? `step ${n}: asking the kernel…`
    : `step ${n}: not inspected while the kernel ran (inspect steps while it runs; the notebook keeps those)`;
}

/** The row view's line where its tokens would be: a finished row no handle holds
 *  any more (`d.gone`), a view that cannot ask (`quiet`), or still asking. */
export function tokensNote(d, quiet) {
  return d && d.gone ? "tokens: no longer held by the kernel (keep the run, e.g. -o run, to see them)"
    : quiet ? "tokens: open this row while its kernel runs to see them" : "tokens: asking the kernel…";
}

function formatKB(n) {
  if (n == null) return "–";
  const u = ["B", "KB", "MB", "GB"];
  let i = 0, v = n;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return `${i ? v.toFixed(1) : v} ${u[i]}`;
}

/** The point of a step chart nearest x (pixels): its index, or -1. */
export function nearestIndex(xs, x) {
  let best = -1, bd = Infinity;
  for (let i = 0; i < xs.length; i++) {
    const d = Math.abs(xs[i] - x);
    if (d < bd) { bd = d; best = i; }
  }
  return best;
}
