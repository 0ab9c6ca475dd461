"""The server engine without a server: Prometheus parsing on the names vLLM, llama.cpp
and SGLang document, and the HTTP behaviour (streaming, retries, errors, the API key)
against httpx's MockTransport, which runs the real httpx client end to end."""

from __future__ import annotations

import asyncio
import time
import json

import httpx
import pytest

from mlxnb.core.protocol import EngineLike
from mlxnb.remote import RemoteEngine
from mlxnb.remote.client import normalize_url
from mlxnb.remote.wire import SSEEvents, SSELines, ServerError, error_text
from mlxnb.remote.metrics import parse_prometheus, server_load

pytestmark = pytest.mark.usefixtures("patient_connect")

KEY = "sk-test-0123456789abcdef"

# As vLLM's /metrics prints them (V1 engine, two data-parallel engines), abridged.
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_bucket{le="+Inf",model_name="m"} 7.0
"""
VLLM_V0 = """\
vllm:num_requests_running{model_name="m"} 4.0
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:num_requests_swapped{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.125
vllm:cpu_cache_usage_perc{model_name="m"} 0.0
"""
# llama.cpp's server with --metrics (no labels).
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.0625
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 512
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""
SGLANG = """\
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 7.0
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.0
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.28
"""


def test_prometheus_parser_reads_labels_comments_and_odd_values():
    s = parse_prometheus('a{x="1",y="}"} 2\n# HELP a b\nb 3 1700000000\nc NaN\nbad line here\n'
                         'd{q="a \\" b"} 1e3\n')
    assert s == {"a": [2.0], "b": [3.0], "d": [1000.0]}


@pytest.mark.parametrize("text,want", [
    (VLLM, (21, 3, 0.375, "vllm")),  # counts summed over engines, KV averaged
    (VLLM_V0, (4, 1, 0.125, "vllm")),
    (LLAMACPP, (2, 5, 0.0625, "llamacpp")),
    (SGLANG, (7, 2, 0.28, "sglang")),
])
def test_server_load_from_documented_metric_names(text, want):
    ld = server_load(text)
    assert (ld.running, ld.waiting, ld.kv_fraction, ld.source) == want
    assert ld.reported


def test_a_page_without_known_gauges_reports_nothing():
    ld = server_load("python_gc_objects_collected_total 5\nprocess_cpu_seconds_total 1.5\n")
    assert not ld.reported and ld.running is None and ld.kv_fraction is None


def test_urls_and_error_bodies():
    assert normalize_url("http://h:8000") == "http://h:8000/v1"
    assert normalize_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert normalize_url("https://gw.example/openai/v1") == "https://gw.example/openai/v1"
    for bad in ("h:8000", "ftp://h/v1", ""):
        with pytest.raises(ValueError, match="http"):
            normalize_url(bad)
    assert error_text(b'{"error": "top_k must be at least 0"}') == "top_k must be at least 0"
    assert error_text(b'{"error": {"message": "The model `x` does not exist.", "code": 404}}') \
        == "The model `x` does not exist."
    assert error_text(b'{"detail": "Not Found"}') == "Not Found"
    from mlxnb.remote.client import Client

    c = Client("http://me:hunter2@h:8000/v1")
    assert c.shown == "http://h:8000/v1" and "hunter2" not in repr(c)
    assert error_text(b"<html>\n502 Bad Gateway</html>") == "<html> 502 Bad Gateway</html>"


# -- a scripted server -------------------------------------------------------------------
def sse(*events, done=True, comments=()) -> bytes:
    out = [f": {c}\n\n" for c in comments]
    out += [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def chat_chunks(pieces, finish="length", usage=None):
    ev = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
          for p in pieces]
    ev.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if usage:
        ev.append({"choices": [], "usage": usage})
    return ev


class Server:
    """A MockTransport handler: answers /v1/models and /metrics, and hands each
    completion request to `script(request, n)` (n = how many came before)."""

    def __init__(self, script, models=("m1",), metrics=None, key=None):
        self.script, self.models, self.metrics, self.key = script, models, metrics, key
        self.bodies = []

    def __call__(self, req: httpx.Request) -> httpx.Response:
        if self.key and req.headers.get("authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": {"message": "Invalid API key"}})
        path = req.url.path
        if path == "/v1/models":
            if self.models is None:
                return httpx.Response(404, text="Not Found")
            return httpx.Response(200, json={"data": [{"id": m} for m in self.models]})
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics) if self.metrics else \
                httpx.Response(404, text="Not Found")
        body = json.loads(req.content)
        self.bodies.append((path, body))
        return self.script(req, len(self.bodies) - 1)


def engine(server, **kw):
    kw.setdefault("sample_s", 0.02)
    eng = RemoteEngine("http://test:8000", _transport=httpx.MockTransport(server), **kw)
    eng.client.backoff_s = 0.001
    return eng


def one_row(arun, server, **kw):
    """The result of one row "p" on a fresh engine against `server`."""
    async def main():
        eng = engine(server, **kw)
        r = await eng.submit("p")
        await eng.aclose()
        return r

    return arun(main)


def test_rows_stream_text_counts_and_usage(arun):
    ok = lambda req, n: httpx.Response(200, content=sse(  # noqa: E731
        *chat_chunks(["Hel", "lo", " there"], usage={"prompt_tokens": 11, "completion_tokens": 4}),
        comments=["keepalive 5/11"]))
    srv = Server(ok, metrics=VLLM)

    async def main():
        eng = engine(srv, max_concurrency=2)
        assert isinstance(eng, EngineLike)
        assert eng.model == "m1" and eng.kv_unit == "fraction" and eng.batch_reported
        run = eng.generate(["a", "b", "c"], max_tokens=8, temperature=0.5, top_k=5,
                           stop=["\n"], system="be brief")
        res = await run
        await eng.aclose()
        return eng, run, res

    eng, run, res = arun(main)
    assert [r.finish_reason for r in res] == ["length"] * 3
    assert res[0].text == "Hello there" and res[0].prompt_tokens == 11
    assert run.rows[0].ntok == 4  # the server's usage count wins over the 3 pieces
    path, body = srv.bodies[0]
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "a"}]
    assert body["model"] == "m1" and body["top_k"] == 5 and body["stop"] == ["\n"]
    assert "top_p" not in body and "seed" not in body and "min_p" not in body
    assert run.records()[0]["tokens"] == 4


def test_finished_rows_are_not_kept_by_the_remote_engine(arun):
    """As a local engine: unfinished rows are the engine's, finished ones live as
    long as the user's handles."""
    import gc

    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))

    async def main():
        eng = engine(srv, max_concurrency=4)
        for _ in range(3):
            await eng.generate([f"p{i}" for i in range(10)], max_tokens=2)
        gc.collect()
        dropped = len(eng.rows)
        kept = eng.generate(["kept"], max_tokens=2)
        await kept
        out = (dropped, len(eng.rows), kept.rows[0] in eng.rows, eng.submitted,
               dict(eng.finished), eng.status())
        await eng.aclose()
        return out

    dropped, n, held, submitted, finished, status = arun(main)
    assert dropped == 0 and n == 1 and held
    assert submitted == 31 and finished == {"length": 31} and "done 31" in status


