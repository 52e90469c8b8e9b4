"""The omni thinkers through the whole engine vs transformers' ``generate`` (fp32): text only,
image, audio, video, video with its audio track, and all of them mixed in one request, batched
together, plain and with a chunked prefill that cuts through the media; then the same video
again hits the processor and encoder caches and still matches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers import Qwen2_5OmniThinkerForConditionalGeneration as HFQwen25Thinker
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as HFQwen3Thinker

from omniserve import LLM, SamplingParams
from omniserve.cpu.linear import WidenedLinear
from tests.hf_reference import ReferenceOutput, assert_matches_reference

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
FPS = 1.0
THINKERS = {
    "Qwen2_5OmniThinkerForConditionalGeneration": HFQwen25Thinker,
    "Qwen3OmniMoeThinkerForConditionalGeneration": HFQwen3Thinker,
}
# Item kinds per prompt: "image", "video", "audio", or "av" (a video with its audio track).
PROMPTS = [[], ["image"], ["audio"], ["video"], ["av"], ["image", "audio", "av"]]


def _media(kinds: list[str], seed: int) -> list[tuple[str, Any]]:
    rng = np.random.default_rng(seed)
    items = []
    for kind in kinds:
        if kind == "image":
            items.append((kind, rng.integers(0, 256, (112, 168, 3), dtype=np.uint8)))
        elif kind == "audio":
            items.append((kind, rng.standard_normal(16000 * 2).astype(np.float32)))
        else:
            frames = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
            track = rng.standard_normal(16000 * 3).astype(np.float32) if kind == "av" else None
            items.append((kind, (frames, track)))
    return items


def _text(processor: Any, kinds: list[str]) -> str:
    tok = processor.tokenizer
    markers = {
        "image": f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}",
        "video": f"{tok.vision_bos_token}{tok.video_token}{tok.vision_eos_token}",
        "audio": f"{tok.audio_bos_token}{tok.audio_token}{tok.audio_eos_token}",
    }
    body = " and ".join(markers["video" if k == "av" else k] for k in kinds) or "Hello there"
    return f"<|im_start|>user\n{body} say<|im_end|>\n<|im_start|>assistant\n"


def _hf_inputs(processor: Any, text: str, items: list[tuple[str, Any]]) -> dict[str, Any]:
    images = [v for k, v in items if k == "image"]
    videos = [v[0] for k, v in items if k in ("video", "av")]
    audio, slots = [], []
    for kind, value in items:
        if kind == "audio":
            audio.append(value)
            slots.append(None)
        elif kind == "av":
            audio.append(value[1])
            slots.append(
                sum(1 for k, _ in items[: items.index((kind, value)) + 1] if k in ("video", "av"))
                - 1
            )
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
        kwargs["videos_kwargs"] = {"fps": FPS}
    if audio:
        kwargs["audio"] = audio
    if any(k == "av" for k, _ in items):
        kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
    inputs = dict(processor(text=[text], return_tensors="pt", **kwargs))
    inputs["use_audio_in_video"] = any(k == "av" for k, _ in items)
    return inputs


def _engine_prompt(text: str, items: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, list[Any]] = {}
    for kind, value in items:
        if kind == "image":
            data.setdefault("image", []).append(value)
        elif kind == "audio":
            data.setdefault("audio", []).append((value, 16000))
        elif kind == "video":
            data.setdefault("video", []).append(value[0])
        else:
            data.setdefault("video", []).append((value[0], (value[1], 16000)))
    prompt: dict[str, Any] = {
        "prompt": text,
        "multi_modal_data": data,
        "mm_processor_kwargs": {"fps": FPS},
    }
    if any(k == "av" for k, _ in items):
        prompt["mm_processor_kwargs"]["use_audio_in_video"] = True
    return prompt


def _reference(
    arch: str, model_dir: str, kinds_of_prompts: list[list[str]]
) -> tuple[list[dict[str, Any]], list[ReferenceOutput]]:
    """The engine's prompts and transformers' fp32 greedy run of them."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = THINKERS[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, reference = [], []
    with torch.inference_mode():
        for seed, kinds in enumerate(kinds_of_prompts):
            items, text = _media(kinds, seed), _text(processor, kinds)
            inputs = _hf_inputs(processor, text, items)
            out = model.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            logprobs = [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
            reference.append(ReferenceOutput(generated, logprobs[: len(generated)]))
            prompts.append(_engine_prompt(text, items))
    return prompts, reference


@pytest.fixture(scope="module", params=list(THINKERS))
def omni_case(request, tiny_checkpoint):
    model_dir = str(tiny_checkpoint(request.param))
    return model_dir, *_reference(request.param, model_dir, PROMPTS)


@pytest.mark.parametrize("shape", ["plain", "chunked"])
@pytest.mark.slow
def test_thinker_matches_hf(omni_case, shape):
    model_dir, prompts, reference = omni_case
    # Plain runs without prefix caching so that the repeat below must reuse encoder outputs
    # (with it, the identical prompt would be served from cached KV and encode nothing).
    kwargs = (
        {"max_num_batched_tokens": 16, "max_num_seqs": 3}
        if shape == "chunked"
        else {"enable_prefix_caching": False}
    )
    llm = LLM(model_dir, dtype="float32", **kwargs)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # Media prompts here run to ~700 tokens through deliberately sharp random weights; batching
    # and chunking reorder fp32 sums (MoE expert groups, attention), which moves logprobs by
    # ~1e-4. Greedy tokens must still be identical.
    assert_matches_reference(outputs, reference, atol=5e-4)
    if shape == "plain":
        # The mixed prompt again: its items come from the processor and encoder caches.
        before = llm.llm_engine.engine_core.call_utility("get_stats")
        again = llm.generate(prompts[-1:], GREEDY, use_tqdm=False)
        after = llm.llm_engine.engine_core.call_utility("get_stats")
        assert_matches_reference(again, reference[-1:], atol=5e-4)
        assert after["encoder_cache_hits"] > before["encoder_cache_hits"]
        cache = llm.llm_engine.processor.mm_processor.cache
        assert cache.stats().hits >= 3  # image, audio and the video with its track


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(THINKERS))
def test_bf16_checkpoint_thinker_in_fp32_matches_hf(arch, bf16_checkpoint):
    """A bf16 omni checkpoint computed in fp32 keeps its decoder's linear, expert and embedding
    weights bf16 (widened in the kernels: ``cpu.backend.keep_bf16_weights``) while its towers
    widen at load: transformers' fp32 answers on the same checkpoint, media prompts chunked."""
    model_dir = bf16_checkpoint(arch)
    prompts, reference = _reference(arch, model_dir, [["image"], ["audio"], ["av"]])
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3)
    assert_matches_reference(llm.generate(prompts, GREEDY, use_tqdm=False), reference, atol=5e-4)
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    if WidenedLinear.available():
        assert "linear: C bf16 weights, fp32 activations" in info["layer_kernels"]
