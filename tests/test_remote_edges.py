"""The server engine against servers that misbehave, on loopback: one that accepts and
never answers, one that drips its model list a byte at a time, one that answers 200
and then says nothing (or only keep-alive comments), one line that never ends, and
tokens past max_tokens. Each ends by itself, quickly, with one line saying what to
do, and the event loop keeps running meanwhile.

The servers are plain sockets in a thread, each bounded in time (HOLD_S), so a
client that does not give up makes its test fail instead of hang."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import tracemalloc

import pytest

from mlxnb.remote import connect

HOLD_S = 6.0  # longest any misbehaving server keeps a connection
MODELS = json.dumps({"data": [{"id": "m1"}]}).encode()
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")


def token(text: str, finish=None) -> bytes:
    ev = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(ev)}\n\n".encode()


class Loopback:
    """A TCP server on 127.0.0.1: GET /v1/models lists "m1" (or `models(srv, conn)`
    answers it), /metrics is 404 (or `metrics(srv, conn)`), and a completion request goes to
    `completion(srv, conn)`. `srv.left` is set once a write finds the client gone."""

    def __init__(self, completion=None, models=None, metrics=None):
        self.completion, self.models, self.metrics = completion, models, metrics
        self.stop, self.left = threading.Event(), threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in list(self.threads):
            t.join(timeout=HOLD_S + 2)
        self.sock.close()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn):
        with conn:
            conn.settimeout(HOLD_S)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                head, _, body = head.partition(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        n = int(v)
                while len(body) < n:
                    body += conn.recv(65536)
                path = head.split(b" ")[1].decode()
                if path.endswith("/models"):
                    if self.models is not None:
                        return self.models(self, conn)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                                 % len(MODELS) + MODELS)
                elif path.endswith("/metrics") and self.metrics is not None:
                    self.metrics(self, conn)
                elif path.endswith("/metrics") or self.completion is None:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                else:
                    self.completion(self, conn)
            except OSError:
                self.left.set()

    def hold(self, until: float) -> bool:
        """Wait a little; False once the test is over or HOLD_S has passed."""
        return not self.stop.wait(0.05) and time.monotonic() < until


# -- the servers ---------------------------------------------------------------------
def never_answer(srv, conn):
    until = time.monotonic() + HOLD_S
    while srv.hold(until):
        pass


def drip_bytes(srv, conn):
    """A valid 200 whose body comes a byte every 0.1 s."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\nConnection: close\r\n\r\n")
    until = time.monotonic() + HOLD_S
    while srv.hold(until):
        conn.sendall(b" ")
        time.sleep(0.05)


def silent_200(srv, conn):
    conn.sendall(SSE_HEAD)
    never_answer(srv, conn)


def pings_forever(srv, conn):
    conn.sendall(SSE_HEAD)
    until = time.monotonic() + HOLD_S
    while srv.hold(until):
        conn.sendall(b": ping\n\n")


def empty_events_forever(srv, conn):
    """Events that carry no output (a keep-alive in data form)."""
    conn.sendall(SSE_HEAD)
    until = time.monotonic() + HOLD_S
    while srv.hold(until):
        conn.sendall(b'data: {"choices": []}\n\n')


def slow_prefill_then_tokens(srv, conn):
    """mlx_lm.server's prefill progress for 2 s, then the answer."""
    conn.sendall(SSE_HEAD)
    for i in range(1, 9):
        time.sleep(0.25)
        conn.sendall(b": keepalive %d/8\n\n" % i)
    conn.sendall(token("ok") + token("", "stop") + b"data: [DONE]\n\n")


def one_at_a_time(lock):
    """Serves one request at a time, as mlx_lm.server does seeded ones: tokens for
    2 s, then the next request is let in."""
    def serve(srv, conn):
        with lock:
            conn.sendall(SSE_HEAD)
            for i in range(20):
                time.sleep(0.1)
                conn.sendall(token(f"{i} "))
            conn.sendall(token("", "stop") + b"data: [DONE]\n\n")
    return serve


