"""Qwen3-VL on its tiny checkpoint against transformers: the builder's row, the processor's
prompts (timestamped frame groups, HF's frame rate default and a video's own rate), M-RoPE
positions against ``get_rope_index``, and what it refuses. Greedy generation against
transformers runs in test_fidelity_mm.py (plain, chunked, tiny encoder cache)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omniserve.config import ModelConfig
from omniserve.multimodal.media_io import VideoItem
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from omniserve.plugin_tools.reference import hf_processor_text
from omniserve.tokenizer import get_tokenizer
from processors.qwen3_vl import frame_group_times

ARCH = "Qwen3VLForConditionalGeneration"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}then{VIDEO}and{VIDEO}?<|im_end|>\n<|im_start|>assistant\n"


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _video(seed: int, frames: int, height: int = 64, width: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Callable[..., Path]) -> tuple[Any, Any, Any]:
    """(our processor, transformers' processor, transformers' model)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = str(tiny_checkpoint(ARCH))
    ours = MULTIMODAL_REGISTRY.create_processor(ModelConfig.from_path(path), get_tokenizer(path))
    hf = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, model


def _media() -> tuple[dict[str, Any], dict[str, Any]]:
    """The same media for us and for HF: an image, a bare 4-frame video (no rate: HF's 24 fps)
    and a decoded 5-frame video at 3 fps (an odd count: the last group repeats a frame)."""
    image, bare, decoded = _image(0, 140, 112), _video(1, 4), _video(2, 5)
    item = VideoItem(decoded, fps=3.0, source_fps=3.0, frame_indices=list(range(5)), audio=None)
    ours = {"image": [image], "video": [bare, item]}
    metadata = [
        {"total_num_frames": 4, "fps": None, "frames_indices": list(range(4))},
        {"total_num_frames": 5, "fps": 3.0, "frames_indices": list(range(5))},
    ]
    hf = {"images": [image], "videos": [bare, decoded], "video_metadata": metadata}
    return ours, hf


