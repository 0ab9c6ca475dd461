"""A constraint as llguidance's grammar text: JSON schema, regex, choices, Lark or GBNF.
Pure functions; `constrain.Constraints` compiles what they return."""

from __future__ import annotations

import importlib.util
import json
import re

from .constraint_params import without_annotations
from .constraint_results import _VALUE


# Whitespace inside JSON is fixed (", " and ": ", none elsewhere): with flexible
# whitespace a model can spend its whole token budget on spaces and newlines.
# Lenient: keys llguidance cannot enforce while generating (uniqueItems, not, if/then,
# dependencies, unknown formats, ...) are left out of the mask and oneOf is read as
# anyOf; every finished row is then checked against the whole schema (`full_check`).
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": True, "coerce_one_of": True}


def grammar(kind: str, value) -> str:
    import llguidance as llg

    LLM = llg.LLMatcher
    if kind == "json_schema":
        given = value.get("x-guidance")
        opts = dict(json_opts(), **(given if isinstance(given, dict) else {}))
        # %json inside Lark, to capture the whole value: a finished row's check reads
        # its text there (the worker holds the matcher, not the text)
        return LLM.grammar_from_lark(f"start: {_VALUE}\n{_VALUE}[capture]: %json "
                                     + json.dumps(dict(without_annotations(value),
                                                       **{"x-guidance": opts})))
    if kind == "regex":
        return LLM.grammar_from_regex(value)
    if kind == "choices":
        # One regex, one lexeme: as Lark alternatives ("a" | "b" | ...) every choice is
        # an item of the parser's row, and llguidance stops at 2,000 of those.
        return LLM.grammar_from_regex("|".join(literal(c) for c in value))
    # Lark, or GBNF (llama.cpp's format), which llguidance converts to Lark
    return llg.grammar_from("grammar", value)


def json_opts() -> dict:
    if importlib.util.find_spec("jsonschema") is None:  # nothing checks what the mask leaves out
        return dict(_JSON_OPTS, lenient=False, coerce_one_of=False)
    return _JSON_OPTS


def literal(text: str) -> str:
    """`text` as a regex (Rust's syntax, which allows a backslash before any ASCII
    punctuation but < and >, which it reads as word boundaries)."""
    return re.sub(r"[!-/:;=?@\[-`{-~]", lambda m: "\\" + m.group(), text)


def parser_limits():
    import llguidance as llg

    # not verbose: a failing row's error is then its reason alone, without the
    # parser's state and the grammar
    return llg.LLParserLimits(verbose_errors=False)
