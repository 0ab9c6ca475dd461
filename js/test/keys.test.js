// The widget's controls keep their arrow keys from the notebook's shortcuts (keys.js).
import { test } from "node:test";
import assert from "node:assert/strict";
import { KEYS_ATTR, claimKeys, installKeyGuard, isClaimed } from "../keys.js";

// A minimal element tree: closest() over attribute selectors, as the DOM does.
function el(parent = null) {
  const attrs = new Map();
  const e = {
    parentElement: parent,
    setAttribute: (k, v) => attrs.set(k, String(v)),
    getAttribute: (k) => (attrs.has(k) ? attrs.get(k) : null),
    closest(sel) {
      const name = sel.slice(1, -1);
      for (let x = e; x; x = x.parentElement) if (x.getAttribute(name) != null) return x;
      return null;
    },
  };
  return e;
}

function keydown(key, mods = {}) {
  return { key, ctrlKey: false, altKey: false, metaKey: false, ...mods, defaultPrevented: false,
    stopped: false, preventDefault() { this.defaultPrevented = true; }, stopPropagation() { this.stopped = true; } };
}

test("a claimed key on a control or inside it is claimed; others and modified keys are not", () => {
  const list = el(), token = el(list), outside = el();
  claimKeys(list, ["ArrowLeft", "ArrowRight", "Home"]);
  assert.equal(list.getAttribute(KEYS_ATTR), "ArrowLeft ArrowRight Home");
  assert.ok(isClaimed(list, keydown("ArrowRight")));
  assert.ok(isClaimed(token, keydown("Home")));
  assert.ok(!isClaimed(list, keydown("Enter")));
  assert.ok(!isClaimed(outside, keydown("ArrowRight")));
  for (const m of ["ctrlKey", "altKey", "metaKey"]) assert.ok(!isClaimed(list, keydown("ArrowRight", { [m]: true })));
  assert.ok(!isClaimed(null, keydown("ArrowRight")));
  assert.ok(!isClaimed({}, keydown("ArrowRight"))); // a text node, a window: no closest()
});

// Notebook 7 order: window capture (the guard), then the shortcut registry on document
// in the capture phase (it skips a prevented event, otherwise it takes arrow keys and
// stops the event), then the control's own handler.
function dispatch(win, target, ev) {
  ev.target = target;
  for (const [type, fn, capture] of win.listeners) if (type === "keydown" && capture) fn(ev);
  if (!ev.defaultPrevented && ev.key.startsWith("Arrow")) { ev.preventDefault(); ev.stopPropagation(); }
  return !ev.stopped;
}

test("with the guard, an arrow key reaches the token list before the notebook's shortcuts take it", () => {
  const win = { listeners: [], addEventListener(t, fn, c) { this.listeners.push([t, fn, c]); } };
  const list = el(), token = el(list), cell = el();
  claimKeys(list, ["ArrowLeft", "ArrowRight"]);
  // without the guard the shortcut registry takes the key: the list never sees it
  assert.equal(dispatch(win, token, keydown("ArrowRight")), false);
  assert.equal(installKeyGuard(win), true);
  assert.equal(installKeyGuard(win), false, "one guard per page, however many views");
  assert.equal(win.listeners.length, 1);
  const ev = keydown("ArrowRight");
  assert.equal(dispatch(win, token, ev), true);
  assert.ok(ev.defaultPrevented && !ev.stopped);
  // elsewhere in the notebook the shortcuts work as before
  const other = keydown("ArrowDown");
  assert.equal(dispatch(win, cell, other), false);
  // Ctrl+S and the like are never claimed
  const save = keydown("ArrowRight", { ctrlKey: true });
  dispatch(win, token, save);
  assert.ok(save.stopped);
});
