"""`POST /v1/embeddings` (OpenAI's shape) and vLLM's `POST /pooling`: each input becomes one
pooling request (`PoolingParams`), batched through the scheduler beside generation; the vector
is the final hidden state pooled as the server's `--pooler-config` says (by default the last
token's, L2-normalized), cut to `dimensions` if asked.

Served by every server, whatever `--task`/`--runner` says (see docs/serving.md): the weights
that generate also embed, and both kinds of request share the KV cache.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.embedding_protocol import EmbeddingRequest, PoolingRequest
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, documented_errors
from pagedllm.entrypoints.openai.server_options import RequestFields, api_key_check
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.streaming import run_until_disconnect
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import EMBED_TASKS, PoolingParams


def encode_vector(vector, encoding_format: str) -> list[float] | str:
    """A float32 tensor as OpenAI sends it: a list of floats, or base64 of its little-endian
    float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        params = self._pooling_params(request)
        prompts, param = await self._prompts(request)
        request_id = self.new_id("embd")
        streams = await self.add_prompts(request_id, prompts, params, param)

        async def respond() -> Response:
            finals = await self.final_outputs(streams)
            data = [
                {"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data, request.encoding_format)}
                for i, o in enumerate(finals)
            ]
            body = {"id": request_id, "object": "list", "created": self.created(), "model": model, "data": data,
                    "usage": _usage(finals)}
            return JSONResponse(body)

        return await run_until_disconnect(raw_request, respond())

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        if request.task is not None and request.task not in EMBED_TASKS:
            raise bad_request(
                f"task {request.task!r} is not served here: /pooling serves 'embed' (one vector per input).", "task"
            )
        params = self._pooling_params(request)
        prompts, param = await self._prompts(request)
        request_id = self.new_id("pool")
        streams = await self.add_prompts(request_id, prompts, params, param)

        async def respond() -> Response:
            finals = await self.final_outputs(streams)
            data = [
                {"index": i, "object": "pooling", "data": encode_vector(o.outputs.data, request.encoding_format)}
                for i, o in enumerate(finals)
            ]
            body = {"id": request_id, "object": "list", "created": self.created(), "model": model, "data": data,
                    "usage": {**_usage(finals), "completion_tokens": 0}}
            return JSONResponse(body)

        return await run_until_disconnect(raw_request, respond())

    # --- the request's parts ----------------------------------------------------------------

    def _pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        size = self.engine.engine.embedding_size
        if request.dimensions is not None and not 1 <= request.dimensions <= size:
            raise bad_request(
                f"dimensions must be between 1 and this model's {size} hidden dimensions, got {request.dimensions}.",
                "dimensions",
            )
        return PoolingParams(dimensions=request.dimensions, normalize=request.normalize)

    async def _prompts(self, request: EmbeddingRequest) -> tuple[list[list[int]], str]:
        """The token ids of each input (or of the chat `messages`), truncated as asked, each
        within the context; and the field errors about them name."""
        if request.messages is not None:
            if request.input is not None:
                raise bad_request("Give input or messages, not both.", "input")
            ids = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                         template_kwargs=request.chat_template_kwargs)
            return [self._fitted(ids, request, "The messages", "messages")], "messages"
        items = _input_items(request)
        limit = self.engine.engine.config.limits.max_seqs_per_request
        if len(items) > limit:
            raise bad_request(
                f"This request has {len(items):,} inputs; this server embeds at most {limit:,} per request "
                "(--max-seqs-per-request). Split it into several requests.", "input",
            )
        prompts = []
        for index, item in enumerate(items):
            name = "The input" if len(items) == 1 else f"Input {index}"
            if isinstance(item, str):
                ids = await self._encode_input(item, request, name)
            else:
                bad = [t for t in item if not 0 <= t < self.vocab_size]
                if bad:
                    raise bad_request(f"{name} holds token ids outside [0, {self.vocab_size}): {bad[:5]}.", "input")
                ids = list(item)
            prompts.append(self._fitted(ids, request, name, "input"))
        return prompts, "input"

    async def _encode_input(self, text: str, request: EmbeddingRequest, name: str) -> list[int]:
        truncating = request.truncate_prompt_tokens is not None
        try:
            if truncating and len(text) > self.max_prompt_chars:  # whole, then truncated: no length to refuse
                return await self._on_large_text_thread(
                    self._large_tokenizer.encode, text, add_special_tokens=request.add_special_tokens
                )
            return await self.encode(text, request.add_special_tokens, param="input", within_context=not truncating)
        except OpenAIError as exc:
            raise bad_request(f"{name}: {exc.message}", "input") from None

    def _fitted(self, ids: list[int], request: EmbeddingRequest, name: str, param: str) -> list[int]:
        keep = request.truncate_prompt_tokens
        if keep == 0:
            raise bad_request("truncate_prompt_tokens must be >= 1 (keep that many last tokens) or -1 (the last "
                              "max_model_len); drop it to keep every token.", "truncate_prompt_tokens")
        if keep is not None:
            ids = ids[-(self.max_model_len if keep == -1 else keep):]
        if not ids:
            raise bad_request(f"{name} has no tokens; give a non-empty input.", param)
        if len(ids) > self.max_model_len:
            raise bad_request(
                f"{name} has {len(ids)} tokens, more than this model's context of {self.max_model_len}; shorten it, "
                "or send truncate_prompt_tokens to keep its last tokens.", param,
            )
        return ids


def _input_items(request: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, each a text or a list of token ids."""
    given = request.input
    if given is None:
        raise bad_request("input is required: a string, a list of token ids, or a list of either.", "input")
    if isinstance(given, str) or all(isinstance(t, int) for t in given):
        return [given]
    return list(given)


def _usage(outputs: list[PoolingRequestOutput]) -> dict:
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": num_prompt, "total_tokens": num_prompt}


def embedding_router(serving: OpenAIServingEmbedding, request_fields: RequestFields, api_keys: list[str]) -> APIRouter:
    """`/v1/embeddings` and `/pooling`, behind the API key when keys are set."""
    router = APIRouter(dependencies=[Depends(api_key_check(api_keys))])
    errors = documented_errors(400, 401, 404, 408, 413, 503)

    @router.post("/v1/embeddings", responses=errors)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        request_fields.prepare(request)
        return await serving.create_embedding(request, raw_request)

    @router.post("/pooling", responses=errors)
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        request_fields.prepare(request)
        return await serving.create_pooling(request, raw_request)

    return router