def endless_line(srv, conn):
    """One `data:` line of 64 MB, sent as fast as the client reads it."""
    conn.sendall(SSE_HEAD + b"data: ")
    block = b"x" * 65536
    until = time.monotonic() + HOLD_S
    for _ in range(1024):
        if srv.stop.is_set() or time.monotonic() > until:
            return
        conn.sendall(block)



def endless_event(srv, conn):
    """`data:` lines of 64 kB each, 64 MB of them, and never the blank line that would
    end their event."""
    conn.sendall(SSE_HEAD)
    line = b"data: " + b"x" * 65530 + b"\n"
    until = time.monotonic() + HOLD_S
    for _ in range(1024):
        if srv.stop.is_set() or time.monotonic() > until:
            return
        conn.sendall(line)


def send_apart(conn, chunks):
    """Each chunk in a write of its own, a little apart, so that the client reads
    them one by one: a network chunk ends where each ends."""
    conn.sendall(SSE_HEAD)
    for c in chunks:
        time.sleep(0.05)
        conn.sendall(c)


def cr_line_ends(srv, conn):
    """Lines ended by a bare CR, which the SSE spec allows as LF and CRLF are."""
    send_apart(conn, [x.replace(b"\n", b"\r") for x in
                      (token("a"), token("b"), token("", "stop"), b"data: [DONE]\n\n")])


def one_event_over_lines_and_chunks(srv, conn):
    """One JSON event over three `data:` lines (its data: the lines joined with LF),
    CRLF ended, in chunks that part a CRLF between its CR and its LF and cut a line in
    two; then the finish as usual."""
    ev = json.dumps({"choices": [{"index": 0, "delta": {"content": "split"},
                                  "finish_reason": None}]}).encode()
    i, j = ev.index(b"["), ev.index(b'"delta"')  # (a line break inside a string is no JSON)
    body = (b"data: " + ev[:i] + b"\r\ndata:" + ev[i:j] + b"\r\ndata: " + ev[j:] + b"\r\n\r\n"
            + (token("", "stop") + b"data: [DONE]\n\n").replace(b"\n", b"\r\n"))
    cuts = [0, body.index(b"\r") + 1, body.index(b"data:", 10) + 9,
            body.index(b"\r\n\r\n") + 3, len(body)]
    send_apart(conn, [body[a:b] for a, b in zip(cuts, cuts[1:])])


def tokens_forever(srv, conn):
    """Tokens every 10 ms, whatever max_tokens said, until the client goes."""
    conn.sendall(SSE_HEAD)
    until = time.monotonic() + HOLD_S
    i = 0
    while time.monotonic() < until and not srv.stop.is_set():
        conn.sendall(token(f"t{i} "))
        i += 1
        time.sleep(0.01)


# -- helpers ---------------------------------------------------------------------------
def arun_bounded(arun, fn, *args, **kw):
    return arun(lambda: fn(*args, **kw), timeout=HOLD_S + 4)


async def ticks_while(aw, every=0.05):
    """Await `aw` while a trivial coroutine runs every `every` s; returns (result or
    exception, the longest gap between ticks): the loop's responsiveness meanwhile."""
    loop = asyncio.get_running_loop()
    gaps, last = [], [loop.time()]

    async def tick():
        while True:
            await asyncio.sleep(every)
            gaps.append(loop.time() - last[0])
            last[0] = loop.time()

    t = asyncio.ensure_future(tick())
    try:
        out = await aw
    except Exception as e:
        out = e
    finally:
        t.cancel()
    return out, max(gaps, default=0.0)


async def one_row(url, timeout, **params):
    eng = connect(url, timeout=timeout)
    t0 = time.monotonic()
    try:
        row = eng.submit("p", **params)
        _, gap = await ticks_while(row)
        return row, time.monotonic() - t0, gap
    finally:
        await eng.aclose()


