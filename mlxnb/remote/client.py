"""HTTP to an OpenAI-compatible server: streamed completions, retries, one-line errors.

Built on httpx rather than the official `openai` client: the openai client is itself
a wrapper over httpx, but it types every streamed chunk into pydantic objects (host
time per token, times hundreds of concurrent streams), hides the SSE comment lines
mlx_lm.server uses for prefill progress, passes sampling options other servers
accept but OpenAI does not (top_k, min_p, repetition_penalty) only through
`extra_body`, and does not read `/metrics`. httpx gives the connection pool, the
timeouts and closing a stream on cancel directly, and it is already installed with
Jupyter.

Cancelling the task that awaits `stream()` leaves the `async with` block, which
closes the response before its body is read: the connection is dropped, not
returned to the pool, and the server sees the client go and stops generating.

Every wait on a server is bounded, since a server can accept a connection and then
misbehave in ways a per-read timeout never notices: connecting is one total deadline
(a model list dripped a byte at a time still ends), a stream must deliver output (or
prefill progress) within `timeout` seconds of the last (keep-alive comments alone do
not count), and a line is refused past MAX_LINE bytes before it is held whole.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from typing import Callable, List, Optional
from urllib.parse import urlsplit, urlunsplit

import httpx

from .._text import one_line
from .bodies import read_capped, sse_events
from .wire import (REDIRECTS, ServerError, error_line, error_text, redirect_error,
                   status_error)

# Statuses worth trying again: rate limits and a server (or its proxy) that is
# starting, overloaded or restarting.
RETRY_STATUS = {429, 502, 503, 504}
# Connection-level failures before any token arrived: nothing was generated for us,
# so sending the request again cannot duplicate text.
RETRY_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)


# A streamed line past this ends its row: the longest real events (a token with many
# top logprobs, a usage block) are a few kB, and an unbounded one would be held in
# memory whole before it could be parsed.
MAX_LINE = 1 << 20
# Error bodies and model lists: enough for any real one, bounded against a server
# that never stops sending.
MAX_BODY = 4 << 20
# Connecting (the model list, then /metrics) ends within this many seconds, or within
# the row timeout when that is shorter: the cell that connects waits meanwhile.
PROBE_S = 5.0
# A row's timeout check that runs this late (s) found the loop held, not the server
# silent: it looks again that much later, after the stream has read what came.
LATE_S = 0.5


class EndStream(Exception):
    """Raised by an `on_data` callback to close the stream at once (the row has all
    it asked for); `stream()` then returns normally."""


def check_timeout(timeout) -> float:
    """A positive, finite number of seconds; ValueError (one line) otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds (e.g. 60); got "
                         f"{timeout!r}")
    return float(timeout)


