"""Constraints at their edges, tried as a user would: through Engine.submit and
%%generate. Whatever fails must fail before any row is submitted, in one line that
names the constraint and what to change, and never with llguidance's parser state,
a Rust backtrace or a build machine's paths."""

import logging
import threading
import time

import pytest
from IPython.core.error import UsageError

from mlxnb import Engine
from mlxnb.core import constrain
from mlxnb.core.constrain import Constraints
from mlxnb.core.constraint_params import one_line
from mlxnb.core.rows import SamplingParams

from test_magics import arun_shut, attach, gen, ip  # noqa: F401  (fixtures)


pytestmark = pytest.mark.usefixtures("patient_submits")  # (conftest.py)

def make(tiny, **kw):
    kw.setdefault("kv_budget", None)
    kw.setdefault("warmup", False)
    return Engine(tiny, **kw)


def nested(levels: int) -> dict:
    schema = inner = {}
    for _ in range(levels):
        inner["type"] = "array"
        inner["items"] = {}
        inner = inner["items"]
    inner["type"] = "integer"
    return schema


def refused(tiny, arun, **kw) -> str:
    """The one-line ValueError Engine.submit raises for `kw` (each time); nothing is
    submitted."""
    async def main():
        eng = make(tiny)
        try:
            with pytest.raises(ValueError) as ei:
                eng.submit("x", chat=False, max_tokens=8, **kw)
            with pytest.raises(ValueError) as again:
                eng.submit("x", chat=False, max_tokens=8, **kw)
            assert str(again.value) == str(ei.value)
            assert len(eng.rows) == 0
            return str(ei.value)
        finally:
            await eng.aclose()

    msg = arun(main)
    assert "\n" not in msg and msg.strip(), repr(msg)
    assert "<state>" not in msg and ".rs" not in msg and "Parser: {" not in msg, msg
    return msg


