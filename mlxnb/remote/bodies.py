"""Reading a server's response bodies under bounds: a body capped in bytes, and a
stream's lines each capped before it is held whole (client.py)."""

from __future__ import annotations

import httpx

from .wire import ServerError

__all__ = ["read_capped", "sse_lines"]


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
    """The body's lines (LF or CRLF ended), each at most `limit` bytes. A longer one
    raises ServerError as soon as `limit` bytes of it have come, so memory stays at
    about `limit` whatever the server sends; scanning resumes where it stopped, so a
    line dripped a byte at a time costs linear time."""
    buf, seen, first = bytearray(), 0, True
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if first and len(buf) >= 3:  # a byte-order mark is not part of the first line
            first = False
            if buf.startswith(b"\xef\xbb\xbf"):
                del buf[:3]
                seen = max(0, seen - 3)
        start = 0
        while (i := buf.find(b"\n", seen)) >= 0:
            if i - start > limit:
                break
            line = buf[start:i]
            if line.endswith(b"\r"):
                del line[-1:]
            yield line.decode("utf-8", "replace")
            start = seen = i + 1
        if start:
            del buf[:start]
        seen = len(buf)
        if seen > limit:
            raise ServerError(f"the server sent a line longer than {limit // 1024} kB; it "
                              "is not a streaming completion (check the address and the "
                              "server)")
    if buf:
        yield buf.decode("utf-8", "replace").removesuffix("\r")
