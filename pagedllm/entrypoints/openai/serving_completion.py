"""`POST /v1/completions`: prompts as text or token ids (one or a batch), streamed or not.

With `echo`, each choice's text starts with its prompt; with `logprobs` too, its logprobs start
with the prompt tokens' (the first one's logprob is None: nothing precedes it), which is how
evaluation harnesses score a text's log-likelihood (`echo`, `logprobs=1`, `max_tokens` 0 or 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_llm_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing,
    clamp_logprob,
    finish_events,
    prompt_logprobs_json,
    ranked_at_end,
    usage,
)
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
    token_ids: list[int], logprobs: list[PositionLogprobs | None], num_top: int, offset: int, first_text: str = ""
) -> tuple[dict, int]:
    """OpenAI's completion logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)
    and the text offset after the last token. Like vLLM, each `top_logprobs` entry holds the
    top `num_top` tokens and the chosen one. A position without logprobs (an echoed prompt's
    first token, whose text is `first_text`) has None for both."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs):
        if position is None:
            result["tokens"].append(first_text)
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            result["text_offset"].append(offset)
            offset += len(first_text)
            continue
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
        # Echoing only the prompt still runs one step: the prompt's logprobs come with its first token.
        max_tokens = 1 if request.echo_only else request.max_tokens
        params = request.to_sampling_params(max_tokens, request.logprobs, "prompt", request.num_prompt_logprobs)
        self.check_request_size(len(self._prompt_items(request)), params, "prompt")  # before tokenizing them
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
        items = self._prompt_items(request)
        texts = [item if isinstance(item, str) else None for item in items]
        prompts = [await self.encode(item, request.add_special_tokens) if isinstance(item, str) else list(item) for item in items]
        return texts, prompts

    @staticmethod
    def _prompt_items(request: CompletionRequest) -> list:
        """The request's prompts, each a text or a list of token ids."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [prompt]
        return list(prompt) or [[]]  # an empty list is one empty prompt (refused as such)

    async def _echo_text(self, text: str | None, output: RequestOutput) -> str:
        return text if text is not None else await self.decode(output.prompt_token_ids)

    async def _echoed_logprobs(self, output: RequestOutput, num_top: int) -> tuple[dict, int]:
        """The completion logprobs of the prompt, and the text offset after it."""
        prompt = output.prompt_token_ids
        entries = list(output.prompt_logprobs or [])
        entries = [None] * (len(prompt) - len(entries)) + entries  # None where nothing precedes
        first_text = await self.decode(prompt[:1])
        return completion_logprobs(prompt, entries, num_top, 0, first_text)

    async def _full(
        self, request: CompletionRequest, params: SamplingParams, model: str, request_id: str,
        texts: list[str | None], streams: list[RequestStream],
    ) -> Response:
        finals = await self.final_outputs(streams)
        if request.echo_only:
            finals = [without_generation(output) for output in finals]
        choices = []
        for prompt_index, output in enumerate(finals):
            prefix = await self._echo_text(texts[prompt_index], output) if request.echo else ""
            echoed, offset = ({}, 0)
            if request.echo and request.logprobs is not None:
                echoed, offset = await self._echoed_logprobs(output, request.logprobs)
            for position, choice in enumerate(output.outputs):
                logprobs = None
                if request.logprobs is not None:
                    logprobs, _ = completion_logprobs(choice.token_ids, choice.logprobs or [], request.logprobs, offset)
                    logprobs = _joined(echoed, logprobs)
                entry = {
                    "index": prompt_index * params.n + position,
                    "text": prefix + choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
                if request.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
                choices.append(entry)
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
            if request.echo_only:
                output = without_generation(output)
            latest[prompt_index] = output
            if final_only and not output.finished:
                continue
            for delta in trackers[prompt_index].deltas(output):
                index = prompt_index * params.n + delta.position
                text, head = delta.text, {}
                if request.echo and index not in echoed:
                    echoed.add(index)
                    text = await self._echo_text(texts[prompt_index], output) + text
                    if request.logprobs is not None:
                        head, offsets[index] = await self._echoed_logprobs(output, request.logprobs)
                logprobs = None
                if request.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(
                        delta.token_ids, delta.logprobs or [], request.logprobs, offsets.get(index, 0)
                    )
                    logprobs = _joined(head, logprobs)
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


def _joined(head: dict, tail: dict) -> dict:
    """Two runs of completion logprobs, one after the other."""
    return {key: head.get(key, []) + values for key, values in tail.items()}


def without_generation(output: RequestOutput) -> RequestOutput:
    """`output` with its generated tokens taken out (echo with max_tokens 0: the step that
    computed the prompt's logprobs also sampled a token, which nobody asked for)."""
    outputs = [
        dataclasses.replace(
            c, text="", token_ids=[], logprobs=None if c.logprobs is None else [], cumulative_logprob=0.0
        )
        for c in output.outputs
    ]
    return dataclasses.replace(output, outputs=outputs)
