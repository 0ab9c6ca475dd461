"""What the widget's detail views show, built when a view opens (never streamed).

The front end asks with a custom message and gets one answer:

    {"type": "row_detail", "id": n}   ->  {"type": "row_detail", "id": n, "trace": [...],
                                            "tokens": {...} or None, "why": str}
    {"type": "step_detail", "step": s} -> {"type": "step_detail", "step": s, ...}

row: its life (`Row.trace`, times rounded to 0.1 ms) and its tokens as the token view
shows them: each token's text, its probability under the distribution it was drawn
from and the top alternatives (rows run with `--logprobs K`; others get their tokens
and `why` says how to see probabilities), the sampling in force (temperature and
filters), the constraint if any. A token that came from an accepted speculative
draft is marked (`Row.drafted`: the indices of such tokens).

step: one `StepRecord` (the batch, the rows that prefilled and how much, the rows
that ended, the time split, KV bytes and budget), with the rows' prompts for labels.

Finished rows and steps opened while the kernel runs are kept in the widget's traits
(`keep`, `keep_step`), so a notebook saved with widget state opens them without one.
"""

from __future__ import annotations

import bisect
import math

from .._text import one_line
from ..core.constraint_params import kind_of

MAX_TOKENS = 4096  # tokens of one row sent to the token view
KEEP_ROWS = 8  # rows' details kept in the widget's traits (saved with widget state)
KEEP_TOKENS = 1024  # tokens of each kept row
KEEP_STEPS = 64  # steps inspected last, kept in the traits likewise (~0.5 KB each)
LABEL_CHARS = 60


def _r(x, nd=4):
    return None if x is None else round(float(x), nd)


def compact_trace(row) -> list:
    """`row.trace` with times rounded (what the widget keeps in its traits)."""
    out = []
    for p in getattr(row, "trace", None) or []:
        out.append({k: (_r(v) if isinstance(v, float) else v) for k, v in p.items()})
    return out


def _piece(tok, tid: int, cache: dict) -> str:
    s = cache.get(tid)
    if s is None:
        try:
            s = cache[tid] = tok.decode([tid])
        except Exception:  # a tokenizer that cannot decode one id alone
            s = cache[tid] = f"<{tid}>"
    return s


def _char_start(tokenizer, toks: list, start: int) -> int:
    """A token index at or before `start` where the whole view's scan holds nothing
    over (the tokens before it do not end in a cut character): a scan from there
    gives the same pieces. Up to 16 tokens back, else 0."""
    for j in range(start, max(0, start - 16), -1):
        try:
            if not tokenizer.decode(toks[max(0, j - 4):j]).endswith("\ufffd"):
                return j
        except Exception:
            return 0
    return 0


def _p(lp):
    """A probability from a logprob; None where there is none to show (-inf, NaN)."""
    return _r(math.exp(lp), 5) if isinstance(lp, (int, float)) and math.isfinite(lp) \
        else None


def _pieces(tokenizer, toks: list, start: int) -> dict:
    """Token index -> the text it adds to the row, for tokens from `start` on: each
    token decoded after the one before it (so a SentencePiece word keeps its leading
    space), and a character split over tokens (the bytes of an emoji) shown on the
    token that completes it, the others adding "". Joined, the pieces are the text."""
    out, held = {}, 0  # tokens not shown yet: they end in an incomplete character
    for i in range(_char_start(tokenizer, toks, start), len(toks)):
        k = max(0, i - held - 1)  # one shown token of context before them
        try:
            whole = tokenizer.decode(toks[k:i + 1])
            shown = tokenizer.decode(toks[k:i - held]) if i - held > k else ""
        except Exception:  # a tokenizer that cannot: one by one
            return {}
        if whole.endswith("\ufffd") and held < 4:
            held += 1
            piece = ""
        else:
            held, piece = 0, whole[len(shown):]
        if i >= start:
            out[i] = piece
    return out


def sampling(row) -> dict:
    p = row.params
    out = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
           "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
           "logprobs": p.logprobs}
    kind = kind_of(p)
    if kind is not None:
        out["constraint"] = kind
    return out


