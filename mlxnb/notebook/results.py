"""The lasting record of a widget's rows: `text/plain` and `text/html` for a cell output.

A live widget needs its kernel: JupyterLab and Notebook 7 do not save widget state by
default, and a reopened notebook then shows "Error displaying widget: model not found"
where the widget was (jupyterlab-manager renders that message and no other mime type
of the bundle). So every `%%generate` output also holds this rendering, in a display
output of its own that the widget keeps current by display id (`update_display_data`
while rows finish, and at a low rate while they run). Re-sending the widget's own
bundle instead would make JupyterLab build a new widget view on every update.

The HTML is small and safe: everything is escaped, styles are inline (sanitised
away in untrusted notebooks, where the text still reads), no scripts. Each row's text
is whole up to a per-row share of a total budget, so exports stay a sensible size.
"""

from __future__ import annotations

import html
import time

from .._text import one_line
from ..core.constraint_results import widget_fields as constraint_fields
from ..core.states import RowState

TOTAL_CHARS = 200_000  # all rows' text together, in one rendering
ROW_CHARS = 8_000  # most text of one row (fewer when many rows share the budget)
PROMPT_CHARS = 160


class Ended:
    """A finished row whose handle is gone, for a rendering, made from what its widget
    recorded (`rowwire.full`'s dict, and the row's tag where it holds settings,
    `kept_tag`): the saved results go on showing it as it ended, and a long session
    keeps nothing more per row than the widget already does."""

    __slots__ = ("id", "done", "state", "finish_reason", "error", "ntok", "prefill_done",
                 "prompt", "prompt_tokens", "t_admit", "t_done", "tag", "text", "tok_s",
                 "ttft_s", "adapter", "con")

    def __init__(self, d: dict, tag):
        self.id, self.done, self.state, self.text = d["id"], True, d["state"], d["text"]
        self.finish_reason, self.error, self.ntok = d["finish"], d["error"], d["ntok"]
        self.prompt, self.prompt_tokens = d["prompt"], d["prompt_tokens"]
        self.prefill_done = self.prompt_tokens
        self.t_admit, self.t_done, self.tok_s, self.ttft_s = (
            d["t_admit"], d["t_done"], d["tok_s"], d["ttft"])
        self.tag, self.adapter = tag, d.get("adapter")
        self.con = {k: d[k] for k in ("con", "parse") if k in d}


def kept_tag(row):
    """What a finished row keeps for its saved rendering besides the widget's record:
    its tag, where it holds settings that may tell rows apart (else nothing)."""
    tag = getattr(row, "tag", None)
    return tag if isinstance(tag, dict) and set(tag) - {"prompt_index"} else None


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def state_label(r) -> str:
    """"done: stop" for a finished row; "unfinished (decoding)" otherwise: a saved
    rendering of a run whose kernel went away must not read as if it still runs."""
    if r.done:
        return f"done: {r.finish_reason}"
    if r.state == RowState.PREFILL:
        pt = r.prompt_tokens or 1
        return f"unfinished (prefill {min(100, int(100 * r.prefill_done / pt))}%)"
    return "unfinished ({})".format({RowState.DECODE: "decoding"}.get(r.state, r.state))


def _con(r) -> dict:
    return r.con if isinstance(r, Ended) else constraint_fields(r)


def verdict(r) -> str:
    """A structured row's constraint and whether its output meets it ("json: valid",
    "json: invalid: not valid JSON: ... (cut by max_tokens: ...)"), "" otherwise."""
    con = _con(r)
    if not con:
        return ""
    if con["parse"] == "pending":
        return f"{con['con']}: not checked yet"
    if con["parse"] == "ok":
        return f"{con['con']}: valid"
    return f"{con['con']}: invalid: {one_line(con['parse'], 300)}"


def _varying(rows) -> list:
    """The tag keys (a sweep's settings, `sample`, list variables) whose values differ
    between these rows: what tells a grid's rows apart in a saved rendering."""
    tags = [r.tag if isinstance(getattr(r, "tag", None), dict) else {} for r in rows]
    keys = dict.fromkeys(k for t in tags for k in t if k != "prompt_index")
    return [k for k in keys if len({repr(t.get(k)) for t in tags}) > 1]


def _settings(r, keys) -> str:
    tag = r.tag if isinstance(getattr(r, "tag", None), dict) else {}
    # (a dashboard's rows come from many cells: a row says only the settings it has)
    return one_line(" ".join(f"{k}={tag[k]}" for k in keys if k in tag), 120) if keys else ""


def _stats(r) -> list:
    out = [f"{r.ntok} tok"]
    adapter = r.adapter if isinstance(r, Ended) else getattr(
        getattr(r, "params", None), "adapter", None)
    if adapter is not None:
        out.insert(0, f"adapter {adapter}")
    if r.tok_s is not None:
        out.append(f"{r.tok_s:.1f} tok/s")
    if r.ttft_s is not None:
        out.append(f"ttft {r.ttft_s:.2f} s")
    return out


