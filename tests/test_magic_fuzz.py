"""Bad input at the magic level, table-driven and fuzzed.

An in-process IPython shell with the extension loaded and one engine on the tiny
random-weight model, on an event loop of our own that runs only when a test steps it
(so a test controls exactly when rows make progress). The contract checked for every
bad ``%%generate`` / ``%mlxnb`` line or body:

* exactly one ``UsageError`` with a non-empty one-line message, and nothing else (no
  other exception type; through a whole cell the shell prints one line, no traceback);
* nothing is submitted (the engine's row list does not grow);
* rows already running are undisturbed: a "victim" run started before the bad cells
  (and stepped between them) finishes with exactly the tokens of a reference run of
  the same prompts made alone.

Odd but valid input (mixed scripts, emoji, NUL, zero-width characters) must produce a
`Run` whose rows generate. Hypothesis then throws random option lines and bodies at
the magics and asserts "a UsageError or a Run, never anything else".

(tests/test_magics.py covers the basic mistakes table; these are further cases.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mlxnb.notebook import magics
from mlxnb.core.engine import Engine
from mlxnb.core.run import Run

VICTIM_TOKENS = 400
VICTIM_LINE = f"--quiet --raw --max-tokens {VICTIM_TOKENS}"
VICTIM_BODY = "The sea is\nOnce upon a time"


class Boom:
    """A notebook variable whose formatting fails."""

    def __format__(self, spec):
        raise RuntimeError("no format for you\nsecond line")


class Task:
    """Has cancel() and done, as an asyncio task does: not a Run or a Row."""

    done = False

    def cancel(self):
        raise AssertionError("%mlxnb stop cancelled a user's own object")


VARS = {
    "word": "ocean",
    "task": Task(),
    "mixed": "Ünïcödé 日本語 עברית العربية हिन्दी ไทย 🙂👍🏽👨‍👩‍👧 e\u0301",
    "emojis": ["🙂", "👨‍👩‍👧", "🏳️‍🌈"],
    "sur": "bad \ud800 text",
    "sur_pair": "\ud83d\ude42",  # a valid pair written as two lone surrogates
    "some_bad": ["fine", "bad \udcff"],
    "blank": "   ",
    "nothing": [],
    "big": "w" * 100_000,
    "many": list(range(2000)),
    "d": {"k": 1},
    "boom": Boom(),
    "obj": object(),
}


class World:
    def __init__(self, ip, loop, eng):
        self.ip, self.loop, self.eng = ip, loop, eng
        self.ref = None
        self.running = None  # the victim run of the current block

    def nudge(self) -> None:
        """Let the victim decode a little between bad cells, but keep it short of its
        last tokens, so that it is still running when the block ends."""
        if self.running is not None and self.running.rows[0].ntok < VICTIM_TOKENS - 100:
            self.step(0.001)

    def step(self, seconds: float = 0.0) -> None:
        """Let the engine work on its loop for a moment."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def finish(self, run: Run, timeout: float = 60) -> None:
        self.loop.run_until_complete(asyncio.wait_for(
            asyncio.gather(*(r._future for r in run.rows)), timeout))

    def attempt(self, kind: str, line: str, body: str = ""):
        """The error message (str) of a refused magic, or what it returned; any other
        exception propagates and fails the test."""
        n0 = len(self.eng.rows)
        try:
            if kind == "cell":
                return self.ip.run_cell_magic("generate", line, body)
            return self.ip.run_line_magic("mlxnb", line)
        except UsageError as e:
            msg = str(e)
            assert msg.strip(), "an empty UsageError"
            assert "\n" not in msg and "\r" not in msg, f"a multi-line message: {msg!r}"
            assert len(msg) < 600, f"a {len(msg)}-character message"
            # ipykernel cannot send a lone surrogate: the cell would get no reply at all
            msg.encode("utf-8")
            assert len(self.eng.rows) == n0, f"refused, yet submitted rows: {msg}"
            return msg

    @contextlib.contextmanager
    def victim(self):
        """A run decoding before, during and after the block; its tokens must equal
        the reference run's."""
        run = self.ip.run_cell_magic("generate", VICTIM_LINE, VICTIM_BODY)
        for _ in range(200):  # its rows' first tokens: a busy host may take a while
            self.step(0.05)
            if all(r.tokens for r in run.rows):
                break
        assert not run.done and all(r.tokens for r in run.rows), "victim not decoding"
        self.running = run
        try:
            yield run
        except BaseException:
            run.cancel()  # a failed test must not leave rows running for the next one
            self.finish(run)
            raise
        finally:
            self.running = None
        assert not run.done, "the victim ended during the block (cancelled or too short)"
        self.finish(run)
        assert [r.finish_reason for r in run.rows] == ["length"] * 2, run.records()
        assert [list(r.tokens) for r in run.rows] == self.ref, "victim's tokens changed"


