"""What a finished structured row says: whether its output meets the constraint
(the matcher's verdict, and the full schema checked with jsonschema), its JSON value,
its DataFrame columns and the widget's parse status."""

from __future__ import annotations

import functools
import json
import threading
from fractions import Fraction
from collections import OrderedDict
from typing import Any, Optional, Tuple

from .._log import log
from .constraint_params import _WHAT, kind_of, one_line
from .states import Finish
_VALUE = "value"  # the capture holding a JSON row's whole value (see _grammar)
_CACHE = 256  # compiled constraints kept per engine


def verdict(p, m, text: Optional[str] = None, cut: bool = False) -> Optional[str]:
    """Why the output a matcher `m` of `p` has read so far (all of it accepted, and
    `text` if given) is not yet whole or breaks what the mask left out, or None when
    the constraint is met; `cut`: max_tokens ended it inside a character."""
    if m.is_stopped() or m.is_accepting():
        if p.json_schema is not None:
            got = m.get_capture(_VALUE)
            got = text if got is None else got
            return None if got is None else full_check(p.json_schema, got)
        return None
    return incomplete(p, cut)


# What a detokenizer shows for a character max_tokens cut short. The matcher reads
# bytes, and no constraint is met inside a character; the text's U+FFFD in its place
# is not what the model wrote, so no check reads it as a character (`cut_short`).
_CUT = "\ufffd"


def cut_short(text: Optional[str], reason) -> bool:
    """Whether a row that ended for `reason` with `text` ends in a character cut
    short: max_tokens ended it, and its text ends in U+FFFD (unknowable from the text
    alone: a U+FFFD the model wrote reads as cut short too, then)."""
    return reason == Finish.LENGTH and bool(text) and text.endswith(_CUT)


def incomplete(p, cut: bool = False) -> str:
    why = f"incomplete: {_WHAT[kind_of(p)]} needs more"
    if cut:
        why += " (max_tokens ended the row inside a character, shown as U+FFFD)"
    return why


_validators: "OrderedDict[str, Any]" = OrderedDict()
_validators_lock = threading.Lock()


def full_check(schema: dict, text) -> Optional[str]:
    """Why a JSON row's `text` (whole, and accepted by its matcher) breaks its schema
    where the mask could not enforce it, or None. Checked with the jsonschema package
    (Draft 2020-12 unless the schema names another)."""
    try:
        import jsonschema
        from jsonschema.exceptions import best_match
    except ImportError:  # then the schema is compiled strictly (constraint_grammar.json_opts)
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
                v = _validators[key] = _exact_multiples(cls)(schema)
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
    if _after_only(err.absolute_schema_path):
        how = "a key checked after generating, not enforced while generating"
    else:
        how = "a key the mask enforces, which let this value through"
        if err.validator in ("exclusiveMinimum", "exclusiveMaximum"):
            how += " (known for exclusive bounds on ranges narrower than 1)"
    return f"breaks its schema's {err.validator} at {at}: {one_line(err.message, 120)} ({how})"


# The keys the mask cannot enforce (README, "JSON schema keys"): the check after
# generating is what holds them. A break of any other key is the mask's slip.
AFTER_ONLY = frozenset({
    "oneOf", "uniqueItems", "not", "if", "then", "else", "dependencies",
    "dependentRequired", "dependentSchemas", "contains", "minContains", "maxContains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "format"})


# Schema keywords whose next path element is a name (a property's, a definition's),
# not a keyword
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas", "dependencies"})


def _after_only(schema_path) -> bool:
    """Whether a failure at `schema_path` lies under a key the mask cannot enforce
    (jsonschema names the innermost keyword: `required` inside `then`, say)."""
    named = False
    for k in schema_path:
        if named or not isinstance(k, str):
            named = False
            continue
        if k in AFTER_ONLY:
            return True
        named = k in _NAMED
    return False


@functools.lru_cache(maxsize=None)  # one class per draft, not one per schema
def _exact_multiples(cls):
    """`cls` whose multipleOf is exact on the parsed numbers' shortest decimal forms:
    0.3 is a multiple of 0.1 (in binary floating point, jsonschema's default, it is
    not), and integers of any size stay exact."""
    import jsonschema

    base = cls.VALIDATORS.get("multipleOf")
    if base is None:  # draft 3 has divisibleBy instead
        return cls

    def multiple_of(validator, factor, instance, schema):
        if not validator.is_type(instance, "number"):
            return
        try:
            exact = (Fraction(repr(instance)) / Fraction(repr(factor))).denominator == 1
        except (ArithmeticError, ValueError, TypeError):  # inf, nan, a zero factor
            yield from base(validator, factor, instance, schema)
            return
        if not exact:
            yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {factor!r}")

    return jsonschema.validators.extend(cls, {"multipleOf": multiple_of})


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
    # JSON that does not meet its schema (a stop string cut it short, or it breaks a
    # key checked only after generating): no value, and why
    if row.constraint_error is not None:
        return None, row.constraint_error
    return value, None


def record_fields(row) -> dict:
    """Columns a constrained row adds to `Run.records()`: `constraint`, `valid`
    (its output satisfies the constraint), `constraint_error` (why not),
    `json_error` and `json.<field>` per top-level field of a JSON object."""
    kind = kind_of(row.params)
    if kind is None:
        return {}
    out = {"constraint": kind, "valid": row.valid,
           "constraint_error": row.constraint_error}
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
