"""%mlxnb adapter and %%generate --adapter on an in-process IPython shell."""

import asyncio
import json

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from adapter_kit import base_model, random_adapter, reference_tokens
from mlxnb.core.engine import Engine
from mlxnb.notebook import magics


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    magics.load_ipython_extension(shell)
    yield shell
    magics.unload_ipython_extension(shell)
    magics._S.config = None
    shell.config.pop("MLXNB", None)
    assert magics._S.engine is None, "a test left its engine open"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ad")
    return {"ft1": random_adapter(root / "ft1", "lora", rank=4, scale=2.0, seed=1),
            "ft2": random_adapter(root / "ft2", "dora", rank=8, scale=1.5, seed=2)}


def test_load_list_sweep_save_and_unload(ip, dirs, arun, tmp_path):
    async def main():
        magics.use(Engine(base_model(), loop=asyncio.get_running_loop(), kv_budget=None,
                          warmup=False), name="tiny")
        try:
            with capture_output() as out:
                ip.run_line_magic("mlxnb", f"adapter load ft1 {dirs['ft1']}")
                ip.run_line_magic("mlxnb", f"adapter load ft2 '{dirs['ft2']}'")
                ip.run_line_magic("mlxnb", "adapter list")
            assert "adapter 'ft1' loaded (lora rank 4" in out.stdout
            assert "ft2: dora rank 8 scale 1.5" in out.stdout
            run = ip.run_cell_magic("generate", "--raw --quiet --max-tokens 12 "
                                    "--adapter base,ft1,ft2 -o run", "hello\nabc")
            # every prompt under each adapter, side by side, in one batch
            assert [r.params.adapter for r in run.rows] == [None, "ft1", "ft2"] * 2
            with capture_output() as out:
                ip.run_line_magic("mlxnb", "status")
            assert "ft1 (lora r4" in out.stdout and "rows)" in out.stdout
            await run
            df = run.to_pandas()
            assert list(df["adapter"]) == ["base", "ft1", "ft2"] * 2
            for r in run.rows:
                path = dirs.get(r.params.adapter)
                assert r.tokens == reference_tokens(path, r.prompt, 12)
            run.save(tmp_path / "out.jsonl")
            recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
            assert recs[1]["params"]["adapter"] == "ft1"
            assert recs[1]["adapter_path"] == str(dirs["ft1"])
            assert recs[0]["adapter"] == "base" and "adapter_path" not in recs[0]
            with capture_output() as out:
                ip.run_line_magic("mlxnb", "adapter unload ft2")
            assert "unloaded" in out.stdout
            assert list(magics.get_engine().adapters) == ["ft1"]
        finally:
            await magics.shutdown()

    arun(main)


@pytest.mark.parametrize("line,msg", [
    ("adapter", "write %mlxnb adapter load NAME PATH"),
    ("adapter load ft1", "takes NAME PATH"),
    ("adapter load base /x", "'base' names the model"),
    ("adapter load x /no/such/dir", "no adapter directory"),
    ("adapter unload nope", "no adapter named 'nope' is loaded"),
])
def test_adapter_mistakes_are_one_line_usage_errors(ip, arun, line, msg):
    async def main():
        magics.use(Engine(base_model(), loop=asyncio.get_running_loop(), kv_budget=None,
                          warmup=False), name="tiny")
        try:
            with pytest.raises(UsageError, match=msg) as e:
                ip.run_line_magic("mlxnb", line)
            assert "\n" not in str(e.value)
        finally:
            await magics.shutdown()

    arun(main)


def test_generate_with_an_unknown_adapter_submits_nothing(ip, dirs, arun):
    async def main():
        eng = magics.use(Engine(base_model(), loop=asyncio.get_running_loop(),
                                kv_budget=None, warmup=False), name="tiny")
        try:
            eng.load_adapter("ft1", dirs["ft1"])
            for opt, msg in (("--adapter base,ft9", "no adapter named 'ft9'"),
                             ("--adapter ft1,ft1", "twice")):
                with pytest.raises(UsageError, match=msg):
                    ip.run_cell_magic("generate", f"--raw --quiet {opt}", "hi")
            assert eng.submitted == 0
        finally:
            await magics.shutdown()

    arun(main)


def test_widget_rows_carry_the_adapter_label(ip, dirs, arun):
    async def main():
        eng = magics.use(Engine(base_model(), loop=asyncio.get_running_loop(),
                                kv_budget=None, warmup=False), name="tiny")
        try:
            eng.load_adapter("ft1", dirs["ft1"])
            run = ip.run_cell_magic("generate", "--raw --max-tokens 4 --adapter base,ft1",
                                    "hi")
            await run
            run.widget._write_traits()
            assert [d.get("adapter") for d in run.widget.rows] == [None, "ft1"]
            from mlxnb.notebook.results import plain

            assert "adapter ft1" in plain(run.rows)  # the text fallback says it too
        finally:
            await magics.shutdown()

    arun(main)
