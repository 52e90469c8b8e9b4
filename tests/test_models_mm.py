"""Qwen2-VL, Qwen2.5-VL and Qwen2-Audio against transformers on their tiny checkpoints (fp32).

Inputs come from each checkpoint's own HF processor; the test cuts its outputs into per-item
features the way the omniserve processor does (one item's tensors, placeholder range from the
expanded pad tokens), then checks encoder embeddings, M-RoPE positions and logits (a chunked
prefill through the paged cache, then decode steps at ``p + delta``) against HF.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from transformers import Qwen2AudioForConditionalGeneration as HFQwen2Audio
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.video_utils import VideoMetadata

import model_zoo
from omniserve.attention import AttentionMetadata, get_attention_layers
from omniserve.cpu.backend import apply_cpu_backend
from omniserve.cpu.norm_rope import CpuRMSNorm
from omniserve.forward_context import set_forward_context
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.rotary_embedding import MRotaryEmbedding, get_rope
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omniserve.registry import ModelRegistry
from omniserve.worker.model_loader import load_model_weights

VL_ARCHS = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]
AUDIO_ARCH = "Qwen2AudioForConditionalGeneration"
BLOCK_SIZE = 4
ATOL = 1e-4
VL_PROMPT = (
    "<|im_start|>user\nLook <|vision_start|><|image_pad|><|vision_end|> and "
    "<|vision_start|><|image_pad|><|vision_end|> then <|vision_start|><|video_pad|><|vision_end|>"
    " and say<|im_end|>\n<|im_start|>assistant\n"
)
AUDIO_PROMPT = (
    "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "What is it?"
)
# modality -> (pad token attribute of the config, per-item keys cut by rows, per-item grid key)
VISION_FIELDS = {
    "image": ("image_token_id", "pixel_values", "image_grid_thw"),
    "video": ("video_token_id", "pixel_values_videos", "video_grid_thw"),
}


def _rng_media(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "images": [
            rng.integers(0, 256, (112, 168, 3), dtype=np.uint8),  # 8x12 patches, 2 windows wide
            rng.integers(0, 256, (56, 84, 3), dtype=np.uint8),  # 4x6 patches
        ],
        "videos": [rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)],  # grid (2, 4, 4)
        "audio": [
            (rng.standard_normal(16000) * 0.1).astype(np.float32),  # 1 s -> 25 embeddings
            (rng.standard_normal(7000) * 0.1).astype(np.float32),
        ],
    }


def _runs(ids: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``token_id`` in ``ids``."""
    hits = (ids == token_id).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for i in hits:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(offset, length) for offset, length in runs]


def vision_features(inputs: dict, config: Any) -> list[MultiModalFeatureSpec]:
    """Cut an HF Qwen-VL processor output into one feature per image / video, in prompt order."""
    ids = inputs["input_ids"][0]
    features = []
    for modality, (token_attr, rows_key, grid_key) in VISION_FIELDS.items():
        if grid_key not in inputs:
            continue
        grids = inputs[grid_key]
        rows = inputs[rows_key].split(grids.prod(-1).tolist())
        runs = _runs(ids, getattr(config, token_attr))
        assert len(runs) == len(grids)
        for i, (offset, length) in enumerate(runs):
            data = {rows_key: rows[i], grid_key: grids[i]}
            if modality == "video" and "second_per_grid_ts" in inputs:
                data["second_per_grid_ts"] = inputs["second_per_grid_ts"][i]
            position = PlaceholderRange(offset, length)
            features.append(MultiModalFeatureSpec(modality, f"{modality}{i}", position, data))
    return sorted(features, key=lambda f: f.mm_position.offset)


def audio_features(inputs: dict, config: Any) -> list[MultiModalFeatureSpec]:
    runs = _runs(inputs["input_ids"][0], config.audio_token_id)
    return [
        MultiModalFeatureSpec(
            "audio",
            f"audio{i}",
            PlaceholderRange(offset, length),
            {
                "input_features": inputs["input_features"][i],
                "feature_attention_mask": inputs["feature_attention_mask"][i],
            },
        )
        for i, (offset, length) in enumerate(runs)
    ]


