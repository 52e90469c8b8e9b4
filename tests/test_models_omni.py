"""Qwen2.5-Omni and Qwen3-Omni-MoE thinkers against transformers on their tiny checkpoints (fp32).

Inputs come from each checkpoint's own HF processor; the test cuts its outputs into one feature per
item (an audio-in-video video carries its audio track), then checks encoder embeddings, M-RoPE
positions and logits (a chunked prefill through the paged cache, cut through an image, then two
decode steps at ``p + delta``) against HF, and that full-model checkpoints load the thinker only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor
from transformers import Qwen2_5OmniThinkerForConditionalGeneration as HFQwen25Thinker
from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as HFQwen3Thinker
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerTextRotaryEmbedding,
)

from omniserve.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from tests.test_models_mm import (
    ATOL,
    PagedRunner,
    check_prefill_and_decode,
    encode,
    load_ours,
    mm_window,
)

QWEN2_5 = "Qwen2_5OmniThinkerForConditionalGeneration"
QWEN3 = "Qwen3OmniMoeThinkerForConditionalGeneration"
HF_CLASSES = {QWEN2_5: HFQwen25Thinker, QWEN3: HFQwen3Thinker}
FULL_MODELS = {
    QWEN2_5: ("Qwen2_5OmniForConditionalGeneration", "token2wav"),
    QWEN3: ("Qwen3OmniMoeForConditionalGeneration", "code2wav"),
}
# Item kinds of a prompt, in order: "image", "video", "audio", or "av" (a video with its audio).
PROMPTS = {
    "image": ["image"],
    "video": ["video"],
    "audio": ["audio", "audio"],
    "av": ["av"],
    "mixed": ["image", "audio", "video", "image"],
    "mixed_av": ["image", "av", "audio", "av"],
}


class Omni:
    """One thinker checkpoint: our model, HF's model and processor, and prompt building."""

    def __init__(self, arch: str, model_dir: Path) -> None:
        self.arch = arch
        self.ours = load_ours(model_dir)
        self.hf = HF_CLASSES[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.config = self.hf.config
        tok = self.processor.tokenizer
        self.markers = {
            "image": f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}",
            "video": f"{tok.vision_bos_token}{tok.video_token}{tok.vision_eos_token}",
            "audio": f"{tok.audio_bos_token}{tok.audio_token}{tok.audio_eos_token}",
        }

    def inputs(
        self,
        kinds: list[str],
        fps: float = 1.0,
        seed: int = 0,
        clips: tuple[float, ...] = (1.0, 0.44),
    ) -> dict[str, Any]:
        """HF processor outputs for a prompt with one item per kind, each between text; audio
        clips take the durations ``clips`` in turn (a video's track lasts 3 s)."""
        rng = np.random.default_rng(seed)
        text, media = "<|im_start|>user\n", {"images": [], "videos": [], "audio": []}
        slots: list[int | None] = []
        for kind in kinds:
            text += self.markers["video" if kind == "av" else kind] + " and"
            if kind == "image":
                size = (112, 168, 3) if len(media["images"]) % 2 == 0 else (64, 96, 3)
                media["images"].append(rng.integers(0, 256, size, dtype=np.uint8))
            elif kind in ("video", "av"):
                frames = 8 if kind == "av" else 4
                media["videos"].append(rng.integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8))
            if kind in ("audio", "av"):
                seconds = 3.0 if kind == "av" else clips[slots.count(None) % len(clips)]
                media["audio"].append(rng.standard_normal(int(16000 * seconds)).astype(np.float32))
                slots.append(len(media["videos"]) - 1 if kind == "av" else None)
        text += " say<|im_end|>\n<|im_start|>assistant\n"
        kwargs: dict[str, Any] = {k: v for k, v in media.items() if v}
        if media["videos"]:
            # small frames (the HF omni processors default to at least 128 tokens per frame)
            unit = (
                self.processor.video_processor.patch_size
                * self.config.vision_config.spatial_merge_size
            )
            size = {"shortest_edge": 4 * unit**2, "longest_edge": 16 * unit**2}
            kwargs["videos_kwargs"] = {"fps": fps, "size": size}
        if "av" in kinds:
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
        inputs = dict(self.processor(text=[text], return_tensors="pt", **kwargs))
        inputs["use_audio_in_video"] = "av" in kinds
        return inputs

    def features(
        self, inputs: dict[str, Any], with_markers: bool = False
    ) -> list[MultiModalFeatureSpec]:
        """One feature per item in prompt order. ``with_markers``: an audio-in-video range also
        covers its inner start/end markers (``is_embed`` False there), as the omniserve processor
        records it; otherwise ranges hold embedding tokens only."""
        ids = inputs["input_ids"][0].tolist()
        cfg = self.config
        starts = {cfg.vision_start_token_id, cfg.audio_start_token_id}
        ends = {cfg.vision_end_token_id, cfg.audio_end_token_id}
        pad = {
            cfg.image_token_id: "image",
            cfg.video_token_id: "video",
            cfg.audio_token_id: "audio",
        }
        count = {"image": 0, "video": 0, "audio": 0}
        features, i = [], 0
        while i < len(ids):
            if ids[i] not in starts:
                i += 1
                continue
            while ids[i] in starts:  # an audio-in-video item opens with two markers
                i += 1
            end = i
            while ids[end] not in ends:
                end += 1
            kinds = {pad[t] for t in ids[i:end]}
            modality = "image" if kinds == {"image"} else "video" if "video" in kinds else "audio"
            data = self._item_data(inputs, modality, count, with_audio=kinds == {"video", "audio"})
            if data.get("use_audio_in_video"):
                data["audio_in_video"] = self._audio_in_video_params(data)
            position = PlaceholderRange(i, end - i)
            if with_markers and data.get("use_audio_in_video"):
                position = PlaceholderRange(i - 1, end - i + 2, [False, *[True] * (end - i), False])
            identifier = f"{modality}{len(features)}"
            features.append(MultiModalFeatureSpec(modality, identifier, position, data))
            i = end
        return features

    def _audio_in_video_params(self, data: dict[str, Any]) -> dict[str, float | int]:
        """The layout parameters the omniserve processor stores on an audio-in-video item."""
        return {
            "seconds_per_grid": float(data["video_second_per_grid"]),
            "position_id_per_seconds": float(self.config.position_id_per_seconds),
            "seconds_per_chunk": float(getattr(self.config, "seconds_per_chunk", 2)),
            "merge_size": self.config.vision_config.spatial_merge_size,
            "n_window": self.config.audio_config.n_window,
        }

    @staticmethod
    def _item_data(inputs: dict, modality: str, count: dict, with_audio: bool) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if modality in ("image", "video"):
            rows_key, grid_key = (
                ("pixel_values", "image_grid_thw")
                if modality == "image"
                else ("pixel_values_videos", "video_grid_thw")
            )
            grids, k = inputs[grid_key], count[modality]
            first = int(grids[:k].prod(-1).sum())
            data[rows_key] = inputs[rows_key][first : first + int(grids[k].prod())]
            data[grid_key] = grids[k]
            if modality == "video":
                data["video_second_per_grid"] = inputs["video_second_per_grid"][k]
                data["use_audio_in_video"] = with_audio
            count[modality] += 1
        if modality == "audio" or with_audio:
            k = count["audio"]
            data["input_features"] = inputs["input_features"][k]
            data["feature_attention_mask"] = inputs["feature_attention_mask"][k]
            count["audio"] += 1
        return data

    def hf_prefill(self, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """HF's prefill output and the merged inputs_embeds it gave its language model."""
        captured: list[torch.Tensor] = []
        hook = self.hf.model.language_model.register_forward_pre_hook(
            lambda _m, _a, kwargs: captured.append(kwargs["inputs_embeds"]), with_kwargs=True
        )
        try:
            with torch.no_grad():
                out = self.hf(**inputs, use_cache=True)
        finally:
            hook.remove()
        return out, captured[0][0]

    def hf_positions(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        mask = inputs.get("feature_attention_mask")
        positions, delta = self.hf.model.get_rope_index(
            inputs["input_ids"],
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            inputs["attention_mask"],
            inputs["use_audio_in_video"],
            None if mask is None else mask.sum(-1),
            inputs.get("video_second_per_grid"),
        )
        return positions[:, 0], delta[0, 0]


@pytest.fixture(scope="module", params=[QWEN2_5, QWEN3])
def omni(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Omni:
    return Omni(request.param, tiny_checkpoint(request.param))


def _main(embeds: torch.Tensor, hidden: int) -> torch.Tensor:
    return embeds[:, :hidden]  # Qwen3-Omni rows carry their DeepStack levels after the main part


def test_embeddings_match_hf_features(omni: Omni) -> None:
    """Each item's embeddings equal HF's for that item alone, whatever else the call encodes.

    The 0.44 s clip is shorter than one audio chunk: Qwen3-Omni's tower convolves chunk padding,
    so HF's embeddings of such a clip change when its batch holds a longer clip; omniserve
    encodes it as HF does alone (items are cached per item).
    """
    inputs = omni.inputs(["image", "audio", "video", "image", "audio"])
    features = omni.features(inputs)
    embeds = encode(omni.ours, features)
    hidden = omni.config.text_config.hidden_size
    model = omni.hf.model
    with torch.no_grad():
        images = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        videos = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        audio = [
            model.get_audio_features(
                inputs["input_features"][i : i + 1], inputs["feature_attention_mask"][i : i + 1]
            ).last_hidden_state
            for i in range(len(inputs["input_features"]))
        ]
    by_modality = {"image": list(images.pooler_output), "video": list(videos.pooler_output)}
    by_modality["audio"] = audio
    for feature, got in zip(features, embeds, strict=True):
        want = by_modality[feature.modality].pop(0)
        torch.testing.assert_close(_main(got, hidden), want, atol=ATOL, rtol=0)
        assert got.shape[0] == feature.mm_position.length
    if omni.arch == QWEN3:  # DeepStack levels follow the main embedding; zeros for audio
        rows = {
            m: torch.cat([e for f, e in zip(features, embeds, strict=True) if f.modality == m])
            for m in by_modality
        }
        for modality, out in (("image", images), ("video", videos)):
            levels = torch.cat([torch.cat(level) for level in out.deepstack_features], dim=-1)
            torch.testing.assert_close(rows[modality][:, hidden:], levels, atol=ATOL, rtol=0)
        assert not rows["audio"][:, hidden:].any()
    # batching items of a call does not change any item's embeddings
    with torch.no_grad():
        alone = [omni.ours.get_multimodal_embeddings(f.modality, [f.data])[0] for f in features]
    for got, want in zip(alone, embeds, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("prompt", "fps"),  # at 3 fps a frame group spans 2/3 s: fractional temporal steps
    [
        ("image", 1.0),
        ("video", 1.0),
        ("video", 3.0),
        ("audio", 1.0),
        ("av", 1.0),
        ("av", 3.0),
        ("av", 8.0),  # the whole video in the first chunk, the track in two
        ("mixed", 1.0),
        ("mixed_av", 3.0),
        ("text", 1.0),
    ],
)
def test_mrope_positions_match_hf_get_rope_index(omni: Omni, prompt: str, fps: float) -> None:
    inputs = omni.inputs(PROMPTS.get(prompt, []), fps=fps)
    want, want_delta = omni.hf_positions(inputs)
    ids = inputs["input_ids"][0].tolist()
    got, delta = omni.ours.get_mrope_input_positions(ids, omni.features(inputs))
    with_markers = omni.ours.get_mrope_input_positions(ids, omni.features(inputs, True))
    torch.testing.assert_close(with_markers[0], got, atol=0, rtol=0)
    assert got.shape == (3, len(ids))
    # Qwen2.5-Omni floors the temporal steps (int64); Qwen3-Omni keeps fractions (float32 then)
    assert got.dtype == torch.int64 or (omni.arch == QWEN3 and got.dtype == torch.float32)
    torch.testing.assert_close(got.to(want.dtype), want, atol=0, rtol=0)
    assert delta == want_delta.item()


@pytest.mark.parametrize("prompt", ["mixed", "mixed_av"])
def test_prefill_and_decode_match_hf(omni: Omni, prompt: str) -> None:
    """Prefill in two chunks cut through the middle of the first image (or audio-in-video item),
    so DeepStack rows are split between steps, then two decode steps."""
    # clips of at least one audio chunk, so HF's batched audio encoding is per-item exact
    inputs = omni.inputs(PROMPTS[prompt], fps=1.0, seed=1, clips=(1.5,))
    features = omni.features(inputs)
    cut = next(f for f in features if f.modality == ("image" if prompt == "mixed" else "video"))
    split = cut.mm_position.offset + cut.mm_position.length // 2
    check_prefill_and_decode(omni.ours, omni.hf, inputs, features, split)


def test_deepstack_rows_are_added_and_handed_over_once(omni: Omni) -> None:
    """DeepStack changes the logits (so the HF match above tests it), and its rows reach only
    the forward right after get_input_embeddings."""
    if omni.arch != QWEN3:
        pytest.skip("Qwen2.5-Omni has no DeepStack")
    inputs = omni.inputs(["image"])
    ids, features = inputs["input_ids"][0].tolist(), omni.features(inputs)
    positions, _ = omni.ours.get_mrope_input_positions(ids, features)
    (embeds,) = encode(omni.ours, features)
    hidden = omni.config.text_config.hidden_size
    window = (0, len(ids))
    flat = torch.cat([embeds[:, :hidden], torch.zeros_like(embeds[:, hidden:])], dim=-1)
    with_levels, without = (
        PagedRunner(omni.ours).step(ids, positions, *mm_window(features, [rows], *window))
        for rows in (embeds, flat)
    )
    assert (with_levels - without).abs().max() > 1e-2
    ours = omni.ours
    merged = ours.get_input_embeddings(torch.tensor(ids), *mm_window(features, [embeds], *window))
    with pytest.raises(RuntimeError, match="right before forward"):
        ours(None, positions[:, :-1], inputs_embeds=merged[:-1])
    assert ours._deepstack is None  # consumed even by a failed forward


def test_interleaved_mrope_matches_hf() -> None:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTextConfig,
    )

    from model_zoo.qwen2_5_omni_thinker import thinker_rope
    from omniserve.layers.rotary_embedding import InterleavedMRotaryEmbedding

    config = Qwen3OmniMoeTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]},
    )
    rope = thinker_rope(config, [24, 20, 20], InterleavedMRotaryEmbedding)
    positions = torch.randint(0, 5000, (3, 17), generator=torch.Generator().manual_seed(0))
    want_cos, want_sin = Qwen3OmniMoeThinkerTextRotaryEmbedding(config)(
        torch.zeros(1), positions[:, None, :]
    )
    for got, want in zip(rope(positions, torch.float32), (want_cos[0], want_sin[0]), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_placeholder_strings_match_the_chat_templates(omni: Omni) -> None:
    cls = type(omni.ours)
    for modality in ("image", "video", "audio"):
        assert cls.get_placeholder_str(modality, 2) == omni.markers[modality]
    assert cls.supports_multimodal and cls.uses_mrope
    with pytest.raises(ValueError, match="image, video and audio"):
        cls.get_placeholder_str("tactile", 0)


def _write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, path / "model.safetensors")
    return path


