"""Structured rows: a JSON schema, a regex, a list of choices or a grammar per row.

llguidance (Rust; a structured-output backend of vLLM and llama.cpp) compiles each
constraint into a matcher over the model's tokenizer. This module holds the user's
side of it: the keywords' values, the compiler (`Constraints`: one compile per
constraint and lane, a copy per row, and the check of a finished row's text), and
the results (`row.json`, DataFrame columns, the widget's parse status). The batch's
masks, filled each step while the forward launches, are `masks.py`'s.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as _Timeout
from typing import Any, Dict, Optional, Tuple

from .._log import log
from .states import Finish

KINDS = ("json_schema", "regex", "choices", "grammar")
# Bounds on compiling a constraint, which runs while the kernel's loop waits: the
# compile time of llguidance grows faster than the schema (1,000 optional properties
# 0.1 s, 3,000 2.4 s, 15,000 10-20 s), and a 100 KB schema is already far past what
# a model writes well.
MAX_CONSTRAINT_CHARS = 128_000
COMPILE_TIMEOUT_S = 5.0
# serde_json (under llguidance) stops at 128 levels; Python's json at ~1,000 with a
# RecursionError. Real schemas nest a few levels, with $defs for anything recursive.
MAX_SCHEMA_DEPTH = 100
_PROBE_TOKENS = 4  # tokens a fresh matcher is walked at validation (see _probe)
# Whitespace inside JSON is fixed (", " and ": ", none elsewhere): with flexible
# whitespace a model can spend its whole token budget on spaces and newlines.
# Lenient: keys llguidance cannot enforce while generating (uniqueItems, not, if/then,
# dependencies, unknown formats, ...) are left out of the mask and oneOf is read as
# anyOf; every finished row is then checked against the whole schema (`full_check`).
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": True, "coerce_one_of": True}
_VALUE = "value"  # the capture holding a JSON row's whole value (see _grammar)
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
    if not isinstance(js, dict):
        raise ValueError(f"json_schema takes a dict, a JSON string or a pydantic model "
                         f"class; got {_short(js)}")
    if _deeper_than(js, MAX_SCHEMA_DEPTH):
        raise ValueError(f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels deep (or "
                         "holds itself); flatten it, with $defs and $ref for recursive parts")
    try:  # a deep, JSON-only copy: later edits to the user's dict change nothing here
        text = json.dumps(js, ensure_ascii=False)
        text.encode("utf-8")
        return json.loads(text)
    except UnicodeEncodeError as e:
        raise ValueError(f"json_schema holds a string that is not valid Unicode "
                         f"({_bad_char(e)}); remove that character") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema holds a value JSON cannot represent "
                         f"({one_line(e, 120)})") from None


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


def verdict(p, m, text: Optional[str] = None) -> Optional[str]:
    """Why the output a matcher `m` of `p` has read so far (all of it accepted, and
    `text` if given) is not yet whole or breaks what the mask left out, or None when
    the constraint is met."""
    if m.is_stopped() or m.is_accepting():
        if p.json_schema is not None:
            got = m.get_capture(_VALUE)
            got = text if got is None else got
            return None if got is None else full_check(p.json_schema, got)
        return None
    return f"incomplete: {_WHAT[kind_of(p)]} needs more"


_validators: "OrderedDict[str, Any]" = OrderedDict()
_validators_lock = threading.Lock()


def full_check(schema: dict, text) -> Optional[str]:
    """Why a JSON row's `text` (whole, and accepted by its matcher) breaks its schema
    where the mask could not enforce it, or None. Checked with the jsonschema package
    (Draft 2020-12 unless the schema names another)."""
    try:
        import jsonschema
        from jsonschema.exceptions import best_match
    except ImportError:  # then the schema is compiled strictly (_json_opts)
        return None
    try:
        value = json.loads(text)
        key = json.dumps(schema, sort_keys=True)
        with _validators_lock:
            v = _validators.get(key)
            if v is None:
                # no $schema: 2020-12, but draft 7 for its "dependencies" (2020-12
                # split it into dependentRequired / dependentSchemas)
                old = '"dependencies":' in key
                cls = jsonschema.validators.validator_for(
                    schema, default=jsonschema.Draft7Validator if old
                    else jsonschema.Draft202012Validator)
                v = _validators[key] = cls(schema)
            _validators.move_to_end(key)
            while len(_validators) > _CACHE:
                _validators.popitem(last=False)
        err = best_match(v.iter_errors(value))
    except Exception:  # a schema jsonschema cannot read, a remote $ref: unchecked
        log.debug("the full check of a JSON row failed", exc_info=True)
        return None
    if err is None:
        return None
    at = "/" + "/".join(str(x) for x in err.absolute_path)
    return (f"breaks its schema's {err.validator} at {at}: {one_line(err.message, 120)} "
            "(a key checked after generating, not enforced while generating)")


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


def _grammar(kind: str, value) -> str:
    import llguidance as llg

    LLM = llg.LLMatcher
    if kind == "json_schema":
        given = value.get("x-guidance")
        opts = dict(_json_opts(), **(given if isinstance(given, dict) else {}))
        # %json inside Lark, to capture the whole value: a finished row's check reads
        # its text there (the worker holds the matcher, not the text)
        return LLM.grammar_from_lark(f"start: {_VALUE}\n{_VALUE}[capture]: %json "
                                     + json.dumps(dict(value, **{"x-guidance": opts})))
    if kind == "regex":
        return LLM.grammar_from_regex(value)
    if kind == "choices":
        # One regex, one lexeme: as Lark alternatives ("a" | "b" | ...) every choice is
        # an item of the parser's row, and llguidance stops at 2,000 of those.
        return LLM.grammar_from_regex("|".join(_literal(c) for c in value))
    # Lark, or GBNF (llama.cpp's format), which llguidance converts to Lark
    return llg.grammar_from("grammar", value)


def _json_opts() -> dict:
    if importlib.util.find_spec("jsonschema") is None:  # nothing checks what the mask leaves out
        return dict(_JSON_OPTS, lenient=False, coerce_one_of=False)
    return _JSON_OPTS


_warming = threading.Lock()
_warmed = False


def _warm_jsonschema() -> None:
    """Import jsonschema on a thread of its own, once: it takes 1-2 s (its format
    checkers build a parser at import), which the first finished JSON row would
    otherwise spend on the worker, stalling its batch."""
    global _warmed
    with _warming:
        if _warmed:
            return
        _warmed = True

    def work():
        try:
            import jsonschema  # noqa: F401
        except Exception:
            log.debug("importing jsonschema failed", exc_info=True)

    threading.Thread(target=work, daemon=True, name="mlxnb-jsonschema").start()


def _literal(text: str) -> str:
    """`text` as a regex (Rust's syntax, which allows a backslash before any ASCII
    punctuation but < and >, which it reads as word boundaries)."""
    return re.sub(r"[!-/:;=?@\[-`{-~]", lambda m: "\\" + m.group(), text)


def _limits():
    import llguidance as llg

    # not verbose: a failing row's error is then its reason alone, without the
    # parser's state and the grammar
    return llg.LLParserLimits(verbose_errors=False)


_EMPTY = {
    "json_schema": "no JSON value satisfies json_schema (a $ref loop with no way out, or "
                   "keys that contradict each other); fix the schema",
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


def _explain(kind: str, err: str) -> str:
    """llguidance's failure at the first tokens of a fresh matcher as one line:
    which of its limits, and what to change."""
    m = re.search(r"Current row has (\d+) items; max is (\d+)", err)
    if m:
        return (f"{kind} is over llguidance's limit of {m[2]} alternatives at one point "
                f"(it has {m[1]}); {_FIX[kind]}")
    m = re.search(r"Too many items \(limit (\d+)", err)
    if m:
        return (f"{kind} is over llguidance's limit of {m[1]} parser items per token "
                f"(a right-recursive rule, or one that never ends?); {_FIX[kind]}")
    if "NoExtensionBias" in err:
        return _EMPTY[kind]
    return f"{kind} fails at its first tokens: {one_line(err, 200)}; {_FIX[kind]}"


def _bounded(fn, what: str):
    """fn() on a thread of its own, waited for at most COMPILE_TIMEOUT_S: llguidance
    compiles with the GIL released but cannot be stopped, so past the bound the
    compile is left to finish (its result dropped) and the caller gets a ValueError.
    An interrupt ends the wait at once."""
    fut: Future = Future()

    def work():
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the waiting thread
            fut.set_exception(e)

    threading.Thread(target=work, daemon=True, name="mlxnb-constraint").start()
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    while True:
        try:  # short waits: a pending interrupt is raised between them
            return fut.result(max(0.0, min(0.1, deadline - time.monotonic())))
        except _Timeout:
            if time.monotonic() < deadline:
                continue
        raise ValueError(f"compiling {what} took longer than {COMPILE_TIMEOUT_S:g} s (the "
                         f"limit); simplify it: {_FIX[what]}") from None


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
        self._refused: "OrderedDict[tuple, str]" = OrderedDict()  # constraint -> why

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
        """Compile `p`'s constraint (cached) and walk a copy of it over its first
        tokens, or raise a one-line ValueError: for a constraint that cannot compile,
        is too large or slow to, admits no text, or runs into one of llguidance's
        limits where every row would end in error at its first token."""
        key = _key(p)
        if key is None:
            return
        with self._lock:
            if key in self._refused:  # its compile may sit in the cache: refuse first
                raise ValueError(self._refused[key])
            hit = self._cache.get(key)
            if hit is not None and 0 in hit[1]:
                return
        if len(key[1]) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{key[0]} is {len(key[1]):,} characters, over the limit of "
                             f"{MAX_CONSTRAINT_CHARS:,}; {_FIX[key[0]]}")
        self.lltokenizer()  # built once, outside the compile's time bound
        if key[0] == "json_schema":
            _warm_jsonschema()
        try:
            self._probe(key[0], _bounded(lambda: self._template(p), key[0]).deep_copy())
        except ValueError as e:
            # the same verdict next time, without compiling again
            with self._lock:
                self._refused[key] = str(e)
                while len(self._refused) > _CACHE:
                    self._refused.popitem(last=False)
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a Rust panic is a BaseException
            log.warning("checking a %s constraint failed", key[0], exc_info=True)
            raise ValueError(f"{key[0]} could not be checked ({type(e).__name__}; the "
                             f"'mlxnb' logger has the details); {_FIX[key[0]]}") from None

    def _probe(self, kind: str, m) -> None:
        """Walk `m` (a fresh copy) a few tokens, each the lowest-numbered one its mask
        allows: an empty language, and llguidance's per-row limits (items in a parser
        row, items per token), show at the first token or the next."""
        import llguidance.numpy as lln
        import numpy as np

        V = self.lltokenizer().vocab_size
        eos = set(getattr(self._tokenizer, "eos_token_ids", None) or ())
        buf = self.bitmask(1)
        for step in range(_PROBE_TOKENS):
            if m.is_stopped():
                return
            lln.fill_next_token_bitmask(m, buf, 0)
            if not m.is_error():
                allowed = np.flatnonzero(
                    np.unpackbits(buf.view(np.uint8), bitorder="little")[:V])
                tok = next((int(t) for t in allowed if int(t) not in eos), None)
                if tok is None:  # nothing, or only the end: accepting, or nothing at all
                    if step == 0 and not m.is_accepting():
                        raise ValueError(_EMPTY[kind])
                    return
                m.consume_token(tok)
            if m.is_error():
                err = m.get_error()
                log.debug("%s failed its first tokens: %s", kind, err)
                if step > 0 and "NoExtensionBias" in err:
                    return  # a dead branch the probe walked into; other branches may live
                raise ValueError(_explain(kind, err))

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
        return verdict(p, m, text)

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
        try:
            g = self._grammar(key[0], getattr(p, key[0])) if hit is None else hit[0]
            m = llg.LLMatcher(self.lltokenizer(), g, log_level=0, limits=_limits())
        except ValueError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # RecursionError, a Rust panic (BaseException), ...
            log.warning("compiling a %s constraint failed", key[0], exc_info=True)
            raise ValueError(f"{key[0]} could not be compiled ({type(e).__name__}; the "
                             f"'mlxnb' logger has the details); {_FIX[key[0]]}") from None
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
        err = llg.LLMatcher.validate_grammar(g, self.lltokenizer(), limits=_limits())
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
