"""llama-server's native routes (llama.cpp's HTTP server), so that a llama.cpp client works
unchanged: `POST /completion` (and `/completions`), `GET /props`, `GET /slots`.

`/completion` runs on the `/v1/completions` machinery (`OpenAIServing`: tokenizing, length
checks, submitting, aborting on disconnect) and answers in llama-server's shapes: one JSON
object per prompt (`content`, `stop_type`, `timings`, `completion_probabilities`, ...), or
server-sent events, one per new piece of text, the last with `"stop": true` and the whole
result (without `data: [DONE]`, as llama-server). The request fields are in `llama_protocol`.

`/props` and `/slots` are read-only: a slot is a request in flight, and its id is the request's
number (`id_task`), the engine having no fixed slots; `POST /props` and slot actions are refused.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedllm import __version__
from pagedllm.engine.async_llm_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, documented_errors, error_body
from pagedllm.entrypoints.openai.llama_protocol import (
    LlamaCompletionRequest,
    generation_settings,
    llama_defaults,
    renamed,
)
from pagedllm.entrypoints.openai.server_options import api_key_check
from pagedllm.entrypoints.openai.serving_base import InFlightRequest, clamp_logprob, engine_error
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion, without_generation
from pagedllm.entrypoints.openai.streaming import (
    SSE_EVENT_SCHEMA, DeltaTracker, EventStreamResponse, merge_streams, run_until_disconnect, sse,
)
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams

_STREAMED_200 = {
    200: {
        "description": "llama-server's completion (a list of them for a list of prompts); with `stream`, "
        "server-sent events, the last with `\"stop\": true`.",
        "content": {
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA}
        },
    }
}


def stop_type(choice: CompletionOutput) -> tuple[str, str]:
    """llama-server's `stop_type` ("eos", "word", "limit", "none") and `stopping_word`."""
    if choice.finish_reason == "length":
        return "limit", ""
    if choice.finish_reason == "stop":
        return ("word", choice.stop_reason) if isinstance(choice.stop_reason, str) else ("eos", "")
    return "none", ""


def _token(token_id: int, text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"id": token_id, "token": text, "bytes": list(text.encode("utf-8")), "logprob": clamp_logprob(logprob)}


def completion_probabilities(token_ids: list[int], logprobs: list[PositionLogprobs] | None, n_probs: int) -> list[dict]:
    """Per generated token, llama-server's entry: the token, its logprob and the `n_probs` most
    likely tokens at that position (`top_logprobs`, most likely first)."""
    entries = []
    for token_id, position in zip(token_ids, logprobs or []):
        chosen = position.get(token_id)
        ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)
        entry = _token(token_id, chosen.decoded_token if chosen else None, chosen.logprob if chosen else float("-inf"))
        entry["top_logprobs"] = [_token(t, lp.decoded_token, lp.logprob) for t, lp in ranked[:n_probs]]
        entries.append(entry)
    return entries


def timings(output: RequestOutput) -> dict:
    """llama-server's `timings`: the prompt phase from arrival to the first token (waiting and
    prefill: one engine step computes the prompt and samples the first token), then the rest."""
    metrics = output.metrics
    predicted_n = sum(len(c.token_ids) for c in output.outputs)
    cache_n = output.num_cached_tokens
    prompt_n = len(output.prompt_token_ids) - cache_n
    prompt_ms = predicted_ms = 0.0
    if metrics is not None:
        start = metrics.arrival_time
        first = metrics.first_token_time or start
        end = metrics.finished_time or metrics.last_token_time or first
        prompt_ms, predicted_ms = (first - start) * 1000, (end - first) * 1000

    def rates(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1000 * n / ms if ms > 0 else 0.0)

    prompt_per_token_ms, prompt_per_second = rates(prompt_n, prompt_ms)
    predicted_per_token_ms, predicted_per_second = rates(predicted_n, predicted_ms)
    return {
        "cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token_ms,
        "prompt_per_second": prompt_per_second, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_per_token_ms, "predicted_per_second": predicted_per_second,
    }