@pytest.mark.parametrize("arch", [QWEN2_5, QWEN3])
def test_full_model_checkpoint_loads_the_thinker_only(
    arch: str,
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    full_arch, vocoder = FULL_MODELS[arch]
    full_dir, thinker_dir = tiny_checkpoint(full_arch), tiny_checkpoint(arch)
    state = load_file(full_dir / "model.safetensors")
    assert {name.split(".")[0] for name in state} == {"thinker", "talker", vocoder}
    # A full model speaks: it loads the speech half, unless audio output is off
    # (transformers' enable_audio_output, which --disable-audio-output sets).
    assert {"talker", vocoder} <= {
        n.split(".")[0] for n, _ in load_ours(full_dir).named_parameters()
    }
    config = json.loads((full_dir / "config.json").read_text())
    full_dir = _write_checkpoint(
        tmp_path / "silent", {**config, "enable_audio_output": False}, state
    )
    with caplog.at_level(logging.INFO, logger="model_zoo.qwen2_5_omni_thinker"):
        full = load_ours(full_dir)
    for submodel in ("talker", vocoder):  # named and counted in the log, not skipped silently
        assert re.search(rf"skipped the speech sub-models \(.*{submodel}: \d+ tensors", caplog.text)
    assert type(full).__name__ == full_arch
    # the full row wraps the thinker checkpoint of the same seed: same config, same weights
    thinker = dict(load_ours(thinker_dir).named_parameters())
    for name, param in full.named_parameters():
        assert torch.equal(param, thinker[name]), name
    # keys outside the thinker are skipped only for the named speech sub-models ...
    config = json.loads((full_dir / "config.json").read_text())
    extra = _write_checkpoint(tmp_path / "extra", config, {**state, "vocoder.w": torch.ones(1)})
    with pytest.raises(ValueError, match=r"match no parameter.*vocoder\.w"):
        load_ours(extra)
    # ... and only for the full-model architectures
    thinker_state = load_file(thinker_dir / "model.safetensors")
    thinker_config = json.loads((thinker_dir / "config.json").read_text())
    talker = {**thinker_state, "talker.w": torch.ones(1)}
    with pytest.raises(ValueError, match=r"match no parameter.*talker\.w"):
        load_ours(_write_checkpoint(tmp_path / "talker", thinker_config, talker))


def test_loads_transformers_module_layout(omni: Omni, tmp_path: Path) -> None:
    """HF's in-memory names (``model.language_model.*``, ``model.audio_tower.*``, ...) load as
    the hub layout. Qwen3-Omni is left out: its in-memory experts are fused tensors, while its
    checkpoints (hub and ``save_pretrained``) store one tensor per expert."""
    if omni.arch == QWEN3:
        pytest.skip("fused in-memory experts are not a checkpoint layout")
    state = {k: v.contiguous() for k, v in omni.hf.state_dict().items()}
    assert any(name.startswith("model.audio_tower.") for name in state)
    config = omni.config.to_dict()
    loaded = load_ours(_write_checkpoint(tmp_path / "module_layout", config, state))
    want = dict(omni.ours.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, want[name]), name