# (600: compiled well within the submit's wait; slower compiles end their rows instead,
# test_constrain_async.py)
OPTIONAL_600 = {"type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


@pytest.mark.parametrize("kw, words", [
    # a RecursionError before
    (dict(json_schema=nested(2000)), "nests more than 100 levels"),
    # the same as a JSON string: Python's parser recursed past its limit first
    (dict(json_schema='{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000),
     "nests more than 100 levels"),
    # llguidance's messages start with a position ("1(8): ..."): they came out empty
    (dict(grammar="start: ??? nope"), "grammar is invalid: Expected value"),
    (dict(choices=["ok", "a\ud800"]), "choice 2 of 2 holds a character that is not valid"),
    (dict(regex="a\udc00"), "regex holds a character that is not valid Unicode"),
    # blank labels: rows could only write blanks, and counted as valid
    (dict(choices=[" ", "\t"]), "choice 1 of 2 is blank"),
    # empty languages: accepted before, then every row ended in error at token 0
    (dict(json_schema={"$ref": "#"}), "no JSON value satisfies json_schema"),
    (dict(regex=r"[^\s\S]"), "regex matches no text"),
    (dict(regex="(a|b)\\"), "ends in a lone backslash; escape it"),
    (dict(regex="\\"), "ends in a lone backslash"),
    # right recursion without an end: accepted, then an error at token 1
    (dict(grammar='start: "a" start'), "limit of 50000 parser items"),
    (dict(grammar='root ::= "a" root'), "write recursion on the left"),
    # 600 optional properties: 2,407 items in one parser row, limit 2,000
    (dict(json_schema=OPTIONAL_600), "limit of 2000 alternatives at one point"),
    # past the size bound: refused before compiling
    (dict(json_schema={"type": "string", "description": "x" * 130_000}),
     "over the limit of 128,000"),
])
def test_edge_constraints_are_refused_in_one_line_before_submitting(tiny, arun, kw, words):
    msg = refused(tiny, arun, **kw)
    assert words in msg, msg


def test_2000_choices_and_more_work(tiny, arun):
    labels = [f"c{i}" for i in range(2500)]

    async def main():
        eng = make(tiny)
        rows = [eng.submit("pick", chat=False, choices=labels, max_tokens=10, seed=s,
                           temperature=1.0) for s in range(3)]
        await eng.wait()
        await eng.aclose()
        return rows

    for r in arun(main):
        assert (r.finish_reason, r.valid) == ("stop", True), (r.error, r.text)
        assert r.text in labels


def test_choices_with_regex_characters_are_literal(tiny, arun):
    labels = ["a|b", "x.*", "(1)", "<t>", "c\\d", "q\"", "é"]

    async def main():
        eng = make(tiny)
        rows = [eng.submit("pick", chat=False, choices=labels, max_tokens=10, seed=s,
                           temperature=1.5) for s in range(12)]
        await eng.wait()
        await eng.aclose()
        return rows

    rows = arun(main)
    assert all(r.finish_reason == "stop" and r.text in labels for r in rows)
    cons = Constraints(tiny[1])
    p = SamplingParams(choices=tuple(labels))
    assert all(cons.check(p, c) is None for c in labels)
    assert cons.check(p, "a") is not None and cons.check(p, "x12") is not None


def test_a_slow_compile_is_bounded_and_refused_again_at_once(tiny, arun, monkeypatch):
    real = constrain._grammar
    calls, done = [], threading.Event()

    def slow(kind, value):
        calls.append(value)
        time.sleep(1.0)
        done.set()  # (the compile finishes unread in the background)
        return real(kind, value)

    monkeypatch.setattr(constrain, "_grammar", slow)
    monkeypatch.setattr(constrain, "COMPILE_TIMEOUT_S", 0.1)
    msg = refused(tiny, arun, regex="[a-z]+")
    assert "took longer than 0.1 s" in msg, msg
    assert not done.is_set()  # refused at the bound, not when the compile ended

    cons = Constraints(tiny[1])
    p = SamplingParams(regex="[0-9]+")
    with pytest.raises(ValueError):
        cons.validate(p)
    n = len(calls)
    with pytest.raises(ValueError, match="took longer"):  # not compiled again
        cons.validate(p)
    assert len(calls) == n


class PanicLike(BaseException):
    """Like pyo3's PanicException, which derives from BaseException."""


@pytest.mark.parametrize("exc", [
    RecursionError("maximum recursion depth exceeded while encoding a JSON object"),
    PanicLike("called `Option::unwrap()` on a `None` value\nstack backtrace:\n"
              "   0: /home/runner/work/llguidance/parser/src/earley/parser.rs:1234:5"),
    TypeError("argument 'schema': 'int' object cannot be converted"),
])
def test_other_failures_of_compiling_become_one_line(tiny, arun, monkeypatch, caplog, exc):
    def boom(kind, value):
        raise exc

    monkeypatch.setattr(constrain, "_grammar", boom)
    with caplog.at_level(logging.WARNING, logger="mlxnb"):
        msg = refused(tiny, arun, json_schema={"type": "integer"})
    assert msg.startswith("json_schema could not be compiled"), msg
    assert "/home/runner" not in msg
    assert any(rec.exc_info for rec in caplog.records)  # the detail is logged


def test_one_line_drops_state_dumps_backtraces_and_paths():
    verbose = ("Parser Error: Current row has 2001 items; max is 2000; consider making "
               "your grammar left-recursive if it's right-recursive\n<state>\nTokens: ⟦c⟧\n"
               "Flags:\nParser: {\n  \"compute_time_us\": 0,\n  \"rows\": 2\n}\n")
    assert one_line(verbose) == ("Parser Error: Current row has 2001 items; max is 2000; "
                                 "consider making your grammar left-recursive if it's "
                                 "right-recursive")
    assert one_line("NoExtensionBias\n<non-verbose/>") == "NoExtensionBias"
    quoted = "1(8): Expected value (at \"?\")\n   1 | start: ??? nope\n              ^\n"
    assert one_line(quoted) == 'Expected value (at "?")'
    panic = ("assertion failed at /home/ci/.cargo/registry/src/index/derivre-0.3/src/ast.rs"
             ":88:9\nstack backtrace:\n   0: rust_begin_unwind\n")
    assert one_line(panic) == "assertion failed at llguidance"


def test_edge_constraints_in_generate_are_one_line_usage_errors(ip, tiny, arun_shut):
    names = dict(edge_deep=nested(2000), edge_nope="start: ??? nope",
                 edge_rr='start: "a" start', edge_blanks=["", " "], edge_loop={"$ref": "#"})

    async def main():
        eng = attach(tiny)
        ip.user_ns.update(names)
        out = []
        for line in ("--json-schema edge_deep", "--grammar edge_nope", "--grammar edge_rr",
                     "--choice edge_blanks", "--json-schema edge_loop", r"--regex '[^\s\S]'"):
            with pytest.raises(UsageError) as ei:
                gen(ip, "--quiet --raw --max-tokens 8 " + line, "a\nb")
            out.append(str(ei.value))
        return out, len(eng.rows)

    try:
        msgs, n = arun_shut(main)
    finally:
        for k in names:  # the shell is shared: later tests must not see these
            ip.user_ns.pop(k, None)
    assert n == 0
    for m, words in zip(msgs, ("nests more than", "Expected value", "parser items",
                               "is blank", "no JSON value", "matches no text")):
        assert words in m and "\n" not in m, m


# Keys llguidance cannot enforce while generating: accepted, left out of the mask,
# and checked on every finished row.
LENIENT = [
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 50},
               {"type": "integer", "minimum": 40, "maximum": 99}]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
     "maxItems": 4, "uniqueItems": True},
    {"type": "string", "format": "postal-code", "maxLength": 5},
    {"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "b": {"type": "boolean"}},
     "dependencies": {"a": ["b"]}, "additionalProperties": False},
    {"type": "integer", "minimum": 0, "maximum": 99,
     "if": {"minimum": 10}, "then": {"multipleOf": 10}},
]


