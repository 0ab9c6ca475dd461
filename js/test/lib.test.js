import { test } from "node:test";
import assert from "node:assert/strict";
import {
  MAX_POINTS, appendSteps, applyMessage, applyRowDelta, badgeText, bytesTicks, countStates,
  emptyHist, formatBytes, formatDuration, formatRate, halveSnaps, halveSteps, liveNow,
  niceTicks, oneLine, pruneRows, rowColor, runStats, scaleLinear, shouldTakeTraits,
  stackSnaps, stateFromTraits, tailText, timelineSpans,
} from "../lib.js";

const traits = (over = {}) => ({
  rows: [{ id: 0, prompt: "p", text: "Hel", state: "decode", ntok: 2 }],
  steps: { s: [1], t: [0.1], dt: [5], b: [1], pf: [0], kv: [100], snap: [[1, 100, [0, 100]]] },
  header: { model: "m", live: true, now: 1.0 },
  seq: 3,
  ...over,
});

// ---------------------------------------------------------------- deltas
test("row delta appends text and sets fields", () => {
  const r = applyRowDelta(undefined, { id: 4, prompt: "hi", d: "ab", state: "prefill", pf: 30 });
  assert.equal(r.text, "ab");
  applyRowDelta(r, { id: 4, d: "cd", state: "decode", ntok: 2 });
  assert.deepEqual([r.text, r.state, r.ntok, r.pf, r.prompt], ["abcd", "decode", 2, 30, "hi"]);
  applyRowDelta(r, { id: 4, text: "xyz" }); // a rewrite replaces
  assert.equal(r.text, "xyz");
});

test("messages apply in order; stale ones are ignored; gaps are reported", () => {
  const st = stateFromTraits(traits());
  assert.equal(st.seq, 3);
  let res = applyMessage(st, { type: "delta", seq: 4, rows: [{ id: 0, d: "lo", ntok: 3 }] });
  assert.ok(res.applied);
  assert.deepEqual([...res.changed], [0]);
  assert.equal(st.rows.get(0).text, "Hello");
  res = applyMessage(st, { type: "delta", seq: 4, rows: [{ id: 0, d: "!!" }] });
  assert.equal(res.applied, false);
  assert.equal(st.rows.get(0).text, "Hello");
  res = applyMessage(st, { type: "delta", seq: 6, rows: [{ id: 0, d: "?" }] });
  assert.ok(res.gap);
  assert.equal(st.rows.get(0).text, "Hello");
  assert.equal(st.seq, 4);
});

test("new rows, steps and header merge from a message", () => {
  const st = stateFromTraits(traits());
  applyMessage(st, {
    type: "delta", seq: 4,
    rows: [{ id: 1, prompt: "q", t_submit: 0.5, state: "queued", ntok: 0 }],
    steps: { s: [2, 3], t: [0.2, 0.3], dt: [6, 7], b: [2, 2], pf: [16, 0], kv: [200, 300],
      snap: [[3, 300, [0, 150, 1, 150]]] },
    header: { running: 2, tok_s: 40.5 },
  }, 1234);
  assert.deepEqual([...st.rows.keys()], [0, 1]);
  assert.deepEqual(st.hist.s, [1, 2, 3]);
  assert.equal(st.hist.snap.length, 2);
  assert.equal(st.header.model, "m");
  assert.equal(st.header.running, 2);
  assert.equal(st.recvAt, 1234);
});

test("traits win unless the view holds newer deltas", () => {
  const st = stateFromTraits(traits({ seq: 5 }));
  assert.ok(shouldTakeTraits(st, 5));
  assert.ok(shouldTakeTraits(st, 9));
  assert.ok(!shouldTakeTraits(st, 4));
  assert.ok(shouldTakeTraits({ seq: -1 }, 0));
});

test("stateFromTraits copies arrays (later appends do not touch the trait)", () => {
  const t = traits();
  const st = stateFromTraits(t);
  appendSteps(st.hist, { s: [9], t: [1], dt: [1], b: [1], pf: [0], kv: [1], snap: [] });
  assert.deepEqual(t.steps.s, [1]);
  const empty = stateFromTraits({ rows: [], steps: {}, header: {}, seq: 0 });
  assert.deepEqual(empty.hist.s, []);
});

