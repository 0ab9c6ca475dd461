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
  return { valid: false, mark: `${r.con} ✗`, text: `${r.con} ✗ ${r.parse}` };
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
  return { base, name: base ? "step of this run" : "step", label: (s) => String(Math.round(s - base)) };
}

/** The step chart's key: what each mark means. */
export const STEP_LEGEND = [
  { key: "dt", mark: "─", text: "step time (ms, left)" },
  { key: "b", mark: "▮", text: "batch size (right)" },
  { key: "pf", mark: "■", text: "step prefilled a prompt" },
  { key: "clip", mark: "▲", text: "off the scale (value at top)" },
];
