"""Every engine argument and sampling parameter of the wrong type is a `ValueError` naming the
field, the type expected and the value given (pagedllm.field_types), before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.sampling_params import BeamSearchParams, StructuredOutputsParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": "x"}, "EngineArgs.seed must be an integer, got 'x' (str)."),
        ({"max_num_seqs": 2.5}, "EngineArgs.max_num_seqs must be an integer, got 2.5"),
        ({"block_size": True}, "EngineArgs.block_size must be an integer, got True"),
        ({"enforce_eager": "yes"}, "EngineArgs.enforce_eager must be True or False, got 'yes'"),
        ({"swap_space": "4"}, "EngineArgs.swap_space must be a number, got '4'"),
        ({"max_model_len": "128"}, "EngineArgs.max_model_len must be an integer or None, got '128'"),
        ({"max_step_seconds": "fast"}, "EngineArgs.max_step_seconds must be a number or None"),
        ({"dtype": 16}, "EngineArgs.dtype must be a string, got 16"),
    ],
)
def test_an_engine_argument_of_the_wrong_type_names_itself(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        LLM("does-not-matter", **kwargs)  # refused before the model is even looked for


def test_a_path_names_a_model_as_well_as_its_text():
    assert EngineArgs(model=Path("/models/tiny")).model == "/models/tiny"


def test_limits_must_be_positive():
    for name in ("max_n", "max_beam_width", "structured_outputs_cache_bytes"):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            EngineArgs(**{name: 0}).create_engine_config()
    with pytest.raises(ValueError, match="max_step_seconds must be >= 0"):
        EngineArgs(max_step_seconds=-1.0).create_engine_config()
    assert EngineArgs(max_step_seconds=0).create_engine_config().scheduler.max_step_seconds is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": "x"}, "SamplingParams.seed must be an integer or None, got 'x'"),
        ({"n": 2.0}, "SamplingParams.n must be an integer, got 2.0"),
        ({"stop": 3}, "SamplingParams.stop must be a list or a string or None, got 3"),
        ({"logprobs": "5"}, "SamplingParams.logprobs must be an integer or None, got '5'"),
        ({"ignore_eos": 1}, "SamplingParams.ignore_eos must be True or False, got 1"),
        ({"temperature": "hot"}, "SamplingParams.temperature must be a number, got 'hot'"),
        ({"logit_bias": [1, 2]}, "SamplingParams.logit_bias must be a map or None"),
        ({"bad_words": "word"}, "SamplingParams.bad_words must be a list or None"),
    ],
)
def test_a_sampling_parameter_of_the_wrong_type_names_itself(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**kwargs)


def test_constraint_and_beam_parameters_of_the_wrong_type_name_themselves():
    with pytest.raises(ValueError, match=r"structured_outputs\.regex must be a string or None, got 5"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(ValueError, match=r"BeamSearchParams\.beam_width must be an integer, got '4'"):
        BeamSearchParams(beam_width="4", max_tokens=8)