test("pruneRows drops oldest finished rows only", () => {
  const st = stateFromTraits(traits({ rows: [
    { id: 0, state: "done" }, { id: 1, state: "decode" }, { id: 2, state: "done" },
    { id: 3, state: "queued" }] }));
  assert.deepEqual(pruneRows(st, 2), [0, 2]);
  assert.deepEqual([...st.rows.keys()], [1, 3]);
  assert.deepEqual(pruneRows(st, 1), []); // live rows are never dropped
  assert.deepEqual(pruneRows(st, null), []);
});

// ---------------------------------------------------------------- history
test("halveSteps keeps later step, max dt, summed prefill, odd tail", () => {
  const h = emptyHist();
  Object.assign(h, { s: [1, 2, 3, 4, 5], t: [1, 2, 3, 4, 5], dt: [5, 9, 1, 2, 7],
    b: [1, 2, 3, 4, 5], pf: [10, 20, 0, 5, 1], kv: [1, 2, 3, 4, 5] });
  halveSteps(h);
  assert.deepEqual(h.s, [2, 4, 5]);
  assert.deepEqual(h.dt, [9, 2, 7]);
  assert.deepEqual(h.pf, [30, 5, 1]);
  assert.deepEqual(h.kv, [2, 4, 5]);
});

test("appendSteps bounds the history", () => {
  const h = emptyHist();
  for (let i = 0; i < 10; i++) {
    const n = 700, base = i * n;
    const a = Array.from({ length: n }, (_, j) => base + j);
    appendSteps(h, { s: a, t: a, dt: a.map(() => 1), b: a.map(() => 1), pf: a.map(() => 0), kv: a,
      snap: a.map((s) => [s, s, [0, s]]) });
  }
  assert.ok(h.s.length <= MAX_POINTS && h.s.length > MAX_POINTS / 2, `${h.s.length}`);
  for (const k of ["t", "dt", "b", "pf", "kv"]) assert.equal(h[k].length, h.s.length);
  assert.equal(h.s.at(-1), 6999); // the newest step survives decimation
  assert.ok(h.snap.length <= MAX_POINTS);
  assert.equal(h.snap.at(-1)[0], 6999);
  for (let i = 1; i < h.s.length; i++) assert.ok(h.s[i] > h.s[i - 1]);
});

test("halveSnaps keeps the latest", () => {
  assert.deepEqual(halveSnaps([[1], [2], [3]]).map((s) => s[0]), [2, 3]);
  assert.deepEqual(halveSnaps([[1], [2], [3], [4]]).map((s) => s[0]), [2, 4]);
});

test("stackSnaps stacks rows by id and tolerates missing rows", () => {
  const { ids, tops, mine, totals } = stackSnaps([
    [1, 100, [2, 30, 0, 10]],
    [2, 150, [0, 20]],
    [3, 50, []],
  ]);
  assert.deepEqual(ids, [0, 2]);
  assert.deepEqual(tops.get(0), [10, 20, 0]);
  assert.deepEqual(tops.get(2), [40, 20, 0]);
  assert.deepEqual(mine, [40, 20, 0]);
  assert.deepEqual(totals, [100, 150, 50]);
});

// ---------------------------------------------------------------- scales
test("niceTicks gives round bounds covering the data", () => {
  const t = niceTicks(0, 37, 4);
  assert.equal(t.min, 0);
  assert.ok(t.max >= 37 && t.max <= 50);
  assert.deepEqual(t.ticks, [0, 10, 20, 30, 40]);
  const f = niceTicks(0.013, 0.087, 4);
  assert.ok(f.min <= 0.013 && f.max >= 0.087);
  for (const v of f.ticks) assert.equal(v, +v.toPrecision(6)); // no 0.30000000000000004
  const z = niceTicks(5, 5);
  assert.ok(z.max > z.min);
  const bad = niceTicks(NaN, Infinity);
  assert.deepEqual([bad.min, bad.max], [0, 1]);
});

test("bytesTicks lands on binary units", () => {
  const t = bytesTicks(3.5 * 1024 * 1024, 3);
  assert.ok(t.max >= 3.5 * 1024 * 1024);
  assert.ok(t.ticks.every((v) => Number.isInteger(v / (1024 * 1024) * 2) || v === 0));
  assert.equal(formatBytes(t.ticks[1]), "2.0 MB");
  assert.deepEqual(bytesTicks(0).ticks.length > 1, true);
});

