"""%%generate's pure parsing: body rule, {name} interpolation, option values, the grid."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from mlxnb.notebook.cellparse import (build_grid, derive_seed, interpolate, parse_values,
                             split_body, unescape)


# -- body rule -----------------------------------------------------------------------
@pytest.mark.parametrize("body, rows", [
    ("a\nb\nc", ["a", "b", "c"]),
    ("\n  a  \n\n\n b\n", ["a", "b"]),  # blank lines skipped, whitespace stripped
    ("one line", ["one line"]),
    ("a\r\nb\r\n", ["a", "b"]),
    # any `---` line switches to blocks; blank lines inside a block are kept
    ("first line\n\nsecond para\n---\nother", ["first line\n\nsecond para", "other"]),
    ("---\na\n---\n\n---\nb\n---", ["a", "b"]),  # empty blocks skipped
    ("   ---   \n  x\n    y\n", ["x\n  y"]),  # common indent removed, relative kept
    ("a\n----\nb", ["a", "----", "b"]),  # only exactly --- separates
    ("a --- b\nc", ["a --- b", "c"]),
    ("x  \n---\ny\t", ["x", "y"]),
])
def test_body_rule(body, rows):
    assert split_body(body) == rows


@pytest.mark.parametrize("body", ["", "   ", "\n\n  \n", "---", "---\n\n---\n  \n"])
def test_empty_body_is_a_usage_error(body):
    with pytest.raises(UsageError, match="no prompts"):
        split_body(body)


# -- interpolation ------------------------------------------------------------------------
NS = {"topic": "the sea", "n": 3, "xs": ["a", "b"], "ys": (1, 2, 3), "d": {"k": "v"},
      "empty": [], "blank": ""}


@pytest.mark.parametrize("tpl, out", [
    ("Write about {topic}.", [("Write about the sea.", {})]),
    ("x{n:>3}|{d[k]}", [("x  3|v", {})]),
    ("{{literal}} {topic}", [("{literal} the sea", {})]),
    ("{xs}-{xs}", [("a-a", {"xs": "a"}), ("b-b", {"xs": "b"})]),  # same field: one sweep
    ("{xs}{ys}", [(f"{x}{y}", {"xs": x, "ys": y}) for x in "ab" for y in (1, 2, 3)]),
    ("{xs!s}", [("['a', 'b']", {})]),  # a conversion inserts the list itself
    # ... wherever it stands: each occurrence on its own
    ("{xs!s} {xs}", [("['a', 'b'] a", {"xs": "a"}), ("['a', 'b'] b", {"xs": "b"})]),
    ("{xs} {xs!s}", [("a ['a', 'b']", {"xs": "a"}), ("b ['a', 'b']", {"xs": "b"})]),
    ("no fields", [("no fields", {})]),
])
def test_interpolate(tpl, out):
    assert interpolate(tpl, NS) == out


@pytest.mark.parametrize("tpl, msg", [
    ("{missing}", "{missing} is not defined; define missing"),
    ("{missing.attr}", "{missing} is not defined"),
    ("{", "literal braces"),
    ("}", "literal braces"),
    ("{0}", "not a variable name"),
    ("{}", "not a variable name"),
    ("{1x}", "not a variable name"),
    ("{topic.nope}", "could not evaluate"),
    ("{d[zz]}", "could not evaluate"),
    ("{n:q}", "could not format"),
    ("{n:{w}}", "nested braces"),
    ("{empty}", "empty list"),
    ("{blank}", "empty after filling"),
    ('JSON {"a": 1}', "literal braces"),
])
def test_interpolate_errors(tpl, msg):
    with pytest.raises(UsageError) as e:
        interpolate(tpl, NS, "prompt 1")
    assert msg in str(e.value) and "\n" not in str(e.value)


# -- option values ---------------------------------------------------------------------------
@pytest.mark.parametrize("opt, raw, kind, out", [
    ("temp", "0.7", float, [0.7]),
    ("temp", "0.2,0.7,1.0", float, [0.2, 0.7, 1.0]),
    ("temp", ["0.2,", "0.7"], float, [0.2, 0.7]),  # nargs tokens: --temp 0.2, 0.7
    ("temp", ["0.2", "0.7"], float, [0.2, 0.7]),  # --temp 0.2 0.7 / --temp 0.2 --temp 0.7
    ("temp", "[0.2, 0.7]", float, [0.2, 0.7]),  # IPython expanded {temps} in the line
    ("temp", 0.5, float, [0.5]),  # a %config default
    ("temp", "0.7,", float, [0.7]),
    ("seed", "1,2,3", int, [1, 2, 3]),
    ("seed", None, int, [None]),
    ("top_p", "1", float, [1.0]),
    ("max_tokens", "1_000", int, [1000]),
])
def test_parse_values(opt, raw, kind, out):
    assert parse_values(opt, raw, kind) == out


@pytest.mark.parametrize("opt, raw, kind, msg", [
    ("temp", "hot", float, "--temp: 'hot' is not a number"),
    ("temp", "-0.5", float, "--temp must be a number >= 0"),
    ("temp", "nan", float, "finite"),
    ("temp", "inf", float, "finite"),
    ("temp", "0.2,,0.7", float, "'' is not a number"),
    ("top_p", "0", float, "--top-p must be a number in (0, 1]"),
    ("top_p", "1.5", float, "(0, 1]"),
    ("min_p", "1", float, "[0, 1)"),
    ("top_k", "-1", int, "--top-k must be an integer >= 0"),
    ("top_k", "2.5", int, "is not an integer"),
    ("max_tokens", "0", int, "--max-tokens must be a positive integer"),
    ("max_tokens", "-5", int, "positive integer"),
    ("repetition_penalty", "0", float, "> 0"),
    ("seed", "-1", int, "in [0, 2**32)"),
    ("seed", "4294967296", int, "in [0, 2**32)"),
    ("n", "0", int, "--n must be a positive integer"),
    ("logprobs", "21", int, "[0, 20]"),
])
def test_parse_values_errors(opt, raw, kind, msg):
    with pytest.raises(UsageError) as e:
        parse_values(opt, raw, kind)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_single_valued_options_refuse_lists():
    with pytest.raises(UsageError, match="takes one value"):
        parse_values("n", "2,3", int, sweep=False)


def test_unescape():
    assert unescape(r"a\nb\tc\\n") == "a\nb\tc\\n"
    assert unescape("é\\n") == "é\n"


def test_derived_seeds_are_distinct_and_keep_the_base():
    seeds = {derive_seed(s, k) for s in range(50) for k in range(8)}
    assert len(seeds) == 400
    assert derive_seed(7, 0) == 7


# -- the grid ---------------------------------------------------------------------------------
def grid(templates, ns=None, n=1, limit=None, **sweeps):
    sw = {"max_tokens": [16], "temp": [0.0], "seed": [None]}
    sw.update(sweeps)
    return build_grid(templates, ns or {}, sw, n, limit=limit, rng=random.Random(0))


def test_grid_order_and_tags():
    g = grid(["p {xs}", "q"], {"xs": ["a", "b"]}, n=2, temp=[0.2, 0.7], seed=[1, 2])
    # prompts (3 after expansion) x temps (2) x seeds (2) x samples (2)
    assert len(g) == 3 * 2 * 2 * 2
    assert [r.prompt for r in g[::8]] == ["p a", "p b", "q"]
    first = g[0]
    assert first.tag == {"prompt_index": 0, "temp": 0.2, "seed": 1, "sample": 0, "xs": "a"}
    assert first.params == {"max_tokens": 16, "temperature": 0.2, "seed": 1}
    assert g[1].tag["sample"] == 1 and g[1].params["seed"] == derive_seed(1, 1)
    assert g[-1].tag == {"prompt_index": 1, "temp": 0.7, "seed": derive_seed(2, 1),
                         "sample": 1}
    assert len({(r.prompt, r.params["temperature"], r.params["seed"]) for r in g}) == len(g)


def test_grid_swept_options_become_columns():
    g = grid(["p"], top_p=[0.5, 0.9], max_tokens=[8])
    assert [r.tag["top_p"] for r in g] == [0.5, 0.9]
    assert "max_tokens" not in g[0].tag  # one value: not a sweep column


def test_grid_random_seeds_only_for_sampled_rows():
    g = grid(["p"], n=4, temp=[0.0, 0.8])
    greedy, sampled = g[:4], g[4:]
    assert all(r.params["seed"] is None for r in greedy)
    seeds = [r.params["seed"] for r in sampled]
    assert None not in seeds and len(set(seeds)) == 4


def test_grid_reserved_variable_names_are_prefixed():
    g = grid(["{text}"], {"text": ["a", "b"]})
    assert g[0].tag["var_text"] == "a" and "text" not in g[0].tag
    # the run's timing and speculation columns, and what save() adds
    for name in ("decode_s", "queue_s", "draft_accepted", "model", "params", "logprobs"):
        g = grid(["{%s}" % name], {name: ["a", "b"]})
        assert g[0].tag == {"prompt_index": 0, "temp": 0.0, "seed": None, "sample": 0,
                            "var_" + name: "a"}, name


def test_grid_limit_checked_before_expanding(monkeypatch):
    huge = {"a": list(range(1000)), "b": list(range(1000)), "c": list(range(1000))}
    with pytest.raises(UsageError, match="1000000000 rows, more than the limit of 64"):
        grid(["{a}{b}{c}"], huge, limit=64)
    with pytest.raises(UsageError, match="24 rows"):
        grid(["x", "y", "z"], n=4, limit=10, temp=[0.1, 0.2])
    assert len(grid(["x"], n=4, limit=4)) == 4
    # option sweeps too: refused before their combinations are built (27 million: 2 GB)
    import mlxnb.notebook.cellparse as cp

    def product(*_):
        raise AssertionError("combinations built before the limit was checked")

    monkeypatch.setattr(cp.itertools, "product", product)
    vals = [0.1 + i / 1000 for i in range(300)]
    with pytest.raises(UsageError, match="27000000 rows"):
        grid(["x"], limit=1024, temp=vals, top_p=[v / 2 for v in vals],
             min_p=[v / 4 for v in vals])


def test_grid_error_names_the_prompt():
    with pytest.raises(UsageError, match=r"prompt 2 'b \{nope\}': \{nope\} is not defined"):
        grid(["a", "b {nope}"])


# -- fuzz: the parser raises nothing but UsageError ---------------------------------------------
_text = st.lists(st.sampled_from(list("ab {}[]!:.-_0 \n\t\ré") + [
    "---", "{xs}", "{x}", "\n---\n", "{{", "}}", "{a0[k]}", "{b}", "{x!r:>4}"]),
    max_size=30).map("".join)


@settings(max_examples=400, deadline=None)
@given(_text)
@example("\n---\n{:{\n}}")  # a format spec holding a line break, in the error
@example("{a0[\n]}")
@example("{x:\n>4}")
def test_fuzz_body_and_interpolation(body):
    ns = {"x": 1, "xs": ["p", "q"], "a": "A", "b": [], "a0": {"k": 1}}
    try:
        rows = split_body(body)
    except UsageError:
        return
    assert rows and all(r == r.strip() and r for r in rows)
    try:
        out = grid(rows, ns, limit=50)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert all(r.prompt for r in out)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["temp", "seed", "top_p", "top_k", "min_p", "max_tokens",
                        "repetition_penalty"]),
       st.text(max_size=20))
def test_fuzz_values(opt, raw):
    kind = int if opt in ("seed", "top_k", "max_tokens") else float
    try:
        vals = parse_values(opt, raw, kind)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert vals and all(isinstance(v, kind) for v in vals)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.dictionaries(
    st.sampled_from(["x", "xs", "a", "text"]),
    st.one_of(st.text(max_size=5), st.integers(), st.lists(st.text(max_size=3), max_size=3)),
))
def test_fuzz_any_text_and_namespace(body, ns):
    try:
        out = grid(split_body(body), ns, limit=100)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert out and all(r.prompt and r.prompt == r.prompt.strip() for r in out)