def token_view(row, tokenizer, start: int = 0) -> dict:
    """The row's tokens from `start` on (a view holding the first `start` asks for the
    rest only), for the token view; with no tokenizer (a closed engine, a server) just
    what is known without one."""
    toks = list(row.tokens[:MAX_TOKENS])
    lps = row.logprobs if getattr(row, "logprobs", None) else None
    drafts = set(getattr(row, "drafted", None) or ())
    cache: dict = {}
    pieces = _pieces(tokenizer, toks, start) if tokenizer is not None else {}
    # a server's row has no token ids: its logprobs name each token by its text
    texts = [] if toks or lps is None else [
        rec.get("token") if isinstance(rec, dict) and isinstance(rec.get("token"), str)
        else "" for rec in lps[:MAX_TOKENS]]
    n = len(toks) or len(texts)
    items = []
    for i in range(min(start, n), n):
        if texts:
            it = {"i": i, "id": None, "s": texts[i]}
        else:
            it = {"i": i, "id": int(toks[i])}
        if tokenizer is not None and not texts:
            it["s"] = pieces.get(i)
            if it["s"] is None:
                it["s"] = _piece(tokenizer, int(toks[i]), cache)
        if lps is not None and i < len(lps) and lps[i] is not None:
            rec = lps[i]
            lp = rec.get("logprob")
            it["p"] = _p(lp)
            alts = []
            for aid, alp in rec.get("top", [])[:10]:
                if isinstance(aid, str):  # a server's alternative: its text, no id
                    alt = {"id": None, "p": _p(alp), "s": aid}
                else:
                    alt = {"id": int(aid), "p": _p(alp)}
                    if tokenizer is not None:
                        alt["s"] = _piece(tokenizer, int(aid), cache)
                alts.append(alt)
            it["top"] = alts
            if rec.get("allowed") is not None:  # a structured row: tokens its constraint allowed
                it["allowed"] = int(rec["allowed"])
        if i in drafts:
            it["draft"] = True
        items.append(it)
    total = len(lps) if texts else len(row.tokens)
    return {"items": items, "start": min(start, n), "more": max(0, total - n),
            "probs": lps is not None, "sampling": sampling(row)}


def row_detail(row, engine, start: int = 0) -> dict:
    tok = getattr(engine, "tokenizer", None)
    d = {"type": "row_detail", "id": row.id, "trace": compact_trace(row),
         "tokens": token_view(row, tok, start)}
    if d["tokens"]["probs"]:
        d["why"] = ""
    else:
        d["why"] = ("probabilities are kept for rows that ask: run the cell with "
                    "--logprobs 5 to see each token's probability and alternatives")
    return d


def find_step(steps, n: int):
    """The StepRecord numbered `n` in `steps` (ordered by number), or None."""
    if not steps:
        return None
    i = bisect.bisect_left(steps, n, key=lambda s: s.step)
    return steps[i] if i < len(steps) and steps[i].step == n else None


def step_detail(steps, n: int, rows) -> dict:
    """One step for the step inspector; `rows`: the widget's RowTable (labels: of a
    row that lives, or as recorded when it finished)."""
    rec = find_step(steps, n)
    if rec is None:
        return {"type": "step_detail", "step": n, "missing": True}
    d = rec.to_dict()
    d.pop("row_kv_bytes", None)  # per-row bytes: the KV chart has them
    d.update(type="step_detail", ms=_r(1000 * rec.dt_s, 3),
             split={k: _r(1000 * v, 3) for k, v in d.get("split", {}).items()},
             t=_r(rec.t), dt_s=_r(rec.dt_s, 6))
    ids = set(d.get("batch_ids", [])) | {int(k) for k in d.get("prefill_rows", {})} | \
        set(d.get("ended", []))
    d["labels"], d["finish"] = {}, {}
    for i in ids:
        row = rows.get(i)
        seen = ({"prompt": row.prompt, "finish": row.finish_reason} if row is not None
                else rows.recorded(i) if i in rows else None)
        if seen is None:
            continue
        d["labels"][str(i)] = one_line(seen.get("prompt") or "", LABEL_CHARS)
        if i in d.get("ended", []):
            d["finish"][str(i)] = seen.get("finish")
    return d


def keep(details: dict, rid: int, d: dict) -> dict:
    """The widget's `details` trait with row `rid`'s detail added last (its tokens cut
    to KEEP_TOKENS), the oldest dropped beyond KEEP_ROWS; a new dict (traitlets syncs
    on reassignment)."""
    d = dict(d)
    tv = d.get("tokens")
    if tv and len(tv["items"]) > KEEP_TOKENS:
        d["tokens"] = {**tv, "items": tv["items"][:KEEP_TOKENS],
                       "more": tv["more"] + len(tv["items"]) - KEEP_TOKENS}
    out = {k: v for k, v in details.items() if k != str(rid)}
    out[str(rid)] = d
    while len(out) > KEEP_ROWS:
        out.pop(next(iter(out)))
    return out


def keep_step(kept: dict, d: dict) -> dict:
    """The widget's `step_details` trait with step detail `d` added last, the oldest
    dropped beyond KEEP_STEPS; a step the engine no longer has is not kept."""
    if d.get("missing"):
        return kept
    key = str(d["step"])
    out = {k: v for k, v in kept.items() if k != key}
    out[key] = d
    while len(out) > KEEP_STEPS:
        out.pop(next(iter(out)))
    return out
