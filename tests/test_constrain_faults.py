"""Constrained rows where something other than the constraint's text goes wrong: a
schema's numbers the mask cannot hold exactly, a logits processor that leaves the
row nothing to draw, a row cut inside a character. Each is refused in one line
before submitting, or ends its own row with a reason that says what happened."""

import asyncio

import mlx.core as mx
import pytest
from IPython.core.error import UsageError

from mlxnb.core.constraint_grammar import wide_parts
from mlxnb.core.constraint_params import normalize

from test_constrain_edges import make, refused
from test_magics import arun_shut, attach, gen, ip  # noqa: F401  (fixtures)


pytestmark = pytest.mark.usefixtures("patient_submits")  # (conftest.py)

def through(tiny, arun, *submits):
    """The rows of `submit("x", chat=False, **kw)` for each kw in `submits`, run to
    their ends in one batch."""
    async def main():
        eng = make(tiny)
        rows = [eng.submit("x", chat=False, **kw) for kw in submits]
        await eng.wait()
        await eng.aclose()
        return rows
    return arun(main)


BIG = 12345678901234567891  # past 2^53: a 64-bit float holds 12345678901234567168


@pytest.mark.parametrize("schema, where", [
    ({"const": BIG}, "`const` at /"),
    ({"type": "integer", "enum": [1, -(2 ** 53 + 1)]}, "`enum` at /"),
    ({"type": "object", "properties": {"id": {"type": "integer", "minimum": 2 ** 60 + 1}}},
     "`minimum` at /properties/id"),
    ({"type": "array", "items": {"type": "integer", "exclusiveMaximum": -BIG}},
     "`exclusiveMaximum` at /items"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "maximum": BIG}]},
     "`maximum` at /anyOf/1"),
    ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "integer", "multipleOf": BIG}}},
     "`multipleOf` at /$defs/n"),
    ({"type": "object", "properties": {"p": {"const": {"deep": [1, {"n": BIG}]}}}},
     "`const` at /properties/p"),
    ({"type": "integer", "exclusiveMinimum": 2 ** 53 + 1}, "`exclusiveMinimum` at /"),
    # held by a double, but misread: past a signed 64-bit integer (-2^63 made
    # llguidance fail hard), or an exclusive bound that one more does not move
    ({"const": -(2 ** 63)}, "`const` at /"),
    ({"enum": [1, 2 ** 63]}, "`enum` at /"),
    ({"type": "integer", "minimum": 2 ** 63, "maximum": 2 ** 63}, "at /"),
    ({"type": "integer", "exclusiveMinimum": 2 ** 60}, "`exclusiveMinimum` at /"),
    # an integer's bounds written as floats are read as integers
    ({"type": "integer", "minimum": 1e19}, "`minimum` at /"),
    ({"type": ["integer", "null"], "exclusiveMinimum": 1e17}, "`exclusiveMinimum` at /"),
    # allOf's members are built into the mask too
    ({"allOf": [{"type": "integer"}, {"const": 2 ** 53 + 1}]}, "`const` at /allOf/1"),
])
def test_integers_past_2_53_that_the_mask_would_round_are_refused(tiny, arun, schema,
                                                                  where):
    """llguidance reads a schema's numbers as 64-bit floats: such a row was masked to
    a neighbouring number, then called invalid by the exact check after."""
    msg = refused(tiny, arun, json_schema=schema)
    assert "past 2^53" in msg and where in msg and "use a string" in msg, msg


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -(2 ** 53), "maximum": 2 ** 53},  # exact in a float
    {"type": "number", "maximum": 1e300},  # a float is what the mask reads already
    {"type": "integer", "default": BIG, "examples": [BIG], "description": str(BIG)},
    # a property named like a keyword is a schema, not a value
    {"type": "object", "properties": {"const": {"type": "integer"},
                                      "minimum": {"type": "integer"}}},
    {"type": "string", "maxLength": 5, "exclusiveMinimum": True},  # draft 4's boolean
    {"const": 2 ** 60, "enum": [10 ** 18, -(2 ** 62)]},  # past 2^53, but a double holds them
    {"type": "integer", "minimum": 2 ** 60, "maximum": 2 ** 62},  # inclusive: exact
    {"type": "number", "maximum": 1e300, "exclusiveMinimum": 1e20},  # floats, as read
    # keywords the mask is not built from
    {"type": "integer", "not": {"const": BIG}, "if": {"maximum": BIG}, "then": {}},
    {"type": "array", "items": {"type": "integer"}, "additionalItems": {"const": BIG}},
    {"type": "integer", "x-db": {"maximum": BIG}, "$defs": {"unused": {"const": BIG}}},
])
def test_schemas_without_such_integers_pass(schema):
    assert normalize({"json_schema": schema})["json_schema"] == schema


