// What the rows and the step chart choose to show (views.js), and the badge of a
// structured row (lib.js).
import { test } from "node:test";
import assert from "node:assert/strict";
import { BADGES, badgeKind, badgeText, contrast, headerParts } from "../lib.js";
import {
  STEP_LEGEND, commonParts, kernelGone, pickVisible, promptLabel, quantile, robustTop, staleNote,
  stepAxis, verdict,
} from "../views.js";

test("running rows stay in a collapsed window of 12, wherever they are in the list", () => {
  // 40 rows: 0-27 done, 28-34 running, 35-39 queued (a run that is well under way)
  const states = Array.from({ length: 40 }, (_, i) => i < 28 ? "done" : i < 35 ? "decode" : "queued");
  const { shown, hidden } = pickVisible(states, 12);
  assert.equal(hidden, 28);
  assert.equal(shown.filter(Boolean).length, 12);
  for (let i = 28; i < 35; i++) assert.ok(shown[i], `running row ${i} hidden`);
  for (let i = 35; i < 40; i++) assert.ok(shown[i], `queued row ${i} next in line hidden`);
  // a straggler from early on and rows running late: all of them shown
  const mixed = states.map((s, i) => (i === 2 ? "prefill" : s));
  const m = pickVisible(mixed, 12).shown;
  assert.ok(m[2] && m[28] && m[34]);
  // more running rows than the window: the earliest running ones, the window stays 12
  const busy = Array.from({ length: 40 }, (_, i) => (i >= 10 && i < 30 ? "decode" : "done"));
  const b = pickVisible(busy, 12).shown;
  assert.equal(b.filter(Boolean).length, 12);
  assert.ok(b.slice(10, 22).every(Boolean));
  // all done: a run shows its first rows, a dashboard its newest; expanded: all
  const done = new Array(20).fill("done");
  assert.deepEqual(pickVisible(done, 12).shown.map(Number).join(""), "1".repeat(12) + "0".repeat(8));
  assert.deepEqual(pickVisible(done, 12, false, true).shown.map(Number).join(""), "0".repeat(8) + "1".repeat(12));
  assert.ok(pickVisible(done, 12, true).shown.every(Boolean));
  assert.equal(pickVisible(done, 12, true).hidden, 0);
  assert.ok(pickVisible(["decode", "done"], 12).shown.every(Boolean));
});

test("rows of one template show the part that differs", () => {
  const names = ["Ada Lovelace", "Alan Turing", "Grace Hopper"];
  const ps = names.map((n) => `Extract the person's name from this sentence: ${n} wrote the first program. Answer in JSON.`);
  const parts = commonParts(ps);
  assert.ok(parts.head > 0 && parts.tail > 0, JSON.stringify(parts));
  const labels = ps.map((p) => promptLabel(p, parts));
  // one shared word kept on each side for context
  assert.deepEqual(labels, names.map((n) => `…sentence: ${n} wrote …`));
  assert.equal(new Set(labels).size, 3);
  // whole words: a shared "Al" of "Ada"/"Alan" is not cut into
  const two = commonParts(["Tell me about Alan Turing and his work", "Tell me about Alonzo Church and his work"]);
  assert.equal(promptLabel("Tell me about Alan Turing and his work", two), "…Alan Turing …"); // too short to keep context
  // unrelated prompts, a single prompt, identical prompts: shown whole
  assert.deepEqual(commonParts(["Write a haiku.", "Count to ten."]), { head: 0, tail: 0 });
  assert.deepEqual(commonParts(["one prompt only here, long enough"]), { head: 0, tail: 0 });
  assert.deepEqual(commonParts(["same prompt again and again", "same prompt again and again"]), { head: 0, tail: 0 });
  assert.equal(promptLabel("Write a haiku.", { head: 0, tail: 0 }), "Write a haiku.");
  // a prompt that is all shared (one is a prefix of the other) stays readable
  const pre = commonParts(["Summarise the following text please", "Summarise the following text please: x"]);
  assert.ok(promptLabel("Summarise the following text please", pre).length > 0);
});

