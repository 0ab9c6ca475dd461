"""A structured row's constraint keywords: their values normalized, checked before
anything compiles, and llguidance's errors as one line that says what to change
(schema_walk.py reads a schema as llguidance does)."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from .._log import log
from .schema_walk import masked_nodes

KINDS = ("json_schema", "regex", "choices", "grammar")


# serde_json (under llguidance) stops at 128 levels; Python's json at ~1,000 with a
# RecursionError. Real schemas nest a few levels, with $defs for anything recursive.
MAX_SCHEMA_DEPTH = 100
_TOO_DEEP = (f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels deep (or holds "
             "itself); flatten it, with $defs and $ref for recursive parts")


def _short(v: Any, n: int = 60) -> str:
    s = " ".join(repr(v).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# -- the user's values (loop side, before a SamplingParams exists) -----------------
def normalize(params: dict) -> dict:
    """Bring constraint keywords to their stored form, in place: json_schema -> dict
    (from a dict, a JSON string or a pydantic model class), choices -> tuple of str.
    ValueError (one line) for a value of the wrong kind, or for two constraints."""
    given = [k for k in KINDS if params.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema=, regex=, choices=, grammar= per "
                         f"row; got {', '.join(given)}")
    js = params.get("json_schema")
    if js is not None:
        params["json_schema"] = _schema_dict(js)
    ch = params.get("choices")
    if ch is not None:
        if isinstance(ch, (str, bytes)) or not hasattr(ch, "__iter__"):
            raise ValueError(f"choices takes a list of strings, e.g. choices=['yes', 'no']; "
                             f"got {_short(ch)}")
        params["choices"] = tuple(ch)
    return params


def _schema_dict(js) -> dict:
    if isinstance(js, type) and hasattr(js, "model_json_schema"):  # a pydantic model
        try:
            js = js.model_json_schema()
        except Exception as e:
            log.debug("model_json_schema of %r failed", js, exc_info=True)
            raise ValueError(f"json_schema: {js.__name__}.model_json_schema() failed "
                             f"({type(e).__name__}: {one_line(e, 120)}); pass a schema "
                             "dict instead") from None
    elif isinstance(js, (str, bytes)):
        try:
            js = json.loads(js)
        except ValueError as e:
            raise ValueError(f"json_schema is a string but not valid JSON ({e}); pass a "
                             "dict, a JSON string or a pydantic model class") from None
        except RecursionError:  # Python's parser recurses per level
            raise ValueError(_TOO_DEEP) from None
    if not isinstance(js, dict):
        raise ValueError(f"json_schema takes a dict, a JSON string or a pydantic model "
                         f"class; got {_short(js)}")
    if _deeper_than(js, MAX_SCHEMA_DEPTH):
        raise ValueError(_TOO_DEEP)
    try:  # a deep, JSON-only copy: later edits to the user's dict change nothing here
        text = json.dumps(js, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
        js = json.loads(text)
    except UnicodeEncodeError as e:
        raise ValueError(f"json_schema holds a string that is not valid Unicode "
                         f"({_bad_char(e)}); remove that character") from None
    except (TypeError, ValueError) as e:
        what = ("NaN or Infinity" if "Out of range float" in str(e) else
                f"a value ({one_line(e, 120)})")
        raise ValueError(f"json_schema holds {what} which JSON cannot represent; write it "
                         "as JSON values (finite numbers, strings, lists, dicts)") from None
    big = _big_integer(js)
    if big is not None:
        n, key, at = big
        raise ValueError(f"json_schema: integer {_short(n, 40)} in `{key}` at {at or '/'} "
                         f"is past 2^53 where constrained generation cannot hold it exactly "
                         f"(llguidance reads numbers as doubles, bounds as 64-bit integers); "
                         f"use a string instead (with a pattern for a range)")
    return js


# Keys whose numbers llguidance writes into the mask (`_rounded` says which integers
# it misreads): the mask then forces or bounds by a number the schema does not hold,
# and the full check calls the row invalid.
_NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                      "multipleOf"})


def _big_integer(schema: dict) -> Optional[tuple]:
    """The first (integer, key, JSON pointer of its schema) that the mask would round:
    in `const` / `enum` (any depth of their data) or a numeric bound, of a subschema
    the mask is built from (`masked_nodes`)."""
    for node, at, _, _ in masked_nodes(schema):
        for k in ("const", "enum"):
            if k in node:
                n = _rounded_in(node[k])
                if n is not None:
                    return n, k, at
        t = node.get("type")
        integer = "integer" in (t if isinstance(t, list) else [t])
        for k in _NUMBERS:
            v = node.get(k)
            if integer and isinstance(v, float) and v.is_integer():
                v = int(v)  # an integer's bound written 1e19: read as an integer too
            if _rounded(v, k.startswith("exclusive")):
                return node[k], k, at
    return None


def _rounded(v, exclusive: bool = False) -> bool:
    """Would llguidance's mask misread integer `v`? A double rounds it; past a signed
    64-bit integer it prints the rounded float or saturates (and at -2^63 it fails
    hard); an exclusive bound past 2^53 is moved by one, which a double does not
    change."""
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    if not -2 ** 63 < v < 2 ** 63 or (exclusive and abs(v) >= 2 ** 53):
        return True
    return float(v) != v


def _rounded_in(v) -> Optional[int]:
    """The first integer a double cannot hold in JSON data `v` (depth bounded by
    MAX_SCHEMA_DEPTH, checked first)."""
    if _rounded(v):
        return v
    items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
    for x in items:
        n = _rounded_in(x)
        if n is not None:
            return n
    return None


def _deeper_than(v, limit: int) -> bool:
    """Whether dicts and lists nest in `v` more than `limit` levels (a dict that holds
    itself counts as infinitely deep). Iterative: a recursive walk is what fails."""
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            items = x.values()
        elif isinstance(x, (list, tuple)):
            items = x
        else:
            continue
        if d > limit:
            return True
        stack.extend((y, d + 1) for y in items)
    return False


def _bad_char(e: UnicodeEncodeError) -> str:
    return f"{e.object[e.start:e.end]!r} at character {e.start}"


def _unicode(what: str, v: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a character that is not valid Unicode "
                         f"({_bad_char(e)}, a lone surrogate); remove it") from None


def check_params(p) -> None:
    """Type checks for SamplingParams.check (the grammar itself is compiled by
    `Constraints.compile`, which needs the tokenizer)."""
    given = [k for k in KINDS if getattr(p, k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema=, regex=, choices=, grammar= per "
                         f"row; got {', '.join(given)}")
    if p.json_schema is not None and not isinstance(p.json_schema, dict):
        raise ValueError(f"json_schema must be a dict here; got {_short(p.json_schema)}")
    for k in ("regex", "grammar"):
        v = getattr(p, k)
        if v is not None and not (isinstance(v, str) and v.strip()):
            raise ValueError(f"{k} must be a non-empty string; got {_short(v)}")
        if v is not None:
            _unicode(k, v)
    if p.regex is not None and (len(p.regex) - len(p.regex.rstrip("\\"))) % 2:
        # llguidance would drop the lone backslash and constrain to another pattern
        raise ValueError(f"regex {_short(p.regex)} ends in a lone backslash; escape it "
                         "(\\\\ for a literal backslash) or remove it")
    if p.choices is not None:
        if (not isinstance(p.choices, tuple) or not p.choices
                or not all(isinstance(c, str) for c in p.choices)):
            raise ValueError(f"choices must be a non-empty list of non-empty strings; got "
                             f"{_short(p.choices)}")
        for i, c in enumerate(p.choices):
            if not c.strip():  # a row could only write blanks, and would count as valid
                raise ValueError(f"choice {i + 1} of {len(p.choices)} is blank ({c!r}); "
                                 "give every choice some visible text")
            _unicode(f"choice {i + 1} of {len(p.choices)}", c)
_WHAT = {"json_schema": "its schema", "regex": "its regex", "choices": "its choices",
         "grammar": "its grammar"}


def kind_of(p) -> Optional[str]:
    """Which constraint a row's params carry ('json_schema', ...), or None."""
    for k in KINDS:
        if getattr(p, k, None) is not None:
            return k
    return None


