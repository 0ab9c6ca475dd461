"""Reading a server's response bodies under bounds: a body capped in bytes, and an
event stream's lines and events each capped before it is held whole (client.py); the
parsing itself is wire.py's, pure."""

from __future__ import annotations

import httpx

from .wire import SSEEvents, SSELines

__all__ = ["read_capped", "sse_events", "sse_lines"]


async def read_capped(resp: httpx.Response, cap: int) -> bytes:
    """At most `cap` bytes of a body (the rest is left unread and the connection
    dropped with the response)."""
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) >= cap:
            del buf[cap:]
            break
    return bytes(buf)


async def sse_lines(resp: httpx.Response, limit: int):
    """The body's lines (CRLF, LF or CR ended), each at most `limit` bytes
    (wire.SSELines)."""
    split = SSELines(limit)
    async for chunk in resp.aiter_bytes():
        for line in split.feed(chunk):
            yield line
    for line in split.end():
        yield line


async def sse_events(resp: httpx.Response, limit: int):
    """What the body's event stream says, item by item: ("data", an event's data),
    ("comment", text), ("error", text) or ("other", line) (wire.SSEEvents), each line
    and each event's data bounded by `limit`."""
    events = SSEEvents(limit)
    async for line in sse_lines(resp, limit):
        if (item := events.line(line)) is not None:
            yield item
    if (item := events.end()) is not None:
        yield item