def test_builder_row(setup: tuple) -> None:
    _, hf, model = setup
    config = model.config
    assert config.text_config.rope_parameters["mrope_interleaved"] is True
    assert sum(config.text_config.rope_parameters["mrope_section"]) == 16  # head_dim 32 / 2
    assert config.tie_word_embeddings and len(config.vision_config.deepstack_visual_indexes) == 3
    assert type(hf.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert hf.image_processor.patch_size == config.vision_config.patch_size == 16


def test_prompt_and_tensors_match_hf(setup: tuple) -> None:
    ours, hf, _ = setup
    media, hf_media = _media()
    got = ours.apply(PROMPT, media)
    want = hf(text=[hf_processor_text(hf, PROMPT)], return_tensors="pt", **hf_media)
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    videos = [f for f in got.mm_features if f.modality == "video"]
    for key in ("pixel_values_videos", "video_grid_thw"):
        assert torch.equal(torch.cat([f.data[key] for f in videos]), want[key])
    decoded = hf.tokenizer.decode(got.prompt_token_ids)
    # Bare frames: HF's 24 fps; frames 0-1 and 2-3 average to 1/48 and 5/48 s.
    assert "<0.0 seconds><|vision_start|><|video_pad|>" in decoded
    assert "<0.1 seconds><|vision_start|>" in decoded
    # 3 fps, five frames: groups (0, 1), (2, 3), (4, 4) -> 0.17, 0.83, 1.33 s.
    assert frame_group_times(range(5), 3.0, 2) == pytest.approx([1 / 6, 5 / 6, 4 / 3])
    assert "<0.2 seconds>" in decoded and "<0.8 seconds>" in decoded and "<1.3 seconds>" in decoded
    assert f"{VIDEO[:16]}<0." not in decoded  # no group nested inside the template's markers
    for feature, want_grid in zip(videos, want["video_grid_thw"], strict=True):
        t, h, w = want_grid.tolist()
        assert feature.mm_position.num_embeds == t * h * w // 4
        assert not feature.mm_position.is_embed[0]  # a timestamp comes first
    assert got.num_tokens_by_modality["video"] == sum(f.mm_position.length for f in videos)


def test_transformers_nests_frame_groups_in_the_template_markers_before_5_25(setup: tuple) -> None:
    """Pins why the reference takes the bare pad: given the template's span, transformers 5.23
    and 5.24 keep its markers around the groups, two tokens per video more than the trained
    layout; 5.25 replaces the whole span, as Qwen's processor (and then the bare pad and the
    span give the same)."""
    import transformers
    from packaging.version import Version

    ours, hf, _ = setup
    media, hf_media = _media()
    nested = hf(text=[PROMPT], return_tensors="pt", **hf_media)["input_ids"][0].tolist()
    got = ours.apply(PROMPT, media).prompt_token_ids
    if Version(transformers.__version__) >= Version("5.25"):
        assert nested == got
        return
    assert len(nested) == len(got) + 4
    assert "<|vision_start|><0.0 seconds>" in hf.tokenizer.decode(nested)


def test_mrope_positions_match_hf_get_rope_index(setup: tuple) -> None:
    from model_zoo.qwen3_vl import Qwen3VLForConditionalGeneration

    ours, hf, model = setup
    media, hf_media = _media()
    got = ours.apply(PROMPT, media)
    want = hf(text=[hf_processor_text(hf, PROMPT)], return_tensors="pt", **hf_media)
    want_positions, want_delta = model.model.get_rope_index(
        want["input_ids"],
        want["mm_token_type_ids"],
        image_grid_thw=want["image_grid_thw"],
        video_grid_thw=want["video_grid_thw"],
    )
    positions, delta = Qwen3VLForConditionalGeneration(model.config).get_mrope_input_positions(
        got.prompt_token_ids, got.mm_features
    )
    assert positions.dtype == torch.int64
    torch.testing.assert_close(positions, want_positions[:, 0], atol=0, rtol=0)
    assert delta == int(want_delta)


def test_moe_loads_the_hubs_transposed_experts(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers saves fused experts as it keeps them ([E, 2I, H], [E, H, I]); the hub's
    Qwen3-VL-MoE checkpoints store them transposed. Both load to the same parameters, and a
    tensor of neither shape is refused naming it."""
    from safetensors.torch import load_file, save_file

    from tests.test_models_mm import load_ours

    model_dir = tiny_checkpoint("Qwen3VLMoeForConditionalGeneration")
    state = load_file(str(model_dir / "model.safetensors"))
    fused = [name for name in state if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    hub = {k: v.transpose(1, 2).contiguous() if k in fused else v for k, v in state.items()}
    save_file(hub, str(tmp_path / "model.safetensors"))
    shutil.copy(model_dir / "config.json", tmp_path)
    want = dict(load_ours(model_dir).named_parameters())
    got = dict(load_ours(tmp_path).named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        assert torch.equal(param, want[name]), name

    hub[fused[0]] = hub[fused[0]][:, :-1].contiguous()
    save_file(hub, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=fused[0].replace(".", r"\.")):
        load_ours(tmp_path)


@pytest.mark.parametrize(
    ("num_source", "num_frames", "indices", "present", "absent"),
    [(8, None, list(range(8)), "<0.1 seconds>", None),
     (60, 8, [0, 8, 17, 25, 34, 42, 51, 59], "<5.5 seconds>", "<4.9 seconds>")],
    ids=["whole", "sample"],
)  # fmt: skip
def test_chat_video_file_frames_are_placed_at_their_source_times(
    setup: tuple,
    tiny_checkpoint: Callable[..., Path],
    num_source: int,
    num_frames: int | None,
    indices: list[int],
    present: str,
    absent: str | None,
) -> None:
    """A video_url through LLM.chat, a 10 fps file whole (8 frames) or sampled to 8 of its 60
    (``np.linspace(0, 59, 8)`` rounded): each frame group's timestamp is its source frames'
    time (frames 51 and 59: 5.5 s), as transformers gives the same frames with the source's
    metadata, not index / the sample's rate (which put that group at 4.9 s); a sample is not
    sampled again; the greedy answer is transformers'."""
    from omniserve import LLM, SamplingParams
    from omniserve.multimodal.media import MediaConfig
    from omniserve.multimodal.media_io import decode_video
    from tests.test_api_multimodal import _data_url
    from tests.test_media import _video as _mp4

    _, hf, model = setup
    data = _mp4(num_frames=num_source, audio_rate=None)
    llm = LLM(str(tiny_checkpoint(ARCH)), dtype="float32", kv_cache_memory=64 << 20)
    part = {"type": "video_url", "video_url": {"url": _data_url("video/mp4", data)}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "When?"}]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    kwargs = {"num_frames": num_frames} if num_frames else None
    (out,) = llm.chat(messages, greedy, use_tqdm=False, mm_processor_kwargs=kwargs)
    text = hf.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "When?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    budget = MediaConfig().video_budget
    frames = decode_video(data, num_frames=num_frames, fps=None, budget=budget).frames
    metadata = [{"total_num_frames": num_source, "fps": 10.0, "frames_indices": indices}]
    want = hf(
        text=[hf_processor_text(hf, text)],
        videos=[frames],
        video_metadata=metadata,
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert out.prompt_token_ids == want["input_ids"][0].tolist()
    decoded = hf.tokenizer.decode(out.prompt_token_ids)
    assert present in decoded and (absent is None or absent not in decoded)
    reference = model.generate(**want, max_new_tokens=6, do_sample=False)
    assert list(out.outputs[0].token_ids) == reference[0, want["input_ids"].shape[1] :].tolist()


def test_hf_frame_sampling_runs_on_whole_videos_only(setup: tuple) -> None:
    """Under the published checkpoints' ``do_sample_frames=True``, HF samples frames given
    whole (a bare array), but a sample decoded from a longer file goes in as it is, in its own
    HF call, whatever order the items come in (its indices count source frames)."""
    ours, hf, _ = setup
    sample = VideoItem(
        _video(3, 8), fps=8 / 6, source_fps=10.0, frame_indices=[0, 8, 17, 25, 34, 42, 51, 59],
        audio=None, num_source_frames=60,
    )  # fmt: skip
    bare = _video(4, 12)
    prompt = f"<|im_start|>user\n{VIDEO}and{VIDEO}?<|im_end|>\n<|im_start|>assistant\n"
    processors = (ours.info.get_hf_processor().video_processor, hf.video_processor)
    for processor in processors:
        processor.do_sample_frames = True
    try:
        got = ours.apply(prompt, {"video": [bare, sample]})
        whole = hf.video_processor([bare], return_metadata=True, return_tensors="pt")
        sampled = hf.video_processor(
            [sample.frames],
            video_metadata=[
                {"total_num_frames": 60, "fps": 10.0, "frames_indices": sample.frame_indices}
            ],
            do_sample_frames=False,
            return_tensors="pt",
        )
    finally:
        for processor in processors:
            processor.do_sample_frames = False
    first, second = (f.data for f in got.mm_features)
    assert whole["video_grid_thw"][0, 0] < 6  # HF sampled the bare array (24 fps assumed)
    assert torch.equal(first["video_grid_thw"], whole["video_grid_thw"])
    assert torch.equal(first["pixel_values_videos"], whole["pixel_values_videos"])
    assert torch.equal(second["video_grid_thw"], sampled["video_grid_thw"])
    assert second["video_grid_thw"][0, 0] == 4  # all 8 frames kept
    assert torch.equal(second["pixel_values_videos"], sampled["pixel_values_videos"])
    assert "<5.5 seconds>" in hf.tokenizer.decode(got.prompt_token_ids)
