"""%%generate --json-schema / --regex / --choice / --grammar on an in-process IPython
shell and the tiny model."""

import json
import re

import pytest
from IPython.core.error import UsageError

from mlxnb.notebook import magics
from mlxnb.notebook.cellrequests import constraint_params

from test_magics import arun_shut, attach, gen, ip  # noqa: F401  (fixtures)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


pytestmark = pytest.mark.usefixtures("patient_submits")  # (conftest.py)

def test_each_flag_constrains_its_rows(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        ip.user_ns.update(schema=SCHEMA, labels=["red", "green"],
                          gram='root ::= "x" [0-9] [0-9]')
        runs = [gen(ip, "--quiet --raw --max-tokens 40 --json-schema schema", "a\nb"),
                # IPython expands {...} in a magic's line: {{3}} reaches us as {3}
                gen(ip, "--quiet --raw --max-tokens 20 --regex '[a-c]{{3}}!'", "c"),
                gen(ip, "--quiet --raw --max-tokens 20 --choice 'yes,no way'", "d"),
                gen(ip, "--quiet --raw --max-tokens 20 --choice labels", "e"),
                gen(ip, "--quiet --raw --max-tokens 20 --grammar gram", "f"),
                gen(ip, "--quiet --raw --max-tokens 5", "free")]
        for r in runs:
            await r
        return runs

    js, rx, ch, lab, gr, free = arun_shut(main)
    assert all(r.finish_reason == "stop" and set(r.json) == {"ok", "n"} for r in js)
    assert re.fullmatch(r"[a-c]{3}!", rx[0].text) and rx[0].finish_reason == "stop"
    assert ch[0].text in ("yes", "no way") and lab[0].text in ("red", "green")
    assert re.fullmatch(r"x[0-9]{2}", gr[0].text)
    df = js.to_pandas()
    assert list(df["json.n"]) == [r.json["n"] for r in js]
    assert "constraint" not in free.to_pandas().columns


@pytest.mark.parametrize("line, words", [
    ("--json-schema nope", "nope is not defined"),
    ("--json-schema '{\"type\"'", "name of a notebook variable"),
    ("--grammar notstr", "not a string"),
    ("--regex 'a(b'", "regex is invalid"),
    ("--json-schema bad", "json_schema is invalid"),
    ("--regex a --choice a,b", "at most one"),
    ("--choice ,", "--choice needs options"),
    ("--json-schema nothing", "nothing is None"),
    ("--choice word", "word is a str, not a collection of options"),
    ("--choice gen", "gen is a generator"),
    ("--choice lables", "one option is no choice; give two or more, e.g. --choice yes,no, "
                        "or define lables as a list"),
    ("--choice emptyset", "emptyset holds no options; give it two or more"),
    ("--choice one", "one holds 1 option; give it two or more"),
    ("--choice frame", "frame is a DataFrame, not a collection of options"),
    ("--choice scalar", "scalar is a ndarray, not a collection of options"),
    ("--json-schema nan", "json_schema holds NaN or Infinity which JSON cannot represent"),
    ("--json-schema inf", "json_schema holds NaN or Infinity which JSON cannot represent"),
])
def test_bad_constraint_options_are_one_line_usage_errors(ip, tiny, arun_shut, line, words):
    async def main():
        eng = attach(tiny)
        np, pd = pytest.importorskip("numpy"), pytest.importorskip("pandas")
        ip.user_ns.update(notstr=5, bad={"type": "frobnicate"}, nothing=None, word="yes",
                          gen=(x for x in "ab"), emptyset=set(), one=["yes"],
                          frame=pd.DataFrame({"label": ["pos", "neg"]}),
                          scalar=np.array("yes"),
                          nan={"type": "number", "enum": [float("nan"), 1.0]},
                          inf={"type": "number", "maximum": float("inf")})
        with pytest.raises(UsageError) as ei:
            gen(ip, "--quiet --raw " + line, "a\nb")
        return ei.value, len(eng.rows)

    err, n = arun_shut(main)
    assert words in str(err) and "\n" not in str(err), str(err)
    assert n == 0  # nothing submitted


def test_constraint_params_parsing():
    ns = {"xs": ("a", "b"), "s": SCHEMA}
    assert constraint_params(None, None, ["a,b", "c"], None, ns) == {"choices": ["a", "b", "c"]}
    assert constraint_params(None, None, ["xs"], None, ns) == {"choices": ["a", "b"]}
    assert constraint_params(None, None, ["xs,y"], None, ns) == {"choices": ["xs", "y"]}
    assert constraint_params("s", None, None, None, ns) == {"json_schema": SCHEMA}
    assert constraint_params(None, r"\d+", None, None, ns) == {"regex": r"\d+"}
    assert constraint_params(None, None, None, None, ns) == {}


def test_choice_takes_any_collection_and_a_bracketed_list():
    np, pd = pytest.importorskip("numpy"), pytest.importorskip("pandas")
    ns = {"arr": np.array(["yes", "no"]), "ser": pd.Series(["a", "b"]),
          "st": {"b", "a"}, "rng": range(2)}
    for name, want in (("arr", ["yes", "no"]), ("ser", ["a", "b"]), ("st", ["a", "b"]),
                       ("rng", ["0", "1"])):
        assert constraint_params(None, None, [name], None, ns) == {"choices": want}, name
    # as IPython writes {labels} or $labels of ['positive', 'negative'] into the line
    for toks, want in ((["[positive,", "negative]"], ["positive", "negative"]),
                       (["[yes,no]"], ["yes", "no"]), (["(a,", "b)"], ["a", "b"]),
                       (["[x],[y]"], ["[x]", "[y]"])):  # options in brackets: as given
        assert constraint_params(None, None, toks, None, ns) == {"choices": want}, toks


def test_choice_of_a_list_ipython_wrote_into_the_line_keeps_its_items(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        ip.user_ns["cities"] = ["New York", "Paris, France", "it's \\ (here)"]
        r = ip.run_cell("%%generate --quiet --raw --max-tokens 20 --choice {cities}\nWhere?")
        run = r.result
        await run
        return run.rows[0]

    row = arun_shut(main)
    assert row.params.choices == ("New York", "Paris, France", "it's \\ (here)")
    assert row.finish_reason == "stop" and row.text in row.params.choices


def test_a_choice_list_in_the_line_is_read_as_written_and_nowhere_else():
    import time

    from mlxnb.notebook.magicargs import _split

    ns = {}
    for line, want in (("--choice ['Paris, France', 3]", ["Paris, France", "3"]),
                       ("--choice=('a b', 'c,d')", ["a b", "c,d"])):
        toks = _split(line)
        assert constraint_params(None, None, toks[1:] or [toks[0].split("=", 1)[1]],
                                 None, ns) == {"choices": want}, line
    with pytest.raises(UsageError, match="a list of 1 option; give two or more"):
        constraint_params(None, None, _split("--choice ['Paris, France']")[1:], None, ns)
    # inside another option's quoted value it is that option's text, untouched
    assert _split('--system "like --choice [\'a\', \'b\'] does" --stop "--choice [\'x\']"') \
        == ["--system", "like --choice ['a', 'b'] does", "--stop", "--choice ['x']"]
    t0 = time.perf_counter()  # one pass: long or unclosed brackets cost little
    for line in ("--choice [" + "[1]," * 4000, "--choice [ " * 800 + "]" * 800,
                 "--choice [1," * 2000 + "]"):
        _split(line)
    assert time.perf_counter() - t0 < 2


def test_widget_marks_constrained_rows(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        ip.user_ns["schema"] = SCHEMA
        run = gen(ip, "--raw --max-tokens 40 --json-schema schema -o r1", "a")
        cut = gen(ip, "--raw --max-tokens 3 --json-schema schema -o r2", "b")
        free = gen(ip, "--raw --max-tokens 3 -o r3", "c")
        await run
        await cut
        await free
        return run, cut, free

    run, cut, free = arun_shut(main)
    from mlxnb.notebook.rowwire import full as row_full

    full = row_full(run.rows[0])
    assert full["con"] == "json" and full["parse"] == "ok"
    bad = row_full(cut.rows[0])
    assert bad["con"] == "json" and "not valid JSON" in bad["parse"]
    assert "con" not in row_full(free.rows[0])
    text = run.widget.summary_text()
    assert "json ok" in text and "json invalid" in cut.widget.summary_text()
    json.dumps(full)  # what the front end gets is plain JSON


def test_backslashes_outside_quotes_reach_the_regex_and_the_stop(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        run = gen(ip, r"--quiet --raw --max-tokens 8 --regex \d\d --stop \n", "a")
        quoted = gen(ip, r"""--quiet --raw --max-tokens 8 --regex '\d\d' --stop "\n" """, "a")
        spaced = gen(ip, r"--quiet --raw --max-tokens 8 --system say\ hi", "a")
        for r in (run, quoted, spaced):
            await r
        return run, quoted, spaced

    run, quoted, spaced = arun_shut(main)
    for r in (run, quoted):
        p = r.rows[0].params
        assert (p.regex, p.stop) == (r"\d\d", ("\n",)), (p.regex, p.stop)
        assert re.fullmatch(r"\d\d", r.rows[0].text)
    assert spaced.meta["system"] == "say hi"  # a shell's escaped space still joins
