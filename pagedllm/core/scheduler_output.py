"""The control message: what every worker needs to run one step, as plain data.

This is the paper's per-step message from the centralised scheduler to the workers: the input
tokens and block table of each scheduled sequence, plus the block copies and swaps to perform
before the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.pooling_params import PoolingType
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions start_position, start_position + 1, ...
    start_position: int  # tokens of this sequence already in the KV cache
    # Physical block ids covering every position up to the last new token, in KV cache group 0
    # (`kv_spec.kv_cache_groups`). In a sliding-window group the entries of blocks that left the
    # window are None (back in the pool); kernels read only the entries inside each query's window.
    block_table: list[int | None]
    sampling_params: SamplingParams
    # How many tokens to draw from this step's last position: 0 for a prompt chunk that does not
    # reach the end and for every chunk of a pooling request, best_of when a parallel-sampling
    # prompt completes, else 1.
    num_samples: int = 1
    sample_index: int = 0  # which of the request's seeded streams this sequence uses
    num_output_tokens: int = 0  # for min_tokens
    # Only for requests with penalties (references, not copies, within one process).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Compute log-probabilities of these (prompt) tokens: set for prompt chunks of requests with
    # prompt_logprobs; the targets are the tokens following each position.
    prompt_logprob_targets: list[int] | None = None
    # The tokens the sampler may draw next, for a sampling sequence whose request has token
    # constraints (a grammar, allowed_token_ids, bad_words): a packed bitmask, an int32 array of
    # ceil(vocab / 32) words where bit (t % 32) of word t // 32 is set when token t is allowed.
    # Filled in by the engine after scheduling; opaque here (a torch tensor).
    token_bitmask: object | None = None
    # The block tables of KV cache groups 1, 2, ... (a model whose layers form several groups,
    # such as full and sliding-window layers), as `block_table`; empty for a one-group model.
    other_block_tables: list[list[int | None]] = field(default_factory=list)
    # Speculative decoding: the proposed tokens at the end of `token_ids` (after the sequence's
    # last real token), which the driver verifies; empty for every other sequence.
    draft_token_ids: list[int] = field(default_factory=list)
    # For a speculating sequence with token constraints: the bitmask (as `token_bitmask`) of each
    # verified position after the first, the constraint advanced past the proposed tokens before it.
    draft_token_bitmasks: list[object] | None = None
    # A pooling request's prompt chunk: the driver pools the chunk's final hidden states this way
    # (the sum of its rows for MEAN, its last row for LAST, its first for CLS when the chunk
    # starts the prompt) and returns that vector (`SequenceStepOutput.pooled`); None otherwise.
    pooling_type: PoolingType | None = None

    @property
    def block_tables(self) -> list[list[int | None]]:
        """Every group's block table, group 0 first."""
        return [self.block_table, *self.other_block_tables]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), device
    finished_request_ids: list[str] = field(default_factory=list)  # workers drop their per-request state

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def has_model_work(self) -> bool:
        return bool(self.seqs)

    @property
    def has_cache_work(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)
