// Layout, label and colour logic of the widget (lib.js): what the DOM code decides.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BADGES, CHART_TITLES, X_AXIS, badgeKind, badgeText, bandAt, contrast, headerParts, isDark,
  isStale, laneAt, layoutFor, moreLabel, parseColor, rowColor, scaleLinear, stackSnaps,
  visibleRows,
} from "../lib.js";

test("layout: one line when wide, numbers under the text when medium, text alone when narrow", () => {
  assert.equal(layoutFor(1200), "wide");
  assert.equal(layoutFor(900), "wide");
  assert.equal(layoutFor(899), "medium");
  assert.equal(layoutFor(600), "medium");
  assert.equal(layoutFor(519), "narrow");
  assert.equal(layoutFor(320), "narrow");
  assert.equal(layoutFor(0), "wide"); // hidden, not measured: no flip-flop
});

// The medium grid (widget.css): 8px + 104px + max(50px, 22%) + text + 20px, four 6px gaps.
// At 600 px the text column must keep at least 40 % of the width; at the widest width
// that still uses it (899 px) too, and the wide grid at 900 px likewise.
test("text column share at the layout boundaries", () => {
  const medium = (w) => w - (8 + 104 + Math.max(50, 0.22 * w) + 20 + 4 * 6);
  const wide = (w) => w - (8 + 104 + Math.max(60, 0.18 * w) + 52 + 70 + 74 + 20 + 7 * 6);
  for (const w of [520, 600, 700, 899]) assert.ok(medium(w) / w >= 0.4, `medium ${w}`);
  for (const w of [900, 1000, 1400]) assert.ok(wide(w) / w >= 0.4, `wide ${w}`);
});

test("more rows: a run shows its first rows, a dashboard its newest, with a count", () => {
  assert.deepEqual(visibleRows(5, 12, false), { start: 0, end: 5, hidden: 0 });
  assert.deepEqual(visibleRows(20, 12, false), { start: 0, end: 12, hidden: 8 });
  assert.deepEqual(visibleRows(20, 12, true), { start: 0, end: 20, hidden: 0 });
  assert.deepEqual(visibleRows(20, 12, false, true), { start: 8, end: 20, hidden: 8 });
  assert.equal(moreLabel(8, false), "8 more rows");
  assert.equal(moreLabel(1, false), "1 more row");
  assert.equal(moreLabel(8, false, true), "8 earlier rows");
  assert.equal(moreLabel(8, true), "show fewer rows");
});

test("header: this run's counts apart from the engine's", () => {
  const rows = [
    { id: 1, state: "done", finish: "stop", ntok: 10, t_admit: 0, t_done: 2 },
    { id: 2, state: "decode", ntok: 4, t_admit: 0 },
    { id: 3, state: "queued", ntok: 0 },
  ];
  const hd = { live: true, running: 5, queued: 2, tok_s: 123.4, kv: 2048, kv_budget: 4096 };
  const live = headerParts(hd, rows, { kv: [1024] });
  assert.equal(live[0], "this run: 1/3 done · 1 running · 1 queued");
  assert.equal(live[1], "engine: 5 running · 2 queued · 123 tok/s");
  assert.equal(live[2], "KV now 2.0 KB / 4.0 KB");
  // finished: the rate says what it is (all rows' tokens over the run's span)
  const fin = rows.map((r) => ({ ...r, state: "done", finish: "length", t_done: 4 }));
  const done = headerParts({ ...hd, live: false }, fin, { kv: [1024, 3072] });
  assert.equal(done[0], "this run: 3/3 done");
  assert.equal(done[1], "14 tok in 4.00 s = 3.5 tok/s, all rows");
  assert.equal(done[2], "KV peak 3.0 KB / 4.0 KB");
  assert.ok(!done.join(" ").includes("engine"));
  // a saved view with no kernel: unfinished, and it says so
  const st = headerParts(hd, rows, { kv: [1024] }, true);
  assert.equal(st[0], "this run: 1/3 done · 2 unfinished");
  assert.match(st[st.length - 1], /^not live/);
  assert.ok(!st.join(" ").includes("running"));
  // a server engine's KV: a fraction of its cache, or not reported
  assert.equal(headerParts({ ...hd, kv_unit: "fraction", kv: 0.25 }, rows, { kv: [] })[2],
    "server KV now 25%");
  assert.equal(headerParts({ ...hd, kv_unit: null }, rows, { kv: [] })[2],
    "KV: not reported by this server");
  // the cache kinds a local engine batches, after the KV figure
  const kinds = headerParts({ ...hd, cache_kinds: "2 recurrent-state + 2 attention layers, KV 4-bit" },
    rows, { kv: [1024] });
  assert.equal(kinds[3], "2 recurrent-state + 2 attention layers, KV 4-bit");
  assert.equal(live.length, 3);
  // the dashboard counts the engine
  const dash = headerParts({ ...hd, mode: "dashboard" }, rows, { kv: [] });
  assert.equal(dash[0], "showing 3 rows: 1 done");
  assert.doesNotMatch(dash[0], /shown done/);
  const dashDone = headerParts({ ...hd, mode: "dashboard" }, fin, { kv: [] });
  assert.equal(dashDone[0], "showing 3 rows: all done");
  assert.match(dash[1], /^engine: 5 running/);
});

