"""Anthropic's Messages API, served on the chat route's machinery: `POST /v1/messages` (JSON or
Anthropic's server-sent events) and `POST /v1/messages/count_tokens`.

A message request is translated into a chat-completion request (`anthropic_protocol`), whose
prompt, sampling parameters, tool constraints and length checks are the chat route's; its
output goes through the same reasoning parser (`--reasoning-parser`: its thinking becomes a
`thinking` block) and tool-call parsing (`tools.tool_message`, `ToolCallStreamer`: `tool_use`
blocks), the rest becoming `text` blocks.

The stream is Anthropic's event sequence: `message_start` (the message, empty, with the input
tokens), then per content block `content_block_start`, its deltas (`text_delta`,
`input_json_delta`, `thinking_delta`) and `content_block_stop`, one `ping` after the first
block opens, then `message_delta` (stop_reason, stop_sequence, output tokens) and
`message_stop`. Each is `event: NAME\\ndata: {json}\\n\\n`; an error after the start is an
`error` event that ends the stream.

These routes answer errors in Anthropic's shape (`AnthropicRoute`) and take the API key as
`x-api-key` or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pagedllm.engine.async_llm_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicError,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    stop_reason,
    tool_input,
    tool_use_id,
)
from pagedllm.entrypoints.openai.errors import ErrorResponse, OpenAIError, _validation_message
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_base import engine_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.server_options import RequestFields
from pagedllm.entrypoints.openai.streaming import SSE_EVENT_SCHEMA, DeltaTracker, EventStreamResponse, run_until_disconnect
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import constrain_auto_calls
from pagedllm.entrypoints.openai.tools import ToolCallStreamer, ToolParser, tool_message
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.reasoning import RequestReasoning

logger = logging.getLogger("pagedllm")


# --- content blocks -----------------------------------------------------------------------------


def content_blocks(
    text: str, finish_reason: str | None, mode: str, reasoning: str | None = None, parser: ToolParser | None = None,
) -> tuple[list[dict], str | None]:
    """A finished output as Anthropic's content blocks, and its chat finish reason ("tool_calls"
    when it called tools). `mode`: the chat request's tool mode. `reasoning`: the thinking text,
    where a reasoning parser has split it from `text` (a `thinking` block first). `parser`: the
    format of "auto" calls (the server's --tool-call-parser).

    A call whose arguments are not a JSON object (Anthropic's `input` must be one) leaves the
    whole output as text, as a malformed call does on the chat route."""
    message, finish = tool_message(text, finish_reason, mode, parser)
    calls = message.get("tool_calls", [])
    inputs = [tool_input(call["function"]["arguments"]) for call in calls]
    if any(value is None for value in inputs):
        message, calls, finish = {"content": text}, [], finish_reason
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call, value in zip(calls, inputs):
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": value})
    return blocks, finish


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessageEvents:
    """The events of one streamed message: content blocks open as the kind of content changes
    (text, thinking, each tool call) and close before the next opens or the message ends."""

    def __init__(self) -> None:
        self.index = -1  # the open (or last) block's index
        self.open_type: str | None = None
        self.pinged = False

    def start(self, message: dict) -> list[str]:
        return [event("message_start", {"type": "message_start", "message": message})]

    def text(self, text: str) -> list[str]:
        return self._delta("text", {"type": "text_delta", "text": text}, {"type": "text", "text": ""})

    def thinking(self, text: str) -> list[str]:
        """Reasoning text (a reasoning parser's); a thinking block opens if none is open."""
        return self._delta("thinking", {"type": "thinking_delta", "thinking": text},
                           {"type": "thinking", "thinking": "", "signature": ""})

    def tool_use(self, call_id: str, name: str) -> list[str]:
        return self._open({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def input_json(self, partial_json: str) -> list[str]:
        delta = {"type": "input_json_delta", "partial_json": partial_json}
        return [event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def chat_delta(self, piece: dict) -> list[str]:
        """A chat delta of `ToolCallStreamer`'s (`content`, or `tool_calls` that open a call with
        its id and name and carry its arguments) as events."""
        if piece.get("content"):
            return self.text(piece["content"])
        events = []
        for call in piece.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:
                events += self.tool_use(tool_use_id(call["id"]), function.get("name", ""))
            if function.get("arguments"):
                events += self.input_json(function["arguments"])
        return events

    def finish(self, reason: str, stop_sequence: str | None, num_output_tokens: int) -> list[str]:
        events = self._close()
        if not self.pinged:
            self.pinged = True
            events.append(event("ping", {"type": "ping"}))
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                 "usage": {"output_tokens": num_output_tokens}}
        return [*events, event("message_delta", delta), event("message_stop", {"type": "message_stop"})]

    def _delta(self, kind: str, delta: dict, empty_block: dict) -> list[str]:
        events = [] if self.open_type == kind else self._open(empty_block)
        events.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return events

    def _open(self, block: dict) -> list[str]:
        events = self._close()
        self.index += 1
        self.open_type = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        events.append(event("content_block_start", start))
        if not self.pinged:
            self.pinged = True
            events.append(event("ping", {"type": "ping"}))
        return events

    def _close(self) -> list[str]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


class MessageStream:
    """One streamed message: the output's new text in, Anthropic's events out. Text goes
    through the chat route's tool-call streamer (a named tool's and "auto" calls' arguments as
    they grow, `input_json_delta`s; the calls of "any" once the output is complete), as
    `content_blocks` does whole."""

    def __init__(self, mode: str, parser: ToolParser | None = None) -> None:
        self.mode = mode
        self.events = MessageEvents()
        self.tools = ToolCallStreamer(mode, parser) if mode != "none" else None
        self.text = ""  # the output so far
        self.num_text_sent = 0  # how much of it went out as text

    def start(self, message: dict) -> list[str]:
        return self.events.start(message)

    def feed(
        self, text: str, finish_reason: str | None, engine_stop: int | str | None, num_output_tokens: int,
        reasoning: str = "",
    ) -> list[str]:
        """The events for the output's next `text` (and `reasoning`, where a reasoning parser
        split the new text); with `finish_reason`, the message's end too."""
        self.text += text
        events = self.events.thinking(reasoning) if reasoning else []
        if self.tools is None:
            pieces, finish = ([{"content": text}] if text else []), finish_reason
        elif text or finish_reason is not None:  # a named tool's call opens with its first text, after any thinking
            pieces, finish = self.tools.feed(0, text, finish_reason)
        else:
            pieces, finish = [], None
        if self.mode == "required":  # whole calls, at the end ("auto" parsers accept only object arguments)
            calls = [c for piece in pieces for c in piece.get("tool_calls", []) if "id" in c]
            if any(tool_input(c["function"]["arguments"]) is None for c in calls):
                # A call whose arguments are no object: the rest is text, as in content_blocks.
                pieces, finish = [{"content": self.text[self.num_text_sent:]}], finish_reason
        for piece in pieces:
            self.num_text_sent += len(piece.get("content") or "")
            events += self.events.chat_delta(piece)
        if finish is not None:
            events += self.events.finish(*stop_reason(finish, engine_stop), num_output_tokens)
        return events


# --- serving ------------------------------------------------------------------------------------


class AnthropicServingMessages:
    """`/v1/messages` and its token count, over the chat route's serving object."""

    def __init__(self, chat: OpenAIServingChat, request_fields: RequestFields) -> None:
        self.chat = chat
        self.request_fields = request_fields

    async def _prompt(self, chat_request: ChatCompletionRequest) -> list[int]:
        """The chat route's prompt for the translated request (tools through the template)."""
        tools = chat_request.tools if chat_request.tool_mode != "none" else None
        return await self.chat.chat_prompt(
            chat_request.messages, add_generation_prompt=chat_request.add_generation_prompt,
            template_kwargs=chat_request.chat_template_kwargs, tools=tools,
            continue_final_message=chat_request.continue_final_message,
        )

    async def count_tokens(self, request: AnthropicCountTokensRequest) -> dict:
        self.chat.check_model(request.model)
        return {"input_tokens": len(await self._prompt(request.to_chat_request()))}

    async def create_message(self, request: AnthropicMessagesRequest, raw_request: Request) -> Response:
        model = self.chat.check_model(request.model)
        chat_request = request.to_chat_request()
        self.request_fields.prepare(chat_request)  # the generation config's sampling defaults
        chat_request.check_supported()
        params = chat_request.to_sampling_params(chat_request.max_output_tokens, None, "messages")
        if chat_request.tool_mode == "auto":  # a call the model opens is kept well-formed
            await constrain_auto_calls(params, self.chat.tool_parser(chat_request.tools))
        prompt_ids = await self._prompt(chat_request)
        # The chat route's reasoning parser (--reasoning-parser), bound to this prompt: its
        # thinking becomes thinking blocks, and a grammar waits until the thinking ends.
        parser = self.chat.reasoning_parser
        thinking = parser.for_prompt(prompt_ids) if parser is not None else None
        if thinking is not None:
            thinking.constrain(params)
        self.chat.check_length(prompt_ids, params, "messages")
        message_id = f"msg_{uuid.uuid4().hex}"
        streams = await self.chat.submit(message_id, [prompt_ids], params, "messages")
        head = {"id": message_id, "type": "message", "role": "assistant", "model": model}
        mode = chat_request.tool_mode
        tool_parser = self.chat.tool_parser(chat_request.tools) if mode == "auto" else None
        if request.stream:
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}
            events = _ending_with_error_event(self._stream(mode, params, start, streams[0], thinking, tool_parser))
            return EventStreamResponse(events, on_close=lambda: self.chat.abort_unfinished(streams))
        return await run_until_disconnect(raw_request, self._full(mode, head, streams, thinking, tool_parser))

    async def _full(
        self, mode: str, head: dict, streams: list[RequestStream], thinking: RequestReasoning | None,
        tool_parser: ToolParser | None = None,
    ) -> Response:
        (output,) = await self.chat.final_outputs(streams)
        choice = output.outputs[0]
        reasoning, text = (None, choice.text) if thinking is None else thinking.split(choice.text)
        blocks, finish = content_blocks(text or "", choice.finish_reason, mode, reasoning, tool_parser)
        reason, sequence = stop_reason(finish, choice.stop_reason)
        usage = {"input_tokens": len(output.prompt_token_ids), "output_tokens": len(choice.token_ids)}
        return JSONResponse({**head, "content": blocks, "stop_reason": reason, "stop_sequence": sequence, "usage": usage})

    async def _stream(
        self, mode: str, params: SamplingParams, start: dict, stream: RequestStream, thinking: RequestReasoning | None,
        tool_parser: ToolParser | None = None,
    ) -> AsyncIterator[str]:
        message = MessageStream(mode, tool_parser)
        for item in message.start(start):
            yield item
        tracker = DeltaTracker(params)  # holds back what may begin a stop sequence
        splitter = thinking.splitter() if thinking is not None else None  # holds back what may begin a tag
        async for output in stream:
            for delta in tracker.deltas(output):
                reasoning, text = "", delta.text
                if splitter is not None:
                    reasoning, text = splitter.feed(delta.text, final=delta.finish_reason is not None)
                num_output_tokens = len(output.outputs[0].token_ids)
                for item in message.feed(text, delta.finish_reason, delta.stop_reason, num_output_tokens, reasoning):
                    yield item


async def _ending_with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream `events`; an error after the 200 went out becomes Anthropic's `error` event, the
    stream's last."""
    try:
        async for item in events:
            yield item
    except (EngineDeadError, RequestFailedError) as exc:
        yield _error_event(AnthropicError.from_openai(engine_error(exc)))
    except OpenAIError as exc:
        yield _error_event(AnthropicError.from_openai(exc))
    except AnthropicError as exc:
        yield _error_event(exc)
    finally:
        await events.aclose()


def _error_event(exc: AnthropicError) -> str:
    return event("error", exc.body())


# --- routes -------------------------------------------------------------------------------------


class AnthropicRoute(APIRoute):
    """A route whose errors (the body's validation, the key check, the chat path's errors) are
    answered in Anthropic's shape, with the same status as elsewhere."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except AnthropicError as exc:
                error = exc
            except OpenAIError as exc:
                error = AnthropicError.from_openai(exc)
            except RequestValidationError as exc:
                error = AnthropicError(400, _validation_message(exc)[0])
            except StarletteHTTPException as exc:
                error = AnthropicError(exc.status_code, exc.detail if isinstance(exc.detail, str) else "Bad request")
            return JSONResponse(error.body(), status_code=error.status)

        return route


def anthropic_key_check(api_keys: list[str]):
    """A dependency refusing requests without one of `api_keys` as `x-api-key` (Anthropic's
    header) or `Authorization: Bearer`; keys are compared in constant time."""
    expected = [key.encode() for key in api_keys]

    async def check(request: Request) -> None:
        if not expected:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [request.headers.get("x-api-key", "").strip(), token.strip() if scheme.lower() == "bearer" else ""]
        # Every comparison is made: the time taken must not reveal which or how much matched.
        matches = [secrets.compare_digest(g.encode(), key) for g in given for key in expected]
        if not any(matches):
            raise AnthropicError(
                401, "Missing or incorrect API key; send 'x-api-key: <key>' or 'Authorization: Bearer <key>'."
            )

    return check


_ERROR_DESCRIPTIONS = {
    400: "A bad field, a malformed body, an unsupported block (images), a prompt too long; the message names the field.",
    401: "Missing or incorrect API key (`x-api-key` or `Authorization: Bearer`).",
    404: "The model does not exist.",
    500: "A step of the engine failed.",
    503: "The server is shutting down, or the engine has died.",
}
# Answered by the body-limit middleware, in OpenAI's shape like every route's.
_BODY_LIMITS = {408: "The body stalled longer than --body-idle-timeout.", 413: "The body is larger than --max-body-bytes."}


def _documented(*statuses: int) -> dict:
    responses: dict = {s: {"model": AnthropicErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}
    responses.update({s: {"model": ErrorResponse, "description": d} for s, d in _BODY_LIMITS.items()})
    return responses


_MESSAGE_200 = {
    200: {
        "description": "The message; with `stream`, Anthropic's server-sent events (`event: NAME`, `data: {json}`).",
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    }
}


def anthropic_router(chat: OpenAIServingChat, request_fields: RequestFields, api_keys: list[str]) -> APIRouter:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens`."""
    serving = AnthropicServingMessages(chat, request_fields)
    router = APIRouter(prefix="/v1", route_class=AnthropicRoute, dependencies=[Depends(anthropic_key_check(api_keys))])

    @router.post("/messages", responses={**_MESSAGE_200, **_documented(400, 401, 404, 500, 503)})
    async def create_message(request: AnthropicMessagesRequest, raw_request: Request) -> Response:
        return await serving.create_message(request, raw_request)

    @router.post("/messages/count_tokens", responses=_documented(400, 401, 404))
    async def count_message_tokens(request: AnthropicCountTokensRequest) -> dict:
        return await serving.count_tokens(request)

    return router