def test_refusing_a_big_integer_leaves_running_rows_alone(tiny, arun):
    async def main():
        eng = make(tiny)
        running = eng.submit("x", chat=False, max_tokens=64, regex="[a-z]{64}")
        while not running.ntok:
            await asyncio.sleep(0.002)
        with pytest.raises(ValueError, match="past 2"):
            eng.submit("x", chat=False, max_tokens=8, json_schema={"const": BIG})
        await eng.wait()
        await eng.aclose()
        return running, len(eng.rows)

    running, n = arun(main)
    assert n == 1 and (running.finish_reason, running.valid, running.ntok) == ("stop", True, 64)


def test_a_big_integer_in_generate_is_a_one_line_usage_error(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny)
        ip.user_ns["big_schema"] = {"type": "object", "properties": {"n": {"const": BIG}}}
        with pytest.raises(UsageError) as ei:
            gen(ip, "--quiet --raw --max-tokens 8 --json-schema big_schema", "a")
        return str(ei.value), len(eng.rows)

    try:
        msg, n = arun_shut(main)
    finally:
        ip.user_ns.pop("big_schema", None)
    assert n == 0 and "\n" not in msg and f"integer {BIG} in `const`" in msg, msg


def _ban_digits(tokens, logits):
    """Sets every digit's logit to -inf (the byte model: byte b is token b)."""
    return mx.where((mx.arange(logits.shape[-1]) >= 48) & (mx.arange(logits.shape[-1]) < 58),
                    -mx.inf, logits)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_processor_that_bans_every_allowed_token_ends_its_row_saying_so(tiny, arun,
                                                                         temperature):
    kw = dict(max_tokens=6, temperature=temperature, seed=1)
    banned, plain, free = through(
        tiny, arun, dict(kw, regex="[0-9]{3}", logits_processors=[_ban_digits]),
        dict(kw, regex="[0-9]{3}"), dict(kw, logits_processors=[_ban_digits]))
    assert banned.finish_reason == "error" and banned.valid is None
    assert "logits processors left no token the constraint allows" in banned.error, banned.error
    assert "constraint failed" not in banned.error and "\n" not in banned.error
    # the token its constraint refused is not in its text or its count
    assert not banned.text and banned.ntok == 0, (banned.text, banned.ntok)
    # the batch's other rows go on as if it were not there
    assert (plain.finish_reason, plain.valid, plain.error) == ("stop", True, None)
    assert free.finish_reason == "length" and free.ntok == 6
    assert not any(c.isdigit() for c in free.text)


@pytest.mark.parametrize("stop", [[], ["zz"]])
def test_a_token_taken_before_the_next_mask_fails_stays_in_the_text(tiny, arun, monkeypatch,
                                                                    stop):
    """llguidance takes 'h', then fails on a limit computing the next mask (little
    lexer fuel): the row ends `error` with 'h' in its text (not read as refused), and
    text a stop string held back shows."""
    import llguidance as llg

    from mlxnb.core import constrain, constraint_grammar, constraint_probe

    def low_fuel():
        return llg.LLParserLimits(verbose_errors=False, step_lexer_fuel=800)

    for mod in (constrain, constraint_grammar, constraint_probe):
        monkeypatch.setattr(mod, "parser_limits", low_fuel)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
             "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
             "quebec", "romeo", "sierra", "tango"]
    (row,) = through(tiny, arun, dict(max_tokens=20, stop=stop,
                                      regex=f"abcdefgh({'|'.join(words)})[0-9]{{2}}"))
    assert row.finish_reason == "error" and "too many expressions" in row.error, row.error
    assert (row.text, row.ntok) == ("abcdefgh", 8)


