"""Precomputed embeddings (``--enable-mm-embeds``): an image's vision-tower output (with its
``image_grid_thw``; Qwen3-VL's with its DeepStack levels) or an audio clip's encoder output
stands for the item — the same greedy
tokens as sending the media — offline and over the API; bad shapes, NaNs, a wrong grid, a model
that cannot take them, and a server without the flag are clear errors naming the item."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.multimodal.errors import MultiModalInputError
from tests.server_utils import MODEL, assert_error, launch_server
from tests.test_api_multimodal import IMAGE

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VL_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
AUDIO_PROMPT = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?"
TONE = (np.sin(np.linspace(0, 400 * np.pi, 16000)).astype(np.float32), 16000)


def _llm(path: Any, **kwargs: Any) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        return LLM(str(path), dtype="float32", max_model_len=512, kv_cache_memory="16MiB", **kwargs)


def _encoder_output(llm: LLM, prompt: dict[str, Any], modality: str) -> dict[str, Any]:
    """What the model's own encoder makes of the prompt's item, and the fields beside it."""
    processed = llm.llm_engine.processor.input_preprocessor.preprocess(prompt)
    (feature,) = processed.mm_features
    model = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model
    with torch.no_grad():
        (output,) = model.get_multimodal_embeddings(modality, [feature.data])
    return {key: value for key, value in feature.data.items() if key.endswith("_grid_thw")} | {
        f"{modality}_embeds": output
    }


@pytest.fixture(scope="module")
def vl(tiny_checkpoint: Any) -> Any:
    llm = _llm(tiny_checkpoint("Qwen2VLForConditionalGeneration"), enable_mm_embeds=True)
    yield llm
    llm.llm_engine.shutdown()


def _same_answer(llm: LLM, prompt: str, modality: str, item: Any) -> None:
    media = {"prompt": prompt, "multi_modal_data": {modality: item}}
    direct = llm.generate(media, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    embeds = _encoder_output(llm, media, modality)
    given = (
        llm.generate(
            {"prompt": prompt, "multi_modal_data": {modality: embeds}}, GREEDY, use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert given == direct


def test_image_embeds_answer_as_the_image(vl: LLM, tiny_checkpoint: Any) -> None:
    _same_answer(vl, VL_PROMPT, "image", IMAGE)
    omni = _llm(
        tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"), enable_mm_embeds=True
    )
    _same_answer(omni, "<|vision_bos|><|IMAGE|><|vision_eos|>What is it?", "image", IMAGE)
    omni.llm_engine.shutdown()


def test_qwen3_image_embeds_carry_their_deepstack_levels(tiny_checkpoint: Any) -> None:
    """Qwen3-VL's and Qwen3-Omni's tower output (each row: the main embedding, then its
    DeepStack levels) stands for the image; embeddings as wide as the hidden size alone, or a
    video's, are refused."""
    omni = _llm(
        tiny_checkpoint("Qwen3OmniMoeThinkerForConditionalGeneration"), enable_mm_embeds=True
    )
    _same_answer(omni, VL_PROMPT, "image", IMAGE)
    omni.llm_engine.shutdown()
    llm = _llm(tiny_checkpoint("Qwen3VLForConditionalGeneration"), enable_mm_embeds=True)
    _same_answer(llm, VL_PROMPT, "image", IMAGE)
    good = _encoder_output(
        llm, {"prompt": VL_PROMPT, "multi_modal_data": {"image": IMAGE}}, "image"
    )
    rows, width = good["image_embeds"].shape
    hidden = llm.llm_engine.processor.model_config.hf_config.get_text_config().hidden_size
    assert width == 4 * hidden  # three DeepStack levels
    for modality, item, needle in (
        ("image", {**good, "image_embeds": good["image_embeds"][:, :hidden]},
         rf"\[num_embeds, {width}\] tensor \(the hidden size x \(1 \+ 3 DeepStack levels\)\)"),
        ("video", {"video_embeds": good["image_embeds"]}, "video process error: item 0 is a dict"),
    ):  # fmt: skip
        prompt = VL_PROMPT.replace("image", modality)
        with pytest.raises(MultiModalInputError, match=needle):
            llm.generate({"prompt": prompt, "multi_modal_data": {modality: item}}, GREEDY,
                         use_tqdm=False)  # fmt: skip
    llm.llm_engine.shutdown()


def test_audio_embeds_answer_as_the_clip(tiny_checkpoint: Any) -> None:
    llm = _llm(tiny_checkpoint("Qwen2AudioForConditionalGeneration"), enable_mm_embeds=True)
    _same_answer(llm, AUDIO_PROMPT, "audio", TONE)
    llm.llm_engine.shutdown()


def test_bad_embeds_are_errors_naming_the_item(vl: LLM, tiny_checkpoint: Any) -> None:
    good = _encoder_output(vl, {"prompt": VL_PROMPT, "multi_modal_data": {"image": IMAGE}}, "image")
    rows, hidden = good["image_embeds"].shape
    for change, needle in (
        ({"image_embeds": torch.zeros(rows, hidden + 1)}, rf"\[num_embeds, {hidden}\]"),
        ({"image_embeds": torch.zeros(rows, hidden, dtype=torch.int64)}, "floating-point"),
        ({"image_embeds": torch.full((rows, hidden), float("nan"))}, "NaN"),
        ({"image_grid_thw": None}, "need image_grid_thw"),
        ({"image_grid_thw": torch.tensor([[1, 2, 2]])}, f"{rows} rows, but image_grid_thw"),
    ):
        item = {key: value for key, value in {**good, **change}.items() if value is not None}
        with pytest.raises(MultiModalInputError, match=needle):
            vl.generate(
                {"prompt": VL_PROMPT, "multi_modal_data": {"image": item}}, GREEDY, use_tqdm=False
            )
    plain = _llm(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    with pytest.raises(MultiModalInputError, match="--enable-mm-embeds"):
        plain.generate(
            {"prompt": VL_PROMPT, "multi_modal_data": {"image": good}}, GREEDY, use_tqdm=False
        )
    # A chat part is refused before its payload is decoded (here it is no tensor at all).
    part = {"type": "image_embeds", "image_embeds": "not base64"}
    with pytest.raises(MultiModalInputError, match=r"content\[0\].*--enable-mm-embeds"):
        plain.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)
    plain.llm_engine.shutdown()


def _b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.slow
def test_embeds_parts_over_the_api(
    vl: LLM, tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    embeds = _encoder_output(
        vl, {"prompt": VL_PROMPT, "multi_modal_data": {"image": IMAGE}}, "image"
    )
    part = {
        "type": "image_embeds",
        "image_embeds": {name: _b64(value) for name, value in embeds.items()},
    }
    with launch_server(
        tiny_checkpoint("Qwen2VLForConditionalGeneration"),
        tmp_path_factory.mktemp("embeds"),
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "16MiB",
        "--dtype",
        "float32",
        "--enable-mm-embeds",
    ) as server:

        def ask(content: list[dict[str, Any]]) -> Any:
            return server.post(
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "max_tokens": 4,
                    "temperature": 0.0,
                    "messages": [{"role": "user", "content": content}],
                },
            )

        answer = ask([part, {"type": "text", "text": "What is it?"}])
        assert answer.status_code == 200, answer.text
        assert (
            answer.json()["usage"]["prompt_tokens_details"]["image_tokens"]
            == embeds["image_embeds"].shape[0]
        )
        error = assert_error(
            ask([{"type": "image_embeds", "image_embeds": "bm90IGEgdGVuc29y"}]), 400
        )
        assert "messages[0].content[0]" in error["message"] and "torch.save" in error["message"]
