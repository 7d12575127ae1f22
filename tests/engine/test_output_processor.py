"""The OutputProcessor without a model: stop conditions, text, finish reasons, parallel-sample forks and logprobs."""

from __future__ import annotations

import pytest

from pagedllm.core import SequenceStatus
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams
from tests.engine.fakes import EOS, FakeEngine, feed, tokens

PROMPT = [1, 2, 3]
STOP_TOKEN = 5  # decodes to "x"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 10, **kwargs})


def start(engine: FakeEngine, params: SamplingParams, prompt=PROMPT):
    """Add a request; return its only sequence."""
    return engine.add("req", prompt, params).seqs[0]


# --- stop conditions ------------------------------------------------------------------------


def test_stop_token_id_ends_the_sequence_with_that_token_as_stop_reason():
    engine = FakeEngine()
    seq = start(engine, greedy(stop_token_ids=[STOP_TOKEN]))
    feed(engine, seq, [1, STOP_TOKEN, 2])
    assert seq.output_token_ids == [1, STOP_TOKEN]
    assert (seq.status, seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, STOP_TOKEN)


def test_eos_ends_the_sequence_without_a_stop_reason():
    engine = FakeEngine()
    seq = start(engine, greedy())
    feed(engine, seq, [1, EOS, 2])
    assert seq.output_token_ids == [1, EOS]
    assert (seq.status, seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, None)


def test_ignore_eos_generates_past_eos_until_max_tokens():
    engine = FakeEngine()
    seq = start(engine, greedy(ignore_eos=True, max_tokens=3))
    feed(engine, seq, [EOS, EOS, 1, 2])
    assert seq.output_token_ids == [EOS, EOS, 1]
    assert seq.status is SequenceStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    "stop",
    [{}, {"stop_token_ids": [STOP_TOKEN]}, {"stop": ["x"]}],
    ids=["eos", "stop_token_id", "stop_string"],
)
def test_min_tokens_defers_every_kind_of_stop(stop):
    """The stop comes as outputs 1 and 3; with min_tokens=3 only the second one counts."""
    engine = FakeEngine()
    stopper = EOS if not stop else STOP_TOKEN
    seq = start(engine, greedy(min_tokens=3, **stop))
    feed(engine, seq, [stopper, 1, stopper, 2])
    assert seq.output_token_ids == [stopper, 1, stopper]
    assert seq.status is SequenceStatus.FINISHED_STOPPED


@pytest.mark.parametrize("include, expected_text", [(False, "a"), (True, "aSTOP")])
def test_stop_string_spanning_two_tokens_trims_the_text_at_the_match(include, expected_text):
    """Tokens "a", "ST", "OP": the stop string completes with the third."""
    engine = FakeEngine()
    seq = start(engine, greedy(stop=["STOP"], include_stop_str_in_output=include))
    feed(engine, seq, [1, 6, 7, 2])
    assert seq.output_token_ids == [1, 6, 7]
    assert (seq.output_text, seq.stop_reason) == (expected_text, "STOP")


@pytest.mark.parametrize("include, expected_text", [(False, "a"), (True, "aQ")])
def test_text_after_a_stop_string_inside_a_token_is_dropped(include, expected_text):
    """Token 8 decodes to "Q!": the text ends at (or just after) "Q", never with the "!"."""
    engine = FakeEngine()
    seq = start(engine, greedy(stop=["Q"], include_stop_str_in_output=include))
    feed(engine, seq, [1, 8, 2])
    assert seq.output_text == expected_text


def test_text_grows_by_each_tokens_string():
    engine = FakeEngine()
    seq = start(engine, greedy(max_tokens=4))
    feed(engine, seq, [1, 4, 2, 3])
    assert seq.output_text == "a bc"


# --- length limits --------------------------------------------------------------------------


def test_max_tokens_ends_the_sequence_with_finish_reason_length():
    engine = FakeEngine()
    seq = start(engine, greedy(max_tokens=3))
    feed(engine, seq, [1, 2, 3, 1])
    assert seq.output_token_ids == [1, 2, 3]
    assert seq.status.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [None, 10])
def test_max_model_len_caps_the_output_with_finish_reason_length(max_tokens):
    """A 4-token prompt with max_model_len=6 leaves room for 2 tokens, whatever max_tokens asks."""
    engine = FakeEngine(max_model_len=6)
    seq = start(engine, greedy(max_tokens=max_tokens), prompt=[1, 2, 3, 1])
    feed(engine, seq, [1, 2, 3])
    assert seq.output_token_ids == [1, 2]
    assert seq.status.finish_reason == "length"


