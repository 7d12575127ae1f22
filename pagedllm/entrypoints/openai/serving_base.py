"""What the completion and chat endpoints share: the model check, tokenizing and templating
prompts, length checks, submitting requests to the engine, and usage."""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pagedllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, invalid_input, model_not_found
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.streaming import DONE, merge_streams, sse
from pagedllm.entrypoints.openai.tools import template_conversation, tool_fields
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# OpenAI's JSON cannot carry -inf; vLLM reports impossible tokens with this instead.
MIN_LOGPROB = -9999.0
# apply_chat_template's own arguments, which chat_template_kwargs may not replace.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
# A text longer than max_model_len tokens of the longest token, times this margin (for tokenizers
# whose normalisation drops characters), cannot fit the context: it is refused untokenized.
PROMPT_CHARS_MARGIN = 2
# A text above this many characters is tokenized on a thread of its own (one client's huge input
# never queues the others' behind it), and counted a piece at a time first: once its pieces hold
# more tokens than the context, it is refused there (a 5 MB text of 2.4M tokens was tokenized
# whole before being refused, for 12 s and 1.5 GiB).
LARGE_TEXT_CHARS = 32_768
COUNT_PIECE_CHARS = 16_384
# Tokens a cut between two pieces can add to their count (a word split, a leading-space marker).
COUNT_SLACK_PER_CUT = 4

T = TypeVar("T")


def max_token_chars(tokenizer) -> int:
    """The most characters any one token covers (its vocabulary string is at least as long: one
    character per byte for byte-level BPE, the word-start marker for SentencePiece)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_json(prompt_logprobs: list[PositionLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first (nothing precedes
    it), then {token id: {logprob, rank, decoded_token}} for the token and the top ones."""
    if prompt_logprobs is None:
        return None
    return [
        None if position is None else {
            str(token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def engine_error(exc: Exception) -> OpenAIError:
    """An engine-side failure as the error the client gets."""
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, str(exc), code="request_failed")
    return OpenAIError(500, f"Internal error: {exc!r}")


async def finish_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream `events`, then `data: [DONE]`; an error after the 200 went out can only be an
    event, so it becomes one (OpenAI's error body) before the end."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, RequestFailedError) as exc:
        yield sse(engine_error(exc).body())
    except OpenAIError as exc:
        yield sse(exc.body())
    finally:
        await events.aclose()
    yield DONE


def usage(outputs: list[RequestOutput | None]) -> dict:
    """OpenAI's usage block for the outputs of one API request (several for a prompt batch)."""
    done = [o for o in outputs if o is not None]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in done)
    completion_tokens = sum(len(c.token_ids) for o in done for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in done)},
    }


def ranked_at_end(params: SamplingParams) -> bool:
    """Beams and best-of-n pick their returned sequences only when done, so partial outputs
    would stream sequences that may not be returned: such requests stream their final text."""
    return params.use_beam_search or params.best_of > params.n


@dataclass(slots=True)
class InFlightRequest:
    """A request this server gave the engine and has not yet seen end (llama-server's /slots)."""

    task_id: int  # numbered in the order requests arrived
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    stream: RequestStream  # counts the tokens generated so far

    @property
    def num_output_tokens(self) -> int:
        return self.stream.num_output_tokens


