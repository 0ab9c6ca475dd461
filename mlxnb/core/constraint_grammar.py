"""A constraint as llguidance's grammar text: JSON schema, regex, choices, Lark or GBNF.
Pure functions; `constrain.Constraints` compiles what they return."""

from __future__ import annotations

import importlib.util
import json
import re

from .constraint_results import _VALUE
from .schema_walk import (_required, local_ref, masked_nodes, named_anchors, rewritten,
                          without_annotations)


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


# An object of this many optional properties gets a probe of its own
# (constraint_probe.py `probe_parts`): ~500 optional properties are over llguidance's
# 2,000 alternatives in one parser row (each adds about 4), which the walk over a
# whole schema's first tokens shows only if it enters that object, not when it sits
# in an anyOf branch, an array's items or a later property. llguidance has no check of the whole grammar
# for this limit: it counts a row's items only as it parses.
WIDE_OBJECT = 200
_MAX_PARTS = 8  # the widest; the compile's time bound covers their probes too
_ROOT = "__mlxnb_root"  # where a part's copy of its whole schema sits, under $defs


def wide_parts(schema: dict) -> list:
    """[(JSON pointer, schema)] for the objects of the most optional properties (at
    least WIDE_OBJECT) among the subschemas the mask is built from (`masked_nodes`),
    below the root, each a schema of its own whose $refs reach the whole schema,
    held under its $defs, and that requires what its context requires."""
    found = {}  # id(node) -> its widest reading
    for node, at, ctx, alone in masked_nodes(schema):
        props = node.get("properties")
        if not at or not alone or not isinstance(props, dict) or len(props) < WIDE_OBJECT:
            continue
        required = _required(node) | ctx
        optional = len(props.keys() - required)
        if optional >= WIDE_OBJECT and optional > found.get(id(node), (0,))[0]:
            found[id(node)] = (optional, at, node, required)
    if not found:
        return []
    anchors = named_anchors(schema)
    whole, out = _rerooted(schema, anchors), []
    for _, at, node, required in sorted(found.values(), key=lambda f: -f[0])[:_MAX_PARTS]:
        part = _rerooted(node, anchors)
        if required:  # as merged where it sits (masked_nodes)
            part["required"] = sorted(required)
        defs = part.get("$defs")
        part["$defs"] = dict(defs if isinstance(defs, dict) else {}, **{_ROOT: whole})
        if "x-guidance" in schema:
            part["x-guidance"] = schema["x-guidance"]
        out.append((at, part))
    return out


def _rerooted(node, anchors: dict):
    """A copy of a schema (part) whose local $refs, named anchors' included, point
    into $defs/_ROOT by JSON pointer (so its named anchors go: a part and the whole
    beside it would declare each twice)."""
    def ref(v):
        v = anchors.get(v, v)
        return f"#/$defs/{_ROOT}{v[1:]}" if local_ref(v) else v

    return rewritten(node, drop=frozenset({"$anchor", "$id#"}), ref=ref)
