"""OpenAI's Responses API, served on the chat route's machinery: `POST /v1/responses` (JSON or
server-sent events), `GET` and `DELETE /v1/responses/{id}`.

A response request is translated into a chat-completion request (`responses_protocol`), whose
prompt, sampling parameters, tool constraints and length checks are the chat route's; its
output goes through the same reasoning parser (`--reasoning-parser`: its thinking becomes a
`reasoning` item) and tool-call parsing (`tools.tool_message`, `ToolCallStreamer`:
`function_call` items), the rest becoming a `message` item. A response stopped by
`max_output_tokens` is `incomplete`.

The stream is OpenAI's event sequence: `response.created`, `response.in_progress`, then per
output item `response.output_item.added`, its content (`response.content_part.added`, the
`response.output_text.delta`s or `response.reasoning_text.delta`s, their `.done`,
`response.content_part.done`; for a function call `response.function_call_arguments.delta`s and
`.done`) and `response.output_item.done`; last `response.completed` (or `response.incomplete`).
Each is `event: TYPE\\ndata: {json with type and sequence_number}\\n\\n`; an error after the start
is an `error` event that ends the stream.

Responses created with `store` (the default) are kept in a store bounded in bytes
(`responses_store`), so `previous_response_id` continues their conversation.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from pagedllm.engine.async_llm_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, documented_errors
from pagedllm.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    output_items,
    output_text_part,
    reasoning_item,
    response_usage,
)
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.entrypoints.openai.server_options import RequestFields, api_key_check
from pagedllm.entrypoints.openai.serving_base import engine_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import SSE_EVENT_SCHEMA, DeltaTracker, EventStreamResponse, run_until_disconnect
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import constrain_auto_calls
from pagedllm.entrypoints.openai.tools import ToolCallStreamer, ToolParser, tool_message
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.reasoning import RequestReasoning

# Chat-request fields as the Responses request names them, for errors raised on the chat path.
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def not_stored(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(
        404,
        f"No response with id {response_id!r} is stored here: it is unknown, was deleted, was created with "
        "store false, or was dropped from the store (--responses-store-bytes) to make room.",
        param, "response_not_found",
    )


class ResponseEvents:
    """The events of one streamed response: output items open as the kind of output changes
    (reasoning, text, each function call) and close before the next opens or the response
    ends; the closed items are the response's output."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the open item (its text or arguments so far)

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    @property
    def index(self) -> int:  # the open item's output_index
        return len(self.output)

    def reasoning(self, text: str) -> list[str]:
        events = [] if self._is_open("reasoning") else self._open(reasoning_item("") | {"content": [], "status": "in_progress"})
        self.open["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=self.index,
                                 content_index=0, delta=text))
        return events

    def text(self, text: str) -> list[str]:
        events = [] if self._is_open("message") else self._open(message_item("", "in_progress") | {"content": []})
        self.open["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self.index,
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def function_call(self, call_id: str, name: str) -> list[str]:
        return self._open(function_call_item(call_id, name, "", "in_progress"))

    def arguments(self, delta: str) -> list[str]:
        self.open["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"], output_index=self.index,
                           delta=delta)]

    def chat_delta(self, piece: dict) -> list[str]:
        """A chat delta of `ToolCallStreamer`'s (`content`, or `tool_calls` that open a call with
        its id and name and carry its arguments) as events."""
        events = self.text(piece["content"]) if piece.get("content") else []
        for call in piece.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:
                events += self.function_call(call["id"], function.get("name", ""))
            if function.get("arguments"):
                events += self.arguments(function["arguments"])
        return events

    def close(self, status: str = "completed") -> list[str]:
        """Close the open item, if any (`status`: the message's, "incomplete" when cut short)."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self.index}
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            part = {"type": "reasoning_text", "text": text}
            events += [self.event("response.reasoning_text.done", **at, content_index=0, text=text),
                       self.event("response.content_part.done", **at, content_index=0, part=part)]
            item = reasoning_item(text, item["id"])
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            events += [self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", **at, content_index=0, part=output_text_part(text))]
            item = message_item(text, status, item["id"])
        else:
            events.append(self.event("response.function_call_arguments.done", **at, name=item["name"],
                                     arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.output.append(item)
        return events

    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _open(self, item: dict) -> list[str]:
        events = self.close()
        self.open = item
        events.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            item["content"] = [output_text_part("")]
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part=output_text_part("")))
        return events


# --- serving ------------------------------------------------------------------------------------


class OpenAIServingResponses:
    """`/v1/responses`, over the chat route's serving object, with its store."""

    def __init__(self, chat: OpenAIServingChat, request_fields: RequestFields, store: ResponseStore) -> None:
        self.chat = chat
        self.request_fields = request_fields
        self.store = store

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        try:
            return await self._create(request, raw_request)
        except OpenAIError as exc:  # raised on the chat path: name the field as this request does
            exc.param = _FIELD_NAMES.get(exc.param, exc.param)
            raise

    async def _create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        model = self.chat.check_model(request.model)
        request.check_supported()
        items = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_stored(request.previous_response_id, "previous_response_id")
            items = list(previous.items)
        items += request.input_items()
        chat_request = request.to_chat_request(items)
        self.request_fields.prepare(chat_request)  # the generation config's sampling defaults
        chat_request.check_supported()
        params = chat_request.to_sampling_params(chat_request.max_output_tokens, None, "messages")
        mode = chat_request.tool_mode
        tool_parser = self.chat.tool_parser(chat_request.tools) if mode == "auto" else None  # --tool-call-parser's
        if tool_parser is not None:  # a call the model opens is kept well-formed
            await constrain_auto_calls(params, tool_parser)
        tools = chat_request.tools if mode != "none" else None
        prompt_ids = await self.chat.chat_prompt(chat_request.messages, True, tools=tools)
        # The chat route's reasoning parser (--reasoning-parser), bound to this prompt: its
        # thinking becomes a reasoning item, and a grammar waits until the thinking ends.
        parser = self.chat.reasoning_parser
        thinking = parser.for_prompt(prompt_ids) if parser is not None else None
        if thinking is not None:
            thinking.constrain(params)
        self.chat.check_length(prompt_ids, params, "messages")
        response_id = new_item_id("resp")
        streams = await self.chat.submit(response_id, [prompt_ids], params, "messages")
        head = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
                **request.echo_fields()}
        if request.stream:
            events = self._stream(request, mode, tool_parser, params, head, items, streams[0], thinking)
            return EventStreamResponse(events, on_close=lambda: self.chat.abort_unfinished(streams))
        full = self._full(request, mode, tool_parser, head, items, streams, thinking)
        return await run_until_disconnect(raw_request, full)

    def _finish(self, request: ResponsesRequest, head: dict, items: list[dict], output: list[dict],
                finish_reason: str | None, final: RequestOutput, thinking: RequestReasoning | None) -> dict:
        """The finished response object, stored if asked."""
        token_ids = final.outputs[0].token_ids
        num_reasoning = thinking.num_reasoning_tokens(token_ids) if thinking is not None else 0
        incomplete = finish_reason == "length"
        response = {
            **head,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "output": output,
            "usage": response_usage(len(final.prompt_token_ids), final.num_cached_tokens, len(token_ids), num_reasoning),
        }
        if request.store:
            self.store.put(response, items + output, num_input=len(items))
        return response

    async def _full(
        self, request: ResponsesRequest, mode: str, tool_parser: ToolParser | None, head: dict, items: list[dict],
        streams: list[RequestStream], thinking: RequestReasoning | None,
    ) -> Response:
        (final,) = await self.chat.final_outputs(streams)
        choice = final.outputs[0]
        reasoning, text = (None, choice.text) if thinking is None else thinking.split(choice.text)
        message, finish = tool_message(text or "", choice.finish_reason, mode, tool_parser)
        output = output_items(message, reasoning, finish == "length")
        return JSONResponse(self._finish(request, head, items, output, finish, final, thinking))

    async def _stream(
        self, request: ResponsesRequest, mode: str, tool_parser: ToolParser | None, params: SamplingParams,
        head: dict, items: list[dict], stream: RequestStream, thinking: RequestReasoning | None,
    ) -> AsyncIterator[str]:
        events = ResponseEvents()
        try:
            started = {**head, "status": "in_progress", "incomplete_details": None, "error": None, "output": [], "usage": None}
            yield events.event("response.created", response=started)
            yield events.event("response.in_progress", response=started)
            tools = ToolCallStreamer(mode, tool_parser) if mode != "none" else None
            tracker = DeltaTracker(params)  # holds back what may begin a stop sequence
            splitter = thinking.splitter() if thinking is not None else None  # holds back what may begin a tag
            final = finish = None
            async for final in stream:
                for delta in tracker.deltas(final):
                    reasoning, text = "", delta.text
                    if splitter is not None:
                        reasoning, text = splitter.feed(delta.text, final=delta.finish_reason is not None)
                    if reasoning:
                        for item in events.reasoning(reasoning):
                            yield item
                    if tools is None:
                        pieces, finish = ([{"content": text}] if text else []), delta.finish_reason
                    elif text or delta.finish_reason is not None:  # a call opens with the answer, after any thinking
                        pieces, finish = tools.feed(0, text, delta.finish_reason)
                    else:
                        pieces = []
                    for piece in pieces:
                        for item in events.chat_delta(piece):
                            yield item
            if not events.output and events.open is None:  # nothing generated: an empty message
                for item in events.text(""):
                    yield item
            for item in events.close("incomplete" if finish == "length" else "completed"):
                yield item
            response = self._finish(request, head, items, events.output, finish, final, thinking)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield events.event(kind, response=response)
        except (EngineDeadError, RequestFailedError) as exc:
            yield _error_event(events, engine_error(exc))
        except OpenAIError as exc:
            yield _error_event(events, exc)


