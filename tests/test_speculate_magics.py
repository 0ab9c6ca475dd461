"""%%generate --speculate / --num-draft and %config MLXNB.speculate."""

import pytest
from IPython.core.error import UsageError
from test_magics import arun_shut, attach, gen, ip, models  # noqa: F401  (fixtures)
from traitlets import TraitError

from mlxnb.notebook import magics

BODY = "hello world hello world hello\nabc abc abc abc the cat"


def test_generate_speculate_options_and_config(ip, tiny, arun_shut):
    async def main():
        attach(tiny)
        off = gen(ip, "--raw --max-tokens 40 --quiet", BODY)
        on = gen(ip, "--raw --max-tokens 40 --quiet --speculate lookup --num-draft 3", BODY)
        ip.run_line_magic("config", "MLXNB.speculate = 'lookup'")
        ip.run_line_magic("config", "MLXNB.num_draft = 4")
        cfg = gen(ip, "--raw --max-tokens 40 --quiet", BODY)
        forced_off = gen(ip, "--raw --max-tokens 40 --quiet --speculate off", BODY)
        await magics.wait()
        return off, on, cfg, forced_off

    off, on, cfg, forced_off = arun_shut(main)
    assert [r.params.speculate for r in on.rows] == ["lookup"] * 2
    assert [r.params.num_draft for r in on.rows] == [3, 3]
    assert [r.params.speculate for r in cfg.rows] == ["lookup"] * 2
    assert [r.params.num_draft for r in cfg.rows] == [4, 4]
    assert [r.params.speculate for r in forced_off.rows] == [None] * 2
    assert on.texts == off.texts == cfg.texts == forced_off.texts
    df = on.records()
    assert sum(d["draft_accepted"] for d in df) > 0
    assert sum(d["draft_proposed"] for d in off.records()) == 0


@pytest.mark.parametrize("line,msg", [
    ("--speculate ngram", "--speculate takes lookup, draft or off"),
    ("--speculate draft", "needs an engine with a draft model"),
    ("--speculate lookup --num-draft 40", "--num-draft must be an integer in 0-16"),
    ("--num-draft x", "--num-draft must be an integer in 0-16"),
])
def test_bad_speculate_options_are_usage_errors(ip, tiny, arun_shut, line, msg):
    async def main():
        attach(tiny)
        with pytest.raises(UsageError, match=msg) as e:
            gen(ip, line, "a")
        assert "\n" not in str(e.value)

    arun_shut(main)


def test_config_speculate_refuses_unknown_modes():
    from mlxnb.notebook.session import MLXNB

    c = MLXNB()
    c.speculate = "off"
    assert c.speculate is None
    c.speculate = "lookup"
    assert c.speculate == "lookup"
    c.speculate = "draft"
    assert c.speculate == "draft"
    with pytest.raises(TraitError, match="speculate must be 'lookup', 'draft' or None"):
        c.speculate = "draft-model"


def test_load_with_a_draft_then_generate_speculate_draft(ip, models, arun_shut, capsys):
    async def main():
        ip.run_line_magic("mlxnb", "load tiny --draft layers:1")
        off = gen(ip, "--raw --max-tokens 40 --quiet", BODY)
        on = gen(ip, "--raw --max-tokens 40 --quiet --speculate draft", BODY)
        ip.run_line_magic("config", "MLXNB.speculate = 'draft'")
        cfg = gen(ip, "--raw --max-tokens 40 --quiet --num-draft 2", BODY)
        await magics.wait()
        capsys.readouterr()
        ip.run_line_magic("mlxnb", "status")
        status = capsys.readouterr().out
        with pytest.raises(UsageError, match="draft_model 'layers:N' takes N from 1 to 1") as e:
            ip.run_line_magic("mlxnb", "load tiny --draft layers:5")
        assert "\n" not in str(e.value)
        return off, on, cfg, status

    off, on, cfg, status = arun_shut(main)
    assert on.texts == off.texts == cfg.texts
    assert [r.params.speculate for r in on.rows + cfg.rows] == ["draft"] * 4
    assert sum(d["draft_proposed"] for d in on.records()) > 0
    assert "draft layers:1" in status and "draft acceptance" in status


def test_load_passes_the_configured_speculation_to_the_engine(ip, models, arun_shut):
    """An engine that speculates by default compiles its verification kernels at load
    (CUDA), so `%mlxnb load` gives it the configured mode; 'draft' without --draft
    still loads (cells that ask for it get the one-line error)."""
    async def main():
        ip.run_line_magic("config", "MLXNB.speculate = 'lookup'")
        ip.run_line_magic("mlxnb", "load tiny")
        lookup = magics._S.engine.speculate
        ip.run_line_magic("config", "MLXNB.speculate = 'draft'")
        ip.run_line_magic("mlxnb", "load tiny --max-batch 4")  # (a flag: a new engine)
        draft = magics._S.engine.speculate
        ip.run_line_magic("config", "MLXNB.speculate = None")
        return lookup, draft

    assert arun_shut(main) == ("lookup", None)
