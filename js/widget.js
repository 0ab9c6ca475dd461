// mlxnb generation widget (anywidget ESM). State comes from the synced traits (a new
// view, a reopened notebook) and then from ~15 Hz "delta" custom messages; everything
// is redrawn at most once per animation frame. Charts are plain <canvas> (charts.js);
// the detail panel (a row's life and tokens, the step inspector) is detail.js.
import { CHART_TITLES, applyMessage, badgeKind, badgeText, bandAt, formatDuration, formatRate, headerParts, isStale, laneAt, layoutFor, liveNow, moreLabel, oneLine, rowColor, shouldTakeTraits, stateFromTraits, tailText } from "./lib.js";
import { STEP_LEGEND, commonParts, cutNote, draftText, keepWholeText, kernelGone, pickVisible, promptLabel, verdict } from "./views.js";
import { applyTheme, colors, drawKV, drawSteps, drawTimeline, h, setAttr, setText } from "./charts.js";
import { detailPanel } from "./detail.js";

const ROW_LIMIT = 12; // rows listed before the "N more rows" control
const STALE_MS = 5000; // a sync request unanswered this long: no kernel runs the rows
const KERNEL_POLL_MS = 1000; // how often a live view asks its widget manager for the kernel

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
  const rowsEl = h("div", "mlxnb-rows");
  const more = h("button", "mlxnb-more");
  // The detail panel: a row's life and tokens, or one step (opened by a click or key).
  const detail = detailPanel({ model, cvStep, view: () => ({ st, stale }), schedule: () => schedule(),
    pinRow: (id) => { highlight(id, true); if (hl !== id) highlight(id, true); } });
  root.append(head, charts, detail.el, rowsEl, more);
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
    if (detail.onMsg(msg)) return;
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
      st = keepWholeText(st, stateFromTraits(t));
      st.recvAt = performance.now();
      dirty = new Set(st.rows.keys()); relayout = true;
      detail.takeSaved();
      schedule();
    });
  };
  const events = ["change:rows", "change:steps", "change:header", "change:seq", "change:details",
    "change:step_details"];
  model.on("msg:custom", onMsg);
  model.on("comm_live_update", onCommLive);
  for (const ev of events) model.on(ev, onTraits);
  stopAll.addEventListener("click", () => model.send({ type: "stop_all" }));
  more.addEventListener("click", () => { expanded = !expanded; relayout = true; schedule(); });
  // Catch up on what was sent before us; with no answer the view is a saved snapshot.
  if (st.header.live) ask();

  root.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && detail.isOpen()) detail.close(); });

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
    const cut = h("span", "mlxnb-cut"); // text the saved state left out: how much, where it is
    text.append(verdictEl, inner, cut);
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
    prompt.addEventListener("click", (ev) => { ev.stopPropagation(); detail.openRow(id); });
    prompt.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); detail.openRow(id); }
    });
    e.addEventListener("mouseenter", () => highlight(id));
    e.addEventListener("mouseleave", () => highlight(null));
    e.append(sw, badge, prompt, text, nums, stop);
    const v = { e, badge, prompt, inner, verdict: verdictEl, cut, ntok, rate, ttft, stop };
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
    setText(v.prompt, (r.adapter ? "[" + r.adapter + "] " : "") + promptLabel(r.prompt || "", shared)); setAttr(v.prompt, "title", r.prompt || "");
    const text = r.error ? `error: ${r.error}` + (r.text ? "\n" + r.text : "") : r.text || "";
    const expandedRow = v.e.classList.contains("mlxnb-expanded");
    setText(v.inner, expandedRow ? text
      : r.state === "done" || stale ? oneLine(text, 400) : tailText(text, 240));
    setText(v.cut, cutNote(r, st.header.mode === "dashboard"));
    setAttr(v.e, "data-cut", r.cut > 0 ? r.cut : "");
    setAttr(v.cut, "title", r.cut > 0 ? "a saved notebook keeps part of long rows' text, " +
      "so its file stays small; the kernel's rows hold all of it" : "");
    setText(v.ntok, `${r.ntok ?? 0} tok`);
    setAttr(v.ntok, "title", draftText(r.draft, r.ntok));
    setAttr(v.e, "data-spec", r.draft && r.draft[1] ? "1" : "");
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
    const rt = drawSteps(cvStep, st, c, detail.stepShown());
    keyEls.clip.hidden = !(rt && rt.clipped);
    keyEls.b.hidden = st.header.batch_reported === false;
    keyEls.tk.hidden = st.header.batch_reported === false; // drawn on the batch axis
    const live = st.header.live && !stale; // a stale view's clock stands still
    const tr = detail.rowTrace(hl);
    const marks = tr ? tr.filter((p) => p.phase === "prefill" && p.t1 != null).map((p) => p.t1) : null;
    drawTimeline(cvTime, st, c, liveNow({ ...st.header, live }, st.recvAt, performance.now()),
      hl, live, marks);
    detail.draw();
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