def _error_event(events: ResponseEvents, exc: OpenAIError) -> str:
    """An error after the 200 went out: OpenAI's `error` event, the stream's last."""
    return events.event("error", code=exc.code or str(exc.status), message=exc.message, param=exc.param)


# --- routes -------------------------------------------------------------------------------------

_RESPONSE_200 = {
    200: {
        "description": "The response; with `stream`, server-sent events (`event: TYPE`, `data: {json}`).",
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    }
}


def responses_router(
    chat: OpenAIServingChat, request_fields: RequestFields, api_keys: list[str], store: ResponseStore
) -> APIRouter:
    """`POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}`."""
    serving = OpenAIServingResponses(chat, request_fields, store)
    router = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_keys))], responses=documented_errors(401))

    @router.post("/responses", responses={**_RESPONSE_200, **documented_errors(400, 404, 408, 413, 503)})
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        request_fields.prepare(request)  # logs unknown fields, refuses unsupported ones
        return await serving.create_response(request, raw_request)

    @router.get("/responses/{response_id}", responses=documented_errors(404))
    async def retrieve_response(response_id: str) -> dict:
        entry = store.get(response_id)
        if entry is None:
            raise not_stored(response_id)
        return entry.response

    @router.get("/responses/{response_id}/input_items", responses=documented_errors(400, 404))
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """OpenAI's list of the items a response was given (the earlier turns' with
        previous_response_id, then its own), `order` "desc" (newest first) or "asc", `limit`
        1-100 at a time, from the item after `after`."""
        entry = store.get(response_id)
        if entry is None:
            raise not_stored(response_id)
        return input_items_page(entry.items[:entry.num_input], limit, order, after)

    @router.delete("/responses/{response_id}", responses=documented_errors(404))
    async def delete_response(response_id: str) -> dict:
        if not store.delete(response_id):
            raise not_stored(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router


def input_items_page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """One page of a response's input items, as OpenAI's list object."""
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be between 1 and 100; got {limit}.", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc'; got {order!r}.", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after names no input item of this response: {after!r}.", "after")
        start = ids.index(after) + 1
    page = [_as_listed(item) for item in ordered[start:start + limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


def _as_listed(item: dict) -> dict:
    """An input item as OpenAI lists it: a message's text content as one text part."""
    if item.get("type", "message") != "message" or not isinstance(item.get("content"), str):
        return item
    part = "output_text" if item.get("role") == "assistant" else "input_text"
    return {**item, "type": "message", "content": [{"type": part, "text": item["content"]}]}