class InFlightRequests:
    """The requests in flight, shared by the serving objects of one app: each API request's
    engine requests enter when the engine accepts them and leave when their handler ends
    (`OpenAIServing.abort_unfinished`, which every route calls however it ends)."""

    def __init__(self) -> None:
        self._requests: dict[str, InFlightRequest] = {}
        self._task_ids = itertools.count()

    def add(self, streams: list[RequestStream], prompts: list[list[int]], params: SamplingParams) -> None:
        for stream, prompt in zip(streams, prompts):
            entry = InFlightRequest(next(self._task_ids), stream.request_id, len(prompt), params, stream)
            self._requests[stream.request_id] = entry

    def remove(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self._requests.pop(stream.request_id, None)

    def get(self, request_id: str) -> InFlightRequest | None:
        return self._requests.get(request_id)

    def snapshot(self) -> list[InFlightRequest]:
        """Oldest first."""
        return list(self._requests.values())


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        # Replaced by one shared with the app's other serving objects (build_app).
        self.in_flight = InFlightRequests()
        self.served_model_names = served_model_names
        self.max_model_len = engine.max_model_len
        # The engine thread detokenizes with the engine's tokenizer. Requests are tokenized with
        # a copy, on a thread of its own (a fast tokenizer is not safe to share across threads),
        # so that a long prompt never stalls the event loop and the streams it serves.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer) * PROMPT_CHARS_MARGIN
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
        self._large_text_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer-large")
        # The generation config's max_new_tokens: a cap on every request's max_tokens, as vLLM has it.
        self.max_tokens_cap: int | None = None
        # The served model's reasoning format (--reasoning-parser), set by build_app; None: none.
        self.reasoning_parser: ReasoningParser | None = None

    async def _on_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    @functools.cached_property
    def _large_tokenizer(self):
        """The large texts' thread's own copy, made when the first large text comes."""
        return copy.deepcopy(self.tokenizer)

    async def _on_large_text_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._large_text_thread, functools.partial(fn, *args, **kwargs))

    # --- checks and prompts -----------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model name to answer with; 404 if the request names another model."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise model_not_found(model)
        return model

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt", within_context: bool = True) -> list[int]:
        """Token ids of `text`; a text too long to fit the context in any tokenization is refused
        before the work, and a large one (LARGE_TEXT_CHARS) on its own thread as soon as its
        pieces count more tokens than the context (unless not `within_context`: /tokenize)."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"The {param} has {len(text):,} characters, more than the {self.max_model_len} tokens of this "
                f"model's context can hold ({self.max_prompt_chars:,} characters at most); shorten it.",
                param,
            )
        if len(text) <= LARGE_TEXT_CHARS:
            return await self._on_tokenizer_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await self._on_large_text_thread(self._encode_large, text, add_special_tokens, param, within_context)

    def _encode_large(self, text: str, add_special_tokens: bool, param: str, within_context: bool) -> list[int]:
        if within_context:
            counted = self._count_past_context(text)
            if counted is not None:
                tokens, chars = counted
                raise bad_request(
                    f"The {param} has more tokens than this model's context of {self.max_model_len} ({tokens:,} in "
                    f"its first {chars:,} of {len(text):,} characters); shorten it.", param,
                )
        return self._large_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _count_past_context(self, text: str) -> tuple[int, int] | None:
        """Count `text`'s tokens a piece at a time, cut at spaces; (tokens, characters counted)
        once the count, less what the cuts can add, reaches the context: the whole cannot fit.
        None if it may fit."""
        tokens, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + COUNT_PIECE_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + COUNT_PIECE_CHARS // 2, end)
                end = space if space > start else end
                cuts += 1
            tokens += len(self._large_tokenizer.encode(text[start:end], add_special_tokens=False))
            start = end
            if tokens - COUNT_SLACK_PER_CUT * cuts >= self.max_model_len:
                return tokens, start
        return None

    async def decode(self, token_ids: list[int]) -> str:
        return await self._on_tokenizer_thread(self.tokenizer.decode, token_ids, skip_special_tokens=False)

    async def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool,
        chat_template: str | None = None, template_kwargs: dict | None = None, tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template (or `chat_template`, a
        request's own), with `template_kwargs` as extra template variables and `tools` as the
        template takes them (see `tools.template_conversation`); with `continue_final_message`,
        the last message is left open for the output to continue."""
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}: they are request fields.", "chat_template_kwargs")
        if not chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("This model's tokenizer has no chat template; use /v1/completions.", "messages")
        conversation = [
            {"role": m.role, "content": self._message_text(m), **tool_fields(m)} for m in messages
        ]
        template = chat_template or self.tokenizer.chat_template
        conversation = template_conversation(conversation, tools, template if isinstance(template, str) else "")
        if tools and isinstance(template, str) and "tools" in template:
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        if sum(len(turn["content"]) for turn in conversation) > self.max_prompt_chars:
            raise bad_request(
                f"The messages hold more characters than the {self.max_model_len} tokens of this model's context "
                f"can hold ({self.max_prompt_chars:,} at most); shorten them.",
                "messages",
            )
        large = sum(len(turn["content"]) for turn in conversation) > LARGE_TEXT_CHARS
        text = await (self._on_large_text_thread if large else self._on_tokenizer_thread)(
            self._apply_chat_template, self._large_tokenizer if large else self.tokenizer, conversation,
            add_generation_prompt, chat_template, template_kwargs or {}, continue_final_message,
        )
        # The template already holds any special tokens (BOS) the model expects.
        return await self.encode(text, add_special_tokens=False, param="messages")

    @staticmethod
    def _apply_chat_template(
        tokenizer, conversation: list[dict], add_generation_prompt: bool, chat_template: str | None, template_kwargs: dict,
        continue_final_message: bool = False,
    ) -> str:
        try:
            if continue_final_message:  # (older transformers lack the argument: passed only when used)
                template_kwargs = {**template_kwargs, "continue_final_message": True}
            return tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=chat_template, **template_kwargs,
            )
        except Exception as exc:  # jinja errors raised by the template itself (e.g. bad roles)
            param = "chat_template" if chat_template else "messages"
            raise bad_request(f"The chat template rejected the messages: {exc}", param) from None

    @staticmethod
    def _message_text(message: ChatMessage) -> str:
        if message.content is None or isinstance(message.content, str):
            return message.content or ""
        parts = []
        for part in message.content:
            if part.type != "text":
                raise bad_request(f"Only text content parts are supported, got type {part.type!r}.", "messages")
            if part.text is None:
                raise bad_request("A text content part needs its text: send {\"type\": \"text\", \"text\": \"...\"}.",
                                  "messages")
            parts.append(part.text)
        return "\n".join(parts)

    def check_length(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str) -> None:
        """A prompt that leaves too little room for max_tokens is refused, as vLLM does (a prompt
        that alone fills the context is refused by the engine with its own message). Then
        `max_tokens_cap` lowers max_tokens (if None, to what the context has room for)."""
        num_prompt = len(prompt_ids)
        if not 0 < num_prompt < self.max_model_len:
            return
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            what = "messages" if prompt_param == "messages" else "prompt"
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the {what}, {params.max_tokens} in the "
                f"completion). Reduce the length of the {what} or max_tokens.",
                "max_tokens",
            )
        if self.max_tokens_cap is not None:
            room = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
            params.max_tokens = max(min(room, self.max_tokens_cap), params.min_tokens, 1)

    # --- running requests -------------------------------------------------------------------

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def created() -> int:
        return int(time.time())

    def check_request_size(self, num_prompts: int, params: SamplingParams, prompt_param: str) -> None:
        """A request starting more sequences than `--max-seqs-per-request` is refused before any
        work (its prompts are not even tokenized)."""
        limit = self.engine.engine.config.limits.max_seqs_per_request
        per_prompt = params.best_of or params.n
        # One prompt's samples are bounded by --max-n and --max-beam-width, whose messages say more.
        if num_prompts > 1 and num_prompts * per_prompt > limit:
            raise bad_request(
                f"This request asks for {num_prompts * per_prompt:,} sequences ({num_prompts:,} prompts x {per_prompt} "
                f"each); this server starts at most {limit:,} per request (--max-seqs-per-request). Split it into "
                "several requests.", prompt_param,
            )

    async def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, prompt_param: str
    ) -> list[RequestStream]:
        """Add one engine request per prompt, all in the same engine iteration; if any is
        refused, none stays in the engine. (A cancelled add aborts its own request.)"""
        self.check_request_size(len(prompts), params, prompt_param)
        if params.needs_token_mask or params.logit_bias:
            try:  # a bad schema, regex or grammar is refused before any work starts
                await self.engine.check_constraints(params)
            except ValueError as exc:
                raise invalid_input(exc, prompt_param) from None
        streams = await self.add_prompts(request_id, prompts, params, prompt_param)
        self.in_flight.add(streams, prompts, params)
        return streams

    async def add_prompts(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams | PoolingParams, prompt_param: str
    ) -> list[RequestStream]:
        """One engine request per prompt (`submit`'s, and the pooling routes'); if any is
        refused, none stays in the engine."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            # The prompts of one request take turns with other requests' in the waiting queue.
            *(self.engine.add_request(i, p, params, api_request_id=request_id if len(prompts) > 1 else None)
              for i, p in zip(ids, prompts)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return results  # type: ignore[return-value]
        for result in results:
            if isinstance(result, RequestStream):
                self.engine.abort(result.request_id)
        if isinstance(errors[0], ValueError):
            raise invalid_input(errors[0], prompt_param)
        if isinstance(errors[0], (EngineDeadError, RequestFailedError)):
            raise engine_error(errors[0])
        raise errors[0]

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        """The end of a route's requests, however it ended: those unfinished are aborted."""
        self.in_flight.remove(streams)
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait for every request to finish; on cancellation (disconnect) they are aborted."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                finals[index] = output
        except (EngineDeadError, RequestFailedError) as exc:
            raise engine_error(exc) from None
        finally:
            self.abort_unfinished(streams)
        return finals  # type: ignore[return-value]
