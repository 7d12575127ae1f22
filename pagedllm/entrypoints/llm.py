"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`, and
`LLM(...).embed(prompts)` for embeddings."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from pagedllm.config import DEFAULT_MODEL, EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.generation_config import default_sampling
from pagedllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams, pooling_asked
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

PromptInput = str | list[int] | dict


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated tokens
    text: str  # the generated text
    cum_logprob: float
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class LLM:
    """An engine with a model loaded, for batch generation in this process.

    Keyword arguments are engine arguments (`block_size`, `max_num_seqs`, `kv_cache_memory`,
    `dtype`, `seed`, `enable_prefix_caching`, ...; see `EngineArgs`), vLLM's names included.
    `generation_config` ("auto": the model folder's generation_config.json; "vllm": none; or a
    folder) gives the default sampling of `generate` without `SamplingParams`.
    vLLM's `task="embed"`, `runner="pooling"` and `convert="embed"` are accepted: every engine
    serves both `generate` and `embed` (`pooler_config` sets the pooling defaults).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        for flag in ("task", "runner", "convert"):
            pooling_asked(flag, engine_args.pop(flag, None))  # a ValueError for a task not built
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.default_sampling = default_sampling(args.generation_config, args.model)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling `generate` uses when given none: the generation config's, as vLLM does."""
        return SamplingParams(**self.default_sampling)

    # --- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in input order."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt."
                )
        return self._add_and_run(prompts, params_list, use_tqdm)

    def _add_and_run(self, prompts: list[PromptInput], params_list: list, use_tqdm: bool) -> list:
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._ids))
                if isinstance(params, SamplingParams):
                    self.llm_engine.check_constraints(params)  # an invalid grammar raises before any work
                self.llm_engine.add_request(request_id, self._prompt_of(prompt), params)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)  # leave the engine as it was
            raise
        return self._run(request_ids, use_tqdm)

    # --- pooling ----------------------------------------------------------------------------

    def encode(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's final hidden states into one vector (`PoolingParams`; by default
        the engine's `pooler_config`: the last token, normalized); outputs in input order, each
        with `.outputs.data` (a float32 tensor). The prompts are scheduled beside any other work
        and generate nothing; their KV blocks are freed as each prompt completes."""
        prompts = self._as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} PoolingParams for {len(prompts)} prompts; give one, or one per prompt."
                )
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        return self._add_and_run(prompts, params_list, use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`): `.outputs.embedding`, a list of floats
        (see `encode`)."""
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        failed = next((output for output in outputs if output.outputs is None), None)
        if failed is not None:
            raise RuntimeError(f"Request {failed.request_id} failed: {failed.error}")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to
        several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.llm_engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; use generate() with a plain prompt.")
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
        # The template already holds any special tokens (BOS) the model expects.
        return tokenizer.encode(text, add_special_tokens=False)

    def beam_search(
        self, prompts: PromptInput | SequenceABC[PromptInput], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search inside the engine; beams share KV blocks. Sequences best first."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        results = []
        for out in outputs:
            sequences = [
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + c.token_ids,
                    text=c.text,
                    cum_logprob=c.cumulative_logprob,
                    finish_reason=c.finish_reason,
                )
                for c in out.outputs
            ]
            results.append(BeamSearchOutput(sequences))
        return results

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _as_list(prompts) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt given as token ids
        return prompts

    @staticmethod
    def _prompt_of(prompt: PromptInput) -> str | list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"]
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return prompt
        raise ValueError(f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}.")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        num_prompt = num_output = 0
        try:
            while len(finished) < len(wanted):
                if not self.llm_engine.has_unfinished_requests():
                    raise RuntimeError("The engine stopped with requests unfinished.")
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        num_prompt += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            num_output += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(
                                f"input: {num_prompt / elapsed:.1f} tok/s, output: {num_output / elapsed:.1f} tok/s"
                            )
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]
