"""Limits on request bodies, checked before any work, answered in OpenAI's error shape:
- a body over `max_bytes` gets 413 without being parsed (with a Content-Length, before it is
  even read);
- a client that stops sending its body for `idle_timeout_s` (a Content-Length of 1000 and 10
  bytes sent, say) gets 408 and its connection is closed. uvicorn has no such timeout: without
  it the connection, and the handler waiting for the body, would stay until the client leaves.
"""

from __future__ import annotations

import asyncio
import json

from pagedllm.entrypoints.openai.cli_serve import DEFAULT_BODY_IDLE_TIMEOUT_S
from pagedllm.entrypoints.openai.errors import error_body


class BodyLimits:
    """ASGI middleware: bodies of at most `max_bytes`, each part arriving within
    `idle_timeout_s` of the one before, reach the app, whole."""

    def __init__(self, app, max_bytes: int, idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, 413, f"The request body is larger than this server's limit of {self.max_bytes:,} bytes (--max-body-bytes).")
            return
        # Read the whole body here (the app would, to parse it), up to the limit and the timeout.
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                await self._refuse(
                    send, 408,
                    f"The request body stopped arriving: nothing for {self.idle_timeout_s:g} s after {size:,} bytes "
                    "(--body-idle-timeout); send the whole body without pausing.",
                )
                return
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:  # a chunked body (no length declared) passing the limit
                await self._refuse(send, 413, f"The request body is larger than this server's limit of {self.max_bytes:,} bytes (--max-body-bytes).")
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        payload = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if status == 408:  # the rest of the body may still come: the connection cannot serve another request
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
