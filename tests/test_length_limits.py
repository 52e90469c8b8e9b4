"""The Processor alone decides a request's length limits, after media placeholders expand: the
prompt must leave room to generate, an unset max_tokens takes the room left (capped by the
checkpoint's max_new_tokens), and an explicit max_tokens that does not fit is refused by the
server's engine (``serving``) and cut to fit offline. The server maps the refusal to a
400 ``context_length_exceeded`` naming the field (tests/test_api_server.py)."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from omniserve import SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.processor import ContextLengthError, Processor

MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def config(tiny_checkpoint: Any) -> Any:
    model = str(tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"))
    return EngineArgs(model=model, max_model_len=MAX_MODEL_LEN,
                      kv_cache_memory=8 << 20).create_config()  # fmt: skip


def _image_prompt(processor: Processor) -> dict[str, Any]:
    tok = processor.tokenizer
    image = f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}"
    return {
        "prompt": f"<|im_start|>user\n{image}What is it?<|im_end|>\n<|im_start|>assistant\n",
        "multi_modal_data": {"image": Image.new("RGB", (224, 224), "red")},
    }


def test_max_tokens_is_checked_against_the_expanded_prompt(config: Any) -> None:
    """A max_tokens that fits the text alone but not the prompt with its image's 64 tokens:
    refused where the server's engine is strict, cut to what is left offline."""
    offline, strict = Processor(config), Processor(config, serving=True)
    prompt = _image_prompt(offline)
    text_len = len(offline.tokenizer(prompt["prompt"]).input_ids)
    expanded = len(offline.process_inputs("probe", prompt, SamplingParams()).prompt_token_ids)
    assert expanded > text_len + 50  # the image's placeholders
    fits_the_text = MAX_MODEL_LEN - text_len
    request = offline.process_inputs("a", prompt, SamplingParams(max_tokens=fits_the_text))
    assert request.engine_requests[0].max_tokens == MAX_MODEL_LEN - expanded
    with pytest.raises(ContextLengthError) as error:
        strict.process_inputs("b", prompt, SamplingParams(max_tokens=fits_the_text))
    assert error.value.param == "max_tokens"
    assert f"{expanded} in the prompt, {fits_the_text} in the completion" in str(error.value)
    exact = strict.process_inputs("c", prompt, SamplingParams(max_tokens=MAX_MODEL_LEN - expanded))
    assert exact.engine_requests[0].max_tokens == MAX_MODEL_LEN - expanded


def test_unset_max_tokens_takes_the_room_capped_by_the_checkpoint(config: Any) -> None:
    """Capped only where serving (vLLM's server); offline it runs to max_model_len (its LLM)."""
    tokens = {"prompt_token_ids": list(range(10, 40))}
    unset = SamplingParams(max_tokens=None)
    for processor in (Processor(config), Processor(config, serving=True)):
        assert processor.process_inputs("a", tokens, unset).engine_requests[0].max_tokens == 130
    serving = Processor(config, serving=True)
    serving.default_max_tokens = 7  # as a generation_config.json max_new_tokens sets it
    assert serving.process_inputs("b", tokens, unset).engine_requests[0].max_tokens == 7


def test_a_prompt_with_no_room_is_refused_with_both_counts(config: Any) -> None:
    for processor in (Processor(config), Processor(config, serving=True)):
        tokens = {"prompt_token_ids": list(range(10, 10 + MAX_MODEL_LEN))}
        with pytest.raises(ContextLengthError, match="is 160 tokens .max_model_len.") as error:
            processor.process_inputs("a", tokens, SamplingParams())
        assert error.value.param is None and "has 160 input tokens" in str(error.value)
