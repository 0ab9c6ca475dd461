"""The notebook surface of adapters: ``%mlxnb adapter load NAME PATH | list |
unload NAME`` and ``%%generate --adapter base,ft1,ft2``, a sweep that runs every
prompt under each adapter (``base``: none) in one batch, with the adapter as a
record column and a label on each widget row."""

from __future__ import annotations

import dataclasses
import shlex
from typing import List, Optional

from IPython.core.error import UsageError

from .._text import fmt_bytes, one_line
from .cellparse import GridRow

__all__ = ["adapter_command", "adapter_names", "expand_adapters", "listing"]

BASE = "base"
_USAGE = "write %mlxnb adapter load NAME PATH, %mlxnb adapter list or %mlxnb adapter unload NAME"


def _local(eng, what: str):
    if not hasattr(eng, "load_adapter"):
        raise UsageError(f"%mlxnb adapter {what}: this kernel is connected to a server, "
                         "which serves adapters by model name; name one with "
                         "%%generate --adapter NAME (sent as the request's model)")
    return eng


def listing(eng) -> str:
    ads = getattr(eng, "adapters", None) or {}
    if not ads:
        return "mlxnb: no adapters loaded; %mlxnb adapter load NAME PATH"
    rows = {}
    for r in eng.rows:
        if not r.done:
            rows[r.params.adapter] = rows.get(r.params.adapter, 0) + 1
    lines = [f"mlxnb: {len(ads)} adapter{'s' * (len(ads) != 1)}, "
             f"{fmt_bytes(getattr(eng, 'adapter_bytes', 0))} on device"]
    for n, a in ads.items():
        lines.append(f"  {n}: {a.kind} rank {a.rank} scale {a.scale:g}, {a.layers} "
                     f"layers, {fmt_bytes(a.nbytes)}, {rows.get(n, 0)} unfinished rows, "
                     f"{a.path}")
    return "\n".join(lines)


def adapter_command(get_engine, rest: str) -> None:
    """``%mlxnb adapter ...``; `get_engine()` returns the engine (loading the default
    model when a load needs one)."""
    try:
        words = shlex.split(rest or "")
    except ValueError as e:
        raise UsageError(f"%mlxnb adapter: could not read the arguments ({e}); close "
                         "your quotes") from None
    sub, args = (words[0], words[1:]) if words else ("", [])
    if sub == "load":
        if len(args) != 2:
            raise UsageError(f"%mlxnb adapter load takes NAME PATH; {_USAGE}")
        eng = _local(get_engine(True), "load")
        try:
            info = eng.load_adapter(args[0], args[1])
        except ValueError as e:
            raise UsageError(f"%mlxnb adapter load: {one_line(e, 300)}") from None
        print(f"mlxnb: adapter {info.name!r} loaded ({info.kind} rank {info.rank}, "
              f"{info.layers} layers, {fmt_bytes(info.nbytes)}); use it with "
              f"%%generate --adapter {info.name} (or --adapter base,{info.name})")
    elif sub == "list" and not args:
        eng = get_engine(False)
        print(listing(eng) if eng is not None else "mlxnb: no model loaded yet")
    elif sub == "unload":
        if len(args) != 1:
            raise UsageError(f"%mlxnb adapter unload takes one NAME; {_USAGE}")
        eng = get_engine(False)
        if eng is None:
            raise UsageError("%mlxnb adapter unload: no model is loaded")
        try:
            _local(eng, "unload").unload_adapter(args[0])
        except ValueError as e:
            raise UsageError(f"%mlxnb adapter unload: {one_line(e, 300)}") from None
        print(f"mlxnb: adapter {args[0]!r} unloaded")
    else:
        raise UsageError(f"%mlxnb adapter: {_USAGE}")


def adapter_names(raw) -> Optional[List[Optional[str]]]:
    """--adapter's value(s) as a list of names (None for base), or None if not given."""
    if raw is None:
        return None
    items: List[str] = []
    for tok in (raw if isinstance(raw, (list, tuple)) else [raw]):
        items += [x.strip() for x in str(tok).strip("[]").split(",")]
    items = [x.strip("'\"") for x in items if x.strip("'\"")]
    if not items:
        raise UsageError("--adapter needs a name, or a comma list such as "
                         "--adapter base,ft1")
    dup = sorted({x for x in items if items.count(x) > 1})
    if dup:
        raise UsageError(f"--adapter lists {dup[0]!r} twice; give each adapter once")
    return [None if x == BASE else x for x in items]


def expand_adapters(grid: List[GridRow], names: Optional[List[Optional[str]]]) -> List[GridRow]:
    """Every grid row under each adapter, each prompt's variants side by side (same
    seed: a sampled comparison differs by the adapter alone)."""
    if names is None:
        return grid
    out = []
    for g in grid:
        for n in names:
            tag = dict(g.tag, adapter=n or BASE) if len(names) > 1 or n else dict(g.tag)
            out.append(dataclasses.replace(g, params=dict(g.params, adapter=n), tag=tag))
    return out
