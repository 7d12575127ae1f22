"""Turn logits into tokens, per request, with every decoding method mixed in one batch.

Order of operations for each row: token controls (the engine's bitmask of allowed tokens for
structured outputs, allowed_token_ids and bad_words; logit_bias), min_tokens suppression,
penalties (repetition, frequency, presence), then greedy argmax, or temperature, top-k, top-p
and min-p followed by a random draw. Beam rows return their best candidate continuations for the engine to choose from.

Random draws invert each row's cumulative distribution at a uniform number (on the CPU a fused
kernel, csrc/sampling.cpp; elsewhere a cumsum and a binary search: both much faster than
`torch.multinomial` over a large vocabulary). A seeded
request draws its number from its own generator, one per (request, sample index), so it
produces the same tokens whatever else shares its batch.
Reported log-probabilities are those of the raw model distribution.

The sampler runs where the logits are (on a GPU, the whole batch stays there); the uniform
numbers are always drawn on the CPU, so a seeded request gives the same draws on any device,
and the chosen tokens come back to the host in one copy.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.core.model_output import SampledToken, TopLogprobs
from pagedllm.kernels import ops as fused_ops
from pagedllm.kernels.gguf import Draws
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.sampling.controls import apply_token_controls
from pagedllm.sampling.penalties import apply_min_tokens, apply_penalties
from pagedllm.sampling_params import SamplingType


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._global = torch.Generator().manual_seed(seed)
        self._generators: dict[tuple[str, int], torch.Generator] = {}

    def remove_requests(self, request_ids: list[str]) -> None:
        """Drop the generators of finished requests."""
        if not request_ids or not self._generators:
            return
        gone = set(request_ids)
        for key in [k for k in self._generators if k[0] in gone]:
            del self._generators[key]

    def _generator(self, item: ScheduledSequence, sample_index: int) -> torch.Generator:
        key = (item.request_id, sample_index)
        gen = self._generators.get(key)
        if gen is None:
            # A distinct, reproducible stream per sample of a seeded request.
            seed = (item.sampling_params.seed * 1_000_003 + sample_index) % (1 << 63)
            gen = self._generators[key] = torch.Generator().manual_seed(seed)
        return gen

    def __call__(self, logits: torch.Tensor, items: list[ScheduledSequence]) -> list[list[SampledToken]]:
        """logits: one row per sampling position: the last position of each sampling sequence,
        or, for a speculating sequence (`draft_token_ids`), its last 1 + k positions. Returns each
        item's tokens: one, best_of for a completing parallel-sampling prompt, beam candidates,
        or, for a speculating sequence, the accepted proposed tokens followed by the target's own
        next token (`verify`)."""
        logits = logits.float()
        if len(items) == logits.shape[0] and fused_ops.applies(logits) and self.plain_greedy(items):
            return self._greedy(logits)
        # Rows a parallel-sampling prompt expands into: one per sample, sharing the logits; a
        # speculating sequence expands into one row per verified position, each seeing the
        # proposed tokens before it as its output so far (for penalties and min_tokens).
        row_of: list[int] = []  # expanded row -> item
        logit_row: list[int] = []  # expanded row -> row of `logits`
        sample_index: list[int] = []
        expanded: list[ScheduledSequence] = []
        next_row = 0
        for i, item in enumerate(items):
            if item.draft_token_ids:
                for j in range(len(item.draft_token_ids) + 1):
                    expanded.append(_position_view(item, j))
                    row_of.append(i)
                    logit_row.append(next_row + j)
                    sample_index.append(item.sample_index)
                next_row += len(item.draft_token_ids) + 1
                continue
            if item.sampling_params.sampling_type is SamplingType.BEAM or item.num_samples == 1:
                row_of.append(i)
                sample_index.append(item.sample_index)
                logit_row.append(next_row)
                expanded.append(item)
            else:
                row_of.extend([i] * item.num_samples)
                sample_index.extend(range(item.num_samples))
                logit_row.extend([next_row] * item.num_samples)
                expanded.extend([item] * item.num_samples)
            next_row += 1
        raw = logits[logit_row] if len(logit_row) != logits.shape[0] else logits
        # Seeded speculating rows draw one number per verified position; the stream is rewound
        # to just past the positions kept, so a seeded request draws what it would without
        # speculation.
        rewind = {
            i: self._generator(item, item.sample_index).get_state()
            for i, item in enumerate(items)
            if item.draft_token_ids and item.sampling_params.sampling_type is SamplingType.RANDOM
            and item.sampling_params.seed is not None
        }
        wants_argmax = any(item.sampling_params.sampling_type is not SamplingType.RANDOM for item in expanded)
        if fused_ops.applies(raw) and wants_argmax:  # greedy tokens of the raw logits with their normaliser
            log_norm, raw_argmax = fused_ops.logsumexp_and_argmax_rows(raw)
        elif fused_ops.applies(raw):
            log_norm, raw_argmax = fused_ops.logsumexp_rows(raw), None
        else:
            log_norm, raw_argmax = torch.logsumexp(raw, dim=-1, keepdim=True), None

        # The token controls change `raw` in place until `restore` (no copy of the whole batch).
        controls = apply_token_controls(raw, expanded)
        processed = apply_min_tokens(raw, expanded)
        processed = apply_penalties(processed, expanded)
        untouched = controls is None and processed is raw  # min_tokens and penalties copy when they apply
        chosen = self._choose(processed, expanded, sample_index, raw_argmax if untouched else None)

        results: list[list[SampledToken]] = [[] for _ in items]
        beam_rows = [r for r, item in enumerate(expanded) if item.sampling_params.sampling_type is SamplingType.BEAM]
        beam_picks = self._beam_picks(raw, expanded, beam_rows)
        if controls is not None:
            controls.restore(raw)
        beam_candidates = {r: beam_samples(raw[r], log_norm[r], ids, expanded[r].sampling_params.logprobs)
                           for r, ids in beam_picks.items()}
        chosen_logprob = (raw.gather(1, chosen.unsqueeze(1)) - log_norm).squeeze(1)
        # One device-to-host copy for the step (float64 holds every token id exactly).
        host = torch.stack([chosen.to(torch.float64), chosen_logprob.to(torch.float64)]).cpu()
        chosen_ids = host[0].long().tolist()
        chosen_logprobs = host[1].tolist()
        asked = [r for r, item in enumerate(expanded) if r not in beam_candidates and item.sampling_params.logprobs is not None]
        tops = self._top_logprobs(raw, log_norm, chosen, chosen_ids, chosen_logprobs, asked, expanded)
        for r, item in enumerate(expanded):
            if r in beam_candidates:
                results[row_of[r]] = beam_candidates[r]
                continue
            results[row_of[r]].append(SampledToken(chosen_ids[r], chosen_logprobs[r], tops.get(r)))
        for i, item in enumerate(items):
            if item.draft_token_ids:
                # The kept tokens are the target's own choices, which equal the proposal's there.
                num_accepted = accept_proposal([t.token_id for t in results[i]], item.draft_token_ids)
                results[i] = results[i][: num_accepted + 1]
                if i in rewind:
                    gen = self._generator(item, item.sample_index)
                    gen.set_state(rewind[i])
                    for _ in range(num_accepted + 1):
                        torch.rand(1, generator=gen)
        return results

    @staticmethod
    def plain_greedy(items: list[ScheduledSequence]) -> bool:
        """Whether every item takes one greedy token from its own row and asks nothing else of
        the logits (`_plain_greedy`): its token and log-probability are all there is to compute."""
        return all(map(_plain_greedy, items))

    @staticmethod
    def in_head(items: list[ScheduledSequence], vocab_size: int) -> bool:
        """Whether an LM head that draws with its product serves the batch (`draws`): every item
        plain greedy or a plain top-k draw (`_plain_top_k`), one row each."""
        return all(_plain_greedy(item) or _plain_top_k(item, vocab_size) for item in items)

    def draws(self, items: list[ScheduledSequence]) -> Draws | None:
        """The head's draws for a batch `in_head` serves (None: every row greedy), with the
        uniform numbers `_choose` would draw for it: the same tokens either way."""
        random_rows = [r for r, item in enumerate(items) if item.sampling_params.sampling_type is SamplingType.RANDOM]
        if not random_rows:
            return None
        drawn = [item.sampling_params if r in random_rows else None for r, item in enumerate(items)]  # (greedy: None)
        uniform = torch.zeros(len(items), dtype=torch.float32)
        uniform[random_rows] = self._uniforms([items[r] for r in random_rows], [items[r].sample_index for r in random_rows])
        return Draws(torch.tensor([p.temperature if p is not None else 0.0 for p in drawn], dtype=torch.float32),
                     torch.tensor([p.top_k if p is not None else 0 for p in drawn], dtype=torch.int64),
                     torch.tensor([p.top_p if p is not None else 1.0 for p in drawn], dtype=torch.float32),
                     torch.tensor([p.min_p if p is not None else 0.0 for p in drawn], dtype=torch.float32), uniform)

    def _uniforms(self, items: list[ScheduledSequence], sample_index: list[int]) -> torch.Tensor:
        """One uniform number per random row: from the sampler's generator, a seeded request's
        from its own (request, sample) stream."""
        uniform = torch.rand(len(items), generator=self._global)
        for j, item in enumerate(items):
            if item.sampling_params.seed is not None:
                uniform[j] = torch.rand(1, generator=self._generator(item, sample_index[j]))
        return uniform

    @staticmethod
    def _greedy(logits: torch.Tensor) -> list[list[SampledToken]]:
        """A batch of plain greedy rows (`_plain_greedy`): each row's argmax and its raw
        log-probability from the one pass that finds both, and nothing else (what the general
        path computes for them, without its bookkeeping: a tenth of a millisecond a step)."""
        return Sampler.token_samples(*fused_ops.greedy_rows(logits))

    @staticmethod
    def token_samples(token_ids: list[int], logprobs: list[float]) -> list[list[SampledToken]]:
        """Each row's one token with its log-probability, as the sampler returns them."""
        return [[SampledToken(token_id, logprob)] for token_id, logprob in zip(token_ids, logprobs)]

    def _choose(
        self, logits: torch.Tensor, items: list[ScheduledSequence], sample_index: list[int], argmax: torch.Tensor | None
    ) -> torch.Tensor:
        """argmax: logits.argmax(dim=-1) if already known."""
        random_rows = [r for r, item in enumerate(items) if item.sampling_params.sampling_type is SamplingType.RANDOM]
        if len(random_rows) < len(items):
            # greedy (and beam) rows; random rows are overwritten
            chosen = argmax if argmax is not None else logits.argmax(dim=-1)
            rows = logits[random_rows]
        else:
            chosen = torch.empty(len(items), dtype=torch.int64, device=logits.device)
            rows = logits
        if not random_rows:
            return chosen
        params = [items[r].sampling_params for r in random_rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        top_k, top_p, min_p = [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]
        filtered = filters_apply(top_k, top_p, min_p)
        uniform = self._uniforms([items[r] for r in random_rows], [sample_index[r] for r in random_rows])
        uniform = uniform.to(logits.device)
        if fused_ops.applies(rows):
            drawn = self._draw_on_cpu(rows, temperature, top_k, top_p, min_p, uniform) if filtered \
                else fused_ops.sample_rows(rows, temperature, uniform)
        else:
            if filtered:
                rows = filter_top_k_top_p_min_p(rows / temperature.unsqueeze(1), top_k, top_p, min_p)
                temperature = torch.ones_like(temperature)
            cdf = torch.softmax(rows / temperature.unsqueeze(1), dim=-1).cumsum_(dim=-1)  # [rows, vocab]
            # The first token whose cumulative probability exceeds u: tokens of zero probability
            # (masked by the filters) have empty intervals and are never drawn.
            drawn = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
            drawn = drawn.clamp_(max=cdf.shape[1] - 1)
        chosen[random_rows] = drawn
        return chosen

    @staticmethod
    def _top_logprobs(raw: torch.Tensor, log_norm: torch.Tensor, chosen: torch.Tensor, chosen_ids: list[int],
                      chosen_logprobs: list[float], rows: list[int],
                      items: list[ScheduledSequence]) -> dict[int, TopLogprobs]:
        """The `logprobs` each row in `rows` asks for (`top_logprobs`); on a CPU, every row's in
        one pass of the row (the top k by a heap, the chosen token's rank by a count)."""
        if not rows:
            return {}
        if not fused_ops.applies(raw):
            return {r: top_logprobs(raw[r], log_norm[r], chosen_ids[r], items[r].sampling_params.logprobs) for r in rows}
        k = max(items[r].sampling_params.logprobs for r in rows)
        index = torch.tensor(rows)
        values, ids, ranks = fused_ops.top_logprobs_rows(raw[index], log_norm[index], chosen[index], k)
        values, ids, ranks = values.tolist(), ids.tolist(), ranks.tolist()
        tops: dict[int, TopLogprobs] = {}
        for i, r in enumerate(rows):
            wanted = items[r].sampling_params.logprobs
            top: TopLogprobs = {t: (v, rank) for rank, (t, v) in enumerate(zip(ids[i][:wanted], values[i][:wanted]), start=1)
                                if t >= 0}
            if chosen_ids[r] not in top:
                top[chosen_ids[r]] = (chosen_logprobs[r], ranks[i])
            tops[r] = top
        return tops

    @staticmethod
    def _draw_on_cpu(rows: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float],
                     min_p: list[float], uniform: torch.Tensor) -> torch.Tensor:
        """The draws of a batch where some rows filter: those by the one-pass filtered kernel, the
        others by the plain one, as they would be drawn in a batch without filters (a row's draw
        never depends on its neighbours' settings)."""
        filters = [j for j, (k, p, m) in enumerate(zip(top_k, top_p, min_p)) if k or p < 1.0 or m]
        if len(filters) == len(top_k):
            return fused_ops.sample_filtered_rows(rows, temperature, top_k, top_p, min_p, uniform)
        plain = sorted(set(range(len(top_k))) - set(filters))
        drawn = torch.empty(len(top_k), dtype=torch.int64)
        drawn[plain] = fused_ops.sample_rows(rows[plain], temperature[plain], uniform[plain])
        drawn[filters] = fused_ops.sample_filtered_rows(
            rows[filters], temperature[filters], [top_k[j] for j in filters], [top_p[j] for j in filters],
            [min_p[j] for j in filters], uniform[filters])
        return drawn

    @staticmethod
    def _beam_picks(controlled: torch.Tensor, items: list[ScheduledSequence], rows: list[int]) -> dict[int, torch.Tensor]:
        """For each beam row, the ids of the next tokens the beam step can use, picked under the
        token controls (forbidden tokens never); the caller scores them with the raw
        log-probabilities. transformers ranks the K = max(2, 1 + #stop tokens) * beam_width best
        continuations over all beams; of one beam's, only two kinds can matter: its 2 * beam_width
        best (a candidate finishes only within the step's top beam_width), and its beam_width best
        that do not stop (the next live beams). Those are taken, at most 3 * beam_width per beam
        however many stop tokens a request names."""
        out: dict[int, torch.Tensor] = {}
        vocab = controlled.shape[1]
        for r in rows:
            params = items[r].sampling_params
            width = params.best_of
            picked, ids = torch.topk(controlled[r], min(2 * width, vocab))
            ids = ids[torch.isfinite(picked)]
            stops = [t for t in params.all_stop_token_ids if t < vocab]
            if stops:
                going_on = controlled[r].clone()
                going_on[torch.tensor(stops)] = float("-inf")
                more_picked, more = torch.topk(going_on, min(width, vocab))
                more = more[torch.isfinite(more_picked)]
                ids = torch.cat([ids, more[~torch.isin(more, ids)]])
            out[r] = ids
        return out


