"""A remote engine at the edges: closing from other threads and racing submits, a
server that redirects or sends malformed events, text httpx cannot encode. Every row
still ends with a finish reason, and every refusal is one line that says what to do."""

import asyncio
import threading

import httpx
import pytest

import mlxnb
from mlxnb._aio import NoLoopError
from mlxnb.remote import RemoteEngine
from mlxnb.remote import engine as remote_engine
from test_remote_unit import Server, chat_chunks, engine, one_row, sse


def test_a_row_whose_submit_raced_a_close_ends_cancelled(arun, monkeypatch):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))
    real = remote_engine.RemoteRow

    def closing_first(eng, *a):  # another thread's close, between submit's check and queue
        eng.close()
        return real(eng, *a)

    monkeypatch.setattr(remote_engine, "RemoteRow", closing_first)

    async def main():
        eng = engine(srv)
        row = eng.submit("p")
        return await asyncio.wait_for(row, 5), eng

    row, eng = arun(main)
    assert row.finish_reason == "cancelled" and not eng._live and srv.bodies == []


def test_close_from_another_thread_ends_every_row_on_the_loop(arun):
    started = threading.Event()

    def slow(req, n):
        async def stream():
            yield sse(chat_chunks(["a"])[0], done=False)
            started.set()
            await asyncio.sleep(3)  # (longer than the test waits for the close)
            yield sse(*chat_chunks(["b"])[1:])

        return httpx.Response(200, content=stream())

    srv = Server(slow)

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_debug(True)  # asyncio objects touched off the loop's thread raise here
        eng = engine(srv, max_concurrency=2)
        rows = [eng.submit(p) for p in "pqr"]  # two stream, one waits its turn
        await asyncio.to_thread(started.wait, 5)
        errors = []

        def close():
            try:
                eng.close()
            except Exception as e:  # pragma: no cover - what the test looks for
                errors.append(e)

        await asyncio.to_thread(close)
        done = await asyncio.wait_for(asyncio.gather(*rows), 5)
        return errors, done, eng

    # (on a thread of its own: a task cancelled from the wrong thread never wakes, and
    # the loop's end would wait for it forever)
    out = {}
    th = threading.Thread(target=lambda: out.update(r=arun(main)), daemon=True)
    th.start()
    th.join(20)
    assert "r" in out, "the rows did not end, or their tasks did not, after close()"
    errors, done, eng = out["r"]
    assert errors == []
    assert [r.finish_reason for r in done] == ["cancelled"] * 3
    assert not eng._tasks and not eng._live and eng.closed


def test_connect_on_a_thread_binds_the_loop_of_the_first_submit(arun, monkeypatch):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["hi"]))))
    real = RemoteEngine.__init__

    def with_transport(self, *a, **kw):  # mlxnb.connect as a user calls it
        real(self, *a, _transport=httpx.MockTransport(srv), **kw)

    monkeypatch.setattr(RemoteEngine, "__init__", with_transport)

    async def main():
        eng = await asyncio.to_thread(mlxnb.connect, "http://test:8000")
        row = await eng.submit("p")
        await eng.aclose()
        return row

    assert arun(main).text == "hi"


def test_a_connect_on_a_thread_with_no_loop_is_refused_at_its_first_submit():
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))
    eng = RemoteEngine("http://test:8000", _transport=httpx.MockTransport(srv))
    with pytest.raises(NoLoopError, match="needs a running asyncio event loop"):
        eng.submit("p")
    eng.close()  # nothing bound to a loop: closes here
    assert eng.closed


@pytest.mark.parametrize("kw", [{"stop": ["ok", "\udcff"]}, {"adapter": "lora\udcff"}])
def test_text_that_cannot_be_sent_is_refused_at_submit(arun, kw):
    srv = Server(lambda req, n: httpx.Response(200, content=sse(*chat_chunks(["x"]))))

    async def main():
        eng = engine(srv)
        with pytest.raises(ValueError, match=r"^the (stop string|adapter name) holds "
                                             r"invalid unicode") as e:
            eng.submit("p", **kw)
        await eng.aclose()
        return str(e.value)

    msg = arun(main)
    assert "\udcff" not in msg and srv.bodies == []