def _key(p) -> Optional[tuple]:
    k = kind_of(p)
    if k is None:
        return None
    v = getattr(p, k)
    # a schema's property order is the order its output is written in: not sorted
    return (k, json.dumps(v) if k in ("json_schema", "choices") else v)


_QUOTE = re.compile(r"^\s*\d+\s*\|")  # "   1 | start: ..." quotes the grammar
_BUILT_AT = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.@+-]+){2,}\.rs(?::\d+)*")  # a .rs path


def one_line(msg, n: int = 300) -> str:
    """An llguidance error as one line: its words, without the grammar it quotes
    with a caret under the fault, the parser state it appends, or a Rust panic's
    backtrace and source paths."""
    text = str(msg)
    for cut in ("<state>", "<non-verbose/>", "stack backtrace:", "\nnote: run with"):
        text = text.split(cut, 1)[0]
    keep = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not set(ln.strip()) <= {"^", " "} and not _QUOTE.match(ln)]
    s = " ".join(" ".join(keep).split())
    # positions like "at 1(8):" point into llguidance's internal grammar, not the user's
    s = re.sub(r"(?:\bat )?\b\d+\(\d+\):\s*", "", s).replace(" (in regex)", "")
    s = _BUILT_AT.sub("llguidance", s)
    return s if len(s) <= n else s[: n - 1] + "…"


# What a constraint that cannot run is told: why, and what to change.
_EMPTY = {
    "json_schema": "no JSON value satisfies json_schema as the mask compiles it (a $ref "
                   "loop with no way out, keys that contradict each other, or a decimal "
                   "multipleOf between bounds); fix the schema (for a decimal multipleOf: "
                   "scale it to an integer, or give a pattern)",
    "regex": "regex matches no text at all; fix the pattern",
    "choices": "choices admit no text; give at least one non-empty choice",
    "grammar": "grammar derives no text (does every alternative of a rule recurse "
               "into itself?); give each recursive rule an alternative that ends",
}
_FIX = {
    "json_schema": "mark more properties required, or split the schema into smaller ones",
    "regex": "simplify the pattern",
    "choices": "give fewer choices",
    "grammar": "write recursion on the left (items: items \"a\" | \"a\") and give every "
               "recursive rule an alternative that ends",
}


def _explain(kind: str, err: str, at: Optional[str] = None) -> str:
    """llguidance's failure at the first tokens of a fresh matcher (of the part of a
    schema `at` a JSON pointer) as one line: which of its limits, and what to change."""
    m = re.search(r"Current row has (\d+) items; max is (\d+)", err)
    if m:
        return (f"{kind} is over llguidance's limit of {m[2]} alternatives at "
                f"{at or 'one point'} (it has {m[1]}); {_FIX[kind]}")
    m = re.search(r"Too many items \(limit (\d+)", err)
    if m:
        return (f"{kind} is over llguidance's limit of {m[1]} parser items per token"
                f"{' at ' + at if at else ''} (a right-recursive rule, or one that never "
                f"ends?); {_FIX[kind]}")
    if "NoExtensionBias" in err:
        return _EMPTY[kind]
    return f"{kind} fails at its first tokens: {one_line(err, 200)}; {_FIX[kind]}"