class LlamaServingCompletion:
    """`POST /completion` over the `/v1/completions` serving object (its tokenizer, checks and
    requests in flight)."""

    def __init__(self, completions: OpenAIServingCompletion, defaults: dict) -> None:
        self.serving = completions
        # By this API's names (llama_defaults). Not RequestFields.prepare, which refuses the
        # samplers this engine lacks even when sent switched off, as llama.cpp's clients send them.
        self.defaults = defaults

    async def create_completion(self, request: LlamaCompletionRequest, raw_request: Request) -> Response:
        request.check_supported()
        serving = self.serving
        try:
            prompts = [await self._prompt_ids(prompt) for prompt in _prompt_list(request.prompt)]
            params = request.to_sampling_params(self.defaults, await self._logit_bias(request))
            for prompt_ids in prompts:
                serving.check_length(prompt_ids, params, "prompt")
            streams = await serving.submit(serving.new_id("cmpl"), prompts, params, "prompt")
        except OpenAIError as exc:
            raise renamed(exc) from None
        if request.stream:
            events = self._stream(request, params, streams)
            return EventStreamResponse(events, on_close=lambda: serving.abort_unfinished(streams))
        return await run_until_disconnect(raw_request, self._full(request, params, streams))

    async def _prompt_ids(self, prompt: str | list[int | str]) -> list[int]:
        """A prompt's token ids: strings tokenized in place, with the BOS token (where the
        tokenizer adds one) only before a string that starts the prompt, as llama-server."""
        if isinstance(prompt, str):
            return await self.serving.encode(prompt, add_special_tokens=True)
        ids: list[int] = []
        for index, piece in enumerate(prompt):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(await self.serving.encode(piece, add_special_tokens=index == 0))
        vocab = self.serving.vocab_size
        bad = [token for token in ids if not 0 <= token < vocab]
        if bad:
            raise bad_request(f"prompt: token ids must be in [0, {vocab}); got {bad[:5]}.", "prompt")
        return ids

    async def _logit_bias(self, request: LlamaCompletionRequest) -> dict[int, float] | None:
        """llama-server's `logit_bias`: `[[token id or text, bias or false], ...]` or an object of
        them (a text stands for each of its tokens; `false` bans a token; `true` changes nothing)."""
        given = request.logit_bias
        if not given:
            return None
        pairs = list(given.items()) if isinstance(given, dict) else given
        bias: dict[int, float] = {}
        for pair in pairs:
            key, value = pair if len(pair) == 2 else (None, None)
            if value is True:  # neither a bias nor a ban: llama-server skips it
                continue
            if isinstance(key, str) and isinstance(given, dict) and key.lstrip("-").isdigit():
                key = int(key)  # an object's keys are text: a number is a token id
            if not isinstance(key, (int, str)) or isinstance(key, bool) or not isinstance(value, (int, float)):
                raise bad_request("logit_bias entries must be [token id or text, bias or false].", "logit_bias")
            ids = [key] if isinstance(key, int) else await self.serving.encode(key, False, "logit_bias")
            bias.update(dict.fromkeys(ids, -LOGIT_BIAS_LIMIT if value is False else float(value)))
        return bias or None

    async def _full(self, request: LlamaCompletionRequest, params: SamplingParams, streams: list[RequestStream]) -> Response:
        slots = [self._slot_id(stream) for stream in streams]  # before they leave the list in flight
        finals = await self.serving.final_outputs(streams)
        results = [await self._result(request, params, i, output, slots[i], False) for i, output in enumerate(finals)]
        return JSONResponse(results[0] if len(results) == 1 else results)

    async def _result(
        self, request: LlamaCompletionRequest, params: SamplingParams, index: int, output: RequestOutput,
        slot_id: int, streamed: bool,
    ) -> dict:
        """llama-server's final result of one prompt (`streamed`: its text went out already)."""
        nothing = request.n_predict_value == 0  # the prompt only: the one token run is dropped
        if nothing:
            output = without_generation(output)
        choice = output.outputs[0]
        kind, word = ("limit", "") if nothing else stop_type(choice)
        result = {
            "index": index,
            "content": "" if streamed else choice.text,
            "tokens": choice.token_ids if request.return_tokens and not streamed else [],
            "id_slot": slot_id,
            "stop": True,
            "model": self.serving.served_model_names[0],
            "tokens_predicted": len(choice.token_ids),
            "tokens_evaluated": len(output.prompt_token_ids),
            "generation_settings": generation_settings(params, request.stream, request.num_probs),
            "prompt": await self.serving.decode(output.prompt_token_ids),
            "has_new_line": "\n" in choice.text,
            "truncated": False,
            "stop_type": kind,
            "stopping_word": word,
            "tokens_cached": output.num_cached_tokens,
            "timings": timings(output),
        }
        if request.num_probs and not streamed:
            result["completion_probabilities"] = completion_probabilities(choice.token_ids, choice.logprobs, request.num_probs)
        return result

    def _slot_id(self, stream: RequestStream) -> int:
        entry = self.serving.in_flight.get(stream.request_id)
        return entry.task_id if entry is not None else -1

    async def _stream(self, request: LlamaCompletionRequest, params: SamplingParams, streams: list[RequestStream]):
        """One event per new piece of text of any prompt, then each prompt's final result; an
        error after the 200 went out is an event with the error body."""
        trackers = [DeltaTracker(params) for _ in streams]
        slots = [self._slot_id(stream) for stream in streams]
        try:
            async for index, output in merge_streams(streams):
                view = without_generation(output) if request.n_predict_value == 0 else output
                for delta in trackers[index].deltas(view):
                    if delta.text or delta.token_ids:
                        event = {
                            "index": index, "content": delta.text, "tokens": delta.token_ids, "stop": False,
                            "id_slot": slots[index], "tokens_predicted": len(view.outputs[0].token_ids),
                            "tokens_evaluated": len(output.prompt_token_ids),
                        }
                        if request.timings_per_token:
                            event["timings"] = timings(view)
                        if request.num_probs:
                            event["completion_probabilities"] = completion_probabilities(
                                delta.token_ids, delta.logprobs, request.num_probs
                            )
                        yield sse(event)
                    if delta.finish_reason is not None:
                        yield sse(await self._result(request, params, index, output, slots[index], True))
        except (EngineDeadError, RequestFailedError) as exc:
            yield sse(engine_error(exc).body())
        except OpenAIError as exc:
            yield sse(exc.body())


