"""`POST /v1/chat/completions`: messages through the model's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing,
    clamp_logprob,
    finish_events,
    prompt_logprobs_json,
    ranked_at_end,
    usage,
)
from pagedllm.entrypoints.openai.streaming import DeltaTracker, EventStreamResponse, run_until_disconnect, sse
from pagedllm.entrypoints.openai.tools import ToolCallStreamer, tool_message
from pagedllm.outputs import Logprob, PositionLogprobs
from pagedllm.sampling_params import SamplingParams


def _token_entry(logprob: Logprob) -> dict:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(logprob.logprob), "bytes": list(token.encode("utf-8"))}


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
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params(request.max_output_tokens, request.num_logprobs, "messages", request.prompt_logprobs)
        prompt_ids = await self.chat_prompt(
            request.messages, request.add_generation_prompt, request.chat_template, request.chat_template_kwargs,
            request.tools if request.tool_mode != "none" else None,
        )
        self.check_length(prompt_ids, params, "messages")
        request_id = self.new_id("chatcmpl")
        streams = await self.submit(request_id, [prompt_ids], params, "messages")
        if request.stream:
            events = finish_events(self._stream(request, params, model, request_id, streams[0]))
            return EventStreamResponse(events, on_close=lambda: self.abort_unfinished(streams))
        return await run_until_disconnect(raw_request, self._full(request, model, request_id, streams))

    async def _full(
        self, request: ChatCompletionRequest, model: str, request_id: str, streams: list[RequestStream]
    ) -> Response:
        (output,) = await self.final_outputs(streams)
        mode = request.tool_mode
        choices = []
        for position, choice in enumerate(output.outputs):
            message, finish_reason = tool_message(choice.text, choice.finish_reason, mode)
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
            "usage": usage([output]),
        }
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(
        self, request: ChatCompletionRequest, params: SamplingParams, model: str, request_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        created = self.created()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        output = None

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None, stop=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
            body = {**head, "choices": [choice]}
            if request.include_usage:
                body["usage"] = usage([output]) if request.continuous_usage and output is not None else None
            return sse(body)

        # Each choice opens with its role, as OpenAI's stream does.
        for index in range(params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        tracker = DeltaTracker(params)
        tools = ToolCallStreamer(request.tool_mode) if request.tool_mode != "none" else None
        final_only = ranked_at_end(params)
        async for output in stream:
            if final_only and not output.finished:
                continue
            for delta in tracker.deltas(output):
                logprobs = None
                if request.logprobs:
                    logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], request.num_logprobs)
                if tools is not None:  # content and tool-call deltas; the last piece carries the rest
                    pieces, finish = tools.feed(delta.position, delta.text, delta.finish_reason)
                    if not pieces and finish is None:
                        continue
                    pieces = pieces or [{}]
                    for piece in pieces[:-1]:
                        yield chunk(delta.position, piece)
                    yield chunk(delta.position, pieces[-1], logprobs, finish, delta.stop_reason)
                    continue
                content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                yield chunk(delta.position, content, logprobs, delta.finish_reason, delta.stop_reason)
        if request.include_usage and output is not None:
            yield sse({**head, "choices": [], "usage": usage([output])})
