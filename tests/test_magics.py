"""The notebook surface on a real in-process IPython shell and the tiny model."""

import asyncio
import sys
import types

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from mlxnb.notebook import magics
from mlxnb.core.engine import Engine
from mlxnb.core.run import Run

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    magics.load_ipython_extension(shell)
    shell.user_ns.pop("run", None)
    yield shell
    magics.unload_ipython_extension(shell)
    magics._S.config = None  # %config values must not leak between tests
    shell.config.pop("MLXNB", None)  # (%config also merges them into the shell's config)
    assert magics._S.engine is None, "a test left its engine open"


@pytest.fixture
def models(monkeypatch, tiny):
    """`Engine("tiny")` (or "tiny2", another name for it) loads the tiny model; any other
    name fails like a bad hub id."""
    calls = []

    def load_model(name):
        calls.append(name)
        if name in ("tiny", "tiny2"):
            return tiny
        raise FileNotFoundError(f"No such model: {name}\n(long details)")

    monkeypatch.setitem(sys.modules, "mlxnb.models.loading",
                        types.SimpleNamespace(load_model=load_model))
    return calls


@pytest.fixture
def arun_shut(arun):
    """arun(), then close whatever engine the test made, on the same loop."""

    def run(fn, *args, timeout=60):
        async def main():
            try:
                return await fn(*args)
            finally:
                await magics.shutdown()

        return arun(main, timeout=timeout)

    return run


def attach(tiny, **kw):
    kw.setdefault("kv_budget", None)
    return magics.use(Engine(tiny, loop=asyncio.get_running_loop(), **kw), name="tiny")


def gen(ip, line, body):
    return ip.run_cell_magic("generate", line, body)


async def cell(ip, code):
    """Run a whole cell as ipykernel does (displayhook, `_`, error display)."""
    return await ip.run_cell_async(code, transformed_cell=ip.transform_cell(code))


# -- loading -----------------------------------------------------------------------------
def test_load_is_cheap_and_registers_magics_and_config(ip):
    assert magics.get_engine() is None
    assert "generate" in ip.magics_manager.magics["cell"]
    assert "mlxnb" in ip.magics_manager.magics["line"]
    assert sum(type(c).__name__ == "MLXNB" for c in ip.configurables) == 1
    ip.run_line_magic("config", "MLXNB.max_tokens = 7")
    assert magics._S.config.max_tokens == 7


def test_extension_manager_load_reload_unload(ip, tiny, arun_shut):
    async def main():
        name = "mlxnb" if hasattr(sys.modules["mlxnb"], "load_ipython_extension") \
            else "mlxnb.notebook.magics"
        em = ip.extension_manager
        em.load_extension(name)
        eng = attach(tiny)
        ip.run_line_magic("config", "MLXNB.max_tokens = 3")
        for _ in range(2):
            em.reload_extension(name)
        assert magics.get_engine() is eng  # never a second engine or scheduler
        assert sum(type(c).__name__ == "MLXNB" for c in ip.configurables) == 1
        assert magics._S.config.max_tokens == 3  # %config survives a reload
        run = gen(ip, "--quiet", "hello")
        assert run.rows[0] in eng.rows and run.rows[0].params.max_tokens == 3
        em.unload_extension(name)
        assert "generate" not in ip.magics_manager.magics["cell"]
        assert magics.get_engine() is eng and not run.rows[0].done  # rows keep going
        await run
        magics.load_ipython_extension(ip)  # the fixture's teardown unloads

    arun_shut(main)