def _position_view(item: ScheduledSequence, j: int) -> ScheduledSequence:
    """A speculating sequence as it stands at its j-th verified position: the first j proposed
    tokens are its newest output (what penalties and min_tokens see)."""
    if j == 0:
        return item
    drafts = item.draft_token_ids[:j]
    return dataclasses.replace(
        item,
        num_output_tokens=item.num_output_tokens + j,
        output_token_ids=None if item.output_token_ids is None else item.output_token_ids + drafts,
        token_bitmask=item.draft_token_bitmasks[j - 1] if item.draft_token_bitmasks is not None else None,
        draft_token_ids=[],
        draft_token_bitmasks=None,
    )


def accept_proposal(chosen: list[int], proposed: list[int]) -> int:
    """How many proposed tokens to keep, given the target's own token at each verified position
    (chosen[j] follows the proposal's first j tokens; len(chosen) = len(proposed) + 1): the
    longest prefix on which they agree.

    Greedy rows pick the argmax, so this is the longest prefix equal to the target's argmax.
    Random rows drew chosen[j] from the target's distribution p_j, and a proposal is one token
    x_j (q one-hot): keeping x_j exactly when the draw equals it accepts with probability
    p_j(x_j) = min(1, p_j(x_j) / q_j(x_j)), and on a rejection the draw, conditioned on
    differing from x_j, is a sample of the normalised residual max(0, p_j - q_j); after a full
    acceptance chosen[k] is the bonus token. So the output has the target's distribution."""
    n = 0
    while n < len(proposed) and chosen[n] == proposed[n]:
        n += 1
    return n


