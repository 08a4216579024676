"""An HTTP request carried between processes, and its run through an in-process ASGI app.

A replica answers the ingress's forwarded requests with its own FastAPI app (the one
`loraplex serve` runs on one engine), so validation, tenants, errors, streaming and
receipts are the single engine's. The response comes back as parts: one `Start` (status
and headers), then the body's chunks as they are written, so streams stay streams.
Closing the parts early (the client left) tells the app its client disconnected, which
aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

# Per-connection headers that a relay must not copy (RFC 9110 7.6.1), and the length,
# which the relay's own server writes (the body may arrive in other chunks).
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "content-length", "host"})


@dataclass
class Forwarded:
    """An HTTP request as the ingress received it (picklable: it crosses processes)."""

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class Start:
    """The response's status and headers (hop-by-hop ones dropped)."""

    status: int
    headers: list[tuple[str, str]]


def relay_headers(headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS]


async def call_asgi(app, request: Forwarded) -> AsyncIterator[Start | bytes]:
    """Run `request` through the ASGI `app`: yields a Start, then body chunks."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query.encode(),
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("loraplex-replica", 80),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
    }
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()  # set when the caller stops reading: the app hears a disconnect
    body_read = False

    async def receive():
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    try:
        while True:
            get = asyncio.ensure_future(messages.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned (or raised) with nothing more queued
                get.cancel()
                task.result()
                return
            message = get.result()
            if message["type"] == "http.response.start":
                yield Start(message["status"], relay_headers(
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()
