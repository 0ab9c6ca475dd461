"""The widget's step charts as numbers: step records in, compact point arrays out.

A flush turns its new steps into at most a given number of points (buckets of
consecutive steps) plus a few per-row KV snapshots. The history a widget keeps is
bounded: past MAX_STEP_POINTS, neighbouring points merge pairwise and every second
snapshot goes. lib.js thins the history of a view by the same rules, so a view and
the traits agree on what a chart shows.
"""

from __future__ import annotations

MAX_STEP_POINTS = 2000  # per history array, in traits and in a view
MAX_SNAP_NUMBERS = 20000  # bound on per-row KV numbers kept in traits (lib.js: same)
SNAPS_PER_FLUSH = 4
STEP_KEYS = ("s", "t", "dt", "b", "pf", "kv", "tk")


def points(recs, max_points: int) -> dict:
    """Buckets of consecutive steps: the last step's values, mean dt, summed prefill,
    mean tokens emitted per step (tk: above the batch size where rows took
    speculative drafts). A bucket also closes at a step in which rows ended, so the
    step inspector can open each row's last step (a flush gets a point more for each
    such step)."""
    k = -(-len(recs) // max_points)
    groups, grp = [], []
    for rec in recs:
        grp.append(rec)
        if len(grp) == k or rec.ended:
            groups.append(grp)
            grp = []
    if grp:
        groups.append(grp)
    new = {key: [] for key in STEP_KEYS}
    for grp in groups:
        last = grp[-1]
        new["s"].append(last.step)
        new["t"].append(round(last.t, 3))
        new["dt"].append(round(1000 * sum(g.dt_s for g in grp) / len(grp), 2))
        new["b"].append(last.batch_size)
        new["pf"].append(sum(g.prefill_tokens for g in grp))
        new["kv"].append(last.kv_bytes)
        new["tk"].append(round(sum(g.tokens for g in grp) / len(grp), 2))
    return new


def kv_snapshots(recs, rows, nlive: int) -> list:
    """`[step, kv, [id, bytes, ...]]` for the latest of `recs` and a few evenly before it,
    counting only `rows`' ids. They are the bulky part: fewer as live rows grow."""
    nsnap = max(1, min(SNAPS_PER_FLUSH, 128 // max(1, nlive)))
    stride = -(-len(recs) // nsnap)
    snaps = []
    for rec in recs[len(recs) - 1::-stride][::-1]:
        flat = []
        for rid, b in rec.row_kv_bytes.items():
            if rid in rows:
                flat += (rid, int(b))
        snaps.append([rec.step, rec.kv_bytes, flat])
    return snaps


def extend(hist: dict, new: dict) -> None:
    """Append `new` points to `hist` in place, halving it while it is over the bound."""
    for key in STEP_KEYS:
        hist[key] += new[key]
    while len(hist["s"]) > MAX_STEP_POINTS:
        halve(hist)


def halve(h: dict) -> None:
    """Merge neighbouring pairs in place: keep the later step; dt = max (prefill spikes
    stay visible), prefill tokens summed. Same rule as lib.js `halveSteps`."""
    n = len(h["s"]) // 2 * 2
    for k in STEP_KEYS:
        a = h[k]
        if k == "dt":
            m = [max(a[i], a[i + 1]) for i in range(0, n, 2)]
        elif k == "pf":
            m = [a[i] + a[i + 1] for i in range(0, n, 2)]
        else:
            m = a[1:n:2]
        h[k] = m + a[n:]


def thin_snapshots(snaps: list) -> list:
    """Every second snapshot (keeping the latest) until both bounds hold; the same rule
    as lib.js `halveSnaps`."""
    while len(snaps) > MAX_STEP_POINTS or (
            len(snaps) > 2 and sum(len(s[2]) for s in snaps) > MAX_SNAP_NUMBERS):
        snaps = snaps[1::2] + ([snaps[-1]] if len(snaps) % 2 else [])
    return snaps