def filters_apply(top_k: list[int], top_p: list[float], min_p: list[float]) -> bool:
    return any(top_k) or any(p < 1.0 for p in top_p) or any(min_p)


def filter_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k, top-p and min-p filters exclude.
    logits: [rows, vocab] (already divided by temperature)."""
    if any(top_k):
        vocab = logits.shape[1]
        k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=logits.device)
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def top_logprobs(raw_row: torch.Tensor, log_norm: torch.Tensor, chosen: int, k: int) -> TopLogprobs:
    """The k most likely tokens of one raw distribution, plus the chosen token, with ranks."""
    logprobs = raw_row - log_norm
    result: TopLogprobs = {}
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            result[t] = (v, rank)
    if chosen not in result:
        value = logprobs[chosen]
        result[chosen] = (value.item(), int((logprobs > value).sum()) + 1)
    return result


def beam_samples(raw_row: torch.Tensor, log_norm: torch.Tensor, ids: torch.Tensor, k: int | None) -> list[SampledToken]:
    """A beam's candidate tokens with their raw log-probabilities and, if `logprobs` was asked
    for, the row's top k and each candidate's own rank (as a sampled token has)."""
    logprobs = raw_row - log_norm
    values = logprobs[ids]
    if k is None:
        return [SampledToken(t, v) for t, v in zip(ids.tolist(), values.tolist())]
    top: TopLogprobs = {}
    if k > 0:
        top_values, top_ids = torch.topk(logprobs, k)
        top = {t: (v, rank) for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1)}
    ranks = (logprobs.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1) + 1
    return [
        SampledToken(t, v, top if t in top else {**top, t: (v, rank)})
        for t, v, rank in zip(ids.tolist(), values.tolist(), ranks.tolist())
    ]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TopLogprobs]:
    """Log-probability of each prompt token given its prefix, with its rank and the top k.
    logits: [len(targets), vocab]; every row at once (one log-softmax, one top-k)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    values = logprobs.gather(1, target_ids)
    ranks = (logprobs > values).sum(dim=1) + 1
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k > 0 else (values[:, :0], target_ids[:, :0])
    out: list[TopLogprobs] = []
    for target, value, rank, ids, tops in zip(
        targets, values.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist()
    ):
        entry = {t: (v, r) for r, (t, v) in enumerate(zip(ids, tops), start=1)}
        entry.setdefault(target, (value, rank))
        out.append(entry)
    return out


def _plain_greedy(item: ScheduledSequence) -> bool:
    """A row the greedy fast path serves: one greedy token from its own logits row, with no
    log-probabilities to list, no token control, no min_tokens suppression and no penalty."""
    return item.sampling_params.sampling_type is SamplingType.GREEDY and _plain_row(item)


def _plain_top_k(item: ScheduledSequence, vocab_size: int) -> bool:
    """A row whose draw an LM head can make with its product: a random draw under a top-k
    filter (0 < k < vocab_size; top-p and min-p then act on the k kept), the raw logits'
    otherwise, as `_plain_greedy`'s."""
    params = item.sampling_params
    return params.sampling_type is SamplingType.RANDOM and 0 < params.top_k < vocab_size and _plain_row(item)


def _plain_row(item: ScheduledSequence) -> bool:
    """One token from the item's own logits row, as they are: no log-probabilities to list, no
    token control, no min_tokens suppression, no penalty."""
    params = item.sampling_params
    return (item.num_samples == 1 and not item.draft_token_ids
            and params.logprobs is None and item.token_bitmask is None and not params.logit_bias
            and not params.needs_penalties
            and not (item.num_output_tokens < params.min_tokens and params.all_stop_token_ids))
