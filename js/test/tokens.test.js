// The step chart's tokens-per-step series (views.js tokenSeries) and its history
// (lib.js): aligned with the steps, halved with them, absent from older states.
import { test } from "node:test";
import assert from "node:assert/strict";
import { appendSteps, emptyHist, halveSteps, stateFromTraits } from "../lib.js";
import { STEP_LEGEND, tokenSeries } from "../views.js";

const steps = (s, b, tk) => ({ s, t: s, dt: s.map(() => 1), b, pf: s.map(() => 0), kv: s, tk });

test("tokens per step: a point per step, and the steps whose drafts held", () => {
  const h = emptyHist();
  appendSteps(h, steps([1, 2, 3, 4], [2, 2, 2, 1], [2, 5, 2, 3]));
  const t = tokenSeries(h);
  assert.deepEqual(t.pts, [[0, 2], [1, 5], [2, 2], [3, 3]]);
  assert.equal(t.top, 5); // the batch axis reaches it
  assert.equal(t.gained, 2); // 5 tokens from 2 rows, 3 from 1: accepted drafts
  assert.ok(STEP_LEGEND.some((k) => k.key === "tk" && /tokens/.test(k.text)));
});

test("without speculation tokens never exceed the batch", () => {
  const h = emptyHist();
  appendSteps(h, steps([1, 2, 3], [3, 3, 2], [0, 3, 2])); // the first step read nothing yet
  assert.equal(tokenSeries(h).gained, 0);
});

test("a sender or a saved state without token counts keeps the arrays aligned", () => {
  const h = emptyHist();
  const old = steps([1, 2], [1, 1]);
  delete old.tk;
  appendSteps(h, old);
  appendSteps(h, steps([3], [1], [4]));
  assert.deepEqual(h.tk, [null, null, 4]);
  assert.equal(h.tk.length, h.s.length);
  assert.deepEqual(tokenSeries(h).pts, [[2, 4]]);
  const st = stateFromTraits({ rows: [], steps: { s: [1, 2], b: [1, 1] }, header: {}, seq: 1 });
  assert.deepEqual(st.hist.tk, [null, null]);
  assert.deepEqual(tokenSeries(st.hist).pts, []);
});

test("halving keeps each point's later token count, as the batch size", () => {
  const h = emptyHist();
  appendSteps(h, steps([1, 2, 3, 4, 5], [1, 1, 1, 1, 1], [1, 3, 1, 2, 7]));
  halveSteps(h);
  assert.deepEqual(h.s, [2, 4, 5]);
  assert.deepEqual(h.tk, [3, 2, 7]);
});
