"""Speculative decoding's draft model (`speculative_config` method "draft_model"): a smaller model
sharing the target's vocabulary proposes greedily, on its own paged KV cache under the target's
block tables.

The draft's KV pools have as many blocks as the target's, and every block id means the same
positions of the same sequence in both: the draft runs on the target's own control message, so
the swaps, copies, prefix-cache hits, rollbacks and window frees of the target's block manager
hold for the draft's pools too. Each step, after the target's schedule reserved the slots of k
proposed tokens per speculating sequence, the draft computes what it has not yet computed of every
scheduled sequence (the prompt chunks, and for a decoding sequence its newest one or two tokens)
and draws its first proposed token, then runs k - 1 single-token steps for the rest, writing their
keys and values into the reserved slots. Proposals are the draft's argmax, so a proposal is one
token (q one-hot) and the sampler's acceptance rule stays exact (`sampling.sampler.accept_proposal`).
"""

from __future__ import annotations

import dataclasses

from pagedllm.config import EngineConfig
from pagedllm.core import Sequence
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.executor import create_executor
from pagedllm.sampling_params import SamplingParams
from pagedllm.transformers_utils import load_arch_config, resolve_model

_GREEDY = SamplingParams(temperature=0)


def check_draft_model(path: str, target_vocab_size: int, target_tokenizer) -> None:
    """Refuse a draft model whose vocabulary differs from the target's, saying how."""
    source = resolve_model(path)
    arch = load_arch_config(source)
    if arch.vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_config.model {path!r} has a vocabulary of {arch.vocab_size} tokens, the target model "
            f"{target_vocab_size}: a draft model must share the target's vocabulary (its token ids mean the same "
            "tokens); pick a draft of the same family and tokenizer."
        )
    from pagedllm.transformers_utils import get_tokenizer

    draft_tokenizer = get_tokenizer(source)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_config.model {path!r} has the target's vocabulary size but another tokenizer: a draft "
            "model must share the target's vocabulary (the same token for each id)."
        )


class DraftModel:
    FORGET_EVERY = 64

    def __init__(self, config: EngineConfig, max_model_len: int, target_windows: tuple, num_device_blocks: int,
                 num_cpu_blocks: int) -> None:
        spec = config.speculative
        draft_config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, model=spec.model, tokenizer=None), speculative=None
        )
        self.executor = create_executor(draft_config, max_model_len)
        windows = tuple(group.sliding_window for group in self.executor.kv_cache_groups)
        if windows != tuple(target_windows):
            self.executor.shutdown()
            raise ValueError(
                f"speculative_config.model {spec.model!r} groups its layers by sliding window as {windows}, the target "
                f"as {tuple(target_windows)}: the draft runs under the target's block tables, so its layers must form "
                "the same KV cache groups."
            )
        self.executor.init_cache(num_device_blocks, num_cpu_blocks)
        self._computed: dict[int, int] = {}  # tokens of each sequence whose keys and values the draft holds
        self._base: dict[int, int] = {}  # this step: the position after each sequence's own last token
        self._steps = 0

    def propose(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """Fill in the proposed tokens of the step's speculating sequences (the scheduler reserved
        their slots with placeholders), keeping the draft's KV cache level with the target's."""
        first: list[ScheduledSequence] = []
        self._base = {}
        for item in scheduled.seqs:
            seq = seqs[item.seq_id]
            own_end = item.start_position + len(item.token_ids) - len(item.draft_token_ids)
            begin = min(self._computed.get(item.seq_id, item.start_position), item.start_position)
            self._base[item.seq_id] = own_end
            first.append(
                dataclasses.replace(
                    item, token_ids=seq.token_ids[begin:own_end], start_position=begin, sampling_params=_GREEDY,
                    num_samples=1 if item.draft_token_ids else 0, draft_token_ids=[], prompt_logprob_targets=None,
                    token_bitmask=None, prompt_token_ids=None, output_token_ids=None,
                )
            )
        message = dataclasses.replace(scheduled, seqs=first)
        result = self.executor.execute(message) or ModelRunnerOutput()
        drafts = {item.seq_id: [result.outputs[item.seq_id].samples[0].token_id] for item in first if item.num_samples}
        for item in scheduled.seqs:
            self._computed[item.seq_id] = self._base[item.seq_id]
        wanted = {item.seq_id: len(item.draft_token_ids) for item in scheduled.seqs if item.draft_token_ids}
        by_id = {item.seq_id: item for item in first}
        for j in range(1, max(wanted.values(), default=0)):
            step = [
                dataclasses.replace(
                    by_id[seq_id], token_ids=[drafts[seq_id][-1]], start_position=self._base[seq_id] + j - 1, num_samples=1
                )
                for seq_id, k in wanted.items() if k > j
            ]
            result = self.executor.execute(SchedulerOutput(seqs=step)) or ModelRunnerOutput()
            for item in step:
                drafts[item.seq_id].append(result.outputs[item.seq_id].samples[0].token_id)
        for item in scheduled.seqs:
            if item.draft_token_ids:
                proposal = drafts[item.seq_id][: len(item.draft_token_ids)]
                own = len(item.token_ids) - len(item.draft_token_ids)
                item.token_ids = item.token_ids[:own] + proposal
                item.draft_token_ids = proposal
                seqs[item.seq_id].draft_token_ids = proposal

    def observe(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The draft's keys and values of accepted proposed tokens stay valid (it computed all but
        the last proposed token)."""
        live = set()
        for item in scheduled.seqs:
            live.add(item.seq_id)
            if item.draft_token_ids:
                step = result.outputs.get(item.seq_id)
                accepted = len(step.accepted) if step is not None else 0
                self._computed[item.seq_id] = self._base[item.seq_id] + min(accepted, len(item.draft_token_ids) - 1)
        self._steps += 1
        if self._steps % self.FORGET_EVERY == 0:
            for seq_id in [s for s in self._computed if s not in live]:
                del self._computed[seq_id]

    def shutdown(self) -> None:
        self.executor.shutdown()
