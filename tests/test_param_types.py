"""The offline API's parameter objects refuse a value of the wrong type at construction, naming
the field, what it got and what it takes (``ParamTypeError``: a ``TypeError`` and a
``ValueError``), rather than misreading it or failing later inside the engine."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from omniserve.entrypoints.beam_search import BeamSearchParams
from omniserve.sampling_params import (
    ParamTypeError,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    SpeechParams,
    StructuredOutputsParams,
)

# (field, value, what the message says it takes)
SAMPLING_REFUSED = [
    ("logit_bias", [1, 2], "a dict of integers to numbers or None"),
    ("logit_bias", {"x": 1.0}, "a dict of integers to numbers or None"),
    ("logit_bias", {"-1": 1.0}, "a dict of integers to numbers or None"),  # no digit string
    ("logit_bias", {1: "2"}, "a dict of integers to numbers or None"),
    ("logit_bias", {True: 1.0}, "a dict of integers to numbers or None"),
    ("structured_outputs", 5, "a StructuredOutputsParams or a dict"),
    ("pooling", 5, "a PoolingParams or a dict"),
    ("speech", 5, "a SpeechParams or a dict"),
    ("skip_special_tokens", "no", "a boolean"),
    ("ignore_eos", "yes", "a boolean"),
    ("include_stop_str_in_output", 5, "a boolean"),
    ("detokenize", 0, "a boolean"),
    ("spaces_between_special_tokens", 1, "a boolean"),
    ("output_kind", "x", "a RequestOutputKind"),
    ("output_kind", 7, "a RequestOutputKind"),
    ("stop", [1], "a list of strings"),
    ("stop", 5, "a list of strings"),
    ("stop_token_ids", ["a"], "a list of integers"),
    ("stop_token_ids", "abc", "a list of integers"),
    ("n", True, "an integer"),
    ("n", 2.0, "an integer"),
    ("max_tokens", 2.5, "an integer or None"),
    ("min_tokens", False, "an integer"),
    ("top_k", 2.0, "an integer"),
    ("logprobs", True, "an integer or None"),
    ("seed", "1", "an integer or None"),
    ("temperature", "0.5", "a number"),
    ("top_p", True, "a number"),
    ("allowed_token_ids", ["a"], "a list of integers or None"),
    ("allowed_token_ids", [True], "a list of integers or None"),
    ("bad_words", [3], "a list of strings"),
    ("bad_words_token_ids", [1, 2], "a list of lists of integers"),
    ("bad_words_token_ids", [["a"]], "a list of lists of integers"),
    ("think_token_ids", ["a", 2], "a tuple (an integer, an integer) or None"),
    ("think_token_ids", (1,), "a tuple (an integer, an integer) or None"),
    ("output_modalities", 5, "a list of strings"),
]


@pytest.mark.parametrize(("name", "value", "takes"), SAMPLING_REFUSED)
def test_sampling_params_refuse_wrong_types(name: str, value: Any, takes: str) -> None:
    with pytest.raises(ParamTypeError, match=f"^{name} must be {re.escape(takes)}, got ") as info:
        SamplingParams(**{name: value})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)


NESTED_REFUSED = [
    (PoolingParams, {"dimensions": "4"}, "dimensions must be an integer or None"),
    (PoolingParams, {"normalize": "yes"}, "normalize must be a boolean or None"),
    (PoolingParams, {"use_activation": 1}, "use_activation must be a boolean or None"),
    (PoolingParams, {"task": 5}, "task must be a string or None"),
    (StructuredOutputsParams, {"regex": 5}, "structured_outputs.regex must be a string or None"),
    (StructuredOutputsParams, {"json": 5}, "structured_outputs.json must be a string, a dict or"),
    (StructuredOutputsParams, {"choice": "ab"}, "structured_outputs.choice must be a list of"),
    (StructuredOutputsParams, {"json_object": "yes"}, "structured_outputs.json_object must be a"),
    (
        StructuredOutputsParams,
        {"regex": "a", "disable_any_whitespace": "no"},
        "structured_outputs.disable_any_whitespace must be a boolean",
    ),
    (SpeechParams, {"voice": 5}, "speech.voice must be a string or None"),
    (SpeechParams, {"temperature": "1"}, "speech.temperature must be a number or None"),
    (SpeechParams, {"seed": True}, "speech.seed must be an integer or None"),
    (SpeechParams, {"max_tokens": 2.0}, "speech.max_tokens must be an integer or None"),
    (SpeechParams, {"reply_in_prompt": "yes"}, "speech.reply_in_prompt must be a boolean"),
]


@pytest.mark.parametrize(("kind", "kwargs", "message"), NESTED_REFUSED)
def test_nested_params_refuse_wrong_types(kind: type, kwargs: dict, message: str) -> None:
    with pytest.raises(ParamTypeError, match=f"^{re.escape(message)}"):
        kind(**kwargs)


def test_nested_params_as_dicts_are_checked_too() -> None:
    with pytest.raises(ParamTypeError, match="^speech.seed must be an integer or None"):
        SamplingParams(speech={"seed": "1"})
    with pytest.raises(ValueError, match=r"^pooling.size is not a pooling setting"):
        SamplingParams(pooling={"size": 3})
    with pytest.raises(ValueError, match="^speech.top_p must be in"):
        SpeechParams(top_p=2.0)  # a range, at construction (not only inside SamplingParams)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"length_penalty": math.nan}, ValueError, "length_penalty must be a number in"),
        ({"length_penalty": math.inf}, ValueError, "length_penalty must be a number in"),
        ({"length_penalty": -math.inf}, ValueError, "length_penalty must be a number in"),
        ({"length_penalty": 1000.0}, ValueError, "length_penalty must be a number in"),
        ({"length_penalty": "1"}, ParamTypeError, "length_penalty must be a number, got '1'"),
        ({"beam_width": 2.0}, ParamTypeError, "beam_width must be an integer, got 2.0"),
        ({"beam_width": True}, ParamTypeError, "beam_width must be an integer, got True"),
        ({"max_tokens": "3"}, ParamTypeError, "max_tokens must be an integer, got '3'"),
        ({"ignore_eos": "no"}, ParamTypeError, "ignore_eos must be a boolean, got 'no'"),
    ],
)
def test_beam_search_params_refusals(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **kwargs})


def test_accepted_edge_cases() -> None:
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]  # a word, not its letters
    assert SamplingParams(stop="end").stop == ["end"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(1,)).stop_token_ids == [1]
    assert SamplingParams(allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]
    assert SamplingParams(stop=None, bad_words=None).stop == []
    params = SamplingParams(temperature=1, top_p=1, presence_penalty=0, logit_bias={5: -100})
    assert params.temperature == 1  # an integer is a number
    assert SamplingParams(logit_bias={"12": 1.5, 7: 2}).logit_bias == {12: 1.5, 7: 2}  # JSON keys
    assert SamplingParams(top_k=-1).top_k == 0
    assert (
        SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA
    )
    assert SamplingParams(think_token_ids=(1, 2), bad_words_token_ids=[[3, 4]]).think_token_ids
    assert SamplingParams(speech={"seed": 3}).speech == SpeechParams(seed=3)
    assert SamplingParams(structured_outputs={"json": {"type": "object"}}).structured_outputs
    assert PoolingParams(dimensions=4, normalize=False, pooling_type="mean").pooling_type == "MEAN"
    assert BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=-2).length_penalty == -2
    listed = [1, 2]
    assert SamplingParams(stop_token_ids=listed).stop_token_ids is not listed  # a copy


def test_values_of_the_right_kind_in_another_form_take_the_fields_own() -> None:
    """As vLLM's lax configs: numpy numbers, tuples and enum values are what they stand for."""
    params = SamplingParams(seed=np.int64(3), temperature=np.float32(0.5), max_tokens=np.int64(4),
                            logit_bias={np.int64(5): np.float32(1.0)}, output_kind=2,
                            stop_token_ids=np.array([1, 2]).tolist() + [np.int64(3)])  # fmt: skip
    assert (params.seed, params.max_tokens, params.stop_token_ids) == (3, 4, [1, 2, 3])
    assert type(params.seed) is int and type(params.temperature) is float
    assert list(params.logit_bias) == [5] and type(next(iter(params.logit_bias))) is int
    assert params.output_kind is RequestOutputKind.FINAL_ONLY
    choice = StructuredOutputsParams(choice=("yes", "no")).choice
    assert choice == ["yes", "no"]
    assert BeamSearchParams(beam_width=np.int64(2), max_tokens=4).beam_width == 2


def test_values_of_the_right_type_still_meet_their_ranges() -> None:
    with pytest.raises(ValueError, match="^bad_words_token_ids must be a list of non-empty"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="^logit_bias must be a map of token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="^structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    for keep in (0, -2):
        with pytest.raises(ValueError, match="^truncate_prompt_tokens must be None, -1"):
            SamplingParams(truncate_prompt_tokens=keep)
    with pytest.raises(ParamTypeError, match="^truncate_prompt_tokens must be an integer"):
        SamplingParams(truncate_prompt_tokens=True)
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
