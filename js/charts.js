// The widget's canvas charts (KV memory, step time, timeline) and its small DOM helpers.
// Drawn from the view state (lib.js); no state of their own beyond what a click needs
// (canvas._hit). mlxnb/notebook/frontend.py inlines this file into the widget's ESM.
import { BADGES, bytesTicks, formatBytes, formatDuration, isDark, niceTicks, rowColor, scaleLinear, stackSnaps, timelineSpans } from "./lib.js";
import { robustTop, stepAxis, tokenSeries } from "./views.js";

export const TIMELINE_LANES = 48; // the newest rows get a lane; older ones scroll off

export function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

export function setAttr(e, k, v) {
  const s = v == null ? "" : String(v);
  if (e.getAttribute(k) !== s) e.setAttribute(k, s);
}

export function setText(e, s) {
  if (e.textContent !== s) e.textContent = s;
}

// ---------------------------------------------------------------- canvas helpers
/** The background the widget sits on: the first opaque one up the tree. */
function backdrop(el) {
  for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
    const bg = getComputedStyle(e).backgroundColor;
    if (bg && bg !== "transparent" && !/rgba\(.*,\s*0\)$/.test(bg)) return bg;
  }
  return "#ffffff";
}

/** Light or dark badges, decided from the real backdrop (JupyterLab, Notebook 7 and
 *  VS Code themes all end up as a background colour). */
export function applyTheme(root) {
  const theme = isDark(backdrop(root)) ? "dark" : "light";
  if (root.dataset.theme === theme) return;
  root.dataset.theme = theme;
  for (const [kind, [fg, bg]] of Object.entries(BADGES[theme])) {
    root.style.setProperty(`--mlxnb-badge-${kind}-fg`, fg);
    root.style.setProperty(`--mlxnb-badge-${kind}-bg`, bg);
  }
}

export function colors(root) {
  const cs = getComputedStyle(root);
  const v = (k, d) => (cs.getPropertyValue(k) || "").trim() || d;
  return {
    fg: v("--mlxnb-fg", "#333"), muted: v("--mlxnb-muted", "#888"),
    grid: v("--mlxnb-grid", "rgba(128,128,128,0.25)"), accent: v("--mlxnb-accent", "#4e79a7"),
    warn: v("--mlxnb-warn", "#e49b26"), err: v("--mlxnb-err", "#d9534f"),
    other: v("--mlxnb-other", "rgba(128,128,128,0.35)"), ok: v("--mlxnb-ok", "#59a14f"),
    font: `10px ${v("--mlxnb-font", "sans-serif")}`,
  };
}

/** Size the canvas backing store to its CSS box; returns a ctx in CSS pixels or null. */
function prep(canvas) {
  const w = canvas.clientWidth, ht = canvas.clientHeight;
  if (!w || !ht) return null; // hidden (collapsed output, windowed notebook)
  const dpr = window.devicePixelRatio || 1;
  const W = Math.round(w * dpr), H = Math.round(ht * dpr);
  if (canvas.width !== W || canvas.height !== H) { canvas.width = W; canvas.height = H; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, ht);
  return { ctx, w, h: ht };
}

function yAxis(g, c, box, ticks, fmt, right = false) {
  const { ctx } = g;
  const y = scaleLinear(ticks.min, ticks.max, box.b, box.t);
  ctx.font = c.font; ctx.textBaseline = "middle";
  ctx.textAlign = right ? "left" : "right";
  for (const v of ticks.ticks) {
    const py = Math.round(y(v)) + 0.5;
    if (!right) {
      ctx.strokeStyle = c.grid; ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(box.l, py); ctx.lineTo(box.r, py); ctx.stroke();
    }
    ctx.fillStyle = c.muted;
    ctx.fillText(fmt(v), right ? box.r + 3 : box.l - 3, py);
  }
  return y;
}

function xLabels(g, c, box, lo, hi, fmt, name = "") {
  const { ctx } = g;
  const t = niceTicks(lo, hi, Math.max(2, Math.floor((box.r - box.l) / 70)));
  const x = scaleLinear(lo, hi, box.l, box.r);
  ctx.font = c.font; ctx.fillStyle = c.muted; ctx.textAlign = "center"; ctx.textBaseline = "top";
  const reserve = name ? ctx.measureText(name).width + 6 : 0; // the axis name's corner
  for (const v of t.ticks) {
    if (v < lo || v > hi) continue;
    const s = fmt(v), half = ctx.measureText(s).width / 2, px = x(v);
    // keep edge labels inside the canvas instead of clipping them
    const cx = Math.min(Math.max(px, half + 1), g.w - half - 1);
    if (cx - half < reserve) continue;
    ctx.fillText(s, cx, box.b + 3);
  }
  return x;
}

