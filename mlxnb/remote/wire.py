"""The OpenAI wire format: a row's request body, what one streamed event says, and
what an error body says.

Pure functions (no I/O, no engine state), so every server dialect they accept is
unit-tested on its own: chat events carry `delta.content` and `logprobs.content`,
completion events `text` and `logprobs.tokens / token_logprobs / top_logprobs`;
usage comes in a last event with no choices (`stream_options.include_usage`).
The event stream itself is read the same way, bytes to lines (`SSELines`) and lines
to events (`SSEEvents`), fed a chunk or a line at a time by bodies.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from .._text import one_line
from ..core.rows import SamplingParams
from ..core.states import Finish


class ServerError(Exception):
    """A request the server refused or could not serve; the message is one line."""


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
            msg = _said(err)
            if msg is None and isinstance(obj.get("detail"), (str, list)):
                msg = obj["detail"]
        elif err is not None:
            msg = err
    if msg is None:
        msg = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    return one_line(msg, limit)


def _said(err: dict):
    """The words of an error object ({"message" | "msg" | "detail": ...}), else None."""
    return err.get("message") or err.get("msg") or err.get("detail")


REDIRECTS = (301, 302, 303, 307, 308)


def redirect_error(status: int, location: Optional[str], shown: str) -> ServerError:
    """A redirect is never followed (it would carry the API key to wherever it
    points): the user connects to where it points instead."""
    where = f"to {one_line(location, 200)}" if location else "elsewhere"
    return ServerError(f"{shown} redirects {where} ({status}); connect to that address "
                       "instead")


def status_error(status: int, msg: str, model: Optional[str], shown: str) -> ServerError:
    """What a row or a connect says of a non-200 answer whose (scrubbed) message is
    `msg`, from the server at `shown`."""
    bare = msg.strip().lower().strip(".") in ("", "not found", "404 page not found",
                                              "file not found")
    msg = msg or "no message"
    if status in (401, 403):
        return ServerError(
            f"the server refused the API key ({status}: {msg}); give the right key "
            "with --api-key-env VAR (an environment variable holding it) or api_key=")
    if status == 404:
        # A bare "Not Found" (llama.cpp: "File Not Found"; or nothing) is a missing
        # endpoint; any other 404 from a completion endpoint is about the model
        # (mlx_lm.server answers 404 when it cannot load the model asked for; vLLM:
        # "The model `x` does not exist.").
        if model and not bare:
            return ServerError(f"the server does not know model {model!r} ({msg}); "
                               "connect again with --model set to a model it serves")
        return ServerError(f"{shown} has no such endpoint (404: {msg}); check "
                           "the address (OpenAI-compatible servers answer under /v1)")
    if status in (400, 422):
        return ServerError(f"the server rejected the request: {msg}")
    return ServerError(f"the server answered {status}: {msg}")


def error_line(text: str) -> str:
    """The message of llama.cpp's `error: {json}` stream line, else the text."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    msg = obj.get("message") or obj.get("error") if isinstance(obj, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return str(msg) if msg else (text or "no detail given")


# the server's finish_reason -> ours (anything else it may say counts as "stop")
FINISH = {"stop": Finish.STOP, "eos": Finish.STOP, "length": Finish.LENGTH,
          "tool_calls": Finish.STOP, "function_call": Finish.STOP}


@dataclass(frozen=True)
class Request:
    """How a prompt goes out: chat messages (server-side template) or raw text."""

    chat: bool
    system: Optional[str]


def request_body(prompt: str, req: Request, p: SamplingParams, model: Optional[str]) -> dict:
    """Only what differs from server defaults is sent besides max_tokens and
    temperature, so a server that lacks an option still serves rows not using it."""
    b = {"stream": True, "stream_options": {"include_usage": True},
         "max_tokens": p.max_tokens, "temperature": p.temperature}
    if model is not None:
        b["model"] = model
    if req.chat:
        msgs = [{"role": "system", "content": req.system}] if req.system else []
        b["messages"] = msgs + [{"role": "user", "content": prompt}]
    else:  # the local engine's --raw rule: system text, a blank line, the prompt
        b["prompt"] = f"{req.system}\n\n{prompt}" if req.system else prompt
    for key, value, default in (("top_p", p.top_p, 1.0), ("top_k", p.top_k, 0),
                                ("min_p", p.min_p, 0.0),
                                ("repetition_penalty", p.repetition_penalty, None),
                                ("seed", p.seed, None)):
        if value != default:
            b[key] = value
    if p.stop:
        b["stop"] = list(p.stop)
    if p.logprobs:
        if req.chat:
            b["logprobs"], b["top_logprobs"] = True, p.logprobs
        else:
            b["logprobs"] = p.logprobs
    return b


@dataclass
class Event:
    """What one streamed event says about choice 0."""

    text: str = ""
    ntok: int = 0  # tokens it carries: its logprob entries, else 1 if it has output
    reasoning: str = ""  # a reasoning model's thinking (vLLM, llama.cpp), not its text
    logprobs: Optional[list] = None
    finish: Optional[str] = None  # the server's word, as sent
    usage: Optional[dict] = None


