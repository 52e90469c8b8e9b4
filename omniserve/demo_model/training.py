"""Turning demo examples into transformers training batches, as the server would see them.

Media go through omniserve's own decoders (`MediaConnector`) and then the checkpoint's HF
processor with the arguments the serving processor passes (a decoded video's own frame rate,
audio-in-video as one item), so the token ids a model is trained on are the ones it is served
(`tests/test_demo_model.py` checks this for every task).
"""

from __future__ import annotations

from typing import Any

import torch

from omniserve.demo_model.tasks import (
    COLOURS,
    DIRECTIONS,
    LOUDNESS,
    MAX_BEEPS,
    MAX_SHAPES,
    PITCHES,
    POSITIONS,
    SAMPLE_RATE,
    SHAPES,
    Example,
)
from omniserve.multimodal.media import MediaConnector
from processors.qwen3_omni_audio import get_feat_extract_output_lengths

ARCHITECTURE = "Qwen3OmniMoeThinkerForConditionalGeneration"
MODEL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 128,
    "initializer_range": 0.02, "max_position_embeddings": 4096,
    "vision_config": {"hidden_size": 96, "intermediate_size": 192, "num_heads": 3,
                      "initializer_range": 0.02},
    "audio_config": {"d_model": 96, "encoder_layers": 3, "encoder_attention_heads": 3,
                     "encoder_ffn_dim": 192, "downsample_hidden_size": 32,
                     "initializer_range": 0.02},
}  # fmt: skip
"""The builder's tiny Qwen3-Omni-MoE thinker, widened enough to learn the tasks, with the usual
0.02 init (the tiny test models' large init makes random outputs peaked, which training does
not want)."""

_CONNECTOR = MediaConnector()


def init_encoders(model: torch.nn.Module) -> None:
    """Re-draw the vision and audio towers' matrices at std 1/sqrt(fan_in).

    At transformers' fixed std (0.02) the audio tower's conv stem shrinks the mel features to
    ~1e-3 against unit-scale sinusoidal position embeddings (and the vision tower's content is
    similarly buried), so both towers start out input-independent; trained so, they collapsed to
    a constant "this is audio/image" vector and the model answered from the question alone.
    Fan-in scaling keeps the content at unit scale through every layer.
    """
    towers = [model.model.audio_tower, model.model.visual]
    with torch.no_grad():
        for module in (m for tower in towers for m in tower.modules()):
            if isinstance(
                module, torch.nn.Linear | torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d
            ):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, fan_in**-0.5)
                if module.bias is not None:
                    module.bias.zero_()


PROBED_FACTS: dict[str, dict[str, tuple[Any, ...]]] = {
    "visual": {"colour": tuple(COLOURS), "shape": SHAPES,
               "count": tuple(range(1, MAX_SHAPES + 1)), "position": POSITIONS,
               "direction": DIRECTIONS},
    "audio_tower": {"beeps": tuple(range(1, MAX_BEEPS + 1)), "pitch": tuple(PITCHES),
                    "loudness": tuple(LOUDNESS)},
}  # fmt: skip
"""Tower -> the example facts its mean output is trained to predict, with their values."""


class TowerProbes(torch.nn.Module):
    """Training-only linear classifiers of each example's facts from a tower's mean output.

    Trained from scratch on the answers alone, the towers collapse to a constant "an image /
    a sound is here" vector: the decoder first learns the answers' wording from the question,
    and the little gradient that reaches the towers through it does not pull the content apart.
    A direct loss on the facts makes every tower's mean output carry them from the first steps,
    and the mean is what the decoder reads when it attends evenly to a media item's tokens.
    The heads are not part of the published model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        hidden = model.config.text_config.hidden_size
        self.heads = torch.nn.ModuleDict(
            {
                f"{tower}-{fact}": torch.nn.Linear(hidden, len(values))
                for tower, facts in PROBED_FACTS.items()
                for fact, values in facts.items()
            }
        )
        self._n_window = model.model.audio_tower.n_window
        self._merge = model.model.visual.spatial_merge_size**2
        self.pooled: dict[str, torch.Tensor] = {}
        """Tower -> its mean output per media item of the last forward, in batch order."""
        model.model.visual.register_forward_hook(self._pool_visual, with_kwargs=True)
        model.model.audio_tower.register_forward_hook(self._pool_audio, with_kwargs=True)

    def _pool_visual(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        sizes = (kwargs["grid_thw"].prod(-1) // self._merge).tolist()
        self.pooled["visual"] = _means(out.pooler_output, sizes)

    def _pool_audio(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        sizes = get_feat_extract_output_lengths(kwargs["feature_lens"], self._n_window)
        self.pooled["audio_tower"] = _means(out.last_hidden_state, sizes.tolist())

    def loss(self, facts: list[dict[str, Any]]) -> torch.Tensor | None:
        """Mean cross-entropy over the facts of the towers the last forward ran (then forgets
        them); None when it ran none."""
        losses = []
        for tower, pooled in self.pooled.items():
            if pooled.shape[0] != len(facts):
                raise ValueError(f"{tower} saw {pooled.shape[0]} items for {len(facts)} examples")
            for fact, values in PROBED_FACTS[tower].items():
                targets = torch.tensor(
                    [values.index(f[fact]) if fact in f else -100 for f in facts]
                )
                if (targets >= 0).any():
                    logits = self.heads[f"{tower}-{fact}"](pooled)
                    losses.append(torch.nn.functional.cross_entropy(logits, targets))
        self.pooled.clear()
        return torch.stack(losses).mean() if losses else None


def _means(tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.stack([part.mean(0) for part in torch.split(tokens, sizes)])


_PART_TYPES = {"image_url": "image", "video_url": "video", "input_audio": "audio"}
"""OpenAI content part -> the processor's chat-template part."""


