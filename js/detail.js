// The widget's detail panel: a row's life (waterfall) and tokens, or one step (the
// step inspector). Its data comes when a view opens (row_detail / step_detail answers);
// the rows and steps opened while the kernel ran are also in the "details" and
// "step_details" traits, so a notebook saved with widget state still shows them.
import { liveNow, oneLine, rowColor } from "./lib.js";
import { draftText, nearestIndex, samplingText, showPiece, stampPhases, stepAxis, stepLines, stepNote, tokenInfo, tokenShade, tokensNote, waterfall } from "./views.js";
import { h, setAttr, setText } from "./charts.js";
import { claimKeys, installKeyGuard } from "./keys.js";

const ASK_EVERY_MS = 1000; // an open running row asks for its new tokens this often
const ANSWER_MS = 3000; // a step asked for and not answered by then: no kernel has it

/**
 * The panel and its behaviour. `view()` gives the widget's {st, stale}; `schedule`
 * asks for a redraw; `pinRow(id)` marks a row in the list and charts; `cvStep` is the
 * step chart, whose clicks and keys open the step inspector.
 */
export function detailPanel({ model, cvStep, view: state, schedule, pinRow }) {
  const el = h("div", "mlxnb-detail");
  el.hidden = true;
  const dHead = h("div", "mlxnb-detail-head"), dTitle = h("span", "mlxnb-detail-title");
  const dClose = h("button", "mlxnb-detail-close", "close");
  dClose.title = "close the detail view (Esc)";
  const dBody = h("div", "mlxnb-detail-body");
  dHead.append(dTitle, dClose);
  el.append(dHead, dBody);
  installKeyGuard(window); // the token list's and the step chart's arrow keys (keys.js)

  let open = null, dirty = false, selTok = -1, askedAt = 0;
  const rowDetails = new Map(), stepDetails = new Map(), stepAsked = new Map();
  const takeSaved = () => {
    for (const [k, v] of Object.entries(model.get("details") || {})) if (!rowDetails.has(+k)) rowDetails.set(+k, v);
    for (const [k, v] of Object.entries(model.get("step_details") || {})) if (!stepDetails.has(+k)) stepDetails.set(+k, v);
    dirty = true;
  };
  takeSaved();
  const canAsk = () => { const { st, stale } = state(); return st.header.live !== undefined && !stale; };
  const ask = (msg) => {
    if (!canAsk()) return;
    askedAt = performance.now();
    try { model.send(msg); } catch (e) { /* no kernel connection (a static export) */ }
  };
  const openRow = (id) => {
    open = { kind: "row", id }; selTok = -1; dirty = true;
    pinRow(id);
    ask({ type: "row_detail", id });
    schedule();
  };
  const openStep = (step) => {
    open = { kind: "step", step }; dirty = true;
    if (!stepDetails.has(step) && canAsk()) {
      ask({ type: "step_detail", step });
      stepAsked.set(step, performance.now());
      // a reopened notebook's new kernel does not know this widget: say so in time
      setTimeout(() => { if (open && open.step === step) { dirty = true; schedule(); } }, ANSWER_MS + 50);
    }
    schedule();
  };
  const close = () => { open = null; dirty = true; schedule(); };
  dClose.addEventListener("click", close);

  /** A row_detail / step_detail answer: true when it was one. */
  const onMsg = (msg) => {
    if (msg && msg.type === "row_detail") {
      const old = rowDetails.get(msg.id), tv = msg.tokens;
      if (tv && tv.start > 0) { // the rest of a running row's tokens: append
        const have = old && old.tokens ? old.tokens.items : null;
        if (!have || have.length !== tv.start) { ask({ type: "row_detail", id: msg.id }); return true; }
        msg = { ...msg, tokens: { ...tv, start: 0, items: have.concat(tv.items) } };
      }
      rowDetails.set(msg.id, msg);
      if (open && open.kind === "row" && open.id === msg.id) { dirty = true; schedule(); }
      return true;
    }
    if (msg && msg.type === "step_detail") {
      stepDetails.set(msg.step, msg);
      if (open && open.kind === "step" && open.step === msg.step) { dirty = true; schedule(); }
      return true;
    }
    return false;
  };

  // the step chart: a click opens the nearest step; Enter the last; arrows walk
  cvStep.tabIndex = 0;
  cvStep.setAttribute("role", "button");
  cvStep.setAttribute("aria-label", "step time chart: click a step, or Enter and arrow keys, to inspect it");
  claimKeys(cvStep, ["ArrowLeft", "ArrowRight"]);
  cvStep.addEventListener("click", (ev) => {
    const hit = cvStep._hit;
    if (!hit) return;
    const i = nearestIndex(hit.xs, ev.clientX - cvStep.getBoundingClientRect().left);
    if (i >= 0) openStep(hit.steps[i]);
  });
  cvStep.addEventListener("keydown", (ev) => {
    const hit = cvStep._hit;
    if (!hit || !hit.steps.length) return;
    let i = open && open.kind === "step" ? hit.steps.indexOf(open.step) : -1;
    if (ev.key === "Enter" || ev.key === " ") i = i < 0 ? hit.steps.length - 1 : i;
    else if (ev.key === "ArrowLeft") i = Math.max(0, (i < 0 ? hit.steps.length : i) - 1);
    else if (ev.key === "ArrowRight") i = Math.min(hit.steps.length - 1, i + 1);
    else return;
    ev.preventDefault();
    openStep(hit.steps[i]);
  });

  // What the row view shows now, kept so that a running row's news (an answer every
  // second) updates its life and appends its new tokens: redrawing thousands of
  // tokens each time would cost the page more than the news, and lose the list's
  // scroll position.
  let shown = null;

  function lifeOf(id, r, trace) {
    const { st, stale } = state();
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
    return wf;
  }

  const tokensTitle = (tv) => `tokens (${tv.items.length}${tv.more ? ` of ${tv.items.length + tv.more}` : ""})` +
    (tv.probs ? ": shaded by how unlikely each was (the stronger, the less likely)" : "");

  function drawRow(id) {
    const { st, stale } = state();
    const r = st.rows.get(id), d = rowDetails.get(id);
    setText(dTitle, `row ${id}` + (r ? ` · ${oneLine(r.prompt || "", 80)}` : ""));
    setAttr(el, "data-kind", "row"); setAttr(el, "data-id", id);
    const trace = d && d.trace && d.trace.length ? d.trace : r ? stampPhases(r) : [];
    setAttr(el, "data-trace", d && d.trace ? "kernel" : "stamps");
    const wf = lifeOf(id, r, trace);
    const spec = r ? draftText(r.draft, r.ntok) : "";
    const specText = spec ? spec + " (dotted underline below)" : "";
    const tv = d && d.tokens;
    if (shown && shown.id === id && tv && shown.list.more(tv)) {
      shown.wf.replaceWith(wf); shown.wf = wf;
      setText(shown.spec, specText); shown.spec.hidden = !spec;
      setText(shown.sub, tokensTitle(tv));
      shown.list.add(tv);
      return;
    }
    shown = null;
    dBody.textContent = "";
    const specEl = h("div", "mlxnb-detail-note mlxnb-spec", specText);
    specEl.hidden = !spec;
    dBody.append(h("div", "mlxnb-detail-sub", "life of the row"), wf, specEl);
    if (!tv) {
      dBody.append(h("div", "mlxnb-detail-note", tokensNote(d, stale || !st.header.live && !d)));
      return;
    }
    const sub = h("div", "mlxnb-detail-sub", tokensTitle(tv));
    dBody.append(sub);
    if (d.why) dBody.append(h("div", "mlxnb-detail-note", d.why));
    const list = tokenList(tv);
    dBody.append(list.box, list.info);
    shown = { id, wf, spec: specEl, sub, list };
  }

  function tokenList(tv) {
    const box = h("div", "mlxnb-tokens");
    box.tabIndex = 0;
    box.setAttribute("role", "listbox");
    box.setAttribute("aria-label", "tokens: arrow keys move, the line below describes the token");
    claimKeys(box, ["ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown", "Home", "End"]);
    const info = h("div", "mlxnb-tokinfo");
    info.setAttribute("aria-live", "polite");
    const spans = [];
    let cur = tv;
    const add = (next) => {
      cur = next;
      for (const it of next.items.slice(spans.length)) {
        const e = h("span", "mlxnb-tok", showPiece(it.s ?? `<${it.id}>`));
        e.dataset.i = it.i;
        if (it.p != null) { e.dataset.p = it.p; e.style.background = `rgba(228, 155, 38, ${tokenShade(it.p)})`; }
        if (it.draft) e.dataset.draft = "1";
        e.setAttribute("role", "option");
        spans.push(e);
        // a line may break between any two tokens (their text has no spaces:
        // showPiece writes them as "·"), so a long row wraps instead of running off
        box.append(e, document.createElement("wbr"));
      }
    };
    const select = (i) => {
      if (i < 0 || i >= spans.length) return;
      if (selTok >= 0 && spans[selTok]) {
        spans[selTok].classList.remove("mlxnb-tok-sel");
        spans[selTok].removeAttribute("aria-selected");
      }
      selTok = i; spans[i].classList.add("mlxnb-tok-sel");
      spans[i].setAttribute("aria-selected", "true");
      setText(info, tokenInfo(cur.items[i], cur.sampling));
      setAttr(info, "data-i", i);
    };
    add(tv);
    const pick = (ev) => { const i = ev.target.dataset && ev.target.dataset.i; if (i != null) select(+i); };
    box.addEventListener("mouseover", pick);
    box.addEventListener("click", pick);
    box.addEventListener("keydown", (ev) => {
      const k = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[ev.key];
      if (ev.key === "Home") select(0);
      else if (ev.key === "End") select(spans.length - 1);
      else if (k) select(Math.max(0, Math.min(spans.length - 1, (selTok < 0 ? -1 : selTok) + k)));
      else return;
      ev.preventDefault();
      if (spans[selTok]) spans[selTok].scrollIntoView({ block: "nearest" });
    });
    setText(info, `${samplingText(tv.sampling)}. Hover, tap or use the arrow keys on a token.`);
    if (selTok >= 0) select(selTok);
    // the same tokens and more (a running row's later answer): appended, not redrawn
    const more = (next) => next.probs === cur.probs && next.items.length >= spans.length &&
      (spans.length === 0 || next.items[spans.length - 1].id === cur.items[spans.length - 1].id);
    return { box, info, add, more };
  }

  function drawStep(step) {
    const { st } = state();
    const d = stepDetails.get(step);
    const base = stepAxis(st.header).base;
    shown = null;
    setText(dTitle, "step inspector");
    setAttr(el, "data-kind", "step"); setAttr(el, "data-step", step);
    dBody.textContent = "";
    if (!d) {
      const asking = canAsk() && performance.now() - (stepAsked.get(step) ?? -Infinity) < ANSWER_MS;
      dBody.append(h("div", "mlxnb-detail-note", stepNote(step - base, asking)));
      return;
    }
    const list = h("ul", "mlxnb-step-lines");
    for (const line of stepLines(d, base)) list.append(h("li", "", line));
    dBody.append(list);
  }

  function draw() {
    // a running row's life grows: ask again now and then while it is open
    if (open && open.kind === "row") {
      const r = state().st.rows.get(open.id);
      // ... and once more when it ends, for its last tokens and its finish
      const last = r && r.state === "done" && !open.final;
      if (last) open.final = true;
      if (r && (last || r.state !== "done") && performance.now() - askedAt > (last ? 0 : ASK_EVERY_MS)) {
        const d = rowDetails.get(open.id); // only the tokens the view has not got yet
        ask({ type: "row_detail", id: open.id, from: d && d.tokens ? d.tokens.items.length : 0 });
      }
    }
    if (!dirty) return;
    dirty = false;
    el.hidden = !open;
    if (!open) { setAttr(el, "data-kind", ""); shown = null; return; }
    const a = document.activeElement, refocus = a && el.contains(a) && a.className;
    if (open.kind === "row") drawRow(open.id); else drawStep(open.step);
    if (refocus) { const e = el.querySelector("." + refocus.split(" ")[0]); if (e) e.focus(); }
  }

  return {
    el, onMsg, openRow, close, draw, takeSaved,
    isOpen: () => open !== null,
    stepShown: () => (open && open.kind === "step" ? open.step : null),
    rowTrace: (id) => { const d = id != null ? rowDetails.get(id) : null; return d && d.trace ? d.trace : null; },
  };
}
