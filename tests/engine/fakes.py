"""Model-free stand-ins for the engine's collaborators: a tokenizer with one fixed string per
token id, and an executor that plays the model for the engine's own `EngineCore`."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pagedllm.config import SchedulerConfig
from pagedllm.core import BlockManager, ScheduledSequence, Scheduler, SchedulerOutput, SequenceGroup
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.core.sequence import Sequence
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.sampling_params import SamplingParams

EOS = 0
# Each token id decodes to a fixed string, so expected texts follow from the token ids alone.
TOKEN_TEXTS = {EOS: "</s>", 1: "a", 2: "b", 3: "c", 4: " ", 5: "x", 6: "ST", 7: "OP", 8: "Q!"}
SPECIAL_TOKEN_IDS = frozenset({EOS})


def token_text(token_id: int) -> str:
    return TOKEN_TEXTS.get(token_id, f"<{token_id}>")


class FakeTokenizer:
    """Decodes each id to its `token_text`; special tokens vanish with skip_special_tokens."""

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join("" if skip_special_tokens and t in SPECIAL_TOKEN_IDS else token_text(t) for t in ids)


Sampler = Callable[[ScheduledSequence], list[SampledToken]]
Respond = Callable[[SchedulerOutput], ModelRunnerOutput]


class FakeExecutor:
    """The model of a harness: `respond(output)` gives each step's result."""

    def __init__(self, respond: Respond | None = None) -> None:
        self.respond = respond

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.respond(output)


def samples_of(sample: Sampler) -> Respond:
    """A step's result from `sample(item)`, called for every scheduled sequence that samples."""
    return lambda out: ModelRunnerOutput(
        {item.seq_id: SequenceStepOutput(samples=sample(item)) for item in out.seqs if item.num_samples}
    )


class FakeEngine:
    """The engine's own `EngineCore` (scheduler, block manager, output processor) over a fake
    model: each step's sampled tokens come from `sample(item)`, called for every scheduled
    sequence that samples, returning that sequence's SampledTokens (num_samples of them; for
    beam search, the beam's candidate continuations)."""

    def __init__(
        self,
        block_size: int = 4,
        num_blocks: int = 32,
        max_model_len: int = 64,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        eos_token_ids: tuple[int, ...] = (EOS,),
    ) -> None:
        self.bm = BlockManager(block_size, num_blocks, 0, enable_prefix_caching=False, watermark=0.0)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, watermark=0.0)
        self.scheduler = Scheduler(config, self.bm)
        self.requests = RequestRegistry()
        self.processor = OutputProcessor(FakeTokenizer(), self.requests, max_model_len, list(eos_token_ids))
        self.executor = FakeExecutor()
        self.core = EngineCore(self.scheduler, self.executor, self.processor.process, self.requests)
        self.eos_token_ids = eos_token_ids
        self._clock = itertools.count()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> SequenceGroup:
        group = make_sequence_group(request_id, prompt, params, self.requests, float(next(self._clock)), self.eos_token_ids)
        self.core.add(group)
        return group

    def run_step(self, respond: Respond) -> SchedulerOutput:
        """One step of the core; `respond(output)` plays the model (and may inspect the step)."""
        self.executor.respond = respond
        return self.core.step().scheduled or SchedulerOutput()

    def step(self, sample: Sampler) -> SchedulerOutput:
        return self.run_step(samples_of(sample))


def tokens(*token_ids: int, logprob: float = -1.0) -> list[SampledToken]:
    return [SampledToken(t, logprob) for t in token_ids]


def feed(engine: FakeEngine, seq: Sequence, token_ids: list[int]) -> None:
    """Step until each of `token_ids` has been sampled by `seq`, or it finished."""
    pending = list(token_ids)
    for _ in range(10 * len(token_ids) + 10):
        if not pending or seq.is_finished:
            return
        engine.step(lambda item: tokens(pending.pop(0)) if item.seq_id == seq.seq_id else tokens(1))
    raise AssertionError("the sequence was not scheduled to sample all its tokens")
