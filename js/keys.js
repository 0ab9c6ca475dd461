// Keys a control of the widget handles itself, kept from the notebook's shortcuts.
//
// JupyterLab hands a keydown to its shortcuts once the event has bubbled to document,
// so a control that calls preventDefault wins. Notebook 7 listens on document in the
// capture phase: its shortcuts see the key before any element inside the page does,
// and in command mode ArrowLeft/Right/Up/Down (the notebook's "move cursor" bindings,
// selector `.jp-Notebook.jp-mod-commandMode :focus`) are taken -- preventDefault,
// stopPropagation -- so an arrow key in the token list moved the active cell instead.
// A capture listener on window runs before document's: it marks a claimed key
// handled (the shortcut registry skips an event whose default is prevented) and the
// event still travels on to the control. Keys with Ctrl, Alt or Meta are never
// claimed, so the notebook's own shortcuts (save, run) keep working from the widget.

export const KEYS_ATTR = "data-mlxnb-keys";
const GUARD = Symbol.for("mlxnb.keyGuard");

/** Mark `el` as handling `keys` (KeyboardEvent.key names) itself. */
export function claimKeys(el, keys) {
  el.setAttribute(KEYS_ATTR, keys.join(" "));
}

/** Whether a keydown on `target` is one a widget control claimed. */
export function isClaimed(target, ev) {
  if (!ev || ev.ctrlKey || ev.altKey || ev.metaKey) return false;
  const owner = target && typeof target.closest === "function" ? target.closest(`[${KEYS_ATTR}]`) : null;
  if (!owner) return false;
  return (owner.getAttribute(KEYS_ATTR) || "").split(" ").includes(ev.key);
}

/** Install the window capture listener, once per page (every view shares it). */
export function installKeyGuard(win) {
  if (!win || win[GUARD]) return false;
  win[GUARD] = true;
  win.addEventListener("keydown", (ev) => { if (isClaimed(ev.target, ev)) ev.preventDefault(); }, true);
  return true;
}
