"""One step of the model: the control message becomes flat input tensors and attention
metadata, the model runs over every scheduled token at once, and the driver samples (and pools
the final hidden states of pooling requests' prompt chunks)."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.pooling_params import PoolingType
from pagedllm.sampling import Sampler, prompt_logprobs
from pagedllm.utils import cdiv
from pagedllm.worker.block_tables import block_table_array
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.decode_inputs import DecodeInputs, decode_metadata

# The float32 logits computed at once for prompt log-probabilities (as many rows as fit).
PROMPT_LOGPROBS_BYTES = 64 << 20


def build_attention_metadata(
    items: list[ScheduledSequence], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat input ids and positions, and the metadata of a batch (decodes must come first),
    with one block table and slot mapping per KV cache group."""
    if all(len(item.token_ids) == 1 for item in items):
        return decode_metadata(items, block_size, device)
    return _batch_metadata(items, block_size, device)


def _batch_metadata(
    items: list[ScheduledSequence], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`build_attention_metadata` of any batch: each sequence's tokens expanded to positions."""
    num_seqs = len(items)
    query_lens = np.fromiter((len(item.token_ids) for item in items), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((item.start_position for item in items), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_index = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(num_tokens)
    block_tables = block_table_array([item.block_table for item in items])
    slot_mapping = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    input_ids = np.fromiter(
        (t for item in items for t in item.token_ids), dtype=np.int64, count=num_tokens
    )
    seq_lens = starts + query_lens
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        query_lens=query_lens.tolist(),
        seq_lens_list=seq_lens.tolist(),
        block_size=block_size,
        num_decodes=int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else num_seqs,
    )
    for group in range(len(items[0].other_block_tables)):
        tables = block_table_array([item.other_block_tables[group] for item in items])
        slots = tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
        metadata.other_groups.append(
            dataclasses.replace(
                metadata, slot_mapping=torch.from_numpy(slots).to(device),
                block_tables=torch.from_numpy(tables).to(device), backend_plan=None, other_groups=[],
            )
        )
    return torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), metadata


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device, sampler: Sampler | None,
                 graphs: DecodeGraphs | None = None, num_kv_cache_groups: int = 1) -> None:
        self.model = model
        self.num_kv_cache_groups = num_kv_cache_groups
        self.block_size = block_size
        self.device = device
        self.sampler = sampler  # only the driver samples
        self.graphs = graphs  # decode and verify steps replay CUDA graphs where they apply
        self.vocab_size = model.cfg.vocab_size
        # A CPU step of decodes only advances the last one's inputs where it can.
        self.decode_inputs = DecodeInputs(block_size) if device.type == "cpu" else None
        # Entered by every step: one context kept (the decorator builds two objects a call).
        self._inference_mode = torch.inference_mode()
        # Whether the LM head draws tokens with its product for this model's hidden states
        # (`samples_in_head`), asked once, at the first step that samples (None before): the
        # answer is fixed once the model is loaded, and asking it costs a decode step some 40 us
        # (tensor attributes, properties and modules fetched again after the weights' stream).
        self._samples_in_head: bool | None = None
        # The module whose `fused_layers` (the layer loop as one C++ call, or None) its forward
        # calls: read each step (tests and benchmarks switch it off), without nn.Module's lookup.
        self._layers_owner = getattr(model, "model", None)

    @torch.inference_mode()
    def time_prefill(self, num_tokens: int, repeats: int = 1) -> list[float]:
        """Seconds for each of `repeats` prefills of `num_tokens` tokens (after a warm-up run),
        written into the first blocks of the cache (those of each KV cache group in turn): only
        for start-up profiling, before any request exists."""
        num_blocks = cdiv(num_tokens, self.block_size)
        tables = [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(self.num_kv_cache_groups)]
        item = ScheduledSequence(
            seq_id=-1, request_id="", token_ids=[0] * num_tokens, start_position=0,
            block_table=tables[0], sampling_params=None, other_block_tables=tables[1:],
        )
        input_ids, positions, metadata = build_attention_metadata([item], self.block_size, self.device)
        times = []
        for run in range(repeats + 1):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.model(input_ids, positions, metadata)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if run:  # the first is the warm-up
                times.append(time.perf_counter() - start)
        return times

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """A step of decodes builds its inputs (advanced in place, `DecodeInputs`) and its head
        draws first; a steady one runs without torch (`_steady_decode`), any other step under
        torch's inference mode (`_execute`)."""
        if self.sampler is not None:
            self.sampler.remove_requests(output.finished_request_ids)
        decode = None
        items = output.seqs
        if self.decode_inputs is not None and items and all(len(item.token_ids) == 1 for item in items):
            decode = self.decode_inputs.build(items), self._head_draws(items)
            result = self._steady_decode(items, *decode)
            if result is not None:
                return result
        with self._inference_mode:
            return self._execute(output, decode)

    def _steady_decode(self, items: list[ScheduledSequence], inputs: tuple,
                       head: tuple | None) -> ModelRunnerOutput | None:
        """A step of decodes whose inputs are the last step's advanced in place, where the model's
        fused layers and its head serve it (`FusedDecoderLayers.steady`, `_head_draws`): the
        layers' kept call, then the head's (kept too for greedy rows), outside torch's inference
        mode: for greedy rows no tensor is made or read, the thread count is the one call into
        torch (after the last step streamed the weights through the caches, entering and leaving
        the mode alone costs some 25 us). None where it does not apply (then `_execute`)."""
        if head is None:
            return None
        fused = getattr(self._layers_owner, "fused_layers", None)
        input_ids, positions, metadata = inputs
        if fused is None or not fused.steady(positions, input_ids, metadata):
            return None
        return self._head_output(items, fused.run_steady(), head[0])

    def _head_output(self, items: list[ScheduledSequence], hidden: torch.Tensor, draws) -> ModelRunnerOutput:
        """Each row's token from the head's product (`_head_draws`' step), right after the layers."""
        samples = self.sampler.token_samples(*self.model.head_samples(hidden, draws))
        result = ModelRunnerOutput()
        for item, seq_samples in zip(items, samples):
            result.outputs[item.seq_id] = SequenceStepOutput(samples=seq_samples)
        return result

    def _execute(self, output: SchedulerOutput, decode: tuple | None) -> ModelRunnerOutput | None:
        """`decode`: a step of decodes' inputs and head draws (`execute`), else None."""
        if not output.seqs:
            return ModelRunnerOutput() if self.sampler is not None else None
        # Decodes (one query token) first: backends take a fast path over that leading run.
        items = sorted(output.seqs, key=lambda item: len(item.token_ids) != 1)
        if self.graphs is not None and self.graphs.applies(items):
            hidden, query_lens = self.graphs.run(items)  # each sequence's q rows, its tokens last
        else:
            head = None
            if decode is not None:
                (input_ids, positions, metadata), head = decode
            else:
                input_ids, positions, metadata = build_attention_metadata(items, self.block_size, self.device)
            hidden = self.model(input_ids, positions, metadata)
            if head is not None:  # each row's token from the head's product, right after the layers
                return self._head_output(items, hidden, head[0])
            query_lens = metadata.query_lens

        # Rows that need logits: each sampling sequence's last token (a speculating sequence's
        # last 1 + k positions), then prompt positions whose log-probabilities were asked for.
        starts = [0, *itertools.accumulate(query_lens)]  # host-side: no device sync
        rows: list[int] = []
        sampling = [(i, item) for i, item in enumerate(items) if item.num_samples > 0]
        for i, item in sampling:
            rows.extend(range(starts[i + 1] - 1 - len(item.draft_token_ids), starts[i + 1]))
        prompt_items = [(i, item) for i, item in enumerate(items) if item.prompt_logprob_targets]
        pooling_items = [(i, item) for i, item in enumerate(items) if item.pooling_type is not None]
        if not rows and not prompt_items and not pooling_items:
            return ModelRunnerOutput() if self.sampler is not None else None
        result = ModelRunnerOutput()
        if pooling_items and self.sampler is not None:
            # Only the driver pools: after the final norm every rank holds the full hidden states.
            self._pool(hidden, starts, pooling_items, result)
        if rows:
            # (rows are distinct and ascending: as many as hidden's are all of them, in order)
            picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
            samples = self._sample(picked, [item for _, item in sampling])
            if samples is not None:
                for (_, item), seq_samples in zip(sampling, samples):
                    if item.draft_token_ids:  # the accepted proposed tokens, then the target's own
                        result.outputs[item.seq_id] = SequenceStepOutput(samples=seq_samples[-1:], accepted=seq_samples[:-1])
                    else:
                        result.outputs[item.seq_id] = SequenceStepOutput(samples=seq_samples)
        for i, item in prompt_items:
            position_logprobs = self._prompt_logprobs(hidden, starts[i], item)
            if position_logprobs is not None:
                result.outputs.setdefault(item.seq_id, SequenceStepOutput()).prompt_logprobs = position_logprobs
        return result if self.sampler is not None else None

    def _sample(self, picked: torch.Tensor, items: list[ScheduledSequence]) -> list[list[SampledToken]] | None:
        """Each item's tokens from its rows of `picked` (hidden states); None on a rank that does
        not sample. A batch of plain greedy and top-k rows takes its tokens from the head's
        product where the head draws them with it (`Sampler.in_head`: the logits are not read
        back); else the logits, then the sampler, which runs where the logits are (on a GPU only
        the chosen tokens come back)."""
        sampler = self.sampler
        if self._samples_in_head is None:
            self._samples_in_head = self.model.samples_in_head(picked)
        if (sampler is not None and len(items) == picked.shape[0] and self._samples_in_head
                and sampler.in_head(items, self.model.cfg.vocab_size)):
            return sampler.token_samples(*self.model.head_samples(picked, sampler.draws(items)))
        logits = self.model.compute_logits(picked)
        if logits is None or self.sampler is None:
            return None
        return self.sampler(logits.float(), items)

    def _head_draws(self, items: list[ScheduledSequence]) -> tuple | None:
        """(the head's draws,) for a step of decodes whose rows each sample one token that the
        head draws with its product (`_sample`'s way), else None. Decided before the forward, so
        that the head's product follows the layers with no Python between but its call: the
        layers have just streamed their weights through the caches, and each line run then costs
        what fetching its code and objects again costs."""
        if not self._samples_in_head or self.sampler is None or any(
                item.prompt_logprob_targets or item.pooling_type is not None for item in items):
            return None  # (one sample, no proposals: `in_head`'s own conditions)
        if not self.sampler.in_head(items, self.vocab_size):
            return None
        return (self.sampler.draws(items),)

    @staticmethod
    def _pool(hidden: torch.Tensor, starts: list[int], items: list[tuple[int, ScheduledSequence]],
              result: ModelRunnerOutput) -> None:
        """Each pooling chunk's vector (`ScheduledSequence.pooling_type`), in float32, brought to
        the host in one copy. A sequence's tokens are the last rows of its span (its span is
        longer on a CUDA graph's padded rows)."""
        vectors, owners = [], []
        for i, item in items:
            end = starts[i + 1]
            first = end - len(item.token_ids)
            if item.pooling_type is PoolingType.MEAN:
                vectors.append(hidden[first:end].float().sum(dim=0))  # hidden: [num_tokens, hidden_size]
            elif item.pooling_type is PoolingType.LAST:
                vectors.append(hidden[end - 1].float())
            elif item.start_position == 0:  # CLS: the prompt's first position
                vectors.append(hidden[first].float())
            else:
                result.outputs[item.seq_id] = SequenceStepOutput()  # nothing to add, but the chunk is done
                continue
            owners.append(item.seq_id)
        if vectors:
            pooled = torch.stack(vectors).cpu()  # [num_pooled, hidden_size]
            for seq_id, vector in zip(owners, pooled):
                result.outputs[seq_id] = SequenceStepOutput(pooled=vector)

    def _prompt_logprobs(self, hidden: torch.Tensor, first_row: int, item: ScheduledSequence):
        """The log-probabilities of a prompt chunk's next tokens, their logits computed a piece
        of PROMPT_LOGPROBS_BYTES at a time: a 2,048-token chunk of a 262k vocabulary is 2 GiB of
        float32 logits at once, and its log-softmax as much again. (Every tensor-parallel rank
        computes the same pieces: the head's collectives run in step.)"""
        targets = item.prompt_logprob_targets
        rows_per_piece = max(1, PROMPT_LOGPROBS_BYTES // (4 * self.vocab_size))
        out = []
        for begin in range(0, len(targets), rows_per_piece):
            piece = targets[begin : begin + rows_per_piece]
            logits = self.model.compute_logits(hidden[first_row + begin : first_row + begin + len(piece)])
            if logits is None or self.sampler is None:
                continue
            out.extend(prompt_logprobs(logits, piece, item.sampling_params.prompt_logprobs))
        return out if self.sampler is not None else None
