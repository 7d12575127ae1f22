"""After each step: append sampled tokens, fork parallel samples, carry out beam search's
decisions, detokenize, and check stop conditions; add pooling requests' chunks to their pools
and end each such request once its prompt is computed.

It runs inside `Scheduler.update_from_output` and changes only sequences: the forks and drops
it decides go back as a `StepUpdate` for the scheduler to apply to the block tables."""

from __future__ import annotations

import logging

from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, TopLogprobs
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import BeamState, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.step_update import StepUpdate
from pagedllm.engine.beam_search import BeamStep, add_hypothesis, decide_beam_step
from pagedllm.engine.pooling import PoolState, finish_pool
from pagedllm.engine.requests import RequestRegistry
from pagedllm.outputs import Logprob, PositionLogprobs
from pagedllm.pooling_params import PoolingType
from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.transformers_utils.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("pagedllm")


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        requests: RequestRegistry,
        max_model_len: int,
        eos_token_ids: list[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self._update = StepUpdate()  # the step being processed
        self._token_texts: dict[int, str] = {}
        self.num_generated_tokens = 0

    # --- per step ---------------------------------------------------------------------------

    def process(self, output: SchedulerOutput, result: ModelRunnerOutput, update: StepUpdate) -> None:
        """Apply one step's results to the sequences; `update` receives the forks and drops for
        the scheduler as they are decided, then the groups that changed, in schedule order."""
        self._update = update
        touched: dict[str, SequenceGroup] = {}
        beam_proposals: dict[str, list[tuple[Sequence, list[SampledToken]]]] = {}
        for item in output.seqs:
            step = result.outputs.get(item.seq_id)
            if step is None:
                continue
            group = self.requests.groups[item.request_id]
            seq = self.requests.seqs[item.seq_id]
            touched[group.request_id] = group
            if step.prompt_logprobs is not None:
                self._add_prompt_logprobs(group, step.prompt_logprobs)
            if item.pooling_type is not None:
                self._pool(group, seq, item.pooling_type, step.pooled, item.start_position == 0)
                continue
            if not step.samples:
                continue
            if group.sampling_params.sampling_type is SamplingType.BEAM:
                beam_proposals.setdefault(group.request_id, []).append((seq, step.samples))
            elif len(step.samples) > 1:
                self._fork_samples(group, seq, step.samples)
            else:
                # Speculative decoding: the accepted proposed tokens come first; a stop among
                # them drops the rest.
                for sample in (*step.accepted, step.samples[0]):
                    self._append(group, seq, sample)
                    if seq.is_finished:
                        break
        for request_id, proposals in beam_proposals.items():
            group = self.requests.groups[request_id]
            if group.beam_state is None:
                group.beam_state = BeamState()
            max_new_tokens = self.max_tokens(proposals[0][0], group.sampling_params)
            self._apply_beam_step(group, decide_beam_step(group, proposals, max_new_tokens))
        for _, child in update.forks:  # (on success only: a failed step's forks hold no blocks)
            self.requests.add_seq(child)
        update.touched = list(touched.values())

    @staticmethod
    def _pool(group: SequenceGroup, seq: Sequence, pooling_type: PoolingType, chunk_vector: object | None,
              starts_prompt: bool) -> None:
        """A pooling request's chunk joins its pool; the step that completes the prompt (its
        computed tokens are counted before this runs) ends the request with its vector, and
        the scheduler frees its blocks in the same update."""
        if group.pooled is None:
            group.pooled = PoolState()
        group.pooled.add(pooling_type, chunk_vector, starts_prompt)
        if seq.num_computed_tokens >= seq.num_tokens:
            finish_pool(group.pooled, group.pooling_params, seq.num_prompt_tokens)
            seq.status = SequenceStatus.FINISHED_STOPPED

    def _fork_samples(self, group: SequenceGroup, parent: Sequence, samples: list[SampledToken]) -> None:
        """A parallel-sampling prompt completed: sample i goes to a new sequence that shares the
        parent's blocks (copy-on-write happens when each first writes into the shared last block)."""
        children = [self._fork(parent, sample_index=index) for index in range(1, len(samples))]
        group.seqs.extend(children)
        group.forked = True
        for seq, sample in zip([parent, *children], samples):
            self._append(group, seq, sample)

    def _apply_beam_step(self, group: SequenceGroup, step: BeamStep) -> None:
        params = group.sampling_params
        for finished in step.finished:
            hypothesis = finished.parent.fork(self.requests.new_seq_id())  # a record only: no blocks
            self._append_token(group, hypothesis, finished.sample)
            hypothesis.status = SequenceStatus.FINISHED_STOPPED if finished.stopped else SequenceStatus.FINISHED_LENGTH
            if finished.stopped and finished.sample.token_id in params.stop_token_ids:
                hypothesis.stop_reason = finished.sample.token_id
            hypothesis.output_text += hypothesis.detokenizer.flush()
            add_hypothesis(group.beam_state, finished.score, hypothesis, params.best_of)
        group.beam_state.improvable = step.improvable
        for seq in step.dropped:
            self._free_seq(seq)
        if step.done:
            group.seqs = [seq for _, seq in group.beam_state.finished] or group.seqs
            return
        live: list[Sequence] = []
        for parent, samples in step.continued:
            forks = [self._fork(parent) for _ in samples[1:]]  # before the parent moves on
            for seq, sample in zip([parent, *forks], samples):
                self._append_token(group, seq, sample)
                live.append(seq)
        group.seqs = live

    def _fork(self, parent: Sequence, sample_index: int | None = None) -> Sequence:
        """A copy of `parent` as it is now; the scheduler gives it the parent's blocks."""
        child = parent.fork(self.requests.new_seq_id(), sample_index)
        self._update.forks.append((parent, child))
        return child

    def _free_seq(self, seq: Sequence) -> None:
        """A beam with no future: the scheduler frees its blocks."""
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._update.dropped.append(seq)
        self.requests.remove_seq(seq)

    # --- appending and stopping -------------------------------------------------------------

    def _append_token(self, group: SequenceGroup, seq: Sequence, sample: SampledToken) -> int:
        """Append a token and its text; returns how many characters the text grew by. (Beam
        search decides stopping for the whole group; `_append` adds the per-sequence checks.)"""
        params = group.sampling_params
        seq.append_token(sample.token_id, sample.logprob)
        self.num_generated_tokens += 1
        if seq.constraint is not None and not seq.constraint.accept_token(sample.token_id) and not seq.is_finished:
            # Only a row whose every token was masked can draw a forbidden one: the grammar allows
            # nothing more, so the output ends here (once, not a token and a warning per step).
            logger.warning("Request %s: its constraint allows no token after %d; the output ends there",
                           group.request_id, seq.num_output_tokens - 1)
            if not params.use_beam_search:
                seq.status = SequenceStatus.FINISHED_STOPPED
        if params.logprobs is not None:
            seq.output_logprobs.append(self.to_logprobs(sample.top_logprobs or {}))
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        new_text = seq.detokenizer.add_token(sample.token_id)
        seq.output_text += new_text
        return len(new_text)

    def _append(self, group: SequenceGroup, seq: Sequence, sample: SampledToken) -> None:
        params = group.sampling_params
        num_new_chars = self._append_token(group, seq, sample)
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
