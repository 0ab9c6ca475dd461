"""Structured rows: a JSON schema, a regex, a list of choices or a grammar per row.

llguidance (Rust; a structured-output backend of vLLM and llama.cpp) compiles each
constraint into a matcher over the model's tokenizer. This module holds the user's
side of it: the keywords' values, the compiler (`Constraints`: one compile per
constraint and lane, a copy per row, and the check of a finished row's text), and
the results (`row.json`, DataFrame columns, the widget's parse status). The batch's
masks, filled each step while the forward launches, are `masks.py`'s.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

from .states import Finish

KINDS = ("json_schema", "regex", "choices", "grammar")
# Whitespace inside JSON is fixed (", " and ": ", none elsewhere): with flexible
# whitespace a model can spend its whole token budget on spaces and newlines.
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE = 256  # compiled constraints kept per engine


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
        js = js.model_json_schema()
    elif isinstance(js, (str, bytes)):
        try:
            js = json.loads(js)
        except ValueError as e:
            raise ValueError(f"json_schema is a string but not valid JSON ({e}); pass a "
                             "dict, a JSON string or a pydantic model class") from None
    if not isinstance(js, dict):
        raise ValueError(f"json_schema takes a dict, a JSON string or a pydantic model "
                         f"class; got {_short(js)}")
    try:  # a deep, JSON-only copy: later edits to the user's dict change nothing here
        return json.loads(json.dumps(js))
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema holds a value JSON cannot represent ({e})") from None


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
    if p.choices is not None:
        if (not isinstance(p.choices, tuple) or not p.choices
                or not all(isinstance(c, str) and c for c in p.choices)):
            raise ValueError(f"choices must be a non-empty list of non-empty strings; got "
                             f"{_short(p.choices)}")


_WHAT = {"json_schema": "its schema", "regex": "its regex", "choices": "its choices",
         "grammar": "its grammar"}


def verdict(p, m) -> Optional[str]:
    """Why the output a matcher `m` of `p` has read so far (all of it accepted) is not
    yet whole, or None when the constraint is met."""
    if m.is_stopped() or m.is_accepting():
        return None
    return f"incomplete: {_WHAT[kind_of(p)]} needs more"


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
    return (k, json.dumps(v, sort_keys=True) if k == "json_schema" else
            json.dumps(v) if k == "choices" else v)


def one_line(msg: str) -> str:
    """llguidance errors quote the grammar with a caret under the fault; keep the
    words and drop the drawing."""
    keep = [ln.strip() for ln in str(msg).splitlines()
            if ln.strip() and not set(ln.strip()) <= {"^", " "}
            and not ln.lstrip()[:1].isdigit()]
    s = " ".join(" ".join(keep).split())
    # positions like "at 1(8):" point into llguidance's internal grammar, not the user's
    s = re.sub(r"\bat \d+\(\d+\):\s*", "", s).replace(" (in regex)", "")
    return s if len(s) <= 300 else s[:299] + "…"


def _grammar(kind: str, value) -> str:
    import llguidance as llg

    LLM = llg.LLMatcher
    if kind == "json_schema":
        return LLM.grammar_from_json_schema(value, defaults=_JSON_OPTS)
    if kind == "regex":
        return LLM.grammar_from_regex(value)
    if kind == "choices":
        return LLM.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    # Lark, or GBNF (llama.cpp's format), which llguidance converts to Lark
    return llg.grammar_from("grammar", value)


# -- per engine: the compiler ---------------------------------------------------------
class Constraints:
    """The engine's constraint compiler.

    `validate` runs on the loop (before submitting); the worker compiles a row's
    matcher as it joins the batch. Compiled matchers are cached per constraint and
    lane, and each row gets a copy, so 500 rows with one schema compile it once per
    lane. Copies of one compile share its lexer behind one lock (llguidance's
    `deep_copy` is shallow there), so rows whose masks fill on different threads
    take different lanes (masks.py).
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._llt = None
        # constraint -> (grammar, {lane: compiled matcher}); lane "check" is the loop's
        self._cache: "OrderedDict[tuple, Tuple[str, Dict[Any, Any]]]" = OrderedDict()

    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once: ~0.4 s for 49k tokens)."""
        with self._lock:
            if self._llt is None:
                try:
                    import llguidance
                    import llguidance.hf
                except ImportError:
                    raise ValueError("constrained rows need llguidance: "
                                     "pip install llguidance") from None
                tw = self._tokenizer
                hf = getattr(tw, "_tokenizer", tw)
                eos = sorted(getattr(tw, "eos_token_ids", None) or ()) or None
                # JSON slices: masks of JSON rows 3x faster (32 rows, SmolLM2's vocab),
                # and regexes, choices and Lark no slower than with the general ones
                slices = llguidance.LLTokenizer.json_slices()
                try:
                    self._llt = llguidance.hf.from_tokenizer(hf, eos_token=eos, slices=slices)
                except ValueError as e:
                    raise ValueError(f"constrained rows need a fast (Rust) Hugging Face "
                                     f"tokenizer ({e})") from None
            return self._llt

    def compile(self, p, lane: Any = 0):
        """A fresh matcher for `p`'s constraint (None for a free row), sharing its
        lexer with the other copies of that lane's compile. ValueError with one line naming what is
        wrong in the schema / regex / grammar."""
        m = self._template(p, lane)
        return None if m is None else m.deep_copy()

    def validate(self, p) -> None:
        """Compile `p`'s constraint (cached) or raise a one-line ValueError."""
        self._template(p)

    def check(self, p, text: str) -> Optional[str]:
        """Why `text` does not satisfy `p`'s constraint, or None when it does. A
        fresh matcher reads the text as the tokenizer spells it, so this holds for
        any ending: the grammar's own, max_tokens, or a stop string that cut it."""
        m = self.compile(p, "check")  # its own lexer: no fill thread waits for it
        if m is None:
            return None
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        n = m.try_consume_tokens(ids)
        if n < len(ids):
            at = len(self._tokenizer.decode(ids[:n]))
            return f"breaks {_WHAT[kind_of(p)]} at character {at}: {_short(text[at:], 24)}"
        return verdict(p, m)

    def _template(self, p, lane: Any = 0):
        key = _key(p)
        if key is None:
            return None
        import llguidance as llg

        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if lane in hit[1]:
                    return hit[1][lane]
        if hit is None:
            g = self._grammar(key[0], getattr(p, key[0]))
        else:
            g = hit[0]
        m = llg.LLMatcher(self.lltokenizer(), g, log_level=0)
        if m.is_error():
            raise ValueError(f"{key[0]} is invalid: {one_line(m.get_error())}")
        with self._lock:
            hit = self._cache.setdefault(key, (g, {}))
            m = hit[1].setdefault(lane, m)
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return m

    def _grammar(self, what: str, value) -> str:
        import llguidance as llg

        try:
            g = _grammar(what, value)
        except ValueError as e:
            raise ValueError(f"{what} is invalid: {one_line(e)}") from None
        err = llg.LLMatcher.validate_grammar(g, self.lltokenizer())
        if err:
            raise ValueError(f"{what} is invalid: {one_line(err)}")
        return g

    def bitmask(self, rows: int):
        """An all-allowed bitmask [rows, ceil(vocab / 32)] int32 (llguidance's layout)."""
        import llguidance.numpy as lln

        return lln.allocate_token_bitmask(rows, self.lltokenizer().vocab_size)