test("scaleLinear maps and handles a zero-width domain", () => {
  const s = scaleLinear(0, 10, 100, 0);
  assert.equal(s(0), 100);
  assert.equal(s(5), 50);
  assert.equal(scaleLinear(3, 3, 0, 10)(3), 5);
});

// ---------------------------------------------------------------- timeline & summaries
test("timelineSpans covers queued, prefill, decode; open spans end now", () => {
  const done = { t_submit: 1, t_admit: 2, t_first: 3, t_done: 5 };
  assert.deepEqual(timelineSpans(done, 99).map((s) => [s.kind, s.t0, s.t1]),
    [["queued", 1, 2], ["prefill", 2, 3], ["decode", 3, 5]]);
  const live = { t_submit: 1, t_admit: 2 };
  assert.deepEqual(timelineSpans(live, 4).map((s) => [s.kind, s.t1]), [["queued", 2], ["prefill", 4]]);
  const cancelledInQueue = { t_submit: 1, t_done: 1.5 };
  assert.deepEqual(timelineSpans(cancelledInQueue, 9).map((s) => [s.kind, s.t1]), [["queued", 1.5]]);
  assert.deepEqual(timelineSpans({}, 1), []);
});

test("liveNow extrapolates only while live", () => {
  assert.equal(liveNow({ now: 10, live: true }, 1000, 1500), 10.5);
  assert.equal(liveNow({ now: 10, live: false }, 1000, 1500), 10);
  assert.equal(liveNow({ now: 10, live: true }, 1000, 60000), 15); // capped
});

test("badges, counts and run stats", () => {
  assert.equal(badgeText({ state: "queued" }), "queued");
  assert.equal(badgeText({ state: "prefill", pf: 42 }), "prefill 42%");
  assert.equal(badgeText({ state: "decode" }), "decoding");
  assert.equal(badgeText({ state: "done", finish: "length" }), "done: length");
  const rows = [{ state: "done", ntok: 10, t_admit: 1, t_done: 2 },
    { state: "done", ntok: 30, t_admit: 1.5, t_done: 3 }, { state: "queued", ntok: 0 }];
  assert.deepEqual(countStates(rows), { queued: 1, prefill: 0, decode: 0, done: 2 });
  assert.deepEqual(runStats(rows), { tokens: 40, span: 2, tok_s: 20 });
  assert.equal(runStats([]).tok_s, 0);
});

// ---------------------------------------------------------------- formatting
test("formatBytes", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(512), "512 B");
  assert.equal(formatBytes(1536), "1.5 KB");
  assert.equal(formatBytes(2 * 1024 ** 3), "2.0 GB");
  assert.equal(formatBytes(123.4 * 1024 ** 2), "123 MB");
  assert.equal(formatBytes(null), "–");
});

test("formatDuration", () => {
  assert.equal(formatDuration(0.0004), "0.40 ms");
  assert.equal(formatDuration(0.1234), "123 ms");
  assert.equal(formatDuration(0.05), "50 ms");
  assert.equal(formatDuration(1.234), "1.23 s");
  assert.equal(formatDuration(12.34), "12.3 s");
  assert.equal(formatDuration(125), "2m 05s");
  assert.equal(formatDuration(3725), "1h 02m");
  assert.equal(formatDuration(undefined), "–");
});

test("formatRate, text helpers, colours", () => {
  assert.equal(formatRate(34.14), "34.1");
  assert.equal(formatRate(812.6), "813");
  assert.equal(formatRate(null), "–");
  assert.equal(tailText("a\nb"), "a ⏎ b");
  assert.equal(tailText("abcdef", 3), "…def");
  assert.equal(oneLine("  a \n\n b  "), "a b");
  assert.equal(oneLine("abcdef", 4), "abc…");
  // cuts never split an emoji's surrogate pair
  const lone = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
  for (let n = 2; n < 9; n++) {
    assert.doesNotMatch(tailText("😀".repeat(5) + "y", n), lone);
    assert.doesNotMatch(oneLine("😀".repeat(5), n), lone);
  }
  assert.equal(tailText("a😀b", 2), "…b");
  assert.equal(oneLine("ab😀c", 4), "ab…");
  assert.equal(rowColor(3), rowColor(3)); // a row keeps its colour
  assert.match(rowColor(-1), /^hsl\(/);
});