def _row_budget(n: int) -> int:
    """Each row's share (a cell's most rows, 1024 by default, get 195 characters)."""
    return min(ROW_CHARS, TOTAL_CHARS // max(1, n))


def _body(r, budget: int) -> str:
    """The row's text within `budget` characters; an errored row's error first, the
    text it generated before the error after it, in the same budget."""
    head = f"error: {one_line(r.error, max(budget - 7, 20))}" if r.error else ""
    room, text = max(budget - len(head), 0), r.text
    if len(text) > room:
        more = len(text) - room
        text = text[:room] + f"\u2026 [{more} more characters: see run.texts]"
    return f"{head}\n{text}" if head and r.text else head or text


def summary(rows, model: str = "", title: str = "", now: float | None = None) -> dict:
    """Counts for the heading: rows, done, unfinished, tokens, run tok/s."""
    done = [r for r in rows if r.done]
    t0 = min((r.t_admit for r in rows if r.t_admit is not None), default=None)
    t1 = max((r.t_done for r in done if r.t_done is not None), default=None)
    tokens = sum(r.ntok for r in rows)
    span = (t1 - t0) if t0 is not None and t1 is not None else 0.0
    return {"model": model, "title": title, "rows": len(rows), "done": len(done),
            "unfinished": len(rows) - len(done), "tokens": tokens,
            "tok_s": tokens / span if span > 0 and len(done) == len(rows) else None,
            "at": time.strftime("%H:%M:%S", time.localtime(now or time.time()))}


def heading(s: dict) -> str:
    parts = ["mlxnb"]
    if s["model"]:
        parts[0] += f" {s['model']}"
    if s["title"]:  # the name the user gave with -o
        parts.append(f"-o {s['title']}")
    parts.append(f"{s['done']}/{s['rows']} rows done")
    parts.append(f"{s['tokens']} tokens")
    if s["tok_s"]:
        parts.append(f"{s['tok_s']:.1f} tok/s over the run")
    return " \u00b7 ".join(parts)


def unfinished_note(s: dict) -> str:
    n = s["unfinished"]
    return (f"{n} row{'s' * (n != 1)} unfinished as of {s['at']}. This output updates "
            "while its kernel runs them; if the kernel has stopped, they never finished.")


def plain(rows, model: str = "", title: str = "", now: float | None = None) -> str:
    s = summary(rows, model, title, now)
    lines = [heading(s)]
    if s["unfinished"]:
        lines.append(unfinished_note(s))
    budget, keys = _row_budget(len(rows)), _varying(rows)
    for i, r in enumerate(rows, 1):
        lines.append("")
        v, put = verdict(r), _settings(r, keys)
        lines.append(f"[{i}] {state_label(r)} \u00b7 " + (f"{v} \u00b7 " if v else "")
                     + (f"{put} \u00b7 " if put else "") + " \u00b7 ".join(_stats(r))
                     + f" \u00b7 prompt: {one_line(r.prompt, PROMPT_CHARS)}")
        body = _body(r, budget)
        if body:
            lines += ["    " + ln for ln in body.splitlines() or [body]]
    return "\n".join(lines)


_E = html.escape
_BOX = ("font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:12px;"
        "line-height:1.4;max-width:100%")
_META = "color:var(--jp-ui-font-color2,#5c5c5c);margin:6px 0 1px 0"
_TEXT = ("white-space:pre-wrap;word-break:break-word;margin:0 0 0 1.6em;padding:0;"
         "max-height:16em;overflow:auto;"
         "font-family:var(--jp-code-font-family,monospace);font-size:12px;"
         "background:none;border:none")


def to_html(rows, model: str = "", title: str = "", now: float | None = None) -> str:
    s = summary(rows, model, title, now)
    out = [f'<div class="mlxnb-results" data-rows="{s["rows"]}" data-done="{s["done"]}"'
           f' style="{_BOX}">',
           f'<div class="mlxnb-results-head" style="font-weight:600">{_E(heading(s))}</div>']
    if s["unfinished"]:
        out.append(f'<div class="mlxnb-results-note" style="color:#a33;">'
                   f"{_E(unfinished_note(s))}</div>")
    budget, keys = _row_budget(len(rows)), _varying(rows)
    for i, r in enumerate(rows, 1):
        state = "done" if r.done else "unfinished"
        v, put = verdict(r), _settings(r, keys)
        meta = f"[{i}] {state_label(r)} \u00b7 " + (f"{v} \u00b7 " if v else "") \
            + (f"{put} \u00b7 " if put else "") + " \u00b7 ".join(_stats(r))
        con = _con(r)
        valid = f' data-valid="{int(con["parse"] == "ok")}"' if v and con["parse"] != "pending" else ""
        out.append(f'<div class="mlxnb-results-row" data-state="{state}"{valid}>'
                   f'<div style="{_META}"><b>{_E(meta)}</b> \u00b7 '
                   f'<span title="{_E(_clip(r.prompt, 2000))}">'
                   f"{_E(one_line(r.prompt, PROMPT_CHARS))}</span></div>"
                   f'<pre class="mlxnb-results-text" style="{_TEXT}">'
                   f"{_E(_body(r, budget))}</pre></div>")
    out.append("</div>")
    return "".join(out)


def bundle(rows, model: str = "", title: str = "", now: float | None = None) -> dict:
    rows = list(rows)
    return {"text/plain": plain(rows, model, title, now),
            "text/html": to_html(rows, model, title, now)}