def test_raw_rows_use_completions_and_logprobs(arun):
    ev = [{"choices": [{"index": 0, "text": "ab", "finish_reason": None,
                        "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                     "top_logprobs": [{"a": -0.1, "c": -3.0}, {"b": -0.2}]}}]},
          {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*ev)), models=None)

    async def main():
        eng = engine(srv)
        r = await eng.submit("p", chat=False, logprobs=2, seed=3, temperature=1.0)
        await eng.aclose()
        return eng, r

    eng, r = arun(main)
    path, body = srv.bodies[0]
    assert path == "/v1/completions" and body["prompt"] == "p" and body["logprobs"] == 2
    assert "model" not in body and body["seed"] == 3  # no listing: the server's default
    assert eng.kv_unit is None and not eng.batch_reported
    assert r.finish_reason == "stop" and r.text == "ab" and r.seed == 3
    assert r.logprobs == [{"token": "a", "logprob": -0.1, "top": [("a", -0.1), ("c", -3.0)]},
                          {"token": "b", "logprob": -0.2, "top": [("b", -0.2)]}]
    assert "not reported by this server" in eng.status()


def test_429_and_503_are_retried_then_served(arun):
    def script(req, n):
        if n == 0:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": "slow down"})
        if n == 1:
            return httpx.Response(503, text="starting")
        return httpx.Response(200, content=sse(*chat_chunks(["x"])))

    srv = Server(script)

    r = one_row(arun, srv)
    assert r.finish_reason == "length" and r.text == "x" and len(srv.bodies) == 3


def test_connection_failures_are_retried_then_end_the_row_with_a_reason(arun):
    calls = []

    def script(req, n):
        calls.append(n)
        raise httpx.ConnectError("connection refused")

    r = one_row(arun, Server(script), retries=2)
    assert r.finish_reason == "error" and len(calls) == 3
    assert "after 3 attempts" in r.error and "check that it is running" in r.error


def test_a_stream_broken_after_tokens_is_not_retried(arun):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(*chat_chunks(["one", "two"])[:2], done=False)
            raise httpx.ReadError("connection reset by peer")

    srv = Server(lambda req, n: httpx.Response(200, stream=Broken()))

    r = one_row(arun, srv)
    assert r.finish_reason == "error" and r.text == "onetwo" and len(srv.bodies) == 1
    assert "broke mid-stream" in r.error


def test_a_stream_broken_after_its_finish_reason_keeps_that_finish(arun):
    class Broken(httpx.AsyncByteStream):  # the row was over; only [DONE] is missing
        async def __aiter__(self):
            yield sse(*chat_chunks(["one", "two"], finish="stop"), done=False)
            raise httpx.ReadError("connection reset by peer")

    r = one_row(arun, Server(lambda req, n: httpx.Response(200, stream=Broken())))
    assert (r.finish_reason, r.text, r.error) == ("stop", "onetwo", None)


@pytest.mark.parametrize("status,body,want", [
    (400, {"error": "top_logprobs must be at most 11"},
     "the server rejected the request: top_logprobs must be at most 11"),
    (404, {"error": {"message": "The model `m1` does not exist."}}, "does not know model 'm1'"),
    (500, {"error": "boom"}, "the server answered 500: boom"),
])
def test_refusals_end_that_row_with_one_line(arun, status, body, want):
    srv = Server(lambda req, n: httpx.Response(status, json=body) if n == 0 else
                 httpx.Response(200, content=sse(*chat_chunks(["fine"]))))

    async def main():
        eng = engine(srv)
        bad = await eng.submit("p")
        good = await eng.submit("q")  # the engine goes on serving
        await eng.aclose()
        return bad, good

    bad, good = arun(main)
    assert bad.finish_reason == "error" and want in bad.error and "\n" not in bad.error
    assert good.finish_reason == "length" and good.text == "fine"


def test_an_error_event_mid_stream_ends_the_row(arun):
    ev = chat_chunks(["a"])[:1] + [{"error": {"message": "engine dead", "code": 500}}]
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*ev)))

    r = one_row(arun, srv)
    assert r.finish_reason == "error" and "engine dead" in r.error and r.text == "a"