# --- parallel sampling ----------------------------------------------------------------------

SIX_TOKEN_PROMPT = [1, 2, 3, 1, 2, 3]  # two 4-token blocks, the second holding 2 tokens


def start_parallel_sampling(engine: FakeEngine):
    """A best_of=3 request; one step computes its prompt and draws 3 samples (tokens 1, 2, 3).
    Returns the group and the block table its prompt was computed into."""
    group = engine.add("req", SIX_TOKEN_PROMPT, SamplingParams(n=2, best_of=3, temperature=1.0, max_tokens=5))

    def respond(out):
        (item,) = out.seqs
        assert item.num_samples == 3
        return ModelRunnerOutput({item.seq_id: SequenceStepOutput(samples=tokens(1, 2, 3))})

    (item,) = engine.run_step(respond).seqs
    return group, item.block_table


def test_completed_parallel_sampling_prompt_forks_into_best_of_sequences_one_sample_each():
    engine = FakeEngine(block_size=4)
    group, _ = start_parallel_sampling(engine)
    assert [s.sample_index for s in group.seqs] == [0, 1, 2]
    assert [s.output_token_ids for s in group.seqs] == [[1], [2], [3]]
    assert all(s.status is SequenceStatus.RUNNING for s in group.seqs)


def test_forked_samples_share_the_parents_blocks():
    engine = FakeEngine(block_size=4)
    group, parent_blocks = start_parallel_sampling(engine)
    assert [engine.bm.block_ids(s.seq_id) for s in group.seqs] == [parent_blocks] * 3
    assert [engine.bm.ref_count(b) for b in parent_blocks] == [3, 3]
    engine.bm.check_invariants()


def test_forked_samples_copy_the_shared_partly_filled_block_on_first_write():
    """Each sample writes position 6 into the shared second block: the first two sharers copy
    it, the last writes in place; the full first block stays shared by all three."""
    engine = FakeEngine(block_size=4)
    group, (first, second) = start_parallel_sampling(engine)
    out = engine.step(lambda item: tokens(1))
    assert [src for src, _ in out.blocks_to_copy] == [second, second]
    tables = [engine.bm.block_ids(s.seq_id) for s in group.seqs]
    assert [t[0] for t in tables] == [first] * 3 and engine.bm.ref_count(first) == 3
    assert len({t[1] for t in tables}) == 3
    engine.bm.check_invariants()


# --- log-probabilities ----------------------------------------------------------------------

STEP_SAMPLES = [
    SampledToken(1, -0.5, {1: (-0.5, 1), 2: (-1.25, 2)}),
    SampledToken(2, -2.0, {1: (-0.25, 1), 2: (-2.0, 2)}),
]


def run_two_logprob_steps(params: SamplingParams):
    engine = FakeEngine()
    seq = start(engine, params)
    samples = list(STEP_SAMPLES)
    engine.step(lambda item: [samples.pop(0)])
    engine.step(lambda item: [samples.pop(0)])
    return seq


def test_logprobs_are_recorded_per_output_position_with_rank_and_text_when_asked():
    seq = run_two_logprob_steps(greedy(logprobs=1))
    assert seq.output_logprobs == [
        {1: Logprob(-0.5, 1, "a"), 2: Logprob(-1.25, 2, "b")},
        {1: Logprob(-0.25, 1, "a"), 2: Logprob(-2.0, 2, "b")},
    ]


def test_no_logprobs_are_recorded_when_not_asked():
    seq = run_two_logprob_steps(greedy())
    assert seq.output_logprobs == []


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs():
    seq = run_two_logprob_steps(greedy())
    assert seq.cumulative_logprob == -2.5


def test_prompt_logprobs_start_with_none_then_one_entry_per_following_prompt_token():
    engine = FakeEngine()
    group = engine.add("req", PROMPT, greedy(prompt_logprobs=1))
    (item,) = engine.run_step(
        lambda out: ModelRunnerOutput(
            {out.seqs[0].seq_id: SequenceStepOutput(samples=tokens(1), prompt_logprobs=[{2: (-0.5, 1)}, {3: (-1.0, 2)}])}
        )
    ).seqs
    assert item.prompt_logprob_targets == [2, 3]
    assert group.prompt_logprobs == [None, {2: Logprob(-0.5, 1, "b")}, {3: Logprob(-1.0, 2, "c")}]