# -- connect -----------------------------------------------------------------------------
@pytest.mark.parametrize("server", [never_answer, drip_bytes], ids=["silent", "drip"])
def test_connect_to_a_stuck_server_ends_within_its_timeout(server):
    """A server that accepts and never answers, or drips its model list: connect gives
    up after its total bound (not per read), and it never holds the engine's loop."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    try:
        with Loopback(models=server) as srv:
            t0 = time.monotonic()
            ran = []
            loop.call_soon_threadsafe(lambda: loop.call_later(
                0.3, lambda: ran.append(time.monotonic() - t0)))
            with pytest.raises(ValueError) as e:
                connect(srv.url, timeout=1, loop=loop)
            took = time.monotonic() - t0
        assert took < 2.5, f"connect took {took:.1f} s with timeout=1"
        msg = str(e.value)
        assert "\n" not in msg and srv.url in msg and "did not answer" in msg, msg
        assert ran and ran[0] < 1.0  # the loop ran meanwhile
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
        loop.close()


def test_connect_magic_never_holds_the_kernel_and_reports_a_stuck_server(ip):
    """`%mlxnb connect` returns within CONNECT_WAIT_S whatever the server does (the
    probe goes on on its own thread); %%generate meanwhile says it is still
    connecting, and once the probe's bound (--timeout 3) has passed the next magic
    reports why, in one line, once."""
    from IPython.core.error import UsageError

    from mlxnb.notebook import magics

    with Loopback(models=never_answer) as srv:
        t0 = time.monotonic()
        ip.run_line_magic("mlxnb", f"connect {srv.url} --timeout 3")
        took = time.monotonic() - t0
        with pytest.raises(UsageError) as busy:
            ip.run_cell_magic("generate", "--max-tokens 2 --quiet", "hi")
        end, e = time.monotonic() + 20, None
        while e is None:  # the probe's verdict, in status
            try:
                ip.run_line_magic("mlxnb", "status")
            except UsageError as err:
                e = err
            assert time.monotonic() < end, "the probe never gave up"
            time.sleep(0.2)
        ip.run_line_magic("mlxnb", "status")  # reported once
    assert took < 2.0, f"%mlxnb connect held the kernel {took:.1f} s"
    assert "still connecting" in str(busy.value) and "\n" not in str(busy.value)
    msg = str(e)
    assert "\n" not in msg and "did not answer" in msg and "--timeout" in msg, msg
    assert magics.get_engine() is None


def test_unload_stops_a_connection_under_way(ip, capsys):
    from mlxnb.notebook import magics

    served = threading.Event()

    def late_models(srv, conn):  # answers after the connect magic has returned
        time.sleep(1.0)
        body = json.dumps({"data": [{"id": "m1"}]}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        served.set()

    with Loopback(models=late_models) as srv:
        ip.run_line_magic("mlxnb", f"connect {srv.url} --timeout 3")
        ip.run_line_magic("mlxnb", "unload")
        assert "stopped connecting to" in capsys.readouterr().out
        assert served.wait(5)
        time.sleep(0.3)  # the probe's answer is in
        ip.run_line_magic("mlxnb", "status")
    assert magics.get_engine() is None and magics._S.connecting is None
    assert "no model loaded yet" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "x", "nan", "inf", "1,2"])
def test_connect_timeout_mistakes_are_one_line_usage_errors(ip, value):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as e:
        ip.run_line_magic("mlxnb", f"connect http://127.0.0.1:9 --timeout {value}")
    msg = str(e.value)
    assert "--timeout" in msg and "\n" not in msg and "unrecognized" not in msg, msg


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "5", True])
def test_connect_refuses_a_bad_timeout_before_connecting(value):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        connect("http://127.0.0.1:9", timeout=value, loop=asyncio.new_event_loop())


def test_a_trickled_metrics_page_does_not_stall_the_charts(arun):
    """The charts read /metrics while rows stream; a page dripped forever is given up
    on within its timeout (and its size is bounded); connecting goes on without it."""
    async def main(url):
        eng = connect(url, timeout=1)
        try:
            t0 = time.monotonic()
            text, gap = await ticks_while(eng.client.get_text("/metrics", timeout=0.5))
            return text, time.monotonic() - t0, gap
        finally:
            await eng.aclose()

    with Loopback(metrics=drip_bytes) as srv:
        text, took, gap = arun_bounded(arun, main, srv.url)
    assert text is None and took < 1.5 and gap < 1.0, (text, took)


def test_the_charts_read_metrics_while_every_slot_streams(arun):
    """Both streams allowed stream until the server has served a /metrics page: only
    if the charts can fetch it beside a full batch do the rows end early."""
    served, streaming = threading.Event(), []

    def metrics(srv, conn):
        body = b"vllm:num_requests_running 1\n"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                     b"%d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        if len(streaming) == 2:  # (not the page read at connect)
            served.set()

    def completion(srv, conn):
        conn.sendall(SSE_HEAD)
        streaming.append(conn)
        end = time.monotonic() + 4
        while not served.is_set() and time.monotonic() < end:
            conn.sendall(token("x"))
            time.sleep(0.05)
        conn.sendall(token("", "stop") + b"data: [DONE]\n\n")

    async def main(url):
        eng = connect(url, max_concurrency=2, loop=asyncio.get_running_loop())
        eng.sample_s = 0.05
        try:
            t0 = time.monotonic()
            res = await eng.generate(["p", "q"], max_tokens=1000)
            return res[1], time.monotonic() - t0, served.is_set()
        finally:
            await eng.aclose()

    with Loopback(completion=completion, metrics=metrics) as srv:
        row, took, ok = arun_bounded(arun, main, srv.url)
    assert ok and row.finish_reason == "stop" and took < 2.0, (took, row.finish_reason)


# -- rows ----------------------------------------------------------------------------------
def test_a_silent_stream_ends_the_row_after_the_timeout(arun):
    with Loopback(silent_200) as srv:
        res, took, gap = arun_bounded(arun, one_row, srv.url, 1)
    assert took < 3 and gap < 1.0
    assert res.finish_reason == "error" and "raise --timeout" in res.error, res.error
    assert "\n" not in res.error


@pytest.mark.parametrize("server", [pings_forever, empty_events_forever],
                         ids=["comments", "empty-events"])
def test_keep_alive_comments_do_not_keep_a_row_forever(arun, server):
    with Loopback(server) as srv:
        res, took, gap = arun_bounded(arun, one_row, srv.url, 1)
    assert took < 3, f"the row lasted {took:.1f} s on keep-alive comments alone"
    assert res.finish_reason == "error" and "raise --timeout" in res.error, res.error


def test_prefill_progress_counts_as_the_server_working(arun):
    with Loopback(slow_prefill_then_tokens) as srv:
        row, took, gap = arun_bounded(arun, one_row, srv.url, 1)
    assert (row.finish_reason, row.error, row.text) == ("stop", None, "ok")
    assert took > 1.5  # it outlived its timeout on progress alone


def test_a_row_queued_behind_others_waits_while_they_stream(arun):
    """Before its first token a row waits as long as the server streams to others:
    a server that queues requests says nothing to the ones it has not started."""
    async def main(url):
        eng = connect(url, timeout=1)
        try:
            return await eng.generate(["a", "b"], max_tokens=50)
        finally:
            await eng.aclose()

    with Loopback(one_at_a_time(threading.Lock())) as srv:
        res = arun_bounded(arun, main, srv.url)
    assert [(r.finish_reason, r.error) for r in res] == [("stop", None)] * 2


def test_tokens_past_max_tokens_end_the_row_at_length(arun):
    with Loopback(tokens_forever) as srv:
        res, took, gap = arun_bounded(arun, one_row, srv.url, 5, max_tokens=5)
        left = srv.left.wait(2)
    assert took < 3, f"the row went on {took:.1f} s past max_tokens"
    assert res.finish_reason == "length" and res.ntok == 5, (res.finish_reason, res.ntok)
    assert res.text == "t0 t1 t2 t3 t4 "
    assert left, "the stream was not closed"


@pytest.mark.parametrize("server, what", [(endless_line, "line"), (endless_event, "event")],
                         ids=["line", "event"])
def test_an_endless_line_ends_the_row_with_memory_flat(arun, server, what):
    tracemalloc.start()
    try:
        with Loopback(server) as srv:
            res, took, gap = arun_bounded(arun, one_row, srv.url, 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res.finish_reason == "error" and f"{what} longer than" in res.error, res.error
    assert "\n" not in res.error and gap < 1.0
    assert peak < 16 << 20, f"reading the {what} took {peak / 2**20:.0f} MB"


@pytest.mark.parametrize("server, text", [(cr_line_ends, "ab"),
                                          (one_event_over_lines_and_chunks, "split")],
                         ids=["cr-line-ends", "one-event-over-lines-and-chunks"])
def test_event_streams_the_sse_spec_allows_are_read_whatever_the_chunks(arun, server, text):
    """Line ends and `data:` lines as the spec reads them: https://html.spec.whatwg.org/
    multipage/server-sent-events.html#event-stream-interpretation"""
    with Loopback(server) as srv:
        row, took, gap = arun_bounded(arun, one_row, srv.url, 5)
    assert (row.finish_reason, row.error, row.text) == ("stop", None, text)


