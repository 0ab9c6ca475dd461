"""``%%generate``'s options that ask the engine for more than sampling: a constraint
(``--json-schema``, ``--regex``, ``--choice``, ``--grammar``: some name notebook
variables) and speculation (``--speculate``, ``--num-draft``), as Engine.submit
keywords. Pure, like cellparse.py: a user's mistake is a one-line UsageError."""

from __future__ import annotations

import ast
from typing import Any, Dict, List, Optional

from IPython.core.error import UsageError

__all__ = ["constraint_params", "speculation"]


def _variable(flag: str, name: str, ns: dict, what: str) -> Any:
    if not name.isidentifier():
        raise UsageError(f"{flag} takes the name of a notebook variable holding {what}; "
                         f"got {name!r}")
    if name not in ns:
        raise UsageError(f"{flag} {name}: {name} is not defined; define it in a cell above "
                         f"({what})")
    return ns[name]


def speculation(mode: Optional[str], num_draft: Optional[str], default_mode: Optional[str],
                default_k: int) -> Dict[str, Any]:
    """``--speculate lookup|draft|off`` and ``--num-draft K`` (else the %config defaults) as
    Engine.submit keywords; nothing given and no default: the engine's own."""
    out: Dict[str, Any] = {}
    m = mode if mode is not None else default_mode
    if m is not None:
        m = str(m).strip().lower()
        if m in ("off", "none", "no"):
            out["speculate"] = None
        elif m in ("lookup", "draft"):  # (an engine without a draft refuses 'draft')
            out["speculate"] = m
        else:
            raise UsageError(f"--speculate takes lookup, draft or off, got {mode!r}; write "
                             "e.g. --speculate lookup")
    k = num_draft if num_draft is not None else default_k
    try:
        k = int(k)
    except (TypeError, ValueError):
        k = -1
    if not 0 <= k <= 16:
        raise UsageError(f"--num-draft must be an integer in 0-16 (0 = adaptive), got "
                         f"{num_draft!r}; write e.g. --num-draft 4")
    if k:
        out["num_draft"] = k
    return out


def constraint_params(json_schema: Optional[str], regex: Optional[str], choice: Any,
                      grammar: Optional[str], ns: dict) -> Dict[str, Any]:
    """``--json-schema NAME`` / ``--regex R`` / ``--choice a,b,c`` (or the name of a
    list variable) / ``--grammar NAME`` as Engine.submit keywords (at most one). The
    values themselves are checked by the engine, which compiles them."""
    given = [f for f, v in (("--json-schema", json_schema), ("--regex", regex),
                            ("--choice", choice), ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of --json-schema, --regex, --choice, --grammar; "
                         f"got {', '.join(given)}")
    if json_schema is not None:
        what = "a dict, a JSON string or a pydantic model class"
        schema = _variable("--json-schema", json_schema, ns, what)
        if schema is None:
            raise UsageError(f"--json-schema {json_schema}: {json_schema} is None; give a "
                             f"variable holding {what}")
        return {"json_schema": schema}
    if grammar is not None:
        g = _variable("--grammar", grammar, ns, "a Lark or GBNF grammar string")
        if not isinstance(g, str):
            raise UsageError(f"--grammar {grammar}: {grammar} is a {type(g).__name__}, not "
                             "a string; give a variable holding a Lark or GBNF grammar")
        return {"grammar": g}
    if regex is not None:
        if not regex:
            raise UsageError("--regex needs a pattern; write e.g. --regex '[0-9]+'")
        return {"regex": regex}
    if choice is not None:
        return {"choices": _choices(choice, ns)}
    return {}


def _count(items) -> str:
    return f"{len(items) or 'no'} option{'s' * (not items)}"


def _collection(v) -> bool:
    """A sized, re-iterable, one-dimensional collection of options (an iterator would
    be used up by the first cell; a DataFrame iterates over its column names)."""
    if not hasattr(v, "__iter__") or not hasattr(v, "__len__"):
        return False
    if getattr(v, "ndim", 1) != 1:  # numpy arrays, DataFrames
        return False
    try:
        return iter(v) is not v
    except TypeError:
        return False


def _choices(choice: Any, ns: dict) -> List[str]:
    """``--choice a,b,c``, ``--choice [a, b]`` (a list as IPython writes ``{labels}``)
    or ``--choice LABELS``, a notebook variable holding any collection of options."""
    toks = [str(t) for t in (choice if isinstance(choice, (list, tuple)) else [choice])]
    name = toks[0] if len(toks) == 1 and toks[0].isidentifier() else None
    if name is not None and name in ns:
        v = ns[name]
        if isinstance(v, (str, bytes, dict)) or not _collection(v):
            raise UsageError(f"--choice {name}: {name} is a {type(v).__name__}, not a "
                             f"collection of options; give it a list, e.g. "
                             f"{name} = ['yes', 'no'], or write --choice yes,no")
        if isinstance(v, (set, frozenset)):
            v = sorted(v, key=str)  # the order is saved with the row
        items = [str(x) for x in v]  # every item as given; the engine refuses blank ones
        if len(items) < 2:
            raise UsageError(f"--choice {name}: {name} holds {_count(items)}; give it "
                             "two or more")
        return items
    whole = " ".join(toks)
    if whole[:1] + whole[-1:] in ("[]", "()"):  # a list as IPython writes {labels}
        try:  # its items as given, commas inside them included
            listed = ast.literal_eval(whole)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            listed = None
        if isinstance(listed, (list, tuple)):  # its items, never split at commas
            items = [str(x) for x in listed]
            if len(items) < 2:
                raise UsageError(f"--choice {whole}: a list of {_count(items)}; give two "
                                 "or more")
            return items
        if not any(b in whole[1:-1] for b in "[]()"):
            toks = [whole[1:-1]]
    items = [x.strip() for t in toks for x in t.split(",")]
    items = [x for x in items if x]
    if not items:
        raise UsageError("--choice needs options; write e.g. --choice yes,no or "
                         "--choice LABELS (a list variable)")
    if len(items) == 1:
        also = (f", or define {name} as a list of options" if name is not None else "")
        raise UsageError(f"--choice {items[0]}: one option is no choice; give two or more, "
                         f"e.g. --choice yes,no{also}")
    return items
