"""A remote engine sends each row's adapter as the request's model (vLLM serves LoRA
modules by name); a name the server does not list is refused before sending."""

import httpx
import pytest

from test_remote_unit import Server, chat_chunks, engine, sse


def test_each_rows_adapter_goes_out_as_its_model(arun):
    ok = lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["hi"])))  # noqa: E731
    srv = Server(ok, models=("base-model", "ft1", "ft2"))

    async def main():
        eng = engine(srv, model="base-model")
        rows = [eng.submit("p", adapter=a, max_tokens=4) for a in (None, "ft1", "base", "ft2")]
        for r in rows:
            await r
        with pytest.raises(ValueError, match="does not serve adapter 'ft9' by name.*"
                                             "--lora-modules ft9=PATH"):
            eng.submit("p", adapter="ft9")
        await eng.aclose()

    arun(main)
    assert sorted(b["model"] for _, b in srv.bodies) == ["base-model", "base-model", "ft1",
                                                         "ft2"]
    assert len(srv.bodies) == 4  # the refused row sent nothing
