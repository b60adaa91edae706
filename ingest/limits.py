"""Request body limits enforced before a body is read: a pure ASGI middleware.

A request whose ``Content-Length`` is over its route's limit is answered 413 without reading a byte
of the body; a body without a length (chunked) is counted as it arrives and answered 413 the
moment it passes the limit. Limits are per path (``gateway.max_request_bytes`` for completions,
``gateway.max_feedback_bytes`` for feedback); any other path gets the smallest of them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Wraps an ASGI app; `on_refused(path)` is called for every 413 (metrics)."""

    def __init__(
        self, app: ASGIApp, limits: dict[str, int], on_refused: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.limits = limits
        self.default = min(limits.values())
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        limit = self.limits.get(path, self.default)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await self._refuse(send, path, 400, "Content-Length is not a number")
                return
            if declared > limit:
                await self._refuse(
                    send, path, 413, f"request body of {declared} bytes is over the {limit}-byte limit"
                )
                return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if started:
                raise
            await self._refuse(send, path, 413, f"request body is over the {limit}-byte limit")

    async def _refuse(self, send: Send, path: str, status: int, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(path)
        body = json.dumps(
            {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
        )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