# -- %%generate: submitting ------------------------------------------------------------------
def test_generate_returns_run_binds_o_and_shows_the_widget(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny)
        res = await cell(ip, "%%generate --max-tokens 5 -o run\nhello\n\nworld\n")
        assert res.success, res.error_in_exec
        run = ip.user_ns["run"]
        assert isinstance(run, Run) and res.result is run and ip.user_ns["_"] is run
        assert run.name == "run" and [r.prompt for r in run.rows] == ["hello", "world"]
        assert run.widget is not None and run.widget in magics._S.widgets
        ip.kernel = types.SimpleNamespace()  # as in a notebook: a widget and its results
        try:
            with capture_output() as shown:
                assert ip.display_formatter.format(run) == ({}, {})
        finally:
            del ip.kernel
        assert [WIDGET_MIME in o.data for o in shown.outputs] == [True, False]
        assert "mlxnb" in shown.outputs[0].data["text/plain"]
        assert "hello" in shown.outputs[1].data["text/html"]
        with capture_output() as shown:  # terminal IPython: one text snapshot
            ip.display_formatter.format(run)
        assert [list(o.data) for o in shown.outputs] == [["text/plain"]]
        results = await run
        assert [r.finish_reason for r in results] != [] and run.done
        assert all(1 <= len(r.tokens) <= 5 for r in results)
        assert run.meta["model"] == eng.model_name
        quiet = gen(ip, "--quiet --max-tokens 2", "x")
        assert quiet.widget is None
        with capture_output() as shown:
            ip.display_formatter.format(quiet)
        [data] = [o.data for o in shown.outputs]
        assert WIDGET_MIME not in data and data["text/plain"].startswith("<Run")
        await quiet

    arun_shut(main)


def test_sweep_grid_is_one_batch_with_tag_columns(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny)
        ip.user_ns["who"] = ["kid", "adult"]
        steps0 = len(eng.steps)
        run = gen(ip, "--max-tokens 3 --temp 0,0.7 --seed 1,2 --n 2 --raw --quiet",
                  "Explain {who}\nName {{three}} primes")
        assert len(run) == 3 * 2 * 2 * 2
        assert len(eng.steps) == steps0 and eng.queued + eng.running == len(run)
        assert all(r.prompt_tokens > 0 for r in run.rows)
        seeds = {(r.prompt, r.params.temperature, r.params.seed) for r in run.rows}
        assert len(seeds) == len(run)
        await run
        df = run.to_pandas()
        for col in ("temp", "seed", "sample", "prompt_index", "who"):
            assert col in df.columns
        assert set(df.prompt) == {"Explain kid", "Explain adult", "Name {three} primes"}
        assert df.groupby("temp").size().to_dict() == {0.0: 12, 0.7: 12}
        assert set(df["sample"]) == {0, 1}

    arun_shut(main)


def test_n_samples_of_greedy_rows_say_they_repeat(ip, tiny, arun_shut, capsys):
    async def main():
        attach(tiny)
        notes = []
        for line in ("--n 3", "--n 3 --temp 0,0", "--n 3 --temp 0,0.7", "--n 1",
                     "--n 2 --temp 0.5"):
            run = gen(ip, f"--max-tokens 2 --raw --quiet {line}", "a")
            await run
            notes.append(capsys.readouterr().err.strip())
        return notes

    notes = arun_shut(main)
    assert notes[0] == notes[1] == ("mlxnb: --n 3 of greedy rows (temperature 0) gives "
                                    "the same text 3 times; add e.g. --temp 0.7 for "
                                    "different samples")
    assert notes[2:] == ["", "", ""]


@pytest.mark.parametrize("where", ["submitting", "widget"])
def test_an_interrupted_generate_cell_stops_the_rows_it_submitted(ip, tiny, arun_shut,
                                                                   monkeypatch, where):
    """A cell interrupted before it returns its Run leaves no row without a handle."""
    from mlxnb.notebook import widget

    async def main():
        eng = attach(tiny)
        if where == "widget":
            def interrupted(*a, **kw):
                raise KeyboardInterrupt
            monkeypatch.setattr(widget, "GenerationWidget", interrupted)
        else:
            submit, calls = eng.submit_prepared, []

            def third_interrupted(*a, **kw):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyboardInterrupt
                return submit(*a, **kw)
            monkeypatch.setattr(eng, "submit_prepared", third_interrupted)
        with pytest.raises(KeyboardInterrupt):
            gen(ip, "--max-tokens 500 --raw -o run", "a\nb\nc\nd")
        await asyncio.wait_for(magics.wait(), 10)
        return eng.submitted, dict(eng.finished), ip.user_ns.get("run")

    submitted, finished, bound = arun_shut(main)
    assert bound is None and submitted == (2 if where == "submitting" else 4)
    assert finished["cancelled"] == submitted, finished