def _prompt_list(prompt: str | list) -> list[str | list[int | str]]:
    """The request's prompts: a list holding a token id is one prompt, a list of strings and
    lists is several (llama-server's reading)."""
    shapes = "prompt: give a string, a list of token ids and strings, or a list of such prompts."
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(shapes, "prompt")
    if any(isinstance(p, int) for p in prompt):
        if any(isinstance(p, list) for p in prompt):  # token ids beside a nested list: neither reading
            raise bad_request(shapes, "prompt")
        return [prompt]
    return list(prompt)


def llama_router(completions: OpenAIServingCompletion, default_sampling: dict, api_keys: list[str]) -> APIRouter:
    """llama-server's routes over the `/v1/completions` serving object, behind the API keys;
    `default_sampling`: the generation config's (`ServerOptions.default_sampling`)."""
    engine = completions.engine
    defaults = llama_defaults(default_sampling)
    llama = LlamaServingCompletion(completions, defaults)
    config = engine.engine.config
    total_slots = config.scheduler.max_num_seqs
    speculative = config.speculative is not None
    router = APIRouter(dependencies=[Depends(api_key_check(api_keys))], responses=documented_errors(401))
    errors = documented_errors(400, 408, 413, 503)

    @router.post("/completion", responses={**_STREAMED_200, **errors})
    async def completion(request: LlamaCompletionRequest, raw_request: Request) -> Response:
        return await llama.create_completion(request, raw_request)

    @router.post("/completions", responses={**_STREAMED_200, **errors})
    async def completions_alias(request: LlamaCompletionRequest, raw_request: Request) -> Response:
        return await llama.create_completion(request, raw_request)

    default_params = SamplingParams(
        temperature=defaults["temperature"], top_k=defaults["top_k"], top_p=defaults["top_p"],
        min_p=defaults["min_p"], repetition_penalty=defaults["repeat_penalty"], max_tokens=None,
    )

    def slot(entry: InFlightRequest | None) -> dict:
        """A request in flight as llama-server's slot; None: an idle slot with the defaults."""
        params = entry.params if entry is not None else default_params
        decoded = entry.num_output_tokens if entry is not None else 0
        return {
            "id": entry.task_id if entry is not None else 0,
            "id_task": entry.task_id if entry is not None else -1,
            "request_id": entry.request_id if entry is not None else None,
            "n_ctx": engine.max_model_len,
            "speculative": speculative,
            "is_processing": entry is not None,
            "params": generation_settings(params, n_probs=params.logprobs or 0),
            "n_prompt_tokens": entry.num_prompt_tokens if entry is not None else 0,
            "next_token": {
                "has_next_token": entry is not None,
                "n_remain": -1 if params.max_tokens is None else max(params.max_tokens - decoded, 0),
                "n_decoded": decoded,
            },
        }

    template = getattr(completions.tokenizer, "chat_template", None)
    props = {
        "total_slots": total_slots,
        "model_path": engine.model_path,
        "model_alias": completions.served_model_names[0],
        "chat_template": template if isinstance(template, str) else "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"pagedllm {__version__}",
        "is_sleeping": False,
    }

    @router.get("/props")
    async def get_props() -> dict:
        return {"default_generation_settings": slot(None), **props}

    @router.post("/props", responses=documented_errors(400))
    async def set_props() -> Response:
        raise bad_request("This server's properties are read-only: they are set by `pagedllm serve`'s flags.")

    @router.get("/slots", responses=documented_errors(400, 503))
    async def get_slots(fail_on_no_slot: int = Query(0, description="1: answer 503 when every slot is busy")) -> Response:
        entries = completions.in_flight.snapshot()
        if fail_on_no_slot and len(entries) >= total_slots:
            return JSONResponse(error_body(503, "No slot available: every one is processing a request."), status_code=503)
        return JSONResponse([slot(entry) for entry in entries])

    @router.post("/slots/{id_slot}", responses=documented_errors(400))
    async def slot_action(id_slot: str) -> Response:
        raise bad_request(
            "Slot actions (save, restore, erase) are not supported: this engine has no per-slot cache; "
            "it shares prompt prefixes across requests by itself (prefix caching).", "action"
        )

    return router