test("stale: asked, nothing heard for a while, and only while the header says live", () => {
  assert.equal(isStale(true, 1000, 500, 7000), true);
  assert.equal(isStale(true, 1000, 500, 5000), false); // still waiting
  assert.equal(isStale(true, 1000, 1200, 9000), false); // heard back
  assert.equal(isStale(false, 1000, 500, 9000), false); // a finished run is never stale
  assert.equal(badgeText({ state: "decode" }, true), "unfinished");
  assert.equal(badgeText({ state: "done", finish: "stop" }, true), "done: stop");
  assert.equal(badgeKind({ state: "queued" }, true), "unfinished");
  assert.equal(badgeKind({ state: "done", finish: "cancelled" }), "cancelled");
  assert.equal(badgeKind({ state: "prefill" }), "prefill");
});

test("charts say what their axes are", () => {
  assert.deepEqual(X_AXIS, { kv: "step", step: "step", timeline: "seconds" });
  assert.match(CHART_TITLES.kv, /step/);
  assert.match(CHART_TITLES.step, /step time ms/);
  assert.doesNotMatch(CHART_TITLES.timeline, /pale/);
});

test("badges meet WCAG AA (4.5:1) in light and dark", () => {
  for (const theme of ["light", "dark"]) {
    for (const [kind, [fg, bg]] of Object.entries(BADGES[theme])) {
      const c = contrast(fg, bg);
      assert.ok(c >= 4.5, `${theme} ${kind}: ${c.toFixed(2)}`);
    }
  }
  assert.ok(Math.abs(contrast("#000", "#fff") - 21) < 1e-9);
  assert.equal(isDark("rgb(17, 17, 17)"), true); // JupyterLab dark
  assert.equal(isDark("#ffffff"), false);
  assert.equal(isDark("rgba(0, 0, 0, 0)"), false); // transparent: not a backdrop
  assert.deepEqual(parseColor("#abc"), [170, 187, 204]);
});

test("row colours stay apart: neighbours differ in hue, twenty rows give twenty colours", () => {
  const hue = (c) => +/hsl\((\d+)/.exec(c)[1];
  const cs = Array.from({ length: 20 }, (_, i) => rowColor(i));
  assert.equal(new Set(cs).size, 20);
  for (let i = 1; i < 20; i++) {
    const d = Math.abs(hue(cs[i]) - hue(cs[i - 1]));
    assert.ok(Math.min(d, 360 - d) > 60, `${i}: ${cs[i - 1]} ${cs[i]}`);
  }
});

test("hit tests map chart clicks back to rows", () => {
  assert.equal(laneAt(5, 0, 30, [7, 8, 9]), 7);
  assert.equal(laneAt(25, 0, 30, [7, 8, 9]), 9);
  assert.equal(laneAt(31, 0, 30, [7, 8, 9]), null);
  const stack = stackSnaps([[1, 300, [4, 100, 5, 200]]]);
  assert.equal(bandAt(stack, 0, 50), 4);
  assert.equal(bandAt(stack, 0, 150), 5);
  assert.equal(bandAt(stack, 0, 350), null);
  const y = scaleLinear(0, 100, 90, 10);
  assert.equal(y.invert(y(25)), 25);
});
