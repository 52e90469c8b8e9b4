"""Multimodal processing against the Hugging Face processors, on the tiny checkpoints.

Exactness: for a prompt with one placeholder per item, our token ids equal the full HF
processor's ``input_ids`` and the concatenation of our per-item tensors equals HF's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omniserve.config import ModelConfig
from omniserve.multimodal.cache import ProcessorCache
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.hasher import MultiModalHasher
from omniserve.multimodal.processing import (
    BaseMultiModalProcessor,
    MultiModalInputs,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
)
from omniserve.multimodal.prompt_update import apply_prompt_updates
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from omniserve.tokenizer import get_tokenizer

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN2_AUDIO = "Qwen2AudioForConditionalGeneration"

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"

VISION_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
    "audio": ("input_features", "feature_attention_mask"),
}


def _rng_image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _rng_video(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def _rng_audio(seed: int, num_samples: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(num_samples).astype(np.float32) * 0.1


@pytest.fixture(scope="module")
def make_processor(tiny_checkpoint: Callable[..., Path]) -> Callable[..., BaseMultiModalProcessor]:
    def make(arch: str, **kwargs: Any) -> BaseMultiModalProcessor:
        path = tiny_checkpoint(arch)
        config = ModelConfig.from_path(str(path))
        processor = MULTIMODAL_REGISTRY.create_processor(config, get_tokenizer(str(path)), **kwargs)
        assert processor is not None
        return processor

    return make


@pytest.fixture(scope="module")
def hf_processor(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Any]:
    from transformers import AutoProcessor

    loaded: dict[str, Any] = {}

    def load(arch: str) -> Any:
        if arch not in loaded:
            loaded[arch] = AutoProcessor.from_pretrained(
                tiny_checkpoint(arch), local_files_only=True
            )
        return loaded[arch]

    return load


def assert_matches_hf(ours: MultiModalInputs, ref: Any) -> None:
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    offsets = [f.mm_position.offset for f in ours.mm_features]
    assert offsets == sorted(offsets)
    checked = 0
    for modality, keys in VISION_KEYS.items():
        items = [f.data for f in ours.mm_features if f.modality == modality]
        for key in keys:
            if key in ref:
                assert torch.equal(torch.cat([item[key] for item in items]), ref[key]), key
                checked += 1
    assert checked >= 2
    # Every expanded placeholder sits exactly where the placeholder tokens are.
    for feature in ours.mm_features:
        pos = feature.mm_position
        span = ours.prompt_token_ids[pos.offset : pos.end]
        assert len(set(span)) == 1 and pos.is_embed is None


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL])
def test_one_and_two_images_match_hf(make_processor, hf_processor, arch: str) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    images = [_rng_image(0, 60, 90), _rng_image(1, 150, 40)]
    for count in (1, 2):
        text = f"<|im_start|>user\n{IMAGE * count}Describe.<|im_end|>\n<|im_start|>assistant\n"
        ours = processor.apply(text, {"image": images[0] if count == 1 else images})
        assert_matches_hf(ours, hf(text=[text], images=images[:count], return_tensors="pt"))
        assert len(ours.mm_features) == count
    lengths = [f.mm_position.length for f in ours.mm_features]
    assert lengths[0] != lengths[1]  # different sizes, different token counts
    assert ours.num_tokens_by_modality == {"image": sum(lengths)}


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL])
def test_video_and_image_match_hf(make_processor, hf_processor, arch: str) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    video, image = _rng_video(2, 5, 56, 84), _rng_image(3, 64, 64)
    text = f"{VIDEO}What happens, and {IMAGE}?"
    ours = processor.apply(text, {"video": video, "image": image})
    ref = hf(text=[text], images=[image], videos=[video], return_tensors="pt")
    assert_matches_hf(ours, ref)
    assert [f.modality for f in ours.mm_features] == ["video", "image"]
    if arch == QWEN2_5_VL:
        # bare frames: HF assumes 24 fps, so 2 frames per temporal patch is 1/12 s
        second = ours.mm_features[0].data["second_per_grid_ts"]
        assert second.shape == (1,) and second.item() == pytest.approx(2 / 24)


def test_qwen2_5_vl_video_item_fps_reaches_second_per_grid_ts(make_processor, hf_processor) -> None:
    processor, hf = make_processor(QWEN2_5_VL), hf_processor(QWEN2_5_VL)
    frames = _rng_video(4, 4, 56, 56)
    item = SimpleNamespace(frames=frames, fps=2.0)  # duck-typed media.VideoItem
    ours = processor.apply(f"{VIDEO}hi", {"video": item})
    metadata = {"total_num_frames": 4, "fps": 2.0, "frames_indices": [0, 1, 2, 3]}
    ref = hf(text=[f"{VIDEO}hi"], videos=[frames], video_metadata=[metadata], return_tensors="pt")
    assert_matches_hf(ours, ref)
    assert ours.mm_features[0].data["second_per_grid_ts"].item() == pytest.approx(1.0)
    bare = processor.apply(f"{VIDEO}hi", {"video": frames})
    assert bare.mm_features[0].identifier != ours.mm_features[0].identifier


def test_video_with_vllm_metadata_matches_hf(make_processor, hf_processor) -> None:
    """vLLM's ``(frames, metadata)``: the metadata reaches HF as given (a sample of a longer
    source is not sampled again); wrong metadata is refused by name."""
    processor, hf = make_processor(QWEN2_5_VL), hf_processor(QWEN2_5_VL)
    frames = _rng_video(8, 4, 56, 56)
    sample = {"total_num_frames": 16, "fps": 4.0, "duration": 4.0, "frames_indices": [0, 2, 4, 6],
              "video_backend": "opencv", "do_sample_frames": False}  # fmt: skip
    ours = processor.apply(f"{VIDEO}{VIDEO}hi", {"video": [(frames, sample), (frames, sample)]})
    metadata = {k: v for k, v in sample.items() if k != "do_sample_frames"}
    ref = hf(text=[f"{VIDEO}{VIDEO}hi"], videos=[frames, frames], do_sample_frames=False,
             video_metadata=[metadata, metadata], return_tensors="pt")  # fmt: skip
    assert_matches_hf(ours, ref)
    # HF's sampled fps: 4 of 16 frames at 4 fps is 1 fps, so a patch of 2 frames spans 2 s
    assert ours.mm_features[0].data["second_per_grid_ts"].item() == pytest.approx(2.0)
    whole = processor.apply(f"{VIDEO}hi", {"video": (frames, {"fps": 2.0})})
    item = SimpleNamespace(frames=frames, fps=2.0)  # the same as a decoded media.VideoItem
    assert whole.mm_features[0].identifier == processor.apply(
        f"{VIDEO}hi", {"video": item}).mm_features[0].identifier  # fmt: skip
    for bad, message in [
        ({"fps": 2.0, "rate": 3}, "item 0 has a metadata key 'rate'; the keys may be: total_num"),
        ({"fps": 0}, "metadata fps must be a positive number, got 0"),
        ({"total_num_frames": 4, "fps": 2.0, "duration": 9.0}, "duration 9.0 s is not"),
        ({**sample, "do_sample_frames": True}, "do_sample_frames true for a sample of its source"),
        ({"frames_indices": [0, 1]}, "4 frames but frame_indices [0, 1] of 4 source frames"),
        ({"width": 57}, "metadata width 57 for frames of 56"),
    ]:
        with pytest.raises(MultiModalInputError, match=re.escape(message)) as err:
            processor.apply(f"{VIDEO}hi", {"video": (frames, bad)})
        assert err.value.modality == "video"


def test_audio_one_and_two_clips_match_hf(make_processor, hf_processor) -> None:
    processor, hf = make_processor(QWEN2_AUDIO), hf_processor(QWEN2_AUDIO)
    clips = [_rng_audio(5, 16_000), _rng_audio(6, 37_000)]
    for count in (1, 2):
        text = "".join(f"Audio {i + 1}: {AUDIO}\n" for i in range(count)) + "What is it?"
        mm = [(clip, 16_000) for clip in clips[:count]]
        ours = processor.apply(text, {"audio": mm[0] if count == 1 else mm})
        assert_matches_hf(ours, hf(text=[text], audio=clips[:count], return_tensors="pt"))
    assert [f.mm_position.length for f in ours.mm_features] == [25, 58]
    # vLLM's waveform as a list of samples is the same clip; a list of other things is refused
    listed = processor.apply(f"{AUDIO}?", {"audio": (clips[0].tolist(), 16_000)})
    same = processor.apply(f"{AUDIO}?", {"audio": (clips[0], 16_000)})
    assert listed.mm_features[0].identifier == same.mm_features[0].identifier
    with pytest.raises(MultiModalInputError, match="item 0 is a tuple; expected a waveform of"):
        processor.apply(f"{AUDIO}?", {"audio": (["a", "b"], 16_000)})


@pytest.mark.slow
def test_audio_is_resampled_to_the_feature_extractor_rate(make_processor, hf_processor) -> None:
    import librosa

    processor, hf = make_processor(QWEN2_AUDIO), hf_processor(QWEN2_AUDIO)
    clip = _rng_audio(7, 8_000)
    ours = processor.apply(f"{AUDIO}?", {"audio": (clip, 8_000)})
    resampled = librosa.resample(clip, orig_sr=8_000, target_sr=16_000)
    assert_matches_hf(ours, hf(text=[f"{AUDIO}?"], audio=[resampled], return_tensors="pt"))
    with pytest.raises(MultiModalInputError, match="sampling rate") as err:
        processor.apply(f"{AUDIO}?", {"audio": clip})
    assert err.value.stage == "process" and err.value.modality == "audio"
    with pytest.raises(MultiModalInputError, match="item 1 has samples that are NaN") as err:
        processor.apply(f"{AUDIO}{AUDIO}?", {"audio": [(clip, 8_000), (clip * np.inf, 8_000)]})
    assert err.value.stage == "process" and err.value.modality == "audio"
    # 125 KB at 1 Hz claims 32,000 s: refused before resampling (to 2 GB), as a file would be
    with pytest.raises(MultiModalInputError, match="lasts 32000.0 s, over the limit of 600 s"):
        processor.apply(f"{AUDIO}?", {"audio": (np.zeros(32_000, np.float32), 1)})


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_AUDIO])
def test_token_id_prompt_equals_text_prompt(make_processor, arch: str) -> None:
    processor = make_processor(arch)
    if arch == QWEN2_AUDIO:
        text, mm = f"Audio 1: {AUDIO}\nhi", {"audio": (_rng_audio(8, 9_000), 16_000)}
    else:
        text, mm = (
            f"a {IMAGE} b {VIDEO}",
            {"image": _rng_image(9, 40, 70), "video": _rng_video(10, 2, 56, 56)},
        )
    from_text = processor.apply(text, mm)
    token_ids = processor.info.get_tokenizer().encode(text)
    from_ids = processor.apply(token_ids, mm)
    assert from_ids.prompt is None and from_text.prompt == text
    assert from_ids.prompt_token_ids == from_text.prompt_token_ids
    assert [(f.identifier, f.mm_position) for f in from_ids.mm_features] == [
        (f.identifier, f.mm_position) for f in from_text.mm_features
    ]


def test_multi_turn_conversation_with_images_matches_hf(make_processor, hf_processor) -> None:
    processor, hf = make_processor(QWEN2_VL), hf_processor(QWEN2_VL)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]},
    ]
    text = processor.info.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    images = [_rng_image(11, 84, 56), _rng_image(12, 30, 120)]
    ours = processor.apply(text, {"image": images})
    assert_matches_hf(ours, hf(text=[text], images=images, return_tensors="pt"))


def test_cache_returns_cold_tensors_and_counts(make_processor) -> None:
    cold = make_processor(QWEN2_VL).apply(
        f"{IMAGE}{IMAGE}{VIDEO}",
        {
            "image": [_rng_image(13, 56, 56), _rng_image(14, 70, 42)],
            "video": _rng_video(15, 2, 56, 56),
        },
    )
    processor = make_processor(QWEN2_VL, cache=ProcessorCache(1 << 30))
    mm = {
        "image": [_rng_image(13, 56, 56), _rng_image(14, 70, 42)],
        "video": _rng_video(15, 2, 56, 56),
    }
    first = processor.apply(f"{IMAGE}{IMAGE}{VIDEO}", mm)
    second = processor.apply(f"x{IMAGE}{IMAGE}{VIDEO}", mm)
    stats = processor.cache.stats()
    assert (stats.hits, stats.misses, stats.num_items) == (3, 3, 3)
    for run in (first, second):
        for ours, ref in zip(run.mm_features, cold.mm_features, strict=True):
            assert ours.identifier == ref.identifier
            assert ours.data.keys() == ref.data.keys()
            assert all(torch.equal(ours.data[k], ref.data[k]) for k in ref.data)
    # the same image twice in one prompt is processed once and shares its identifier
    twice = processor.apply(f"{IMAGE}{IMAGE}", {"image": [mm["image"][0], mm["image"][0]]})
    assert twice.mm_features[0].identifier == twice.mm_features[1].identifier
    assert processor.cache.stats().hits == 4


def test_cache_evicts_least_recently_used_by_bytes() -> None:
    def item(n: int) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(n, dtype=torch.float32)}  # 4n bytes

    cache = ProcessorCache(1000)
    cache.put("a", item(100))
    cache.put("b", item(100))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("c", item(60))  # 400 + 400 + 240 > 1000: evicts b
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.size_bytes == 640
    cache.put("huge", item(300))  # larger than the whole cache: not stored, nothing evicted
    assert "huge" not in cache and len(cache) == 2
    assert cache.get("b") is None
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (1, 1) and stats.hit_rate == 0.5
    assert ProcessorCache.from_gb(0) is None


def test_identifier_covers_kwargs_that_change_the_output(make_processor, hf_processor) -> None:
    processor, hf = make_processor(QWEN2_VL), hf_processor(QWEN2_VL)
    image = _rng_image(16, 224, 224)
    default = processor.apply(IMAGE, {"image": image})
    small = processor.apply(IMAGE, {"image": image}, {"max_pixels": 16 * 28 * 28})
    assert default.mm_features[0].identifier != small.mm_features[0].identifier
    assert small.mm_features[0].mm_position.length == 16 < default.mm_features[0].mm_position.length
    ref = hf(text=[IMAGE], images=[image], max_pixels=16 * 28 * 28, return_tensors="pt")
    assert_matches_hf(small, ref)
    # a video-only kwarg leaves the image's identity (and its cache entries) alone
    with_fps = processor.apply(IMAGE, {"image": image}, {"fps": 1.0})
    assert with_fps.mm_features[0].identifier == default.mm_features[0].identifier
    # global defaults (--mm-processor-kwargs, here in the `size` form) apply too
    size = {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}
    capped = make_processor(QWEN2_VL, mm_processor_kwargs={"size": size})
    capped_out = capped.apply(IMAGE, {"image": image})
    assert capped_out.prompt_token_ids == small.prompt_token_ids
    assert torch.equal(
        capped_out.mm_features[0].data["pixel_values"], small.mm_features[0].data["pixel_values"]
    )
    assert capped.info.get_max_image_tokens() < processor.info.get_max_image_tokens()


def test_hasher_is_content_based() -> None:
    image = _rng_image(17, 20, 30)
    copy = Image.fromarray(np.asarray(image).copy())
    changed = np.asarray(image).copy()
    changed[0, 0, 0] ^= 1
    h = MultiModalHasher.hash_item
    assert h("image", image, {}) == h("image", copy, {})
    assert h("image", image, {}) != h("image", Image.fromarray(changed), {})
    assert h("image", image, {}) != h("video", image, {})
    assert h("image", image, {"a": 1}) != h("image", image, {"a": 2})
    assert h("audio", np.zeros(4, np.float32), {}) != h("audio", np.zeros(4, np.float64), {})
    assert h("audio", [1, 2], {}) != h("audio", (1, 2), {})


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL, QWEN2_AUDIO])
def test_analytic_max_tokens_cover_worst_case_dummies(make_processor, arch: str) -> None:
    processor = make_processor(arch)
    counts = {m: 2 for m in processor.info.get_supported_mm_limits()}
    seq_len = 2048
    bound = processor.info.get_mm_max_tokens_per_item(seq_len, counts)
    dummy = processor.get_dummy_mm_inputs(seq_len, counts)
    assert len(dummy.mm_features) == sum(counts.values())
    for feature in dummy.mm_features:
        assert 0 < feature.mm_position.length <= bound[feature.modality]
    measured = {f.modality: f.mm_position.length for f in dummy.mm_features}
    assert measured == dict(bound)  # the dummies reach the bound: they are the worst case
    assert processor.cache is None or len(processor.cache) == 0


def test_max_image_tokens_bound_extreme_sizes(make_processor) -> None:
    info = make_processor(QWEN2_VL).info
    image_processor = info.get_hf_processor().image_processor
    bound = info.get_max_image_tokens()
    merge = image_processor.merge_size**2
    worst = 0
    for height in (1, 3, 14, 15, 27, 28, 29, 100, 224, 1000, 3000):
        for ratio in (1, 2, 7, 50, 199, 200):
            for h, w in ((height, height * ratio), (height * ratio, height)):
                worst = max(worst, image_processor.get_number_of_image_patches(h, w) // merge)
    assert worst <= bound
    assert worst == bound  # reached by a 200:1 strip at this checkpoint's small max_pixels


def test_placeholder_count_mismatch_names_both_counts(make_processor) -> None:
    processor = make_processor(QWEN2_VL)
    with pytest.raises(MultiModalInputError, match=r"has 1 .*<\|image_pad\|>.* but 2 image") as e:
        processor.apply(IMAGE, {"image": [_rng_image(18, 56, 56)] * 2})
    assert e.value.stage == "process" and e.value.modality == "image"
    with pytest.raises(MultiModalInputError, match="has 1 .* but 0 video"):
        processor.apply(f"{IMAGE}{VIDEO}", {"image": _rng_image(18, 56, 56)})


def test_limits_and_unsupported_modalities(make_processor) -> None:
    processor = make_processor(QWEN2_VL, limit_mm_per_prompt={"image": 1})
    with pytest.raises(MultiModalInputError, match="at most 1") as err:
        processor.apply(IMAGE * 2, {"image": [_rng_image(19, 56, 56)] * 2})
    assert err.value.modality == "image"
    with pytest.raises(MultiModalInputError, match="does not take audio") as err:
        processor.apply("hi", {"audio": (_rng_audio(0, 100), 16_000)})
    assert err.value.modality == "audio"
    with pytest.raises(MultiModalInputError, match="unknown modality 'images'"):
        processor.apply("hi", {"images": _rng_image(19, 56, 56)})
    with pytest.raises(MultiModalInputError, match="item 1 is a str") as err:
        processor.apply(IMAGE * 2, {"image": [_rng_image(19, 56, 56), "x"]})
    assert err.value.modality == "image" and err.value.stage == "process"
    # float pixels must be numbers, and a video needs a frame (both once silently accepted)
    with pytest.raises(MultiModalInputError, match="item 0 has pixels that are NaN") as err:
        processor.apply(IMAGE, {"image": np.full((56, 56, 3), np.nan, np.float32)})
    assert err.value.modality == "image"
    with pytest.raises(MultiModalInputError, match="item 0 has no frames") as err:
        processor.apply(VIDEO, {"video": np.zeros((0, 56, 56, 3), np.uint8)})
    assert err.value.modality == "video"


def test_registry_text_arch_has_no_processor(tiny_checkpoint) -> None:
    path = tiny_checkpoint("Qwen2ForCausalLM")
    config = ModelConfig.from_path(str(path))
    assert not MULTIMODAL_REGISTRY.supports_multimodal(config)
    assert MULTIMODAL_REGISTRY.create_processor(config, get_tokenizer(str(path))) is None


def test_registry_builds_each_models_processor(make_processor) -> None:
    from processors.qwen2_audio import Qwen2AudioMultiModalProcessor
    from processors.qwen2_vl import Qwen2VLMultiModalProcessor

    assert isinstance(make_processor(QWEN2_VL), Qwen2VLMultiModalProcessor)
    assert isinstance(make_processor(QWEN2_5_VL), Qwen2VLMultiModalProcessor)
    assert isinstance(make_processor(QWEN2_AUDIO), Qwen2AudioMultiModalProcessor)


def test_prompt_updates_insertion_and_embed_mask() -> None:
    tokens = [1, 7, 2, 8, 3, 7, 4]
    updates = [
        PromptReplacement(
            "image",
            [7],
            lambda i: PromptUpdateDetails.select_token_id([5, 9, 9, 5][: 2 + 2 * i], 9),
        ),
        PromptInsertion("audio", [8], [6, 6]),
    ]
    out, placed = apply_prompt_updates(
        tokens, updates, {"image": 2, "audio": 1}, lambda seq: list(seq)
    )
    assert out == [1, 5, 9, 2, 8, 6, 6, 3, 5, 9, 9, 5, 4]
    assert [(p.modality, p.item_idx, p.position.offset, p.position.length) for p in placed] == [
        ("image", 0, 1, 2),
        ("audio", 0, 5, 2),
        ("image", 1, 8, 4),
    ]
    assert placed[0].position.is_embed == [False, True]
    assert placed[1].position.is_embed is None
    assert placed[2].position.num_embeds == 2


def test_field_configs_cut_items_that_concatenate_back() -> None:
    from omniserve.multimodal.processing import MultiModalFieldConfig

    rows = torch.arange(12.0).reshape(6, 2)  # [sum of rows, 2]
    flat = MultiModalFieldConfig.flat_from_sizes("image", torch.tensor([1, 3, 2]))
    pieces = flat.split(rows, 3)
    assert [p.shape[0] for p in pieces] == [1, 3, 2] and torch.equal(torch.cat(pieces), rows)
    batched = MultiModalFieldConfig.batched("audio").split([[1, 2], [3, 4]], 2)
    assert [p.tolist() for p in batched] == [[[1, 2]], [[3, 4]]]
    shared = MultiModalFieldConfig.shared("video").split(torch.tensor(True), 2)
    assert len(shared) == 2 and all(bool(s) for s in shared)
    with pytest.raises(ValueError, match="3 pieces for 2 image items"):
        flat.split(rows, 2)