@pytest.mark.parametrize("kw, text", [
    # "ab" then any non-ASCII character, which U+FFFD is: the loop's check read the
    # replacement character as that character, the worker's matcher the cut bytes
    (dict(regex="ab[^\\x00-\\x7f]?", max_tokens=3), "ab\ufffd"),
    (dict(choices=["ab", "abé"], max_tokens=3), "ab\ufffd"),
    (dict(json_schema={"enum": ["abé"]}, max_tokens=4), '"ab\ufffd'),
])
def test_a_row_cut_inside_a_character_is_incomplete_with_or_without_a_stop(tiny, arun,
                                                                            kw, text):
    """The row's text, checked on the worker (no stop string: its matcher) or on the
    loop (a stop string: a fresh matcher reads the text), gets one verdict."""
    worker, loop = through(tiny, arun, kw, dict(kw, stop=["zz"]))
    for r in (worker, loop):
        assert (r.finish_reason, r.text, r.valid) == ("length", text, False), (
            r.text, r.constraint_error)
        assert "inside a character" in r.constraint_error, r.constraint_error
    assert worker.constraint_error == loop.constraint_error


@pytest.mark.parametrize("kw", [dict(regex="ab\ufffd"), dict(choices=["ok\ufffd", "no"])])
def test_a_row_that_writes_a_replacement_character_and_ends_is_valid(tiny, arun, kw):
    """U+FFFD as a character the constraint asks for, and the row ends by its grammar:
    whole, with or without a stop string (only max_tokens cuts a character)."""
    for r in through(tiny, arun, dict(kw, max_tokens=16), dict(kw, max_tokens=16, stop=["zz"])):
        assert (r.finish_reason, r.valid) == ("stop", True), (r.text, r.constraint_error)
        assert r.text.endswith("\ufffd")


def test_a_whole_replacement_character_at_max_tokens_is_read_as_written(tiny, arun):
    """A row that max_tokens ends is checked on its tokens, as the worker's matcher
    read them: a U+FFFD the model wrote whole is a character, with or without a stop
    string (its text alone could not tell it from a cut one)."""
    kw = dict(regex="(ab\ufffd)+", max_tokens=5)  # the byte model: 2 + 3 bytes
    for r in through(tiny, arun, kw, dict(kw, stop=["zz"])):
        assert (r.finish_reason, r.text, r.valid) == ("length", "ab\ufffd", True), (
            r.constraint_error)


def _wide(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


WIDE = _wide(600)  # 2,407 alternatives in one parser row once a row enters it


@pytest.mark.parametrize("schema, at", [
    ({"anyOf": [{"type": "integer"}, WIDE]}, "/anyOf/1"),
    ({"type": "array", "items": WIDE}, "/items"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": WIDE},
      "required": ["a", "b"]}, "/properties/b"),
    ({"type": "object", "properties": {"a": {"type": "integer"},
                                       "b": {"$ref": "#/definitions/wide"}},
      "required": ["a", "b"], "definitions": {"wide": WIDE}}, "/definitions/wide"),
    # reached by a named anchor: `$anchor`, and a draft-07 `$id` of the form "#name"
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#wide"}},
      "required": ["a", "b"], "$defs": {"w": dict(WIDE, **{"$anchor": "wide"})}},
     "/$defs/w"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"$ref": "#wide"}},
      "required": ["a", "b"], "definitions": {"w": dict(WIDE, **{"$id": "#wide"})}},
     "/definitions/w"),
])
def test_a_wide_object_off_the_probes_path_is_refused_before_submitting(tiny, arun,
                                                                        schema, at):
    """The walk over a schema's first tokens passed these by; their rows then ended
    `error` with llguidance's own message once one entered the object."""
    msg = refused(tiny, arun, json_schema=schema)
    assert f"limit of 2000 alternatives at {at} (it has" in msg, msg


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"type": "integer"}, _wide(300)]},  # wide, within the limit
    {"type": "integer", "$defs": {"unused": WIDE}},  # never reached
])
def test_wide_objects_within_the_limit_or_unreached_run(tiny, arun, schema):
    for r in through(tiny, arun, *[dict(json_schema=schema, max_tokens=16, seed=s,
                                        temperature=1.0) for s in range(4)]):
        assert r.finish_reason in ("stop", "length") and r.error is None, r.error


