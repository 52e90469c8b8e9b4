"""Omni checkpoints from the builder: thinkers with their processors, and full speech models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from omniserve.checkpoint_builder import build_tiny_checkpoint

THINKER_OF = {
    "Qwen2_5OmniForConditionalGeneration": "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration": "Qwen3OmniMoeThinkerForConditionalGeneration",
}
OMNI_ARCHS = [*THINKER_OF.values(), *THINKER_OF]
# Config key -> token, and the processor's attribute for the same token, per thinker.
OMNI_TOKENS = {
    "Qwen2_5OmniThinkerForConditionalGeneration": {
        "image_token_id": ("<|IMAGE|>", "image_token"),
        "video_token_id": ("<|VIDEO|>", "video_token"),
        "audio_token_id": ("<|AUDIO|>", "audio_token"),
        "vision_start_token_id": ("<|vision_bos|>", "vision_bos_token"),
        "vision_end_token_id": ("<|vision_eos|>", "vision_eos_token"),
        "audio_start_token_id": ("<|audio_bos|>", "audio_bos_token"),
        "audio_end_token_id": ("<|audio_eos|>", "audio_eos_token"),
    },
    "Qwen3OmniMoeThinkerForConditionalGeneration": {
        "image_token_id": ("<|image_pad|>", "image_token"),
        "video_token_id": ("<|video_pad|>", "video_token"),
        "audio_token_id": ("<|audio_pad|>", "audio_token"),
        "vision_start_token_id": ("<|vision_start|>", "vision_bos_token"),
        "vision_end_token_id": ("<|vision_end|>", "vision_eos_token"),
        "audio_start_token_id": ("<|audio_start|>", "audio_bos_token"),
        "audio_end_token_id": ("<|audio_end|>", "audio_eos_token"),
    },
}
# Tokens for 1 s, 30 s and 45 s of audio: Qwen2.5-Omni pads or cuts to 30 s, Qwen3-Omni does not.
AUDIO_TOKENS = {
    "Qwen2_5OmniThinkerForConditionalGeneration": (25, 750, 750),
    "Qwen3OmniMoeThinkerForConditionalGeneration": (13, 390, 585),
}


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tone(freq: float, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)  # [num_samples]


def _greedy(model: torch.nn.Module, inputs: dict, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _prompt(processor, *parts: str) -> str:
    content = [{"type": part} for part in parts] + [{"type": "text", "text": "What is it?"}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _check_config(arch: str, config, processor) -> None:
    tokenizer = processor.tokenizer
    for key, (token, attribute) in OMNI_TOKENS[arch].items():
        assert getattr(config, key) == tokenizer.convert_tokens_to_ids(token)
        assert getattr(processor, attribute) == token
    text, vision, audio = config.text_config, config.vision_config, config.audio_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert vision.out_hidden_size == audio.output_dim == text.hidden_size
    assert processor.image_processor.patch_size == vision.patch_size
    assert processor.video_processor.merge_size == vision.spatial_merge_size
    assert processor.feature_extractor.feature_size == audio.num_mel_bins == 128
    assert config.initializer_range == text.initializer_range  # lm_head init follows the text
    if arch.startswith("Qwen3"):
        assert (text.num_experts, text.num_experts_per_tok) == (8, 2)
        assert vision.deepstack_visual_indexes == [1, 2, 3] and vision.depth == 4
        assert (audio.n_window, config.position_id_per_seconds) == (processor.n_window, 13)
    else:
        assert (audio.n_window, config.position_id_per_seconds) == (100, 25)


@pytest.mark.parametrize("arch", list(OMNI_TOKENS))
def test_omni_thinker_processes_every_modality_offline(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, info = getattr(transformers, arch).from_pretrained(path, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == arch.replace("ThinkerForConditionalGeneration", "Processor")
    config = model.config
    _check_config(arch, config, processor)

    image_prompt, audio_prompt = _prompt(processor, "image"), _prompt(processor, "audio")
    bos, eos = processor.vision_bos_token, processor.vision_eos_token
    assert f"{bos}{processor.image_token}{eos}What is it?" in image_prompt
    images = [
        processor(text=[image_prompt], images=[_image(s)], return_tensors="pt") for s in (0, 1)
    ]
    assert images[0]["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert (images[0]["input_ids"] == config.image_token_id).sum() == 16
    assert _greedy(model, images[0]) != _greedy(model, images[1])  # the model looks

    one_s, thirty_s, long = AUDIO_TOKENS[arch]
    for seconds, num_tokens in ((30, thirty_s), (45, long)):
        inputs = processor(text=[audio_prompt], audio=[_tone(300, seconds)], return_tensors="pt")
        assert (inputs["input_ids"] == config.audio_token_id).sum() == num_tokens
    audios = [
        processor(text=[audio_prompt], audio=[_tone(f)], return_tensors="pt") for f in (220, 880)
    ]
    assert (audios[0]["input_ids"] == config.audio_token_id).sum() == one_s
    assert _greedy(model, audios[0]) != _greedy(model, audios[1])  # ... and listens

    frames = np.random.default_rng(4).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    video_prompt = _prompt(processor, "video")
    inputs = processor(text=[video_prompt], videos=[frames], return_tensors="pt")
    grid = inputs["video_grid_thw"][0].tolist()
    assert grid[0] == 2 and (inputs["input_ids"] == config.video_token_id).sum() == 280
    assert len(_greedy(model, inputs)) == 6

    # A video with its audio track: one interleaved span inside the video's vision markers.
    inputs = processor(
        text=[video_prompt], videos=[frames], audio=[_tone(500, 2.0)], audio_from_video_indices=[0],
        load_audio_from_video=True, return_tensors="pt",
    )  # fmt: skip
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(config.audio_start_token_id)
    assert (
        ids[start - 1] == config.vision_start_token_id and ids[start + 1] == config.video_token_id
    )
    assert ids.count(config.video_token_id) == 280 and ids.count(config.audio_token_id) == 2 * one_s
    assert ids[ids.index(config.audio_end_token_id) + 1] == config.vision_end_token_id
    assert len(_greedy(model, inputs, use_audio_in_video=True)) == 6


@pytest.mark.parametrize("arch", list(THINKER_OF))
def test_full_omni_checkpoint_wraps_the_same_thinker(tiny_checkpoint, arch):
    path, thinker_path = tiny_checkpoint(arch), tiny_checkpoint(THINKER_OF[arch])
    weights = load_file(path / "model.safetensors")
    thinker = load_file(thinker_path / "model.safetensors")
    vocoder = "token2wav" if arch.startswith("Qwen2_5") else "code2wav"
    assert {name.split(".")[0] for name in weights} == {"thinker", "talker", vocoder}
    thinker_part = {k[8:]: v for k, v in weights.items() if k.startswith("thinker.")}
    assert thinker_part.keys() == thinker.keys()
    assert all(torch.equal(thinker_part[name], value) for name, value in thinker.items())

    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [arch]
    thinker_config = AutoConfig.from_pretrained(thinker_path)
    for key in ("text_config", "vision_config", "audio_config", "audio_token_id", "image_token_id"):
        # NOTE: to_dict() differs in bookkeeping (sub-config dtype, _name_or_path), not in shapes.
        values = [getattr(c, key) for c in (config.thinker_config, thinker_config)]
        values = [{**v.to_dict(), "dtype": None} if hasattr(v, "to_dict") else v for v in values]
        assert values[0] == values[1]
    assert config.talker_config.audio_token_id == thinker_config.audio_token_id
    processor = AutoProcessor.from_pretrained(path)
    thinker_vocab = AutoTokenizer.from_pretrained(thinker_path).get_vocab()
    assert processor.tokenizer.get_vocab() == thinker_vocab
    model = getattr(transformers, arch).from_pretrained(path)  # Qwen2.5-Omni reads spk_dict.pt
    assert type(model.thinker).__name__ == THINKER_OF[arch]
    # Talker and vocoder configs are consistent enough for transformers to speak: text -> waveform.
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    torch.manual_seed(0)
    with torch.no_grad():
        text_ids, waveform = model.generate(
            **processor(text=[prompt], return_tensors="pt"),
            thinker_max_new_tokens=4,
            talker_max_new_tokens=8,
        )
    assert text_ids.shape[0] == 1 and waveform.numel() > 1000


@pytest.mark.parametrize("arch", list(THINKER_OF))
def test_full_omni_speech_half_reacts_to_its_inputs(tiny_checkpoint, arch):
    """The vocoder hears its codes (a change of half of them moves the waveform by a visible
    share of its spread, nothing clipped, causal for Qwen3's code2wav) and a greedy talker
    speaks (its first code is never end-of-speech)."""
    model = getattr(transformers, arch).from_pretrained(tiny_checkpoint(arch))
    generator = torch.Generator().manual_seed(3)
    if arch.startswith("Qwen3"):
        codec = model.config.code2wav_config
        codes = torch.randint(
            0, codec.codebook_size, (1, codec.num_quantizers, 20), generator=generator
        )
        changed = codes.clone()
        changed[..., 10:] = (changed[..., 10:] + 1) % codec.codebook_size

        def speak(c: torch.Tensor) -> torch.Tensor:
            return model.code2wav(c)
    else:
        speaker = next(iter(torch.load(tiny_checkpoint(arch) / "spk_dict.pt").values()))
        codes = torch.randint(0, 100, (1, 20), generator=generator)
        changed = codes.clone()
        changed[..., 10:] += 1

        def speak(c: torch.Tensor) -> torch.Tensor:
            torch.manual_seed(0)  # the DiT starts from noise: the same for both
            return model.token2wav(
                c, conditioning=speaker["cond"].float(), reference_mel=speaker["ref_mel"].float()
            )

    with torch.no_grad():
        wave, other = speak(codes), speak(changed)
    assert 0.05 < float(wave.std()) < 0.5 and float((wave.abs() >= 0.999).float().mean()) < 0.01
    assert float((wave - other).std()) > 0.1 * float(wave.std())
    if arch.startswith("Qwen3"):  # causal: the first half's samples do not hear the second
        head = wave.shape[-1] // 3
        assert torch.equal(wave[..., :head], other[..., :head])
    processor = AutoProcessor.from_pretrained(tiny_checkpoint(arch))
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    with torch.no_grad():
        _, waveform = model.generate(
            **processor(text=[prompt], return_tensors="pt"),
            thinker_max_new_tokens=4,
            talker_max_new_tokens=6,
            talker_do_sample=False,
        )
    assert waveform.numel() > 1000


def test_omni_tokenizers_keep_the_qwen_ids(tiny_checkpoint):
    qwen = AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    for arch, extra in (
        ("Qwen2_5OmniThinkerForConditionalGeneration", ["<|vision_bos|>", "<|vision_eos|>"]),
        ("Qwen3OmniMoeThinkerForConditionalGeneration", ["<|tts_pad|>", "<|tts_text_bos|>"]),
    ):
        omni = AutoTokenizer.from_pretrained(tiny_checkpoint(arch))
        assert qwen.get_vocab().items() <= omni.get_vocab().items()
        assert all(omni.convert_tokens_to_ids(token) >= len(qwen) for token in extra)


def test_omni_build_is_deterministic(tmp_path: Path):
    arch = "Qwen3OmniMoeForConditionalGeneration"
    first = build_tiny_checkpoint(arch, tmp_path / "a")
    second = build_tiny_checkpoint(arch, tmp_path / "b")
    for name in ("model.safetensors", "config.json", "processor_config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
