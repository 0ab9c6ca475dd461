// mlxnb generation widget (anywidget ESM). State comes from the synced traits (a new
// view, a reopened notebook) and then from ~15 Hz "delta" custom messages; everything
// is redrawn at most once per animation frame. Charts are plain <canvas>.
import { BADGES, CHART_TITLES, applyMessage, badgeKind, badgeText, bandAt, bytesTicks, formatBytes, formatDuration, formatRate, headerParts, isDark, isStale, laneAt, layoutFor, liveNow, moreLabel, niceTicks, oneLine, rowColor, scaleLinear, shouldTakeTraits, stackSnaps, stateFromTraits, tailText, timelineSpans } from "./lib.js";
import { STEP_LEGEND, commonParts, kernelGone, nearestIndex, pickVisible, promptLabel, robustTop, samplingText, showPiece, stampPhases, stepAxis, stepLines, tokenInfo, tokenShade, verdict, waterfall } from "./views.js";

const TIMELINE_LANES = 48; // the newest rows get a lane; older ones scroll off
const ROW_LIMIT = 12; // rows listed before the "N more rows" control
const STALE_MS = 5000; // a sync request unanswered this long: no kernel runs the rows
const KERNEL_POLL_MS = 1000; // how often a live view asks its widget manager for the kernel

function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function setAttr(e, k, v) {
  const s = v == null ? "" : String(v);
  if (e.getAttribute(k) !== s) e.setAttribute(k, s);
}