@pytest.fixture(scope="module")
def world(tiny):
    loop = asyncio.new_event_loop()
    ip = InteractiveShell.instance()
    magics.load_ipython_extension(ip)
    ip.user_ns.update(VARS)
    eng = magics.use(Engine(tiny, loop=loop, kv_budget=None), name="tiny")
    w = World(ip, loop, eng)
    ref = ip.run_cell_magic("generate", VICTIM_LINE, VICTIM_BODY)
    w.finish(ref)
    w.ref = [list(r.tokens) for r in ref.rows]
    assert [len(t) for t in w.ref] == [VICTIM_TOKENS] * 2
    try:
        yield w
    finally:
        loop.run_until_complete(magics.shutdown())
        magics.unload_ipython_extension(ip)
        magics._S.config = None
        ip.config.pop("MLXNB", None)
        for k in VARS:
            ip.user_ns.pop(k, None)
        loop.close()


# -- %%generate: the table ------------------------------------------------------------------
# (line, body, a fragment the one-line message must contain)
BAD_CELLS = {
    "unknown options": [
        ("--frob", "hi", "unrecognized arguments: --frob"),
        ("--max_tokens 5", "hi", "unrecognized arguments: --max_tokens 5"),
        ("-x 1", "hi", "unrecognized arguments"),
        ("--quiet stray words", "hi", "unrecognized arguments: stray words"),
        ("--", "hi", "unrecognized arguments: --"),
        ("--s 1", "hi", "ambiguous option: --s"),
        ("--quiet=yes", "hi", "ignored explicit argument 'yes'"),
        ("-o", "hi", "expected one argument"),
        ("--system", "hi", "expected one argument"),
        ("--temp 0.5 'unclosed", "hi", "close your quotes"),
    ],
    "duplicate options": [
        ("--n 2 --n 3", "hi", "-n/--n given more than once"),
        ("-n 2 --n 2", "hi", "-n/--n given more than once"),
        ("--system a --system b", "hi", "--system given more than once"),
        ("-o a --out b", "hi", "-o/--out given more than once"),
        ("--raw --chat", "hi", "--chat/--raw given more than once"),
        ("--quiet --quiet", "hi", "--quiet given more than once"),
        ("--model tiny --model tiny", "hi", "--model given more than once"),
        ("--max-tokens 5 --max-tokens 6", "hi", "--max-tokens given more than once"),
        ("--temp 0.1 --temperature 0.2", "hi", "--temp/--temperature given more than once"),
        ("--temp=0.1 --temp=0.1", "hi", "--temp/--temperature given more than once"),
        ("--seed 1 --seed 2", "hi", "--seed given more than once"),
        ("--logprobs 1 --logprobs 2", "hi", "--logprobs given more than once"),
    ],
    "non-numeric values": [
        ("--max-tokens ten", "hi", "--max-tokens: 'ten' is not an integer"),
        ("--max-tokens 2.0", "hi", "--max-tokens: '2.0' is not an integer"),
        ("--max-tokens 1e2", "hi", "--max-tokens: '1e2' is not an integer"),
        ("--max-tokens=", "hi", "--max-tokens: '' is not an integer"),
        ("--temp 0,7x", "hi", "--temp: '7x' is not a number"),
        ("--temp 0x1", "hi", "--temp: '0x1' is not a number"),
        ("--temp ,", "hi", "--temp: '' is not a number"),
        ("--top-p []", "hi", "--top-p: '' is not a number"),
        ("--top-k one", "hi", "--top-k: 'one' is not an integer"),
        ("--seed 1.5", "hi", "--seed: '1.5' is not an integer"),
        ("--n 1.0", "hi", "--n: '1.0' is not an integer"),
        ("--logprobs many", "hi", "--logprobs: 'many' is not an integer"),
        ("--temp nan", "hi", "--temp must be a finite number"),
        ("--temp -inf", "hi", "expected at least one argument"),  # argparse: an option?
        ("--min-p NaN", "hi", "--min-p must be a finite number"),
        ("--repetition-penalty inf", "hi", "--repetition-penalty must be a finite number"),
        ("--temp 1e999", "hi", "--temp must be a finite number"),
    ],
    "out-of-range values": [
        ("--max-tokens -1", "hi", "--max-tokens must be a positive integer"),
        ("--temp -0.5", "hi", "--temp must be a number >= 0"),
        ("--top-p 0", "hi", "--top-p must be a number in (0, 1]"),
        ("--top-p 1.0001", "hi", "--top-p must be a number in (0, 1]"),
        ("--min-p 1", "hi", "--min-p must be a number in [0, 1)"),
        ("--min-p -0.1", "hi", "--min-p must be a number in [0, 1)"),
        ("--top-k -1", "hi", "--top-k must be an integer >= 0"),
        ("--repetition-penalty 0", "hi", "--repetition-penalty must be a number > 0"),
        ("--seed -1", "hi", "--seed must be an integer in [0, 2**32)"),
        ("--seed 4294967296", "hi", "--seed must be an integer in [0, 2**32)"),
        ("--n -2", "hi", "--n must be a positive integer"),
        ("--n 1,2", "hi", "--n takes one value, not a list"),
        ("--logprobs 21", "hi", "--logprobs must be an integer in [0, 20]"),
        ("--logprobs -1", "hi", "--logprobs must be an integer in [0, 20]"),
        ("--n 5000", "hi", "5000 rows, more than the limit of 1024"),
        ("--temp 0.1,0.2,0.3 --n 400", "a\nb", "2400 rows, more than the limit"),
        ("--max-tokens 4096", "hi", "exceeds the model's context of 4096"),
        ("--max-tokens 99999999999999999999999", "hi", "exceeds the model's context"),
    ],
    "empty and whitespace bodies": [
        ("", "   ", "the cell has no prompts"),
        ("", "\t\n\t\n", "the cell has no prompts"),
        ("", "\r\n\r\n", "the cell has no prompts"),
        ("", "\u00a0\u2003\u3000", "the cell has no prompts"),  # NBSP, em, ideographic
        ("", "\u2028\u2029\x0b\x0c", "the cell has no prompts"),  # line/para separators
        ("", "---", "the cell has no prompts"),
        ("", "---\n \n---\n\t", "the cell has no prompts"),
        ("", "{blank}", "is empty after filling in variables"),
        ("", "{nothing}", "is an empty list"),
    ],
    "long prompts": [
        # refused before tokenizing: more characters than the context holds in any
        # tokenization
        ("", "a" * 100_000, "100,000 characters, more than the model's context"),
        ("--raw", "日本" * 50_000, "more than the model's context"),  # 300 kB of UTF-8
        ("", "🙂" * 100_000, "more than the model's context"),
        ("", "x" * 5000, "exceeds the model's context of 4096"),  # just over the context
        ("--max-tokens 100", "y" * 4000, "prompt (4019 tokens) + max_tokens (100)"),
        ("", "ok\n" + "z" * 100_000, "row 2 'zzzz"),  # the second row of a grid
        ("", "{big}", "more than the model's context"),
        ("", "a\n" * 50_000, "50000 rows, more than the limit of 1024"),  # 100k chars
        ("", "{many}", "2000 rows, more than the limit of 1024"),
    ],
    "invalid surrogates": [
        ("", "\ud800", "invalid unicode (lone surrogates)"),
        ("", "ok \udfff", "invalid unicode"),
        ("", "a\udc80b", "invalid unicode"),  # surrogateescape range
        ("", "\ud83d\ude42", "invalid unicode"),  # a pair as two code points
        ("", "fine\nbad \ud800", "row 2 'bad"),  # only the second row is bad
        ("", "{sur}", "invalid unicode"),
        ("", "{sur_pair}", "invalid unicode"),
        ("", "{some_bad}", "row 2"),  # one bad element of a list variable
        ("--system '\ud800'", "hi", "invalid unicode"),
        ("-o x\udcff", "hi", "is not a valid variable name"),
        ("--model '\ud800'", "hi", "run `%mlxnb load"),
        ("'\udcff'", "hi", "unrecognized arguments"),  # argparse echoes the raw text
        ("", "{\ud800}", "is not a variable name"),
        ("", "{word.\ud800}", "could not evaluate"),
        ("", "{word:\ud800}", "could not format {word}"),
    ],
    "interpolation": [
        ("", "{undefined_var}", "{undefined_var} is not defined"),
        ("", "about {nope.attr}", "{nope} is not defined"),
        ("", "about {nope[0]}", "{nope} is not defined"),
        ("", "{ word }", "is not a variable name"),
        ("", "{word!z}", "Unknown conversion specifier z"),
        ("", "{word:d}", "could not format {word}"),
        ("", "{word.nope}", "AttributeError"),
        ("", "{emojis[9]}", "IndexError"),
        ("", "{d[missing]}", "KeyError"),
        ("", "{obj[0]}", "TypeError"),
        ("", "{boom}", "could not format {boom}: no format for you"),
        ("", "{", "literal braces"),
        ("", "}", "literal braces"),
        ("", "{word:{word}}", "nested braces"),
        ("", "{0}", "is not a variable name"),
        ("", "{}", "is not a variable name"),
    ],
    "model option": [
        ("--model no/such-model", "hi", "run `%mlxnb load no/such-model` first"),
        ("--model ' '", "hi", "--model needs a model's name"),
        ("--model ''", "hi", "--model needs a model's name"),
    ],
}
BAD_CELL_CASES = [(cat, *c) for cat, cases in BAD_CELLS.items() for c in cases]

