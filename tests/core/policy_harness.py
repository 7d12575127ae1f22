"""The engine's own `EngineCore` for any memory policy, over a model-free executor."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core import SchedulerOutput, SequenceGroup, create_scheduler
from pagedllm.core.model_output import SampledToken
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.sampling_params import SamplingParams, SamplingType
from tests.engine.fakes import EOS, FakeExecutor, FakeTokenizer, samples_of


def _sample(item) -> list[SampledToken]:
    """Every sampled token is 1; beam candidates get distinct log-probabilities."""
    if item.sampling_params.sampling_type is SamplingType.BEAM:
        return [SampledToken(k + 1, -0.1 * (k + 1) - 0.01 * item.seq_id) for k in range(2 * item.sampling_params.best_of)]
    return [SampledToken(1, -1.0)] * item.num_samples


class PolicyHarness:
    """The engine core for any `kv_policy`, lengths forced with ignore_eos; checks the KV cache
    manager's invariants after every step."""

    def __init__(self, policy: str, block_size: int = 4, num_blocks: int = 32, max_model_len: int = 64, max_num_seqs: int = 16, budget: int = 64):
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, watermark=0.0, kv_policy=policy)
        self.scheduler = create_scheduler(config, block_size, num_blocks, 0, max_model_len, enable_prefix_caching=False)
        self.bm = self.scheduler.block_manager
        self.requests = RequestRegistry()
        processor = OutputProcessor(FakeTokenizer(), self.requests, max_model_len, [EOS])
        self.core = EngineCore(self.scheduler, FakeExecutor(samples_of(_sample)), processor.process, self.requests,
                               check_invariants=True)
        self.clock = 0.0
        self.finished: dict[str, int] = {}  # request id -> step it finished in
        self.failed: list[SequenceGroup] = []  # groups the scheduler gave up on, in order
        self.num_steps = 0

    def add(self, request_id: str, prompt_len: int, max_tokens: int, n: int = 1, beam: bool = False) -> SequenceGroup:
        if beam:
            params = SamplingParams(n=n, best_of=n, use_beam_search=True, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        elif n > 1:
            params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.clock += 1
        group = make_sequence_group(request_id, list(range(1, prompt_len + 1)), params, self.requests, self.clock)
        self.core.add(group)
        return group

    def step(self) -> SchedulerOutput:
        step = self.core.step()
        self.num_steps += 1
        self.failed += step.failed
        for group in step.touched:
            if group.is_finished:
                self.finished[group.request_id] = self.num_steps
        return step.scheduled or SchedulerOutput()

    def run(self, max_steps: int = 2000) -> None:
        while self.scheduler.has_unfinished():
            self.step()
            assert self.num_steps < max_steps