/** The x axis's name in the bottom-left corner, under the y labels. */
function xName(g, c, box, name) {
  const { ctx } = g;
  ctx.font = c.font; ctx.fillStyle = c.muted; ctx.textAlign = "left"; ctx.textBaseline = "top";
  ctx.fillText(name, 1, box.b + 3);
}

function empty(g, c, msg) {
  g.ctx.font = c.font; g.ctx.fillStyle = c.muted; g.ctx.textAlign = "center";
  g.ctx.textBaseline = "middle"; g.ctx.fillText(msg, g.w / 2, g.h / 2);
}

// ---------------------------------------------------------------- charts
export function drawKV(canvas, st, c, hl) {
  const snaps = st.hist.snap;
  setAttr(canvas, "data-points", snaps.length);
  const g = prep(canvas);
  if (!g) return;
  // A server engine publishes its KV use as a fraction of its cache, or not at all.
  const unit = st.header.kv_unit === undefined ? "bytes" : st.header.kv_unit;
  setAttr(canvas, "data-reported", unit === null ? "0" : "1");
  if (unit === null) return empty(g, c, "KV memory: not reported by this server");
  if (!snaps.length) return empty(g, c, "KV memory: no steps yet");
  const frac = unit === "fraction";
  const { ctx } = g;
  const box = { l: 44, r: g.w - 6, t: 6, b: g.h - 14 };
  const { ids, tops, totals } = stackSnaps(snaps);
  const peak = Math.max(...totals, frac ? 0.01 : 1);
  const budget = frac ? 1 : st.header.kv_budget;
  const showBudget = budget && budget <= 3 * peak; // else the rows would be a flat line
  const yTop = (showBudget ? Math.max(peak, budget) : peak) * 1.05;
  const yt = frac ? niceTicks(0, yTop, 3) : bytesTicks(yTop);
  const fmt = frac ? (v) => `${Math.round(100 * v)}%` : formatBytes;
  const y = yAxis(g, c, box, yt, fmt);
  const s0 = snaps[0][0], s1 = Math.max(snaps[snaps.length - 1][0], s0 + 1);
  const ax = stepAxis(st.header);
  const x = xLabels(g, c, box, s0, s1, ax.label, ax.name);
  xName(g, c, box, ax.name);
  const xs = snaps.map((s) => x(s[0]));
  const band = (lo, hi, fill) => {
    ctx.beginPath();
    ctx.moveTo(xs[0], y(hi[0]));
    for (let i = 1; i < xs.length; i++) ctx.lineTo(xs[i], y(hi[i]));
    for (let i = xs.length - 1; i >= 0; i--) ctx.lineTo(xs[i], y(lo ? lo[i] : 0));
    ctx.closePath(); ctx.fillStyle = fill; ctx.fill();
  };
  if (xs.length === 1) { // one snapshot: draw it as a thin bar, not an invisible line
    xs.push(xs[0] + 2); totals.push(totals[0]);
    for (const id of ids) tops.get(id).push(tops.get(id)[0]);
  }
  band(null, totals, c.other); // rows of other cells (and anything unattributed)
  let prev = null;
  for (const id of ids) {
    const top = tops.get(id);
    ctx.globalAlpha = hl == null ? 0.85 : id === hl ? 1 : 0.2;
    band(prev, top, rowColor(id)); ctx.globalAlpha = 1;
    prev = top;
  }
  // what a click needs to find the band under the pointer
  canvas._hit = { stack: { ids, tops }, xs: snaps.map((s) => x(s[0])), y, box };
  ctx.textAlign = "right"; ctx.textBaseline = "top"; ctx.font = c.font; ctx.fillStyle = c.fg;
  if (budget) {
    if (showBudget) {
      const py = Math.round(y(budget)) + 0.5;
      ctx.strokeStyle = c.err; ctx.setLineDash([4, 3]); ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(box.l, py); ctx.lineTo(box.r, py); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = c.err; ctx.fillText("budget", box.r - 2, py + 2);
    } else {
      ctx.fillText(`budget ${fmt(budget)} ↑`, box.r - 2, box.t);
    }
  }
}

