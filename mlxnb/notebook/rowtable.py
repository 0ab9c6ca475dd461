"""The rows a widget shows, by id in display order, held only as long as they need it.

ipywidgets keeps every open widget alive for good (its comm may serve a view that is
reopened later), so a widget that held its rows would keep every row of every cell of
a long session. A `RowTable` holds a row while it runs; once a finished row's last
state is recorded (`full`), it keeps that dict (what the synced traits and a
reopened view need), what `keep` keeps of it for a rendering of it once it is gone
(`shown`), and only a weak reference to the row, which then lives as long as the user's own handles (a `Run`, a
variable).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterator, List

__all__ = ["RowTable", "newest"]


class _Recorded:
    """A finished row whose last state is recorded: the dict, what `keep` kept of it,
    and the row while it lives."""

    __slots__ = ("ref", "full", "kept")

    def __init__(self, row, full: dict, kept):
        self.ref, self.full, self.kept = weakref.ref(row), full, kept


class RowTable:
    def __init__(self, rows=(), keep: Callable[[object], object] = lambda row: None,
                 show: Callable[[dict, object], object] = lambda full, kept: full):
        """For a rendering (`shown`) of a finished row once it is gone: `keep(row)` is
        kept as the row is recorded, `show(full, kept)` stands in for the row."""
        self._keep, self._show = keep, show
        self._at: Dict[int, object] = {}  # id -> Row (held) or _Recorded
        for r in rows:
            self._at[r.id] = r

    def __contains__(self, rid) -> bool:
        return rid in self._at

    def __len__(self) -> int:
        return len(self._at)

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __setitem__(self, rid: int, row) -> None:
        self._at[rid] = row

    def __delitem__(self, rid: int) -> None:
        del self._at[rid]

    def get(self, rid, default=None):
        """The row with id `rid` while it lives (else `default`)."""
        e = self._at.get(rid)
        if isinstance(e, _Recorded):
            e = e.ref()
        return default if e is None else e

    def __getitem__(self, rid):
        row = self.get(rid)
        if row is None:
            raise KeyError(rid)
        return row

    def recorded(self, rid):
        """The dict recorded when row `rid` finished (None while it runs)."""
        e = self._at.get(rid)
        return e.full if isinstance(e, _Recorded) else None

    def done(self, rid) -> bool:
        e = self._at[rid]
        return isinstance(e, _Recorded) or e.done

    def values(self) -> List:
        """The rows that still live (a recorded row nobody holds is gone)."""
        return [r for r in map(self.get, self._at) if r is not None]

    def items(self) -> List[tuple]:
        return [(rid, r) for rid in self._at if (r := self.get(rid)) is not None]

    def shown(self) -> List:
        """Every row in order for a rendering: the row while it lives, else `show` of
        its record."""
        out = []
        for e in self._at.values():
            row = e.ref() if isinstance(e, _Recorded) else e
            out.append(self._show(e.full, e.kept) if row is None else row)
        return out

    def full(self, make: Callable[[object], dict]) -> List[dict]:
        """Every row's full dict, in order: `make(row)` for a row that lives, the
        recorded dict for one that is gone. A finished row is recorded here, and from
        then on held only weakly."""
        out: List[dict] = []
        for rid, e in self._at.items():
            row = e.ref() if isinstance(e, _Recorded) else e
            if row is None:
                out.append(e.full)
                continue
            d = make(row)
            if isinstance(e, _Recorded):
                e.full = d
            elif row.done:
                self._at[rid] = _Recorded(row, d, self._keep(row))
            out.append(d)
        return out


def newest(rows, most: int) -> list:
    """A dashboard's first rows: every live row and the newest finished ones, at most
    `most` in all unless more are live (the rule `_prune` keeps), in the engine's order."""
    rows = list(rows)
    room = max(most - sum(1 for r in rows if not r.done), 0)
    keep = []
    for r in reversed(rows):
        if not r.done or room > 0:
            room -= r.done
            keep.append(r)
    return keep[::-1]