def test_the_api_key_is_sent_but_never_shown_or_saved(arun, tmp_path):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["k"]))), key=KEY)

    async def main():
        eng = engine(srv, api_key=KEY)
        run = eng.generate(["a"])
        await run
        from mlxnb.notebook.widget import GenerationWidget

        w = GenerationWidget(eng, run.rows)
        state = json.dumps([w.rows, w.header, w.steps]) + w.summary_text()
        await eng.aclose()
        return eng, run, state

    eng, run, state = arun(main)
    assert run.rows[0].finish_reason == "length"
    assert "KV not reported by this server" in state  # the text fallback says so too
    saved = run.save(tmp_path / "run.jsonl").read_text()
    for text in (repr(eng), eng.status(), repr(eng.client), state, saved, repr(run.meta),
                 json.dumps(run.records())):
        assert KEY not in text


def test_a_wrong_key_is_refused_at_connect_without_echoing_it():
    srv = Server(lambda req, n: httpx.Response(200), key=KEY)
    with pytest.raises(ValueError, match="refused the API key") as e:
        engine(srv, api_key="sk-wrong-key-42")
    assert "sk-wrong-key-42" not in str(e.value)


def test_a_key_read_with_its_newline_works_and_one_no_header_can_carry_is_refused(arun):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["k"]))), key=KEY)
    assert one_row(arun, srv, api_key=KEY + "\n").finish_reason == "length"
    with pytest.raises(ValueError, match="^api_key must be a string, got bytes$"):
        engine(srv, api_key=KEY.encode())
    for bad in ("sk-a\nb", "sk-clé", "sk-\x00"):
        with pytest.raises(ValueError, match="^the API key holds a character an HTTP "
                                             "header cannot carry") as e:
            engine(srv, api_key=bad)
        assert bad.strip() not in str(e.value)


@pytest.mark.parametrize("status,body", [
    (500, {"error": {"message": "x" * 180 + f" auth=Bearer {KEY} and more"}}),  # across the cut
    (200, None),  # an error event inside the stream
])
def test_the_key_is_scrubbed_from_what_servers_say_before_any_cut(arun, status, body):
    def script(req, n):
        if body is not None:
            return httpx.Response(status, json=body)
        return httpx.Response(200, content=sse({"error": {"message": f"upstream said {KEY}"}}))

    srv = Server(script, key=KEY)
    row = one_row(arun, srv, api_key=KEY)
    assert row.finish_reason == "error" and ("***" in row.error or status != 200)
    assert KEY[:6] not in row.error, row.error


