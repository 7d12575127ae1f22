"""The engine's step loop over the core, for any memory policy, without a model."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core import Sequence, SequenceGroup, create_scheduler
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry
from pagedllm.sampling_params import SamplingParams, SamplingType
from tests.engine.fakes import EOS, FakeTokenizer


class PolicyHarness:
    """The engine's step loop over the core for any `kv_policy`: every sampled token is 1,
    beam candidates get distinct log-probabilities; lengths are forced with ignore_eos."""

    def __init__(self, policy: str, block_size: int = 4, num_blocks: int = 32, max_model_len: int = 64, max_num_seqs: int = 16, budget: int = 64):
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, watermark=0.0, kv_policy=policy)
        self.scheduler = create_scheduler(config, block_size, num_blocks, 0, max_model_len, enable_prefix_caching=False)
        self.bm = self.scheduler.block_manager
        self.requests = RequestRegistry()
        self.processor = OutputProcessor(FakeTokenizer(), self.bm, self.requests, max_model_len, [EOS])
        self.clock = 0.0
        self.finished: dict[str, int] = {}  # request id -> step it finished in
        self.num_steps = 0

    def add(self, request_id: str, prompt_len: int, max_tokens: int, n: int = 1, beam: bool = False) -> SequenceGroup:
        if beam:
            params = SamplingParams(n=n, best_of=n, use_beam_search=True, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        elif n > 1:
            params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        params.all_stop_token_ids = set()
        self.clock += 1
        seq = Sequence(self.requests.new_seq_id(), list(range(1, prompt_len + 1)))
        group = SequenceGroup(request_id, [seq], params, arrival_time=self.clock)
        self.requests.add_group(group)
        self.scheduler.add(group)
        return group

    def step(self):
        out = self.scheduler.schedule()
        self.scheduler.on_step_computed(out, self.requests.seqs)
        outputs = {}
        for item in out.seqs:
            if not item.num_samples:
                continue
            if item.sampling_params.sampling_type is SamplingType.BEAM:
                samples = [SampledToken(k + 1, -0.1 * (k + 1) - 0.01 * item.seq_id) for k in range(2 * item.sampling_params.best_of)]
            else:
                samples = [SampledToken(1, -1.0)] * item.num_samples
            outputs[item.seq_id] = SequenceStepOutput(samples=samples)
        touched = self.processor.process(out, ModelRunnerOutput(outputs))
        self.scheduler.free_finished()
        self.num_steps += 1
        for group in touched:
            if group.is_finished:
                self.finished[group.request_id] = self.num_steps
                self.requests.remove_group(group)
        self.bm.check_invariants()
        return out

    def run(self, max_steps: int = 2000) -> None:
        while self.scheduler.has_unfinished():
            self.step()
            assert self.num_steps < max_steps
