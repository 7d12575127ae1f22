"""A snapshot of the engine's state and counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepTime:
    """Seconds spent, over all steps, in each part of `EngineCore.step`."""

    scheduler: float = 0.0  # scheduling and block management (core)
    model: float = 0.0  # the executor: cache copies, model, sampling
    outputs: float = 0.0  # appending tokens, detokenizing, stop checks, building outputs
    grammar: float = 0.0  # the token bitmasks of constrained sequences (structured outputs)

    @property
    def scheduler_share(self) -> float:
        total = self.scheduler + self.model + self.outputs
        return self.scheduler / total if total else 0.0


@dataclass
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int  # cached-but-unreferenced blocks count as free
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_cache_usage: float  # fraction of device blocks referenced
    num_running: int  # requests
    num_running_seqs: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_recompute_preemptions: int
    num_swap_preemptions: int
    num_blocks_swapped_in: int
    num_blocks_swapped_out: int
    num_copy_on_writes: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    num_prompt_tokens: int  # prompt tokens of every request added
    num_generation_tokens: int  # tokens generated
    num_computed_tokens: int  # tokens run through the model (prefills, recomputation, decodes)
    num_steps: int
    step_time: StepTime = field(default_factory=StepTime)
    # Share of the device's KV slots in each part of the paper's Figure 2, averaged over the
    # steps so far: token_states, reservation, internal_fragmentation, external_fragmentation_free
    # (pagedllm.core.kv_breakdown). The four add up to 1 once a step has run.
    kv_breakdown: dict[str, float] = field(default_factory=dict)
    # Speculative decoding (vLLM's spec_decode counters; all zero without speculative_config):
    # sequence-steps that verified proposed tokens, those tokens, the accepted ones, and the
    # accepted ones by position in the proposal (index 0: first proposed token).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)