@pytest.mark.parametrize("line,want", [
    ('error: {"code": 500, "message": "KV cache is full", "type": "server_error"}',
     "the server failed the request: KV cache is full"),
    ("error: out of memory", "the server failed the request: out of memory"),
])
def test_llama_cpps_error_lines_end_the_row_with_their_message(arun, line, want):
    body = sse(*chat_chunks(["partial"])[:1], done=False) + f"{line}\n\n".encode()
    row = one_row(arun, Server(lambda req, n: httpx.Response(200, content=body)))
    assert (row.finish_reason, row.error, row.text) == ("error", want, "partial")


def test_a_server_finish_reason_of_error_ends_the_row_in_error(arun):
    srv = Server(lambda req, n: httpx.Response(
        200, content=sse(*chat_chunks(["partial"], finish="error"))))
    row = one_row(arun, srv)
    assert row.finish_reason == "error" and "reported an error" in row.error
    assert row.text == "partial"


def test_a_bad_address_is_shown_without_its_password():
    for url in ("http://me:hunter2@h:99999/v1", "ftp://me:hunter2@h/v1", "http://[::1/v1"):
        with pytest.raises(ValueError) as e:
            normalize_url(url)
        assert "hunter2" not in str(e.value) and "e.g. http://localhost:8000/v1" in str(e.value)


@pytest.mark.parametrize("retries", ["3", -1, True, 2.0])
def test_a_bad_retries_is_refused_at_connect(retries):
    srv = Server(lambda req, n: httpx.Response(200))
    with pytest.raises(ValueError, match="^retries must be an integer >= 0, got "):
        engine(srv, retries=retries)


def test_model_choice_at_connect():
    srv = Server(lambda req, n: httpx.Response(200), models=("a", "b"))
    with pytest.raises(ValueError, match="serves 2 models .*pick one with --model"):
        engine(srv)
    with pytest.raises(ValueError, match="does not serve model 'c'; it lists 'a', 'b'"):
        engine(srv, model="c")
    assert engine(srv, model="b", loop=asyncio.new_event_loop()).model_name == "b"


def test_an_unreachable_server_is_refused_at_connect():
    def refuse(req):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(ValueError, match="could not connect to http://test:8000/v1 .*"
                                         "check the address"):
        engine(refuse)


def test_a_transport_error_httpx_does_not_wrap_is_a_failed_connect():
    def broken(req):
        raise OSError("no route to host")

    with pytest.raises(ValueError, match="could not connect to http://test:8000/v1 "
                                         r"\(OSError: no route to host\); check"):
        engine(broken)


def test_bad_input_is_refused_before_anything_is_sent(arun):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))

    async def main():
        eng = engine(srv)
        for kw, msg in [({"stop": [lambda t: True]}, "stop strings only"),
                        ({"logits_processors": [lambda t, l: l]}, "cannot take them"),
                        ({"temperature": -1}, "temperature must be a number >= 0"),
                        ({"speculate": "lookup"}, "a server speculates as it was started"),
                        ({"num_draft": 4}, "a server speculates as it was started"),
                        ({"bogus": 1}, "unknown parameter")]:
            with pytest.raises(ValueError, match=msg):
                eng.submit("p", **kw)
        with pytest.raises(ValueError, match="prompt is empty"):
            eng.submit("  ")
        await eng.aclose()

    arun(main)
    assert srv.bodies == []


def test_cancel_queued_and_streaming_rows(arun):
    class Slow(httpx.AsyncByteStream):
        closed = []

        async def __aiter__(self):
            for i in range(1000):
                yield sse(*chat_chunks([f"{i} "])[:1], done=False)
                await asyncio.sleep(0.005)

        async def aclose(self):
            Slow.closed.append(True)

    srv = Server(lambda req, n: httpx.Response(200, stream=Slow()), metrics=VLLM)

    async def main():
        eng = engine(srv, max_concurrency=1)
        run = eng.generate(["a", "b"], max_tokens=1000)
        while run.rows[0].ntok < 3 or not eng.steps:  # streaming, and charted
            await asyncio.sleep(0.01)
        assert run.rows[1].state == "queued" and eng.queued == 1
        run.cancel()
        res = await run
        await eng.aclose()
        return eng, res

    eng, res = arun(main)
    assert [r.finish_reason for r in res] == ["cancelled", "cancelled"]
    assert len(srv.bodies) == 1 and Slow.closed  # the queued row was never sent
    assert eng.running == 0 and eng.steps and eng.steps[-1].kv_bytes == 0.375


