"""A row as the widget sends it: its fields, its delta since the last message, and
its whole dict for the traits; and the engine's header line (the protocol is in
widget.py's docstring)."""

from __future__ import annotations

import os

from ..core.constraint_results import widget_fields as constraint_fields
from ..core.states import RowState

PROMPT_CHARS = 200


def rounded(x, nd):
    return None if x is None else round(float(x), nd)


def fields(r) -> dict:
    """The fields a delta carries when they change."""
    pt = r.prompt_tokens
    return {
        "state": r.state, "ntok": r.ntok,
        "pf": 100 if r.state in (RowState.DECODE, RowState.DONE) or not pt
        else min(100, int(100 * r.prefill_done / pt)),
        "tok_s": rounded(r.tok_s, 1), "ttft": rounded(r.ttft_s, 3),
        "finish": r.finish_reason, "error": r.error and str(r.error)[:300],
        "t_admit": rounded(r.t_admit, 3), "t_first": rounded(r.t_first, 3),
        "t_done": rounded(r.t_done, 3),
        **constraint_fields(r),
        **draft_fields(r),
    }


def _first(r) -> dict:
    """What a row's first appearance carries besides its fields."""
    d = {"prompt": prompt_text(r.prompt), "prompt_tokens": r.prompt_tokens,
         "t_submit": rounded(r.t_submit, 3)}
    if getattr(r.params, "adapter", None) is not None:  # its label on the row
        d["adapter"] = r.params.adapter
    return d


def delta(r, sent: dict):
    """What changed in row `r` since the values in `sent` (id -> what was sent; updated
    in place), or None: "d" the text appended, "text" the whole text if rewritten."""
    last = sent.get(r.id)
    out = {"id": r.id}
    if last is None:
        last = sent[r.id] = {"text": ""}
        out.update(_first(r))
    for k, v in fields(r).items():
        if last.get(k, ...) != v:
            out[k] = last[k] = v
    text, old = r.text, last["text"]
    if text is not old and text != old:
        if text.startswith(old):
            out["d"] = text[len(old):]
        else:  # text was rewritten (not just grown): replace it
            out["text"] = text
        last["text"] = text
    return out if len(out) > 1 else None


def full(r) -> dict:
    """The row's whole dict, as the traits hold it."""
    d = {"id": r.id, **_first(r), "text": r.text}
    d.update(fields(r))
    if getattr(r, "drafted_spans", None):  # [start, end) of text from accepted drafts
        d["drafted_spans"] = [list(x) for x in r.drafted_spans]
    return d


def prompt_text(p: str) -> str:
    """A prompt for the widget's column: its head and its tail when it is long, since
    rows made from one template differ anywhere, often near the end."""
    if len(p) <= PROMPT_CHARS:
        return p
    half = (PROMPT_CHARS - 3) // 2
    return p[:half] + " \u2026 " + p[-half:]


def draft_fields(r) -> dict:
    """A speculating row's drafts: [accepted, verified] (live)."""
    proposed = getattr(r, "draft_proposed", 0)
    if not proposed:
        return {}
    return {"draft": [r.draft_accepted, proposed]}


def short_model_name(name: str) -> str:
    """A local model directory shows as its folder name; hub ids stay whole."""
    if os.sep in name and os.path.isdir(name):
        return os.path.basename(name.rstrip(os.sep)) or name
    return name


def header(e, now: float, tok_s: float, **view) -> dict:
    """The header trait: the engine's model, limits, load and KV now, and the view's
    own fields (`view`: live, mode, title, max_rows, step0)."""
    return {
        "model": short_model_name(str(getattr(e, "model_name", "") or "")),
        "kv_budget": getattr(e, "kv_budget", None), "max_batch": getattr(e, "max_batch", None),
        "running": int(e.running), "queued": int(e.queued), "tok_s": tok_s,
        "kv": e.steps[-1].kv_bytes if e.steps and e.running else 0,
        "now": round(now, 3), **view,
        # a server engine: KV as a fraction of its cache, or None = not reported
        "kv_unit": getattr(e, "kv_unit", "bytes"),
        "batch_reported": getattr(e, "batch_reported", True),
        # e.g. "24 recurrent-state + 8 attention layers, KV 4-bit" (local engines)
        "cache_kinds": getattr(e, "cache_kinds", None),
    }