BAD_LINES = [  # %mlxnb
    ("bogus", "unknown subcommand 'bogus'"),
    ("__init__", "unknown subcommand '__init__'"),
    ("STATUS", "unknown subcommand 'STATUS'"),
    ("status --verbose", "%mlxnb status takes no arguments"),
    ("unload now", "%mlxnb unload takes no arguments"),
    ("wait 5", "%mlxnb wait takes no arguments"),
    ("dashboard big", "%mlxnb dashboard takes no arguments"),
    ("load --max-batch 0", "--max-batch must be a positive integer"),
    ("load --max-batch x", "--max-batch: 'x' is not an integer"),
    ("load --max-batch 1,2", "--max-batch takes one value"),
    ("load --prefill-chunk -5", "--prefill-chunk must be a positive integer"),
    ("load --prefill-chunk fast", "'fast' is not an integer; write e.g. --prefill-chunk 1 (or --prefill-chunk auto)"),
    ("load --frob", "unrecognized arguments: --frob"),
    ("load a b", "unrecognized arguments: b"),
    ("load --max-batch 2 --max-batch 3", "--max-batch given more than once"),
    ("load 'tiny", "close your quotes"),
    ("load tiny --kv-budget", "expected one argument"),
    ("load other", "still running or queued"),  # rows run: no model switch
    ("stop nothing_here", "'nothing_here' is not a Run or Row variable"),
    ("stop word", "'word' is not a Run or Row variable"),
    ("stop task", "'task' is not a Run or Row variable"),
    ("stop \ud800", "is not a Run or Row variable"),
    ("load 'bad\ud800id'", "still running or queued"),
    ("\ud800", "unknown subcommand"),
    ("load\ttiny --max-batch 0", "--max-batch must be a positive integer"),
]