def test_rows_cancelled_as_their_requests_start_end_and_free_their_slots(arun):
    """A cancel in the same loop step as the submit reaches tasks that never ran."""
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))

    async def main():
        eng = engine(srv, max_concurrency=1)
        run = eng.generate(["a", "b", "c"], max_tokens=4)
        run.cancel()
        res = await asyncio.wait_for(run, 5)
        later = await asyncio.wait_for(eng.submit("later", max_tokens=4), 5)
        running = eng.running
        await eng.aclose()
        return res, later, running

    res, later, running = arun(main)
    assert [r.finish_reason for r in res] == ["cancelled"] * 3
    assert later.finish_reason == "length" and running == 0


# -- the magics ------------------------------------------------------------------------
@pytest.fixture
def ip(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    import mlxnb.remote
    from mlxnb.notebook import magics

    srv = Server(lambda req, n: httpx.Response(200, content=sse(
        *chat_chunks(["hi"], usage={"prompt_tokens": 3, "completion_tokens": 1}))),
        metrics=LLAMACPP)

    def connect(url, **kw):  # the real engine, on the scripted server
        return RemoteEngine(url, _transport=httpx.MockTransport(srv), **kw)

    monkeypatch.setattr(mlxnb.remote, "connect", connect)
    shell = InteractiveShell.instance()
    magics.load_ipython_extension(shell)
    yield shell
    magics.unload_ipython_extension(shell)
    magics._S.config = None
    assert magics._S.engine is None, "a test left its engine open"


@pytest.mark.parametrize("line,msg", [
    ("connect", "the following arguments are required: url"),
    ("connect http://h:1 --max-concurrency 0", "--max-concurrency must be a positive"),
    ("connect http://h:1 --max-concurrency x", "is not an integer"),
    ("connect http://h:1 --api-key-env MLXNB_NO_SUCH_VAR", "'MLXNB_NO_SUCH_VAR' is not set"),
    ("connect http://h:1 --api-key-env '\ud800'", "is not a valid environment variable name"),
    ("connect h:1", "is not an http(s) address"),
    ("connect http://h:99999/v1", "no valid host and port (ports are 1-65535)"),
    ("connect http://h:abc/v1", "no valid host and port"),
    ("connect http://h:0/v1", "no valid host and port"),
])
def test_connect_mistakes_are_one_line_usage_errors(ip, line, msg):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as e:
        ip.run_line_magic("mlxnb", line)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_connect_then_generate_status_and_stop(ip, arun, capsys, monkeypatch):
    from mlxnb.notebook import magics

    monkeypatch.setenv("MLXNB_TEST_KEY", KEY)

    async def main():
        try:
            ip.run_line_magic("mlxnb", "connect http://test:8000 --api-key-env MLXNB_TEST_KEY "
                                       "--max-concurrency 2")
            run = ip.run_cell_magic("generate", "--max-tokens 5 --quiet", "one\ntwo\nthree")
            res = await run
            ip.run_line_magic("mlxnb", "status")
            ip.run_line_magic("mlxnb", "stop")
            dash = ip.run_line_magic("mlxnb", "dashboard")
            assert len(dash.rows) == 3 and dash.header["kv_unit"] == "fraction"
            assert dash.header["running"] == 0 and dash.header["max_batch"] == 2
            return run, res
        finally:
            await magics.shutdown()

    run, res = arun(main)
    out = capsys.readouterr().out
    assert [r.text for r in res] == ["hi"] * 3 and run.meta["model"] == "m1"
    assert "connected to http://test:8000/v1, model 'm1' (llamacpp /metrics)" in out
    assert "done 3 (max 2 at once) | server (llamacpp metrics): running 2, waiting 5, KV 6%" in out
    assert KEY not in out


def test_speculation_and_other_models_on_a_server_say_what_to_do(ip, arun):
    from IPython.core.error import UsageError

    from mlxnb.notebook import magics

    async def main():
        try:
            ip.run_line_magic("mlxnb", "connect http://test:8000")
            for line in ("--speculate lookup", "--num-draft 4", "--speculate off"):
                with pytest.raises(UsageError, match="a server speculates as it was "
                                                     "started") as e:
                    ip.run_cell_magic("generate", f"--quiet {line}", "p")
                assert "\n" not in str(e.value)
            with pytest.raises(UsageError) as e:
                ip.run_cell_magic("generate", "--quiet --model ft1", "p")
            assert str(e.value) == (
                "this kernel is connected to http://test:8000/v1, model 'm1'; run `%mlxnb "
                "connect http://test:8000/v1 --model ft1` to use another of its models, or "
                "`%mlxnb load ft1` for a local one")
            # the %config default is for a local engine: not sent, not refused
            ip.run_line_magic("config", "MLXNB.speculate = 'lookup'")
            run = ip.run_cell_magic("generate", "--quiet --max-tokens 5", "p")
            await run
            return run
        finally:
            await magics.shutdown()
            ip.config.pop("MLXNB", None)

    run = arun(main)
    assert run.rows[0].finish_reason == "length" and run.rows[0].params.speculate is None


def test_both_engines_satisfy_the_protocol(tiny, arun):
    from mlxnb.core.engine import Engine

    async def main():
        eng = Engine(tiny, warmup=False)
        try:
            assert isinstance(eng, EngineLike)
        finally:
            await eng.aclose()

    arun(main)
    assert isinstance(engine(Server(lambda req, n: None), loop=asyncio.new_event_loop()),
                      EngineLike)


def test_wire_events_and_finish_reasons():
    from mlxnb.remote import wire

    ev = wire.parse_event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {
        "content": [{"token": "H", "logprob": -0.5,
                     "top_logprobs": [{"token": "H", "logprob": -0.5}]},
                    {"token": "i", "logprob": -0.1, "top_logprobs": []}]},
        "finish_reason": None}, {"index": 1, "delta": {"content": "other choice"}}]}, chat=True)
    assert (ev.text, ev.ntok, ev.finish) == ("Hi", 2, None)
    assert ev.logprobs[0] == {"token": "H", "logprob": -0.5, "top": [("H", -0.5)]}
    role_only = wire.parse_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, True)
    assert role_only.ntok == 0 and role_only.text == ""
    assert wire.usage_counts({"prompt_tokens": 7, "completion_tokens": 3,
                              "prompt_tokens_details": {"cached_tokens": 4}}) == (7, 3, 4)
    assert wire.usage_counts({"prompt_tokens": True}) == (None, None, 0)
    assert wire.prefill_progress("keepalive 512/2048") == (512, 2048)
    assert wire.prefill_progress("keepalive soon") is None
    assert wire.finish("length") == ("length", None)
    assert wire.finish("tool_calls") == ("stop", None)
    assert wire.finish("abort")[0] == "error"
    assert wire.finish("content_filter") == (
        "error", "the server's content filter stopped this row (the text before it is kept)")
    assert "without a finish reason" in wire.finish(None)[1]
    with pytest.raises(ServerError, match="the server failed the request: out of memory"):
        wire.parse_event({"error": {"message": "out of\nmemory", "code": 500}}, chat=False)


