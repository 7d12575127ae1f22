"""A limit on request bodies, checked before any work: a body over it gets 413 in OpenAI's error
shape without being parsed (with a Content-Length, before it is even read)."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.errors import error_body


class BodySizeLimit:
    """ASGI middleware: bodies of at most `max_bytes` reach the app."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        # No declared length (a chunked body): read it up to the limit, then hand it on.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
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

    async def _refuse(self, send) -> None:
        message = f"The request body is larger than this server's limit of {self.max_bytes:,} bytes (--max-body-bytes)."
        payload = json.dumps(error_body(413, message)).encode()
        await send({
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        })
        await send({"type": "http.response.body", "body": payload})