def full_valid(schema, value) -> bool:
    import jsonschema

    cls = jsonschema.Draft7Validator if "dependencies" in schema else jsonschema.Draft202012Validator
    return cls(schema).is_valid(value)


@pytest.mark.parametrize("schema", LENIENT, ids=["oneOf", "uniqueItems", "format", "not",
                                                 "dependencies", "if-then"])
def test_keys_the_mask_cannot_enforce_are_accepted_and_checked_after(tiny, arun, schema):
    import json

    async def main():
        eng = make(tiny)
        rows = [eng.submit("x", chat=False, json_schema=schema, max_tokens=40, seed=s,
                           temperature=1.0) for s in range(8)]
        await eng.wait()
        await eng.aclose()
        return rows

    for r in arun(main):
        assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
        assert r.valid == full_valid(schema, json.loads(r.text)), (r.text, r.constraint_error)


def test_a_row_that_breaks_an_unenforced_key_is_not_valid_and_says_which(tiny, arun):
    # the mask allows only [1, 1], which uniqueItems refuses
    schema = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}

    async def main():
        eng = make(tiny)
        worker = eng.submit("x", chat=False, json_schema=schema, max_tokens=20)
        loop = eng.submit("x", chat=False, json_schema=schema, max_tokens=20, stop=["zz"])
        await eng.wait()
        await eng.aclose()
        return worker, loop

    for r in arun(main):  # checked on the worker, and on the loop (a stop-string row)
        assert (r.finish_reason, r.text, r.valid) == ("stop", "[1, 1]", False)
        assert "uniqueItems" in r.constraint_error and "\n" not in r.constraint_error
        assert "checked after generating" in r.constraint_error
        assert r.json is None and "uniqueItems" in r.json_error


