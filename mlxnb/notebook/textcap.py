"""The rows' text as the widget's `rows` trait holds it: bounded, whatever the run's size.

That trait is what a notebook saved with widget state keeps, and what every view is
sent on each trait write, so its text has a budget: finished rows share
`TEXT_BUDGET` characters (rows shorter than the share stay whole, longer ones keep
their first `share` characters), and no row keeps more than `ROW_TEXT_MAX`. A cut
row's dict says how many characters it left out ("cut"), and the view says so on the
row. The rows themselves (`run.rows[i].text`, `run.texts`) keep all of it.

A row still running keeps its whole text: the deltas that follow append to the text
a view holds, so a cut one would read with a hole. At most a batch of rows runs, and
each is cut at the first trait write after it finishes.
"""

from __future__ import annotations

from typing import Iterable, List

# 2,000,000 characters: a 1,000-row run of 400-token answers (about 1.6 M characters
# of English) is saved whole; 10,000 rows keep about 200 characters each, about what a
# finished row's one-line view shows. About 2 MB of ASCII in the .ipynb, a size
# git, nbviewer and a browser parsing the saved state take without trouble.
TEXT_BUDGET = 2_000_000
# 50,000 characters (about 12k tokens, 25 pages): an expanded row is a small scroll
# box, and a few very long generations would otherwise fill the file on their own.
ROW_TEXT_MAX = 50_000


def share(lengths: Iterable[int], budget: int, most: int) -> int:
    """The largest per-row length c <= `most` with sum(min(n, c)) <= `budget`: rows no
    longer than c stay whole, the longer ones split what is left equally."""
    ns = sorted(min(n, most) for n in lengths)
    left = budget
    for i, n in enumerate(ns):
        c = left // (len(ns) - i)  # what each row from here on may have
        if n > c:
            return c
        left -= n
    return most


def cut(d: dict, keep: int) -> dict:
    """A copy of row dict `d` holding the first `keep` characters of its text, with
    "cut": how many it left out; its drafted spans are clipped to the text held."""
    text = d["text"]
    out = {**d, "text": text[:keep], "cut": len(text) - keep}
    spans = d.get("drafted_spans")
    if spans:
        kept = [[a, min(b, keep)] for a, b in spans if a < keep]
        if kept:
            out["drafted_spans"] = kept
        else:
            del out["drafted_spans"]
    return out


def cap_rows(rows: List[dict], live, budget: int | None = None,
             most: int | None = None) -> List[dict]:
    """`rows` (whole row dicts, in order) with the text of every row whose id is not in
    `live` cut to one shared length (see the module docstring); uncut dicts are the
    same objects. `budget` and `most` default to TEXT_BUDGET and ROW_TEXT_MAX."""
    budget = TEXT_BUDGET if budget is None else budget
    most = ROW_TEXT_MAX if most is None else most
    done = [d for d in rows if d["id"] not in live]
    c = share((len(d["text"]) for d in done), budget, most)
    return [cut(d, c) if d["id"] not in live and len(d["text"]) > c else d for d in rows]