def parse_event(obj, chat: bool) -> Event:
    """Read one `data:` event. Raises ServerError for an error event (vLLM reports a
    failure mid-stream that way; client.py turns llama.cpp's `error:` lines into one)."""
    ev = Event()
    if not isinstance(obj, dict):
        return ev
    err = obj.get("error")
    if not err and obj.get("object") == "error":  # vLLM's ErrorResponse, sent bare
        err = obj
    if err:
        msg = (_said(err) or json.dumps(err, separators=(",", ":"))) if isinstance(err, dict) \
            else err
        # cut long, not at 200: the engine scrubs the API key out first (a cut could
        # leave part of it), then cuts
        raise ServerError(f"the server failed the request: {one_line(msg, 2000)}")
    if isinstance(obj.get("usage"), dict):
        ev.usage = obj["usage"]
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue
        delta = (ch.get("delta") or {}) if chat else {}
        if not isinstance(delta, dict):
            delta = {}
        text = _text(delta.get("content") if chat else ch.get("text"))
        # thinking and tool calls are tokens the server generated: they count as
        # output (a row thinking for minutes is not stuck), though not as its text
        thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
        other = bool(thought or delta.get("tool_calls"))
        lps = _logprobs(ch.get("logprobs"), chat)
        ev.text += text
        if isinstance(thought, str):
            ev.reasoning += thought
        ev.ntok += len(lps) if lps else (1 if text or other else 0)
        if lps:
            ev.logprobs = (ev.logprobs or []) + lps
        if isinstance(ch.get("finish_reason"), str) and ch["finish_reason"]:
            ev.finish = ch["finish_reason"]
    return ev


def _text(value) -> str:
    """An event's output text: a string, or a list of {"type": "text", "text": ...}
    content parts (OpenAI's content-part form); anything else is a malformed event."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        parts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in parts):
            return "".join(parts)
    raise ServerError(f"the server sent a malformed event: its text is "
                      f"{one_line(json.dumps(value, default=str), 120)}, not a string")


def usage_counts(usage: dict) -> Tuple[Optional[int], Optional[int], int]:
    """(prompt tokens, completion tokens, cached prompt tokens) from a usage object."""
    def num(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    details = usage.get("prompt_tokens_details") or {}
    cached = num(details.get("cached_tokens")) if isinstance(details, dict) else None
    return num(usage.get("prompt_tokens")), num(usage.get("completion_tokens")), cached or 0


def prefill_progress(comment: str) -> Optional[Tuple[int, int]]:
    """mlx_lm.server's prefill progress comment "keepalive 512/2048" -> (512, 2048)."""
    if not comment.startswith("keepalive "):
        return None
    done, _, total = comment[10:].partition("/")
    return (int(done), int(total)) if done.isdecimal() and total.isdecimal() else None


def finish(server_reason: Optional[str]) -> Tuple[str, Optional[str]]:
    """(our finish reason, error) for the finish_reason a stream ended with."""
    if server_reason is None:
        return Finish.ERROR, ("the server ended the stream without a finish reason (it may "
                         "have stopped or restarted)")
    if server_reason == "abort":
        return Finish.ERROR, "the server aborted the request"
    if server_reason == "error":  # vLLM's word for a request that failed
        return Finish.ERROR, "the server reported an error for this request"
    if server_reason == "content_filter":  # cut short: not a complete answer
        return Finish.ERROR, ("the server's content filter stopped this row (the text "
                              "before it is kept)")
    return FINISH.get(server_reason, Finish.STOP), None


def _logprobs(lp, chat: bool) -> Optional[list]:
    """Per-token {"token", "logprob", "top": [(token, logprob), ...]} from either API's
    logprobs object; None when the event has none."""
    if not isinstance(lp, dict):
        return None

    def listed(v):  # a field that is not a list is read as absent
        return v if isinstance(v, list) else []

    out = []
    if chat:
        for e in listed(lp.get("content")):
            if isinstance(e, dict) and "logprob" in e:
                top = [(t.get("token"), t.get("logprob")) for t in listed(e.get("top_logprobs"))
                       if isinstance(t, dict)]
                out.append({"token": e.get("token"), "logprob": e["logprob"], "top": top})
    else:
        toks = listed(lp.get("tokens"))
        vals = listed(lp.get("token_logprobs"))
        tops = listed(lp.get("top_logprobs"))
        for i, (t, v) in enumerate(zip(toks, vals)):
            top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            out.append({"token": t, "logprob": v, "top": list(top.items())})
    return out or None


# -- the event stream ------------------------------------------------------------------
# https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
BOM = b"\xef\xbb\xbf"
_EOL = re.compile(rb"[\r\n]")


