// The detail views' logic (views.js): the waterfall, the token view, the step inspector.
import { test } from "node:test";
import assert from "node:assert/strict";
import { BADGES, contrast, parseColor } from "../lib.js";
import {
  SHADE_RGB, blend, nearestIndex, samplingText, showPiece, stampPhases, stepLines, stepNote, tokenInfo,
  tokenShade, tokensNote, waterfall,
} from "../views.js";

const TRACE = [
  { phase: "queued", t0: 1.0, t1: 3.0, s: 2.0, why: ["KV budget"] },
  { phase: "prefix hit", t: 3.0, tokens: 32 },
  { phase: "prefill", t0: 3.0, t1: 3.5, s: 0.5, tokens: 16, step: 40 },
  { phase: "prefill", t0: 3.5, t1: 4.0, s: 0.5, tokens: 8, step: 41 },
  { phase: "first token", t: 4.0 },
  { phase: "decode", t0: 4.0, t1: 5.0, s: 1.0, tokens: 20, tok_s: 20 },
  { phase: "finish", t: 5.0, reason: "length", step: 61 },
];

test("waterfall: each phase placed on the row's own time axis, with its numbers", () => {
  const wf = waterfall(TRACE, null);
  assert.equal(wf.length, TRACE.length);
  const q = wf[0];
  assert.equal(q.left, 0);
  assert.equal(q.width, 50); // 2 s of 4
  assert.match(q.text, /^2\.00 s \(KV budget\)$/);
  assert.equal(wf[1].text, "32 prompt tokens reused");
  assert.equal(wf[2].label, "prefill chunk 1");
  assert.equal(wf[2].text, "16 tokens · 500 ms · step 40");
  assert.equal(wf[3].label, "prefill chunk 2");
  assert.equal(wf[3].left, 62.5);
  assert.equal(wf[4].text, "at 3.00 s");
  assert.equal(wf[5].text, "20 tokens · 1.00 s · 20.0 tok/s");
  assert.equal(wf[6].text, "length at 4.00 s");
  assert.equal(wf[6].width, 0);
  // a running row: open phases end at now
  const open = waterfall([{ phase: "queued", t0: 0, t1: 1, s: 1, why: [] },
    { phase: "decode", t0: 1, t1: null, s: null, tokens: 3 }], 3);
  assert.ok(Math.abs(open[1].width - 200 / 3) < 1e-9);
  assert.match(open[0].text, /waiting for a step/);
  assert.deepEqual(waterfall([], 1), []);
});

test("stamps alone give the coarse phases (a saved view never opened live)", () => {
  const r = { t_submit: 0, t_admit: 1, t_first: 2, t_done: 5, ntok: 11, state: "done", finish: "stop", prompt_tokens: 7 };
  const ph = stampPhases(r);
  assert.deepEqual(ph.map((p) => p.phase), ["queued", "prefill", "first token", "decode", "finish"]);
  assert.equal(ph[3].tokens, 10);
  assert.equal(ph[3].s, 3);
  assert.deepEqual(stampPhases({}), []);
});

test("token shading: the less likely, the darker, and text stays AA in both themes", () => {
  assert.equal(tokenShade(1), 0);
  assert.ok(tokenShade(0.1) > tokenShade(0.5));
  assert.equal(tokenShade(null), 0);
  const themes = { light: ["#ffffff", "#333333"], dark: ["#111111", "#dddddd"] };
  for (const [name, [bg, fg]] of Object.entries(themes)) {
    for (const p of [0, 0.01, 0.3, 0.7, 1]) {
      const mixed = blend(parseColor(bg), tokenShade(p), SHADE_RGB);
      const c = contrast(fg, `rgb(${mixed.join(",")})`);
      assert.ok(c >= 4.5, `${name} p=${p}: ${c.toFixed(2)}`);
    }
  }
  assert.ok(BADGES.light.invalid); // (the badge set the panel's colours sit beside)
});

test("a token's line: its probability, the alternatives, the sampling in force", () => {
  const it = { i: 4, id: 9, s: " the", p: 0.4321, top: [{ id: 9, s: " the", p: 0.4321 }, { id: 3, s: "\n", p: 0.2 }] };
  const s = { temperature: 0.7, top_p: 0.9, top_k: 0, min_p: 0, constraint: "json_schema" };
  const line = tokenInfo(it, s);
  assert.match(line, /^token 5: “·the”/);
  assert.match(line, /p = 43\.2%/);
  assert.match(line, /top: “·the” 43\.2%, “⏎” 20\.0%/);
  assert.match(line, /temperature 0\.7, top-p 0\.9/);
  assert.match(line, /json_schema constraint/);
  assert.match(tokenInfo({ ...it, draft: true }, null), /accepted draft/);
  assert.match(tokenInfo({ ...it, allowed: 3 }, null), /3 tokens allowed by the constraint here/);
  assert.match(tokenInfo({ ...it, allowed: 1 }, null), /1 token allowed by/);
  assert.doesNotMatch(tokenInfo(it, null), /allowed/);
  assert.equal(samplingText({ temperature: 0, top_p: 0.5 }), "greedy (temperature 0; p at T = 1)");
  assert.equal(showPiece(" a "), "·a·");
  assert.equal(showPiece(""), "∅");
});

test("the step inspector says which rows did what and where the time went", () => {
  const d = { step: 52, dt_s: 0.0401, batch_size: 2, batch_ids: [3, 4], prefill_rows: { 7: 512 },
    prefill_tokens: 512, ended: [4], finish: { 4: "length" }, labels: { 7: "long prompt" },
    split: { build: 1.2, launch: 0.3, device: 35.1, worker: 2.5, loop: 1.0 },
    kv_bytes: 2048, kv_budget: 1 << 20 };
  const lines = stepLines(d, 51);
  assert.equal(lines[0], "step 1 of this run (engine step 52) · 40.1 ms · batch 2 decoding");
  assert.equal(lines[1], "decoding: row 3, row 4");
  assert.equal(lines[2], "prefill: row 7 “long prompt” +512 tokens");
  assert.equal(lines[3], "ended: row 4 (length)");
  assert.match(lines[4], /waiting on the device 35\.1 ms/);
  assert.equal(lines[5], "KV 2.0 KB of 1.0 MB budget");
  assert.match(stepLines({ step: 9, missing: true })[0], /no longer kept/);
  assert.equal(nearestIndex([0, 10, 20], 13), 1);
  assert.equal(nearestIndex([], 3), -1);
});

test("a step with no record: asking while a kernel may answer, else why it cannot be shown", () => {
  assert.equal(stepNote(7, true), "step 7: asking the kernel…");
  assert.match(stepNote(7, false), /^step 7: not inspected while the kernel ran/);
});

test("a row's tokens: asking, not askable, or gone from the kernel", () => {
  assert.equal(tokensNote(null, false), "tokens: asking the kernel…");
  assert.equal(tokensNote(null, true), "tokens: open this row while its kernel runs to see them");
  assert.match(tokensNote({ id: 0, gone: true, trace: [] }, false), /^tokens: no longer held/);
});