class PagedRunner:
    """One request through the paged cache, with merged embeddings and the given positions."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 96) -> None:
        self.model = model
        for layer in get_attention_layers(model):
            layer.kv_cache = torch.zeros(
                2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size
            )
        self.free_blocks = list(reversed(range(1, num_blocks)))
        self.blocks: list[int] = []
        self.num_computed = 0

    @torch.no_grad()
    def step(
        self,
        token_ids: list[int],
        positions: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        start, end = self.num_computed, self.num_computed + len(token_ids)
        while len(self.blocks) * BLOCK_SIZE < end:  # scrambled, never contiguous
            self.blocks.append(self.free_blocks.pop(len(self.free_blocks) // 2))
        slots = [
            self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
        ]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, len(token_ids)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_table=torch.tensor([self.blocks], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens_cpu=[len(token_ids)],
            seq_lens_cpu=[end],
        )
        self.num_computed = end
        embeds = self.model.get_input_embeddings(torch.tensor(token_ids), mm_embeds, is_mm)
        with set_forward_context(metadata):
            hidden = self.model(None, positions, inputs_embeds=embeds)
        return self.model.compute_logits(hidden)  # [num_tokens, vocab]


def load_ours(model_dir: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    model_zoo.register()
    model = ModelRegistry.resolve_model_cls(config.architectures[0])(config)
    load_model_weights(model, model_dir)
    return model.eval()


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> tuple:
    model_dir = tiny_checkpoint(request.param)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_ours(model_dir), hf, AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def audio(tiny_checkpoint: Callable[..., Path]) -> tuple:
    model_dir = tiny_checkpoint(AUDIO_ARCH)
    hf = HFQwen2Audio.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_ours(model_dir), hf, AutoProcessor.from_pretrained(model_dir)


def vl_inputs(processor: Any, prompt: str, fps: float | None = None, seed: int = 0) -> dict:
    """Media for each pad token of ``prompt``; ``fps`` sets the video's frame rate."""
    media = _rng_media(seed)
    num_images, num_videos = prompt.count("<|image_pad|>"), prompt.count("<|video_pad|>")
    kwargs: dict[str, Any] = {}
    if num_images:
        kwargs["images"] = media["images"][:num_images]
    if num_videos:
        kwargs["videos"] = media["videos"][:num_videos]
        if fps is not None:
            kwargs["videos_kwargs"] = {
                "video_metadata": [VideoMetadata(total_num_frames=4, fps=fps)]
            }
    return dict(processor(text=[prompt], return_tensors="pt", **kwargs))


def encode(model: torch.nn.Module, features: list[MultiModalFeatureSpec]) -> list[torch.Tensor]:
    """Each feature's embeddings, items batched per modality as the runner does."""
    out: dict[str, torch.Tensor] = {}
    for modality in {f.modality for f in features}:
        items = [f for f in features if f.modality == modality]
        with torch.no_grad():
            embeds = model.get_multimodal_embeddings(modality, [f.data for f in items])
        out.update({f.identifier: e for f, e in zip(items, embeds, strict=True)})
    return [out[f.identifier] for f in features]


