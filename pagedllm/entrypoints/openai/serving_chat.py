"""`POST /v1/chat/completions`: messages through the model's chat template, streamed or not. With a
reasoning parser (`--reasoning-parser`), a message's thinking goes to `reasoning` (vLLM's name)
and `reasoning_content` (the older one), the rest to `content`; tool calls are parsed from the
content only, and usage counts the reasoning tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import ReasoningSplitter, RequestReasoning
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing,
    clamp_logprob,
    finish_events,
    prompt_logprobs_json,
    ranked_at_end,
    usage,
)
from pagedllm.entrypoints.openai.streaming import DeltaTracker, EventStreamResponse, run_until_disconnect, sse
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import constrain_auto_calls
from pagedllm.entrypoints.openai.tools import HermesToolParser, ToolCallStreamer, ToolParser, tool_functions, tool_message
from pagedllm.outputs import Logprob, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams


def _token_entry(logprob: Logprob) -> dict:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(logprob.logprob), "bytes": list(token.encode("utf-8"))}


def reasoning_fields(reasoning: str | None) -> dict:
    """A message's or delta's reasoning, under vLLM's current name and its older one."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def chat_usage(output: RequestOutput | None, thinking: RequestReasoning | None) -> dict:
    """Usage, with the reasoning tokens of every choice when the server parses reasoning."""
    body = usage([output])
    if thinking is not None and output is not None:
        num = sum(thinking.num_reasoning_tokens(choice.token_ids) for choice in output.outputs)
        body["completion_tokens_details"] = {"reasoning_tokens": num}
    return body


def chat_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int) -> dict:
    """OpenAI's chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`, the
    top list holding the `num_top` most likely tokens, best first."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id) or Logprob(float("-inf"))
        top = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append({**_token_entry(chosen), "top_logprobs": [_token_entry(lp) for lp in top]})
    return {"content": content}


class OpenAIServingChat(OpenAIServing):
    # The format of the calls a model makes on its own ("auto"): --tool-call-parser, set by build_app.
    tool_parser_class: type[ToolParser] = HermesToolParser

    def tool_parser(self, tools: list[dict] | None) -> ToolParser:
        """The server's tool-call parser for a request's declared `tools` (a call of another
        name is not a call)."""
        return self.tool_parser_class(tool_functions(tools) if tools else None)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params(request.max_output_tokens, request.num_logprobs, "messages", request.prompt_logprobs)
        if request.tool_mode == "auto":  # a call the model opens is kept well-formed
            await constrain_auto_calls(params, self.tool_parser(request.tools))
        prompt_ids = await self.chat_prompt(
            request.messages, request.add_generation_prompt, request.chat_template, request.chat_template_kwargs,
            request.tools if request.tool_mode != "none" else None, request.continue_final_message,
        )
        thinking = self.reasoning_parser.for_prompt(prompt_ids) if self.reasoning_parser is not None else None
        if thinking is not None:
            thinking.constrain(params)  # a grammar applies once the reasoning ends
        self.check_length(prompt_ids, params, "messages")
        request_id = self.new_id("chatcmpl")
        streams = await self.submit(request_id, [prompt_ids], params, "messages")
        if request.stream:
            events = finish_events(self._stream(request, params, model, request_id, streams[0], thinking))
            return EventStreamResponse(events, on_close=lambda: self.abort_unfinished(streams))
        return await run_until_disconnect(raw_request, self._full(request, model, request_id, streams, thinking))

    async def _full(
        self, request: ChatCompletionRequest, model: str, request_id: str, streams: list[RequestStream],
        thinking: RequestReasoning | None,
    ) -> Response:
        (output,) = await self.final_outputs(streams)
        mode = request.tool_mode
        parser = self.tool_parser(request.tools) if mode == "auto" else None
        choices = []
        for position, choice in enumerate(output.outputs):
            if thinking is None:
                message, finish_reason = tool_message(choice.text, choice.finish_reason, mode, parser)
            else:  # tool calls are parsed from the answer, never from the thinking
                reasoning, content = thinking.split(choice.text)
                message, finish_reason = tool_message(content or "", choice.finish_reason, mode, parser)
                message = {**message, "content": message["content"] or None,
                           **reasoning_fields(reasoning if request.include_reasoning else None)}
            logprobs = chat_logprobs(choice.token_ids, choice.logprobs or [], request.num_logprobs) if request.logprobs else None
            choices.append(
                {
                    "index": position,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": self.created(),
            "model": model,
            "choices": choices,
            "usage": chat_usage(output, thinking),
        }
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(
        self, request: ChatCompletionRequest, params: SamplingParams, model: str, request_id: str, stream: RequestStream,
        thinking: RequestReasoning | None = None,
    ) -> AsyncIterator[str]:
        created = self.created()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        output = None

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None, stop=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
            body = {**head, "choices": [choice]}
            if request.include_usage:
                # (the reasoning tokens are counted once, in the last usage)
                body["usage"] = usage([output]) if request.continuous_usage and output is not None else None
            return sse(body)

        # Each choice opens with its role, as OpenAI's stream does.
        for index in range(params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        tracker = DeltaTracker(params)
        tools = ToolCallStreamer(request.tool_mode, self.tool_parser(request.tools)) if request.tool_mode != "none" else None
        splitters: dict[int, ReasoningSplitter] = {}  # each choice's, with a reasoning parser
        final_only = ranked_at_end(params)
        async for output in stream:
            if final_only and not output.finished:
                continue
            for delta in tracker.deltas(output):
                logprobs = None
                if request.logprobs:
                    logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], request.num_logprobs)
                text, thought = delta.text, {}
                if thinking is not None:  # the thinking apart; the rest goes on as content (or tool calls)
                    if delta.position not in splitters:
                        splitters[delta.position] = thinking.splitter()
                    reasoning, text = splitters[delta.position].feed(delta.text, final=delta.finish_reason is not None)
                    if reasoning and request.include_reasoning:
                        thought = reasoning_fields(reasoning)
                if tools is not None:  # content and tool-call deltas; the last piece carries the rest
                    pieces, finish = [], None
                    if text or delta.finish_reason is not None or thinking is None:  # a call opens with the answer
                        pieces, finish = tools.feed(delta.position, text, delta.finish_reason)
                    pieces = [thought, *pieces] if thought else pieces
                    if not pieces and finish is None:
                        continue
                    pieces = pieces or [{}]
                    for piece in pieces[:-1]:
                        yield chunk(delta.position, piece)
                    yield chunk(delta.position, pieces[-1], logprobs, finish, delta.stop_reason)
                    continue
                if thinking is None:
                    content = {"content": text} if text or delta.finish_reason is None else {}
                else:
                    content = {**thought, **({"content": text} if text else {})}
                    if not content and delta.finish_reason is None and logprobs is None:
                        continue  # text held back (a tag may be starting)
                yield chunk(delta.position, content, logprobs, delta.finish_reason, delta.stop_reason)
        if request.include_usage and output is not None:
            yield sse({**head, "choices": [], "usage": chat_usage(output, thinking)})