def test_the_check_after_reads_decimal_multiples_exactly_and_blames_the_right_side():
    """0.3 is a multiple of 0.1 as written (not in binary floating point); a break of
    a key the mask enforces is not called a key checked only after generating."""
    from mlxnb.core.constraint_results import full_check

    tenths = {"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 1}
    assert full_check(tenths, "0.3") is None and full_check(tenths, "0.7") is None
    assert "multipleOf" in full_check(tenths, "0.35")
    assert full_check({"type": "integer", "multipleOf": 3}, "7") is not None
    why = full_check({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, "0")
    assert "exclusiveMinimum" in why and "a key the mask enforces" in why
    # integers of any size stay exact (a 28-digit decimal quotient rounds to whole)
    assert "multipleOf" in full_check({"type": "integer", "multipleOf": 2}, str(10**29 + 1))
    assert full_check({"type": "integer", "multipleOf": 2}, str(10**29)) is None
    # a failure inside an after-only key names its innermost keyword: still after-only
    then = {"if": {"required": ["a"]}, "then": {"required": ["b"]}}
    assert "checked after generating" in full_check(then, '{"a": 1}')
    names = {"propertyNames": {"maxLength": 2}}
    assert "checked after generating" in full_check(names, '{"abcd": 1}')
    # ...but a property called "then" is no keyword
    prop = {"type": "object", "properties": {"then": {"type": "integer"}}}
    assert "a key the mask enforces" in full_check(prop, '{"then": "x"}')


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 10, "not": {"multipleOf": 1}},  # no integer passes
    {"type": "number", "minimum": 10, "not": {"minimum": 0}},  # no number >= 10 passes
])
def test_a_number_cut_by_max_tokens_is_checked_against_unenforced_keys(tiny, arun, schema):
    """A top-level number cut by max_tokens has no finished value in the matcher (it
    could still grow), so its text is what the full schema checks."""
    async def main():
        eng = make(tiny)
        worker = eng.submit("x", chat=False, json_schema=schema, max_tokens=3)
        loop = eng.submit("x", chat=False, json_schema=schema, max_tokens=3, stop=["zz"])
        await eng.wait()
        await eng.aclose()
        return worker, loop

    for r in arun(main):  # checked on the worker, and on the loop (a stop-string row)
        assert r.finish_reason == "length" and len(r.text) == 3, (r.finish_reason, r.text)
        assert r.valid is False and "schema's not at" in r.constraint_error, (r.text, r.constraint_error)


def test_a_recursive_ref_beside_annotations_runs(tiny, arun):
    """SchemaStore's schemas often describe a $ref beside it (VS Code's
    markdownDescription); llguidance refuses a recursive $ref with a sibling key it
    does not know, so the mask's copy goes without annotations (the full check after
    reads the schema as given)."""
    schema = {"$ref": "#/definitions/node", "definitions": {"node": {
        "description": "a number, or a list of nodes",
        "anyOf": [{"type": "integer", "title": "leaf"},
                  {"type": "array", "maxItems": 2,
                   "items": {"$ref": "#/definitions/node", "markdownDescription": "a"}}]}}}

    async def main():
        eng = make(tiny)
        rows = [eng.submit("x", chat=False, json_schema=schema, max_tokens=24, seed=s,
                           temperature=1.0) for s in range(6)]
        await eng.wait()
        await eng.aclose()
        return rows

    for r in arun(main):
        assert r.finish_reason in ("stop", "length") and r.error is None, r.error
        assert r.finish_reason == "length" or r.valid, (r.text, r.constraint_error)