function setText(e, s) {
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
function applyTheme(root) {
  const theme = isDark(backdrop(root)) ? "dark" : "light";
  if (root.dataset.theme === theme) return;
  root.dataset.theme = theme;
  for (const [kind, [fg, bg]] of Object.entries(BADGES[theme])) {
    root.style.setProperty(`--mlxnb-badge-${kind}-fg`, fg);
    root.style.setProperty(`--mlxnb-badge-${kind}-bg`, bg);
  }
}

function colors(root) {
  const cs = getComputedStyle(root);
  const v = (k, d) => (cs.getPropertyValue(k) || "").trim() || d;
  return {
    fg: v("--mlxnb-fg", "#333"), muted: v("--mlxnb-muted", "#888"),
    grid: v("--mlxnb-grid", "rgba(128,128,128,0.25)"), accent: v("--mlxnb-accent", "#4e79a7"),
    warn: v("--mlxnb-warn", "#e49b26"), err: v("--mlxnb-err", "#d9534f"),
    other: v("--mlxnb-other", "rgba(128,128,128,0.35)"),
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

function xLabels(g, c, box, lo, hi, fmt) {
  const { ctx } = g;
  const t = niceTicks(lo, hi, Math.max(2, Math.floor((box.r - box.l) / 70)));
  const x = scaleLinear(lo, hi, box.l, box.r);
  ctx.font = c.font; ctx.fillStyle = c.muted; ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (const v of t.ticks) {
    if (v < lo || v > hi) continue;
    const s = fmt(v), half = ctx.measureText(s).width / 2, px = x(v);
    // keep edge labels inside the canvas instead of clipping them
    ctx.fillText(s, Math.min(Math.max(px, half + 1), g.w - half - 1), box.b + 3);
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
function drawKV(canvas, st, c, hl) {
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
  const x = xLabels(g, c, box, s0, s1, ax.label);
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

function drawSteps(canvas, st, c, sel) {
  const { s, dt, b, pf } = st.hist;
  setAttr(canvas, "data-points", s.length);
  const g = prep(canvas);
  if (!g) return;
  if (!s.length) return empty(g, c, "step time: no steps yet");
  const { ctx } = g;
  const box = { l: 36, r: g.w - 24, t: 6, b: g.h - 14 };
  const s0 = s[0], s1 = Math.max(s[s.length - 1], s0 + 1);
  const ax = stepAxis(st.header);
  const x = xLabels(g, c, box, s0, s1, ax.label);
  xName(g, c, box, ax.name);
  // Batch size first, as a faint step area on the right axis, so the line stays on top.
  setAttr(canvas, "data-batch-reported", st.header.batch_reported === false ? "0" : "1");
  if (st.header.batch_reported !== false) {
    const bt = niceTicks(0, Math.max(1, ...b), 2);
    const yb = scaleLinear(0, bt.max, box.b, box.t);
    ctx.beginPath(); ctx.moveTo(x(s[0]), box.b);
    for (let i = 0; i < s.length; i++) {
      ctx.lineTo(x(i ? s[i - 1] : s[0]), yb(b[i])); ctx.lineTo(x(s[i]), yb(b[i]));
    }
    ctx.lineTo(x(s[s.length - 1]), box.b); ctx.closePath();
    ctx.fillStyle = c.other; ctx.fill();
    yAxis(g, c, box, bt, (v) => String(v), true);
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
    ctx.font = c.font; ctx.textBaseline = "top";
    let lastLabel = -Infinity;
    for (let i = 0; i < s.length; i++) {
      if (dt[i] <= yt.max) continue;
      const px = x(s[i]);
      ctx.fillStyle = c.err; ctx.beginPath(); // a triangle at the top: off the scale
      ctx.moveTo(px, box.t); ctx.lineTo(px - 3.5, box.t + 5); ctx.lineTo(px + 3.5, box.t + 5);
      ctx.closePath(); ctx.fill();
      const label = `${formatDuration(dt[i] / 1000)}`;
      const w = ctx.measureText(label).width;
      if (px - w / 2 > lastLabel + 4) { // labels that would overlap are left out
        ctx.fillStyle = c.fg; ctx.textAlign = "left";
        const lx = Math.min(Math.max(px + 5, box.l), box.r - w);
        ctx.fillText(label, lx, box.t);
        lastLabel = lx + w;
      }
    }
  }
  return rt;
}

function drawTimeline(canvas, st, c, now, hl, live, marks) {
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

// ---------------------------------------------------------------- view
function render({ model, el }) {
  const root = h("div", "mlxnb-widget");
  const head = h("div", "mlxnb-header");
  const hModel = h("span", "mlxnb-model"), hTitle = h("span", "mlxnb-title");
  const hStats = h("span", "mlxnb-stats");
  const stopAll = h("button", "mlxnb-stop-all", "stop all");
  head.append(hModel, hTitle, hStats, stopAll);
  const charts = h("div", "mlxnb-charts");
  const chart = (cls, title) => {
    const box = h("div", "mlxnb-chart"), cv = h("canvas", cls);
    const t = typeof title === "string" ? h("div", "mlxnb-chart-title", title) : title;
    box.append(t, cv);
    charts.append(box);
    return cv;
  };
  // The step chart's title is its key: a mark in each series' colour, then its meaning.
  const stepKey = h("div", "mlxnb-chart-title mlxnb-legend");
  const keyEls = {};
  for (const k of STEP_LEGEND) {
    const item = h("span", "mlxnb-key"), mark = h("span", "mlxnb-key-mark", k.mark);
    item.dataset.key = k.key;
    item.append(mark, " " + k.text);
    stepKey.append(item);
    keyEls[k.key] = item;
  }
  const cvKV = chart("mlxnb-chart-kv", CHART_TITLES.kv);
  const cvStep = chart("mlxnb-chart-step", stepKey);
  const cvTime = chart("mlxnb-chart-timeline", CHART_TITLES.timeline);
  // The detail panel: a row's life and tokens, or one step (opened by a click or key).
  const detail = h("div", "mlxnb-detail");
  detail.hidden = true;
  const dHead = h("div", "mlxnb-detail-head"), dTitle = h("span", "mlxnb-detail-title");
  const dClose = h("button", "mlxnb-detail-close", "close");
  dClose.title = "close the detail view (Esc)";
  const dBody = h("div", "mlxnb-detail-body");
  dHead.append(dTitle, dClose);
  detail.append(dHead, dBody);
  const rowsEl = h("div", "mlxnb-rows");
  const more = h("button", "mlxnb-more");
  root.append(head, charts, detail, rowsEl, more);
  cvStep.tabIndex = 0;
  cvStep.setAttribute("role", "button");
  cvStep.setAttribute("aria-label", "step time chart: click a step, or Enter and arrow keys, to inspect it");
  el.append(root);

  const readTraits = () => ({ rows: model.get("rows"), steps: model.get("steps"),
    header: model.get("header"), seq: model.get("seq") });
  let st = stateFromTraits(readTraits());
  st.recvAt = performance.now();
  const rowEls = new Map();
  let dirty = new Set(st.rows.keys()), relayout = true, raf = 0, traitsQueued = false;
  // Liveness: only a kernel sends custom messages (deltas, the "synced" answer);
  // trait changes can also come from restoring saved widget state.
  // `stale`: false, or why no kernel runs the rows ("answer": a sync went unanswered,
  // "kernel": the widget manager has no live kernel, "comm": the kernel restarted).
  let askedAt = -1e9, heardAt = -Infinity, stale = false, staleTimer = 0, commDown = false;
  let expanded = false, hl = null, pinned = false;
  let shared = { head: 0, tail: 0 }, stateMoved = false;

  const schedule = () => { if (!raf) raf = requestAnimationFrame(draw); };
  const checkStale = () => {
    staleTimer = 0;
    const now = performance.now();
    const was = stale;
    if (stale !== "kernel") {
      stale = isStale(st.header.live, askedAt, heardAt, now, STALE_MS) &&
        (commDown ? "comm" : "answer");
    }
    if (stale !== was) { dirty = new Set(st.rows.keys()); schedule(); }
    if (!stale && st.header.live && heardAt < askedAt) {
      staleTimer = setTimeout(checkStale, Math.max(50, askedAt + STALE_MS + 10 - now));
    }
  };
  const ask = (force = false) => { // a gap (deltas sent before this view existed), a first look
    const now = performance.now();
    if (!force && now - askedAt <= 2000) return;
    askedAt = now;
    try {
      model.send({ type: "sync" });
    } catch (e) { // no kernel connection at all (a static export)
    }
    if (!staleTimer) staleTimer = setTimeout(checkStale, STALE_MS + 10);
  };
  // Asked and not yet answered: stop buttons wait (a restored view may have no kernel).
  const pending = () => heardAt < askedAt;
  const heard = () => {
    if (stale || pending()) { stale = false; dirty = new Set(st.rows.keys()); schedule(); }
    heardAt = performance.now(); commDown = false;
  };
  // The kernel shut down or died: the widget manager knows at once, while a sync probe
  // would wait for its timeout (and a kernel busy in a long cell answers late, so the
  // probe alone cannot tell busy from gone).
  const pollKernel = () => {
    if (!st.header.live || stale === "kernel") return;
    if (kernelGone(model.widget_manager) === true) {
      stale = "kernel"; dirty = new Set(st.rows.keys()); schedule();
    }
  };
  const kernelPoll = setInterval(pollKernel, KERNEL_POLL_MS);
  // A restart drops the comm (the manager marks it not live): probe now.
  const onCommLive = () => { commDown = true; if (st.header.live) ask(true); };
  const onMsg = (msg) => {
    heard();
    if (msg && msg.type === "row_detail") {
      rowDetails.set(msg.id, msg);
      if (view && view.kind === "row" && view.id === msg.id) { detailDirty = true; schedule(); }
      return;
    }
    if (msg && msg.type === "step_detail") {
      stepDetails.set(msg.step, msg);
      if (view && view.kind === "step" && view.step === msg.step) { detailDirty = true; schedule(); }
      return;
    }
    const res = applyMessage(st, msg, performance.now());
    if (res.gap) return ask();
    if (!res.applied) return;
    for (const id of res.changed) { if (!rowEls.has(id)) relayout = true; dirty.add(id); }
    if (res.pruned) relayout = true;
    schedule();
  };
  const onTraits = () => { // several traits change in one update: take them once
    if (traitsQueued) return;
    traitsQueued = true;
    queueMicrotask(() => {
      traitsQueued = false;
      const t = readTraits();
      if (!shouldTakeTraits(st, t.seq)) return;
      st = stateFromTraits(t);
      st.recvAt = performance.now();
      dirty = new Set(st.rows.keys()); relayout = true;
      takeDetails(); detailDirty = true;
      schedule();
    });
  };
  const events = ["change:rows", "change:steps", "change:header", "change:seq", "change:details"];
  model.on("msg:custom", onMsg);
  model.on("comm_live_update", onCommLive);
  for (const ev of events) model.on(ev, onTraits);
  stopAll.addEventListener("click", () => model.send({ type: "stop_all" }));
  more.addEventListener("click", () => { expanded = !expanded; relayout = true; schedule(); });
  // Catch up on what was sent before us; with no answer the view is a saved snapshot.
  if (st.header.live) ask();

  // ------------------------------------------------------------ detail views
  // Their data comes when one opens (row_detail / step_detail answers); rows opened
  // while the kernel ran are also in the "details" trait, so a saved notebook has them.
  let view = null, detailDirty = false, selTok = -1, askedDetailAt = 0;
  const rowDetails = new Map(), stepDetails = new Map();
  function takeDetails() {
    const saved = model.get("details") || {};
    for (const [k, v] of Object.entries(saved)) if (!rowDetails.has(+k)) rowDetails.set(+k, v);
  }
  takeDetails();
  const canAsk = () => st.header.live !== undefined && !stale;
  const askDetail = (msg) => {
    if (!canAsk()) return;
    askedDetailAt = performance.now();
    try { model.send(msg); } catch (e) { /* no kernel connection (a static export) */ }
  };
  const openRow = (id) => {
    view = { kind: "row", id }; selTok = -1; detailDirty = true;
    highlight(id, true); if (hl !== id) highlight(id, true);
    askDetail({ type: "row_detail", id });
    schedule();
  };
  const openStep = (step) => {
    view = { kind: "step", step }; detailDirty = true;
    if (!stepDetails.has(step)) askDetail({ type: "step_detail", step });
    schedule();
  };
  const closeDetail = () => { view = null; detailDirty = true; schedule(); };
  dClose.addEventListener("click", closeDetail);
  root.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && view) closeDetail(); });
  const stepIndex = () => {
    const hit = cvStep._hit;
    if (!hit || !hit.steps.length) return -1;
    return view && view.kind === "step" ? hit.steps.indexOf(view.step) : -1;
  };
  cvStep.addEventListener("click", (ev) => {
    const hit = cvStep._hit;
    if (!hit) return;
    const i = nearestIndex(hit.xs, ev.clientX - cvStep.getBoundingClientRect().left);
    if (i >= 0) openStep(hit.steps[i]);
  });
  cvStep.addEventListener("keydown", (ev) => {
    const hit = cvStep._hit;
    if (!hit || !hit.steps.length) return;
    let i = stepIndex();
    if (ev.key === "Enter" || ev.key === " ") i = i < 0 ? hit.steps.length - 1 : i;
    else if (ev.key === "ArrowLeft") i = Math.max(0, (i < 0 ? hit.steps.length : i) - 1);
    else if (ev.key === "ArrowRight") i = Math.min(hit.steps.length - 1, i + 1);
    else return;
    ev.preventDefault();
    openStep(hit.steps[i]);
  });

  function drawRowDetail(id) {
    const r = st.rows.get(id), d = rowDetails.get(id);
    setText(dTitle, `row ${id}` + (r ? ` · ${oneLine(r.prompt || "", 80)}` : ""));
    setAttr(detail, "data-kind", "row"); setAttr(detail, "data-id", id);
    dBody.textContent = "";
    const trace = d && d.trace && d.trace.length ? d.trace : r ? stampPhases(r) : [];
    setAttr(detail, "data-trace", d && d.trace ? "kernel" : "stamps");
    const wf = h("div", "mlxnb-wf");
    const now = liveNow({ ...st.header, live: st.header.live && !stale }, st.recvAt, performance.now());
    for (const b of waterfall(trace, now)) {
      const line = h("div", "mlxnb-wf-row");
      line.dataset.phase = b.phase;
      const track = h("span", "mlxnb-wf-track"), bar = h("span", "mlxnb-wf-bar");
      bar.style.left = `${b.left}%`; bar.style.width = b.width ? `${b.width}%` : "2px";
      if (r) bar.style.background = b.phase === "queued" ? "" : rowColor(id);
      track.append(bar);
      line.append(h("span", "mlxnb-wf-label", b.label), track, h("span", "mlxnb-wf-text", b.text));
      wf.append(line);
    }
    dBody.append(h("div", "mlxnb-detail-sub", "life of the row"), wf);
    const tv = d && d.tokens;
    if (!tv) {
      dBody.append(h("div", "mlxnb-detail-note", stale || !st.header.live && !d
        ? "tokens: open this row while its kernel runs to see them"
        : "tokens: asking the kernel…"));
      return;
    }
    dBody.append(h("div", "mlxnb-detail-sub",
      `tokens (${tv.items.length}${tv.more ? ` of ${tv.items.length + tv.more}` : ""})` +
      (tv.probs ? ": shaded by how unlikely each was (darker = less likely)" : "")));
    if (d.why) dBody.append(h("div", "mlxnb-detail-note", d.why));
    const box = h("div", "mlxnb-tokens");
    box.tabIndex = 0;
    box.setAttribute("role", "listbox");
    box.setAttribute("aria-label", "tokens: arrow keys move, the line below describes the token");
    const info = h("div", "mlxnb-tokinfo");
    info.setAttribute("aria-live", "polite");
    const spans = tv.items.map((it) => {
      const e = h("span", "mlxnb-tok", showPiece(it.s ?? `<${it.id}>`));
      e.dataset.i = it.i;
      if (it.p != null) { e.dataset.p = it.p; e.style.background = `rgba(228, 155, 38, ${tokenShade(it.p)})`; }
      if (it.draft) e.dataset.draft = "1";
      e.setAttribute("role", "option");
      return e;
    });
    const select = (i) => {
      if (i < 0 || i >= spans.length) return;
      if (selTok >= 0 && spans[selTok]) spans[selTok].classList.remove("mlxnb-tok-sel");
      selTok = i; spans[i].classList.add("mlxnb-tok-sel");
      spans[i].setAttribute("aria-selected", "true");
      setText(info, tokenInfo(tv.items[i], tv.sampling));
      setAttr(info, "data-i", i);
    };
    box.append(...spans);
    box.addEventListener("mouseover", (ev) => { const i = ev.target.dataset && ev.target.dataset.i; if (i != null) select(+i); });
    box.addEventListener("click", (ev) => { const i = ev.target.dataset && ev.target.dataset.i; if (i != null) select(+i); });
    box.addEventListener("keydown", (ev) => {
      const k = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[ev.key];
      if (ev.key === "Home") select(0);
      else if (ev.key === "End") select(spans.length - 1);
      else if (k) select(Math.max(0, Math.min(spans.length - 1, (selTok < 0 ? -1 : selTok) + k)));
      else return;
      ev.preventDefault();
      spans[selTok].scrollIntoView({ block: "nearest" });
    });
    dBody.append(box, info);
    setText(info, `${samplingText(tv.sampling)}. Hover, tap or use the arrow keys on a token.`);
    if (selTok >= 0) select(selTok);
  }

  function drawStepDetail(step) {
    const d = stepDetails.get(step);
    const base = stepAxis(st.header).base;
    setText(dTitle, "step inspector");
    setAttr(detail, "data-kind", "step"); setAttr(detail, "data-step", step);
    dBody.textContent = "";
    if (!d) {
      dBody.append(h("div", "mlxnb-detail-note", canAsk()
        ? `step ${step - base}: asking the kernel…` : `step ${step - base}: the kernel is needed to inspect a step`));
      return;
    }
    const list = h("ul", "mlxnb-step-lines");
    for (const line of stepLines(d, base)) list.append(h("li", "", line));
    dBody.append(list);
  }

  function drawDetail() {
    // a running row's life grows: ask again now and then while it is open
    if (view && view.kind === "row") {
      const r = st.rows.get(view.id);
      if (r && r.state !== "done" && performance.now() - askedDetailAt > 1000) {
        askDetail({ type: "row_detail", id: view.id });
      }
    }
    if (!detailDirty) return;
    detailDirty = false;
    detail.hidden = !view;
    if (!view) { setAttr(detail, "data-kind", ""); return; }
    const a = document.activeElement, refocus = a && detail.contains(a) && a.className;
    if (view.kind === "row") drawRowDetail(view.id); else drawStepDetail(view.step);
    if (refocus) { const e = detail.querySelector("." + refocus.split(" ")[0]); if (e) e.focus(); }
  }

  const highlight = (id, pin = false) => {
    if (pinned && !pin) return;
    pinned = pin && id != null && !(pinned && hl === id);
    const next = pin && !pinned ? null : id;
    if (next === hl) return;
    if (hl != null && rowEls.has(hl)) rowEls.get(hl).e.classList.remove("mlxnb-hl");
    hl = next;
    if (hl != null && rowEls.has(hl)) rowEls.get(hl).e.classList.add("mlxnb-hl");
    setAttr(root, "data-hl", hl ?? "");
    schedule();
  };
  const pick = (canvas, ev, find) => {
    const r = canvas.getBoundingClientRect(), hit = canvas._hit;
    const id = hit ? find(hit, ev.clientX - r.left, ev.clientY - r.top) : null;
    highlight(id, true);
    const v = id != null && rowEls.get(id);
    if (v) {
      if (v.e.hidden) { expanded = true; relayout = true; draw(); }
      v.e.scrollIntoView({ block: "nearest" });
    }
  };
  cvTime.addEventListener("click", (ev) => pick(cvTime, ev, (hit, _x, y) =>
    laneAt(y, hit.top, hit.bottom, hit.ids)));
  cvKV.addEventListener("click", (ev) => pick(cvKV, ev, (hit, x, y) => {
    let i = 0; // the snapshot nearest the pointer
    for (let j = 1; j < hit.xs.length; j++) if (Math.abs(hit.xs[j] - x) < Math.abs(hit.xs[i] - x)) i = j;
    const inv = (py) => hit.box.b === hit.box.t ? 0 : hit.y.invert(py);
    return bandAt(hit.stack, i, inv(y));
  }));

  function rowView(id) {
    const e = h("div", "mlxnb-row");
    e.dataset.id = id;
    const sw = h("span", "mlxnb-swatch"); sw.style.background = rowColor(id);
    const badge = h("span", "mlxnb-badge"), prompt = h("span", "mlxnb-prompt");
    const text = h("span", "mlxnb-text"), inner = h("span", "mlxnb-text-inner");
    const verdictEl = h("span", "mlxnb-verdict"); // a structured row's ✓ / ✗ and why
    text.append(verdictEl, inner);
    const nums = h("span", "mlxnb-nums");
    const ntok = h("span", "mlxnb-num mlxnb-ntok"), rate = h("span", "mlxnb-num mlxnb-rate");
    const ttft = h("span", "mlxnb-num mlxnb-ttft"), stop = h("button", "mlxnb-stop", "■");
    nums.append(ntok, rate, ttft);
    stop.title = "stop this row";
    stop.addEventListener("click", (ev) => {
      ev.stopPropagation(); stop.disabled = true; v.stopped = true;
      model.send({ type: "stop", id });
    });
    text.addEventListener("click", () => { e.classList.toggle("mlxnb-expanded"); update(id); });
    // the prompt cell opens the row's detail: its life and its tokens
    prompt.tabIndex = 0;
    prompt.setAttribute("role", "button");
    prompt.addEventListener("click", (ev) => { ev.stopPropagation(); openRow(id); });
    prompt.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); openRow(id); }
    });
    e.addEventListener("mouseenter", () => highlight(id));
    e.addEventListener("mouseleave", () => highlight(null));
    e.append(sw, badge, prompt, text, nums, stop);
    const v = { e, badge, prompt, inner, verdict: verdictEl, ntok, rate, ttft, stop };
    rowEls.set(id, v);
    return v;
  }

  function update(id) {
    const r = st.rows.get(id), v = rowEls.get(id);
    if (!r || !v) return;
    if (v.e.getAttribute("data-state") !== r.state) stateMoved = true;
    setAttr(v.e, "data-state", r.state); setAttr(v.e, "data-ntok", r.ntok ?? 0);
    setAttr(v.e, "data-finish", r.state === "done" ? r.finish || "" : "");
    setText(v.badge, badgeText(r, stale)); setAttr(v.badge, "data-kind", badgeKind(r, stale));
    // A structured row (r.con: json, regex, choice, grammar): the badge says done or
    // invalid; the verdict, at the head of the text, says which constraint and why not.
    const vd = verdict(r);
    setText(v.verdict, vd ? vd.text : "");
    setAttr(v.e, "data-constraint", r.con || "");
    setAttr(v.e, "data-valid", vd ? (vd.valid ? "1" : "0") : "");
    setAttr(v.badge, "title", r.con ? `${r.con} constraint` + (vd ? `: ${vd.valid ? "valid" : r.parse}` : "") : "");
    setAttr(v.verdict, "title", vd && !vd.valid ? r.parse : "");
    setText(v.prompt, promptLabel(r.prompt || "", shared)); setAttr(v.prompt, "title", r.prompt || "");
    const text = r.error ? `error: ${r.error}` : r.text || "";
    const expandedRow = v.e.classList.contains("mlxnb-expanded");
    setText(v.inner, expandedRow ? text
      : r.state === "done" || stale ? oneLine(text, 400) : tailText(text, 240));
    setText(v.ntok, `${r.ntok ?? 0} tok`);
    setText(v.rate, r.tok_s != null ? `${formatRate(r.tok_s)} tok/s` : "");
    setText(v.ttft, r.ttft != null ? `ttft ${formatDuration(r.ttft)}` : "");
    v.stop.disabled = Boolean(v.stopped) || r.state === "done" || stale || pending();
    setAttr(v.e, "data-stale", stale ? "1" : "");
  }

  function drawHeader() {
    const hd = st.header, rows = [...st.rows.values()];
    setText(hModel, hd.model || "mlxnb");
    // the run's name as the user wrote it (-o name): a bare "run" read as a heading word
    setText(hTitle, hd.title ? `-o ${hd.title}` : hd.mode === "dashboard" ? "dashboard" : "");
    setText(hStats, headerParts(hd, rows, st.hist, stale).join(" · "));
    setAttr(root, "data-live", stale ? "stale" : hd.live ? "1" : "0");
    setAttr(root, "data-seq", st.seq);
    setAttr(head, "data-running", hd.running ?? 0); setAttr(head, "data-queued", hd.queued ?? 0);
    stopAll.textContent = hd.mode === "dashboard" ? "stop all" : "stop run";
    stopAll.style.display = hd.live && !stale ? "" : "none";
    stopAll.disabled = Boolean(stale) || pending();
    setAttr(root, "data-stale", stale || "");
  }

  function placeRows() {
    for (const [id, v] of rowEls) if (!st.rows.has(id)) { v.e.remove(); rowEls.delete(id); }
    const ids = [...st.rows.keys()], newest = st.header.mode === "dashboard";
    // rows of one template share a head and tail: the prompt column shows the rest
    const parts = commonParts(ids.map((id) => st.rows.get(id).prompt));
    if (parts.head !== shared.head || parts.tail !== shared.tail) {
      shared = parts; dirty = new Set(ids);
    }
    // running rows stay in the window, whatever their place in the list
    const vis = pickVisible(ids.map((id) => st.rows.get(id).state), ROW_LIMIT, expanded, newest);
    let prev = null;
    ids.forEach((id, i) => {
      const v = rowEls.get(id) || rowView(id);
      const want = prev ? prev.nextSibling : rowsEl.firstChild;
      if (want !== v.e) rowsEl.insertBefore(v.e, want);
      v.e.hidden = !vis.shown[i];
      prev = v.e;
    });
    const extra = expanded ? Math.max(0, ids.length - ROW_LIMIT) : vis.hidden;
    more.hidden = extra === 0;
    setText(more, moreLabel(extra, expanded, newest));
    setAttr(more, "data-hidden", vis.hidden);
    // a dashboard's control for earlier rows sits above them
    if (newest && more.nextSibling !== rowsEl) root.insertBefore(more, rowsEl);
  }

  function draw() {
    raf = 0;
    applyTheme(root);
    setAttr(root, "data-layout", layoutFor(root.clientWidth));
    if (relayout) { placeRows(); relayout = false; }
    stateMoved = false;
    for (const id of dirty) update(id);
    dirty.clear();
    if (stateMoved && !expanded && st.rows.size > ROW_LIMIT) { // a row started or ended
      placeRows();
      for (const id of dirty) update(id);
      dirty.clear();
    }
    drawHeader();
    const c = colors(root);
    drawKV(cvKV, st, c, hl);
    const rt = drawSteps(cvStep, st, c, view && view.kind === "step" ? view.step : null);
    keyEls.clip.hidden = !(rt && rt.clipped);
    keyEls.b.hidden = st.header.batch_reported === false;
    const live = st.header.live && !stale; // a stale view's clock stands still
    const rd = hl != null ? rowDetails.get(hl) : null;
    const marks = rd && rd.trace ? rd.trace.filter((p) => p.phase === "prefill" && p.t1 != null).map((p) => p.t1) : null;
    drawTimeline(cvTime, st, c, liveNow({ ...st.header, live }, st.recvAt, performance.now()),
      hl, live, marks);
    drawDetail();
  }

  // Canvases and the row layout follow the output area's width.
  const ro = typeof ResizeObserver !== "undefined" ? new ResizeObserver(schedule) : null;
  if (ro) ro.observe(root);
  schedule();

  return () => {
    model.off("msg:custom", onMsg);
    model.off("comm_live_update", onCommLive);
    clearInterval(kernelPoll);
    for (const ev of events) model.off(ev, onTraits);
    if (raf) cancelAnimationFrame(raf);
    if (staleTimer) clearTimeout(staleTimer);
    if (ro) ro.disconnect();
  };
}

export default { render };