def check_whole_cell(w, capsys, code: str, fragment: str) -> None:
    """Through `run_cell` (as a kernel runs it): one line on stderr, no traceback."""
    capsys.readouterr()
    res = w.ip.run_cell(code)
    assert isinstance(res.error_in_exec, UsageError), res.error_in_exec
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: "), err[:1000]
    assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("category", list(BAD_CELLS))
def test_bad_cells_are_one_usage_error_and_disturb_nothing(world, capsys, category):
    w = world
    cases = BAD_CELLS[category]
    with w.victim():
        for line, body, fragment in cases:
            msg = w.attempt("cell", line, body)
            assert isinstance(msg, str), f"{line!r} {body[:40]!r} returned {msg!r}"
            assert fragment in msg, (line, body[:40], msg)
            if "{" not in line and "$" not in line:  # run_cell expands those in the line
                check_whole_cell(w, capsys, f"%%generate {line}\n{body}", fragment)
            w.nudge()  # the victim decodes between the bad cells


def test_bad_mlxnb_lines_are_one_usage_error(world, capsys):
    w = world
    with w.victim():
        for line, fragment in BAD_LINES:
            msg = w.attempt("line", line)
            assert isinstance(msg, str), f"%mlxnb {line!r} returned {msg!r}"
            assert fragment in msg, (line, msg)
            check_whole_cell(w, capsys, f"%mlxnb {line}", fragment)
            w.nudge()
        assert magics.get_engine() is w.eng