# -- servers at the edges of the event-stream format -----------------------------------
def test_a_reasoning_models_thinking_counts_as_output_and_is_kept_apart(arun):
    """vLLM's and llama.cpp's reasoning parsers stream the thinking as
    `reasoning_content` (vLLM >= 0.11: `reasoning`) with `content` null."""
    class Thinking(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(30):
                key = "reasoning_content" if i % 2 else "reasoning"
                yield sse({"choices": [{"index": 0, "delta": {"content": None, key: f"t{i} "},
                                        "finish_reason": None}]}, done=False)
                await asyncio.sleep(0.02)
            yield sse(*chat_chunks(["The answer."], finish="stop"))

    srv = Server(lambda req, n: httpx.Response(200, stream=Thinking()))

    async def main():
        eng = engine(srv, timeout=0.3)  # it thinks for 0.6 s, a token every 0.02 s
        row = eng.submit("p")
        await row
        await eng.aclose()
        return row

    r = arun(main)
    assert (r.finish_reason, r.text, r.error, r.ntok) == ("stop", "The answer.", None, 31)
    assert r.reasoning.startswith("t0 t1 t2 ")
    # kept in every lasting form: the result, the records and a saved run
    from mlxnb.core.run import Run

    assert r.result().reasoning == r.reasoning == Run([r]).records()[0]["reasoning"]


def test_the_thinking_is_on_the_row(arun):
    ev = [{"choices": [{"index": 0, "delta": {"reasoning_content": "hm, "},
                        "finish_reason": None}]}] + chat_chunks(["ok"], finish="stop")
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*ev)))

    async def main():
        eng = engine(srv)
        row = eng.submit("p")
        await row
        await eng.aclose()
        return row

    row = arun(main)
    assert (row.text, row.reasoning, row.ntok) == ("ok", "hm, ", 2)


