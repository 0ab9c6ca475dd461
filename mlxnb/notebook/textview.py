"""The widget as a few lines of text, for frontends that show no widget: a header
line, then one line per row (its state, counts, prompt and text, cut to a width)."""

from __future__ import annotations

from .._text import fmt_bytes, one_line
from ..core.constraint_results import widget_fields as constraint_fields
from ..core.states import RowState


def summary_text(header: dict, rows, max_rows: int = 20, width: int = 120) -> str:
    """A compact tqdm-like text view (terminal IPython, nbconvert, text/plain) of `rows`
    under a widget's header fields."""
    h = header
    rows = list(rows)
    counts = {}
    for r in rows:
        k = "done" if r.done else r.state
        counts[k] = counts.get(k, 0) + 1
    parts = [f"mlxnb {h['model']}".rstrip(), f"{len(rows)} rows"
             + (" (" + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")" if rows else "")]
    if h["tok_s"]:
        parts.append(f"{h['tok_s']:.0f} tok/s")
    if h["kv_budget"]:
        parts.append(f"KV {fmt_bytes(h['kv'])} / {fmt_bytes(h['kv_budget'])}")
    elif h["kv_unit"] == "fraction":
        parts.append(f"server KV {100 * h['kv']:.0f}%")
    elif h["kv_unit"] is None:
        parts.append("KV not reported by this server")
    lines = [" | ".join(parts)]
    shown = rows[-max_rows:]
    if len(rows) > len(shown):
        lines.append(f"  ... {len(rows) - len(shown)} earlier rows")
    lines += [row_line(r, width) for r in shown]
    if any(not r.done for r in rows):
        lines.append("(a snapshot: the live widget shows progress; display it again for now)")
    return "\n".join(lines)


def row_line(r, width: int) -> str:
    """`[done:stop]   12 tok  34.1 tok/s  ttft 0.12s  "prompt..." -> "text..."`"""
    if r.done:
        badge = f"done:{r.finish_reason}"
    elif r.state == RowState.PREFILL:
        pt = r.prompt_tokens or 1
        badge = f"prefill {min(100, int(100 * r.prefill_done / pt))}%"
    else:
        badge = {RowState.DECODE: "decoding"}.get(r.state, r.state)
    stats = f"{r.ntok:>5} tok"
    stats += f" {r.tok_s:6.1f} tok/s" if r.tok_s is not None else " " * 12
    stats += f"  ttft {r.ttft_s:.2f}s" if r.ttft_s is not None else " " * 12
    con = constraint_fields(r)
    if con:  # a constrained row: its kind and whether its output parses
        badge += f" {con['con']}" + {"ok": " ok", "pending": ""}.get(con["parse"], " invalid")
    line = f"[{badge}]".ljust(15) + stats
    out = f"error: {r.error}" if r.error else r.text
    p, txt = " ".join(r.prompt.split()), " ".join(out.split())
    room = max(24, width - len(line) - 10)  # quotes, arrow
    pn = min(len(p), max(12, room - min(len(txt), int(room * 0.6))))  # short text: long prompt
    line += f'  "{one_line(p, pn)}"'
    if txt:
        line += f' -> "{one_line(txt, max(8, room - pn))}"'
    return line