# -- odd but valid input generates ----------------------------------------------------------
GOOD_CELLS = [
    ("--raw", VARS["mixed"], 1),
    ("", "{mixed} and {word}", 1),
    ("", "pick one of {emojis}", 3),  # a list variable: one row per element
    ("", "{emojis!s}", 1),
    ("", "NUL \x00 byte", 1),
    ("", "zero\u200bwidth\u200d joiner \ufeff BOM \u202e RTL override", 1),
    ("--raw", "\u200b", 1),  # not whitespace to Python: one invisible prompt
    ("--system 'Réponds en 日本語 🙂' --stop '🙂'", "hi", 1),
    ("--stop '\ud800'", "a stop string that can never match", 1),
    ("--temp 0.5, --seed 7", "trailing comma in a sweep", 1),
    ("--max-tokens ١٢", "Arabic-Indic digits are digits", 1),
    ("--temp=0.2,0.7 --seed=1", "x", 2),
    ("", "a {{literal}} brace", 1),
    ("", "\n\n  padded  \n\n", 1),
    ("", "x" * 4000, 1),  # long but fits the context with the default max_tokens
]


def test_odd_but_valid_cells_generate(world):
    w = world
    runs = []
    for line, body, n in GOOD_CELLS:
        run = w.attempt("cell", f"--quiet --max-tokens 3 {line}"
                        if "--max-tokens" not in line else f"--quiet {line}", body)
        assert isinstance(run, Run), (line, body[:40], run)
        assert len(run) == n, (line, body[:40], len(run))
        runs.append(run)
    for run in runs:
        w.finish(run)
        assert all(r.finish_reason == "length" and r.ntok >= 1 for r in run.rows), \
            run.records()
    assert runs[0].rows[0].prompt == VARS["mixed"]
    assert [r.prompt for r in runs[2].rows] == [f"pick one of {e}" for e in VARS["emojis"]]
    assert runs[10].rows[0].ntok == 12