export function drawSteps(canvas, st, c, sel) {
  const { s, dt, b, pf } = st.hist;
  setAttr(canvas, "data-points", s.length);
  const g = prep(canvas);
  if (!g) return;
  if (!s.length) return empty(g, c, "step time: no steps yet");
  const { ctx } = g;
  const box = { l: 36, r: g.w - 24, t: 6, b: g.h - 14 };
  const s0 = s[0], s1 = Math.max(s[s.length - 1], s0 + 1);
  const ax = stepAxis(st.header);
  const x = xLabels(g, c, box, s0, s1, ax.label, ax.name);
  xName(g, c, box, ax.name);
  // Batch size first, as a faint step area on the right axis, so the line stays on top.
  setAttr(canvas, "data-batch-reported", st.header.batch_reported === false ? "0" : "1");
  const tks = tokenSeries(st.hist);
  setAttr(canvas, "data-token-points", tks.pts.length);
  setAttr(canvas, "data-token-gains", tks.gained);
  if (st.header.batch_reported !== false) {
    // tokens per step share the batch axis: above the batch area, accepted drafts
    const bt = niceTicks(0, Math.max(1, ...b, tks.top), 2);
    const yb = scaleLinear(0, bt.max, box.b, box.t);
    ctx.beginPath(); ctx.moveTo(x(s[0]), box.b);
    for (let i = 0; i < s.length; i++) {
      ctx.lineTo(x(i ? s[i - 1] : s[0]), yb(b[i])); ctx.lineTo(x(s[i]), yb(b[i]));
    }
    ctx.lineTo(x(s[s.length - 1]), box.b); ctx.closePath();
    ctx.fillStyle = c.other; ctx.fill();
    yAxis(g, c, box, bt, (v) => String(v), true);
    if (tks.pts.length) {
      ctx.strokeStyle = c.ok; ctx.lineWidth = 1; ctx.setLineDash([3, 2]); ctx.beginPath();
      tks.pts.forEach(([i, v], j) => (j ? ctx.lineTo : ctx.moveTo).call(ctx, x(s[i]), yb(v)));
      ctx.stroke(); ctx.setLineDash([]);
    }
  } else {
    ctx.font = c.font; ctx.fillStyle = c.muted; ctx.textAlign = "right"; ctx.textBaseline = "top";
    ctx.fillText("batch: not reported by this server", box.r, box.t);
  }
  // One slow prefill step must not flatten every decode step: past a few times the
  // 90th percentile the axis stops and those steps are drawn clipped, value written.
  const rt = robustTop(dt);
  setAttr(canvas, "data-clipped", rt.clipped ? dt.filter((v) => v > rt.top).length : 0);
  const yt = niceTicks(0, Math.max(0.1, rt.top), 3);
  const y = yAxis(g, c, box, yt, (v) => (v >= 10 ? v.toFixed(0) : +v.toFixed(2)) + "");
  setAttr(canvas, "data-ymax", yt.max);
  const yc = (v) => y(Math.min(v, yt.max));
  ctx.strokeStyle = c.accent; ctx.lineWidth = 1.25; ctx.beginPath();
  for (let i = 0; i < s.length; i++) (i ? ctx.lineTo : ctx.moveTo).call(ctx, x(s[i]), yc(dt[i]));
  if (s.length === 1) ctx.lineTo(x(s[0]) + 2, yc(dt[0]));
  ctx.stroke();
  ctx.fillStyle = c.warn; // steps that prefilled a prompt chunk: where joiners stall the batch
  for (let i = 0; i < s.length; i++) if (pf[i] > 0) ctx.fillRect(x(s[i]) - 1.5, yc(dt[i]) - 1.5, 3, 3);
  canvas._hit = { xs: s.map((v) => x(v)), steps: s.slice() };
  if (sel != null) { // the step the inspector shows
    const i = s.indexOf(sel);
    if (i >= 0) {
      ctx.strokeStyle = c.fg; ctx.setLineDash([3, 2]); ctx.lineWidth = 1;
      const px = Math.round(x(s[i])) + 0.5;
      ctx.beginPath(); ctx.moveTo(px, box.t); ctx.lineTo(px, box.b); ctx.stroke(); ctx.setLineDash([]);
    }
  }
  if (rt.clipped) {
    let top = -1;
    for (let i = 0; i < s.length; i++) {
      if (dt[i] <= yt.max) continue;
      if (top < 0 || dt[i] > dt[top]) top = i;
      const px = x(s[i]);
      ctx.fillStyle = c.err; ctx.beginPath(); // a triangle at the top: off the scale
      ctx.moveTo(px, box.t); ctx.lineTo(px - 3.5, box.t + 5); ctx.lineTo(px + 3.5, box.t + 5);
      ctx.closePath(); ctx.fill();
    }
    // the largest one's value, written beside it (one label: several would overlap)
    const label = `max ${formatDuration(dt[top] / 1000)}`;
    ctx.font = c.font; ctx.textBaseline = "top"; ctx.textAlign = "left"; ctx.fillStyle = c.fg;
    const w = ctx.measureText(label).width, px = x(s[top]);
    ctx.fillText(label, px + 6 + w <= box.r ? px + 6 : Math.max(box.l, px - 6 - w), box.t + 6);
  }
  return rt;
}