@pytest.mark.parametrize("error,want", [
    ({"code": 500, "type": "InternalServerError"},
     'the server failed the request: {"code":500,"type":"InternalServerError"}'),
    ({"detail": "worker died"}, "the server failed the request: worker died"),
    ("plain words", "the server failed the request: plain words"),
    (None, "the server failed the request: prompt too long"),  # sent bare: see below
])
def test_an_error_event_says_what_the_server_said(arun, error, want):
    ev = chat_chunks(["a"])[:1] + [{"error": error} if error is not None else {
        "object": "error", "message": "prompt too long", "type": "BadRequestError",
        "param": None, "code": 400}]
    r = one_row(arun, Server(lambda req, n: httpx.Response(200, content=sse(*ev))))
    assert r.finish_reason == "error" and r.error == want and r.text == "a"


@pytest.mark.parametrize("delta,want", [
    ({"content": 5}, "malformed event: its text is 5, not a string"),
    ({"content": {"text": "x"}}, 'malformed event: its text is {"text": "x"}'),
    ({"content": [{"type": "text", "text": 7}]}, "malformed event"),
])
def test_a_malformed_event_ends_its_row_with_one_line(arun, delta, want):
    ev = [{"choices": [{"index": 0, "delta": {"content": "a"}}]},
          {"choices": [{"index": 0, "delta": delta}]}] + chat_chunks([])

    async def main():
        eng = engine(Server(lambda req, n: httpx.Response(
            200, content=sse(*(ev if n == 0 else chat_chunks(["fine"]))))))
        bad = await eng.submit("p")
        good = await eng.submit("q")
        await eng.aclose()
        return bad, good

    bad, good = arun(main)
    assert bad.finish_reason == "error" and want in bad.error and "\n" not in bad.error
    assert bad.text == "a" and good.text == "fine"


def test_content_parts_and_odd_logprobs_are_read(arun):
    parts = [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]
    ev = [{"choices": [{"index": 0, "delta": {"content": parts},
                        "logprobs": {"content": [{"token": "he", "logprob": -0.5,
                                                  "top_logprobs": 3}]}}]},
          {"choices": [{"index": 0, "delta": {"content": "!"},
                        "logprobs": {"content": 7}}]}] + chat_chunks([], finish="stop")
    r = one_row(arun, Server(lambda req, n: httpx.Response(200, content=sse(*ev))))
    assert r.finish_reason == "stop" and r.text == "hello!"


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_server_that_redirects_is_refused_at_connect_with_where_to(status):
    def srv(req):
        return httpx.Response(status, headers={"location": "https://test:8443/v1/models"})

    with pytest.raises(ValueError, match=rf"^http://test:8000/v1 redirects to "
                                         rf"https://test:8443/v1/models \({status}\); "
                                         "connect to that address instead$"):
        RemoteEngine("http://test:8000", _transport=httpx.MockTransport(srv))


def test_a_redirect_on_a_completion_ends_the_row_saying_where_to(arun):
    def later(req, n):
        return httpx.Response(308, headers={"location": "http://test:9000/v1/chat"})

    r = one_row(arun, Server(later))
    assert r.finish_reason == "error"
    assert r.error == ("http://test:8000/v1 redirects to http://test:9000/v1/chat (308); "
                       "connect to that address instead")


def test_a_redirected_metrics_page_only_loses_the_charts():
    def srv(req):
        if req.url.path == "/metrics":
            return httpx.Response(301, headers={"location": "https://elsewhere/metrics"})
        return httpx.Response(200, json={"data": [{"id": "m1"}]})

    eng = RemoteEngine("http://test:8000", _transport=httpx.MockTransport(srv))
    assert eng.model == "m1" and eng.metrics_source is None
    eng.close()