# -- models ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_model_dirs(tmp_path_factory):
    """Broken copies of a good tiny model directory, by what is wrong with them."""
    from mlxnb.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("bad_models")
    good = save_tiny_model(root / "good")

    def variant(name, drop=(), files=None, config=None):
        d = root / name
        shutil.copytree(good, d)
        for f in drop:
            os.remove(d / f)
        if config is not None:
            c = json.loads((d / "config.json").read_text())
            config(c)
            (d / "config.json").write_text(json.dumps(c))
        for f, data in (files or {}).items():
            (d / f).write_bytes(data)
        return d

    (root / "empty").mkdir()
    (root / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    tok_files = [f for f in os.listdir(good) if f.startswith("tokenizer")]
    return {
        "an empty directory": (root / "empty", "there is no config.json"),
        "no weights": (variant("noweights", drop=["model.safetensors"]),
                       "no *.safetensors weights"),
        "config.json not JSON": (variant("badjson", files={"config.json": b"{not json"}),
                                 "JSONDecodeError"),
        "config.json empty": (variant("emptyjson", files={"config.json": b""}),
                              "JSONDecodeError"),
        "config.json a list": (variant("listjson", files={"config.json": b"[1, 2]"}),
                               "could not load"),
        "no model_type": (variant("nomt", config=lambda c: c.pop("model_type")),
                          "model_type"),
        "unknown model_type": (variant("frob", config=lambda c: c.update(
            model_type="frobnet")), "Model type frobnet not supported"),
        "weights of the wrong shape": (variant("shape", config=lambda c: c.update(
            hidden_size=128)), "Expected shape"),
        "zero attention heads": (variant("heads", config=lambda c: c.update(
            num_attention_heads=0)), "could not load"),
        "garbage weights": (variant("garbage", files={
            "model.safetensors": b"\x00garbage" * 64}), "could not load"),
        "no tokenizer": (variant("notok", drop=tok_files), "could not load"),
        "a GGUF file": (root / "model.gguf", "GGUF files are not loaded directly"),
        "a missing path": ("./no/such/model/dir", "no such directory"),
        "an unknown hub id": ("no-such-org/no-such-model", "HF_HUB_OFFLINE is set"),
        "an invalid hub id": ("bad\ud800id", "not a valid hub id"),
    }


def test_bad_models_are_one_usage_error(world, bad_model_dirs, monkeypatch, capsys):
    w = world
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network probe: fail fast
    # 1. `%mlxnb load BAD` with an idle engine: refused, the engine is kept
    for what, (path, fragment) in bad_model_dirs.items():
        msg = w.attempt("line", f"load {shlex.quote(str(path))}")
        assert isinstance(msg, str), (what, msg)
        assert "could not load" in msg and fragment in msg, (what, msg)
        assert magics.get_engine() is w.eng, what
    # ... and the kept engine still generates what it did before
    with w.victim():
        # 2. the same with rows running: refused before anything loads
        for what, (path, _) in bad_model_dirs.items():
            msg = w.attempt("line", f"load {shlex.quote(str(path))}")
            assert "still running or queued" in msg, (what, msg)
            w.nudge()
        # 3. on a kernel without an engine yet, `%%generate --model BAD` (lazy load)
        monkeypatch.setattr(magics._S, "engine", None)
        for what, (path, fragment) in bad_model_dirs.items():
            msg = w.attempt("cell", f"--quiet --model {shlex.quote(str(path))}", "hi")
            assert isinstance(msg, str) and fragment in msg, (what, msg)
            assert magics._S.engine is None, what
        monkeypatch.setattr(magics._S, "engine", w.eng)
        capsys.readouterr()


# -- hypothesis ----------------------------------------------------------------------------
FLAGS = ["--max-tokens", "--temp", "--temperature", "--top-p", "--top-k", "--min-p",
         "--repetition-penalty", "--seed", "-n", "--n", "--stop", "--system", "--chat",
         "--raw", "--logprobs", "--model", "-o", "--out", "--quiet", "--frob", "-x", "-",
         "--", "--max", "--s", "--temp=", "-o="]
VALUES = ["0", "1", "3", "-1", "0.5", "1e3", "nan", "inf", "", ",", "1,2", "0.2,0.7",
          "[0.2,", "0.7]", "99999999999999999999", "tiny", "x", "run", "{word}", "$word",
          "'", '"', "\\n", "\ud800", "🙂", "日本", "None", "0x1"]
# every code point (lone surrogates too), with the troublesome ones made likely
CHARS = st.one_of(st.characters(exclude_categories=()),
                  st.sampled_from(["\ud800", "\udcff", "\n", "\r", " ", "{", "}", "'",
                                   '"', "\\", "\x00", "🙂", "\u200b", "-"]))
# (st.text would drop the surrogates: join lists of characters instead)
TEXT = st.lists(CHARS, max_size=8).map("".join)
token = st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES),
                  st.integers(-10**25, 10**25).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(repr), TEXT)