def test_config_defaults_and_options_override(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        for stmt in ("max_tokens = 4", "temperature = 0.5", "top_k = 3", "seed = 11",
                     "chat = False", "quiet = True", "stop = ['zz']", "logprobs = 2"):
            ip.run_line_magic("config", f"MLXNB.{stmt}")
        run = gen(ip, "", "a")
        p = run.rows[0].params
        assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.logprobs) == \
               (4, 0.5, 3, 11, ("zz",), 2)
        assert run.widget is None and run.meta["chat"] is False
        run_b = gen(ip, "--max-tokens 2 --temp 0 --stop '\\n' --chat --logprobs 0", "a")
        p = run_b.rows[0].params
        assert (p.max_tokens, p.temperature, p.stop, p.logprobs) == (2, 0.0, ("\n",), 0)
        assert run_b.meta["chat"] is True
        await magics.wait()
        assert run.done and run_b.done

    arun_shut(main)


def test_a_config_default_out_of_range_says_it_is_the_default(ip, tiny, arun_shut):
    from IPython.core.error import UsageError

    async def main():
        attach(tiny)
        ip.run_line_magic("config", "MLXNB.seed = -3")  # refused by the setting itself
        assert magics._S.config.seed is None
        errs = []
        for stmt, line in (("top_p = 0", ""), ("min_p = 1.0", "--top-p 0.9"),
                           ("min_p = 0.0", "--top-p 0.9")):
            ip.run_line_magic("config", f"MLXNB.{stmt}")
            try:
                await gen(ip, f"--quiet --max-tokens 2 {line}", "a")
                errs.append(None)
            except UsageError as e:
                errs.append(str(e))
        ip.run_line_magic("config", "MLXNB.top_p = 1.0")
        ip.run_line_magic("config", "MLXNB.stop = ['']")
        for line in ("", "--stop ''", "--stop x"):
            if line == "--stop x":  # the cell's own stop wins over a bad default
                await gen(ip, f"--quiet --max-tokens 2 {line}", "a")
                continue
            with pytest.raises(UsageError) as e:
                gen(ip, f"--quiet --max-tokens 2 {line}", "a")
            errs.append(str(e.value))
        return errs

    errs = arun_shut(main)
    assert errs[3] == ("the default %config MLXNB.stop is not valid: --stop needs a "
                       "non-empty string; write e.g. --stop '\\n\\n'")
    assert errs[4].startswith("--stop needs")  # the cell's own
    assert errs[0].startswith("the default %config MLXNB.top_p is not valid: --top-p must "
                              "be a number in (0, 1]")
    assert errs[1].startswith("the default %config MLXNB.min_p is not valid")
    assert errs[2] is None  # an option given in the cell wins over its default


def test_load_timeout_is_a_config_setting(ip, monkeypatch, caplog):
    import mlxnb.core.engine

    seen = {}

    def fake_engine(spec, **kw):
        seen.update(kw)
        raise ValueError("no model here")

    monkeypatch.setattr(mlxnb.core.engine, "Engine", fake_engine)
    ip.run_line_magic("load_ext", "mlxnb")
    for value, want in (("30", 30.0), ("None", None)):
        ip.run_line_magic("config", f"MLXNB.load_timeout = {value}")
        with pytest.raises(UsageError, match="no model here"):
            ip.run_line_magic("mlxnb", "load some/model")
        assert seen["load_timeout"] == want
    ip.run_line_magic("config", "MLXNB.load_timeout = 0")  # %config logs the refusal
    assert "load_timeout must be a positive number" in caplog.text
    assert magics._S.config.load_timeout is None  # the bad value was not taken


