"""Streaming plumbing: server-sent events that stop (and abort their requests) the moment the
client disconnects, deltas computed from the engine's cumulative outputs, and the merging of
several requests' streams (a batch of prompts) into one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_llm_engine import RequestStream
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

DONE = "data: [DONE]\n\n"
# The OpenAPI schema of one server-sent event as the routes document it (`text/event-stream`):
# its `data` line, and the `event` name where the protocol gives one (Responses, Anthropic).
SSE_EVENT_SCHEMA = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    "required": ["data"]}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of strings.

    Starlette's StreamingResponse notices a disconnect only on some ASGI versions and otherwise
    leaves the generator suspended until garbage collection; here the stream is raced against
    the disconnect and closed at once, and `on_close` aborts the engine requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        # Not Response.__init__: that would declare an empty body (content-length: 0).
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self.events = events
        self.on_close = on_close  # runs however the stream ends, even if it never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _race(stream(), _wait_for_disconnect(receive))
        finally:
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


async def _race(main: Awaitable, watcher: Awaitable) -> bool:
    """Run both; whichever ends first cancels the other. True when `main` finished."""
    main_task = asyncio.ensure_future(main)
    watcher_task = asyncio.ensure_future(watcher)
    try:
        await asyncio.wait({main_task, watcher_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (main_task, watcher_task):
            task.cancel()
        await asyncio.gather(main_task, watcher_task, return_exceptions=True)
    if main_task.done() and not main_task.cancelled() and main_task.exception() is not None:
        raise main_task.exception()
    return main_task.done() and not main_task.cancelled()


async def run_until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await a non-streamed answer, cancelling it (which aborts its requests) if the client
    goes away first; the request body must have been read already."""
    result: list[Response] = []

    async def run() -> None:
        result.append(await work)

    if await _race(run(), _wait_for_disconnect(request.receive)):
        return result[0]
    return Response(status_code=499)  # the client closed the request; nobody reads this


@dataclass(slots=True)
class Delta:
    """What is new in one choice since the last chunk."""

    position: int  # the choice's place among its request's outputs
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


class DeltaTracker:
    """Turns one request's cumulative outputs into per-choice deltas.

    With stop strings, the last `len(longest stop) - 1` characters are held back until more
    text arrives: the engine cuts the text where a stop string begins, and a prefix of it must
    not have been streamed already. So streamed and non-streamed texts are always identical.
    """

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop or []
        self.holdback = 0 if params.include_stop_str_in_output or not stops else max(map(len, stops)) - 1
        self._sent_chars: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def deltas(self, output: RequestOutput) -> list[Delta]:
        deltas = []
        for position, choice in enumerate(output.outputs):
            if position in self._finished:
                continue
            sent_chars = self._sent_chars.get(position, 0)
            sent_tokens = self._sent_tokens.get(position, 0)
            end = len(choice.text) if choice.finish_reason else len(choice.text) - self.holdback
            text = choice.text[sent_chars:end] if end > sent_chars else ""
            token_ids = choice.token_ids[sent_tokens:]
            if not text and not token_ids and choice.finish_reason is None:
                continue
            logprobs = choice.logprobs[sent_tokens:] if choice.logprobs is not None else None
            self._sent_chars[position] = sent_chars + len(text)
            self._sent_tokens[position] = len(choice.token_ids)
            if choice.finish_reason is not None:
                self._finished.add(position)
            deltas.append(Delta(position, text, token_ids, logprobs, choice.finish_reason, choice.stop_reason))
        return deltas


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several request streams as they arrive; the first error
    from any stream is raised."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except Exception as exc:
            await merged.put((index, exc))
        await merged.put((index, None))

    tasks = [asyncio.create_task(forward(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