test("a structured row's validity: its own badge colour, the reason on the row", () => {
  const cut = { state: "done", finish: "length", con: "json",
    parse: "not valid JSON: Unterminated string (cut by max_tokens: raise --max-tokens)" };
  const ok = { state: "done", finish: "stop", con: "json", parse: "ok" };
  assert.equal(badgeKind(cut), "invalid");
  assert.equal(badgeText(cut), "invalid: length");
  assert.equal(badgeKind(ok), "done");
  assert.equal(badgeText(ok), "done: stop");
  assert.equal(badgeKind({ ...cut, finish: "error" }), "error");
  assert.equal(badgeKind({ state: "decode", con: "json", parse: "pending" }), "decode");
  // short enough for the 104 px badge column (the browser test measures it)
  for (const f of ["stop", "length", "cancelled", "error"]) {
    assert.ok(badgeText({ ...cut, finish: f }).length <= 15, f);
  }
  assert.equal(badgeKind({ ...cut, finish: "cancelled" }), "cancelled"); // stopped, not invalid
  const v = verdict(cut);
  assert.equal(v.valid, false);
  // the remedy first, then the parser's complaint
  assert.equal(v.text, "json ✗ cut by max_tokens: raise --max-tokens: not valid JSON: Unterminated string");
  assert.equal(verdict({ ...cut, parse: "breaks its schema's required at /" }).text,
    "json ✗ breaks its schema's required at /");
  assert.deepEqual(verdict(ok), { valid: true, mark: "json ✓", text: "json ✓ valid" });
  assert.equal(verdict({ state: "decode", con: "json", parse: "pending" }), null);
  assert.equal(verdict({ state: "done", finish: "stop" }), null);
  for (const theme of ["light", "dark"]) {
    const [fg, bg] = BADGES[theme].invalid;
    assert.ok(contrast(fg, bg) >= 4.5, theme);
    assert.notDeepEqual(BADGES[theme].invalid, BADGES[theme].done);
    assert.notDeepEqual(BADGES[theme].invalid, BADGES[theme].error);
  }
});

test("a kernel that shut down is seen through the widget manager", () => {
  assert.equal(kernelGone(undefined), null); // no manager: cannot tell
  assert.equal(kernelGone({}), null); // a manager without a kernel getter (another front end)
  assert.equal(kernelGone({ kernel: null }), true); // Kernel > Shut Down Kernel
  assert.equal(kernelGone({ kernel: { status: "dead" } }), true);
  assert.equal(kernelGone({ kernel: { status: "idle", isDisposed: true } }), true);
  assert.equal(kernelGone({ kernel: { status: "restarting" } }), true);
  assert.equal(kernelGone({ kernel: { status: "busy" } }), false); // busy in a long cell: live
  assert.equal(kernelGone({ kernel: { status: "idle" } }), false);
  const throwing = { get kernel() { throw new Error("disposed"); } };
  assert.equal(kernelGone(throwing), null);
  // the header says not live, why, and no longer "running"
  const rows = [{ id: 1, state: "decode", ntok: 3 }];
  const hd = { live: true, running: 7, queued: 0, tok_s: 27.7, kv: 0 };
  const parts = headerParts(hd, rows, { kv: [] }, "kernel");
  assert.ok(!parts.join(" ").includes("running"), parts.join(" · "));
  assert.ok(!parts.join(" ").includes("tok/s"), parts.join(" · "));
  assert.equal(parts[parts.length - 1], staleNote("kernel"));
  assert.match(staleNote("kernel"), /^not live: the kernel shut down/);
  assert.match(staleNote("answer"), /^not live: no kernel answered/);
  assert.match(staleNote(true), /^not live/);
});