def test_a_loop_held_past_the_timeout_does_not_end_rows_the_server_still_streams(arun):
    class Steady(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(40):
                yield sse(*chat_chunks([f"{i} "])[:1], done=False)
                await asyncio.sleep(0.02)
            yield sse(*chat_chunks([], finish="stop")[-1:])

    srv = Server(lambda req, n: httpx.Response(200, stream=Steady()))

    async def main():
        eng = engine(srv, timeout=0.5)
        run = eng.generate(["a", "b"], max_tokens=100)
        while not all(r.ntok for r in run.rows):
            await asyncio.sleep(0.01)
        time.sleep(1.0)  # a cell holding the kernel's loop, twice the timeout
        await run
        await eng.aclose()
        return run.rows

    rows = arun(main)
    assert [(r.finish_reason, r.ntok, r.error) for r in rows] == [("stop", 40, None)] * 2


@pytest.mark.parametrize("body, want", [
    # a cut at 80 characters would leave the key's first 10 unscrubbed
    (b"data: Unauthorized, token " + b"y" * 44 + KEY.encode() + b"\n\n", "is not JSON"),
])
def test_the_key_never_shows_however_a_message_is_cut(arun, body, want):
    srv = Server(lambda req, n: httpx.Response(200, content=body))
    r = one_row(arun, srv, api_key=KEY)
    assert r.finish_reason == "error" and want in r.error and "\n" not in r.error
    assert not any(KEY[i:i + 6] in r.error for i in range(len(KEY) - 5)), r.error


def test_a_key_escaped_in_a_json_error_body_is_scrubbed():
    from mlxnb.remote.client import Client

    c = Client("http://h:1/v1", api_key="abc/DEF/ghi/JKL/mno")
    body = json.dumps({"error": {"message": "x" * 180 + " key abc/DEF/ghi/JKL/mno bad"}})
    msg = str(c.http_error(401, body.replace("/", "\\/").encode(), "m"))
    assert "abc/DEF" not in msg and "ghi/JKL" not in msg and "refused the API key" in msg


@pytest.mark.parametrize("content, want", [
    (b'{"error": {"message": "top_k must be at least 0"}}', "top_k must be at least 0"),
    (b"<html><body>Sign in to continue</body></html>", "Sign in to continue"),
])
def test_a_200_answer_that_is_not_an_event_stream_says_what_it_is(arun, content, want):
    r = one_row(arun, Server(lambda req, n: httpx.Response(200, content=content)))
    assert r.finish_reason == "error"
    assert r.error.startswith("the server's answer is not an event stream: ") and want in r.error


def over_lines(*events, end="\n") -> bytes:
    """`sse(*events)` with each event's JSON over several `data:` lines (indented, so
    its lines break between tokens) and its lines ended by `end`."""
    out = []
    for text in [json.dumps(e, indent=1) for e in events] + ["[DONE]"]:
        out += [f"data: {line}{end}" for line in text.split("\n")] + [end]
    return "".join(out).encode()


HELLO = chat_chunks(["hello ", "world"], "stop")


@pytest.mark.parametrize("name, body", [
    ("a byte-order mark", b"\xef\xbb\xbf" + sse(*HELLO)),
    ("an empty data field", b"data:\n\n" + sse(*HELLO)),
    ("a comment of other digits", sse(*HELLO, comments=["keepalive \u00b2/3"])),
    # https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
    ("lines ended by a bare CR", sse(*HELLO, comments=["keepalive 1/2"]).replace(b"\n", b"\r")),
    ("events over several data lines, CRLF ended", over_lines(*HELLO, end="\r\n")),
    ("events over several data lines, CR ended", over_lines(*HELLO, end="\r")),
    # not the spec's, but sent: consecutive events as the data lines of one
    ("events ended by a single line end", sse(*HELLO).replace(b"\n\n", b"\n")),
])
def test_event_stream_details_a_server_may_send(arun, name, body):
    class Drip(httpx.AsyncByteStream):  # a byte at a time: the mark and each CRLF split too
        async def __aiter__(self):
            for i in range(len(body)):
                yield body[i:i + 1]

    r = one_row(arun, Server(lambda req, n: httpx.Response(200, stream=Drip())))
    assert (r.finish_reason, r.text, r.error) == ("stop", "hello world", None), name



# -- the event stream, parsed without I/O: https://html.spec.whatwg.org/multipage/
# server-sent-events.html#event-stream-interpretation
def split(chunks, limit=64):
    lines = SSELines(limit)
    return [x for c in chunks for x in lines.feed(c)] + lines.end()


def every_chunking(body):
    """`body` whole, a byte at a time, and cut in two at every point."""
    yield [body]
    yield [body[i:i + 1] for i in range(len(body))]
    for i in range(len(body) + 1):
        yield [body[:i], b"", body[i:]]


def test_lines_end_in_crlf_lf_or_a_bare_cr_wherever_the_chunks_part():
    body = "\ufeffdata: é1\r\n\r\n: c\rdata: 2\n\ndata: 3\r\rx".encode()
    want = ["data: é1", "", ": c", "data: 2", "", "data: 3", "", "x"]
    for chunks in every_chunking(body):  # a CR then an LF in the next chunk: one end
        assert split(chunks) == want, chunks
    assert split([b"a\r", b"\n", b"\n"]) == ["a", ""]
    assert split([b"a\r", b"\r\n"]) == ["a", ""]
    assert split([b"a\n\r"]) == ["a", ""]  # (no LF followed: the CR ends a line)
    # a byte-order mark is dropped at the very start only
    assert split([b"\n\xef\xbb\xbfx\n"]) == ["", "\ufeffx"]
    assert split([b"\xef\xbb", b"\xbfx"]) == ["x"]
    with pytest.raises(ServerError, match="line longer than"):
        split([b"x" * 65 + b"\r"])


def events(lines, limit=1 << 20):
    ev = SSEEvents(limit)
    out = [x for x in map(ev.line, lines) if x is not None]
    return out + ([last] if (last := ev.end()) else [])


def test_an_events_data_lines_are_joined_and_dispatched_at_the_blank_line():
    assert events(['data: {"a":', "data:  1,", "event: x", "id: 7", "retry: 5",
                   'data: "b": 2}', ""]) == [("data", '{"a":\n 1,\n"b": 2}')]  # one space off
    assert events(["data", "data:", "", "", "data: [DONE]", ""]) == \
        [("data", "\n"), ("data", "[DONE]")]  # a field's name alone: an empty value
    assert events([": keepalive 1/2", "data: 1", ": ping", "data: 2", ""]) == \
        [("comment", " keepalive 1/2"), ("comment", " ping"), ("data", "1\n2")]
    assert events(["error: {}", "<html>", "data: 1"]) == \
        [("error", "{}"), ("other", "<html>"), ("data", "1")]  # the last without its blank
    assert events(["error", ""]) == [("other", "error")]
    with pytest.raises(ServerError, match="event longer than 1 kB"):
        events(["data: " + "x" * 500] * 3, limit=1024)  # bounded, though each line is short


def test_events_sent_without_blank_lines_are_dispatched_as_they_come():
    """Not the spec's, but sent: each event ended by one line end. A data line after
    one that is a whole JSON value dispatches it, so the stream still streams."""
    sse_events = SSEEvents(1 << 20)
    got = [sse_events.line(x) for x in ['data: {"a": 1}', 'data: {"b": [2]}', "data: [DONE]"]]
    assert got == [None, ("data", '{"a": 1}'), ("data", '{"b": [2]}')]
    assert sse_events.end() == ("data", "[DONE]")
    # a true multi-line event never starts with a whole JSON value: joined as before
    assert events(['data: {"a":', 'data: 1}', 'data: {"b": 2}', ""]) == \
        [("data", '{"a":\n1}\n{"b": 2}')]
    for _ in range(10_000):  # long streams stay within the event bound
        sse_events.line('data: {"t": "x"}')


def test_a_finish_reason_that_is_not_a_string_is_not_a_finish(arun):
    ev = chat_chunks(["a"])[:1] + [{"choices": [{"index": 0, "delta": {},
                                                 "finish_reason": ["stop"]}]}]
    r = one_row(arun, Server(lambda req, n: httpx.Response(200, content=sse(*ev, done=False))))
    assert r.finish_reason == "error" and r.text == "a"
    assert "without a finish reason" in r.error


def test_credentials_in_the_address_and_an_api_key_are_refused_together():
    from mlxnb.remote.client import Client

    with pytest.raises(ValueError, match="user:password@ and an API key; give one") as e:
        Client("http://me:hunter2@h:8000/v1", api_key=KEY)
    assert "hunter2" not in str(e.value) and KEY not in str(e.value)
    Client("http://me:hunter2@h:8000/v1")  # either alone is fine


@pytest.mark.parametrize("status, body, want", [
    (404, b"", "has no such endpoint (404: no message)"),
    (404, b"File Not Found", "has no such endpoint (404: File Not Found)"),
    (404, b'{"error": "model m1 not found"}', "does not know model 'm1'"),
    (413, b"", "the server answered 413: no message"),
])
def test_what_a_refusal_says_with_or_without_a_body(status, body, want):
    from mlxnb.remote.client import Client

    assert want in str(Client("http://h:1/v1").http_error(status, body, "m1"))
