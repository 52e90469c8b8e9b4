"""Multimodal models vs transformers on the same tiny checkpoints: greedy tokens identical and
logprobs close (fp32), for images, two images, video, multi-turn with an image, and audio.

Every case of a model runs in one batch, under three engine shapes: plain; chunked prefill with a
tiny token budget that cuts through placeholder ranges; and a tiny encoder cache/budget that
forces eviction and re-encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen2AudioForConditionalGeneration,
)

from omniserve import LLM, SamplingParams
from omniserve.plugin_tools.reference import hf_processor_text
from tests.hf_reference import ReferenceOutput, assert_matches_reference

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)


@dataclass
class Case:
    name: str
    messages: list[dict[str, Any]]
    media: dict[str, list[Any]]


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _video(seed: int, frames: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, 64, 96, 3), dtype=np.uint8)  # [T, H, W, 3]


def _tone(freq: float, seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(int(freq)).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(2 * np.pi * freq * t) + noise).astype(np.float32)


def _user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


TEXT = {"type": "text", "text": "What is shown here?"}
IMAGE, VIDEO, AUDIO = {"type": "image"}, {"type": "video"}, {"type": "audio"}

VL_CASES = [
    Case("image", [_user(IMAGE, TEXT)], {"image": [_image(1, 112, 140)]}),
    Case(
        "two images",
        [_user(IMAGE, IMAGE, TEXT)],
        {"image": [_image(2, 56, 56), _image(3, 200, 120)]},
    ),
    Case("video", [_user(VIDEO, TEXT)], {"video": [_video(4)]}),
    Case(
        "multi-turn",
        [
            _user(IMAGE, TEXT),
            {"role": "assistant", "content": [{"type": "text", "text": "A pattern."}]},
            _user({"type": "text", "text": "Which colours dominate it?"}),
        ],
        {"image": [_image(5, 84, 84)]},
    ),
]
AUDIO_CASES = [
    Case("audio", [_user(AUDIO, TEXT)], {"audio": [_tone(440, 1.0)]}),
    Case("two audios", [_user(AUDIO, AUDIO, TEXT)], {"audio": [_tone(220, 0.6), _tone(880, 1.7)]}),
]
MODELS = {
    "Qwen2VLForConditionalGeneration": (AutoModelForImageTextToText, VL_CASES),
    "Qwen2_5_VLForConditionalGeneration": (AutoModelForImageTextToText, VL_CASES),
    "Qwen3VLForConditionalGeneration": (AutoModelForImageTextToText, VL_CASES),
    "Qwen3VLMoeForConditionalGeneration": (AutoModelForImageTextToText, VL_CASES),
    "Qwen2AudioForConditionalGeneration": (Qwen2AudioForConditionalGeneration, AUDIO_CASES),
}


def _hf_inputs(processor: Any, text: str, media: dict[str, list[Any]]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if "image" in media:
        kwargs["images"] = media["image"]
    if "video" in media:
        kwargs["videos"] = media["video"]
    if "audio" in media:
        kwargs["audio"] = media["audio"]
        kwargs["sampling_rate"] = 16000
    return processor(text=[hf_processor_text(processor, text)], return_tensors="pt", **kwargs)


def _hf_reference(
    model_cls: Any, model_dir: str, prompts: list[str], cases: list[Case]
) -> list[ReferenceOutput]:
    processor = AutoProcessor.from_pretrained(model_dir)
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for text, case in zip(prompts, cases, strict=True):
            inputs = _hf_inputs(processor, text, case.media)
            out = model.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            logprobs = [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
            results.append(ReferenceOutput(generated, logprobs[: len(generated)]))
    return results


def _engine_prompt(text: str, media: dict[str, list[Any]]) -> dict[str, Any]:
    data = {m: [(a, 16000) for a in items] if m == "audio" else items for m, items in media.items()}
    return {"prompt": text, "multi_modal_data": data}


@pytest.fixture(scope="module", params=list(MODELS))
def mm_case(request, tiny_checkpoint):
    arch = request.param
    model_cls, cases = MODELS[arch]
    model_dir = str(tiny_checkpoint(arch))
    processor = AutoProcessor.from_pretrained(model_dir)
    prompts = [
        processor.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False)
        for c in cases
    ]
    reference = _hf_reference(model_cls, model_dir, prompts, cases)
    engine_prompts = [_engine_prompt(p, c.media) for p, c in zip(prompts, cases, strict=True)]
    return model_dir, engine_prompts, reference


ENGINE_SHAPES = {
    "plain": {},
    # An 8-token budget cuts every placeholder range across several steps.
    "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    # Room for about one large item: the two-item prompts evict and the batch re-encodes.
    "tiny encoder cache": {
        "max_num_encoder_input_tokens": 48,
        "encoder_cache_size": 48,
        "max_num_batched_tokens": 32,
        "enable_prefix_caching": False,
    },
}


@pytest.mark.parametrize("shape", list(ENGINE_SHAPES))
@pytest.mark.slow
def test_matches_hf(mm_case, shape):
    model_dir, prompts, reference = mm_case
    llm = LLM(model_dir, dtype="float32", **ENGINE_SHAPES[shape])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # The CPU backend's products (the decoder's and the towers', the patch embedding's as one
    # product where transformers convolves) add fp32 sums in other orders, which moves these
    # logprobs by ~1e-4 (as the omni thinkers' media prompts). Greedy tokens stay identical.
    assert_matches_reference(outputs, reference, atol=2e-4)
    assert all(sum(o.num_mm_tokens.values()) > 0 for o in outputs)
    if shape == "tiny encoder cache":
        stats = llm.llm_engine.engine_core.call_utility("get_stats")
        assert stats["encoder_cache_queries"] > 0


@pytest.mark.slow
def test_different_images_never_share_prefix_blocks(tiny_checkpoint):
    """Same text, same image size, different pixels: identical placeholder tokens, so only the
    item hashes in the block keys keep the second request from reusing the first one's KV."""
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    text = processor.apply_chat_template(
        [_user(IMAGE, TEXT)], add_generation_prompt=True, tokenize=False
    )
    first, second = _image(10, 112, 112), _image(11, 112, 112)
    llm = LLM(model_dir, dtype="float32", block_size=4)
    llm.generate(_engine_prompt(text, {"image": [first]}), GREEDY, use_tqdm=False)
    again = llm.generate(_engine_prompt(text, {"image": [first]}), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_engine_prompt(text, {"image": [second]}), GREEDY, use_tqdm=False)[0]
    image_start = again.prompt_token_ids.index(
        processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    )
    assert again.num_cached_tokens > image_start  # the same image is a prefix hit
    assert other.num_cached_tokens <= image_start  # a different one is not
    reference = _hf_reference(
        AutoModelForImageTextToText, model_dir, [text], [Case("second", [], {"image": [second]})]
    )
    assert_matches_reference([other], reference)