_BASE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    # keywords the mask is not built from: checked after, or merged
    dict(_BASE, **{"not": WIDE}),
    dict(_BASE, **{"if": WIDE, "then": {"required": ["a"]}}),
    dict(_BASE, **{"x-ui": WIDE}),
    dict(_BASE, dependentSchemas={"a": WIDE}),
    {"type": "array", "items": {"type": "integer"}, "contains": WIDE},
    {"type": "array", "items": {"type": "integer"}, "additionalItems": WIDE},
    # what merges into a member or a $ref's target requires its properties
    {"allOf": [{"$ref": "#/$defs/base"}, {"required": [f"p{i}" for i in range(600)]}],
     "$defs": {"base": WIDE}},
    {"type": "array", "items": {"required": [f"p{i}" for i in range(590)], "anyOf": [WIDE]}},
    # every property required: a sequence, no alternatives
    {"type": "array", "items": dict(WIDE, required=list(WIDE["properties"]))},
])
def test_wide_objects_no_alternative_of_the_mask_reaches_are_not_probed(schema):
    assert wide_parts(schema) == []


def test_a_long_chain_of_refs_is_walked_without_the_stack():
    n = 3000
    defs = {f"D{i}": {"type": "object", "properties": {"next": {
        "type": "array", "items": {"$ref": f"#/$defs/D{i + 1}"}}}} for i in range(n)}
    defs[f"D{n}"] = dict(WIDE, **{"x-tail": {"const": 2 ** 53 + 1}})
    schema = {"$ref": "#/$defs/D0", "$defs": defs}
    assert [at for at, _ in wide_parts(schema)] == [f"/$defs/D{n}"]
    assert normalize({"json_schema": schema})["json_schema"] == schema


def test_a_definition_is_probed_in_the_context_that_leaves_it_widest():
    """Reached first where its properties are all required, then where none are."""
    schema = {"type": "object", "required": ["x", "y"], "$defs": {"w": WIDE}, "properties": {
        "x": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/w"}]},
        "y": {"allOf": [{"$ref": "#/$defs/w"}, {"required": list(WIDE["properties"])}]}}}
    assert [at for at, _ in wide_parts(schema)] == ["/$defs/w"]


@pytest.mark.parametrize("schema", [
    # a member's property merged with another member's (llguidance intersects them)
    {"type": "object", "required": ["x"], "properties": {"x": {"allOf": [
        {"type": "object", "properties": {"q": WIDE}},
        {"properties": {"q": {"required": list(WIDE["properties"])}}}]}}},
    {"type": "object", "properties": {"q": WIDE},
     "anyOf": [{"properties": {"q": {"required": list(WIDE["properties"])}}}]},
    # a required name the wide branch cannot hold: it is never entered
    {"required": ["p999"], "anyOf": [{"type": "integer"}, dict(
        _wide(1000), additionalProperties=False, required=["nope"])]},
])
def test_wide_objects_merged_with_others_are_not_refused(tiny, arun, schema):
    (r,) = through(tiny, arun, dict(json_schema=schema, max_tokens=8))
    assert r.finish_reason in ("stop", "length"), r.error


def test_a_wide_object_inside_an_all_of_is_probed():
    """pydantic v1 writes a described field as `allOf: [{$ref}]`: llguidance builds
    the members into the mask, so the wide definition is reached there."""
    schema = {"type": "object", "properties": {"b": {
        "allOf": [{"$ref": "#/definitions/wide"}], "description": "b"}},
        "required": ["b"], "definitions": {"wide": WIDE}}
    assert [at for at, _ in wide_parts(schema)] == ["/definitions/wide"]


def test_an_object_reached_twice_is_probed_once():
    schema = {"type": "object", "properties": {"big": WIDE, "again": {"$ref": "#/properties/big"}}}
    assert [at for at, _ in wide_parts(schema)] == ["/properties/big"]
