"""The offline API refuses mistaken inputs with a TypeError/ValueError naming the argument or key
(never ignoring them, never an unrelated traceback), and reads image arrays by one layout rule."""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tqdm.auto import tqdm

from omniserve import LLM, SamplingParams
from omniserve.entrypoints.beam_search import BeamSearchParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=2)
VL_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
TONE = (np.zeros(16000, np.float32), 16000)
PIL_IMAGE = Image.new("RGB", (28, 28))


def _llm(path: Any) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=512, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> Any:
    llm = _llm(tiny_checkpoint("Qwen3ForCausalLM"))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def vl(tiny_checkpoint: Any) -> Any:
    llm = _llm(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    yield llm
    llm.shutdown()


def _refused(llm: LLM, error: type[Exception], needle: str, *args: Any, **kwargs: Any) -> None:
    """``generate`` refuses the call, naming ``needle``, and leaves nothing running."""
    with pytest.raises(error, match=needle):
        llm.generate(*args, **{"use_tqdm": False, **kwargs})
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_prompt_keys_are_refused_naming_them(llm: LLM) -> None:
    _refused(llm, TypeError, r"'multimodal_data' \(did you mean 'multi_modal_data'\?\)",
             {"prompt": "hi", "multimodal_data": {"image": None}}, PARAMS)  # fmt: skip
    with pytest.raises(TypeError, match="'foo'; a prompt dict takes .*prompt_token_ids") as info:
        llm.generate({"prompt": "hi", "foo": 1}, PARAMS, use_tqdm=False)
    assert "multi_modal_data" in str(info.value)
    _refused(llm, TypeError, "'foo'", [{"prompt_token_ids": [5], "foo": 1}], PARAMS)
    _refused(llm, TypeError, "token_type_ids: vLLM's field for BERT-style cross-encoders",
             {"prompt_token_ids": [5], "token_type_ids": [0]}, PARAMS)  # fmt: skip
    _refused(llm, TypeError, "'foo'", {"prompt_embeds": torch.zeros(1, 8), "foo": 1}, PARAMS)


def test_text_beside_token_ids_is_the_outputs_prompt(llm: LLM) -> None:
    """vLLM's TokensPrompt: the ids run and the text is returned with them (the chat renderer
    and the server send both); beam search extends the ids."""
    (out,) = llm.generate({"prompt": "hi", "prompt_token_ids": [5, 6]}, PARAMS, use_tqdm=False)
    assert (out.prompt, out.prompt_token_ids) == ("hi", [5, 6])
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    both = llm.beam_search({"prompt": "hi", "prompt_token_ids": [5, 6]}, params)
    ids = llm.beam_search({"prompt_token_ids": [5, 6]}, params)
    assert [b.tokens for b in both[0].sequences] == [b.tokens for b in ids[0].sequences]


def test_mm_processor_kwargs_without_media(
    llm: LLM, vl: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM ignores them (a text model's too): so does this, logging the no-op once; they must
    still be a dict."""
    kwargs = {"max_pixels": 200_000}
    _refused(vl, TypeError, "mm_processor_kwargs must be a dict, not int",
             {"prompt": "hi", "mm_processor_kwargs": 5}, PARAMS)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="omniserve.inputs.preprocess"):
        (out,) = vl.generate({"prompt": "hi", "mm_processor_kwargs": kwargs}, PARAMS,
                             use_tqdm=False)  # fmt: skip
    assert len(out.outputs[0].token_ids) == 2
    assert "mm_processor_kwargs ['max_pixels'] given in a prompt without" in caplog.text
    for model in (llm, vl):  # a text model; an option no request of the model may set
        prompt = {"prompt": "hi", "mm_processor_kwargs": {"size": {"longest_edge": 3136}}}
        assert model.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert llm.chat(messages, PARAMS, use_tqdm=False, mm_processor_kwargs=kwargs)


def test_token_ids_must_be_ints(llm: LLM) -> None:
    _refused(llm, TypeError, r"prompt_token_ids\[0\] must be an int, not bool",
             {"prompt_token_ids": [True, 2]}, PARAMS)  # fmt: skip
    _refused(llm, TypeError, r"prompt_token_ids\[1\] must be an int, not float",
             {"prompt_token_ids": [1, 2.0]}, PARAMS)  # fmt: skip
    _refused(llm, TypeError, r"prompt_token_ids\[0\] must be an int, not float",
             {"prompt_token_ids": np.array([1.0, 2.0])}, PARAMS)  # fmt: skip
    _refused(llm, TypeError, r"must be a list of ints \(or a tuple, or a 1-D integer array\), "
             "not ndarray", {"prompt_token_ids": np.array([[1, 2]])}, PARAMS)  # fmt: skip
    _refused(llm, TypeError, "must be a list of ints .*not str", {"prompt_token_ids": "12"},
             PARAMS)  # fmt: skip


def test_token_ids_may_be_a_tuple_or_an_integer_array(llm: LLM) -> None:
    """What a tokenizer's numpy/torch output or a tuple holds: the same prompt as the list."""
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, PARAMS, use_tqdm=False)
    for ids in [(5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), 6, 7]]:
        (same,) = llm.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)
        assert same.prompt_token_ids == [5, 6, 7]
        assert same.outputs[0].token_ids == out.outputs[0].token_ids