option_line = st.lists(st.tuples(token, st.booleans()), max_size=7).map(
    lambda ts: " ".join(shlex.quote(t) if q else t for t, q in ts))
body_piece = st.one_of(
    TEXT,
    st.sampled_from(["{", "}", "{{", "}}", "{word}", "{emojis}", "{nope}", "{sur}",
                     "{blank}", "{nothing}", "{many}", "{word!r}", "{d[k]}", "---",
                     "\n", "\n---\n", " ", "\t", "🙂", "\ud800", "x" * 5000]))
cell_body = st.lists(body_piece, max_size=10).map("".join)

# Slots where a user's own text ends up (and may be echoed in an error message).
LINE_SLOTS = ["{}", "--model {}", "--system {}", "--stop {}", "-o {}", "--temp {}",
              "--seed {}", "--n {}", "--logprobs {}", "--quiet {}", "--temp 0.5,{}"]
BODY_SLOTS = ["{}", "{{{}}}", "{{word.{}}}", "{{word:{}}}", "{{word!{}}}", "{{d[{}]}}",
              "a\n{}\n---\n{}"]

mlxnb_line = st.tuples(
    st.sampled_from(["status", "stop", "dashboard", "wait", "help", "", "load", "Stop",
                     "bogus", "unload"]),
    option_line).filter(  # not the commands that would legitimately end the victim
        lambda sr: not (sr[0] in ("stop", "unload") and sr[1].strip() in ("", "all"))
    ).map(lambda sr: f"{sr[0]} {sr[1]}".strip())

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def outcome_ok(w, got, what):
    """A refused cell gave its message (checked in attempt); a Run is cancelled at once
    (the loop is not running, so its rows never reach the batch)."""
    if isinstance(got, str):
        return
    assert isinstance(got, Run), f"{what} returned {type(got).__name__}: {got!r}"
    assert len(got) >= 1 and all(r.finish_reason is None for r in got.rows), got
    got.cancel()
    assert all(r.finish_reason == "cancelled" for r in got.rows), got.records()


@pytest.fixture
def quiet_runs(world):
    world.ip.run_line_magic("config", "MLXNB.quiet = True")  # no widget per fuzzed Run
    yield
    world.ip.run_line_magic("config", "MLXNB.quiet = False")


def test_fuzz_generate_is_usage_error_or_run(world, quiet_runs):
    w = world
    with w.victim():
        @FUZZ
        @given(line=option_line, body=cell_body)
        def fuzz(line, body):
            outcome_ok(w, w.attempt("cell", line, body), (line, body))
            w.nudge()

        fuzz()


def test_fuzz_user_text_in_every_slot(world, quiet_runs):
    w = world
    with w.victim():
        @FUZZ
        @given(slot=st.sampled_from([("line", s) for s in LINE_SLOTS] +
                                    [("body", s) for s in BODY_SLOTS]),
               text=st.lists(CHARS, min_size=1, max_size=10).map("".join))
        def fuzz(slot, text):
            where, template = slot
            if where == "line":
                line, body = template.format(shlex.quote(text)), "hi"
            else:
                line, body = "", template.format(text, text)
            outcome_ok(w, w.attempt("cell", line, body), (line, body))
            w.nudge()

        fuzz()


def test_fuzz_mlxnb_line_is_usage_error_or_nothing(world, capsys):
    w = world
    with w.victim():
        @settings(FUZZ, max_examples=60)
        @given(line=mlxnb_line)
        def fuzz(line):
            got = w.attempt("line", line)
            assert got is None or isinstance(got, str) or type(got).__name__ == \
                "GenerationWidget", (line, got)
            if type(got).__name__ == "GenerationWidget":
                got.close()
            assert magics.get_engine() is w.eng, f"%mlxnb {line!r} dropped the engine"
            w.nudge()

        fuzz()
    capsys.readouterr()