test("step time: one slow prefill step does not flatten the decode steps", () => {
  const dt = [...Array(50).fill(30), 40000, ...Array(20).fill(32)];
  const rt = robustTop(dt);
  assert.equal(rt.clipped, true);
  assert.ok(rt.top < 100 && rt.top >= 32, JSON.stringify(rt)); // decode steps fill the axis
  assert.equal(rt.max, 40000);
  // an even run, or too few steps to judge: the top is the largest value
  assert.deepEqual(robustTop([10, 12, 11, 13, 12, 10, 11, 14]), { top: 14, clipped: false, max: 14 });
  assert.equal(robustTop([1, 500]).clipped, false);
  assert.equal(robustTop([]).top, 0);
  assert.equal(quantile([5, 1, 3], 0.5), 3);
  // the key names the orange prefill marks and the clipped marks
  assert.ok(STEP_LEGEND.some((k) => k.key === "pf" && /prefill/.test(k.text)));
  assert.ok(STEP_LEGEND.some((k) => k.key === "clip"));
});

test("a run's steps count from 1; a dashboard keeps the engine's numbers", () => {
  const run = stepAxis({ mode: "run", step0: 51 });
  assert.equal(run.label(52), "1");
  assert.equal(run.name, "run step");
  const dash = stepAxis({ mode: "dashboard", step0: 51 });
  assert.equal(dash.label(52), "52");
  assert.equal(dash.name, "step");
  assert.equal(stepAxis({ mode: "run" }).label(7), "7"); // a header without step0 (older state)
});

test("a speculating row says how many drafted tokens it accepted; others say nothing", async () => {
  const { draftText } = await import("../views.js");
  assert.equal(draftText(undefined, 10), "");
  assert.equal(draftText([0, 0], 10), "");
  const t = draftText([31, 40], 50);
  assert.match(t, /31 of 40 drafted tokens accepted \(77.5%\)/);
  assert.match(t, /31 of its 50 tokens came from drafts/);
});

test("a row whose saved text was cut says how much is left out and where the rest is", async () => {
  const { cutNote } = await import("../views.js");
  assert.equal(cutNote({ text: "whole" }), "");
  assert.equal(cutNote({ text: "abc", cut: 0 }), "");
  assert.equal(cutNote({ text: "abc", cut: 1234 }), "… [1234 more characters: see run.texts]");
  assert.equal(cutNote({ text: "abc", cut: 5 }, true), "… [5 more characters: see its run's texts]");
});

test("a view that streamed a row's whole text keeps it when the traits bring it cut", async () => {
  const { keepWholeText } = await import("../views.js");
  const whole = "héllo 👋 world, and more";
  const head = whole.slice(0, 9); // "héllo 👋 " : 8 code points, 9 UTF-16 units
  const cutBy = [...whole].length - [...head].length;
  const saved = () => ({ rows: new Map([
    [1, { id: 1, state: "done", text: head, cut: cutBy }],
    [2, { id: 2, state: "done", text: "short" }],
    [3, { id: 3, state: "done", text: "abc", cut: 10 }],
  ]) });
  const streamed = { rows: new Map([
    [1, { id: 1, state: "done", text: whole }],
    [2, { id: 2, state: "done", text: "short" }],
    [3, { id: 3, state: "done", text: "abcdef" }], // not the text the cut came from
  ]) };
  const st = keepWholeText(streamed, saved());
  assert.equal(st.rows.get(1).text, whole);
  assert.equal(st.rows.get(1).cut, undefined);
  assert.equal(st.rows.get(2).text, "short");
  assert.equal(st.rows.get(3).text, "abc");
  assert.equal(st.rows.get(3).cut, 10);
  // a view that never streamed the row (a reopened notebook) keeps the cut and its mark
  const fresh = keepWholeText({ rows: new Map() }, saved());
  assert.equal(fresh.rows.get(1).text, head);
  assert.equal(fresh.rows.get(1).cut, cutBy);
  // a row the view holds cut itself, or still running, is not taken for whole
  const running = { rows: new Map([[1, { id: 1, state: "decode", text: whole }]]) };
  assert.equal(keepWholeText(running, saved()).rows.get(1).cut, cutBy);
});