def test_beam_search_takes_one_prompt_and_needs_its_params(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    (one,) = llm.beam_search("hey", params)
    (listed,) = llm.beam_search(["hey"], params)
    assert [b.tokens for b in one.sequences] == [b.tokens for b in listed.sequences]
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, not dict"):
        llm.beam_search(["hey"], {"beam_width": 2})
    with pytest.raises(TypeError, match=r"prompts\[0\] must be text"):
        llm.beam_search([5], params)
    (ids,) = llm.beam_search({"prompt_token_ids": (5, 6)}, params)
    (same,) = llm.beam_search({"prompt_token_ids": [5, 6]}, params)
    assert [b.tokens for b in ids.sequences] == [b.tokens for b in same.sequences]
    with pytest.raises(TypeError, match="prompt_token_ids must be a list of ints .*not set"):
        llm.beam_search({"prompt_token_ids": {5, 6}}, params)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[0\] must be an int, not bool"):
        llm.beam_search({"prompt_token_ids": [True, 6]}, params)


def test_beam_search_takes_vllms_use_tqdm_and_concurrency_limit(llm: LLM) -> None:
    """``concurrency_limit`` prompts at a time give what all at once give; the bar counts
    steps, to ``max_tokens`` per group of prompts."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    prompts = ["a", "b", "c"]
    together = llm.beam_search(prompts, params)
    bars: list[Any] = []

    class Bar:  # a bar needs update and close only
        def __init__(self, total: int, **kwargs: Any) -> None:
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            self.closed = True

    apart = llm.beam_search(prompts, params, use_tqdm=Bar, concurrency_limit=2)
    assert [[b.tokens for b in out.sequences] for out in apart] == [
        [b.tokens for b in out.sequences] for out in together]  # fmt: skip
    assert (bars[0].total, bars[0].n, bars[0].closed) == (2 * 3, 2 * 3, True)
    with pytest.raises(ValueError, match="concurrency_limit must be >= 1, got 0"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    with pytest.raises(TypeError, match="use_tqdm must be a bool or a callable"):
        llm.beam_search(prompts, params, use_tqdm="yes")


def test_chat_template_content_format(llm: LLM) -> None:
    """vLLM's ``chat_template_content_format``: "string" joins a message's text parts, "openai"
    hands the template the parts; "auto" reads which the template takes."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

    def rendered(**kwargs: Any) -> str:
        out = llm.chat(messages, PARAMS, use_tqdm=False, chat_template=template, **kwargs)
        return llm.get_tokenizer().decode(out[0].prompt_token_ids)

    assert rendered() == rendered(chat_template_content_format="string") == "[hi]"
    assert "'type': 'text'" in rendered(chat_template_content_format="openai")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        rendered(chat_template_content_format="json")


def test_use_tqdm_takes_a_callable_building_the_bar(llm: LLM) -> None:
    calls: list[dict[str, Any]] = []

    def make_bar(**kwargs: Any) -> tqdm:
        calls.append(kwargs)
        return functools.partial(tqdm, leave=False, disable=True)(**kwargs)

    outs = llm.generate(["a", "b"], PARAMS, use_tqdm=make_bar)
    assert len(outs) == 2 and calls and calls[0]["total"] == 2
    llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=make_bar)
    assert len(calls) == 2
    _refused(llm, TypeError, "use_tqdm must be a bool or a callable", "a", PARAMS, use_tqdm="yes")
    assert llm.generate("a", PARAMS, use_tqdm=None)  # vLLM tests its truth: None is False

    class Plain:  # a bar of update and close only, which is all vLLM asks of one
        def __init__(self, **kwargs: Any) -> None:
            calls.append(kwargs)

        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    assert len(llm.generate(["a", "b"], PARAMS, use_tqdm=Plain)) == 2

    def broken(**kwargs: Any) -> tqdm:
        raise RuntimeError("no terminal")

    _refused(llm, RuntimeError, "no terminal", ["a", "b"], PARAMS, use_tqdm=broken)