def mm_window(
    features: list[MultiModalFeatureSpec], embeds: list[torch.Tensor], start: int, end: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The embeddings prompt positions [start, end) consume and the mask of their rows."""
    is_mm = torch.zeros(end - start, dtype=torch.bool)
    pieces = []
    for feature, item_embeds in zip(features, embeds, strict=True):
        pos = feature.mm_position
        lo, hi = pos.embeds_in(start, end)
        if hi > lo:
            pieces.append(item_embeds[lo:hi])
            is_mm[max(pos.offset, start) - start : min(pos.end, end) - start] = True
    return (torch.cat(pieces), is_mm) if pieces else (None, None)


def hf_prefill(hf: torch.nn.Module, inputs: dict) -> tuple[Any, torch.Tensor]:
    """HF's prefill output and the merged inputs_embeds it gave its language model."""
    captured: list[torch.Tensor] = []
    hook = hf.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kwargs: captured.append(kwargs["inputs_embeds"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            out = hf(**inputs, use_cache=True)
    finally:
        hook.remove()
    return out, captured[0][0]


def check_prefill_and_decode(ours: Any, hf: Any, inputs: dict, features: list, split: int) -> None:
    """Prefill in two chunks cut at ``split``, then two greedy decode steps, all equal to HF."""
    ids = inputs["input_ids"][0].tolist()
    if ours.uses_mrope:
        positions, delta = ours.get_mrope_input_positions(ids, features)
    else:
        positions, delta = torch.arange(len(ids)), 0
    embeds = encode(ours, features)
    out, hf_embeds = hf_prefill(hf, inputs)
    merged = ours.get_input_embeddings(torch.tensor(ids), *mm_window(features, embeds, 0, len(ids)))
    torch.testing.assert_close(merged, hf_embeds, atol=ATOL, rtol=0)
    runner = PagedRunner(ours)
    logits = [
        runner.step(ids[a:b], positions[..., a:b], *mm_window(features, embeds, a, b))
        for a, b in ((0, split), (split, len(ids)))
    ]
    torch.testing.assert_close(torch.cat(logits), out.logits[0], atol=ATOL, rtol=0)
    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    for p in range(len(ids), len(ids) + 2):
        position = torch.full((3, 1), p + delta) if ours.uses_mrope else torch.tensor([p])
        got = runner.step([token], position)[0]
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(got, out.logits[0, -1], atol=ATOL, rtol=0)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_vision_embeddings_match_hf(vl: tuple) -> None:
    ours, hf, processor = vl
    inputs = vl_inputs(processor, VL_PROMPT)
    features = vision_features(inputs, hf.config)
    images = [f.data for f in features if f.modality == "image"]
    videos = [f.data for f in features if f.modality == "video"]
    with torch.no_grad():
        hf_images = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        hf_videos = hf.model.get_video_features(
            inputs["pixel_values_videos"], inputs["video_grid_thw"]
        )
        got_images = ours.get_multimodal_embeddings("image", images)
        got_videos = ours.get_multimodal_embeddings("video", videos)
        second_alone = ours.get_multimodal_embeddings("image", images[1:])
    for got, want in zip(
        got_images + got_videos, [*hf_images.pooler_output, *hf_videos.pooler_output], strict=True
    ):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert [e.shape[0] for e in got_images] == [24, 6]
    # batching items in one forward does not change any item's embeddings
    torch.testing.assert_close(second_alone[0], got_images[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("prompt", "fps"),
    [
        (VL_PROMPT, None),  # two images of different sizes, a video, text after
        ("<|vision_start|><|video_pad|><|vision_end|> then", 1.0),  # 2 s per frame pair
        ("<|image_pad|><|vision_end|>x<|vision_start|><|video_pad|><|vision_end|>", 0.5),
        ("no media at all", None),
    ],
)
def test_mrope_positions_match_hf_get_rope_index(vl: tuple, prompt: str, fps: float) -> None:
    ours, hf, processor = vl
    inputs = vl_inputs(processor, prompt, fps=fps)
    rope_kwargs = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    if "second_per_grid_ts" in inputs:
        rope_kwargs["second_per_grid_ts"] = inputs["second_per_grid_ts"]
    want, want_delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], **rope_kwargs
    )
    ids = inputs["input_ids"][0].tolist()
    got, delta = ours.get_mrope_input_positions(ids, vision_features(inputs, hf.config))
    assert got.dtype == torch.int64 and got.shape == (3, len(ids))
    torch.testing.assert_close(got, want[:, 0], atol=0, rtol=0)
    assert delta == int(want_delta)


def test_vl_prefill_and_decode_match_hf(vl: tuple) -> None:
    ours, hf, processor = vl
    inputs = vl_inputs(processor, VL_PROMPT, fps=1.0)
    features = vision_features(inputs, hf.config)
    first = features[0].mm_position
    check_prefill_and_decode(ours, hf, inputs, features, split=first.offset + first.length // 2)


def test_audio_embeddings_follow_hf_lengths(audio: tuple) -> None:
    ours, hf, processor = audio
    media = _rng_media(0)["audio"]
    inputs = dict(processor(text=[AUDIO_PROMPT], audio=media, return_tensors="pt"))
    features = audio_features(inputs, hf.config)
    embeds = encode(ours, features)
    # 1 s = 100 frames -> 50 after the stride-2 conv -> 25 after pooling; 7000 samples -> 11
    assert [e.shape[0] for e in embeds] == [f.mm_position.length for f in features] == [25, 11]
    with torch.no_grad():
        alone = ours.get_multimodal_embeddings("audio", [features[1].data])
    torch.testing.assert_close(alone[0], embeds[1], atol=1e-5, rtol=0)


def test_audio_prefill_and_decode_match_hf(audio: tuple) -> None:
    ours, hf, processor = audio
    inputs = dict(processor(text=[AUDIO_PROMPT], audio=_rng_media(1)["audio"], return_tensors="pt"))
    features = audio_features(inputs, hf.config)
    first = features[0].mm_position
    check_prefill_and_decode(ours, hf, inputs, features, split=first.offset + 7)


def test_placeholder_strings_and_flags() -> None:
    model_zoo.register()
    vl_cls = ModelRegistry.resolve_model_cls("Qwen2_5_VLForConditionalGeneration")
    audio_cls = ModelRegistry.resolve_model_cls(AUDIO_ARCH)
    assert vl_cls.get_placeholder_str("image", 0) == "<|vision_start|><|image_pad|><|vision_end|>"
    assert vl_cls.get_placeholder_str("video", 3) == "<|vision_start|><|video_pad|><|vision_end|>"
    assert (
        audio_cls.get_placeholder_str("audio", 1) == "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>"
    )
    assert vl_cls.supports_multimodal and vl_cls.uses_mrope
    assert audio_cls.supports_multimodal and not audio_cls.uses_mrope
    with pytest.raises(ValueError, match="audio"):
        vl_cls.get_placeholder_str("audio", 0)


def test_mrotary_embedding_matches_hf() -> None:
    config = Qwen2VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    rope = get_rope(config, 128)
    assert isinstance(rope, MRotaryEmbedding)
    positions = torch.randint(0, 5000, (3, 17), generator=torch.Generator().manual_seed(0))
    cos, sin = rope(positions, torch.float32)
    want_cos, want_sin = Qwen2VLRotaryEmbedding(config)(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(cos, want_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, want_sin[0], atol=0, rtol=0)
    # 1-D (text-only) positions are the case of three equal rows
    for got, want in zip(
        rope(positions[0], torch.float32),
        rope(positions[0].expand(3, -1), torch.float32),
        strict=True,
    ):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("arch", [*VL_ARCHS, AUDIO_ARCH])
def test_loads_transformers_module_layout(
    arch: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_checkpoint(arch)
    from_hub_layout = load_ours(model_dir)
    hf_cls = HFQwen2Audio if arch == AUDIO_ARCH else AutoModelForImageTextToText
    state = hf_cls.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert any(name.startswith("model.language_model.") for name in state)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    shutil.copy(model_dir / "config.json", tmp_path)
    from_module_layout = load_ours(tmp_path)
    want = dict(from_hub_layout.named_parameters())
    got = dict(from_module_layout.named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        assert torch.equal(param, want[name]), name


def _write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, path / "model.safetensors")
    return path


def test_loading_names_unexpected_and_missing_keys(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_checkpoint("Qwen2VLForConditionalGeneration")
    config = json.loads((model_dir / "config.json").read_text())
    state = load_file(model_dir / "model.safetensors")
    extra = _write_checkpoint(
        tmp_path / "extra", config, {**state, "visual.extra.w": torch.ones(1)}
    )
    with pytest.raises(ValueError, match=r"match no parameter.*visual\.extra\.w"):
        load_ours(extra)
    partial = {k: v for k, v in state.items() if k != "visual.merger.mlp.0.bias"}
    missing = _write_checkpoint(tmp_path / "missing", config, partial)
    with pytest.raises(ValueError, match=r"not \(fully\) loaded.*visual\.merger\.mlp\.0\.bias"):
        load_ours(missing)
    # Tied (as Qwen2-VL-2B): the composite config decides, and lm_head.weight is not stored.
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    tied = load_ours(
        _write_checkpoint(tmp_path / "tied", {**config, "tie_word_embeddings": True}, untied)
    )
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize(
    "arch", ["Qwen2_5_VLForConditionalGeneration", "Qwen2_5OmniThinkerForConditionalGeneration"]
)
def test_qwen2_5_vision_norms_are_ours(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """Qwen2.5's vision tower norms are our RMSNorm on the checkpoint's parameters (it loads
    with no key left over or missing), so the CPU backend gives them its bf16 kernel."""
    model = load_ours(tiny_checkpoint(arch)).to(torch.bfloat16)
    norms = [m for m in model.visual.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * model.config.vision_config.depth + 1  # two per block, the merger's
    assert not [m for m in model.visual.modules() if type(m).__name__.endswith("RMSNorm")
                and not isinstance(m, RMSNorm)]  # fmt: skip
    apply_cpu_backend(model, torch.bfloat16)
    assert all(norm.kernel is not None for norm in norms) == CpuRMSNorm.supports(norms[0])
