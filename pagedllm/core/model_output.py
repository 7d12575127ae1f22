"""What the driver worker sends back after a step: sampled tokens and log-probabilities, as plain
data keyed by sequence id."""

from __future__ import annotations

from dataclasses import dataclass, field

# token id -> (log-probability, rank in the distribution, 1 = most likely)
TopLogprobs = dict[int, tuple[float, int]]


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float  # under the model's raw distribution (before temperature and penalties)
    top_logprobs: TopLogprobs | None = None  # the top-k and the chosen token, if requested


@dataclass(slots=True)
class SequenceStepOutput:
    # One token normally; best_of tokens when a parallel-sampling prompt completes; for beam
    # search, the 2 * beam_width best candidate continuations of this beam.
    samples: list[SampledToken] = field(default_factory=list)
    # Log-probabilities of the prompt tokens computed in this step (each given its prefix).
    prompt_logprobs: list[TopLogprobs] | None = None
    # Speculative decoding: the leading proposed tokens the target model accepted, in order; they
    # come before samples[0] (the target's own token after them: a correction or the bonus).
    accepted: list[SampledToken] = field(default_factory=list)
    # A pooling request's chunk (`ScheduledSequence.pooling_type`): its pooled final hidden state,
    # a float32 CPU tensor [hidden_size] (opaque here); None where the chunk adds nothing (a CLS
    # pool past the first chunk).
    pooled: object | None = None


@dataclass
class ModelRunnerOutput:
    outputs: dict[int, SequenceStepOutput] = field(default_factory=dict)