def normalize_url(url: str) -> str:
    """`http://host:8000` or `http://host:8000/v1/` -> `http://host:8000/v1`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("give the server's address, e.g. http://localhost:8000/v1")
    try:
        u = urlsplit(url.strip())
    except ValueError as e:  # e.g. an unclosed [ of an IPv6 address
        raise ValueError(f"cannot read the server's address ({e}); write e.g. "
                         "http://localhost:8000/v1") from None
    shown = urlunsplit(u._replace(netloc=u.netloc.rpartition("@")[2]))  # no password
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"{shown!r} is not an http(s) address; write e.g. "
                         "http://localhost:8000/v1")
    try:
        port = u.port  # ValueError: not a number, or past 65535
    except ValueError:
        port = 0
    if not u.hostname or port == 0:
        raise ValueError(f"{shown!r} has no valid host and port (ports are 1-65535); "
                         "write e.g. http://localhost:8000/v1")
    path = u.path.rstrip("/") or "/v1"
    return urlunsplit((u.scheme, u.netloc, path, "", ""))


def server_root(base: str) -> str:
    u = urlsplit(base)
    return urlunsplit((u.scheme, u.netloc, "", "", ""))


class Client:
    """One server: its address, credentials, connection pool and retry policy.

    The API key lives only in the request headers of this object; no message,
    repr, run file or widget state ever holds it (errors are scrubbed of it too)."""

    def __init__(self, url: str, api_key: Optional[str] = None, *, max_connections: int = 64,
                 timeout: float = 60.0, connect_timeout: float = 10.0, retries: int = 4,
                 backoff_s: float = 0.5, connect_backoff_s: float = 0.1,
                 backoff_max_s: float = 8.0, transport=None):
        self.base = normalize_url(url)
        self.root = server_root(self.base)
        # what messages show: user:password@ in an address is a credential too
        u = urlsplit(self.base)
        self.shown = urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, "", ""))
        # A key read from a file often ends in a newline; inside, a line break or any
        # non-ASCII character cannot go in a header (h11 would quote it in errors).
        if api_key is not None and not isinstance(api_key, str):
            raise ValueError(f"api_key must be a string, got {type(api_key).__name__}")
        self._key = (api_key or "").strip() or None
        if self._key and not (self._key.isascii() and self._key.isprintable()):
            raise ValueError("the API key holds a character an HTTP header cannot carry "
                             "(a line break, a control or a non-ASCII character); check "
                             "the key's value")
        if self._key and "@" in u.netloc:  # httpx would send the address's instead
            raise ValueError(f"{self.shown} is given with user:password@ and an API key; "
                             "give one of them")
        self._headers = {"Accept": "text/event-stream"}
        if self._key:
            self._headers["Authorization"] = f"Bearer {self._key}"
        # The longest wait for a stream's next output. httpx's read timeout is per
        # read, so a server trickling keep-alive comments would reset it forever:
        # `stream()` keeps its own deadline, moved only by output or prefill progress.
        # A request queued on a busy server says nothing until its first token, so
        # until then output on any stream of this client counts too (the server is
        # working, just not on this row yet); a stuck server still times out.
        self.timeout = check_timeout(timeout)
        self.last_output = -math.inf  # loop time of the last output on any stream
        self.max_line = MAX_LINE
        # (so no read timeout here: it would end a queued row the watchdog keeps)
        self._timeout = httpx.Timeout(connect=min(connect_timeout, self.timeout),
                                      read=None, write=30.0, pool=None)
        # One connection more than the streams may take (the engine bounds those):
        # the charts' /metrics page must not wait behind a full batch.
        self._limits = httpx.Limits(max_connections=max_connections + 1,
                                    max_keepalive_connections=max_connections + 1)
        self.retries = retries
        # A busy server's 429/503 asks for a real pause; a refused or reset connection
        # is most often a burst of new connections overflowing a small listen backlog
        # (mlx_lm.server's is 5, and it closes every connection after one response),
        # which a quick retry gets through.
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.connect_backoff_s = connect_backoff_s
        self.retried = 0  # retries so far (status: how often the server pushed back)
        self._http: Optional[httpx.AsyncClient] = None
        self._transport = transport  # tests: an httpx.MockTransport

    def __repr__(self):
        return f"<mlxnb.remote.Client {self.shown}{' (with API key)' if self._key else ''}>"

    def scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def scrub_bytes(self, body: bytes) -> bytes:
        """A body with the key taken out: before any cut, which could leave part."""
        return body.replace(self._key.encode(), b"***") if self._key else body

    def _client(self) -> httpx.AsyncClient:
        if self._http is None or self._http.is_closed:
            self._http = httpx.AsyncClient(headers=self._headers, timeout=self._timeout,
                                           limits=self._limits, transport=self._transport)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    # -- errors ----------------------------------------------------------------------
    def http_error(self, status: int, body: bytes, model: Optional[str]) -> ServerError:
        # scrubbed as sent and as decoded (JSON may escape the key), then cut
        msg = one_line(self.scrub(error_text(self.scrub_bytes(body), 4000)), 200)
        return status_error(status, msg, model, self.shown)

    def _delay(self, attempt: int, retry_after: Optional[str], base: float) -> float:
        self.retried += 1
        if retry_after:
            try:
                return min(float(retry_after), 30.0)
            except ValueError:
                pass
        d = min(self.backoff_max_s, base * 2 ** attempt)
        return d * (0.5 + random.random() / 2)  # jitter: retries do not arrive in lockstep

    # -- streaming -------------------------------------------------------------------
    async def stream(self, path: str, body: dict, on_data: Callable[[dict], bool],
                     on_comment: Optional[Callable[[str], bool]] = None) -> None:
        """POST `body` to `path` with stream=True; call `on_data(obj)` per SSE event
        and `on_comment(text)` per SSE comment line. `on_data` returns True once the
        event carried output: from then on a failure is not retried (the text
        already shown would come again); it raises EndStream to close the stream.
        Output, or a comment for which `on_comment` returns True (progress), moves
        the deadline for the next one `timeout` s ahead. Raises ServerError (one
        line)."""
        url = self.base + path
        attempt, started = 0, [False]
        while True:
            try:
                retry = await self._attempt(url, body, on_data, on_comment, attempt, started)
                if retry is None:
                    return
                await asyncio.sleep(retry)
                attempt += 1
            except RETRY_ERRORS as e:
                if started[0]:
                    raise ServerError(f"the connection to the server broke mid-stream "
                                      f"({_why(e)}); the text so far is kept") from None
                if attempt >= self.retries:
                    raise ServerError(f"could not reach the server at {self.shown} after "
                                      f"{attempt + 1} attempts ({_why(e)}); check that it "
                                      "is running, then submit again") from None
                await asyncio.sleep(self._delay(attempt, None, self.connect_backoff_s))
                attempt += 1
            except (TimeoutError, httpx.TimeoutException):
                more = "more " if started[0] else ""
                raise ServerError(
                    f"the server sent no {more}tokens for {self.timeout:g} s (keep-alive comments "
                    "do not count); it may be stuck or overloaded: try again, or raise "
                    "--timeout in %mlxnb connect (timeout= in mlxnb.connect)") from None
            except httpx.HTTPError as e:
                raise ServerError(f"request failed: {_why(e)}") from None

    async def _attempt(self, url, body, on_data, on_comment, attempt, started):
        """One request. None when the stream ended; seconds to wait before trying
        again on a status worth retrying."""
        loop = asyncio.get_running_loop()
        last = loop.time()  # of this stream's last output or progress

        def watchdog(at):
            nonlocal check
            now = loop.time()
            due = (last if started[0] else max(last, self.last_output)) + self.timeout
            if now >= due and now - at < LATE_S:
                deadline.reschedule(now)  # ends the block with TimeoutError
            else:  # re-armed when due, not per token: output only sets `last`. Late,
                # the loop was held (a cell blocking it): the stream first reads what
                # the server sent meanwhile.
                nxt = due if now < due else now + LATE_S
                check = loop.call_at(nxt, watchdog, nxt)

        check = loop.call_at(last + self.timeout, watchdog, last + self.timeout)
        try:
            async with asyncio.timeout(None) as deadline:
                async with self._client().stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        data = await read_capped(resp, MAX_BODY)
                        if resp.status_code in RETRY_STATUS and attempt < self.retries:
                            return self._delay(attempt, resp.headers.get("retry-after"),
                                               self.backoff_s)
                        if resp.status_code in REDIRECTS:
                            raise redirect_error(resp.status_code, self.scrub(
                                resp.headers.get("location", "")), self.shown)
                        raise self.http_error(resp.status_code, data, body.get("model"))
                    other: List[str] = []  # lines no event stream has: what it is instead
                    async for kind, value in sse_events(resp, self.max_line):
                        if kind == "comment":
                            if on_comment is not None and on_comment(value.strip()):
                                last = self.last_output = loop.time()
                            continue
                        if kind == "error":  # llama.cpp's failure mid-stream
                            on_data({"error": error_line(value.strip())})
                            continue
                        if kind == "other":
                            if len(other) < 64:
                                other.append(value)
                            continue
                        payload = value.strip()  # an event's data, its lines joined
                        if payload == "[DONE]":
                            return None
                        if not payload:  # an empty data field dispatches nothing
                            continue
                        try:
                            obj = json.loads(payload)
                        except ValueError:  # (long: the engine scrubs the key, then cuts)
                            raise ServerError("the server sent a stream event that is not "
                                              f"JSON: {payload[:2000]!r}") from None
                        try:
                            output = on_data(obj)
                        except EndStream:
                            return None  # leaving the block drops the connection
                        if output:
                            started[0] = True
                            last = self.last_output = loop.time()
                    if other and not started[0]:  # e.g. a JSON error, a sign-in page
                        raise ServerError("the server's answer is not an event stream: "
                                          + error_text("\n".join(other).encode(), 4000))
                    return None  # ended without [DONE]: the caller checks the finish
        finally:
            check.cancel()

    async def get_text(self, path_from_root: str, timeout: float = 2.0) -> Optional[str]:
        """GET a page under the server root; None for anything but a 200 within
        `timeout` s in all (a page trickled forever would stall the charts)."""
        async def get():
            async with self._client().stream("GET", self.root + path_from_root,
                                             headers={"Accept": "text/plain"}) as r:
                if r.status_code != 200:
                    return None
                return (await read_capped(r, MAX_BODY)).decode("utf-8", "replace")

        try:
            return await asyncio.wait_for(get(), timeout)
        except (httpx.HTTPError, TimeoutError):
            return None

    # -- connect-time probe ------------------------------------------------------------
    def probe(self, bound: Optional[float] = None):
        """(model ids or None when the server lists none, /metrics text or None).
        Raises ValueError (one line) when the server cannot be reached, answers
        nothing within `bound` s in total (default: PROBE_S, or the row timeout when
        shorter), or refuses the key.

        It runs on a thread of its own with a loop of its own: never on the engine's
        (the kernel's) loop, and a server that holds the connection cannot hold the
        caller past the bound."""
        bound = min(PROBE_S, self.timeout) if bound is None else check_timeout(bound)
        out: dict = {}

        def work():
            try:
                out["ok"] = asyncio.run(self._probe(bound))
            except BaseException as e:  # handed to the caller below
                out["err"] = e

        th = threading.Thread(target=work, name="mlxnb-connect", daemon=True)
        th.start()
        th.join(bound + 2.0)  # wait_for has already given up by then; a margin only
        err = out.get("err")
        if "ok" in out:
            return out["ok"]
        if err is None or isinstance(err, (TimeoutError, httpx.TimeoutException)):
            raise ValueError(f"{self.shown} did not answer within {bound:g} s; check that "
                             "the server is up and not overloaded, or raise --timeout in "
                             "%mlxnb connect (timeout= in mlxnb.connect)")
        if isinstance(err, ValueError):
            raise ValueError(str(err)) from None
        # httpx's errors, and anything the transport raised unwrapped (an OS error,
        # an exception group): a failed connect, said in one line, not a crash.
        raise ValueError(f"could not connect to {self.shown} ({_why(err)}); check "
                         "the address and that the server is running") from (
            None if isinstance(err, httpx.HTTPError) else err)

    async def _probe(self, bound: float):
        loop = asyncio.get_running_loop()
        end = loop.time() + bound

        async def get(url, **kw):
            async with c.stream("GET", url, **kw) as r:
                if r.status_code in REDIRECTS:  # the body says nothing more
                    return r.status_code, self.scrub(r.headers.get("location", ""))
                return r.status_code, await read_capped(r, MAX_BODY)

        async with httpx.AsyncClient(headers=self._headers, timeout=self._timeout,
                                     transport=self._transport) as c:
            models, metrics = None, None
            try:
                status, body = await asyncio.wait_for(get(self.base + "/models"), bound)
            except (httpx.ConnectError, httpx.TimeoutException):
                raise
            except httpx.HTTPError:  # it answered, but not with a model list
                status, body = None, b""
            if status in REDIRECTS:
                raise ValueError(str(redirect_error(status, body, self.shown)))
            if status in (401, 403):
                raise ValueError(str(self.http_error(status, body, None)))
            if status == 200:
                try:
                    data = json.loads(body).get("data")
                    models = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
                except (ValueError, AttributeError, TypeError, KeyError):
                    models = None
            # Optional (charts only): what is left of the bound, and a server whose
            # page does not come in time is served all the same, without charts.
            try:
                status, page = await asyncio.wait_for(
                    get(self.root + "/metrics", headers={"Accept": "text/plain"}),
                    max(end - loop.time(), 0.05))
                if status == 200:
                    metrics = page.decode("utf-8", "replace")
            except (httpx.HTTPError, TimeoutError):
                metrics = None
        return (models or None), metrics


def _why(e: BaseException) -> str:
    s = one_line(str(e), 200)
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


def model_list_text(models: List[str], n: int = 5) -> str:
    shown = ", ".join(repr(m) for m in models[:n])
    return shown + (f" and {len(models) - n} more" if len(models) > n else "")
