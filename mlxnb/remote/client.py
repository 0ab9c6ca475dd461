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
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Callable, List, Optional
from urllib.parse import urlsplit, urlunsplit

import httpx

from .._text import one_line

# Statuses worth trying again: rate limits and a server (or its proxy) that is
# starting, overloaded or restarting.
RETRY_STATUS = {429, 502, 503, 504}
# Connection-level failures before any token arrived: nothing was generated for us,
# so sending the request again cannot duplicate text.
RETRY_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)


class ServerError(Exception):
    """A request the server refused or could not serve; the message is one line."""


def normalize_url(url: str) -> str:
    """`http://host:8000` or `http://host:8000/v1/` -> `http://host:8000/v1`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("give the server's address, e.g. http://localhost:8000/v1")
    u = urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"{url!r} is not an http(s) address; write e.g. "
                         "http://localhost:8000/v1")
    path = u.path.rstrip("/") or "/v1"
    return urlunsplit((u.scheme, u.netloc, path, "", ""))


def server_root(base: str) -> str:
    u = urlsplit(base)
    return urlunsplit((u.scheme, u.netloc, "", "", ""))


def error_text(body: bytes, limit: int = 200) -> str:
    """The message in an error body: {"error": "..."} (mlx_lm), {"error": {"message":
    ...}} (OpenAI, vLLM, llama.cpp), {"message"|"detail": ...}, or the raw text."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("msg") or err.get("detail")
            if msg is None and isinstance(obj.get("detail"), (str, list)):
                msg = obj["detail"]
        elif err is not None:
            msg = err
    if msg is None:
        msg = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    return one_line(msg, limit)


class Client:
    """One server: its address, credentials, connection pool and retry policy.

    The API key lives only in the request headers of this object; no message,
    repr, run file or widget state ever holds it (errors are scrubbed of it too)."""

    def __init__(self, url: str, api_key: Optional[str] = None, *, max_connections: int = 64,
                 timeout: float = 300.0, connect_timeout: float = 10.0, retries: int = 4,
                 backoff_s: float = 0.5, connect_backoff_s: float = 0.1,
                 backoff_max_s: float = 8.0, transport=None):
        self.base = normalize_url(url)
        self.root = server_root(self.base)
        # what messages show: user:password@ in an address is a credential too
        u = urlsplit(self.base)
        self.shown = urlunsplit((u.scheme, u.netloc.rpartition("@")[2], u.path, "", ""))
        self._key = api_key or None
        self._headers = {"Accept": "text/event-stream"}
        if self._key:
            self._headers["Authorization"] = f"Bearer {self._key}"
        # read: the longest silence between two streamed lines (a queued or long
        # prefill request on a busy server says nothing until its first token)
        self._timeout = httpx.Timeout(connect=connect_timeout, read=timeout, write=30.0,
                                      pool=None)
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
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
        msg = self.scrub(error_text(body))
        if status in (401, 403):
            return ServerError(
                f"the server refused the API key ({status}: {msg}); give the right key "
                "with --api-key-env VAR (an environment variable holding it) or api_key=")
        if status == 404:
            # A bare "Not Found" is a missing endpoint; any other 404 from a completion
            # endpoint is about the model (mlx_lm.server answers 404 when it cannot
            # load the model asked for; vLLM: "The model `x` does not exist.").
            if model and msg.strip().lower().strip(".") not in ("not found", "404 page not found"):
                return ServerError(f"the server does not know model {model!r} ({msg}); "
                                   "connect again with --model set to a model it serves")
            return ServerError(f"{self.shown} has no such endpoint (404: {msg}); check "
                               "the address (OpenAI-compatible servers answer under /v1)")
        if status in (400, 422):
            return ServerError(f"the server rejected the request: {msg}")
        return ServerError(f"the server answered {status}: {msg}")

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
                     on_comment: Optional[Callable[[str], None]] = None) -> None:
        """POST `body` to `path` with stream=True; call `on_data(obj)` per SSE event
        and `on_comment(text)` per SSE comment line. `on_data` returns True once the
        event carried output: from then on a failure is not retried (the text
        already shown would come again). Raises ServerError (one line)."""
        url = self.base + path
        attempt, started = 0, False
        while True:
            try:
                async with self._client().stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        data = await resp.aread()
                        if resp.status_code in RETRY_STATUS and attempt < self.retries:
                            await asyncio.sleep(self._delay(
                                attempt, resp.headers.get("retry-after"), self.backoff_s))
                            attempt += 1
                            continue
                        raise self.http_error(resp.status_code, data, body.get("model"))
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        if line.startswith(":"):
                            if on_comment is not None:
                                on_comment(line[1:].strip())
                            continue
                        if not line.startswith("data:"):
                            continue  # event:, id:, retry: fields carry nothing we use
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            return
                        try:
                            obj = json.loads(payload)
                        except ValueError:
                            raise ServerError("the server sent a stream line that is not "
                                              f"JSON: {payload[:80]!r}") from None
                        if on_data(obj):
                            started = True
                    return  # the stream ended without [DONE]: the caller checks the finish
            except RETRY_ERRORS as e:
                if started:
                    raise ServerError(f"the connection to the server broke mid-stream "
                                      f"({_why(e)}); the text so far is kept") from None
                if attempt >= self.retries:
                    raise ServerError(f"could not reach the server at {self.shown} after "
                                      f"{attempt + 1} attempts ({_why(e)}); check that it "
                                      "is running, then submit again") from None
                await asyncio.sleep(self._delay(attempt, None, self.connect_backoff_s))
                attempt += 1
            except httpx.TimeoutException as e:
                raise ServerError(f"the server sent nothing for {self._timeout.read:.0f} s "
                                  f"({_why(e)}); it may be overloaded; try again or raise "
                                  "timeout=") from None
            except httpx.HTTPError as e:
                raise ServerError(f"request failed: {_why(e)}") from None

    async def get_text(self, path_from_root: str, timeout: float = 2.0) -> Optional[str]:
        """GET a page under the server root; None for anything but a 200."""
        try:
            r = await self._client().get(self.root + path_from_root, timeout=timeout,
                                         headers={"Accept": "text/plain"})
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    # -- synchronous probes (connect time) ---------------------------------------------
    def probe(self, timeout: float = 10.0):
        """(model ids or None when the server lists none, /metrics text or None).
        Raises ValueError (one line) when the server cannot be reached or refuses
        the key."""
        with httpx.Client(headers=self._headers, timeout=timeout, transport=self._transport) as c:
            try:
                r = c.get(self.base + "/models")
            except (httpx.ConnectError, httpx.TimeoutException) as e:
                raise ValueError(f"could not connect to {self.shown} ({_why(e)}); check "
                                 "the address and that the server is running") from None
            except httpx.HTTPError:  # it answered, but not with a model list
                r = None
            if r is not None and r.status_code in (401, 403):
                raise ValueError(str(self.http_error(r.status_code, r.content, None)))
            models = None
            if r is not None and r.status_code == 200:
                try:
                    data = r.json().get("data")
                    models = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
                except (ValueError, AttributeError, TypeError, KeyError):
                    models = None
            try:
                m = c.get(self.root + "/metrics", headers={"Accept": "text/plain"})
                metrics = m.text if m.status_code == 200 else None
            except httpx.HTTPError:
                metrics = None
        return (models or None), metrics


def _why(e: BaseException) -> str:
    s = one_line(str(e), 200)
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


def model_list_text(models: List[str], n: int = 5) -> str:
    shown = ", ".join(repr(m) for m in models[:n])
    return shown + (f" and {len(models) - n} more" if len(models) > n else "")