export function drawTimeline(canvas, st, c, now, hl, live, marks) {
  const rows = [...st.rows.values()].slice(-TIMELINE_LANES).filter((r) => r.t_submit != null);
  setAttr(canvas, "data-points", rows.length);
  const g = prep(canvas);
  if (!g) return;
  if (!rows.length) return empty(g, c, "timeline: no rows yet");
  const { ctx } = g;
  const box = { l: 6, r: g.w - 6, t: 4, b: g.h - 14 };
  const t0 = Math.min(...rows.map((r) => r.t_submit));
  let t1 = now;
  for (const r of rows) t1 = Math.max(t1, r.t_done ?? 0);
  t1 = Math.max(t1, t0 + 0.01);
  const x = xLabels(g, c, box, 0, t1 - t0, (v) => (v ? formatDuration(v) : "0 s"));
  const lane = (box.b - box.t) / rows.length, bar = Math.max(1, Math.min(10, lane - 1));
  canvas._hit = { top: box.t, bottom: box.b, ids: rows.map((r) => r.id) };
  rows.forEach((r, i) => {
    const py = box.t + i * lane + (lane - bar) / 2;
    const dim = hl != null && r.id !== hl;
    for (const sp of timelineSpans(r, now)) {
      // queued: a thin grey line; prefill: outlined in the row's colour (an outline
      // reads on dark backgrounds, where a pale fill did not); decode: solid
      const q = sp.kind === "queued", hq = q ? Math.max(1, bar * 0.35) : bar;
      const xa = x(sp.t0 - t0), xb = x(sp.t1 - t0), w = Math.max(1, xb - xa);
      ctx.globalAlpha = dim ? 0.2 : 1;
      if (sp.kind === "prefill") {
        ctx.fillStyle = rowColor(r.id); ctx.globalAlpha *= 0.3;
        ctx.fillRect(xa, py, w, bar); ctx.globalAlpha = dim ? 0.2 : 1;
        ctx.strokeStyle = rowColor(r.id); ctx.lineWidth = 1;
        ctx.strokeRect(xa + 0.5, py + 0.5, Math.max(0, w - 1), Math.max(0, bar - 1));
      } else {
        ctx.fillStyle = q ? c.other : rowColor(r.id);
        ctx.fillRect(xa, py + (bar - hq) / 2, w, hq);
      }
      ctx.globalAlpha = 1;
    }
    if (r.id === hl && marks && marks.length) { // its prefill chunks' ends: the waterfall
      ctx.fillStyle = c.fg;
      for (const t of marks) ctx.fillRect(Math.round(x(t - t0)), py - 2, 1, bar + 4);
    }
    if (r.t_done != null && r.finish && r.finish !== "stop" && r.finish !== "length") {
      ctx.fillStyle = r.finish === "error" ? c.err : c.fg; // cancelled / error: an end mark
      ctx.fillRect(x(r.t_done - t0) - 1, py - 1, 2, bar + 2);
    }
  });
  if (live) {
    ctx.strokeStyle = c.muted; ctx.setLineDash([2, 2]);
    const px = Math.round(x(now - t0)) + 0.5;
    ctx.beginPath(); ctx.moveTo(px, box.t); ctx.lineTo(px, box.b); ctx.stroke();
    ctx.setLineDash([]);
  }
}
