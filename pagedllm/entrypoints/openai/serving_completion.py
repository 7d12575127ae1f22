"""`POST /v1/completions`: prompts as text or token ids (one or a batch), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, clamp_logprob, finish_events, ranked_at_end, usage
from pagedllm.entrypoints.openai.streaming import (
    DeltaTracker,
    EventStreamResponse,
    merge_streams,
    run_until_disconnect,
    sse,
)
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int, offset: int
) -> tuple[dict, int]:
    """OpenAI's completion logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)
    and the text offset after the last token. Like vLLM, each `top_logprobs` entry holds the
    top `num_top` tokens and the chosen one."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id)
        token = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
        result["tokens"].append(token)
        result["token_logprobs"].append(clamp_logprob(chosen.logprob) if chosen else None)
        ranked = sorted(position.values(), key=lambda lp: lp.rank or 0)
        top = {lp.decoded_token or "": clamp_logprob(lp.logprob) for lp in ranked}
        result["top_logprobs"].append(top if num_top else None)
        result["text_offset"].append(offset)
        offset += len(token)
    return result, offset


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        request.check_supported()
        params = request.to_sampling_params(request.max_tokens, request.logprobs, "prompt")
        texts, prompts = await self._prompts(request)
        for prompt_ids in prompts:
            self.check_length(prompt_ids, params, "prompt")
        request_id = self.new_id("cmpl")
        streams = await self.submit(request_id, prompts, params, "prompt")
        if request.stream:
            events = finish_events(self._stream(request, params, model, request_id, texts, streams))
            return EventStreamResponse(events, on_close=lambda: self.abort_unfinished(streams))
        return await run_until_disconnect(raw_request, self._full(request, params, model, request_id, texts, streams))

    async def _prompts(self, request: CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
        """(prompt texts, None where given as ids; token ids) of each prompt of the request."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            items = [prompt]
        else:
            items = list(prompt) or [[]]  # an empty list is one empty prompt (refused as such)
        texts = [item if isinstance(item, str) else None for item in items]
        prompts = [await self.encode(item, request.add_special_tokens) if isinstance(item, str) else list(item) for item in items]
        return texts, prompts

    async def _echo_text(self, text: str | None, output: RequestOutput) -> str:
        return text if text is not None else await self.decode(output.prompt_token_ids)

    async def _full(
        self, request: CompletionRequest, params: SamplingParams, model: str, request_id: str,
        texts: list[str | None], streams: list[RequestStream],
    ) -> Response:
        finals = await self.final_outputs(streams)
        choices = []
        for prompt_index, output in enumerate(finals):
            prefix = await self._echo_text(texts[prompt_index], output) if request.echo else ""
            for position, choice in enumerate(output.outputs):
                logprobs = None
                if request.logprobs is not None:
                    logprobs, _ = completion_logprobs(choice.token_ids, choice.logprobs or [], request.logprobs, 0)
                choices.append(
                    {
                        "index": prompt_index * params.n + position,
                        "text": prefix + choice.text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                )
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": self.created(),
            "model": model,
            "choices": choices,
            "usage": usage(finals),
        }
        return JSONResponse(body)

    async def _stream(
        self, request: CompletionRequest, params: SamplingParams, model: str, request_id: str,
        texts: list[str | None], streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = self.created()
        trackers = [DeltaTracker(params) for _ in streams]
        latest: list[RequestOutput | None] = [None] * len(streams)
        offsets: dict[int, int] = {}  # text offset of each choice's next token
        echoed: set[int] = set()
        final_only = ranked_at_end(params)
        async for prompt_index, output in merge_streams(streams):
            latest[prompt_index] = output
            if final_only and not output.finished:
                continue
            for delta in trackers[prompt_index].deltas(output):
                index = prompt_index * params.n + delta.position
                text = delta.text
                if request.echo and index not in echoed:
                    echoed.add(index)
                    text = await self._echo_text(texts[prompt_index], output) + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(
                        delta.token_ids, delta.logprobs or [], request.logprobs, offsets.get(index, 0)
                    )
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
                chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
                if request.include_usage:
                    chunk["usage"] = usage(latest) if request.continuous_usage else None
                yield sse(chunk)
        if request.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(latest)})