def test_sweep_from_a_variable_in_the_options_line(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        ip.user_ns.update(temps=[0.2, 0.9], k=3)
        res = await cell(ip, "%%generate --quiet --max-tokens 2 --temp {temps} --top-k $k\nhi")
        assert res.success, res.error_in_exec
        run = res.result
        assert [r.params.temperature for r in run.rows] == [0.2, 0.9]
        assert {r.params.top_k for r in run.rows} == {3}
        await run

    arun_shut(main)


def test_blocks_and_system_prompt(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        ip.user_ns["lang"] = "French"
        run = gen(ip, "--quiet --max-tokens 2 --system 'Be terse.\\nAlways.'",
                  "Translate to {lang}:\n\n  the sea\n---\nSecond prompt")
        assert [r.prompt for r in run.rows] == ["Translate to French:\n\n  the sea",
                                                "Second prompt"]
        assert run.meta["system"] == "Be terse.\nAlways."
        await run

    arun_shut(main)


def test_lazy_load_on_first_generate_and_model_option(ip, models, arun_shut, capsys):
    async def main():
        ip.run_line_magic("config", "MLXNB.model = 'tiny'")
        ip.run_line_magic("config", "MLXNB.kv_budget = None")
        assert magics.get_engine() is None
        run = gen(ip, "--quiet --max-tokens 2", "hi")
        eng = magics.get_engine()
        assert eng is not None and models == ["tiny"] and run.rows[0] in eng.rows
        assert eng.loop is asyncio.get_running_loop()
        gen(ip, "--quiet --max-tokens 2 --model tiny", "again")  # same model: fine
        with pytest.raises(UsageError, match="run `%mlxnb load other` first"):
            gen(ip, "--quiet --model other", "hi")
        await magics.wait()
        assert models == ["tiny"]

    arun_shut(main)
    assert "loading model 'tiny'" not in capsys.readouterr().out  # --quiet


def test_mlxnb_load_status_stop_unload(ip, models, arun_shut, capsys):
    async def main():
        ip.run_line_magic("mlxnb", "status")
        assert "no model loaded" in capsys.readouterr().out
        ip.run_line_magic("mlxnb", "load tiny --kv-budget none --max-batch 4")
        eng = magics.get_engine()
        assert eng.max_batch == 4 and eng.kv_budget is None
        assert "loaded" in capsys.readouterr().out
        ip.run_line_magic("mlxnb", "load tiny --max-batch 4 --kv-budget none")
        assert "already loaded" in capsys.readouterr().out and magics.get_engine() is eng
        run = gen(ip, "--quiet --max-tokens 200 -o big", "a\nb")
        with pytest.raises(UsageError, match="still running or queued"):
            ip.run_line_magic("mlxnb", "load tiny --max-batch 8")
        ip.run_line_magic("mlxnb", "status")
        out = capsys.readouterr().out
        assert "model tiny" in out and "2 rows submitted" in out
        ip.run_line_magic("mlxnb", "stop big")
        assert "stopping 2 rows" in capsys.readouterr().out
        await run
        assert {r.finish_reason for r in run.rows} <= {"cancelled", "stop"}
        run_b = gen(ip, "--quiet --max-tokens 200", "c")
        ip.run_line_magic("mlxnb", "stop")
        await run_b
        assert run_b.rows[0].finish_reason in ("cancelled", "stop")
        ip.run_line_magic("mlxnb", "load tiny --max-batch 8")  # idle: replaced
        assert magics.get_engine() is not eng and magics.get_engine().max_batch == 8
        assert magics.get_engine().prefill_chunk is None  # auto by default
        ip.run_line_magic("mlxnb", "load tiny --prefill-chunk 64")
        assert magics.get_engine().prefill_chunk == 64
        ip.run_line_magic("mlxnb", "load tiny --prefill-chunk AUTO")
        assert magics.get_engine().prefill_chunk is None
        ip.run_line_magic("mlxnb", "wait")
        assert "await mlxnb.wait()" in capsys.readouterr().out
        ip.run_line_magic("mlxnb", "unload")
        assert magics.get_engine() is None
        ip.run_line_magic("mlxnb", "")
        assert "%mlxnb load [MODEL]" in capsys.readouterr().out

    arun_shut(main)


def test_dashboard(ip, tiny, arun_shut):
    async def main():
        with pytest.raises(UsageError, match="no model loaded"):
            ip.run_line_magic("mlxnb", "dashboard")
        attach(tiny)
        gen(ip, "--quiet --max-tokens 2", "a")
        w = ip.run_line_magic("mlxnb", "dashboard")
        assert w.dashboard and w in magics._S.widgets
        gen(ip, "--quiet --max-tokens 2", "b")
        await magics.wait()
        assert len(w._rows) == 2

    arun_shut(main)


# -- mistakes: one-line UsageError, nothing submitted, running rows untouched ---------------
BAD = [
    ("--frobnicate 3", "hi", "unrecognized arguments: --frobnicate"),
    ("--temp hot", "hi", "--temp: 'hot' is not a number"),
    ("--max-tokens 0", "hi", "--max-tokens must be a positive integer"),
    ("--max-tokens -3", "hi", "--max-tokens must be a positive integer"),
    ("--temp -1", "hi", "--temp must be a number >= 0"),
    ("--top-p 1.5", "hi", "--top-p must be a number in (0, 1]"),
    ("--n 0", "hi", "--n must be a positive integer"),
    ("--logprobs 50", "hi", "--logprobs must be an integer in [0, 20]"),
    ("--seed 1,x", "hi", "--seed: 'x' is not an integer"),
    ("--stop ''", "hi", "--stop needs a non-empty string"),
    ("--system 'unclosed", "hi", "close your quotes"),
    ("-o 1x", "hi", "not a valid variable name"),
    ("-o \uff52\uff55\uff4e", "hi", "Python reads this name as 'run'; write -o run"),
    ("-o \ufb01le", "hi", "Python reads this name as 'file'"),
    ("--num-draft 4", "hi", "--num-draft 4 sets how many tokens speculative decoding drafts, "
                            "and it is off here; add --speculate lookup"),
    ("--speculate off --num-draft 4", "hi", "it is off here"),
    ("--temp", "hi", "expected at least one argument"),
    ("", "", "the cell body is empty"),  # IPython's own message
    ("", "\n  \n", "the cell has no prompts"),
    ("", "  \n---\n", "the cell has no prompts"),
    ("", "ok\nabout {undefined_thing}", "{undefined_thing} is not defined"),
    ("", "a {", "literal braces"),
    ("--model elsewhere", "hi", "run `%mlxnb load elsewhere` first"),
    ("--max-tokens 8", "short\n" + "long " * 400 + "\nshort", "row 2 'long long"),
]


def test_mistakes_are_one_line_usage_errors_and_disturb_nothing(ip, tiny, arun_shut, capsys):
    async def main():
        eng = attach(tiny, kv_budget=None)
        eng.context_length = None  # rows that keep running through the whole test
        running = gen(ip, "--quiet --max-tokens 100000 --raw", "keep going\nme too")
        eng.context_length = 300  # so the long prompt can never fit
        await asyncio.sleep(0.05)
        n_rows = len(eng.rows)
        ip.user_ns.pop("_", None)
        for line, body, msg in BAD:
            with pytest.raises(UsageError) as e:
                gen(ip, line, body)
            text = str(e.value)
            assert msg in text, (line, body, text)
            assert "\n" not in text and len(text) < 400, text
            assert len(eng.rows) == n_rows, f"{line!r} submitted rows"
            assert not any(r.done for r in running.rows)
        # through a whole cell: the shell prints exactly one line, no traceback
        capsys.readouterr()
        res = await cell(ip, "%%generate --temp nope\nhi")
        assert isinstance(res.error_in_exec, UsageError)
        err = capsys.readouterr().err.strip()
        assert err.startswith("UsageError: --temp: 'nope' is not a number") and "\n" not in err
        assert "Traceback" not in err
        with pytest.raises(UsageError, match="unknown subcommand 'bogus'"):
            ip.run_line_magic("mlxnb", "bogus")
        with pytest.raises(UsageError, match="--max-batch"):
            ip.run_line_magic("mlxnb", "load tiny --max-batch 0")
        with pytest.raises(UsageError, match="not a Run or Row"):
            ip.run_line_magic("mlxnb", "stop nothing_here")
        assert not any(r.done for r in running.rows) and len(eng.rows) == n_rows
        running.cancel()
        await running

    arun_shut(main)


def test_kv_budget_too_small_rejects_whole_grid(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny, kv_budget="64KB")
        eng.context_length = None
        with pytest.raises(UsageError) as e:
            gen(ip, "--quiet --max-tokens 100000", "a\nb\nc")
        assert "kv_budget" in str(e.value) and str(e.value).startswith("row 1 'a'")
        assert eng.rows == []

    arun_shut(main)


def test_unknown_model_is_a_usage_error(ip, models, arun_shut):
    async def main():
        with pytest.raises(UsageError) as e:
            ip.run_line_magic("mlxnb", "load no/such-model")
        msg = str(e.value)
        assert "could not load model 'no/such-model'" in msg and "\n" not in msg
        assert magics.get_engine() is None
        with pytest.raises(UsageError, match="could not load model 'nope'"):
            gen(ip, "--model nope", "hi")
        with pytest.raises(UsageError) as e:  # the draft failed, not the model
            ip.run_line_magic("mlxnb", "load tiny --draft no/such-draft")
        assert str(e.value) == (
            "%mlxnb load: could not load draft model 'no/such-draft' (FileNotFoundError: "
            "No such model: no/such-draft (long details)); give an mlx-lm hub id, a local "
            "mlx-lm directory, or layers:N")

    arun_shut(main)


def test_too_many_rows(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny)
        ip.run_line_magic("config", "MLXNB.max_rows = 10")
        with pytest.raises(UsageError, match="12 rows, more than the limit of 10"):
            gen(ip, "--n 4 --temp 0.1,0.2,0.3", "a")
        assert eng.rows == []

    arun_shut(main)


# -- threads and waiting ----------------------------------------------------------------------
def test_submit_from_another_thread_like_a_subshell(ip, tiny, arun_shut):
    async def main():
        eng = attach(tiny)
        run = await asyncio.to_thread(gen, ip, "--max-tokens 3", "from a thread\ntwo")
        assert len(run) == 2 and run.widget is not None
        await run
        assert run.done and all(r.tokens for r in run.rows)
        assert len(eng.rows) == 2

    arun_shut(main)


def test_wait_returns_when_every_row_is_done(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        assert await magics.wait() is None
        a = gen(ip, "--max-tokens 6", "a\nb")
        b = gen(ip, "--max-tokens 3 --quiet", "c")
        await magics.wait()
        assert a.done and b.done
        # the widget's traits hold the final state (saved notebooks)
        assert all(r["state"] == "done" for r in a.widget.rows)

    arun_shut(main)


def test_a_load_applies_the_config_defaults_it_did_not_have(ip, models, arun_shut, capsys):
    async def main():
        ip.run_line_magic("mlxnb", "load tiny")
        eng = magics.get_engine()
        ip.run_line_magic("mlxnb", "load tiny")
        assert "already loaded" in capsys.readouterr().out and magics.get_engine() is eng
        ip.run_line_magic("config", "MLXNB.max_batch = 4")
        ip.run_line_magic("config", "MLXNB.kv_budget = '1GB'")
        ip.run_line_magic("mlxnb", "load tiny")
        out = capsys.readouterr().out
        assert "again for its new settings: max_batch=4, kv_budget='1GB'" in out, out
        new = magics.get_engine()
        assert new is not eng and (new.max_batch, new.kv_budget) == (4, 1 << 30)
        ip.run_line_magic("mlxnb", "load tiny")
        assert "already loaded" in capsys.readouterr().out and magics.get_engine() is new
        with pytest.raises(UsageError, match="as a size"):  # refused: nothing reloads
            ip.run_line_magic("mlxnb", "load tiny --kv-budget lots")
        assert "again" not in capsys.readouterr().out and magics.get_engine() is new
        ip.run_line_magic("mlxnb", "load tiny2")  # another model is not "again"
        assert "again" not in capsys.readouterr().out and magics.get_engine() is not new

    arun_shut(main)


def test_stop_then_load_in_one_cell_is_not_refused_for_the_rows_stopping(ip, models,
                                                                          arun_shut, capsys):
    async def main():
        ip.run_line_magic("mlxnb", "load tiny")
        run = gen(ip, "--quiet --max-tokens 500 -o big", "a\nb")
        while not all(r.state == "decode" for r in run.rows):
            await asyncio.sleep(0.005)
        with pytest.raises(UsageError, match="2 rows are still running"):
            ip.run_line_magic("mlxnb", "load tiny --max-batch 8")
        ip.run_line_magic("mlxnb", "stop big")
        assert magics.get_engine().stopping == 2
        ip.run_line_magic("mlxnb", "load tiny --max-batch 8")  # the same cell
        assert magics.get_engine().max_batch == 8
        await asyncio.wait_for(run, 10)
        assert [r.finish_reason for r in run.rows] == ["cancelled"] * 2

    arun_shut(main)
