"""After each step: append sampled tokens, fork parallel samples, detokenize, check stop
conditions. Beam search has its own module (`beam_search.py`)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, TopLogprobs
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.model.tokenizer import IncrementalDetokenizer
from pagedllm.outputs import Logprob, PositionLogprobs
from pagedllm.sampling_params import SamplingParams, SamplingType


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: list[int],
        new_seq_id: Callable[[], int],
        register_seq: Callable[[Sequence], None],
        unregister_seq: Callable[[Sequence], None],
        share_blocks: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.new_seq_id = new_seq_id
        self.register_seq = register_seq
        self.unregister_seq = unregister_seq
        # Off only to measure what sharing saves: forks then copy every block.
        self.share_blocks = share_blocks
        self._token_texts: dict[int, str] = {}
        self.num_generated_tokens = 0

    # --- per step ---------------------------------------------------------------------------

    def process(
        self, output: SchedulerOutput, result: ModelRunnerOutput, groups: dict[str, SequenceGroup], seqs: dict[int, Sequence]
    ) -> list[SequenceGroup]:
        """Apply one step's results; returns the groups that changed, in schedule order."""
        touched: dict[str, SequenceGroup] = {}
        beam_steps: dict[str, list[tuple[Sequence, list[SampledToken]]]] = {}
        for item in output.seqs:
            step = result.outputs.get(item.seq_id)
            if step is None:
                continue
            group = groups[item.request_id]
            seq = seqs[item.seq_id]
            touched[group.request_id] = group
            if step.prompt_logprobs is not None:
                self._add_prompt_logprobs(group, step.prompt_logprobs)
            if not step.samples:
                continue
            if group.sampling_params.sampling_type is SamplingType.BEAM:
                beam_steps.setdefault(group.request_id, []).append((seq, step.samples))
            elif len(step.samples) > 1:
                self._fork_samples(group, seq, step.samples)
            else:
                self.append(group, seq, step.samples[0])
        if beam_steps:
            from pagedllm.engine.beam_search import step_beams

            for request_id, candidates in beam_steps.items():
                step_beams(self, groups[request_id], candidates)
        return list(touched.values())

    def _fork_samples(self, group: SequenceGroup, parent: Sequence, samples: list[SampledToken]) -> None:
        """A parallel-sampling prompt completed: sample i goes to a new sequence that shares the
        parent's blocks (copy-on-write happens when each first writes into the shared last block)."""
        children = []
        for index in range(1, len(samples)):
            child = self.fork(parent, sample_index=index)
            group.seqs.append(child)
            children.append(child)
        group.forked = True
        self.append(group, parent, samples[0])
        for child, sample in zip(children, samples[1:]):
            self.append(group, child, sample)

    def fork(self, parent: Sequence, sample_index: int | None = None) -> Sequence:
        child = parent.fork(self.new_seq_id(), sample_index)
        if parent.detokenizer is not None:
            child.detokenizer = parent.detokenizer.fork()
        if not self.block_manager.can_fork(parent, share=self.share_blocks):
            raise RuntimeError(
                "Out of KV blocks while copying a sequence with enable_block_sharing=False; "
                "that measuring mode needs a larger KV cache."
            )
        self.block_manager.fork(parent, child, share=self.share_blocks)
        self.register_seq(child)
        return child

    def drop(self, seq: Sequence) -> None:
        """A beam that has no future: release its blocks now."""
        seq.status = SequenceStatus.FINISHED_ABORTED
        self.block_manager.forget(seq)
        self.unregister_seq(seq)

    # --- appending and stopping -------------------------------------------------------------

    def append_beam_token(self, group: SequenceGroup, seq: Sequence, sample: SampledToken) -> int:
        """Append a token and its text; returns how many characters the text grew by. (Beam
        search decides stopping for the whole group; `append` adds the per-sequence checks.)"""
        params = group.sampling_params
        seq.append_token(sample.token_id, sample.logprob)
        self.num_generated_tokens += 1
        if params.logprobs is not None:
            seq.output_logprobs.append(self.to_logprobs(sample.top_logprobs or {}))
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        new_text = seq.detokenizer.add_token(sample.token_id)
        seq.output_text += new_text
        return len(new_text)

    def append(self, group: SequenceGroup, seq: Sequence, sample: SampledToken) -> None:
        params = group.sampling_params
        num_new_chars = self.append_beam_token(group, seq, sample)
        self.check_stop(seq, params, num_new_chars)
        if seq.is_finished:
            tail = seq.detokenizer.flush()
            if seq.stop_reason is None or isinstance(seq.stop_reason, int):
                seq.output_text += tail

    def max_tokens(self, seq: Sequence, params: SamplingParams) -> int:
        room = self.max_model_len - seq.num_prompt_tokens
        return min(params.max_tokens, room) if params.max_tokens is not None else room

    def check_stop(self, seq: Sequence, params: SamplingParams, num_new_chars: int) -> None:
        if seq.num_output_tokens >= params.min_tokens:
            token = seq.last_token_id
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                return
            if params.stop and self._check_stop_strings(seq, params, num_new_chars):
                return
        if seq.num_output_tokens >= self.max_tokens(seq, params):
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def _check_stop_strings(seq: Sequence, params: SamplingParams, num_new_chars: int) -> bool:
        """Find a stop string that ends in the newly added text; trim the text at it."""
        if num_new_chars == 0:
            return False
        text = seq.output_text
        for stop in params.stop:
            # Only a match that overlaps the new characters can be new.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            at = text.find(stop, start)
            if at == -1:
                continue
            end = at + len(stop) if params.include_stop_str_in_output else at
            seq.output_text = text[:end]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop
            return True
        return False

    # --- log-probabilities ------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def to_logprobs(self, top: TopLogprobs) -> PositionLogprobs:
        return {t: Logprob(lp, rank, self._token_text(t)) for t, (lp, rank) in top.items()}

    def _add_prompt_logprobs(self, group: SequenceGroup, chunk: list[TopLogprobs]) -> None:
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]  # the first prompt token has no prefix to condition on
        group.prompt_logprobs.extend(self.to_logprobs(top) for top in chunk)
