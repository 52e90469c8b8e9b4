"""Qwen2.5-Omni and Qwen3-Omni-MoE processing against the Hugging Face processors.

Exactness: our token ids equal HF's ``input_ids`` and the concatenation of our per-item tensors
equals HF's tensors. HF's Qwen3-Omni pads a batch of clips to the longest one, which changes the
last frame of a shorter clip (HF itself is batch-dependent there); we featurize each clip alone,
so such a clip equals HF on its own and HF's batch on every frame but its last.
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

from omniserve.config import ModelConfig
from omniserve.engine.arg_utils import EngineArgs
from omniserve.multimodal.cache import ProcessorCache
from omniserve.multimodal.context import InputProcessingContext
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media_io import VideoItem
from omniserve.multimodal.processing import BaseMultiModalProcessor, MultiModalInputs
from omniserve.tokenizer import get_tokenizer
from processors import qwen2_5_omni_thinker as qwen2_5
from processors import qwen3_omni_moe_thinker as qwen3
from processors.qwen2_5_omni_audio import get_feat_extract_output_lengths as qwen2_5_lengths
from processors.qwen3_omni_audio import get_feat_extract_output_lengths as qwen3_lengths

QWEN2_5 = "Qwen2_5OmniThinkerForConditionalGeneration"
QWEN3 = "Qwen3OmniMoeThinkerForConditionalGeneration"
ARCHS = [QWEN2_5, QWEN3]
CLASSES = {
    QWEN2_5: (
        qwen2_5.Qwen2_5OmniThinkerProcessingInfo,
        qwen2_5.Qwen2_5OmniThinkerDummyInputsBuilder,
        qwen2_5.Qwen2_5OmniThinkerMultiModalProcessor,
    ),
    QWEN3: (
        qwen3.Qwen3OmniMoeThinkerProcessingInfo,
        qwen3.Qwen3OmniMoeThinkerDummyInputsBuilder,
        qwen3.Qwen3OmniMoeThinkerMultiModalProcessor,
    ),
}
AUDIO_IN_VIDEO = {"use_audio_in_video": True}
HOP = 160  # samples per mel frame at 16 kHz


def _image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _video(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 56, 84, 3), dtype=np.uint8)


def _audio(seed: int, num_samples: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(num_samples).astype(np.float32) * 0.1


@pytest.fixture(scope="module")
def make_processor(tiny_checkpoint: Callable[..., Path]) -> Callable[..., BaseMultiModalProcessor]:
    def make(arch: str, cache: ProcessorCache | None = None, **ctx_kwargs: Any) -> Any:
        path = str(tiny_checkpoint(arch))
        ctx = InputProcessingContext(ModelConfig.from_path(path), get_tokenizer(path), **ctx_kwargs)
        info_cls, dummy_cls, processor_cls = CLASSES[arch]
        info = info_cls(ctx)
        return processor_cls(info, dummy_cls(info), cache=cache)

    return make


@pytest.fixture(scope="module")
def hf_processor(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Any]:
    from transformers import AutoProcessor

    loaded: dict[str, Any] = {}

    def load(arch: str) -> Any:
        if arch not in loaded:
            loaded[arch] = AutoProcessor.from_pretrained(tiny_checkpoint(arch))
        return loaded[arch]

    return load


def _markers(hf: Any) -> dict[str, str]:
    return {
        "image": f"{hf.vision_bos_token}{hf.image_token}{hf.vision_eos_token}",
        "video": f"{hf.vision_bos_token}{hf.video_token}{hf.vision_eos_token}",
        "audio": f"{hf.audio_bos_token}{hf.audio_token}{hf.audio_eos_token}",
    }


def _prompt(hf: Any, kinds: list[str]) -> str:
    """A chat turn with one placeholder per item kind ("av" is a video with its audio)."""
    markers = _markers(hf)
    body = " and ".join(markers["video" if kind == "av" else kind] for kind in kinds)
    return f"<|im_start|>user\n{body}?<|im_end|>\n<|im_start|>assistant\n"


def _call_hf(hf: Any, text: str, images=(), videos=(), audio=(), slots=None, **kwargs) -> Any:
    media: dict[str, Any] = {"images": list(images) or None, "videos": list(videos) or None}
    media["audio"] = list(audio) or None
    if slots is not None:
        kwargs.update(audio_from_video_indices=slots, load_audio_from_video=True)
    return hf(text=[text], **media, return_tensors="pt", **kwargs)


def _assert_audio_matches(arch: str, clips: list[dict[str, torch.Tensor]], ref: Any) -> None:
    """Our clips (HF's audio-slot order) against HF's batched ``input_features``."""
    if arch == QWEN2_5:  # HF pads every clip to the window; ours are its valid frames alone
        for clip, features, mask in zip(clips, ref["input_features"], ref["feature_attention_mask"],
                                        strict=True):  # fmt: skip
            length = int(mask.sum())
            assert bool(mask[:length].all()) and clip["feature_attention_mask"].shape == (1, length)
            assert clip["feature_attention_mask"].dtype == mask.dtype
            assert bool(clip["feature_attention_mask"].all())
            assert torch.equal(clip["input_features"][0], features[:, :length])
        return
    lengths = ref["feature_attention_mask"].sum(-1).tolist()
    for clip, features, length in zip(clips, ref["input_features"], lengths, strict=True):
        assert clip["input_features"].shape == (1, features.shape[0], length)
        assert clip["feature_attention_mask"].shape == (1, length)
        assert bool(clip["feature_attention_mask"].all())
        same = length if length == max(lengths) else length - 1  # see the module docstring
        assert torch.equal(clip["input_features"][0, :, :same], features[:, :same])


def assert_matches_hf(arch: str, ours: MultiModalInputs, ref: Any) -> None:
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    offsets = [f.mm_position.offset for f in ours.mm_features]
    assert offsets == sorted(offsets)
    for modality, keys in (
        ("image", ("pixel_values", "image_grid_thw")),
        ("video", ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")),
    ):
        items = [f.data for f in ours.mm_features if f.modality == modality]
        for key in keys:
            assert (key in ref) == bool(items), key
            if items:
                assert torch.equal(torch.cat([item[key] for item in items]), ref[key]), key
    clips = [f.data for f in ours.mm_features if "input_features" in f.data]
    assert ("input_features" in ref) == bool(clips)
    if clips:
        _assert_audio_matches(arch, clips, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_and_two_images_match_hf(make_processor, hf_processor, arch: str) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    images = [_image(0, 60, 90), _image(1, 150, 40)]
    for count in (1, 2):
        text = _prompt(hf, ["image"] * count)
        ours = processor.apply(text, {"image": images[0] if count == 1 else images[:count]})
        assert_matches_hf(arch, ours, _call_hf(hf, text, images=images[:count]))
    assert [f.mm_position.length for f in ours.mm_features] == [
        int(grid.prod()) // 4 for grid in (f.data["image_grid_thw"] for f in ours.mm_features)
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_video_matches_hf_and_uses_its_frame_rate(make_processor, hf_processor, arch) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    frames, text = _video(2, 6), _prompt(hf, ["video"])
    bare = processor.apply(text, {"video": frames})
    assert_matches_hf(arch, bare, _call_hf(hf, text, videos=[frames]))
    default_fps = 2.0 if arch == QWEN2_5 else 1.0  # HF's default for video_second_per_grid
    assert bare.mm_features[0].data["video_second_per_grid"].item() == 2 / default_fps
    # A decoded video knows its frame rate: the same as HF told that fps.
    decoded = processor.apply(text, {"video": SimpleNamespace(frames=frames, fps=4.0, audio=None)})
    assert_matches_hf(arch, decoded, _call_hf(hf, text, videos=[frames], fps=4.0))
    assert decoded.mm_features[0].data["video_second_per_grid"].item() == 0.5
    # The frames' own rate beats the kwarg (which, for the chat API, asked the decoder for a
    # rate the frame cap may have lowered); bare frames take the kwarg, as in HF.
    item = SimpleNamespace(frames=frames, fps=4.0, audio=None)
    overridden = processor.apply(text, {"video": item}, {"fps": 2.0}).mm_features[0].data
    assert overridden["video_second_per_grid"].item() == 0.5
    with_kwarg = processor.apply(text, {"video": frames}, {"fps": 0.5})
    assert_matches_hf(arch, with_kwarg, _call_hf(hf, text, videos=[frames], fps=0.5))
    assert decoded.mm_features[0].identifier != bare.mm_features[0].identifier


@pytest.mark.parametrize("arch", ARCHS)
def test_one_and_two_audio_clips_match_hf(make_processor, hf_processor, arch: str) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    clips = [_audio(3, 16_000 + 7 * HOP), _audio(4, 37_000 // HOP * HOP)]
    for count in (1, 2):
        text = _prompt(hf, ["audio"] * count)
        mm = [(clip, 16_000) for clip in clips[:count]]
        ours = processor.apply(text, {"audio": mm[0] if count == 1 else mm})
        assert_matches_hf(arch, ours, _call_hf(hf, text, audio=clips[:count]))
    alone = processor.apply(_prompt(hf, ["audio"]), {"audio": (clips[0], 16_000)})
    for key, value in alone.mm_features[0].data.items():  # independent of the other clips
        assert torch.equal(ours.mm_features[0].data[key], value), key
    expected = [27, 58] if arch == QWEN2_5 else [14, 30]
    assert [f.mm_position.length for f in ours.mm_features] == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_audio_lengths_match_hf_from_0_1_to_60_s(make_processor, hf_processor, arch) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    text = _prompt(hf, ["audio"])
    lengths = qwen2_5_lengths if arch == QWEN2_5 else qwen3_lengths
    for seconds in (0.1, 0.37, 1.0, 2.345, 7.77, 29.99, 30.0, 30.01, 45.5, 60.0):
        clip = np.zeros(round(seconds * 16_000), np.float32)
        ref = _call_hf(hf, text, audio=[clip])
        hf_count = int((ref["input_ids"] == hf.audio_token_id).sum())
        ours = processor.apply(text, {"audio": (clip, 16_000)}).mm_features[0]
        frames = int(ours.data["feature_attention_mask"].sum())
        assert ours.mm_position.length == hf_count == int(lengths(frames)), seconds
    # Qwen2.5-Omni truncates at 30 s, Qwen3-Omni keeps every window (13 tokens per second).
    assert hf_count == (750 if arch == QWEN2_5 else 780)


def test_qwen2_5_clips_keep_the_padded_calls_frames_bit_for_bit(make_processor,
                                                               hf_processor) -> None:  # fmt: skip
    """Qwen2.5-Omni featurizes a clip without the window's padding: from a clip of a few
    frames (padded to a second) to one just under the window, and one truncated by it, the
    frames are HF's padded call's, with its mask's count."""
    processor, hf = make_processor(QWEN2_5), hf_processor(QWEN2_5)
    text = _prompt(hf, ["audio"])
    window = hf.feature_extractor.n_samples
    for i, size in enumerate((401, 1234, 8013, 16_000, 7 * 16_000 + 99, window - 10, window + 999)):
        clip = _audio(10 + i, size)
        ours = processor.apply(text, {"audio": (clip, 16_000)})
        assert_matches_hf(QWEN2_5, ours, _call_hf(hf, text, audio=[clip]))


@pytest.mark.parametrize("arch", ARCHS)
def test_audio_shorter_than_one_token_is_rejected(make_processor, hf_processor, arch) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    too_short = 2 * HOP if arch == QWEN2_5 else 200  # 2 frames; an STFT window's half
    with pytest.raises(MultiModalInputError, match="too short") as err:
        processor.apply(_prompt(hf, ["audio"]), {"audio": (np.ones(too_short, np.float32), 16_000)})
    assert (err.value.stage, err.value.modality) == ("process", "audio")
    shortest = processor.apply(
        _prompt(hf, ["audio"]), {"audio": (np.ones(too_short + 1, np.float32), 16_000)}
    )
    assert shortest.mm_features[0].mm_position.length == 1
    track = (np.ones(too_short, np.float32), 16_000)
    with pytest.raises(MultiModalInputError, match="audio track of video item 0 is too short"):
        processor.apply(_prompt(hf, ["video"]), {"video": (_video(5, 4), track)}, AUDIO_IN_VIDEO)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_files_sample_is_timed_at_its_own_rate(make_processor, hf_processor, arch) -> None:
    """8 frames sampled from a 6 s file (60 frames at 10 fps) with its audio: the video's
    temporal patches span 2 / (8 / 6) = 1.5 s, and its tokens interleave with the track's as
    transformers lays them out when called with that rate."""
    import librosa

    processor, hf = make_processor(arch), hf_processor(arch)
    frames, track = _video(8, 8), _audio(9, 8_000 * 6)
    indices = [0, 8, 17, 25, 34, 42, 51, 59]
    item = VideoItem(
        frames, fps=8 / 6, source_fps=10.0, frame_indices=indices, audio=(track, 8_000),
        num_source_frames=60,
    )  # fmt: skip
    text = _prompt(hf, ["av"])
    ours = processor.apply(text, {"video": item}, AUDIO_IN_VIDEO)
    resampled = librosa.resample(track, orig_sr=8_000, target_sr=16_000)
    ref = _call_hf(hf, text, videos=[frames], audio=[resampled], slots=[0], fps=8 / 6)
    assert_matches_hf(arch, ours, ref)
    assert ours.mm_features[0].data["video_second_per_grid"].item() == pytest.approx(1.5)


@pytest.mark.parametrize("arch", ARCHS)
def test_video_with_its_audio_matches_hf(make_processor, hf_processor, arch: str) -> None:
    import librosa

    processor, hf = make_processor(arch), hf_processor(arch)
    frames, track = _video(6, 8), _audio(7, 8_000 * 5)  # 8 kHz: resampled like any clip
    text = _prompt(hf, ["av"])
    item = SimpleNamespace(frames=frames, fps=1.0, audio=(track, 8_000))  # a decoded VideoItem
    ours = processor.apply(text, {"video": item}, AUDIO_IN_VIDEO)
    resampled = librosa.resample(track, orig_sr=8_000, target_sr=16_000)
    ref = _call_hf(hf, text, videos=[frames], audio=[resampled], slots=[0], fps=1.0)
    assert_matches_hf(arch, ours, ref)
    (feature,) = ours.mm_features
    data, pos = feature.data, feature.mm_position
    assert data["use_audio_in_video"] is True and feature.modality == "video"
    # The range is <audio_bos> + interleaved tokens + <audio_eos>; the order function says
    # which embedding each interleaved token takes.
    span = ours.prompt_token_ids[pos.offset : pos.end]
    assert pos.is_embed == [False] + [True] * (pos.length - 2) + [False]
    order = processor.audio_in_video_order(data)
    assert order.tolist() == [token == hf.video_token_id for token in span[1:-1]]
    assert span[0] == hf.tokenizer.convert_tokens_to_ids(hf.audio_bos_token)
    assert order.tolist() != sorted(order.tolist(), reverse=True)  # truly interleaved
    module = qwen2_5 if arch == QWEN2_5 else qwen3
    assert torch.equal(module.get_audio_in_video_order(data), order)
    # The offline pair form gives the same item; a silent video stays a plain video.
    pair = processor.apply(text, {"video": [(item, (track, 8_000))]}, AUDIO_IN_VIDEO)
    assert pair.prompt_token_ids == ours.prompt_token_ids
    assert pair.mm_features[0].identifier == feature.identifier
    # So does vLLM's offline form: the track as the audio item beside its video.
    bare = SimpleNamespace(frames=frames, fps=1.0, audio=None)
    vllm_form = processor.apply(text, {"video": bare, "audio": (track, 8_000)}, AUDIO_IN_VIDEO)
    assert vllm_form.prompt_token_ids == ours.prompt_token_ids
    assert [f.identifier for f in vllm_form.mm_features] == [feature.identifier]
    with pytest.raises(MultiModalInputError, match="2 audio items for 1 videos"):
        processor.apply(text, {"video": bare, "audio": [(track, 8_000)] * 2}, AUDIO_IN_VIDEO)
    silent = processor.apply(
        text, {"video": SimpleNamespace(frames=frames, fps=1.0, audio=None)}, AUDIO_IN_VIDEO
    )
    assert "input_features" not in silent.mm_features[0].data
    assert_matches_hf(arch, silent, _call_hf(hf, text, videos=[frames], fps=1.0))
    with pytest.raises(MultiModalInputError, match="use_audio_in_video must be true or false"):
        processor.apply(text, {"video": item}, {"use_audio_in_video": "false"})


@pytest.mark.parametrize("arch", ARCHS)
def test_all_modalities_mixed_match_hf(make_processor, hf_processor, arch: str) -> None:
    processor, hf = make_processor(arch), hf_processor(arch)
    images = [_image(8, 60, 90), _image(9, 84, 56)]
    clips = [_audio(10, 9_600), _audio(11, 24_000)]  # whole frames: see the module docstring
    frames, track = _video(12, 6), _audio(13, 48_000)
    text = _prompt(hf, ["image", "audio", "av", "audio", "image"])
    mm = {
        "image": images,
        "audio": [(clip, 16_000) for clip in clips],
        "video": (frames, (track, 16_000)),
    }
    ours = processor.apply(text, mm, AUDIO_IN_VIDEO)
    ref = _call_hf(
        hf,
        text,
        images=images,
        videos=[frames],
        audio=[clips[0], track, clips[1]],
        slots=[None, 0, None],
    )
    assert_matches_hf(arch, ours, ref)
    kinds = [f.modality for f in ours.mm_features]
    assert kinds == ["image", "audio", "video", "audio", "image"]
    # usage: the video's track counts as audio, beside the two clips; the rest as video
    video = ours.mm_features[2]
    track = int((~processor.audio_in_video_order(video.data)).sum())
    clips_length = sum(f.mm_position.length for f in ours.mm_features if f.modality == "audio")
    assert ours.num_tokens_by_modality["video"] == video.mm_position.length - track > 0
    assert ours.num_tokens_by_modality["audio"] == clips_length + track


@pytest.mark.parametrize("arch", ARCHS)
def test_repeated_video_hits_the_cache_and_the_flag_splits_identity(
    make_processor, hf_processor, arch: str
) -> None:
    hf = hf_processor(arch)
    processor = make_processor(arch, cache=ProcessorCache(1 << 30))
    text = _prompt(hf, ["image", "av"])
    mm = {"image": _image(14, 56, 56), "video": (_video(15, 4), (_audio(16, 32_000), 16_000))}
    cold = make_processor(arch).apply(text, mm, AUDIO_IN_VIDEO)
    first = processor.apply(text, mm, AUDIO_IN_VIDEO)
    second = processor.apply(text, mm, AUDIO_IN_VIDEO)
    stats = processor.cache.stats()
    assert (stats.hits, stats.misses) == (2, 2)
    for run in (first, second):
        assert run.prompt_token_ids == cold.prompt_token_ids
        for ours, ref in zip(run.mm_features, cold.mm_features, strict=True):
            assert ours.identifier == ref.identifier and ours.mm_position == ref.mm_position
            assert ours.data.keys() == ref.data.keys()
            for key, value in ref.data.items():
                same = (
                    torch.equal(ours.data[key], value)
                    if torch.is_tensor(value)
                    else (ours.data[key] == value)
                )
                assert same, key
    plain = processor.apply(text, mm)
    assert plain.mm_features[1].identifier != first.mm_features[1].identifier
    assert plain.mm_features[0].identifier == first.mm_features[0].identifier  # image untouched
    assert "use_audio_in_video" not in plain.mm_features[1].data
    explicit_off = processor.apply(text, mm, {"use_audio_in_video": False})
    assert explicit_off.mm_features[1].identifier == plain.mm_features[1].identifier
    # Under the flag, kwargs shaping the track's features are part of the video's identity.
    other_audio = processor.apply(text, mm, {**AUDIO_IN_VIDEO, "sampling_rate": 16_000})
    assert other_audio.mm_features[1].identifier != first.mm_features[1].identifier


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("audio_in_video", [False, True])
def test_dummy_inputs_reach_the_analytic_max(make_processor, arch: str, audio_in_video) -> None:
    kwargs = {"mm_processor_kwargs": AUDIO_IN_VIDEO} if audio_in_video else {}
    processor = make_processor(arch, **kwargs)
    counts = {"image": 1, "video": 1, "audio": 2}
    seq_len = 4096
    bound = processor.info.get_mm_max_tokens_per_item(seq_len, counts)
    dummy = processor.get_dummy_mm_inputs(seq_len, counts)
    assert [f.modality for f in dummy.mm_features] == ["image", "video", "audio", "audio"]
    for feature in dummy.mm_features:
        assert feature.mm_position.length == bound[feature.modality], feature.modality
    video = dummy.mm_features[1].data
    assert ("use_audio_in_video" in video) == audio_in_video
    if arch == QWEN2_5:
        assert bound["audio"] == 750  # the 30 s window
    else:  # clips share the room left after the image with the video
        room = seq_len - processor.info.get_max_image_tokens()
        assert bound["audio"] == room // 3


def test_registry_builds_the_omni_processors(tiny_checkpoint) -> None:
    from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

    for arch in ARCHS:
        path = str(tiny_checkpoint(arch))
        processor = MULTIMODAL_REGISTRY.create_processor(
            ModelConfig.from_path(path), get_tokenizer(path)
        )
        assert type(processor) is CLASSES[arch][2]


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_set_only_the_declared_processor_options(make_processor, arch: str) -> None:
    """Architecture settings (n_window, merge_size) and HF call arguments (return_tensors) are
    not per-request options: they would desync the placeholder count from the encoder."""
    from omniserve.multimodal.errors import MultiModalInputError

    info = make_processor(arch).info
    info.check_request_kwargs(
        {"max_pixels": 3136, "num_frames": 4, "fps": 2, "use_audio_in_video": True}
    )
    for kwargs, phrase in (
        ({"n_window": 1}, "mm_processor_kwargs.n_window is not a per-request option"),
        ({"return_tensors": "np"}, "mm_processor_kwargs.return_tensors is not"),
        ({"max_pixels": 0}, "mm_processor_kwargs.max_pixels must be an integer in [1, "),
        ({"fps": float("nan")}, "mm_processor_kwargs.fps must be a number in"),
        ({"use_audio_in_video": "yes"}, "mm_processor_kwargs.use_audio_in_video must be true"),
        ({"min_pixels": 10**6, "max_pixels": 100}, "min_pixels (1000000) is over max_pixels (100)"),
    ):
        with pytest.raises(MultiModalInputError, match=re.escape(phrase)):
            info.check_request_kwargs(kwargs)


def test_server_kwargs_may_not_change_what_the_encoder_fixes(tiny_checkpoint: Any) -> None:
    """``--mm-processor-kwargs n_window`` (or a patch size) would desync the placeholder count
    from the encoder's output: refused at start-up, with the per-request ranges checked too."""
    from omniserve.engine.processor import Processor

    path = str(tiny_checkpoint(QWEN3))
    for kwargs, needle in [
        ({"n_window": 25}, "n_window is fixed by the checkpoint's encoder"),
        ({"patch_size": 15}, r"patch_size is fixed by the checkpoint's encoder \(16\)"),
        ({"max_pixels": -5}, "mm_processor_kwargs.max_pixels must be an integer in"),
    ]:
        config = EngineArgs(path, mm_processor_kwargs=kwargs).create_config()
        with pytest.raises(ValueError, match=needle):
            Processor(config)
    config = EngineArgs(path, mm_processor_kwargs={"max_pixels": 12544}).create_config()
    assert Processor(config).input_preprocessor.default_mm_kwargs == {"max_pixels": 12544}
    # the checkpoint's own value changes nothing, so a launch script may state it
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(path)
    same = {"patch_size": hf.image_processor.patch_size,
            "sampling_rate": hf.feature_extractor.sampling_rate}  # fmt: skip
    assert Processor(EngineArgs(path, mm_processor_kwargs=same).create_config())