@pytest.mark.parametrize("kw, want", [
    (dict(regex="<bos>"), {"<bos>"}),
    (dict(regex="abcd<pad>"), {"abcd<pad>"}),
    (dict(regex="abcd<eos>", temperature=1.0, seed=3), {"abcd<eos>"}),
    (dict(choices=["see <pad> here", "none <eos>"]), {"see <pad> here", "none <eos>"}),
    (dict(json_schema={"type": "object", "properties": {"b": {"const": "<pad>"}},
                       "required": ["b"], "additionalProperties": False}),
     {'{"b": "<pad>"}'}),
])
def test_text_spelling_a_special_token_is_written_as_text(tiny, arun, kw, want):
    """The tiny tokenizer's <bos>, <eos> and <pad> are special tokens: a constraint
    that forces their text gets it written in ordinary tokens, rows with and without
    a stop string alike."""
    async def main():
        eng = make(tiny)
        rows = [eng.submit("x", chat=False, max_tokens=40, **kw),
                eng.submit("x", chat=False, max_tokens=40, stop=["zzz"], **kw)]
        for r in rows:
            await r
        special = {eng.tokenizer.convert_tokens_to_ids(t) for t in ("<bos>", "<eos>", "<pad>")}
        await eng.aclose()
        return rows, special

    rows, special = arun(main)
    for r in rows:
        assert (r.finish_reason, r.valid, r.error) == ("stop", True, None), r.constraint_error
        assert r.text in want and not special & set(r.tokens), (r.text, r.tokens)


def test_the_copy_that_checks_finished_texts_compiles_off_the_loop(tiny, arun, monkeypatch):
    import threading

    from mlxnb.core import constrain

    compiled_on, template = [], constrain.Constraints._template

    def spy(self, p, lane=0):
        hit = self._cache.get(constrain._key(p))
        # (a compile an earlier test left running past its bound may call this too)
        if lane == "check" and not (hit and "check" in hit[1]) and self is ours[0]:
            compiled_on.append(threading.current_thread().name)
        return template(self, p, lane)

    monkeypatch.setattr(constrain.Constraints, "_template", spy)
    ours = [None]

    async def main():
        eng = make(tiny)
        ours[0] = eng.constraints
        row = eng.submit("x", chat=False, max_tokens=20, regex="[a-c]{4}x[0-9]{3}",
                         stop=["x"])  # the stop string ends it: the loop checks its text
        await row
        await eng.aclose()
        return row

    row = arun(main)
    assert row.finish_reason == "stop" and row.valid is False
    assert compiled_on == ["mlxnb-constraint"]


def test_schemas_that_differ_only_in_property_order_are_written_in_their_own(tiny, arun):
    """Property order is the order a schema's output is written in ("reasoning"
    before "answer" is a common reason to reorder one)."""
    from mlxnb import Engine

    props = {"answer": {"type": "integer"}, "reasoning": {"type": "string", "maxLength": 5}}
    a = {"type": "object", "properties": props, "required": ["answer", "reasoning"],
         "additionalProperties": False}
    b = dict(a, properties=dict(reversed(list(props.items()))))

    async def main():
        eng = Engine(tiny, kv_budget=None, warmup=False)
        out = []
        for s in (a, b, a):
            out.append((await eng.submit("q", chat=False, max_tokens=14, json_schema=s)).text)
        await eng.aclose()
        return out

    out = arun(main)
    assert [t[:6] for t in out] == ['{"answ', '{"reas', '{"answ'], out


def test_a_constrained_rows_text_keeps_its_leading_space(arun):
    """mlx-lm's BPE detokenizer drops a text's leading space; a constrained row's text
    is what its matcher accepted, so `valid` and the text agree."""
    import re

    from mlxnb import Engine
    from mlxnb.models.tiny import tiny_model

    async def main():
        eng = Engine(tiny_model(vocab="smollm2"), kv_budget=None, warmup=False)
        rows = [eng.submit("Answer:", chat=False, max_tokens=8, choices=[" yes", " no"]),
                eng.submit("Answer:", chat=False, max_tokens=8, choices=[" yes", " no"],
                           stop=["zz"]),
                eng.submit("Number:", chat=False, max_tokens=8, regex=r" [0-9]{2}")]
        await eng.wait()
        await eng.aclose()
        return rows

    choice, stopped, number = arun(main)
    for r in (choice, stopped):
        assert r.text in (" yes", " no") and r.valid and r.constraint_error is None, r.text
    assert re.fullmatch(r" [0-9]{2}", number.text) and number.valid, number.text
