"""Speculative decoding's draft model (`speculative_config` method "draft_model"): a smaller model
sharing the target's vocabulary proposes greedily, on its own paged KV cache under the target's
block tables.

The draft's KV pools have as many blocks as the target's, and every block id means the same
positions of the same sequence in both: the draft runs on the target's own control message, so
the swaps, copies, prefix-cache hits, rollbacks and window frees of the target's block manager
hold for the draft's pools too. The draft catches up lazily: in a step where a sequence
speculates (the target's schedule reserved the slots of its k proposed tokens), the draft computes
that sequence's tokens it has not yet computed (its prompt, the tokens of steps it did not
speculate in, its newest one or two), batched over every speculating sequence, and draws its first
proposed token, then runs k - 1 single-token passes for the rest, writing their keys and values
into the reserved slots. A step where no sequence speculates (the adaptive policy under load)
costs the draft no model pass, only the step's swaps and copies. (With a sliding window the draft
computes every scheduled sequence each step: a lagging one would need keys the window freed.)
Proposals are the draft's argmax, so a proposal is one token (q one-hot) and the sampler's
acceptance rule stays exact (`sampling.sampler.accept_proposal`); what the draft holds only
decides how good its proposals are, never what the target outputs.
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
        windows = self.executor.group_windows
        if windows != tuple(target_windows):
            self.executor.shutdown()
            raise ValueError(
                f"speculative_config.model {spec.model!r} groups its layers by sliding window as {windows}, the target "
                f"as {tuple(target_windows)}: the draft runs under the target's block tables, so its layers must form "
                "the same KV cache groups."
            )
        self.executor.init_cache(num_device_blocks, num_cpu_blocks)
        # A lagging sequence's catch-up would need keys the window has already freed: with a
        # sliding window the draft keeps level with every scheduled sequence in every step.
        self.lazy = all(window is None for window in windows)
        self.max_forward_tokens = config.scheduler.max_num_batched_tokens
        self._computed: dict[int, int] = {}  # tokens of each sequence whose keys and values the draft holds
        self._base: dict[int, int] = {}  # this step: the position after each sequence's own last token
        self._steps = 0
        self.num_forwards = 0  # the draft's model passes (catch-up and proposals)

    def _held(self, item: ScheduledSequence) -> int:
        """Tokens of the sequence whose keys and values the draft holds. Lazily, a sequence it has
        not seen holds none (a prefix-cache hit or a fork's shared blocks may carry keys the draft
        never computed, when their first owner did not speculate), and one that restarted below
        what the draft held was preempted by recompute, its blocks reallocated. Level with every
        sequence (a sliding window), the draft holds what the target does, and a catch-up never
        starts below the target's (whose earlier blocks the window may have freed)."""
        held = self._computed.get(item.seq_id)
        if not self.lazy:
            return item.start_position if held is None else min(held, item.start_position)
        return 0 if held is None or item.start_position < held else held

    def propose(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """Fill in the proposed tokens of the step's speculating sequences (the scheduler reserved
        their slots with placeholders). The draft catches up lazily: it computes a sequence's
        tokens only when the sequence speculates, from what it holds to the sequence's own last
        token, batched, drawing the first proposed token; k - 1 one-token passes draw the rest.
        In a step where no sequence speculates it runs only the step's swaps and copies."""
        for item in scheduled.seqs:
            self._computed[item.seq_id] = self._held(item)
        computes = [item for item in scheduled.seqs if item.draft_token_ids or not self.lazy]
        self._base = {item.seq_id: item.start_position + len(item.token_ids) - len(item.draft_token_ids)
                      for item in computes}
        templates = {
            item.seq_id: dataclasses.replace(
                item, sampling_params=_GREEDY, num_samples=0, draft_token_ids=[], prompt_logprob_targets=None,
                token_bitmask=None, draft_token_bitmasks=None, prompt_token_ids=None, output_token_ids=None,
                pooling_type=None,
            )
            for item in computes
        }
        wanted = {item.seq_id: len(item.draft_token_ids) for item in computes if item.draft_token_ids}
        drafts = self._catch_up(scheduled, seqs, templates, wanted)
        for seq_id in templates:
            self._computed[seq_id] = self._base[seq_id]
        for j in range(1, max(wanted.values(), default=0)):
            step = [
                dataclasses.replace(templates[seq_id], token_ids=[drafts[seq_id][-1]],
                                    start_position=self._base[seq_id] + j - 1, num_samples=1)
                for seq_id, k in wanted.items() if k > j
            ]
            result = self._execute(SchedulerOutput(seqs=step))
            for item in step:
                drafts[item.seq_id].append(result.outputs[item.seq_id].samples[0].token_id)
        for item in computes:
            if item.draft_token_ids:
                proposal = drafts[item.seq_id][: len(item.draft_token_ids)]
                own = len(item.token_ids) - len(item.draft_token_ids)
                item.token_ids = item.token_ids[:own] + proposal
                item.draft_token_ids = proposal

    def _catch_up(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence], templates: dict[int, ScheduledSequence],
                  wanted: dict[int, int]) -> dict[int, list[int]]:
        """Compute each sequence's tokens from what the draft holds to its own last token, in
        passes of at most `max_forward_tokens` tokens, the first pass carrying the step's swaps
        and copies; returns the first proposed token of each sequence in `wanted`."""
        begins = {seq_id: self._computed[seq_id] for seq_id in templates}
        drafts: dict[int, list[int]] = {}
        message = dataclasses.replace(scheduled, seqs=[])
        while True:
            left = self.max_forward_tokens
            for seq_id, template in templates.items():
                begin, end = begins[seq_id], self._base[seq_id]
                if begin >= end:
                    continue
                if left <= 0:
                    break
                stop = min(end, begin + left)
                left -= stop - begin
                begins[seq_id] = stop
                message.seqs.append(dataclasses.replace(
                    template, token_ids=seqs[seq_id].token_ids[begin:stop], start_position=begin,
                    num_samples=1 if stop == end and seq_id in wanted else 0,
                ))
            if not message.seqs and not message.has_cache_work and not message.finished_request_ids:
                return drafts
            result = self._execute(message)
            for item in message.seqs:
                if item.num_samples:
                    drafts[item.seq_id] = [result.outputs[item.seq_id].samples[0].token_id]
            if not message.seqs:
                return drafts
            message = SchedulerOutput()

    def _execute(self, message: SchedulerOutput) -> ModelRunnerOutput:
        self.num_forwards += bool(message.seqs)
        return self.executor.execute(message) or ModelRunnerOutput()

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