def prompt_messages(example: Example) -> list[dict[str, Any]]:
    """`Example.messages` in the processor's chat format (media parts without their data)."""
    (message,) = example.messages()
    content = message["content"]
    if isinstance(content, str):
        return [message]
    return [
        {
            "role": "user",
            "content": [
                part if part["type"] == "text" else {"type": _PART_TYPES[part["type"]]}
                for part in content
            ],
        }
    ]


def encode(processor: Any, example: Example, *, with_answer: bool = True) -> dict[str, Any]:
    """The HF processor's tensors for one example; with the answer, `input_ids` continue with
    the answer and `<|im_end|>`, and `labels` mark those tokens alone."""
    prompt = processor.apply_chat_template(
        prompt_messages(example), add_generation_prompt=True, tokenize=False
    )
    media: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if example.image is not None:
        media["images"] = [_CONNECTOR.load_image_bytes(example.image)]
    if example.audio is not None:
        waveform, _ = _CONNECTOR.load_audio_bytes(example.audio)
        media["audio"] = [waveform]
    if example.video is not None:
        video = _CONNECTOR.load_video_bytes(example.video)
        media["videos"] = [video.frames]
        kwargs["videos_kwargs"] = {"fps": video.fps}
        if example.use_audio_in_video:
            waveform, rate = video.audio
            if rate != SAMPLE_RATE:
                raise ValueError(f"the demo videos' tracks are {SAMPLE_RATE} Hz, got {rate}")
            media["audio"] = [waveform]
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=[0])
    inputs = dict(processor(text=[prompt], return_tensors="pt", **media, **kwargs))
    if with_answer:
        tokenizer = processor.tokenizer
        answer = tokenizer(
            example.answer + "<|im_end|>", add_special_tokens=False, return_tensors="pt"
        )["input_ids"]
        prompt_ids = inputs["input_ids"]
        inputs["input_ids"] = torch.cat([prompt_ids, answer], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["labels"] = torch.cat([torch.full_like(prompt_ids, -100), answer], dim=1)
    inputs["use_audio_in_video"] = example.use_audio_in_video
    return inputs


def collate(items: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """One right-padded batch of `encode` outputs that share `use_audio_in_video`."""
    flags = {item["use_audio_in_video"] for item in items}
    if len(flags) != 1:
        raise ValueError("a batch mixes audio-in-video with plain examples")
    width = max(item["input_ids"].shape[1] for item in items)
    batch: dict[str, Any] = {
        "input_ids": _pad_cat([item["input_ids"] for item in items], width, pad_token_id),
        "attention_mask": _pad_cat([item["attention_mask"] for item in items], width, 0),
        "labels": _pad_cat([item["labels"] for item in items], width, -100),
        "use_audio_in_video": flags.pop(),
    }
    for key in (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
    ):
        parts = [item[key] for item in items if key in item]
        if parts:
            batch[key] = torch.cat(parts)
    features = [item for item in items if "input_features" in item]
    if features:
        frames = max(item["input_features"].shape[-1] for item in features)
        batch["input_features"] = torch.cat(
            [
                torch.nn.functional.pad(
                    item["input_features"], (0, frames - item["input_features"].shape[-1])
                )
                for item in features
            ]
        )
        batch["feature_attention_mask"] = _pad_cat(
            [item["feature_attention_mask"] for item in features], frames, 0
        )
    return batch


def _pad_cat(rows: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    return torch.cat(
        [torch.nn.functional.pad(row, (0, width - row.shape[1]), value=value) for row in rows]
    )