class SSELines:
    """An event stream's bytes, fed a network chunk at a time, as its lines.

    A line ends in CRLF, LF or a bare CR (the spec allows all three). A CR is a line
    end at once, so a line is not held back for the next chunk; an LF that comes
    next, in the same chunk or the next one, belongs to that CR's ending and is no
    line of its own (an empty line would dispatch an event early). A byte-order mark
    at the very start is not part of the first line. Line ends never fall inside a
    UTF-8 sequence, so each line is decoded on its own.

    A line longer than `limit` bytes raises ServerError as soon as `limit` bytes of it
    have come, so memory stays at about `limit` whatever the server sends; scanning
    resumes where it stopped, so a line dripped a byte at a time costs linear time."""

    def __init__(self, limit: int):
        self.limit = limit
        self._buf = bytearray()
        self._seen = 0  # bytes of _buf already scanned for a line end
        self._cr = False  # the last line ended in a CR that was the last byte fed
        self._head = True  # the stream's first bytes may still be a byte-order mark

    def feed(self, chunk: bytes) -> Iterator[str]:
        """The lines `chunk` completes (iterate it to the end before the next feed)."""
        buf = self._buf
        buf += chunk
        if self._head:
            if len(buf) < len(BOM) and BOM.startswith(buf):
                return  # too few bytes yet to tell a mark from a first line
            self._head = False
            if buf.startswith(BOM):
                del buf[:len(BOM)]
        start = 0
        if self._cr and buf:
            self._cr = False
            if buf[0] == 0x0A:  # the LF of a CRLF split between chunks
                start = self._seen = 1
        while (m := _EOL.search(buf, self._seen)) is not None:
            i = m.start()
            if i - start > self.limit:
                break
            yield buf[start:i].decode("utf-8", "replace")
            if buf[i] == 0x0D and i + 1 == len(buf):
                self._cr = True  # its LF, if any, comes with the next chunk
            start = self._seen = i + 2 if buf[i:i + 2] == b"\r\n" else i + 1
        del buf[:start]
        self._seen = len(buf)
        if self._seen > self.limit:
            raise ServerError(f"the server sent a line longer than {self.limit // 1024} kB; "
                              "it is not a streaming completion (check the address and the "
                              "server)")

    def end(self) -> List[str]:
        """At the stream's end: its last line, when no line end follows it."""
        last = self._buf.decode("utf-8", "replace") if self._buf else None
        self._buf.clear()
        return [] if last is None else [last]


class SSEEvents:
    """An event stream's lines, fed one at a time, as what they say.

    As the spec reads them: a `data` field's value (less one leading space) is a line
    of the event's data, and a blank line dispatches the event, its data lines joined
    with "\n" (a JSON event may be split over several `data:` lines). `event`, `id`
    and `retry` carry nothing used here. `line()` returns ("data", the data) at a
    dispatch, ("comment", the text after ":") for a comment (mlx_lm.server's prefill
    progress), ("error", the value) for llama.cpp's `error: {json}` line (its own, not
    an SSE field), ("other", the line) for a line no event stream has, or None.

    A server that ends each event with one line end, not two, sends consecutive
    events as the data lines of one. So a data line that comes after a first one that
    is a JSON value (or [DONE]) on its own dispatches that first: a JSON value never
    goes on past a line end the spec reads, so a true multi-line event never starts
    with one, and such a stream still streams.

    An event's data past `limit` characters raises ServerError: lines are bounded one
    by one, and data lines that never reach a blank line must not grow forever."""

    def __init__(self, limit: int):
        self.limit = limit
        self._data: List[str] = []
        self._size = 0

    def line(self, line: str) -> Optional[Tuple[str, str]]:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return "comment", line[1:]
        field, colon, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            if len(self._data) == 1 and _whole(self._data[0]):
                out, self._data, self._size = ("data", self._data[0]), [value], len(value) + 1
                return out
            self._size += len(value) + 1
            if self._size > self.limit:
                raise ServerError(f"the server sent an event longer than "
                                  f"{self.limit // 1024} kB; it is not a streaming "
                                  "completion (check the address and the server)")
            self._data.append(value)
            return None
        if field == "error" and colon:
            return "error", value
        if field in ("event", "id", "retry"):
            return None
        return "other", line

    def end(self) -> Optional[Tuple[str, str]]:
        """At the stream's end: the event whose blank line never came. The spec drops
        it; it is read all the same, since a stream that ends without a blank line
        (or without [DONE]) may still carry its last tokens and finish reason."""
        return self._dispatch()

    def _dispatch(self) -> Optional[Tuple[str, str]]:
        """The pending event's data (its lines joined), as the blank line sends it."""
        if not self._data:
            return None
        data, self._data, self._size = "\n".join(self._data), [], 0
        return "data", data


def _whole(line: str) -> bool:
    """Is one data line a whole event by itself: [DONE], or a JSON value?"""
    text = line.strip()
    if text == "[DONE]":
        return True
    if not text or text[0] not in "{[":  # (completion events are objects)
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