def test_the_magic_passes_its_timeout_to_rows(ip, arun):
    from mlxnb.notebook import magics

    async def main():
        try:
            ip.run_line_magic("mlxnb", f"connect {srv.url} --timeout 1")
            run = ip.run_cell_magic("generate", "--max-tokens 5 --quiet", "one")
            t0 = time.monotonic()
            res = await run
            return res, time.monotonic() - t0
        finally:
            await magics.shutdown()

    with Loopback(silent_200) as srv:
        res, took = arun_bounded(arun, main)
    assert took < 3 and "raise --timeout" in res[0].error, res[0].error


@pytest.fixture
def ip():
    from IPython.core.interactiveshell import InteractiveShell

    from mlxnb.notebook import magics

    shell = InteractiveShell.instance()
    magics.load_ipython_extension(shell)
    yield shell
    magics.unload_ipython_extension(shell)
    magics._S.config = None
    assert magics._S.engine is None, "a test left its engine open"



def test_lines_are_split_bounded_and_linear_whatever_the_chunks(arun):
    import httpx

    from mlxnb.remote.bodies import sse_lines
    from mlxnb.remote.wire import ServerError

    class Chunks(httpx.AsyncByteStream):
        def __init__(self, chunks):
            self.chunks = chunks

        async def __aiter__(self):
            for c in self.chunks:
                yield c

    async def lines(chunks, limit=64):
        resp = httpx.Response(200, stream=Chunks(chunks))
        return [x async for x in sse_lines(resp, limit)]

    body = "data: é1\r\n\n: c\ndata: 2".encode()
    want = ["data: é1", "", ": c", "data: 2"]
    assert arun(lines, [body]) == want
    assert arun(lines, [body[i:i + 1] for i in range(len(body))]) == want  # a byte at a time
    with pytest.raises(ServerError, match="line longer than"):
        arun(lines, [b"x" * 65 + b"\n"])
    t0 = time.perf_counter()
    with pytest.raises(ServerError, match="line longer than 256 kB"):
        arun(lines, [b"y"] * 300_000, 256 << 10)  # a long line dripped: not quadratic
    assert time.perf_counter() - t0 < 5
