"""What every HTTP request meets before any route: its API key, then its body's size.

A pure ASGI middleware, so both checks happen before the body is parsed (a request
without a key learns nothing of the schema, and an oversized body is refused unread
past the limit). The tenant goes to the route in `request.state.tenant`.
"""

from __future__ import annotations

import json

from loraplex.server.auth import Auth, Unauthorized
from loraplex.server.protocol import error_body


class GuardMiddleware:
    def __init__(self, app, auth: Auth, public_paths: frozenset[str], max_body_bytes: int):
        self.app = app
        self.auth = auth
        self.public_paths = public_paths  # served without a key (health checks)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # raw bytes: a header need not be ASCII
        if scope["path"] not in self.public_paths:
            try:
                tenant = self.auth.authenticate(headers.get(b"authorization"))
            except Unauthorized as e:
                return await _reply(send, 401, error_body(str(e), "authentication_error", 401))
            scope.setdefault("state", {})["tenant"] = tenant
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _too_large(send, self.max_body_bytes, length)
        body, more = [], True
        size = 0
        while more:  # read here (up to the limit), then replay it to the app
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_body_bytes:
                return await _too_large(send, self.max_body_bytes, None)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _too_large(send, limit: int, length: bytes | None) -> None:
    if length is not None and not length.isdigit():
        return await _reply(send, 400, error_body("Content-Length is not a number"))
    return await _reply(send, 413, error_body(f"the request body exceeds {limit} bytes", code=413))


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