# -- results (loop side) ------------------------------------------------------------
def parse_json(row) -> Tuple[Any, Optional[str]]:
    """(value, None) when the row's text parses as JSON, else (None, reason)."""
    if not row.done:
        return None, f"the row is still {row.state}; await it first"
    cached = getattr(row, "_parsed_json", None)  # a done row's text no longer changes
    if cached is None:
        cached = row._parsed_json = _parse(row)
    return cached


def _parse(row) -> Tuple[Any, Optional[str]]:
    if row.finish_reason in (Finish.ERROR, Finish.CANCELLED):
        return None, f"the row ended with {row.finish_reason}" + (
            f": {row.error}" if row.error else "")
    text = row.text
    try:
        value = json.loads(text)
    except ValueError as e:
        cut = " (cut by max_tokens: raise --max-tokens)" if row.finish_reason == Finish.LENGTH else ""
        return None, f"not valid JSON: {e}{cut}"
    if row.constraint_error is not None:  # JSON, cut by a stop string before the schema was met
        return None, row.constraint_error
    return value, None


def record_fields(row) -> dict:
    """Columns a constrained row adds to `Run.records()`: `constraint`, `valid`
    (its output satisfies the constraint), `json_error` and `json.<field>` per
    top-level field of a JSON object."""
    kind = kind_of(row.params)
    if kind is None:
        return {}
    out = {"constraint": kind, "valid": row.valid}
    if kind == "json_schema":
        value, err = parse_json(row)
        out["json_error"] = err
        if isinstance(value, dict):
            out.update({f"json.{k}": v for k, v in value.items()})
        elif value is not None:
            out["json"] = value
    return out


_SHORT = {"json_schema": "json", "regex": "regex", "choices": "choice", "grammar": "grammar"}


def widget_fields(row) -> dict:
    """A constrained row's fields for the widget: `con` (json | regex | choice |
    grammar) and `parse` ('pending', 'ok' or why its output is not valid)."""
    kind = kind_of(row.params)
    if kind is None:
        return {}
    return {"con": _SHORT[kind], "parse": _status(row, kind)}


def _status(row, kind) -> str:
    if not row.done:
        return "pending"
    if kind == "json_schema":
        return parse_json(row)[1] or "ok"
    if row.finish_reason in (Finish.ERROR, Finish.CANCELLED):
        return f"incomplete ({row.finish_reason})"
    return row.constraint_error or "ok"