def test_argument_types_are_named(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, needle in (
        ({"chat_template_kwargs": 5}, "chat_template_kwargs must be a dict, not int"),
        ({"mm_processor_kwargs": 5}, "mm_processor_kwargs must be a dict, not int"),
    ):
        with pytest.raises(TypeError, match=needle):
            llm.chat(messages, PARAMS, use_tqdm=False, **kwargs)
    for messages, needle in (
        ("hi", "messages must be a conversation .*, not str"),
        ([{"role": "user", "content": "hi"}, "hi"], "messages must be a conversation"),
        ([[{"role": "user", "content": "hi"}], "hi"], r"messages\[1\] must be a conversation"),
    ):
        with pytest.raises(TypeError, match=needle):
            llm.chat(messages, PARAMS, use_tqdm=False)  # type: ignore[arg-type]
    for kwargs, needle in (
        ({"priority": "0"}, "priority must be an int or a list of one per prompt, not str"),
        ({"priority": ["0"]}, r"priority\[0\] must be an int, not str"),
        ({"priority": [True]}, r"priority\[0\] must be an int, not bool"),
        ({"lora_request": "abc"}, "lora_request must be a LoRARequest .*, not str"),
        ({"lora_request": ["abc"]}, r"lora_request\[0\] must be a LoRARequest"),
        ({"sampling_params": "x"}, "sampling_params must be a SamplingParams .*, not str"),
    ):
        _refused(llm, TypeError, needle, "a", **{"sampling_params": PARAMS, **kwargs})
    _refused(llm, ValueError, "Got 2 LoRA requests for 1 prompts", "a", PARAMS,
             lora_request=[None, None])  # fmt: skip
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate([], {"max_tokens": 3}, use_tqdm=False)
    assert llm.generate(["a"], PARAMS, use_tqdm=False, priority=[np.int64(0)])  # numpy's ints


def _pixels(vl: LLM, image: Any) -> torch.Tensor:
    prompt = {"prompt": VL_PROMPT, "multi_modal_data": {"image": image}}
    (feature,) = vl.llm_engine.processor.input_preprocessor.preprocess(prompt).mm_features
    return feature.data["pixel_values"]


@pytest.mark.parametrize(
    "shape", [(1, 1, 3), (3, 3, 3), (3, 40, 3), (28, 56, 3), (28, 56, 1), (28, 56, 4)]
)
def test_image_arrays_are_hwc_ndarrays_or_chw_tensors(vl: LLM, shape: tuple[int, ...]) -> None:
    """Read as the same image as PIL's, whatever HF would guess from the shape (it takes a
    leading 1 or 3 as channels)."""
    hwc = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    pil = Image.fromarray(hwc[..., 0] if shape[2] == 1 else hwc).convert("RGB")  # RGBA: no alpha
    expected = _pixels(vl, pil)
    assert torch.equal(_pixels(vl, hwc), expected)
    assert torch.equal(_pixels(vl, torch.from_numpy(hwc).permute(2, 0, 1)), expected)
    if shape[0] not in (1, 3):  # a tensor is HWC only where it cannot be CHW
        assert torch.equal(_pixels(vl, torch.from_numpy(hwc)), expected)


def test_bad_image_arrays_name_the_item(vl: LLM) -> None:
    for image, needle in (
        (np.zeros((0, 56, 3), np.uint8), r"ndarray of shape \(0, 56, 3\); expected a non-empty"),
        (np.zeros((56, 56, 5), np.uint8), r"\(56, 56, 5\); expected an HWC ndarray or a CHW"),
        (torch.zeros(2, 8, 8), "Tensor of shape .*; expected an HWC ndarray or a CHW tensor"),
    ):
        prompt = {"prompt": VL_PROMPT, "multi_modal_data": {"image": [PIL_IMAGE, image]}}
        _refused(vl, ValueError, f"image process error: item 1 is a .*{needle}", prompt, PARAMS)


def test_audio_for_a_model_without_an_audio_encoder(vl: LLM) -> None:
    needle = r"audio process error: this model does not take audio input \(it takes: image, video"
    _refused(vl, ValueError, needle, {"prompt": "hi", "multi_modal_data": {"audio": TONE}}, PARAMS)
    content = [{"type": "audio_array", "audio_array": TONE}, {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError, match=rf"messages\[0\].content\[0\]: {needle}"):
        vl.chat([{"role": "user", "content": content}], PARAMS, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM, vl: LLM) -> None:
    """vLLM's SamplingParams.truncate_prompt_tokens: the last k tokens run, as if they were the
    whole prompt (-1: the last max_model_len); media cannot be cut."""
    ids = list(range(100, 140))
    cut = llm.generate({"prompt_token_ids": ids},
                       PARAMS.clone(truncate_prompt_tokens=8), use_tqdm=False)[0]  # fmt: skip
    alone = llm.generate({"prompt_token_ids": ids[-8:]}, PARAMS, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-8:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = llm.generate("a short prompt", PARAMS.clone(truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]  # fmt: skip
    assert text.prompt == "a short prompt"  # nothing to cut: as it was
    prompt = {"prompt": VL_PROMPT, "multi_modal_data": {"image": PIL_IMAGE}}
    _refused(vl, ValueError, "truncate_prompt_tokens cannot cut a prompt with media", prompt,
             PARAMS.clone(truncate_prompt_tokens=4))  # fmt: skip
